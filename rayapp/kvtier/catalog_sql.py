"""The catalog's SQL, one dialect at a time: openGauss (DataVec's built-in `vector`, `ON DUPLICATE KEY`)
or PostgreSQL with pgvector. Pure text, so each dialect's statements are testable without its server;
`rayapp.kvtier.catalog.Catalog` runs them with parameters only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Dialect(enum.Enum):
    POSTGRESQL = "postgresql"
    OPENGAUSS = "opengauss"


def detect_dialect(version: str) -> Dialect:
    """The dialect of a server from its `SELECT version()` text.

    openGauss (and GaussDB, its commercial sibling) report a PostgreSQL 9.2 version string with
    their own name in it, e.g. "(openGauss 6.0.0 build ...)".
    """
    text = version.lower()
    return Dialect.OPENGAUSS if "opengauss" in text or "gaussdb" in text else Dialect.POSTGRESQL


_LOCATION_COLUMNS = "block_hash, layer_group, node_id, store_name, nbytes, num_tokens"
_RETURNING_KEYS = "RETURNING block_hash, layer_group"
UPSERT_COLUMNS = (
    "block_hash", "parent_hash", "model_id", "cache_salt", "layer_group",
    "node_id", "store_name", "nbytes", "num_tokens", "representation",
)  # fmt: skip
# The key columns cannot be updated by openGauss's ON DUPLICATE KEY UPDATE; created_at keeps the first write.
_UPDATED_COLUMNS = tuple(c for c in UPSERT_COLUMNS if c not in ("block_hash", "layer_group")) + ("last_used",)


@dataclass(frozen=True)
class CatalogSQL:
    """The catalog's statements for one dialect. Every value is a `%(name)s` parameter."""

    dialect: Dialect
    representation_dim: int

    # A table per representation width, so models of different KV widths share one database, and a database
    # that outlives the cluster (the embedded one keeps its files in the temp dir) serves the next model too.
    @property
    def table(self) -> str:
        return f"kv_blocks_v{self.representation_dim}"

    @property
    def node_index(self) -> str:
        return f"{self.table}_node_idx"

    def create_extension(self) -> str | None:
        # openGauss ships DataVec's `vector` type built in; PostgreSQL needs the pgvector extension.
        return "CREATE EXTENSION IF NOT EXISTS vector" if self.dialect is Dialect.POSTGRESQL else None

    def lock_ddl(self) -> str:
        return "SELECT pg_advisory_xact_lock(%(key)s)"

    def create_table(self) -> str:
        return (
            f"CREATE TABLE IF NOT EXISTS {self.table} (block_hash BIGINT NOT NULL, parent_hash BIGINT NULL, "
            "model_id TEXT NOT NULL, cache_salt TEXT NOT NULL, layer_group INTEGER NOT NULL, node_id TEXT NOT NULL, "
            "store_name TEXT NOT NULL, nbytes BIGINT NOT NULL, num_tokens INTEGER NOT NULL, "
            f"representation vector({self.representation_dim}) NULL, "
            "created_at TIMESTAMPTZ NOT NULL DEFAULT now(), last_used TIMESTAMPTZ NOT NULL DEFAULT now(), "
            "PRIMARY KEY (block_hash, layer_group))"
        )

    def index_exists(self) -> str:
        return "SELECT 1 FROM pg_class WHERE relname = %(name)s AND relkind = 'i'"

    def create_node_index(self) -> str:
        return f"CREATE INDEX {self.node_index} ON {self.table} (node_id)"

    def upsert(self, num_rows: int) -> str:
        """One multi-row statement (a single round trip) for `num_rows` rows of positional parameters,
        `UPSERT_COLUMNS` in order per row."""
        one = ", ".join("%s::vector" if c == "representation" else "%s" for c in UPSERT_COLUMNS)
        values = ", ".join([f"({one}, now())"] * num_rows)
        insert = f"INSERT INTO {self.table} ({', '.join(UPSERT_COLUMNS)}, last_used) VALUES {values}"
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in _UPDATED_COLUMNS)
        if self.dialect is Dialect.OPENGAUSS:
            return f"{insert} ON DUPLICATE KEY UPDATE {updates}"
        return f"{insert} ON CONFLICT (block_hash, layer_group) DO UPDATE SET {updates}"

    def locate(self) -> str:
        return (
            f"SELECT {_LOCATION_COLUMNS} FROM {self.table} "
            "WHERE layer_group = %(layer_group)s AND block_hash = ANY(%(hashes)s::bigint[])"
        )

    def topk_inner_product(self) -> str:
        # `<#>` is the negative inner product on both pgvector and DataVec: ascending = most relevant first.
        return (
            f"SELECT {_LOCATION_COLUMNS}, representation <#> %(query)s::vector AS distance FROM {self.table} "
            "WHERE layer_group = %(layer_group)s AND block_hash = ANY(%(hashes)s::bigint[]) "
            "AND representation IS NOT NULL ORDER BY distance LIMIT %(k)s"
        )

    # Deletes return the keys of the rows they removed: those blocks left the tier, and the prefix
    # router must hear so (`KVTierStore` reports them). Both dialects support DELETE ... RETURNING.
    def delete_node(self) -> str:
        return f"DELETE FROM {self.table} WHERE node_id = %(node_id)s {_RETURNING_KEYS}"

    def delete_nodes_except(self) -> str:
        return f"DELETE FROM {self.table} WHERE NOT (node_id = ANY(%(alive)s::text[])) {_RETURNING_KEYS}"

    def delete_hashes(self, *, guarded: bool) -> str:
        sql = f"DELETE FROM {self.table} WHERE layer_group = %(layer_group)s AND block_hash = ANY(%(hashes)s::bigint[])"
        # A guarded delete removes only rows that still point at the caller's store: after another
        # store re-wrote the block, the row is that store's and must stay.
        if guarded:
            sql += " AND node_id = %(node_id)s AND store_name = %(store_name)s"
        return f"{sql} {_RETURNING_KEYS}"

    def usage(self, *, per_node: bool) -> str:
        sql = f"SELECT count(*), COALESCE(SUM(nbytes), 0) FROM {self.table}"
        return sql + " WHERE node_id = %(node_id)s" if per_node else sql

    def touch(self) -> str:
        return (
            f"UPDATE {self.table} SET last_used = now() "
            "WHERE layer_group = %(layer_group)s AND block_hash = ANY(%(hashes)s::bigint[])"
        )
