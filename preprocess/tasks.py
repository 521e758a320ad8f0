"""Independent tasks over processes, and the processes of a run: finalize's shard tasks, `check`'s shards and the
selection's reads run here (in this process, a spawned pool, or Ray tasks), and every child process of a run is
tied to its parent and reports its own death in one line.
"""

from __future__ import annotations

import ctypes
import itertools
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Callable, Iterator, NoReturn

from tqdm import tqdm

from wampipe.errors import WampipeError

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def auto_workers(workers: int, tasks: int) -> int:
    """`workers`, or for 0 (auto) one process per 32 tasks, at most every core and 8: a small job runs in this
    process, where starting processes would cost more than they save."""
    return workers or max(1, min(8, os.cpu_count() or 1, tasks // 32))


class LazyTasks(Sequence):
    """The arguments of task i, `make(items[i])`, built only when the task is handed out: a run of many tasks never
    holds all their arguments at once."""

    def __init__(self, make: Callable[[Any], tuple], items: Sequence):
        self.make, self.items = make, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple:
        return self.make(self.items[i])


def run_tasks(
    fn: Callable,
    tasks: Sequence[tuple],
    workers: int,
    desc: str,
    progress: bool = True,
    ray_address: str | None = None,
    on_ray: bool = False,
) -> Iterator[tuple[int, Any]]:
    """(i, fn(*tasks[i])) as each task finishes, with a progress bar: in this process with one worker, else in a
    pool of `workers` spawned processes, or with `on_ray` as Ray tasks of the cluster at `ray_address`, at most two
    tasks per worker in flight (finalize's shard tasks, `check`'s: independent, so any order gives the same
    files)."""
    bar = tqdm(total=len(tasks), desc=desc, unit="task", disable=not (progress and len(tasks)))
    try:
        if on_ray and len(tasks) > 1:
            yield from _on_ray(fn, tasks, workers, ray_address, bar)
            return
        if workers <= 1 or len(tasks) <= 1:
            for i in range(len(tasks)):
                yield i, fn(*tasks[i])
                bar.update(1)
            return
        with ProcessPoolExecutor(
            min(workers, len(tasks)),
            mp_context=multiprocessing.get_context("spawn"),
            initializer=die_with_parent,
            initargs=(os.getpid(),),
        ) as pool:
            pending, queued = {}, iter(range(len(tasks)))
            try:
                for i in itertools.islice(queued, 2 * workers):
                    pending[pool.submit(fn, *tasks[i])] = i
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        i = pending.pop(future)
                        yield i, future.result()
                        bar.update(1)
                        for j in itertools.islice(queued, 1):
                            pending[pool.submit(fn, *tasks[j])] = j
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    finally:
        bar.close()


def _on_ray(fn: Callable, tasks: Sequence[tuple], workers: int, address: str | None, bar) -> Iterator[tuple[int, Any]]:
    import ray

    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(num_cpus=1)(fn)
    pending, queued = {}, iter(range(len(tasks)))
    try:
        for i in itertools.islice(queued, 2 * max(workers, 1)):
            pending[remote.remote(*tasks[i])] = i
        while pending:
            (ready,), _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ready)
            yield i, ray.get(ready)
            bar.update(1)
            for j in itertools.islice(queued, 1):
                pending[remote.remote(*tasks[j])] = j
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


class ChildDied(WampipeError, RuntimeError):
    """A process of the run ended without a word (the kernel's out-of-memory killer, a signal from a user): the run
    stops with this one line; whatever the child printed before it died is above it."""

    def __init__(self, name: str, exitcode: int):
        how, hint = f"exit code {exitcode}", ": see its output above"
        if exitcode < 0:
            try:
                how = f"killed by {signal.Signals(-exitcode).name}"
            except ValueError:  # a real-time signal has no name
                how = f"killed by signal {-exitcode}"
            # SIGKILL is the out-of-memory killer's signal; its report is in the kernel's log
            hint = ": out of host memory? see `dmesg`" if -exitcode == signal.SIGKILL else ""
        super().__init__(f"{name} died ({how}){hint}")


def leave_child(*queues) -> NoReturn:
    """End a spawned child process once what it put on `queues` is flushed, without the interpreter's teardown.
    Why: a spawned child returns through sys.exit, whose teardown runs C++ static destructors while threads of CUDA,
    torch.compile or the decoders may still exist, and aborts with "terminate called without an active exception"."""
    for q in queues:
        q.close()
        q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def thread_only_progress_lock() -> None:
    """Give tqdm a thread lock in a stream child. Left alone, the first bar a library shows there (inductor's, while
    it compiles) makes a semaphore that only this process could ever share, and leave_child's os._exit leaves it
    registered: the resource tracker then warns of a "leaked semaphore" at the end of every such run."""
    tqdm.set_lock(threading.RLock())


def die_with_parent(parent: int) -> None:
    """Pool worker initializer: a worker must not outlive the run. A run killed with SIGKILL releases its lock on
    OUT at once, so a worker still writing could mix into the next run's output. Linux kills the worker when its
    parent dies; the pid check covers a parent that died before the request took effect."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
