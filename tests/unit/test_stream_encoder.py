"""The streaming encoder's next batch: it launches a batch before it finishes the last one, but waits for another
only while the device still runs that one, so a worker waiting for its codes before it sends more never hangs."""

import queue
import threading

from wampipe.preprocess.stream import _DEVICE_IDLE, _next_prepared


def test_nothing_pending_waits_for_the_next_batch():
    prepared: queue.Queue = queue.Queue()
    threading.Timer(0.05, prepared.put, args=("batch",)).start()
    assert _next_prepared(prepared, None) == "batch"


def test_with_a_batch_on_the_device_an_empty_queue_waits_only_while_it_runs():
    prepared: queue.Queue = queue.Queue()
    assert _next_prepared(prepared, lambda: False) is _DEVICE_IDLE  # the device is done: its codes go first
    polls = iter([True, True, False])  # the device runs the pending batch for two more polls
    assert _next_prepared(prepared, lambda: next(polls)) is _DEVICE_IDLE
    threading.Timer(0.05, prepared.put, args=("batch",)).start()
    assert _next_prepared(prepared, lambda: True) == "batch"  # one coming is launched before the pending one ends
    prepared.put(None)  # the end of the work is taken like a batch
    assert _next_prepared(prepared, lambda: True) is None
