"""Cluster KV tier: blocks in the Ray object store (`store`), catalogued in openGauss / PostgreSQL
(`catalog`), serialized by `codec`; `embedded` starts the default PostgreSQL + pgvector.

Import the submodules directly: `codec` and `catalog` need neither Ray nor a running cluster.
"""

import logging

logger = logging.getLogger(__name__)


def log_unavailable(error: BaseException) -> None:
    """Say in the log that the cluster tier could not be reached and that this process goes on without it (it
    is a cache: requests recompute instead). A failure in the database actor arrives wrapped in Ray's traceback:
    its cause says what to change."""
    logger.warning("cluster KV tier unavailable (%s); running without it", getattr(error, "cause", None) or error)
