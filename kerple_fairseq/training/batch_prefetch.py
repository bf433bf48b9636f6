"""fairseq's batch prefetching thread stopped before the interpreter exits.

fairseq's ``BufferedIterator`` (``--data-buffer-size``, 10 by default) collates the next batches in
a daemon thread (``BackgroundConsumer``). When training stops before its epoch ends (``--max-update``,
which is how most runs end), that thread is still collating as the interpreter exits. Python 3.11
ends a daemon thread that wakes during finalization with ``pthread_exit``; unwinding it through
PyTorch's C++ (a frame that re-takes the GIL and may not throw) calls ``std::terminate``, and a run
that trained and saved its checkpoints exits with SIGABRT ("terminate called without an active
exception"), which job scripts read as a failed run. Each consumer now ends at its next batch when
the process exits (an ``atexit`` handler, which runs while daemon threads still run normally), its
queue emptied so that it is not left waiting to put one. A consumer that does not end within
:data:`STOP_SECONDS` (a data loader blocked on a lost worker) is left as fairseq leaves it.
"""

import atexit
import queue
import threading
import time
import weakref

from fairseq.data import iterators

STOP_SECONDS = 60.0

_running = weakref.WeakSet()  # the consumers started in this process


def _until_stopped(stop: threading.Event, source):
    """``source``'s items, ending before the next one once ``stop`` is set."""
    items = iter(source)
    while not stop.is_set():
        try:
            item = next(items)
        except StopIteration:
            return
        yield item


def _stoppable(init):
    def __init__(self, buffer, source, max_len, cuda_device):
        self.stopping = threading.Event()
        init(self, buffer, _until_stopped(self.stopping, source), max_len, cuda_device)
        _running.add(self)

    __init__.kerple_fairseq = True
    return __init__


def stop_prefetching(timeout: float = STOP_SECONDS) -> None:
    """End every running consumer at its next batch, emptying its queue until it has ended."""
    consumers = [consumer for consumer in list(_running) if consumer.is_alive()]
    for consumer in consumers:
        consumer.stopping.set()
    deadline = time.monotonic() + timeout
    for consumer in consumers:
        while consumer.is_alive() and time.monotonic() < deadline:
            _empty(consumer._queue)
            consumer.join(0.05)


def _empty(buffer: queue.Queue) -> None:
    """Take every item ``buffer`` holds now, so that a consumer waiting to put one goes on."""
    try:
        while True:
            buffer.get_nowait()
    except queue.Empty:
        pass


def install_prefetch_stopped_at_exit() -> None:
    consumer = iterators.BackgroundConsumer
    if not getattr(consumer.__init__, "kerple_fairseq", False):
        consumer.__init__ = _stoppable(consumer.__init__)
        atexit.register(stop_prefetching)
