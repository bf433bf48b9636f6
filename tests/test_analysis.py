"""kerple-analyze: every analysis's numbers against a direct computation, its figure a real PNG,
the receptive field of windowed models against their theoretical receptive field."""

import csv
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils
from PIL import Image
from torch import nn

import reference
from conftest import BIN, REPO, TRAIN_LENGTH, train
from console_scripts import run_forked
from helpers import tiny_model
from kerple_fairseq.analysis.kernel_curves import effective_lengths
from kerple_fairseq.analysis.receptive_field import receptive_field
from kerple_fairseq.evaluation.checkpoint_file import no_checkpoint
from kerple_core.kernels import build_kernel

ANALYZE = BIN / "kerple-analyze"
WINDOW, LAYERS = 8, 2


def ckpt(trained, name):
    return str(trained[name][0] / "checkpoint_last.pt")


@pytest.fixture(scope="module")
def windowed(data_bin, tmp_path_factory):
    """ALiBi with a window of 8 keys, 2 layers, trained briefly."""
    save_dir = tmp_path_factory.mktemp("ckpt-windowed")
    train(data_bin, save_dir, 8, "--arch", "transformer_lm_kerple", "--bias-kernel", "alibi",
          "--attn-window", str(WINDOW), "--decoder-layers", str(LAYERS))
    return str(save_dir / "checkpoint_last.pt")


def analyze(*args, check=True):
    """The installed command, forked (:mod:`console_scripts`)."""
    return run_forked(ANALYZE.name, args, REPO, check=check)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_png(path):
    """A decodable PNG of a reasonable size that is not one flat colour."""
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= 300 and image.height >= 200
        extrema = image.convert("L").getextrema()
        assert extrema[1] - extrema[0] > 100, "the figure is blank"


def load(path, data_bin, **overrides):
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [path], arg_overrides={"data": str(data_bin), **overrides})
    return models[0].eval(), task


def valid_stream(task, data_bin):
    from fairseq.data import data_utils

    dataset = data_utils.load_indexed_dataset(str(data_bin / "valid"), task.source_dictionary)
    return torch.cat([dataset[i].long() for i in range(len(dataset))])


def kernel_parameters(path, data_bin):
    """Per-head constrained parameters of a checkpoint's kernel, through a fully built model."""
    model, _ = load(path, data_bin)
    return {name: v.detach().double().numpy() for name, v in model.decoder.attention_bias.kernel.values().items()}


# ---------------------------------------------------------------- effective length


@pytest.mark.parametrize("num_heads", [4, 8, 12, 16])
def test_alibi_effective_length_closed_form(num_heads):
    """Smallest d with -m_h d < -2: ceil(2/m_h) where 2/m_h is not an integer; where it is (the
    power-of-two slopes), B(2/m_h) = -2 exactly, which is not below -2, so it is 2/m_h + 1."""
    slopes = reference.alibi_slopes_reference(num_heads)
    with torch.no_grad():
        curves = build_kernel("alibi", num_heads)(torch.arange(20481, dtype=torch.float32)).double().numpy()
    got = effective_lengths(curves)
    for head, m in enumerate(slopes):
        reach = 2.0 / m
        if abs(reach - round(reach)) < 1e-9:
            assert got[head] == round(reach) + 1
        else:
            assert got[head] == math.ceil(reach)
    assert effective_lengths(curves, threshold=-2.0 + 1e-6) == [math.ceil(2.0 / m - 1e-6) for m in slopes], \
        "just above -2 the closed form ceil(2/m_h) holds for every head"


@pytest.mark.slow
def test_effective_length_command_matches_direct_computation(trained, data_bin, tmp_path):
    paths = [ckpt(trained, "alibi"), ckpt(trained, "kerple_log")]
    analyze("effective-length", "--path", *paths, "--labels", "A", "K", "--out", tmp_path)
    rows = read_csv(tmp_path / "effective-length.csv")
    assert_png(tmp_path / "effective-length.png")
    got = {(r["model"], int(r["head"])): (int(r["effective_length"]) if r["effective_length"] else None) for r in rows}

    slopes = reference.alibi_slopes_reference(4)
    for head, m in enumerate(slopes):
        assert got["A", head + 1] == math.floor(2.0 / m) + 1
    params = kernel_parameters(paths[1], data_bin)
    for head in range(4):
        bias = reference.kerple_log(params["r1"], params["r2"])
        expected = next((d for d in range(20481) if bias(head, d) < -2), None)
        assert got["K", head + 1] == expected
    assert len(rows) == 8


# ---------------------------------------------------------------- kernel curves


@pytest.mark.slow
def test_kernels_command_matches_the_formulas(trained, windowed, data_bin, tmp_path):
    paths = [ckpt(trained, "alibi"), ckpt(trained, "kerple_log"), windowed]
    analyze("kernels", "--path", *paths, "--labels", "A", "K", "W", "--max-distance", "300", "--out", tmp_path)
    assert_png(tmp_path / "kernels.png")
    rows = read_csv(tmp_path / "kernels.csv")
    assert len(rows) == 3 * 4 * 301
    slopes = reference.alibi_slopes_reference(4)
    params = kernel_parameters(paths[1], data_bin)
    formulas = {"A": reference.alibi(slopes), "K": reference.kerple_log(params["r1"], params["r2"]),
                "W": reference.windowed(reference.alibi(slopes), WINDOW)}
    for r in rows:
        expected = formulas[r["model"]](int(r["head"]) - 1, int(r["distance"]))
        value = float(r["bias"])
        if math.isinf(expected):
            assert value == expected
        else:
            assert value == pytest.approx(expected, rel=1e-5, abs=1e-5)
        assert r["weight"] == ""


# ---------------------------------------------------------------- position-wise perplexity


def brute_force_position_loss(model, stream, length):
    """Every non-overlapping block of `length` through the model one at a time; mean base-2 loss by position."""
    inputs = torch.cat([stream.new_tensor([2]), stream[:-1]])  # fairseq's eos is 2
    sums, counts = np.zeros(length), np.zeros(length)
    with torch.no_grad():
        for start in range(0, len(stream), length):
            src, tgt = inputs[start:start + length], stream[start:start + length]
            logits, _ = model(src[None])
            lprobs = torch.log_softmax(logits[0].double(), dim=-1).gather(-1, tgt[:, None])[:, 0]
            sums[: len(tgt)] -= lprobs.numpy() / math.log(2)
            counts[: len(tgt)] += 1
    return sums / counts, counts


@pytest.mark.slow
def test_position_wise_command_matches_brute_force(trained, data_bin, tmp_path):
    length = 160
    path = ckpt(trained, "kerple_log")
    analyze("position-wise", data_bin, "--path", path, "--labels", "K", "--length", str(length),
            "--windowed-reference", "--cpu", "--no-progress-bar", "--max-tokens", "2048", "--out", tmp_path)
    assert_png(tmp_path / "position-wise.png")
    rows = read_csv(tmp_path / "position-wise.csv")
    model, task = load(path, data_bin)
    assert task.source_dictionary.eos() == 2
    stream = valid_stream(task, data_bin)
    windowed_model, _ = load(path, data_bin, attn_window=TRAIN_LENGTH)
    for name, m in (("K", model), (f"K windowed@{TRAIN_LENGTH}", windowed_model)):
        mine = [r for r in rows if r["model"] == name]
        expected, counts = brute_force_position_loss(m, stream, length)
        assert [int(r["position"]) for r in mine] == list(range(length))
        assert [int(r["count"]) for r in mine] == counts.astype(int).tolist()
        np.testing.assert_allclose([float(r["loss"]) for r in mine], expected, rtol=1e-5)
        np.testing.assert_allclose([float(r["ppl"]) for r in mine], 2.0 ** expected, rtol=1e-5)
    full = np.array([float(r["loss"]) for r in rows if r["model"] == "K"])
    reference_line = np.array([float(r["loss"]) for r in rows if r["model"] != "K"])
    np.testing.assert_allclose(full[:TRAIN_LENGTH], reference_line[:TRAIN_LENGTH], rtol=1e-5,
                               err_msg="within the training length the window changes nothing")
    assert not np.allclose(full[TRAIN_LENGTH:], reference_line[TRAIN_LENGTH:]), "the reference is windowed"


# ---------------------------------------------------------------- receptive field


@pytest.mark.parametrize("kernel,window,layers", [("window", 1, 2), ("window", 2, 3), ("alibi", 2, 1),
                                                  ("window", 8, 2), ("kerple_log", 5, 4)])
def test_windowed_receptive_field_within_theory(kernel, window, layers):
    """A window of w keys (the query's own included) reaches back (w-1) tokens per layer, so R layers
    see exactly the last (w-1)R + 1 tokens (<= wR): 1 for w = 1, R + 1 for w = 2."""
    torch.manual_seed(window * 10 + layers)
    model = tiny_model(kernel, "--attn-window", str(window), "--decoder-layers", str(layers)).eval()
    stream = torch.randint(4, 50, (400,))
    field = receptive_field(model, stream, 48, 6, 0.99, 1000, "cpu")
    theoretical = (window - 1) * layers + 1
    assert field.support == theoretical, "gradient reaches exactly the theoretical receptive field"
    assert np.all(field.shares[theoretical:] == 0)
    assert field.erf <= theoretical <= window * layers
    if window == 1:
        assert field.erf == 1
    if window == 2:
        assert field.support == layers + 1
    assert field.shares.sum() == pytest.approx(1.0)


def direct_receptive_field(model, stream, length, num_segments, mass):
    """One segment at a time: leaf embeddings fed through the full model, loss from a full log-softmax."""
    model.requires_grad_(False)
    targets = np.floor(np.linspace(length, len(stream) - 1, num_segments)).astype(int)
    embed = model.decoder.embed_tokens
    shares = np.zeros(length)
    for t in targets:
        leaf = embed(stream[t - length:t][None]).detach().requires_grad_(True)

        class Fixed(nn.Module):
            def forward(self, tokens):
                return leaf

        model.decoder.embed_tokens = Fixed()
        try:
            logits, _ = model(stream[t - length:t][None])
        finally:
            model.decoder.embed_tokens = embed
        loss = -torch.log_softmax(logits[0, -1].double(), dim=-1)[stream[t]]
        loss.backward()
        norms = leaf.grad[0].double().norm(dim=-1).numpy()
        shares += norms / norms.sum()
    by_recency = shares[::-1] / num_segments
    cumulative = np.cumsum(by_recency)
    return by_recency, int(np.argmax(cumulative > mass)) + 1


@pytest.mark.slow
def test_receptive_field_command_matches_direct_computation(trained, windowed, data_bin, tmp_path):
    length, segments = 96, 6
    paths = [ckpt(trained, "kerple_log"), windowed]
    analyze("receptive-field", data_bin, "--path", *paths, "--labels", "K", "W", "--length", str(length),
            "--num-segments", str(segments), "--cpu", "--no-progress-bar", "--max-tokens", "200", "--out", tmp_path)
    assert_png(tmp_path / "receptive-field.png")
    summary = json.loads((tmp_path / "receptive-field.json").read_text())
    rows = read_csv(tmp_path / "receptive-field.csv")
    for label, path in zip(("K", "W"), paths):
        model, task = load(path, data_bin)
        shares, erf = direct_receptive_field(model, valid_stream(task, data_bin), length, segments, 0.99)
        mine = [r for r in rows if r["model"] == label]
        assert [int(r["recent_tokens"]) for r in mine] == list(range(1, length + 1))
        np.testing.assert_allclose([float(r["share"]) for r in mine], shares, rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose([float(r["cumulative"]) for r in mine], np.cumsum(shares), rtol=1e-4, atol=1e-9)
        assert summary[label]["erf"] == erf
    trf = (WINDOW - 1) * LAYERS + 1
    assert summary["W"]["theoretical_receptive_field"] == trf and summary["W"]["window"] == WINDOW
    assert summary["W"]["support"] == trf and summary["W"]["erf"] <= trf <= WINDOW * LAYERS
    assert summary["K"]["theoretical_receptive_field"] is None and summary["K"]["support"] == length


# ---------------------------------------------------------------- without matplotlib, and bad input


@pytest.mark.slow
def test_without_matplotlib_the_numbers_are_written_and_the_fix_is_named(trained, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from kerple_fairseq.analysis.cli import cli_main\n"
            f"cli_main(['kernels', '--path', {ckpt(trained, 'alibi')!r}, '--out', {str(tmp_path)!r}])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "matplotlib is not installed" in proc.stderr and "[plots]" in proc.stderr
    assert (tmp_path / "kernels.csv").is_file() and not (tmp_path / "kernels.png").exists()
    assert len(read_csv(tmp_path / "kernels.csv")) == 4 * 2049


@pytest.mark.slow
def test_bad_input_through_the_installed_command(tmp_path):
    proc = analyze("kernels", "--path", tmp_path / "missing.pt", "--out", tmp_path / "out", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"kerple-analyze: error: {no_checkpoint(tmp_path / 'missing.pt')}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bad_input(trained, data_bin, tmp_path, capsys):
    from kerple_fairseq.analysis.cli import cli_main

    out = tmp_path / "out"
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(open(ckpt(trained, "alibi"), "rb").read()[:5000])
    alibi, sinusoidal = ckpt(trained, "alibi"), ckpt(trained, "sinusoidal")
    cases = [
        (["kernels", "--path", corrupt], "cannot read checkpoint"),
        (["kernels", "--path", sinusoidal], "not a kerple_fairseq checkpoint"),
        (["kernels", "--path", alibi, ckpt(trained, "kerple_log"), "--labels", "x"],
         "--labels gives 1 names for 2 checkpoints"),
        (["effective-length", "--path", alibi, alibi], "--labels must be distinct"),
        (["position-wise", tmp_path, "--path", alibi, "--length", "64", "--cpu"], "not a fairseq data-bin"),
        (["position-wise", data_bin, "--path", sinusoidal, "--length", "64", "--windowed-reference", "--cpu"],
         "needs a kerple_fairseq model"),
        (["position-wise", data_bin, "--path", ckpt(trained, "learned"), "--length", "4096", "--cpu"],
         "exceeds the 64 learned positional embeddings"),
        (["receptive-field", data_bin, "--path", alibi, "--length", "64", "--mass", "1.5", "--cpu"],
         "--mass must be between 0 and 1"),
        (["receptive-field", data_bin, "--path", alibi, "--length", "60000", "--cpu"], "targets"),
    ]
    for args, expected in cases:
        with pytest.raises(SystemExit) as exit_info:
            cli_main([str(a) for a in args] + ["--out", str(out)])
        assert exit_info.value.code == 1
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kerple-analyze: error:")]
        assert len(errors) == 1 and expected in errors[0], (args, errors)
        assert not out.exists(), "nothing written on bad input"


def test_extrapolation_draws_each_models_results_files(tmp_path, capsys):
    """Perplexity against length from --results-json files, no model run: the CSV holds exactly the
    files' numbers, the figure is a real PNG, and the training length comes from the records."""
    from kerple_fairseq.analysis.cli import cli_main

    files = {}
    for label, base in (("A", 100.0), ("B", 90.0)):
        records = [{"protocol": p, "length": n, "ppl": base + k + (20 if p == "last-token" else 0), "loss": 0.0,
                    "num_tokens": 1, "train_length": 128}
                   for p in ("early-token-cursed", "last-token") for k, n in enumerate([128, 512, 2048])]
        files[label] = tmp_path / label / "results.json"
        files[label].parent.mkdir()
        files[label].write_text(json.dumps(records))
    out = tmp_path / "out"
    cli_main(["extrapolation", "--path", *map(str, files.values()), "--out", str(out)])  # labels: directory names
    rows = list(csv.DictReader(open(out / "extrapolation.csv")))
    assert len(rows) == 12
    for label, path in files.items():
        for r in json.loads(path.read_text()):
            row = next(x for x in rows if (x["model"], x["protocol"], int(x["length"])) == (label, r["protocol"], r["length"]))
            assert float(row["ppl"]) == r["ppl"]
    image = Image.open(out / "extrapolation.png")
    assert image.format == "PNG" and image.size[0] > 2 * image.size[1]  # two panels side by side
    assert "A: early-token-cursed L=128 100.00, L=512 101.00, L=2048 102.00" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        cli_main(["extrapolation", "--path", str(files["A"]), str(tmp_path / "bad.json"), "--out", str(tmp_path / "o2")])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kerple-analyze: error:")]
    assert len(errors) == 1 and "is not a kerple-eval-lm --results-json file" in errors[0]
    assert not (tmp_path / "o2").exists()


def test_extrapolation_draws_the_mean_and_range_of_a_models_runs(tmp_path, capsys):
    """Results files sharing a label are runs (seeds) of one model: one line at their mean, the CSV
    with each length's mean, smallest and largest; a length some run lacks is left out."""
    from kerple_fairseq.analysis.cli import cli_main

    paths, labels = [], []
    for label, runs in (("A", [[100.0, 104.0], [102.0, 110.0]]), ("B", [[90.0, 91.0], [96.0, 97.0]])):
        for k, ppl in enumerate(runs):
            lengths = [128, 512] + ([2048] if k == 0 else [])
            records = [{"protocol": "early-token-cursed", "length": n, "ppl": p, "train_length": 128}
                       for n, p in zip(lengths, ppl + [1.0])]
            paths.append(tmp_path / f"{label}{k}.json")
            paths[-1].write_text(json.dumps(records))
            labels.append(label)
    out = tmp_path / "out"
    cli_main(["extrapolation", "--path", *map(str, paths), "--labels", *labels, "--out", str(out)])
    rows = {(r["model"], int(r["length"])): r for r in csv.DictReader(open(out / "extrapolation.csv"))}
    assert set(rows) == {("A", 128), ("A", 512), ("B", 128), ("B", 512)}
    assert [float(rows["A", 512][k]) for k in ("ppl", "min", "max", "runs")] == [107.0, 104.0, 110.0, 2]
    assert [float(rows["B", 128][k]) for k in ("ppl", "min", "max")] == [93.0, 90.0, 96.0]
    assert "A: early-token-cursed (mean of 2 runs) L=128 101.00, L=512 107.00" in capsys.readouterr().out
    assert Image.open(out / "extrapolation.png").format == "PNG"
    with pytest.raises(SystemExit):
        cli_main(["extrapolation", "--path", *map(str, paths[:3]), "--labels", *labels[:3], "--out", str(tmp_path / "o2")])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kerple-analyze: error:")]
    assert len(errors) == 1 and "A has 2, B has 1" in errors[0]
