"""Cluster KV tier: blocks in the Ray object store (`store`), catalogued in openGauss / PostgreSQL
(`catalog`), serialized by `codec`; `embedded` starts the default PostgreSQL + pgvector.

Import the submodules directly: `codec` and `catalog` need neither Ray nor a running cluster.
"""

import logging
import random

logger = logging.getLogger(__name__)


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
