"""fairseq's batch prefetching thread (``BufferedIterator``'s ``BackgroundConsumer``) ends before the
interpreter exits, so a run that stops before its epoch ends exits with its own status, not SIGABRT."""

import subprocess
import sys

import pytest
from fairseq.data.iterators import BufferedIterator

import kerple_fairseq  # noqa: F401  (its changes to fairseq)
from kerple_fairseq.training.batch_prefetch import stop_prefetching

from conftest import REPO

# the next batches of a stopped epoch, still being collated in torch when the process exits
STOPPED_EPOCH = """
import sys, torch
sys.path.insert(0, {repo!r})
import kerple_fairseq
from fairseq.data.iterators import BufferedIterator

class Batches:
    def __len__(self):
        return 10 ** 9

    def __iter__(self):
        x = torch.randn(256, 256)
        while True:
            for _ in range(10):
                x = (x @ x).tanh()
            yield x

batches = BufferedIterator(10 ** 6, Batches())
next(batches)
print("took a batch", flush=True)
"""


@pytest.mark.slow
def test_a_process_exiting_while_batches_are_collated_exits_with_its_own_status():
    # Without the change each such process aborted: "terminate called without an active exception", -6
    processes = [subprocess.Popen([sys.executable, "-c", STOPPED_EPOCH.format(repo=str(REPO))],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert (process.returncode, out) == (0, "took a batch\n"), err[-3000:]
        assert "terminate called" not in err


def test_every_batch_comes_through_until_prefetching_is_stopped():
    batches = BufferedIterator(2, range(25))
    assert list(batches) == list(range(25))

    batches = BufferedIterator(2, range(10 ** 6))
    assert [next(batches) for _ in range(3)] == [0, 1, 2]
    consumer = batches._consumer
    assert consumer.is_alive(), "waiting to put a batch in the full queue"
    stop_prefetching(timeout=30)
    assert not consumer.is_alive()
