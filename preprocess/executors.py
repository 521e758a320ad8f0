"""Where units run: in this process, in a local process pool, streamed through long-lived encoder processes
(preprocess.stream), or as Ray tasks feeding Ray encoder actors (array jobs pick their units in the CLI and use one of
these). Every executor
encodes the same batches of the same (spec, unit, episodes), so the choice never changes the output bytes.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Iterator, Literal

from wampipe.preprocess.errors import OutOfSpace, out_of_space
from wampipe.preprocess.spec import BuildSpec
from wampipe.preprocess.tasks import die_with_parent


def run_units(
    spec: BuildSpec,
    units: dict[int, list[int]],
    executor: Literal["stream", "local", "ray"],
    workers: int,
    ray_address: str | None = None,
) -> Iterator[dict]:
    """Process {unit: episodes}; yields each unit's record as it finishes. An error (e.g. a bad episode with
    --fail-fast) cancels the units not yet started and propagates."""
    if not units:
        return
    if executor == "stream":
        from wampipe.preprocess.stream import run_stream

        yield from run_stream(spec, units, workers)  # its children name the output in a full disk's line
    elif executor == "ray":
        from wampipe.preprocess.stream import run_ray

        yield from run_ray(spec, units, ray_address)
    else:
        try:
            yield from _local(spec, units, workers)
        except OSError as err:
            if not out_of_space(err):
                raise
            # a unit's write fails without a file name (the temporary file is written through its handle)
            raise OutOfSpace.from_os_error(err, f"{spec.out}: ") from None


def _local(spec: BuildSpec, units: dict[int, list[int]], workers: int) -> Iterator[dict]:
    if workers > 1:
        yield from _pool(spec, units, workers)
        return
    from wampipe.preprocess.pipeline import process_unit

    for unit, episodes in units.items():
        yield process_unit(spec, unit, episodes)


def _pool(spec: BuildSpec, units: dict[int, list[int]], workers: int) -> Iterator[dict]:
    from wampipe.preprocess.pipeline import process_unit

    # spawn: torch and the decoders are not fork-safe
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futures = [pool.submit(process_unit, spec, unit, episodes) for unit, episodes in units.items()]
        try:
            for future in as_completed(futures):
                yield future.result()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
