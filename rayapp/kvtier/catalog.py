"""The cluster tier's catalog: one row per stored block, in openGauss or PostgreSQL with pgvector.

All of rayapp's SQL is `CatalogSQL` (`rayapp.kvtier.catalog_sql`), which renders the statements of one
dialect (pure text, so the openGauss ones are testable without an openGauss server); `Catalog` runs
them through a connection pool of psycopg 3 (or of `gaussdb`, its fork for openGauss's authentication:
`rayapp.kvtier.driver`) with parameters only, never with values spliced into the text.

The catalog is consulted per request, never per token. When the database cannot be reached the
catalog disables itself with one warning and answers as if it were empty (writes return False);
after `retry_after_s` the next call tries the database again. Only failures of the database are
treated so (unreachable, shut down, table gone, or silent past a deadline): an SQL or data error is
a bug and raises. Every call runs on a thread of the catalog's own and is waited on for at most
`statement_timeout_s` (`connect_timeout_s` more for a reconnect), so a database that froze (no
answer and no error: a stopped server, a partitioned network) costs its caller one deadline, and
the calls after it go on without the catalog until it answers again.

Invariant kept by `KVTierStore`: a row names the store actor holding the block's bytes. A reader
still checks every loaded block against its hash and token ids, since a row can outlive its bytes
for the moment between an eviction and the row's removal.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import psycopg
from psycopg_pool import ConnectionPool

from rayapp.blocks import BlockHash
from rayapp.kvtier.catalog_sql import UPSERT_COLUMNS, CatalogSQL, Dialect, detect_dialect
from rayapp.kvtier.driver import Driver, driver_for
from rayapp.kvtier.records import (
    BlockKey,
    BlockLocation,
    BlockRow,
    ChainMatch,
    ScoredBlock,
    TierUsage,
    from_db_hash,
    to_db_hash,
)

logger = logging.getLogger("rayapp.kvtier")

_T = TypeVar("_T")
# pgvector and openGauss DataVec both cap a `vector` column at 16,000 dimensions.
MAX_REPRESENTATION_DIM = 16_000
# Serializes the DDL of concurrent first starts (two stores creating the table at once).
_DDL_LOCK_KEY = 0x7261796170706B76
# Rows per INSERT statement: 10 parameters a row stays far below the protocol's 65,535 per statement.
_UPSERT_CHUNK_ROWS = 1000


def _vector_text(values: Sequence[float] | np.ndarray, dim: int, what: str) -> str:
    arr = np.asarray(values, dtype=np.float32).reshape(-1)
    if arr.size != dim:
        raise ValueError(f"{what} has {arr.size} values; the catalog's vectors have {dim}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{what} holds NaN or infinity, which vector columns reject")
    # 9 significant digits round-trip float32 exactly.
    return "[" + ",".join(f"{x:.9g}" for x in arr.tolist()) + "]"


def _location(row: tuple[Any, ...]) -> BlockLocation:
    return BlockLocation(from_db_hash(row[0]), row[1], row[2], row[3], row[4], row[5])


def _deleted_keys(cursor: psycopg.Cursor) -> list[BlockKey]:
    return [BlockKey(from_db_hash(h), group) for h, group in cursor.fetchall()]


def _describe(driver: Driver) -> str:
    # Host, port and database only: a DSN can carry a password, which must not reach the logs.
    try:
        parts = driver.conninfo_parts()
    except driver.module.ProgrammingError:
        return "<unparsable DSN>"
    return f"{parts.get('host', 'localhost')}:{parts.get('port', 5432)}/{parts.get('dbname', '')}"


class Catalog:
    """The `kv_blocks_v<width>` table of one database, reached through a connection pool.

    Construction creates the table (and the pgvector extension on PostgreSQL) when missing; it
    does not raise when the database is unreachable, it starts disabled. A table made earlier with
    another representation dimension is a `ValueError`, and so is an `opengauss://` DSN where the
    gaussdb driver cannot be loaded.
    """

    def __init__(
        self,
        dsn: str,
        representation_dim: int,
        *,
        max_connections: int = 4,
        connect_timeout_s: float = 3.0,
        statement_timeout_s: float = 2.0,
        retry_after_s: float = 30.0,
    ) -> None:
        if not 1 <= representation_dim <= MAX_REPRESENTATION_DIM:
            raise ValueError(f"representation_dim={representation_dim} must be in 1..{MAX_REPRESENTATION_DIM}")
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections} must be >= 1")
        self.dsn = dsn
        self._driver = driver_for(dsn)
        # Failures of the database rather than of rayapp's SQL: they disable the catalog until a retry.
        self._unreachable = self._driver.unreachable
        self.representation_dim = representation_dim
        self._max_connections = max_connections
        # libpq's connect_timeout is whole seconds, at least 2.
        self._connect_timeout_s = max(2, math.ceil(connect_timeout_s))
        self._statement_timeout_s = statement_timeout_s
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        # Held by the one caller trying to reconnect: the others go on without the catalog meanwhile.
        self._connecting = threading.Lock()
        # Database calls run here, so that their callers can stop waiting at a deadline; a call stuck on a
        # frozen database holds its thread until the database answers or its connection breaks.
        self._calls = ThreadPoolExecutor(max_workers=max_connections + 1, thread_name_prefix="rayapp-kvtier-catalog")
        self._pool: ConnectionPool | None = None
        self._sql: CatalogSQL | None = None
        self._retry_at = 0.0
        self._disabled = False
        self._ensure_ready()

    @property
    def dialect(self) -> Dialect | None:
        """The server's dialect, None until the database was reached once."""
        return None if self._sql is None else self._sql.dialect

    @property
    def available(self) -> bool:
        """Whether the database answers (tries to reconnect once the retry delay has passed)."""
        return self._ensure_ready()

    def close(self) -> None:
        """Close the pool's connections; later calls reconnect."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _ensure_ready(self) -> bool:
        if self._pool is not None:
            return True
        if time.monotonic() < self._retry_at or not self._connecting.acquire(blocking=False):
            return False  # not yet time to try again, or another caller is trying now
        try:
            self._calls.submit(self._connect).result(timeout=self._connect_timeout_s + self._statement_timeout_s)
        except TimeoutError:  # the attempt goes on; if the database answers after all, it turns the catalog on
            with self._lock:
                self._disable_locked(self._silent())
        finally:
            self._connecting.release()
        return self._pool is not None

    def _connect(self) -> None:
        """Connect, create the schema when missing, and open the pool (on a catalog thread)."""
        statement_ms = max(1, round(self._statement_timeout_s * 1000))
        try:
            # A plain connection first: a down server fails here quickly and quietly, where a
            # pool would keep retrying (and logging) in the background.
            with self._driver.module.connect(
                self._driver.conninfo, autocommit=True, connect_timeout=self._connect_timeout_s
            ) as conn:
                version = conn.execute("SELECT version()").fetchone()[0]
                sql = CatalogSQL(detect_dialect(version), self.representation_dim)
                self._create_schema(conn, sql)
            # One connection kept open: a lookup on a request's admission must not wait on a login.
            pool = self._driver.pool_class(
                self._driver.conninfo,
                min_size=1,
                max_size=self._max_connections,
                timeout=self._connect_timeout_s,
                # The server ends statements past the deadline too, so abandoned ones do not pile up on it.
                kwargs={
                    "autocommit": True, "connect_timeout": self._connect_timeout_s,
                    "options": f"-c statement_timeout={statement_ms}",
                },
                name="rayapp-kvtier-catalog",
                open=False,
            )  # fmt: skip
            try:
                pool.open(wait=True, timeout=self._connect_timeout_s)
            except self._unreachable:
                pool.close()
                raise
        except self._unreachable as err:
            with self._lock:
                self._disable_locked(err)
            return
        with self._lock:
            self._sql, self._pool = sql, pool
            if self._disabled:
                logger.info("cluster KV tier catalog at %s is reachable again", _describe(self._driver))
                self._disabled = False

    def _create_schema(self, conn: psycopg.Connection, sql: CatalogSQL) -> None:
        with conn.transaction():
            conn.execute(sql.lock_ddl(), {"key": _DDL_LOCK_KEY})
            extension = sql.create_extension()
            if extension is not None:
                conn.execute(extension)
            conn.execute(sql.create_table())
            if conn.execute(sql.index_exists(), {"name": sql.node_index}).fetchone() is None:
                conn.execute(sql.create_node_index())

    def _disable_locked(self, err: Exception) -> None:
        pool, self._pool = self._pool, None
        self._retry_at = time.monotonic() + self._retry_after_s
        if not self._disabled:
            self._disabled = True
            logger.warning(
                "cluster KV tier disabled: catalog database %s is unreachable (%s); requests go on without "
                "the tier, the database is tried again in %.0f s",
                _describe(self._driver), self._driver.explain(err), self._retry_after_s,
            )  # fmt: skip
        if pool is not None:
            # Off this thread: closing waits on the pool's workers, which a frozen database can hold.
            threading.Thread(target=pool.close, name="rayapp-kvtier-pool-close", daemon=True).start()

    def _run(self, work: Callable[[psycopg.Connection, CatalogSQL], _T], default: _T) -> _T:
        if not self._ensure_ready():
            return default
        pool, sql = self._pool, self._sql
        if pool is None or sql is None:  # closed by another thread meanwhile
            return default
        try:
            return self._calls.submit(self._work, pool, sql, work, default).result(timeout=self._statement_timeout_s)
        except TimeoutError:
            self._disable_if_current(pool, self._silent())
            return default

    def _silent(self) -> TimeoutError:
        return TimeoutError(f"no answer within {self._statement_timeout_s:g} s")

    def _work(
        self, pool: ConnectionPool, sql: CatalogSQL, work: Callable[[psycopg.Connection, CatalogSQL], _T], default: _T
    ) -> _T:
        try:
            with pool.connection() as conn:
                try:
                    return work(conn, sql)
                except self._unreachable as err:
                    # Close the pool before the broken connection goes back to it: a closed pool just
                    # drops it, where an open one would log it and start reconnecting in the background.
                    self._disable_if_current(pool, err)
                    return default
        except self._unreachable as err:  # no connection could be had at all
            self._disable_if_current(pool, err)
            return default

    def _disable_if_current(self, pool: ConnectionPool, err: Exception) -> None:
        with self._lock:
            if self._pool is pool:
                self._disable_locked(err)

    def upsert(self, rows: Iterable[BlockRow]) -> bool:
        """Insert or update the rows (keyed by block hash and layer group) in one transaction.

        Returns False, writing nothing, when the database is unreachable.
        """
        values: dict[tuple[int, int], tuple[Any, ...]] = {}
        for row in rows:
            v = {c: getattr(row, c) for c in UPSERT_COLUMNS}
            v["block_hash"] = to_db_hash(row.block_hash)
            v["parent_hash"] = None if row.parent_hash is None else to_db_hash(row.parent_hash)
            if row.representation is not None:
                v["representation"] = _vector_text(row.representation, self.representation_dim, "representation")
            # One statement may not touch a key twice (both dialects refuse): the last write wins.
            values[(v["block_hash"], row.layer_group)] = tuple(v[c] for c in UPSERT_COLUMNS)
        if not values:
            return self.available
        batch = list(values.values())

        def work(conn: psycopg.Connection, sql: CatalogSQL) -> bool:
            with conn.transaction():
                for i in range(0, len(batch), _UPSERT_CHUNK_ROWS):
                    chunk = batch[i : i + _UPSERT_CHUNK_ROWS]
                    conn.execute(sql.upsert(len(chunk)), [x for row in chunk for x in row])
            return True

        return self._run(work, False)

    def locate(self, hashes: Sequence[int], layer_group: int = 0) -> dict[BlockHash, BlockLocation]:
        """Where the tier holds those of `hashes` it holds, in one round trip ({} when unreachable)."""
        if not hashes:
            return {}
        wanted = [to_db_hash(h) for h in hashes]

        def work(conn: psycopg.Connection, sql: CatalogSQL) -> dict[BlockHash, BlockLocation]:
            rows = conn.execute(sql.locate(), {"layer_group": layer_group, "hashes": wanted}).fetchall()
            return {location.block_hash: location for location in map(_location, rows)}

        return self._run(work, {})

    def longest_chain(self, hashes: Sequence[int], layer_group: int = 0) -> ChainMatch:
        """How many leading blocks of the chain `hashes` (in token order) the tier holds, and where.

        One round trip. Blocks after the first missing one are not returned: a later block's KV
        is useless without its prefix.
        """
        found = self.locate(hashes, layer_group)
        locations: list[BlockLocation] = []
        for h in hashes:
            if h not in found:
                break
            locations.append(found[h])
        return ChainMatch(len(locations), tuple(locations))

    def topk_inner_product(
        self, hashes: Sequence[int], query: Sequence[float] | np.ndarray, k: int, layer_group: int = 0
    ) -> list[ScoredBlock]:
        """The `k` blocks among `hashes` (one sequence's chain) whose representation has the largest
        inner product with `query`, most relevant first. Blocks stored without one are skipped."""
        if k < 1 or not hashes:
            return []
        params = {
            "query": _vector_text(query, self.representation_dim, "query"),
            "layer_group": layer_group,
            "hashes": [to_db_hash(h) for h in hashes],
            "k": k,
        }

        def work(conn: psycopg.Connection, sql: CatalogSQL) -> list[ScoredBlock]:
            rows = conn.execute(sql.topk_inner_product(), params).fetchall()
            return [ScoredBlock(_location(row[:6]), -float(row[6])) for row in rows]

        return self._run(work, [])

    def remove_node(self, node_id: str) -> list[BlockKey]:
        """Delete every row of a node (it died or left); returns the keys of the rows that went."""
        return self._run(lambda conn, sql: _deleted_keys(conn.execute(sql.delete_node(), {"node_id": node_id})), [])

    def remove(
        self,
        hashes: Sequence[int],
        layer_group: int = 0,
        *,
        node_id: str | None = None,
        store_name: str | None = None,
    ) -> list[BlockKey]:
        """Delete the rows of `hashes`; with `node_id` and `store_name`, only those still pointing there.

        Returns the keys of the rows that went."""
        if not hashes:
            return []
        if (node_id is None) != (store_name is None):
            raise ValueError("pass node_id and store_name together, or neither")
        params: dict[str, Any] = {"layer_group": layer_group, "hashes": [to_db_hash(h) for h in hashes]}
        guarded = node_id is not None
        if guarded:
            params.update(node_id=node_id, store_name=store_name)
        return self._run(lambda conn, sql: _deleted_keys(conn.execute(sql.delete_hashes(guarded=guarded), params)), [])

    def remove_nodes_except(self, alive_node_ids: Sequence[str]) -> list[BlockKey]:
        """Delete the rows of every node not in `alive_node_ids`: their blocks died with their object
        stores (a node that left, or a previous cluster on the same database). Returns the keys that went."""
        params = {"alive": list(alive_node_ids)}
        return self._run(lambda conn, sql: _deleted_keys(conn.execute(sql.delete_nodes_except(), params)), [])

    def usage(self, node_id: str | None = None) -> TierUsage:
        """Rows and their bytes, in the whole catalog or on one node."""

        def work(conn: psycopg.Connection, sql: CatalogSQL) -> TierUsage:
            if node_id is None:
                count, nbytes = conn.execute(sql.usage(per_node=False)).fetchone()
            else:
                count, nbytes = conn.execute(sql.usage(per_node=True), {"node_id": node_id}).fetchone()
            return TierUsage(int(count), int(nbytes))

        return self._run(work, TierUsage())

    def touch(self, hashes: Sequence[int], layer_group: int = 0) -> int:
        """Set `last_used` of the blocks to now; returns how many rows matched."""
        if not hashes:
            return 0
        params = {"layer_group": layer_group, "hashes": [to_db_hash(h) for h in hashes]}
        return self._run(lambda conn, sql: conn.execute(sql.touch(), params).rowcount, 0)
