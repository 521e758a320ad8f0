"""The streaming executor: CPU workers decode, window and transform; encoder processes hold the frozen encoders for
the whole run and encode batch after batch; bounded queues in between.

    units ──► CPU worker 0..W-1 ──(video batches, bounded queue)──► encoder process per device ──► back to the worker
              (decode, windows, views;                              (VAE, CLIP, y: loaded once,
               tar members, unit spill)                              busy as long as batches wait)

A worker cuts its unit's samples into batches exactly as `pipeline.encode_samples` does (`batch_size` in arrival
order, the last one short), so every batch an encoder sees is one the in-process path would have formed: the stored
bits do not depend on the executor, the number of workers or which device of the same kind took a batch. A worker
keeps a few batches in flight, so it decodes the next episode while its last batches are being encoded; the request
queue holds at most two batches per encoder and worker, which bounds memory and makes decoders wait for a busy GPU
(backpressure) instead of piling up videos. The workers start once the encoder processes have imported their
libraries, and run at a lower priority, so an encoder's start and its batch preparation get the cores first. Every
child dies with the run (PR_SET_PDEATHSIG): none writes after its parent was killed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch
from tqdm import tqdm

from wampipe.errors import UsageError
from wampipe.errors import WampipeError
from wampipe.preprocess import write
from wampipe.preprocess.errors import OutOfSpace, out_of_space
from wampipe.preprocess.tasks import ChildDied, die_with_parent, leave_child, thread_only_progress_lock
from wampipe.preprocess.pipeline import Encoders, WindowSample, stack_clips, timed, unit_report, unit_samples
from wampipe.preprocess.spec import BuildSpec
from wampipe.shardformat.members import encode_sample

IN_FLIGHT = 2  # batches a worker submits before it waits for the oldest one's codes
POLL_S = 1.0
IMPORT_WAIT_S = 120.0  # the longest the CPU workers wait for the encoder processes' imports
# The queues of every run, referenced until the process exits (a few pipes per run). Why: a queue freed before the
# exit leaves its feeder thread holding the last references to its semaphores; the thread then frees them itself,
# and when the interpreter exits meanwhile (a failed run, a last unit) it can be frozen between unlinking one and
# telling the resource tracker, which then warns about a leaked semaphore after the run's last line. Kept alive,
# the queues' semaphores are freed by the exit handler in the main thread.
_RUN_QUEUES: list = []


def encoder_devices(device: str) -> list[str]:
    """`cuda` = every local GPU, one encoder process each; `cuda:N` or `cpu` = that device alone. A GPU that is not
    visible is refused in one line naming the flag."""
    if device == "cpu":
        return [device]
    count = torch.cuda.device_count()
    if count == 0:
        raise UsageError(f"--device {device}: no CUDA device is visible")
    if device == "cuda":
        return [f"cuda:{i}" for i in range(count)]
    if int(device.partition(":")[2]) >= count:
        raise UsageError(f"--device {device}: only {count} CUDA device{'s are' if count > 1 else ' is'} visible")
    return [device]


WORKER_NICENESS = 10  # a CPU worker's scheduling priority below the encoder processes' (os.nice)


def run_stream(spec: BuildSpec, units: dict[int, list[int]], workers: int) -> Iterator[dict]:
    """Process {unit: episodes} with `workers` CPU workers and one encoder process per device of `spec.device`;
    yields each unit's record as its spill is complete. A failure anywhere stops every process and is raised here."""
    if not units:
        return
    ctx = torch.multiprocessing.get_context("spawn")  # torch and the decoders are not fork-safe
    devices = encoder_devices(spec.device)
    workers = max(1, min(workers, len(units)))
    todo, requests, results = ctx.Queue(), ctx.Queue(maxsize=IN_FLIGHT * max(workers, len(devices))), ctx.Queue()
    replies = [ctx.Queue() for _ in range(workers)]
    todo.cancel_join_thread()  # a run that stops before its workers took every unit must still exit
    for item in units.items():
        todo.put(item)
    for _ in range(workers):
        todo.put(None)
    parent = os.getpid()
    started = time.time()
    encoders = [
        ctx.Process(
            target=_encoder_main,
            args=(spec, d, requests, replies, results, parent, started),
            daemon=True,
            name=f"encoder-{d}",
        )
        for d in devices
    ]
    cpu = [
        ctx.Process(
            target=_worker_main,
            args=(spec, w, todo, requests, replies[w], results, parent),
            daemon=True,
            name=f"cpu-worker-{w}",
        )
        for w in range(workers)
    ]
    for p in encoders:
        p.start()
    failed = True  # until every unit is in: then the children are stopped, else killed at once
    try:
        # the CPU workers start once every encoder process has imported its libraries (or after IMPORT_WAIT_S):
        # dozens of workers importing torch and decoding at once slowed four encoder processes' imports from ~5 to
        # 15 s, and the workers are far ahead of the encoders anyway
        waiting, until = len(encoders), time.monotonic() + IMPORT_WAIT_S
        while waiting and time.monotonic() < until:
            kind, payload = _next_result(results, encoders)
            waiting -= kind == "imported"
            if kind == "info":
                tqdm.write(payload)
        for p in cpu:
            p.start()
        remaining = len(units)
        while remaining:
            kind, payload = _next_result(results, encoders + cpu)
            if kind == "info":
                tqdm.write(payload)
            if kind == "unit":
                remaining -= 1
                yield payload
        failed = False
    finally:
        for _ in encoders:
            try:
                requests.put(None, timeout=0 if failed else POLL_S)
            except queue.Full:
                pass
        deadline = time.monotonic() + (0 if failed else 30)
        for p in cpu + encoders:
            if p.pid is None:  # a worker not started: the run stopped while the encoders imported
                continue
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        _RUN_QUEUES.extend([todo, requests, results, *replies])


def _next_result(results, processes: list) -> tuple[str, Any]:
    """The next (kind, payload) a child sent, "idle" after POLL_S without one; raises a child's error, and names a
    child that died without a word."""
    try:
        kind, payload = results.get(timeout=POLL_S)
    except queue.Empty:
        dead = [p for p in processes if p.exitcode not in (None, 0)]
        if dead:
            raise ChildDied(dead[0].name, dead[0].exitcode)
        return "idle", None
    if kind == "error":
        raise payload
    return kind, payload


def _report_failure(results, where: str, err: BaseException, out: str = "") -> None:
    """Bad input and a full disk travel as themselves (the CLI prints its one line); anything else as the child's
    traceback."""
    if out_of_space(err):
        err = OutOfSpace.from_os_error(err, f"{out}: " if out else "")
    elif not isinstance(err, WampipeError):
        err = RuntimeError(f"{where}: {''.join(traceback.format_exception(err))}")
    results.put(("error", err))


def _encoder_main(spec: BuildSpec, device: str, requests, replies, results, parent: int, started: float) -> None:
    """Load the encoders once; encode each request's batch and send the codes back to its worker. A thread takes
    the next request and prepares it (CLIP's resize on the host, the copy to the device on a side stream) while the
    device runs the current one, and each batch is launched before the previous one's codes are checked and sent, so
    the device does not wait on the host between batches."""
    die_with_parent(parent)
    thread_only_progress_lock()
    torch.set_num_threads(spec.threads_per_worker)  # a CPU encoder's reductions (and so the stored bits) depend on it
    try:
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(device)
        loading = time.time()
        encoders = Encoders(
            replace(spec, device=device), on_imported=lambda: results.put(("imported", device))
        )  # the run starts its workers then
        split = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in encoders.start_seconds.items())
        if encoders.compiled_graphs:
            split += f"; {encoders.compiled_graphs}"
        results.put(
            (
                "info",
                f"encoders on {device}: ready {time.time() - started:.1f} s after the run started "
                f"it (process start {loading - started:.1f} s, loading {time.time() - loading:.1f} s: "
                f"{split})",
            )
        )
        prepared: queue.Queue = queue.Queue(maxsize=1)
        spent: dict[str, float] = dict.fromkeys(
            ("encoding", "waiting for a prepared batch", "preparing", "waiting for work"), 0.0
        )
        threading.Thread(target=_prepare_ahead, args=(encoders, requests, prepared, cuda, spent), daemon=True).start()
        batches = 0
        pending = None  # (worker, seq, launched): the batch on the device while the next one is launched

        def send_pending() -> None:
            nonlocal batches
            assert pending is not None
            worker, seq, launched = pending
            replies[worker].put((seq, encoders.finish(launched)))  # waits for its copy to the host
            batches += 1

        while True:
            # with a batch on the device the wait is the device's time; without one the device waits on the host
            with timed(spent, "waiting for a prepared batch" if pending is None else "encoding"):
                item = _next_prepared(prepared, None if pending is None else _still_running(pending[2].done))
            if isinstance(item, BaseException):
                raise item
            with timed(spent, "encoding"):
                if item is _DEVICE_IDLE:  # no batch came while the device ran the last one: its codes go now
                    send_pending()
                    pending = None
                    continue
                launched = None
                if item is not None:
                    worker, seq, inputs, ready = cast(tuple, item)
                    if ready is not None:
                        torch.cuda.current_stream().wait_event(ready)
                        for tensor in inputs.values():
                            tensor.record_stream(torch.cuda.current_stream())  # made on the side stream
                    with torch.inference_mode():
                        launched = (worker, seq, encoders.launch(inputs))
                if pending is not None:  # the previous batch's codes, while the device runs this one
                    send_pending()
                pending = launched
                if pending is not None and pending[2].done is None:  # a CPU launch has run: nothing to overlap
                    send_pending()
                    pending = None
            if item is None:
                break
        # where the encoder process's time went: a device waiting on preparation or on the CPU workers shows here
        peak = f"; peak {torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB reserved" if cuda else ""
        print(
            f"encoder on {device}: {batches} batches; " + ", ".join(f"{k} {v:.1f} s" for k, v in spent.items()) + peak,
            flush=True,
        )
    except BaseException as err:  # noqa: BLE001 — reported to the run, which stops every process
        _report_failure(results, f"encoder on {device}", err)
    leave_child(results)  # every reply was taken: the workers wait for theirs before they finish


_DEVICE_IDLE = object()  # what _next_prepared gives when the device finished its batch before another came


def _still_running(done: torch.cuda.Event | None) -> Callable[[], bool]:
    return lambda: done is not None and not done.query()  # None: a CPU launch, which has run already


def _next_prepared(prepared: queue.Queue, running: Callable[[], bool] | None):
    """The next prepared batch. While the device runs a launched batch (`running()` true), only as long as it runs
    it: then _DEVICE_IDLE, and its codes go to their worker first (the worker may be waiting for them before it
    sends another batch)."""
    if running is None:
        return prepared.get()
    while True:
        try:
            return prepared.get(timeout=0.002)
        except queue.Empty:
            if not running():
                return _DEVICE_IDLE


def _prepare_ahead(encoders: Encoders, requests, prepared: queue.Queue, cuda: bool, spent: dict[str, float]) -> None:
    if cuda:  # a thread starts on the first GPU: its copies and its side stream belong on the encoders' one
        torch.cuda.set_device(encoders.device)
    side = torch.cuda.Stream(encoders.device) if cuda else None
    try:
        while True:
            with timed(spent, "waiting for work"):
                request = requests.get()
            if request is None:
                break
            worker, seq, batch = request
            with (
                timed(spent, "preparing"),
                torch.inference_mode(),
                torch.cuda.stream(side) if cuda else contextlib.nullcontext(),
            ):
                inputs = encoders.prepare(batch)
                ready = torch.cuda.Event() if cuda else None
                if ready is not None:
                    ready.record(side)
            prepared.put((worker, seq, inputs, ready))
        prepared.put(None)
    except BaseException as err:  # noqa: BLE001 — raised in the encoder's main thread
        prepared.put(err)


def _worker_main(spec: BuildSpec, worker: int, todo, requests, replies, results, parent: int) -> None:
    """Take units until the queue says stop; spill each one with codes from the encoder processes."""
    die_with_parent(parent)
    thread_only_progress_lock()
    # the encoder processes first when every core is busy: their start (imports, compiling) and the batches they
    # prepare for the device; a worker is ahead of them anyway and then waits on the bounded request queue. Before
    # any thread starts: on Linux a thread takes its creator's niceness when made, later changes are its own
    os.nice(WORKER_NICENESS)
    torch.set_num_threads(spec.threads_per_worker)  # the views' resize rounds differently with another thread count
    try:
        while (item := todo.get()) is not None:
            unit, episodes = item
            results.put(("unit", _stream_unit(spec, unit, episodes, worker, requests, replies)))
    except BaseException as err:  # noqa: BLE001
        _report_failure(results, f"CPU worker {worker}", err, str(spec.out))
    leave_child(results)  # every request was answered (on failure the run stops every process)


def _stream_unit(spec: BuildSpec, unit: int, episodes: list[int], worker: int, requests, replies) -> dict:
    counter = itertools.count()
    arrived: dict[int, dict[str, torch.Tensor]] = {}

    def submit(batch: dict[str, torch.Tensor]) -> int:
        seq = next(counter)
        requests.put((worker, seq, batch))
        return seq

    def collect(seq: int) -> dict[str, torch.Tensor]:
        while seq not in arrived:  # codes come back in any order when several encoders serve this worker
            got, codes = replies.get()
            arrived[got] = codes
        return arrived.pop(seq)

    return spill_unit(spec, unit, episodes, submit, collect)


def spill_unit(
    spec: BuildSpec,
    unit: int,
    episodes: list[int],
    submit: Callable[[dict[str, torch.Tensor]], Any],
    collect: Callable[[Any], dict[str, torch.Tensor]],
) -> dict:
    """One unit's samples in batches of `batch_size` (as `pipeline.encode_samples` cuts them), each sent to an
    encoder as `stack_clips` makes it with `submit(batch) -> handle` and its codes taken back with `collect(handle)`,
    IN_FLIGHT batches ahead; then the unit's spill. Returns the unit's JSON record."""
    report = unit_report(spec, episodes)
    dtype = getattr(torch, spec.dtype)
    pending: deque[tuple[Any, list[WindowSample]]] = deque()

    def finish_oldest() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
        handle, batch = pending.popleft()
        codes = collect(handle)
        for i, s in enumerate(batch):
            yield (
                s.key,
                encode_sample(s.key, {**s.tensors, **{k: v[i] for k, v in codes.items()}}, s.meta, spec.compress),
            )

    def members() -> Iterator[tuple[str, list[tuple[str, bytes]]]]:
        samples = unit_samples(spec, episodes, report)
        while batch := list(itertools.islice(samples, spec.batch_size)):
            pending.append((submit(stack_clips([s.video for s in batch], dtype)), batch))
            if len(pending) >= IN_FLIGHT:
                yield from finish_oldest()
        while pending:
            yield from finish_oldest()

    return write.write_unit(Path(spec.out), unit, members(), report)


# ---------------------------------------------------------------- the same stages as Ray actors and tasks


class EncoderActor:
    """A Ray actor holding the encoders for the whole run (one per GPU of the cluster, or one on CPU)."""

    def __init__(self, spec: BuildSpec):
        torch.set_num_threads(spec.threads_per_worker)
        self.encoders = Encoders(spec)

    def encode(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.inference_mode():
            return self.encoders(batch)


def ray_unit(spec: BuildSpec, unit: int, episodes: list[int], actor) -> dict:
    """A Ray task: decode, window and transform one unit on CPU, encode its batches on `actor`, spill it."""
    import ray

    torch.set_num_threads(spec.threads_per_worker)
    return spill_unit(spec, unit, episodes, lambda batch: actor.encode.remote(batch), ray.get)


def run_ray(spec: BuildSpec, units: dict[int, list[int]], address: str | None) -> Iterator[dict]:
    """Units as Ray tasks on the cluster's CPUs feeding one encoder actor per GPU (one CPU actor without GPUs)."""
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs ray: pip install 'wampipe[ray]'") from None

    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    gpu = spec.device.startswith("cuda")
    count = int(ray.cluster_resources().get("GPU", 0)) if gpu else 1
    if count == 0:
        raise UsageError("--executor ray --device cuda: the Ray cluster has no GPU")
    # a CPU actor asks for no CPU of its own: the unit tasks' CPU requests would otherwise starve it
    actor_cls = ray.remote(num_gpus=1 if gpu else 0, num_cpus=0)(EncoderActor)
    actors = [actor_cls.remote(spec) for _ in range(count)]
    task = ray.remote(num_cpus=spec.threads_per_worker)(ray_unit)
    refs = [task.remote(spec, unit, episodes, actors[i % count]) for i, (unit, episodes) in enumerate(units.items())]
    try:
        while refs:
            ready, refs = ray.wait(refs, num_returns=1)
            yield ray.get(ready[0])
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
        # ray types a started actor as its ActorHandle or its class (ActorProxy, so that its methods type-check)
        for actor in actors:
            ray.kill(actor)  # pyright: ignore[reportArgumentType]
