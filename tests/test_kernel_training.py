"""Every kernel and positional option trains a tiny model on the real sample (fairseq-train's main,
in this process), with finite, falling loss and in-domain parameters in the saved checkpoint."""

import argparse
import logging

import pytest
import torch

from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_core.kernels import KERNELS, build_kernel
from kerple_core.kernels.learnable import LearnableKernel

from conftest import assert_finite_falling_loss, train_in_process

SIZE = model_size_flags(layers=2, width=32, heads=4)
UPDATES = 12
RUNS = {name: ["--bias-kernel", name] for name in sorted(KERNELS)}
RUNS["window"] += ["--attn-window", "16"]
RUNS["alibi_rf-learnable-rho"] = ["--bias-kernel", "alibi_rf", "--alibi-rf-learnable-rho",
                                  "--alibi-rf-decay", "reciprocal", "--alibi-rf-rho", "32"]
RUNS["rotary"] = ["--arch", "transformer_lm_rotary"]
RUNS["super-baseline"] = ["--arch", "transformer_lm_rotary", "--attn-window", "16"]


@pytest.mark.parametrize("run", sorted(RUNS))
def test_tiny_training_has_finite_falling_loss_and_valid_checkpoint(data_bin, tmp_path, run):
    flags = RUNS[run]
    arch = [] if "--arch" in flags else ["--arch", "transformer_lm_kerple"]
    losses = train_in_process(data_bin, tmp_path, UPDATES, *arch, *SIZE, *flags)
    assert_finite_falling_loss(losses, UPDATES, run)

    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    cfg = state["cfg"]["model"]
    kernel = build_kernel(cfg["bias_kernel"], cfg["decoder_attention_heads"], argparse.Namespace(**cfg))
    prefix = "decoder.attention_bias.kernel."
    saved = {k[len(prefix):]: v for k, v in state["model"].items() if k.startswith(prefix)}
    assert saved.keys() == kernel.state_dict().keys()
    kernel.load_state_dict(saved)
    assert all(torch.isfinite(p).all() for p in kernel.parameters())
    if isinstance(kernel, LearnableKernel):
        for name, high in kernel.upper_bounds.items():
            value = kernel.value(name)
            assert ((value >= kernel.floor) & (value <= high)).all(), (name, value)  # the domain, bounds included
    if run in ("rotary", "super-baseline"):
        assert cfg["rotary_embeddings"] and cfg["bias_kernel"] == "none"
        assert cfg["attn_window"] == (16 if run == "super-baseline" else 0)


def test_training_in_process_repeats_exactly_and_leaves_logging_as_it_was(data_bin, tmp_path):
    """What the tests above rely on: fairseq-train's main run twice in one process trains the same
    model both times (no state carried over) and logs the losses both times."""
    loggers = [logging.getLogger(), logging.getLogger("fairseq.logging.progress_bar")]
    before = [(logger.level, list(logger.handlers)) for logger in loggers]
    runs = []
    for attempt in ("first", "second"):
        losses = train_in_process(data_bin, tmp_path / attempt, 3, "--arch", "transformer_lm_kerple", *SIZE)
        state = torch.load(tmp_path / attempt / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
        runs.append((losses, state))
    (first_losses, first), (second_losses, second) = runs
    assert len(first_losses) == 3 and first_losses == second_losses
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert [(logger.level, list(logger.handlers)) for logger in loggers] == before


@pytest.mark.parametrize("trainable", [False, True], ids=["held", "learned"])
def test_bam_learns_its_location_only_when_asked(data_bin, tmp_path, trainable):
    """BAM as its reference trains it: the shape and the log-scale learned, the location held at its initial
    value unless ``--bam-loc-trainable`` (the reference's ``--theta_mu_trainable 1``), in the saved checkpoint and
    in its options, so that a resumed run holds or learns it as the first did."""
    flags = ["--bias-kernel", "bam", "--bam-loc-init", "0.3", *(["--bam-loc-trainable"] if trainable else [])]
    train_in_process(data_bin, tmp_path, 4, "--arch", "transformer_lm_kerple", *SIZE, *flags)
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    cfg = state["cfg"]["model"]
    assert cfg["bam_loc_trainable"] is trainable
    initial = build_kernel("bam", cfg["decoder_attention_heads"], argparse.Namespace(**cfg))
    assert initial.loc.requires_grad is trainable
    prefix = "decoder.attention_bias.kernel."
    for name, start in initial.state_dict().items():
        moved = not torch.equal(state["model"][prefix + name], start)
        assert moved is (name != "loc" or trainable), (name, state["model"][prefix + name], start)
