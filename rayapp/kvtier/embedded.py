"""The catalog database rayapp starts itself when `kvtier.dsn` is unset: one per cluster, PostgreSQL 18 + pgvector.

The server (`rayapp.kvtier.postgres.EmbeddedPostgres`) is started once per cluster by the named actor
`rayapp-kvtier-db`, which runs on the head node and listens on that node's IP so replicas on every node reach
it, and stopped by `stop_embedded_database`. A restarted actor starts the server on the port it had, so the
DSN that replicas and stores were given stays valid.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path

from rayapp.kvtier.postgres import EmbeddedPostgres, default_data_dir

logger = logging.getLogger("rayapp.kvtier")

NAMESPACE = "rayapp"
DB_ACTOR_NAME = "rayapp-kvtier-db"
# Seconds between the database actor's checks that its server still runs (it is started again if not).
SUPERVISE_PERIOD_S = 2.0
# Ray gives the head node (only) one unit of this resource: asking for a sliver of it pins an actor there.
HEAD_NODE_RESOURCE = "node:__internal_head__"


# Forks away from the actor (Ray kills a dead worker's child processes, not its grandchildren), reads
# until its stdin closes (the actor's process ended, however it ended), then stops the server.
_WATCHDOG = (
    "import os, sys\n"
    "if os.fork():\n    os._exit(0)\n"
    "sys.stdin.buffer.read()\n"
    "from rayapp.kvtier.postgres import EmbeddedPostgres\n"
    "EmbeddedPostgres(sys.argv[1]).stop()\n"
)


class _DatabaseActor:
    """Holds the cluster's embedded database; restarted by Ray, it re-attaches to the running server.

    The server lives as long as this actor: a watchdog process, detached so that it survives the
    actor being killed, holds a pipe from the actor and stops the server when the pipe closes. So
    the database stops with the cluster (`serve run` ending, `ray stop`), never lingering. A server
    that dies meanwhile (killed, out of memory) is started again, on its port, within
    `SUPERVISE_PERIOD_S`; the catalogs' retries then turn the tier back on.
    """

    def __init__(self, data_dir: str, host: str | None) -> None:
        import ray

        self._db = EmbeddedPostgres(data_dir, host=host or ray.util.get_node_ip_address())
        self._watchdog: subprocess.Popen | None = None
        self._stopped = threading.Event()
        self._supervisor: threading.Thread | None = None

    def start(self) -> str:
        dsn = self._db.start()
        if self._watchdog is None:
            # Kept referenced: the pipe's write end must stay open for this actor's whole life.
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(self._db.data_dir)], stdin=subprocess.PIPE, start_new_session=True
            )
            self._watchdog.wait()  # the forked watchdog carries on alone
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._supervise, name="rayapp-kvtier-db-supervisor", daemon=True)
            self._supervisor.start()
        return dsn

    def _supervise(self) -> None:
        while not self._stopped.wait(SUPERVISE_PERIOD_S):
            try:
                if not self._db.is_running():
                    logger.warning("the embedded KV tier database over %s stopped; starting it again", self._db.pgdata)
                    self._db.start()
            except Exception:  # tried again next period
                logger.exception("starting the embedded KV tier database again failed")

    def stop(self) -> None:
        self._stopped.set()
        self._db.stop()


def start_embedded_database(data_dir: str | Path | None = None, *, host: str | None = None) -> str:
    """Get or create the cluster's database actor (`rayapp-kvtier-db` in namespace `rayapp`), make
    sure its server runs, and return the DSN. Safe to call from many processes at once.

    The actor runs on the head node (and is restarted there), which outlives the workers; `data_dir`
    is a directory of that node. The server listens on `host`, by default the head node's IP, so
    that replicas on every node reach it (with the generated password). The first caller's
    `data_dir` and `host` win; later callers get the same server.
    """
    import ray

    actor = (
        ray.remote(_DatabaseActor)
        .options(name=DB_ACTOR_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                 num_cpus=0, resources={HEAD_NODE_RESOURCE: 0.001}, max_restarts=-1, max_task_retries=3)
        .remote(str(data_dir if data_dir is not None else default_data_dir()), host)
    )  # fmt: skip
    return ray.get(actor.start.remote())


def stop_embedded_database() -> bool:
    """Stop the cluster's embedded database and its actor; False when none was started."""
    import ray

    try:
        actor = ray.get_actor(DB_ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    ray.get(actor.stop.remote())
    ray.kill(actor, no_restart=True)
    return True
