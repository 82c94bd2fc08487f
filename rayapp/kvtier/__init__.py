"""Cluster KV tier: blocks in the Ray object store (`store`), catalogued in openGauss / PostgreSQL
(`catalog`), serialized by `codec`; `embedded` starts the default PostgreSQL + pgvector.

Import the submodules directly: `codec` and `catalog` need neither Ray nor a running cluster.
"""

import contextlib
import logging
import os
import random
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def spare_cores() -> frozenset[int]:
    """Cores this process may use that none of its core-bound threads computes on (empty when there are none).

    vLLM's CPU worker binds each of its OMP threads, the forward's among them, to a core of its own, and keeps
    the node's other cores for its scheduler loop and the frontends. A thread inherits the affinity of the thread
    that starts it, so the tier's threads and Ray's, started from the forward's thread, would all compute on the
    forward's core.
    """
    if not hasattr(os, "sched_getaffinity"):  # not Linux: nothing is bound
        return frozenset()
    threads = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            threads.append(os.sched_getaffinity(int(tid)))
    allowed = set(os.sched_getaffinity(os.getppid())).union(*threads)
    bound = set().union(*(cores for cores in threads if cores < allowed))
    return frozenset(allowed - bound) if bound else frozenset()


def pin_thread(cores: frozenset[int]) -> None:
    """Bind the calling thread to `cores` (no change when empty, or when the host refuses them)."""
    if cores:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)


@contextlib.contextmanager
def threads_on(cores: frozenset[int]) -> Iterator[None]:
    """Threads the calling thread starts inside this block run on `cores` (no change when empty)."""
    if not cores:
        yield
        return
    saved = frozenset(os.sched_getaffinity(0))
    pin_thread(cores)
    try:
        yield
    finally:
        pin_thread(saved)


def join_ray(address: str | None) -> None:
    """Join the Ray cluster at `address` as a driver of this process (an engine's, that the tier writes from).

    Ray names a driver's GCS subscriptions with Python's `random`, which engines seed alike (vLLM seeds every
    worker with its engine seed). Two drivers with the same subscription id take each other's long poll
    away, so both poll the GCS nonstop: measured with two vLLM replicas, 70,846 polls and 16.6 CPU seconds
    of the GCS in one minute of load. So Ray draws from fresh entropy here, and the engine's seeded stream
    is left where it was.
    """
    import ray

    state = random.getstate()
    random.seed()
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    finally:
        random.setstate(state)


def log_unavailable(error: BaseException) -> None:
    """Say in the log that the cluster tier could not be reached and that this process goes on without it (it
    is a cache: requests recompute instead). A failure in the database actor arrives wrapped in Ray's traceback:
    its cause says what to change."""
    logger.warning("cluster KV tier unavailable (%s); running without it", getattr(error, "cause", None) or error)
