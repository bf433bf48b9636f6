"""The committed boards (``results/leaderboard``, trained at 64, and ``results/leaderboard-256``), recomputed from
their committed span losses: no verdict changes with the bootstrap's seed."""

import pytest

from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS
from kerple_fairseq.experiments.small_comparison import board_of, evaluated_in

from conftest import REPO

pytestmark = pytest.mark.slow  # 20 boards of 576 comparisons each


@pytest.mark.parametrize("board", ["leaderboard", "leaderboard-256"])
def test_no_verdict_depends_on_the_bootstrap_seed(board):
    runs, records, lengths = evaluated_in(REPO / "results" / board, list(POSITION_ENCODINGS))
    assert len(runs) == 90 and len(lengths) == 1, "30 encodings, 3 seeds, one training length"
    verdicts = {}
    for seed in range(1, 21):
        built, _ = board_of(runs, records, next(iter(lengths)), bootstrap_seed=seed)
        assert len(built.versus) == 576
        for v in built.versus:
            verdicts.setdefault((v.model, v.reference, v.protocol, v.length), set()).add(v.verdict)
    changing = {pair: found for pair, found in verdicts.items() if len(found) > 1}
    assert not changing, changing
    resolved = sum(found == {"resolved"} for found in verdicts.values())
    assert 0 < resolved < len(verdicts)
