"""The retrieval tasks through the commands: fairseq-train --task retrieval, kerple-eval-lm --task retrieval
against a brute-force scoring of the same examples, fairseq-eval-lm's loss of the answers equal to the
plugin's (MQAR's answers, which padding separates, among them), one-line errors, and the retrieval
comparison going on where it stopped and ranking runs kept without their checkpoints."""

import csv
import json
import re

import numpy as np
import pytest
import torch

from conftest import BIN, REPO, run
from console_scripts import comparable, run_each_forked, run_forked
from kerple_fairseq.evaluation.checkpoint_file import read_checkpoint
from kerple_fairseq.evaluation.loading import load_language_model
from kerple_fairseq.experiments import retrieval_training
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS
from kerple_fairseq.tasks.retrieval_sequences import TASKS
from test_retrieval_tasks import expected_answers, retrieval_task

USER_DIR = ["--user-dir", str(REPO / "kerple_fairseq")]
LENGTH = 32
TASK = ["--task", "retrieval", "--tokens-per-sample", str(LENGTH), "--valid-examples", "12"]
TINY = ["--decoder-layers", "1", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
        "--decoder-attention-heads", "2"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An ALiBi model trained for 30 updates on the three tasks (a few seconds)."""
    save_dir = tmp_path_factory.mktemp("retrieval")
    run([BIN / "fairseq-train", *USER_DIR, *TASK, "--arch", "transformer_lm_alibi", *TINY, "--max-tokens", "512",
         "--optimizer", "adam", "--lr", "0.003", "--max-update", "30", "--cpu", "--seed", "2", "--num-workers", "0",
         "--disable-validation", "--no-epoch-checkpoints", "--criterion", "cross_entropy", "--save-dir", save_dir,
         "--train-examples", "2000"])
    return save_dir / "checkpoint_last.pt"


def test_a_checkpoint_says_its_updates_as_the_resumed_training_reads_them(checkpoint, tmp_path):
    """What lets a training interrupted during a check resume from the checkpoint its stretch saved."""
    assert retrieval_training.checkpoint_updates(checkpoint) == 30
    (tmp_path / "checkpoint_last.pt").write_text("not a checkpoint")
    assert retrieval_training.checkpoint_updates(tmp_path / "checkpoint_last.pt") is None
    assert retrieval_training.checkpoint_updates(tmp_path / "absent.pt") is None


def kerple_eval(checkpoint, *flags, check=True):
    return run([BIN / "python", REPO / "scripts" / "eval_lm.py", *kerple_eval_args(checkpoint, *flags)], check=check)


def test_accuracy_equals_a_brute_force_scoring(checkpoint, tmp_path):
    """kerple-eval-lm's accuracy and loss of each task at 1x and 2x, against each example scored alone by a
    full forward at the positions the task's description gives."""
    kerple_eval(checkpoint, "--lengths", LENGTH, 2 * LENGTH, "--results-json", tmp_path / "r.json",
                "--example-scores", tmp_path / "s.npz", "--max-tokens", 100)
    records = {(r["task"], r["length"]): r for r in json.loads((tmp_path / "r.json").read_text())}
    model, *_ = load_language_model(str(checkpoint), None, task=retrieval_task(tokens_per_sample=LENGTH))
    model.eval()
    for name in TASKS:
        for length in (LENGTH, 2 * LENGTH):
            task = retrieval_task(retrieval_tasks=name, tokens_per_sample=length, valid_examples=12)
            data = task.examples("valid")
            right, log_probs = [], []
            for i in range(len(data)):
                tokens = data.example(i).tokens
                with torch.no_grad():
                    out = torch.log_softmax(model(torch.from_numpy(tokens[None, :-1]))[0][0].double(), -1)
                for t, _ in expected_answers(task, tokens):
                    right.append(int(out[t].argmax()) == tokens[t + 1])
                    log_probs.append(float(out[t, tokens[t + 1]]))
            r = records[name, length]
            assert r["num_answers"] == len(right) and r["num_examples"] == 12
            assert r["accuracy"] == pytest.approx(np.mean(right), abs=1e-12)
            assert r["loss"] == pytest.approx(-np.mean(log_probs) / np.log(2), rel=1e-5)
            assert sum(d["num_answers"] for d in r["depths"]) == len(right)


def fairseq_eval_lm_loss(checkpoint, name, length):
    proc = run([BIN / "fairseq-eval-lm", *USER_DIR, "--task", "retrieval", "--retrieval-tasks", name,
                "--tokens-per-sample", length, "--valid-examples", "12", "--path", checkpoint, "--cpu",
                "--gen-subset", "valid", "--max-tokens", 200])
    return float(re.search(r"Loss \(base 2\): ([0-9.]+)", proc.stdout + proc.stderr).group(1))


@pytest.mark.slow  # a fairseq-eval-lm process per task
def test_fairseq_eval_lm_scores_the_answers_as_the_plugin_does(checkpoint, tmp_path):
    kerple_eval(checkpoint, "--lengths", 2 * LENGTH, "--results-json", tmp_path / "r.json")
    for r in json.loads((tmp_path / "r.json").read_text()):
        assert fairseq_eval_lm_loss(checkpoint, r["task"], 2 * LENGTH) == pytest.approx(r["loss"], abs=1.5e-4)


EVAL_ERRORS = [
    (["--lengths", "16"], "length 16 is too short for mqar: it needs 24 or more"),
    (["--per-token", "x.npz"], "--per-token is for language modelling on a data-bin"),
    (["--retrieval-vocabulary", "32"], "was trained with other symbols (retrieval_vocabulary): give "
                                       "--retrieval-vocabulary 64 --filler-vocabulary 16"),
    (["--gen-subset", "dev"], "the retrieval task has the splits train, valid, test, not 'dev'"),
    (["--example-scores", "/no/such/dir/s.npz"], "directory /no/such/dir does not exist"),
    (["--results-json", "/no/such/dir/r.json"], "directory /no/such/dir does not exist"),
    (["--gen-subset", "train"], "--gen-subset train: the training examples are drawn for the mixture of tasks"),
    (["--lengths", "64", "16"], "length 16 is too short for mqar"),
]


def kerple_eval_args(checkpoint, *flags):
    return [*TASK, "--path", checkpoint, "--cpu", "--gen-subset", "valid", *map(str, flags)]


@pytest.fixture(scope="module")
def eval_error_runs(checkpoint):
    """kerple-eval-lm with each of :data:`EVAL_ERRORS`' flags, forked from one process
    (tests/console_scripts.py)."""
    return run_each_forked([("kerple-eval-lm", kerple_eval_args(checkpoint, *flags), REPO)
                               for flags, _ in EVAL_ERRORS], check=False)


@pytest.mark.parametrize("case", range(len(EVAL_ERRORS)))
def test_kerple_eval_lm_errors_are_one_line(eval_error_runs, case):
    proc, message = eval_error_runs[case], EVAL_ERRORS[case][1]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message in proc.stderr, proc.stderr[-2000:]


def test_the_script_alone_reports_as_the_command_among_others(eval_error_runs, checkpoint):
    alone = kerple_eval(checkpoint, *EVAL_ERRORS[0][0], check=False)
    assert (alone.returncode, alone.stderr) == (eval_error_runs[0].returncode, eval_error_runs[0].stderr)


def test_a_language_model_is_not_evaluated_as_retrieval():
    proc = kerple_eval(REPO / "tests" / "data" / "saved-checkpoints" / "alibi.pt", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "was trained with --task language_modeling, not retrieval" in proc.stderr


# --- kerple-analyze forget-gates ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fox_checkpoint(tmp_path_factory):
    """FoX with two layers, trained for 10 updates on the three tasks."""
    save_dir = tmp_path_factory.mktemp("retrieval-fox")
    run([BIN / "fairseq-train", *USER_DIR, *TASK, "--arch", "transformer_lm_kerple", "--bias-kernel", "fox", *TINY,
         "--decoder-layers", "2", "--max-tokens", "512", "--optimizer", "adam", "--lr", "0.003", "--max-update", "10",
         "--cpu", "--seed", "2", "--num-workers", "0", "--disable-validation", "--no-epoch-checkpoints",
         "--criterion", "cross_entropy", "--save-dir", save_dir, "--train-examples", "2000"])
    return save_dir / "checkpoint_last.pt"


def forget_gates(checkpoint, out, check=True):
    return run_forked("kerple-analyze", ["forget-gates", "--path", checkpoint, "--labels", "fox", "--num-examples",
                                         "6", "--out", out], REPO, check=check)


def gate_examples(checkpoint):
    """The model and, for each task, the 6 validation examples the command reads."""
    model, task, _ = load_language_model(str(checkpoint), None)
    return model.eval(), task, {name: [task.examples("valid", LENGTH, [name]).example(i) for i in range(6)]
                                for name in TASKS}


def kind_of(symbol):
    return symbol if symbol.startswith("<") else {"c": "content", "d": "digit", "f": "filler"}[symbol[0]]


@pytest.mark.slow  # a training and two analyses
def test_forget_gates_against_a_direct_computation(fox_checkpoint, tmp_path):
    """Each layer's mean log f at each kind of symbol, and the median bias of the answers' sources, against the
    layer's gates applied by hand to its input (the first layer's: the scaled embedding; the second's: what the
    first layer outputs; each through the attention's LayerNorm where it comes first) and summed over the
    positions after each source up to its query; then, with every gate set to a constant per layer and head,
    each mean equal to the constant's log-sigmoid, the positions of each kind counted, and each answer's source
    given the constant times its distance from the query."""
    model, task, examples = gate_examples(fox_checkpoint)
    forget_gates(fox_checkpoint, tmp_path / "trained")
    rows = read_rows(tmp_path / "trained" / "forget-gates.csv")
    found = json.loads((tmp_path / "trained" / "forget-gates.json").read_text())["fox"]["tasks"]
    decoder = model.decoder
    assert decoder.embed_positions is None and decoder.layernorm_embedding is None
    outputs = []
    hook = decoder.layers[0].register_forward_hook(lambda module, args, output: outputs.append(output[0]))
    for name, drawn in examples.items():
        by_kind, source_bias = {}, []
        for example in drawn:
            tokens = torch.as_tensor(example.tokens[:-1])
            outputs.clear()
            with torch.no_grad():
                model(tokens[None, :])
                log_f = []
                for layer, x in zip(decoder.layers, (decoder.embed_scale * decoder.embed_tokens(tokens), outputs[0][:, 0])):
                    x = layer.self_attn_layer_norm(x) if layer.normalize_before else x
                    log_f.append(torch.nn.functional.logsigmoid(layer.self_attn.layer_bias.gate(x)).double())
            for position, token in enumerate(tokens.tolist()):
                by_kind.setdefault(kind_of(task.dictionary[token]), []).append([f[position] for f in log_f])
            source_bias.extend([f[source + 1:query + 1].sum(dim=0).numpy() for f in log_f]
                               for query, source in zip(example.answers, example.sources))
        for kind, values in by_kind.items():
            expected = torch.stack([torch.stack(v) for v in values]).mean(dim=0)  # [layers, heads]
            for layer, head in ((0, 0), (0, 1), (1, 0), (1, 1)):
                mean = float(rows[name, layer + 1, head + 1, kind]["mean_log_forget"])
                assert mean == pytest.approx(float(expected[layer, head]), abs=1e-5)
        np.testing.assert_allclose(found[name]["source_bias_median"], np.median(source_bias, axis=0), atol=1e-4)
    hook.remove()
    state = read_checkpoint(str(fox_checkpoint))
    constants = torch.tensor([[-2.0, -0.5], [0.5, 3.0]])  # layer, head
    for layer in range(2):
        state["model"][f"decoder.layers.{layer}.self_attn.layer_bias.gate.weight"].zero_()
        state["model"][f"decoder.layers.{layer}.self_attn.layer_bias.gate.bias"].copy_(constants[layer])
    fixed = tmp_path / "fixed" / "checkpoint_last.pt"
    fixed.parent.mkdir()
    torch.save(state, fixed)
    forget_gates(fixed, tmp_path / "fixed-out")
    rows = read_rows(tmp_path / "fixed-out" / "forget-gates.csv")
    found = json.loads((tmp_path / "fixed-out" / "forget-gates.json").read_text())["fox"]["tasks"]
    log_f = torch.nn.functional.logsigmoid(constants.double()).numpy()
    for name, drawn in examples.items():
        counts = {}
        for example in drawn:
            for token in example.tokens[:-1]:
                counts[kind_of(task.dictionary[token])] = counts.get(kind_of(task.dictionary[token]), 0) + 1
        assert found[name]["count"] == counts
        for kind in counts:
            for layer, head in ((0, 0), (0, 1), (1, 0), (1, 1)):
                row = rows[name, layer + 1, head + 1, kind]
                assert int(row["count"]) == counts[kind]
                assert float(row["mean_log_forget"]) == pytest.approx(log_f[layer, head], abs=1e-6)
        distances = [query - source for example in drawn for query, source in zip(example.answers, example.sources)]
        np.testing.assert_allclose(found[name]["source_bias_median"], np.median(distances) * log_f, atol=1e-5)


def read_rows(path):
    with open(path, newline="") as f:
        return {(r["task"], int(r["layer"]), int(r["head"]), r["kind"]): r for r in csv.DictReader(f)}


def test_forget_gates_refuse_a_model_without_them_in_one_line(checkpoint, tmp_path):
    for path, message in ((checkpoint, "has no forget gates in its layers (a FoX model has)"),
                          (REPO / "tests" / "data" / "saved-checkpoints" / "alibi.pt",
                           "was trained with --task language_modeling, not retrieval: forget-gates reads the "
                           "retrieval tasks' examples")):
        proc = forget_gates(path, tmp_path / "out", check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr[-2000:]
        assert not (tmp_path / "out").exists()


TRAIN_ERRORS = [
    (["--retrieval-tasks", "recall"], "--retrieval-tasks 'recall': choose among mqar, passkey, copy"),
    (["--mqar-queries", "9"], "--mqar-queries must be between 1 and --mqar-pairs (8)"),
    (["--passkey-depth", "2"], "--passkey-depth must be between 0 (first) and 1 (last)"),
    (["--tokens-per-sample", "8"], "--tokens-per-sample 8 is too short for mqar"),
    (["--train-task-mix", "random"], "--train-task-mix: invalid choice: 'random' (choose from 'turns', 'equal-loss')"),
]


@pytest.fixture(scope="module")
def train_error_runs(tmp_path_factory):
    """fairseq-train with each of :data:`TRAIN_ERRORS`' flags, forked from one process: (run, save dir)."""
    save_dirs = [tmp_path_factory.mktemp("refused") / "save" for _ in TRAIN_ERRORS]
    runs = [("fairseq-train", refused_training(flags, save_dir), REPO) for (flags, _), save_dir in zip(TRAIN_ERRORS, save_dirs)]
    return list(zip(run_each_forked(runs, check=False), save_dirs))


def refused_training(flags, save_dir):
    return [*USER_DIR, *TASK, *flags, "--arch", "transformer_lm_alibi", *TINY, "--max-tokens", "512", "--optimizer",
            "adam", "--lr", "0.003", "--max-update", "1", "--cpu", "--save-dir", save_dir]


@pytest.mark.slow  # a process per command, forked from one
@pytest.mark.parametrize("case", range(len(TRAIN_ERRORS)))
def test_fairseq_train_refuses_bad_options_in_one_line(train_error_runs, case):
    (proc, save_dir), message = train_error_runs[case], TRAIN_ERRORS[case][1]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert message in proc.stderr and not save_dir.exists()


@pytest.mark.slow
def test_fairseq_train_alone_refuses_as_among_others(train_error_runs, tmp_path):
    alone = run([BIN / "fairseq-train", *refused_training(TRAIN_ERRORS[0][0], tmp_path / "save")], check=False)
    among, save_dir = train_error_runs[0]
    assert comparable(alone, tmp_path) == comparable(among, save_dir.parent)


# --- the comparison --------------------------------------------------------------------------------------

COMPARISON = str(REPO / "scripts" / "retrieval_comparison.py")
TRAINING = re.compile(r"^\[[0-9:]+\] training ", re.MULTILINE)  # the comparison's line as a training starts


def comparison(out, *more, check=True):
    """The comparison at a tiny size, forked (:mod:`console_scripts`): the script's own imports done once; the
    trainings and evaluations it starts are processes of their own."""
    return run_forked(COMPARISON, ["--models", "alibi", "rotary", "rotary_ntk", "--seeds", "1", "2", "--updates", "8",
                                   "--check-every", "4", "--check-examples", "4",
                                   "--train-length", "28", "--eval-lengths", "28", "56", "--examples", "10",
                                   "--map-examples", "10", "--depth-bands", "5",
                                   "--layers", "1", "--width", "32", "--heads", "2", "--out", out, *more], REPO,
                      check=check)


@pytest.mark.slow  # four trainings and twelve evaluations
def test_the_comparison_goes_on_where_it_stopped_and_keeps_runs_without_checkpoints(tmp_path):
    out = tmp_path / "out"
    first = comparison(out)
    assert "cost:" in first.stdout and "retrieval board" in first.stdout.lower()
    # two stretches of 4 updates each, each checked; rotary+NTK is evaluated on rotary's checkpoint
    assert len(TRAINING.findall(first.stdout)) == 8 and first.stdout.count("updates 4 to 8 of at most 8") == 4
    assert first.stdout.count("not learned in 8 updates (the cap)") == 4
    trained = json.loads((out / "alibi-seed1" / "trained.json").read_text())
    assert [c["updates"] for c in trained["checks"]] == [4, 8] and trained["learned"] is False
    assert set(trained["checks"][0]["whole_accuracy"]) == set(TASKS) and trained["updates"] == 8
    assert json.loads((out / "rotary_ntk-seed1" / "trained.json").read_text())["checks"] == \
        json.loads((out / "rotary-seed1" / "trained.json").read_text())["checks"]
    board, depth_map = (out / "retrieval-board.md").read_text(), (out / "retrieval-depth-map.md").read_text()
    for label in ("ALiBi", "rotary", "rotary+NTK"):
        assert f"| {label} |" in board and f"**{label}**" in depth_map
    assert "## mqar against the family baseline" in board and "| rotary+NTK | rotary | " in board
    assert first.stdout.count("for its depth map: mqar, passkey at lengths 28, 56") == 6
    mapped = json.loads((out / "alibi-seed2" / "depth-map.json").read_text())
    assert [(r["task"], r["length"]) for r in mapped] == [(t, n) for n in (28, 56) for t in ("mqar", "passkey")]
    assert all([b["num_whole"] for b in r["depth_bands"]] == [8 if r["task"] == "mqar" else 2] * 5 for r in mapped)
    assert "| length | 0-20% | 20-40% | 40-60% | 60-80% | 80-100% |" in depth_map
    again = comparison(out)
    assert not TRAINING.findall(again.stdout) and "evaluating " not in again.stdout
    assert (out / "retrieval-board.md").read_text() == board
    assert (out / "retrieval-depth-map.md").read_text() == depth_map
    for path in out.glob("*/checkpoint_last.pt"):
        path.unlink()
    kept = comparison(out)
    assert kept.stdout.count("kept without its checkpoint") == 6
    assert (out / "retrieval-board.md").read_text() == board
    for seed, seconds in ((1, {"trained.json": 7200, "evaluated.json": 1800}),
                          (2, {"trained.json": 7200, "evaluated.json": 1800, "mapped.json": 3600})):
        for record, spent in seconds.items():  # the records' times, for a cost worked out by hand
            path = out / f"alibi-seed{seed}" / record
            path.write_text(json.dumps({**json.loads(path.read_text()), "seconds": spent}))
    (out / "alibi-seed1" / "mapped.json").unlink()  # a run kept without its checkpoint, and its map lost
    lost = comparison(out, check=False)
    assert lost.returncode == 2 and "Traceback" not in lost.stderr and "alibi-seed1 is kept without its checkpoint " \
        "and has no depth map made with these --map-examples and --depth-bands" in lost.stderr
    assert (out / "alibi-seed1" / "trained.json").is_file() and not TRAINING.findall(lost.stdout)
    # the run without its map is not finished, and needs only its map: ALiBi's one finished run here took 7200 s
    # to train and 1800 + 3600 s to evaluate (the map-less run is left out of that mean), of which the map-less
    # run spent 7200 + 1800, so 3600 s are left
    assert "cost: 5 of 6 runs are finished" in lost.stdout and "the other 1 need about 1.0 h" in lost.stdout
    assert (out / "retrieval-depth-map.md").read_text() == depth_map
    for results in ("eval.json", "depth-map.json"):
        records = {p.parent.name: json.loads(p.read_text()) for p in out.glob(f"*/{results}")}
        assert records["rotary_ntk-seed1"] != records["rotary-seed1"]  # scaled at 2x


def test_runs_differ_only_in_their_position_encoding():
    import argparse

    from kerple_fairseq.experiments.retrieval_comparison import training
    args = argparse.Namespace(out=REPO / "runs" / "unused", tasks=list(TASKS), train_length=64, max_tokens=2048,
                              updates=12000, layers=2, width=128, heads=4, kernel_parameterization="clamp",
                              check_every=500, criterion=0.97, check_examples=100, train_task_mix="turns")
    rest = set()
    for name, encoding in POSITION_ENCODINGS.items():
        flags = training(args, name, 1).key["fairseq-train"]
        model = encoding.model_flags()
        assert flags[:len(model)] == model
        rest.add(tuple(flags[len(model):]))
    assert len(rest) == 1


@pytest.mark.parametrize("flags, message", [
    (["--criterion", "1.5"], "--criterion is a share of whole answers, above 0 and at most 1, got 1.5"),
    (["--map-examples", "3"], "--map-examples 3 leaves some of --depth-bands 5 empty"),
    (["--eval-lengths", "24"], "--eval-lengths must be 28 or more for the depth map: mqar, passkey need room"),
])
def test_the_comparison_refuses_bad_options_in_one_line(flags, message, capsys, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("retrieval_comparison_script", COMPARISON)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as e:
        script.main([*flags, "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert e.value.code == 2 and message in error and error.count("\n") == 1 and not (tmp_path / "out").exists()


def test_an_unranked_model_whose_training_learned_the_tasks_is_given_the_reason(tmp_path):
    import argparse

    from kerple_fairseq.analysis.retrieval_board import Entrant, RetrievalBoard
    from kerple_fairseq.experiments.retrieval_comparison import trainings, unranked_reasons
    # every seed's training checks learned the tasks, but rotary+NTK's seed 2; leaky ReRoPE has a seed of its own
    seeds = {"rotary": [1, 2], "rotary_rerope": [1, 2], "rotary_ntk": [1, 2], "rotary_yarn": [1, 2], "alibi": [1],
             "rnope_swa": [1], "swan": [1], "rotary_leaky_rerope": [3]}
    for name, numbers in seeds.items():
        for seed in numbers:
            (tmp_path / f"{name}-seed{seed}").mkdir()
            (tmp_path / f"{name}-seed{seed}" / "trained.json").write_text(
                json.dumps({"learned": (name, seed) != ("rotary_ntk", 2)}))
    # whole answers at L=64 on the board's examples, seed by seed
    copy = {"rotary": [1.0, 1.0], "rotary_rerope": [0.0, 0.0], "rotary_ntk": [1.0, 0.5], "rotary_yarn": [0.99, 0.99],
            "alibi": [0.98], "rnope_swa": [0.99], "swan": [0.5], "rotary_leaky_rerope": [0.0]}
    passkey = {"rotary": [0.95, 0.99], "rotary_rerope": [0.96, 0.5], "rotary_ntk": [0.95, 0.5],
               "rotary_yarn": [0.95, 0.99], "alibi": [0.96], "rnope_swa": [0.99], "swan": [0.99],
               "rotary_leaky_rerope": [0.5]}
    accuracy = {(name, task, 64): values for task, by_model in (("copy", copy), ("passkey", passkey))
                for name, values in by_model.items()}
    board = RetrievalBoard(64, ["copy", "passkey"], [64], [Entrant(n, n, "", s) for n, s in seeds.items()], 0.95,
                           0.97, {}, accuracy)
    args = argparse.Namespace(out=tmp_path, criterion=0.97, train_length=64)
    trained = trainings(args, [(name, seed) for name, numbers in seeds.items() for seed in numbers])
    rerope = "--rotary-scaling rerope --model-overrides {'rerope_query_scale': 'log'}"
    leaky = ("its trained model learned the tasks; evaluated with --rotary-scaling leaky-rerope --model-overrides "
             "{'rerope_query_scale': 'log'}, it does not reach 97% at L=64")  # no seed of its own trained model here
    assert unranked_reasons(args, trained, board, "copy") == {
        "rotary_rerope": f"its trained model, rotary, reaches 97% at L=64; evaluated with {rerope}, it does not",
        "swan": "its trained model, RNoPE-SWA, reaches 97% at L=64; evaluated with --model-overrides "
                "{'swan_scaling': True}, it does not",
        "rotary_leaky_rerope": leaky}
    checks = "its training checks reached 97% at L=64; the board's examples are below it"
    assert unranked_reasons(args, trained, board, "passkey") == {
        "rotary": checks, "alibi": checks, "rotary_leaky_rerope": leaky,
        "rotary_rerope": f"its trained model, rotary, reaches 97% at L=64 at seed 2; evaluated with {rerope}, "
                         "it does not",
        "rotary_yarn": "its trained model, rotary, is below 97% at L=64 here too at seed 1"}


COMMITTED = REPO / "results" / "retrieval"


def test_the_committed_board_is_what_its_runs_give(tmp_path):
    """The committed retrieval board, regenerated from its runs' records and example scores with the command of
    docs/retrieval.md (``--board-only``: the models need not all be at every seed): nothing trained or evaluated,
    the same markdown and CSV; with no finished run among the models and seeds asked, one line."""
    import shutil

    out = tmp_path / "retrieval"
    runs = sorted(p.name for p in COMMITTED.glob("*-seed*"))
    for name in runs:
        shutil.copytree(COMMITTED / name, out / name)
    models = sorted({name.rpartition("-seed")[0] for name in runs})
    seeds = sorted({name.rpartition("-seed")[2] for name in runs})
    proc = run_forked(COMPARISON, ["--board-only", "--seeds", *seeds, "--models", *models, "--out", out], REPO)
    assert not TRAINING.findall(proc.stdout) and "evaluating " not in proc.stdout
    assert f"{len(runs)} finished runs on the board; nothing trained or evaluated" in proc.stdout
    left_out = {f"{m}-seed{s}" for m in models for s in seeds} - set(runs)  # the models not at every seed
    assert all(name in proc.stdout for name in left_out) and ("left out" in proc.stdout) == bool(left_out)
    for board in ("retrieval-board.md", "retrieval-board.csv", "retrieval-depth-map.md"):
        assert (out / board).read_text() == (COMMITTED / board).read_text(), board
    none = run_forked(COMPARISON, ["--board-only", "--seeds", "9", "--models", *models, "--out", out], REPO, check=False)
    assert none.returncode == 2 and "Traceback" not in none.stderr and none.stderr.strip().splitlines() == [
        f"retrieval_comparison: error: --board-only: no run of these --models and --seeds is trained and evaluated "
        f"with these options in {out}"]


def test_every_cell_of_the_committed_depth_map_resolves_ten_points():
    """Each cell (a task, a length, a depth band) holds enough whole answers for a seed's 95% interval to be
    within 10 points, at every length and band of every committed run."""
    from kerple_fairseq.analysis import retrieval_board

    runs = sorted(COMMITTED.glob("*-seed*"))
    records = {(path.name, 1): json.loads((path / "depth-map.json").read_text()) for path in runs}
    entrants = [retrieval_board.Entrant(path.name, path.name, "", [1]) for path in runs]
    for task in ("mqar", "passkey"):
        depth_map = retrieval_board.DepthMap.of(task, entrants, records)
        assert depth_map.lengths == [64 * 2 ** k for k in range(6)] and depth_map.bands == 5
        assert depth_map.counts.min() >= 96 and depth_map.widest_interval() <= 10.0


def test_no_verdict_on_the_committed_board_depends_on_the_bootstrap_seed():
    """The committed retrieval board rebuilt with 20 bootstrap seeds: every comparison's verdict (against ALiBi and
    the family baseline), and whether it is marked, the same under each."""
    from functools import lru_cache

    from kerple_fairseq.analysis import retrieval_board
    from kerple_fairseq.evaluation import retrieval_accuracy
    from kerple_fairseq.experiments.retrieval_comparison import board_entrant

    runs = sorted(p for p in COMMITTED.glob("*-seed*"))
    seeds_of = {}
    for path in runs:
        name, _, seed = path.name.rpartition("-seed")
        seeds_of.setdefault(name, []).append(int(seed))
    entrants = [board_entrant(name, sorted(seeds)) for name, seeds in seeds_of.items()]
    records = json.loads((runs[0] / "eval.json").read_text())
    chance = {(r["task"], r["length"]): r["chance"] for r in records}

    @lru_cache(maxsize=None)
    def scores_of(name, seed):
        return retrieval_accuracy.load(str(COMMITTED / f"{name}-seed{seed}" / "example-scores.npz"))

    found = {}
    for bootstrap_seed in range(1, 21):
        board = retrieval_board.build(entrants, records[0]["train_length"], scores_of, chance, 0.97,
                                      bootstrap_seed=bootstrap_seed)
        assert board.versus
        for v in board.versus:
            found.setdefault((v.model, v.reference, v.protocol, v.length), set()).add((v.verdict, board.marked(v)))
    changing = {key: states for key, states in found.items() if len(states) > 1}
    assert not changing, changing
