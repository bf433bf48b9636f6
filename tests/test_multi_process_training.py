"""Training across processes and machines as users launch it, on gloo CPU processes: two machines
(two launches of scripts/train-wikitext-103.sh, with and without torchrun), fairseq's data-parallel
backends and activation checkpointing, a process killed or hung mid-run, a kill during a checkpoint
write, and resuming on another number of processes. Each equality prints its largest parameter
difference; the fault tests print the time from the fault to the launchers' exit and their messages."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kerple_fairseq.experiments.recipe import STOP_GRACE_SECONDS, free_port

from conftest import REPO, run

SCRIPT = REPO / "scripts" / "train_wikitext_103.py"
UPDATES = 4
LONG_UPDATES = 12  # the fault tests: checkpoints every 4 updates
KERNEL_PARAMETER = "decoder.attention_bias.kernel.r1"
# float32 rounding: the order of sums differs between one process and several, and torchrun gives
# each of several processes one thread (OMP_NUM_THREADS=1); a batch taken twice or a gradient left
# out moves parameters by more than 1e-3 in these runs
TOLERANCE = 1e-5


def script_args(data_bin, save_dir, updates, *flags, model="kerple_log"):
    return [sys.executable, SCRIPT, model, "--tiny", "--data", data_bin, "--save-dir", save_dir,
            "--max-update", str(updates), "--dropout", "0", "--log-format", "json", "--log-interval", "1",
            "--disable-validation", *flags]


def train(data_bin, save_dir, updates, *flags, check=True, env=None):
    return run(script_args(data_bin, save_dir, updates, *flags), check=check, env=env)


def launch(data_bin, save_dir, updates, *flags, name, env=None):
    """The training script started in the background, its output in ``<save_dir>-<name>.log``."""
    log = save_dir.parent / f"{save_dir.name}-{name}.log"
    proc = subprocess.Popen([str(a) for a in script_args(data_bin, save_dir, updates, *flags)], cwd=REPO,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    proc._log = log
    return proc


def finish(*procs, timeout=600):
    """Wait for every launch; the output of each, failing with it if one failed."""
    texts = []
    for proc in procs:
        proc.wait(timeout=timeout)
        texts.append(open(proc._log).read())
    for proc, text in zip(procs, texts):
        assert proc.returncode == 0, f"{proc._log.name} failed ({proc.returncode}):\n{text[-6000:]}"
    return texts


def parameters(save_dir):
    """The run's checkpoint_last.pt, read as data."""
    return torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)


def largest_difference(a, b, label) -> float:
    """The largest absolute difference between two checkpoints' parameters (printed)."""
    a, b = a["model"], b["model"]
    assert a.keys() == b.keys()
    difference = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"{label}: largest parameter difference {difference:.3g}")
    return difference


def two_machines(data_bin, save_dir, updates, *flags, name, master=None):
    """Launches of the training script as on two machines of one process each: node 0, node 1."""
    master = master or f"127.0.0.1:{free_port()}"
    return [launch(data_bin, save_dir, updates, "--cpu-processes", "1", "--nodes", "2", "--node-rank", str(rank),
                   "--master", master, *flags, name=f"{name}-node{rank}") for rank in (0, 1)]


@pytest.fixture(scope="module")
def one_process(data_bin, tmp_path_factory):
    """One process accumulating 2 batches per update (--update-freq 2): the reference."""
    save_dir = tmp_path_factory.mktemp("one-process")
    proc = train(data_bin, save_dir, UPDATES, "--cpu-processes", "1")
    assert "1 CPU worker(s), --update-freq 2: 2048 tokens per update" in proc.stderr
    return parameters(save_dir)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [[], ["--torchrun"]], ids=["one-process-per-rank", "torchrun"])
def test_two_machines_equal_one_process_with_update_freq_2(data_bin, tmp_path, one_process, launcher):
    master = f"127.0.0.1:{free_port()}"
    save_dir = tmp_path / "two-machines"
    texts = finish(*two_machines(data_bin, save_dir, UPDATES, *launcher, name="run", master=master))
    assert all("2 CPU worker(s), --update-freq 1: 2048 tokens per update" in text for text in texts)
    init = "env://" if launcher else f"tcp://{master}"
    assert f"distributed init (rank 0): {init}" in texts[0]
    trained = parameters(save_dir)
    assert largest_difference(trained, one_process, f"two machines ({launcher or 'processes'}) vs one process") <= TOLERANCE
    assert trained["extra_state"]["train_iterator"]["num_shards"] == 2
    # learnable kernel parameters took part
    assert not torch.equal(trained["model"][KERNEL_PARAMETER], torch.tensor([1.0, 1.0, 1.0, 1.0]))


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    ["--cpu-processes", "2"],
    ["--cpu-processes", "2", "--ddp-backend", "pytorch_ddp"],
    ["--cpu-processes", "2", "--torchrun"],
    ["--cpu-processes", "1", "--checkpoint-activations"],
    ["--cpu-processes", "1", "--checkpoint-activations", "--offload-activations"],
], ids=["legacy_ddp", "pytorch_ddp", "torchrun-one-machine", "checkpoint-activations", "offload-activations"])
def test_data_parallel_backends_and_activation_checkpointing_give_the_same_model(data_bin, tmp_path, one_process,
                                                                                  flags):
    train(data_bin, tmp_path, UPDATES, *flags)
    assert largest_difference(parameters(tmp_path), one_process, " ".join(flags)) <= TOLERANCE


@pytest.mark.slow
def test_fully_sharded_data_parallel_on_cpu_is_one_line(data_bin, tmp_path):
    proc = train(data_bin, tmp_path, UPDATES, "--cpu-processes", "2", "--ddp-backend", "fully_sharded", check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert "kerple_fairseq: error: --ddp-backend fully_sharded runs on CUDA GPUs only" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, errors
    assert not (tmp_path / "checkpoint_last.pt").exists()


@pytest.fixture(scope="module")
def uninterrupted(data_bin, tmp_path_factory):
    """Two processes, 12 updates, a checkpoint every 4."""
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    train(data_bin, save_dir, LONG_UPDATES, "--cpu-processes", "2", "--save-interval-updates", "4")
    return parameters(save_dir)


def wait_for(path, proc, seconds=300):
    deadline = time.monotonic() + seconds
    while not path.is_file():
        assert proc.poll() is None, open(proc._log).read()[-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def rank_process(save_dir, rank) -> int:
    """The pid of the fairseq-train process of ``rank`` writing to ``save_dir``."""
    found = rank_processes(save_dir, rank)
    assert len(found) == 1, found
    return found[0]


def rank_processes(save_dir, rank=None):
    """The pids of the fairseq-train processes writing to ``save_dir`` (of ``rank`` if given)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode().split("\0")
        except OSError:  # ended meanwhile
            continue
        ranks = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--distributed-rank"]
        if any(arg.endswith("fairseq-train") for arg in args[:2]) and str(save_dir) in args and \
                (rank is None or ranks == [str(rank)]):
            found.append(int(cmdline.parent.name))
    return found


def messages(proc):
    """The one-line messages of the plugin and of the launcher in a launch's output."""
    return [line for line in open(proc._log).read().splitlines()
            if "kerple_fairseq: error:" in line or line.startswith("train-wikitext-103: ")]


@pytest.mark.slow
@pytest.mark.parametrize("fault, timeout", [(signal.SIGKILL, 600), (signal.SIGSTOP, 10)], ids=["killed", "hung"])
def test_a_lost_machine_stops_the_run_in_bounded_time_and_the_same_commands_resume(data_bin, tmp_path, uninterrupted,
                                                                                   fault, timeout):
    """Node 1's process killed (its connections close) or hung (a machine that stopped answering)
    after the first checkpoint: node 0 stops within the heartbeat timeout with one line saying why,
    checkpoint_last.pt loads, and the same two commands resume to the uninterrupted model."""
    flags = ["--save-interval-updates", "4", "--heartbeat-timeout", str(timeout)]
    save_dir = tmp_path / "run"
    node0, node1 = two_machines(data_bin, save_dir, LONG_UPDATES, *flags, name="interrupted")
    wait_for(save_dir / "checkpoint_1_4.pt", node0)
    victim = rank_process(save_dir, 1)
    faulted = time.monotonic()
    os.kill(victim, fault)
    node0.wait(timeout=timeout + 60)
    elapsed = time.monotonic() - faulted
    if fault == signal.SIGSTOP:
        os.kill(victim, signal.SIGKILL)  # what the lost machine's own scheduler would do
    node1.wait(timeout=60)
    print(f"{fault.name} of node 1's process: node 0 stopped {elapsed:.1f} s later, status {node0.returncode}",
          *messages(node0), f"node 1: status {node1.returncode}", *messages(node1), sep="\n  ")
    assert node0.returncode != 0 and node1.returncode != 0
    assert elapsed < timeout + 10
    survivor = "\n".join(messages(node0))
    assert "[rank0]: kerple_fairseq: error: another process of this training run died or stopped answering (" in survivor
    assert "train-wikitext-103: the process of rank 0 exited with status" in survivor or \
        "train-wikitext-103: the process of rank 0 was killed by SIGINT" in survivor  # fairseq's heartbeat
    assert "train-wikitext-103: training stopped before its end; the same command resumes from" in survivor
    assert "train-wikitext-103: the process of rank 1 was killed by SIGKILL" in "\n".join(messages(node1))
    assert "Traceback" not in open(node0._log).read()
    saved = parameters(save_dir)
    assert saved["optimizer_history"][-1]["num_updates"] in (4, 8)
    resumed = two_machines(data_bin, save_dir, LONG_UPDATES, *flags, name="resumed")
    assert f"Loaded checkpoint {save_dir / 'checkpoint_last.pt'}" in finish(*resumed)[0]
    assert largest_difference(parameters(save_dir), uninterrupted, f"{fault.name}, resumed vs uninterrupted") <= TOLERANCE


@pytest.mark.slow
def test_a_killed_process_stops_the_other_processes_of_its_machine(data_bin, tmp_path):
    save_dir = tmp_path / "run"
    proc = launch(data_bin, save_dir, LONG_UPDATES, "--cpu-processes", "2", "--save-interval-updates", "4", name="run")
    wait_for(save_dir / "checkpoint_1_4.pt", proc)
    faulted = time.monotonic()
    os.kill(rank_process(save_dir, 1), signal.SIGKILL)
    proc.wait(timeout=STOP_GRACE_SECONDS + 60)
    print(f"the launcher exited {time.monotonic() - faulted:.1f} s after the kill:", *messages(proc), sep="\n  ")
    assert time.monotonic() - faulted < STOP_GRACE_SECONDS + 10
    assert proc.returncode == 128 + signal.SIGKILL
    # rank 0 may print its own line first, when it notices the loss before the launcher stops it
    assert [line for line in messages(proc) if line.startswith("train-wikitext-103: ")][1:] == [
        f"train-wikitext-103: the process of rank 1 was killed by SIGKILL (its log: {save_dir / 'rank1.log'}); "
        "stopping this machine's other processes",
        f"train-wikitext-103: training stopped before its end; the same command resumes from {save_dir / 'checkpoint_last.pt'}"]
    assert rank_processes(save_dir) == []


KILL_DURING_WRITE = '''
import os, signal
point = os.environ.get("KERPLE_TEST_KILL_DURING")
if point:
    # a real SIGKILL of this fairseq-train process halfway through writing the checkpoint of update 8
    def die_half_written(data, f):
        f.write(data[: len(data) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "save":
        import io, torch
        save = torch.save

        def torch_save(obj, f, *args, **kwargs):
            if "checkpoint_1_8.pt" in str(getattr(f, "name", f)):
                buffer = io.BytesIO()
                save(obj, buffer, *args, **kwargs)
                die_half_written(buffer.getvalue(), f)
            return save(obj, f, *args, **kwargs)

        torch.save = torch_save
    else:
        import shutil
        copyfile = shutil.copyfile

        def copy(src, dst, *args, **kwargs):
            if str(src).endswith("checkpoint_1_8.pt"):
                with open(src, "rb") as s, open(dst, "wb") as d:
                    die_half_written(s.read(), d)
            return copyfile(src, dst, *args, **kwargs)

        shutil.copyfile = copy
'''


@pytest.mark.slow
@pytest.mark.parametrize("point", ["save", "copy"], ids=["writing-the-checkpoint", "copying-it-to-checkpoint_last"])
def test_a_kill_during_a_checkpoint_write_leaves_a_checkpoint_last_that_loads(data_bin, tmp_path, uninterrupted, point):
    """fairseq writes a save's first checkpoint to a temporary name, then copies it to checkpoint_last.pt;
    a kill halfway through either leaves the previous checkpoint_last.pt whole, and the run resumes."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILL_DURING_WRITE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
           "KERPLE_TEST_KILL_DURING": point}
    save_dir = tmp_path / "run"
    flags = ["--cpu-processes", "1", "--save-interval-updates", "4"]
    killed = train(data_bin, save_dir, LONG_UPDATES, *flags, check=False, env=env)
    assert "the process of rank 0 was killed by SIGKILL" in killed.stderr, killed.stderr[-3000:]
    last = parameters(save_dir)  # loads
    assert last["optimizer_history"][-1]["num_updates"] == 4
    assert (save_dir / ("checkpoint_1_8.pt.tmp" if point == "save" else "checkpoint_last.pt.tmp")).is_file(), \
        "the kill came halfway through the write"
    train(data_bin, save_dir, LONG_UPDATES, *flags)
    assert largest_difference(parameters(save_dir), uninterrupted, f"killed while {point}, resumed") <= TOLERANCE


@pytest.mark.slow
def test_resuming_on_fewer_processes_continues_the_same_run(data_bin, tmp_path, uninterrupted):
    """2 processes for 4 updates, then 1 process with --update-freq doubled (the script doubles it):
    the same batches in the same updates as the uninterrupted 2-process run."""
    train(data_bin, tmp_path, 4, "--cpu-processes", "2", "--save-interval-updates", "4")
    assert parameters(tmp_path)["extra_state"]["train_iterator"] == {
        "version": 2, "epoch": 1, "iterations_in_epoch": 4, "shuffle": True, "num_shards": 2}
    proc = train(data_bin, tmp_path, LONG_UPDATES, "--cpu-processes", "1", "--save-interval-updates", "4")
    assert "1 CPU worker(s), --update-freq 2" in proc.stderr
    assert largest_difference(parameters(tmp_path), uninterrupted, "2 processes, then 1") <= TOLERANCE


@pytest.mark.slow
def test_resuming_where_the_processes_cannot_share_the_epoch_is_one_line(data_bin, tmp_path):
    train(data_bin, tmp_path, 3, "--cpu-processes", "1", "--update-freq", "1")  # 3 batches taken
    before = (tmp_path / "checkpoint_last.pt").read_bytes()
    proc = train(data_bin, tmp_path, 6, "--cpu-processes", "2", check=False)
    assert proc.returncode != 0
    assert ("kerple_fairseq: error: cannot resume on 2 processes: the checkpoint stopped after 3 batches of epoch 1 "
            "(1 processes)") in proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert (tmp_path / "checkpoint_last.pt").read_bytes() == before
