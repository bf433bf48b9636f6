"""The plugin's fixes to fairseq's training across processes, each on its own (in-process, fast):
torchrun's variables on CPU, gloo without GPUs, bounded collective waits, DistributedDataParallel
on CPU, fully sharded data parallel refused in one line, whole checkpoint copies, the checkpoint
state sent between processes as data, the data position across process counts, the launcher's
stopping of its processes and the one-line report of a lost process. The runs they make possible
are in test_multi_process_training.py."""

import io
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils
from omegaconf import OmegaConf
from torch.distributed import distributed_c10d

from kerple_fairseq.errors import KernelConfigError
from kerple_fairseq.experiments import recipe
from kerple_fairseq.experiments.recipe import free_port
from kerple_fairseq.training import distributed, install_training_fixes, resume
from kerple_fairseq.training.distributed import lost_peer

from conftest import REPO, run


def training_cfg(*flags):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["/nonexistent-data", "--user-dir", str(REPO / "kerple_fairseq"),
                                                "--task", "language_modeling", "--arch", "transformer_lm_kerple",
                                                "--cpu", *flags])
    return convert_namespace_to_omegaconf(args)


def test_the_fixes_are_installed_once_by_importing_the_plugin():
    import kerple_fairseq  # noqa: F401
    from fairseq import checkpoint_utils
    from fairseq.data.iterators import EpochBatchIterator
    from fairseq.models import distributed_fairseq_model

    for fixed in (distributed_utils.call_main, distributed_utils.distributed_init,
                  distributed_utils._broadcast_object_slow, EpochBatchIterator.state_dict,
                  EpochBatchIterator.load_state_dict):
        assert getattr(fixed, "kerple_fairseq", False), fixed
    assert checkpoint_utils.PathManager is resume.WholeCheckpointCopies
    assert distributed_fairseq_model.DistributedDataParallel is distributed.DeviceAwareDistributedDataParallel
    before = distributed_utils.call_main, EpochBatchIterator.state_dict
    install_training_fixes()
    assert (distributed_utils.call_main, EpochBatchIterator.state_dict) == before, "nothing is wrapped twice"


def test_torchrun_variables_place_a_cpu_process(monkeypatch):
    cfg = training_cfg()
    assert cfg.distributed_training.distributed_world_size == 1  # fairseq's default on CPU: why it trained alone
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "3",
                        "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    distributed.place_torchrun_process(cfg)
    training = cfg.distributed_training
    assert (training.distributed_init_method, training.distributed_world_size, training.distributed_rank,
            training.device_id, training.distributed_no_spawn) == ("env://", 4, 3, 0, True)
    # where fairseq's own inference divides by the number of GPUs
    with pytest.raises(ZeroDivisionError):
        distributed_utils._infer_torch_distributed_launch_init(training_cfg("--distributed-world-size", "4")
                                                               .distributed_training)


def test_an_explicit_init_method_or_a_single_process_is_left_alone(monkeypatch):
    for name, value in {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "1", "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    cfg = training_cfg()
    distributed.place_torchrun_process(cfg)
    assert cfg.distributed_training.distributed_init_method is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = training_cfg("--distributed-init-method", "tcp://h:1", "--distributed-world-size", "2")
    distributed.place_torchrun_process(cfg)
    assert cfg.distributed_training.distributed_init_method == "tcp://h:1"


def test_processes_without_gpus_use_gloo():
    cfg = training_cfg("--distributed-world-size", "2")
    assert cfg.distributed_training.distributed_backend == "nccl"
    distributed.gloo_without_gpus(cfg)
    assert cfg.distributed_training.distributed_backend == "gloo"


#: the only places fairseq and the plugin name either DDP backend other than in a comparison of both
NAMED_ALONE = {
    ("fairseq/dataclass/constants.py", '"c10d",  # alias for pytorch_ddp'),  # the choices
    ("fairseq/dataclass/constants.py", '"pytorch_ddp",'),
    ("fairseq/dataclass/configs.py", 'default="pytorch_ddp", metadata={"help": "DistributedDataParallel backend"}'),
    ("kerple_fairseq/training/distributed.py", '"NCCL" in str(error) or "c10d" in str(error)'),  # an error's text
}


def test_c10d_is_trained_as_pytorch_ddp_is():
    """``--ddp-backend c10d``, a choice users type, runs what ``pytorch_ddp`` (trained in
    test_multi_process_training.py) runs: every other place fairseq, its commands, the plugin, its core and
    its scripts name either backend is a test for both."""
    import fairseq
    import fairseq_cli
    import kerple_core
    import kerple_fairseq

    folders = [Path(package.__file__).parent for package in (fairseq, fairseq_cli, kerple_fairseq, kerple_core)]
    named = {(path.relative_to(folder.parent).as_posix(), line.strip())
             for folder in [*folders, Path(__file__).parents[1] / "scripts"] for path in folder.rglob("*.py")
             for line in path.read_text().splitlines() if re.search(r"[\"'](c10d|pytorch_ddp)[\"']", line)}
    compared = {place for place in named - NAMED_ALONE if 'in {"c10d", "pytorch_ddp"}' in place[1]}
    assert named - NAMED_ALONE == compared and {path for path, _ in compared} == {
        "fairseq/criterions/adaptive_loss.py", "fairseq/models/distributed_fairseq_model.py"}, named - NAMED_ALONE


@pytest.mark.parametrize("flags, message", [
    (["--ddp-backend", "fully_sharded"], "--ddp-backend fully_sharded runs on CUDA GPUs only"),
])
def test_fully_sharded_without_gpus_is_refused(flags, message):
    with pytest.raises(KernelConfigError, match=message):
        distributed.check_fully_sharded(training_cfg(*flags))
    distributed.check_fully_sharded(training_cfg("--ddp-backend", "legacy_ddp"))


def test_fully_sharded_without_fairscale_is_refused(monkeypatch):
    monkeypatch.setattr(distributed, "uses_gpus", lambda cfg: True)
    monkeypatch.setitem(sys.modules, "fairscale", None)  # not importable
    with pytest.raises(KernelConfigError, match="needs fairscale: pip install fairscale==0.4.13"):
        distributed.check_fully_sharded(training_cfg("--ddp-backend", "fully_sharded"))


def test_heartbeat_timeout_bounds_every_later_process_group(monkeypatch):
    monkeypatch.setattr(distributed_c10d, "default_pg_timeout", distributed_c10d.default_pg_timeout)
    monkeypatch.setattr(distributed_c10d, "default_pg_nccl_timeout", distributed_c10d.default_pg_nccl_timeout)
    seen = []
    init = distributed._distributed_init(lambda cfg: seen.append(
        distributed_c10d._get_default_timeout(dist.Backend.GLOO)) or 0)
    init(training_cfg())
    assert seen == [timedelta(minutes=30)], "without --heartbeat-timeout torch's default stays"
    init(training_cfg("--heartbeat-timeout", "42"))
    assert seen[-1] == timedelta(seconds=42)
    assert distributed_c10d._get_default_timeout(dist.Backend.NCCL) == timedelta(seconds=42)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_distributed_data_parallel_of_a_cpu_model_ignores_fairseqs_gpu_index(one_process_group):
    module = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="device_ids and output_device arguments only work"):
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2), device_ids=[0], output_device=0)
    wrapped = distributed.DeviceAwareDistributedDataParallel(module, device_ids=[0], output_device=0)
    assert wrapped.device_ids is None
    torch.testing.assert_close(wrapped(torch.ones(1, 3)), module(torch.ones(1, 3)))


def test_checkpoint_state_is_sent_between_processes_as_data(one_process_group):
    """What fairseq's process 0 sends the others on resuming: read weights-only on arrival."""
    cfg = OmegaConf.create({"model": {"arch": "transformer_lm_kerple"}, "optimization": {"lr": [0.1]}})
    state = {"cfg": cfg, "model": {"w": torch.arange(3.0)}, "extra_state": {"train_iterator": {"epoch": 1}}}
    tensors = []
    split = distributed_utils._split_tensors_from_obj(state, tensors)
    # fairseq's own form is refused by a weights-only read
    buffer = io.BytesIO()
    torch.save(split, buffer)
    buffer.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(buffer, weights_only=True)
    sent = resume.as_data(split)
    buffer = io.BytesIO()
    torch.save(sent, buffer)
    buffer.seek(0)
    received = resume.with_placeholders(torch.load(buffer, weights_only=True))
    assert received["cfg"] == {"model": {"arch": "transformer_lm_kerple"}, "optimization": {"lr": [0.1]}}
    assert received["model"]["w"] == distributed_utils._TensorPlaceholder(index=0)
    rebuilt = distributed_utils._put_tensors_in_obj(received, tensors)
    assert torch.equal(rebuilt["model"]["w"], torch.arange(3.0))
    # through fairseq's broadcast (one process: the sender's own object comes back unchanged)
    assert distributed_utils.broadcast_object(state, src_rank=0, group=one_process_group)["cfg"] is cfg


def test_a_copy_killed_halfway_leaves_the_destination_whole(tmp_path, monkeypatch):
    source, destination = tmp_path / "checkpoint_1_8.pt", tmp_path / "checkpoint_last.pt"
    source.write_bytes(b"new" * 1000)
    destination.write_bytes(b"old checkpoint")

    def dies_halfway(src, dst, *args, **kwargs):
        with open(src, "rb") as s, open(dst, "wb") as d:
            d.write(s.read()[:1500])
        raise KeyboardInterrupt  # the process ends here

    monkeypatch.setattr(shutil, "copyfile", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        resume.WholeCheckpointCopies.copy(str(source), str(destination), overwrite=True)
    assert destination.read_bytes() == b"old checkpoint"
    monkeypatch.undo()
    assert resume.WholeCheckpointCopies.copy(str(source), str(destination), overwrite=True)
    assert destination.read_bytes() == source.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_1_8.pt", "checkpoint_last.pt"]


@pytest.mark.parametrize("saved, processes, position", [
    ({"num_shards": 2, "iterations_in_epoch": 10}, 1, 20),
    ({"num_shards": 1, "iterations_in_epoch": 20}, 4, 5),
    ({"num_shards": 8, "iterations_in_epoch": 3}, 8, 3),
    ({"iterations_in_epoch": 7}, 2, 7),  # saved without the plugin: as fairseq reads it
    ({"num_shards": 2, "iterations_in_epoch": 0}, 3, 0),
])
def test_the_data_position_is_counted_for_the_resuming_processes(saved, processes, position):
    state = {"version": 2, "epoch": 3, "shuffle": True, **saved}
    assert resume.position_for(state, processes)["iterations_in_epoch"] == position


def test_a_position_the_processes_cannot_share_is_refused():
    with pytest.raises(KernelConfigError, match="cannot resume on 2 processes: the checkpoint stopped after 3 "
                                                "batches of epoch 1 .1 processes.*--reset-dataloader"):
        resume.position_for({"epoch": 1, "num_shards": 1, "iterations_in_epoch": 3}, 2)


@pytest.mark.parametrize("message, lost", [
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
     "[127.0.0.1]:7600. This is typically caused by a remote worker crashing.", "Connection closed by peer [127.0.0.1]:7600"),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation "
     "to complete", "Timed out waiting 8000ms for recv operation to complete"),
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for "
     "600000 milliseconds before timing out.", "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
     "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out"),
    ("CUDA out of memory", None),
    ("mat1 and mat2 shapes cannot be multiplied", None),
])
def test_a_collectives_report_of_a_lost_process_is_recognised(message, lost):
    assert lost_peer(RuntimeError(message)) == lost


def test_the_report_of_a_lost_process_is_one_line(tmp_path):
    program = ("import kerple_fairseq, torch.distributed as d\n"
               "try:\n    raise RuntimeError('[gloo/pair.cc:1] Connection reset by peer [10.0.0.2]:1. More.')\n"
               "except RuntimeError:\n    raise KeyboardInterrupt  # fairseq's heartbeat, arriving meanwhile\n")
    proc = run([sys.executable, "-c", program], check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "kerple_fairseq: error: another process of this training run died or stopped answering (Connection reset "
        "by peer [10.0.0.2]:1); stopping. The same command resumes from checkpoint_last.pt in --save-dir"]


def sleeper(seconds, status=0, ignore_term=False):
    code = ("import signal, sys, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + f"time.sleep({seconds})\nsys.exit({status})\n")
    return [sys.executable, "-c", code]


def test_the_launcher_stops_its_other_processes_when_one_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(recipe, "STOP_GRACE_SECONDS", 2)
    said = []
    started = time.monotonic()
    status = recipe.run_all([sleeper(60), sleeper(0.5, status=3), sleeper(60, ignore_term=True)], first_rank=4,
                            log_dir=tmp_path, say=said.append)
    elapsed = time.monotonic() - started
    assert status == 3 and elapsed < 10, elapsed
    assert said == [f"train-wikitext-103: the process of rank 5 exited with status 3 (its log: {tmp_path / 'rank5.log'}); "
                    "stopping this machine's other processes"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank5.log", "rank6.log"]
    assert recipe.how_it_ended(-9) == "was killed by SIGKILL"
    assert recipe.run_all([sleeper(0), sleeper(0)], log_dir=tmp_path, say=said.append) == 0


def test_a_stopped_launcher_stops_its_processes(tmp_path):
    program = ("import sys; sys.path.insert(0, %r)\nfrom kerple_fairseq.experiments import recipe\n"
               "sys.exit(recipe.run_all([%r, %r], log_dir=__import__('pathlib').Path(%r)))\n"
               % (str(REPO), sleeper(60), sleeper(60), str(tmp_path)))
    launcher = subprocess.Popen([sys.executable, "-c", program], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # the launcher imports torch and fairseq first
    children = []
    while len(children) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
        children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 2
    launcher.terminate()
    assert launcher.wait(timeout=30) == 128 + 15
    assert "train-wikitext-103: stopped by SIGTERM" in launcher.stderr.read()
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_the_script_launches_cpu_machines_and_torchrun(tmp_path):
    (tmp_path / "dict.txt").write_text("a 1\n")
    script = [sys.executable, REPO / "scripts" / "train_wikitext_103.py", "kerple_log", "--tiny", "--data", tmp_path,
              "--save-dir", tmp_path / "x", "--dry-run"]
    lines = run([*script, "--cpu-processes", "2", "--nodes", "3", "--node-rank", "2", "--master", "n0:29500"]
                ).stdout.strip().splitlines()
    assert len(lines) == 2
    for line, rank in zip(lines, (4, 5)):
        assert (f"--cpu --distributed-world-size 6 --distributed-rank {rank} --distributed-init-method tcp://n0:29500 "
                "--distributed-no-spawn --distributed-backend gloo --ddp-backend legacy_ddp") in line
        assert "--update-freq 1 " in line and "--heartbeat-timeout 600" in line
    line, = run([*script, "--cpu-processes", "1", "--nodes", "2", "--node-rank", "1", "--master", "n0:29500",
                 "--torchrun"]).stdout.strip().splitlines()
    assert line.startswith(f"{sys.executable.rsplit('/', 1)[0]}/torchrun --nnodes 2 --nproc-per-node 1 --node-rank 1 "
                           f"--master-addr n0 --master-port 29500 {sys.executable.rsplit('/', 1)[0]}/fairseq-train ")
    assert line.endswith("--cpu --distributed-backend gloo --ddp-backend legacy_ddp")
    assert "--distributed-rank" not in line and "--update-freq 1 " in line
    proc = run([*script, "--nodes", "2", "--node-rank", "2", "--master", "n0:1"], check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == \
        "train-wikitext-103: error: --node-rank 2 is not one of the 2 machines' 0..1"
    assert not (tmp_path / "x").exists()
