"""The figures say what they show: each kernel panel on its own bias range with its own legend and a
title that names the kernel once; the position-wise figure shows the first positions one by one and
states its bin width; the receptive-field figure states L."""

import numpy as np
import pytest

from kerple_fairseq.analysis import figures
from kerple_fairseq.analysis.commands.kernels import panel_title


@pytest.fixture
def drawn(monkeypatch):
    """The matplotlib figure a drawing function made, instead of its PNG."""
    made = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: made.append(fig))
    yield made
    for fig in made:
        figures.pyplot().close(fig)


def test_each_kernel_panel_has_its_own_range_and_legend(drawn):
    d = np.arange(2049, dtype=float)
    alibi = -np.array([0.25, 0.0625]).reshape(2, 1) * d
    kerple_log = -np.array([2.0, 1.5]).reshape(2, 1) * np.log1p(0.7 * d)  # -15.6 ... 0
    heads = ["head 1", "head 2"]
    figures.kernels([("alibi", alibi, heads), ("kerple_log", kerple_log, ["layer 1 head 1", "layer 2 head 1"])],
                    "unused.png")
    left, right = drawn[0].axes
    assert left.get_ylim()[0] < -500 and right.get_ylim()[0] > -20  # KERPLE-log's curves fill their panel
    assert right.get_ylim()[0] < kerple_log.min() and right.get_ylim()[1] > 0
    assert [[t.get_text() for t in ax.get_legend().get_texts()] for ax in (left, right)] == [
        heads, ["layer 1 head 1", "layer 2 head 1"]]
    assert [ax.get_title() for ax in (left, right)] == ["alibi", "kerple_log"]


@pytest.mark.parametrize("label, kernel, window, title", [
    ("alibi", "alibi", 0, "alibi"),
    ("sinusoidal", "none", 0, "sinusoidal (kernel none)"),
    ("kerple_log", "kerple_log", 512, "kerple_log (window 512)"),
    ("run-3", "t5", 64, "run-3 (kernel t5, window 64)"),
])
def test_kernel_panel_titles_name_the_kernel_once(label, kernel, window, title):
    assert panel_title(label, kernel, window) == title


def test_position_wise_shows_the_first_positions_and_its_bin_width(drawn):
    per_position = np.linspace(300.0, 150.0, 2048)
    per_position[0] = 298.0
    centres, binned = np.arange(16, 2048, 32, dtype=float), np.full(64, 160.0)
    figures.position_wise([("alibi", "alibi", per_position, centres, binned)], [64], 2048, 32, 64, "unused.png")
    early, whole = drawn[0].axes
    x, y = early.get_lines()[0].get_data()
    assert x[0] == 0 and y[0] == 298.0 and len(x) == 64  # position 0 itself, not a bin's mean
    assert "bins of 32" in whole.get_title() and "2048" in drawn[0]._suptitle.get_text()
    dotted = [line.get_xdata()[0] for ax in (early, whole) for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert dotted == [64]  # the training length, marked where it lies inside a panel


def test_receptive_field_states_the_length(drawn):
    cumulative = np.linspace(0.4, 1.0, 1024)
    figures.receptive_field([("alibi", cumulative, 900)], 0.99, 1024, 32, "unused.png")
    title = drawn[0].axes[0].get_title()
    assert "L = 1024" in title and "32 segments" in title


def test_more_than_three_kernel_panels_go_on_further_rows(drawn):
    curve = -np.arange(10, dtype=float)[None]
    figures.kernels([(f"m{n}", curve, ["head 1"]) for n in range(4)], "unused.png")
    visible = [ax for ax in drawn[0].axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["m0", "m1", "m2", "m3"]
    assert len(drawn[0].axes) == 6 and visible[3].get_position().y0 < visible[0].get_position().y0


def test_depth_map_draws_each_model_and_task_with_its_cells(drawn):
    """Three models' two tasks: four panels a row, the fifth and sixth on a second, the last two axes off;
    each cell's percentage written where the image puts it."""
    values = np.arange(12, dtype=float).reshape(3, 4) / 11
    rows = [(f"model {k}", [values, 1 - values]) for k in range(3)]
    figures.depth_map(rows, ["mqar", "passkey"], [64, 128, 256], ["0-25%", "25-50%", "50-75%", "75-100%"],
                      "unused.png")
    panels = [ax for ax in drawn[0].axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == [f"model {k}: {t}" for k in range(3) for t in ("mqar", "passkey")]
    assert sum(not ax.axison for ax in drawn[0].axes) == 2
    texts = {(t.get_position(), t.get_text()) for t in panels[1].texts}
    assert ((3, 2), "0") in texts and ((0, 0), "100") in texts  # passkey: 1 - values, row = length, column = band
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["64", "128", "256"]
