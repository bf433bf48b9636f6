"""Drawing the analyses with matplotlib (the optional ``plots`` extra).

Each function takes the numbers an analysis wrote and saves one PNG. Import
:func:`pyplot` first: it raises :class:`PlotsUnavailable` when matplotlib is missing.
"""

import logging
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

INSTALL_HINT = ("pip install 'kerple-fairseq[plots]' (from a checkout: pip install -e '.[plots]'), "
                "then rerun this command")


class PlotsUnavailable(ImportError):
    pass


def pyplot():
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's logging set-up lets its debug lines through
    try:
        import matplotlib
    except ImportError as e:
        raise PlotsUnavailable(f"matplotlib is not installed, so no figure was drawn; for figures: {INSTALL_HINT}") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    partial = f"{path}.partial.png"
    fig.savefig(partial, dpi=120, bbox_inches="tight")
    pyplot().close(fig)
    os.replace(partial, path)


#: panels of the kernel figure side by side; more go on further rows
KERNEL_PANELS_PER_ROW = 3


def kernels(panels: List[Tuple[str, np.ndarray, List[str]]], path: str) -> None:
    """One panel per checkpoint, one line per curve (head, or layer and head): ``B(d)`` against ``d``
    (finite part), with the curves' labels. Each panel has its own bias range: ALiBi's steepest head
    reaches -512 at 2048 where KERPLE-log's stay above -20."""
    plt = pyplot()
    columns = min(len(panels), KERNEL_PANELS_PER_ROW)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, curves, labels) in zip(axes.flat, panels):
        distance = np.arange(curves.shape[1])
        for label, row in zip(labels, curves):
            finite = np.isfinite(row)
            ax.plot(distance[finite], row[finite], lw=1.2, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("distance d = i - j")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2 if len(curves) > 4 else 1, loc="best")
    for row in axes:
        row[0].set_ylabel("bias B_h(d)")
    fig.tight_layout()
    _save(fig, path)


def effective_length(series: List[Tuple[str, Sequence[Optional[int]]]], xs: np.ndarray, counts: List[np.ndarray],
                     threshold: float, path: str) -> None:
    """Number of heads with effective length ``<= x`` (KERPLE Fig. 6b), one step curve per checkpoint."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for (label, _), count in zip(series, counts):
        ax.step(xs, count, where="post", label=label)
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlabel("distance x")
    ax.set_ylabel(f"heads with effective length <= x\n(smallest d with B_h(d) < {threshold:g})")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def position_wise(series: List[Tuple[str, str, np.ndarray, np.ndarray, np.ndarray]], train_lengths: Sequence[int],
                  length: int, bin_width: int, first: int, path: str) -> None:
    """Perplexity by position in a block, ``(model, curve name, perplexity at each position, bin centres,
    binned perplexity)`` per curve: left, each of the ``first`` positions (where the early-token curse
    is); right, all positions in bins of ``bin_width``. A model's second curve (its windowed reference)
    is dashed in the same colour; dotted: the training lengths."""
    plt = pyplot()
    fig, (early, whole) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1.6]})
    colours = {}
    for model, name, per_position, centres, binned in series:
        reference = model in colours
        style = {"color": colours.setdefault(model, f"C{len(colours)}"), "ls": "--" if reference else "-", "label": name}
        early.plot(np.arange(min(first, len(per_position))), per_position[:first], lw=1.1, **style)
        whole.plot(centres, binned, **style)
    for ax in (early, whole):
        for n in sorted(set(train_lengths)):
            if ax is whole or n < first:
                ax.axvline(n, color="grey", lw=0.8, ls=":")
        ax.grid(alpha=0.3)
    early.set_title(f"the first {first} positions, each", fontsize=10)
    early.set_xlabel("position in the block")
    early.set_ylabel("perplexity")
    whole.set_title(f"all {length} positions, in bins of {bin_width}", fontsize=10)
    whole.set_xlabel("position in the block (dotted: training length)")
    whole.legend(fontsize=8)
    fig.suptitle(f"Perplexity by position in blocks of L = {length} (early-token-cursed)", fontsize=11)
    fig.tight_layout()
    _save(fig, path)


def receptive_field(series: List[Tuple[str, np.ndarray, int]], mass: float, length: int, segments: int,
                    path: str) -> None:
    """Cumulative normalized gradient against the number of most recent tokens, ERF marked, for the
    last token of ``segments`` segments of ``length`` tokens."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.set_title(f"Gradient of the last prediction's loss over its L = {length} input tokens\n"
                 f"(mean over {segments} segments)", fontsize=10)
    for label, cumulative, erf in series:
        k = np.arange(1, len(cumulative) + 1)
        (line,) = ax.plot(k, cumulative, label=f"{label} (ERF {erf})")
        ax.plot([erf], [cumulative[erf - 1]], "o", color=line.get_color())
    ax.axhline(mass, color="grey", lw=0.8, ls=":")  # the ERF: the fewest recent tokens holding this share
    ax.set_xscale("log")
    ax.set_xlabel(f"most recent tokens k (dot: the ERF, the fewest holding {mass:g} of it, dotted)")
    ax.set_ylabel("cumulative normalized gradient")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def attention_by_distance(panels: List[Tuple[str, np.ndarray, List[str]]], length: int, path: str) -> None:
    """A panel per model: each line (a layer, its heads' mean) the mean weight on the key ``d`` back."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False, sharey=True)
    floor = 1e-10  # weights below it (stick-breaking's far keys reach 1e-50) would flatten every other panel
    for ax, (title, curves, names) in zip(axes[0], panels):
        d = np.arange(curves.shape[1])
        for curve, name in zip(curves, names):
            ax.plot(d + 1, curve, label=name, lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_ylim(floor, 1.5)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("distance d + 1")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean attention weight")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Attention on the key d tokens back, in segments of L = {length} (below {floor:g}: not drawn)",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, path)


#: panels of the depth map side by side (two models' two tasks); more go on further rows
DEPTH_MAP_PANELS_PER_ROW = 4


def depth_map(rows: List[Tuple[str, List[np.ndarray]]], tasks: Sequence[str], lengths: Sequence[int],
              bands: Sequence[str], path: str) -> None:
    """A needle-in-a-haystack map of each model and task: accuracy (%) by length (rows) and depth band (columns)."""
    plt = pyplot()
    panels = [(f"{label}: {task}", values) for label, maps in rows for task, values in zip(tasks, maps)]
    across = min(DEPTH_MAP_PANELS_PER_ROW, len(panels))
    down = -(-len(panels) // across)
    fig, axes = plt.subplots(down, across, figsize=(3.0 * across + 1, 2.4 * down + 0.4), squeeze=False)
    for ax, (title, values) in zip(axes.flat, panels):
        image = ax.imshow(100 * values, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        for (i, j), v in np.ndenumerate(100 * values):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=6)
        ax.set_xticks(range(len(bands)), bands, fontsize=6)
        ax.set_title(title, fontsize=8)
        ax.set_xlabel("needle's depth band (0%: the input's start)", fontsize=6)
        ax.set_ylabel("length", fontsize=6)
    for ax in axes.flat[len(panels):]:
        ax.set_axis_off()
    fig.subplots_adjust(hspace=0.6, wspace=0.35)
    fig.colorbar(image, ax=axes, shrink=0.6, label="whole-answer accuracy (%)")
    _save(fig, path)


def extrapolation(series: List[Tuple[str, str, Sequence[int], Sequence[float], Sequence[float], Sequence[float]]],
                  protocols: Sequence[str], train_lengths: Sequence[int], path: str) -> None:
    """Perplexity against evaluation length (log axis), one panel per protocol, one line per model
    (``series``: label, protocol, lengths, perplexities, and their smallest and largest over the
    model's training runs, shaded where they differ); dotted: the training lengths."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(protocols), figsize=(5.0 * len(protocols), 3.8), squeeze=False)
    colours = {}
    for ax, protocol in zip(axes[0], protocols):
        for label, p, lengths, ppl, low, high in series:
            if p == protocol:
                line, = ax.plot(lengths, ppl, marker="o", ms=3.5, lw=1.5, label=label, color=colours.get(label))
                colours[label] = line.get_color()
                if list(low) != list(high):
                    ax.fill_between(lengths, low, high, color=line.get_color(), alpha=0.2, lw=0)
        for n in sorted(set(train_lengths)):
            ax.axvline(n, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        all_lengths = sorted({n for _, p, lengths, *_ in series if p == protocol for n in lengths})
        ax.set_xticks(all_lengths)
        ax.set_xticklabels([str(n) for n in all_lengths], rotation=45 if len(all_lengths) > 6 else 0)
        ax.set_title(protocol)
        ax.set_xlabel("evaluation length L (dotted: training length)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation perplexity")
    axes[0][-1].legend(fontsize=8)
    _save(fig, path)


def leaderboard(curves: List[Tuple[str, str, str, Sequence[int], Sequence[float], Sequence[float], Sequence[float]]],
                families: Sequence[str], protocols: Sequence[str], train_length: int, reference: Optional[str],
                path: str, quantity: str = "validation perplexity", log_quantity: bool = True) -> None:
    """Perplexity against evaluation length (log axes), a row per protocol and a column per family
    (``curves``: label, family, protocol, lengths, mean perplexity over seeds, and its smallest and
    largest seed, shaded); or another ``quantity`` in their place (a retrieval task's accuracy, on a linear
    axis unless ``log_quantity``); the ``reference`` model (ALiBi) is drawn in grey in every other family's
    panels; dotted: the training length."""
    plt = pyplot()
    fig, axes = plt.subplots(len(protocols), len(families), figsize=(3.6 * len(families), 3.2 * len(protocols)),
                             squeeze=False, sharex=True)
    for row, protocol in zip(axes, protocols):
        for ax, family in zip(row, families):
            drawn = 0
            for label, f, p, lengths, mean, low, high in curves:
                if p != protocol or (f != family and label != reference):
                    continue
                if f != family:
                    ax.plot(lengths, mean, color="grey", ls="--", lw=1.2, label=label)
                    continue
                # ten colours, solid and then dash-dotted with square markers: a crowded family stays readable
                second = drawn % 20 >= 10
                line, = ax.plot(lengths, mean, marker="s" if second else "o", ms=3, lw=1.5, label=label,
                                color=plt.cm.tab10(drawn % 10), ls="-." if second else "-")
                drawn += 1
                ax.fill_between(lengths, low, high, color=line.get_color(), alpha=0.2, lw=0)
            ax.axvline(train_length, color="grey", ls=":", lw=1)
            ax.set_xscale("log", base=2)
            if log_quantity:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
                ax.yaxis.set_minor_formatter(plt.matplotlib.ticker.ScalarFormatter())
            all_lengths = sorted({n for _, _, _, lengths, *_ in curves for n in lengths})
            ax.set_xticks(all_lengths)
            ax.set_xticklabels([str(n) for n in all_lengths], rotation=45 if len(all_lengths) > 4 else 0)
            ax.xaxis.set_minor_locator(plt.matplotlib.ticker.NullLocator())
            ax.set_title(f"{family}\n{protocol}", fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7 if drawn <= 8 else 5.5, ncol=1 if drawn <= 8 else 2)
        row[0].set_ylabel(quantity)
    for ax in axes[-1]:
        ax.set_xlabel("evaluation length L")
    seeds = ("Mean over seeds; shaded: the smallest to the largest seed" if any(list(low) != list(high) for
             *_, low, high in curves) else "One seed")
    fig.suptitle(f"{seeds}; dashed grey: the reference in other families' panels; dotted: the training length",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def ranks_at_two_lengths(lines: Dict[str, List[Tuple[str, str, int, int, bool]]], lengths: Sequence[Tuple[int, int]],
                         families: Sequence[str], path: str) -> None:
    """A panel per protocol: each model's rank at the longest length when trained at each of two lengths
    (``lengths``: each training length and the longest evaluated; ``lines``: label, family, the two ranks, and whether it is in a pair that swaps
    order with both lengths resolving it, drawn bold), coloured by family (each of ``families`` its own colour,
    the legend naming those drawn); crossing lines are swaps."""
    plt = pyplot()
    most = max(len(ls) for ls in lines.values())
    fig, axes = plt.subplots(1, len(lines), figsize=(6.2 * len(lines), 0.24 * most + 1.6), squeeze=False)
    colour = {family: plt.cm.tab10(k) for k, family in enumerate(families)}
    for ax, (protocol, models) in zip(axes[0], lines.items()):
        for label, family, before, after, reversed_ in models:
            ax.plot([0, 1], [before, after], color=colour[family], lw=2.4 if reversed_ else 1.0,
                    alpha=1.0 if reversed_ else 0.55, marker="o", ms=3)
            ax.text(-0.04, before, f"{label} {before}", ha="right", va="center", fontsize=7, color=colour[family])
            ax.text(1.04, after, f"{after} {label}", ha="left", va="center", fontsize=7, color=colour[family])
        ax.set_xlim(-0.9, 1.9)
        ax.set_ylim(most + 0.7, 0.3)
        ax.set_xticks([0, 1])
        ax.set_xticklabels([f"trained at {n}\nrank at {longest}" for n, longest in lengths], fontsize=8)
        ax.set_yticks([])
        for side in ("left", "right", "top"):
            ax.spines[side].set_visible(False)
        ax.set_title(protocol, fontsize=10)
    drawn = [f for f in families if any(line[1] == f for models in lines.values() for line in models)]
    handles = [plt.Line2D([], [], color=colour[f], lw=2, label=f) for f in drawn]
    fig.legend(handles=handles, loc="lower center", ncol=len(drawn), fontsize=8, frameon=False)
    fig.suptitle("Rank at the longest length, trained at two lengths; bold: in a pair whose order reverses, "
                 "resolved at both", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    _save(fig, path)
