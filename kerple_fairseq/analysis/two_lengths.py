"""Does the order hold at another training length? Two leaderboards of the same models, trained alike
but for the training length, seen together.

Each model is ranked among the models both boards hold, by its mean perplexity at each board's
longest length (32 times its training length in the small comparison), and its change from the
training length to there is set beside it. A pair *swaps* when one model is ahead at one training
length and behind at the other (under the same protocol). For each swap, each board's own paired
comparison of the two (the later model minus the earlier one, seed by seed over the seeds both have,
:func:`leaderboard.paired`) says whether that board resolves its order: a swap resolved at both
lengths is a finding that changed with the training length; one resolved at one length only is an
order that the other length does not confirm; one resolved at neither is noise at both. Ranks come from
each model's mean over its own seeds, so where two models have different seeds a board's paired
comparison can resolve the order opposite to its ranks: the pair keeps one order on the seeds both have,
and the swap is the unequal seeds'.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from kerple_fairseq.analysis import significance
from kerple_fairseq.analysis.leaderboard import RESOLVED, Leaderboard, Scores, Versus, paired

BOTH, NEITHER = "reversed (resolved at both)", "resolved at neither"
SAME_ORDER = "same order on the seeds both have (resolved at L_train={})"


@dataclass
class Swap:
    protocol: str
    ahead: str  # ahead of ``behind`` at the shorter training length, behind it at the longer
    behind: str
    versus: List[Versus]  # ``behind`` − ``ahead`` at each board's longest length, the shorter training length first
    train_lengths: Tuple[int, int]  # the boards'

    @property
    def finding(self) -> str:
        # each board's ranks put ``behind`` after ``ahead`` at the shorter length, before it at the longer
        said = [0 if v.verdict != RESOLVED else 1 if sign * sum(v.difference) > 0 else -1
                for v, sign in zip(self.versus, (1, -1))]
        if -1 in said:
            return SAME_ORDER.format(self.train_lengths[said.index(-1)])
        resolved = [s == 1 for s in said]
        if all(resolved):
            return BOTH
        if not any(resolved):
            return NEITHER
        return f"resolved at L_train={self.train_lengths[resolved.index(True)]} only"


@dataclass
class TwoLengths:
    boards: Tuple[Leaderboard, Leaderboard]  # the shorter training length first
    models: List[str]  # those both boards hold, in the shorter board's order
    swaps: List[Swap] = field(default_factory=list)

    @property
    def protocols(self) -> List[str]:
        return [p for p in self.boards[0].protocols if p in self.boards[1].protocols]

    def ranks(self, k: int, protocol: str) -> Dict[str, int]:
        """Board ``k``'s ranks at its longest length among :attr:`models` (1: lowest mean)."""
        board = self.boards[k]
        return board.ranks(protocol, board.longest, among=self.models)


def build(short: Leaderboard, long_: Leaderboard, short_scores: Scores, long_scores: Scores,
          samples: int = significance.BOARD_SAMPLES, bootstrap_seed: int = 1, confidence: float = 0.95) -> TwoLengths:
    """Both boards seen together (``short`` trained at the shorter length); ``*_scores(name, seed)`` give
    each board's span losses, from which each swap is compared."""
    if short.train_length > long_.train_length:
        short, long_, short_scores, long_scores = long_, short, long_scores, short_scores
    in_long = {e.name for e in long_.entrants}
    view = TwoLengths((short, long_), [e.name for e in short.entrants if e.name in in_long])
    for protocol in view.protocols:
        before, after = view.ranks(0, protocol), view.ranks(1, protocol)
        for i, a in enumerate(view.models):
            for b in view.models[i + 1:]:
                if (before[a] - before[b]) * (after[a] - after[b]) >= 0:
                    continue
                ahead, behind = (a, b) if before[a] < before[b] else (b, a)
                versus = [paired(behind, ahead, protocol, board.longest,
                                 sorted(set(board.seeds_of(ahead)) & set(board.seeds_of(behind))), scores,
                                 samples, bootstrap_seed, confidence)
                          for board, scores in ((short, short_scores), (long_, long_scores))]
                view.swaps.append(Swap(protocol, ahead, behind, versus, (short.train_length, long_.train_length)))
    return view


def _labels(view: TwoLengths) -> Dict[str, str]:
    return {e.name: e.label for board in view.boards for e in board.entrants}


def _ppl(board: Leaderboard, name: str, protocol: str, length: int) -> str:
    return f"{board.mean(name, protocol, length):.2f}"


def markdown(view: TwoLengths, protocol: str) -> str:
    """Each model's rank, perplexity and change to the longest length at both training lengths, best
    first at the longer; then every swap with both boards' paired differences and verdicts."""
    short, long_ = view.boards
    n0, n1 = short.train_length, long_.train_length
    labels = _labels(view)
    before, after = view.ranks(0, protocol), view.ranks(1, protocol)
    lines = [f"| model | rank, L_train={n0} | rank, L_train={n1} | L={short.longest} (L_train={n0}) | "
             f"L={long_.longest} (L_train={n1}) | {n0} → {short.longest} | {n1} → {long_.longest} |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted(view.models, key=lambda m: (after[m], before[m])):
        lines.append(f"| {labels[name]} | {before[name]} | {after[name]} | {_ppl(short, name, protocol, short.longest)} | "
                     f"{_ppl(long_, name, protocol, long_.longest)} | {100 * short.change(name, protocol):+.1f}% | "
                     f"{100 * long_.change(name, protocol):+.1f}% |")
    swaps = sorted((s for s in view.swaps if s.protocol == protocol),
                   key=lambda s: (s.finding != BOTH, before[s.ahead], before[s.behind]))
    if not swaps:
        return "\n".join(lines + ["", "No pair swaps order."])
    lines += ["", f"| ahead at L_train={n0} | behind at L_train={n0} | second − first at L={short.longest} "
              f"(L_train={n0}) | at L={long_.longest} (L_train={n1}) | finding |", "|---|---|---|---|---|"]
    for s in swaps:
        cells = [f"{sum(v.difference) / len(v.difference):+.2f}, {v.verdict} ({len(v.seeds)} seed"
                 f"{'s' * (len(v.seeds) != 1)})" if v.seeds else "no common seed" for v in s.versus]
        lines.append(f"| {labels[s.ahead]} | {labels[s.behind]} | {cells[0]} | {cells[1]} | {s.finding} |")
    return "\n".join(lines)


def counts(view: TwoLengths, protocol: str) -> Dict[str, int]:
    """How many swaps under ``protocol`` come to each finding."""
    found: Dict[str, int] = {}
    for s in view.swaps:
        if s.protocol == protocol:
            found[s.finding] = found.get(s.finding, 0) + 1
    return found


def csv_rows(view: TwoLengths) -> Tuple[List[str], List[list]]:
    """A row per model, protocol and training length: its seeds, mean perplexity at the training length
    and at the longest, the change, and its rank among the models of both boards."""
    header = ["model", "label", "family", "protocol", "train_length", "longest", "seeds", "ppl_train_length",
              "ppl_longest", "change", "rank_longest"]
    labels = _labels(view)
    families = {e.name: e.family for e in view.boards[0].entrants}
    rows = []
    for protocol in view.protocols:
        for k, board in enumerate(view.boards):
            ranks = view.ranks(k, protocol)
            for name in view.models:
                rows.append([name, labels[name], families[name], protocol, board.train_length, board.longest,
                             ";".join(map(str, board.seeds_of(name))),
                             repr(board.mean(name, protocol, board.train_length)),
                             repr(board.mean(name, protocol, board.longest)), repr(board.change(name, protocol)),
                             ranks[name]])
    return header, rows


def swap_csv_rows(view: TwoLengths) -> Tuple[List[str], List[list]]:
    """A row per swap and training length: the pair, the seeds compared, the differences and intervals
    (``;``-separated by seed; the wider of the bootstrap's and the t-interval), the units resampled, the verdict
    there and the finding."""
    header = ["protocol", "ahead", "behind", "train_length", "length", "compared_seeds", "difference_by_seed",
              "interval_by_seed", "units", "verdict", "finding"]
    rows = []
    for s in view.swaps:
        for board, v in zip(view.boards, s.versus):
            rows.append([s.protocol, s.ahead, s.behind, board.train_length, v.length, ";".join(map(str, v.seeds)),
                         ";".join(map(repr, v.difference)),
                         ";".join(f"{low:.10g}/{high:.10g}" for low, high in v.interval), v.units, v.verdict,
                         s.finding])
    return header, rows


def figure_lines(view: TwoLengths, protocol: str) -> List[Tuple[str, str, int, int, bool]]:
    """The figure's lines under ``protocol``: label, family, rank at each training length, and whether the
    model is in a swap resolved at both."""
    before, after = view.ranks(0, protocol), view.ranks(1, protocol)
    reversed_ = {m for s in view.swaps if s.protocol == protocol and s.finding == BOTH for m in (s.ahead, s.behind)}
    labels, families = _labels(view), {e.name: e.family for e in view.boards[0].entrants}
    return [(labels[m], families[m], before[m], after[m], m in reversed_) for m in view.models]

