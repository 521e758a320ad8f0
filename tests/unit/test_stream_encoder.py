"""The streaming encoder's next batch: it launches a batch before it finishes the last one, but waits for another
only while the device still runs that one, so a worker waiting for its codes before it sends more never hangs."""

import queue
import threading

from wampipe.preprocess.stream import _DEVICE_IDLE, _next_prepared


def test_nothing_pending_waits_for_the_next_batch():
    prepared: queue.Queue = queue.Queue()
    threading.Timer(0.05, prepared.put, args=("batch",)).start()
    assert _next_prepared(prepared, None) == "batch"


def test_with_a_finished_batch_pending_an_empty_queue_lets_its_codes_go_first():
    prepared: queue.Queue = queue.Queue()
    assert _next_prepared(prepared, True) is _DEVICE_IDLE  # True: a CPU launch, which has run already
    prepared.put("batch")
    assert _next_prepared(prepared, True) == "batch"  # one ready is launched before the pending one finishes
    prepared.put(None)  # the end of the work is taken like a batch
    assert _next_prepared(prepared, True) is None
