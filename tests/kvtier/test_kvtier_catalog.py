"""The catalog against a real PostgreSQL with pgvector, and the openGauss SQL as text."""

from __future__ import annotations

import numpy as np
import psycopg
import pytest

from rayapp.blocks import BlockHash, hash_blocks
from rayapp.kvtier.catalog import (
    BlockKey,
    BlockRow,
    Catalog,
    CatalogSQL,
    ChainMatch,
    Dialect,
    TierUsage,
    detect_dialect,
    from_db_hash,
    to_db_hash,
)

BLOCK_BYTES = 368_640
REPRESENTATION_DIM = 192  # the session catalog's (tests/kvtier/conftest.py)


def chain(n: int, salt: str = "tenant-a") -> list[BlockHash]:
    return hash_blocks(list(range(n * 16)), 16, ("smollm2", salt))


def rows(hashes, node="node-a", representations=None, parent=None) -> list[BlockRow]:
    out = []
    for i, h in enumerate(hashes):
        rep = None if representations is None else representations[i]
        out.append(BlockRow(h, parent if i == 0 else hashes[i - 1], "smollm2", "tenant-a", 0, node,
                            f"store-{node}", BLOCK_BYTES, 16, rep))  # fmt: skip
    return out


def test_hashes_map_to_bigint_losslessly():
    for h in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert -(1 << 63) <= to_db_hash(h) < 1 << 63
        assert from_db_hash(to_db_hash(h)) == h
    with pytest.raises(ValueError):
        to_db_hash(1 << 64)


def test_server_is_detected_as_postgresql(catalog):
    assert catalog.dialect is Dialect.POSTGRESQL
    assert catalog.available


def test_chain_lookup_returns_the_present_prefix_in_one_match(catalog):
    hashes = chain(8)
    # Blocks 0..4 and 6 are stored: the usable continuation stops at the hole at 5.
    assert catalog.upsert(rows(hashes[:5]) + rows(hashes[6:7]))
    match = catalog.longest_chain(hashes)
    assert match.num_present == 5
    assert [loc.block_hash for loc in match.locations] == hashes[:5]
    assert {(loc.node_id, loc.store_name, loc.nbytes, loc.num_tokens) for loc in match.locations} == {
        ("node-a", "store-node-a", BLOCK_BYTES, 16)
    }
    assert catalog.longest_chain(chain(8, salt="tenant-b")) == ChainMatch()
    assert catalog.longest_chain(hashes, layer_group=1) == ChainMatch()
    assert catalog.longest_chain([]) == ChainMatch()


def test_a_batch_larger_than_one_statement_is_written_whole(dsn):
    # What is tested is the split into statements, not their speed: the production deadline (2 s) would make
    # the 2,500 rows a bet on how busy the machine is (a CI run lost it once, and its late commit then leaked
    # rows into the next test).
    catalog = Catalog(dsn, REPRESENTATION_DIM, statement_timeout_s=60.0)
    catalog.remove_nodes_except([])
    try:
        hashes = chain(2500)
        assert catalog.upsert(rows(hashes))
        assert catalog.usage() == TierUsage(2500, 2500 * BLOCK_BYTES)
        assert catalog.longest_chain(hashes).num_present == 2500
    finally:
        catalog.remove_nodes_except([])
        catalog.close()


def test_hashes_above_2_63_are_stored_and_found(catalog):
    big = [BlockHash((1 << 64) - 1), BlockHash(1 << 63), BlockHash(5)]
    assert catalog.upsert(rows(big, parent=BlockHash((1 << 64) - 2)))
    assert [loc.block_hash for loc in catalog.longest_chain(big).locations] == big


def test_upsert_moves_a_block_to_its_latest_store(catalog):
    hashes = chain(3)
    assert catalog.upsert(rows(hashes, node="node-a"))
    assert catalog.upsert(rows(hashes[:1], node="node-b"))
    nodes = [loc.node_id for loc in catalog.longest_chain(hashes).locations]
    assert nodes == ["node-b", "node-a", "node-a"]
    assert catalog.usage() == TierUsage(3, 3 * BLOCK_BYTES)
    assert catalog.usage("node-b") == TierUsage(1, BLOCK_BYTES)


def test_topk_ranks_a_sequences_blocks_by_inner_product(catalog):
    rng = np.random.default_rng(0)
    hashes = chain(20)
    reps = rng.standard_normal((20, REPRESENTATION_DIM)).astype(np.float32)
    # Block 7 has no representation: it can never be selected.
    stored = rows(hashes, representations=[None if i == 7 else reps[i] for i in range(20)])
    assert catalog.upsert(stored)
    # Another sequence's blocks, with representations that would win if they were considered.
    assert catalog.upsert(rows(chain(2, salt="other"), representations=[reps[0] * 100, reps[1] * 100]))
    query = rng.standard_normal(REPRESENTATION_DIM).astype(np.float32)
    top = catalog.topk_inner_product(hashes, query, k=5)
    scores = reps @ query
    scores[7] = -np.inf
    expected = [hashes[i] for i in np.argsort(-scores)[:5]]
    assert [s.location.block_hash for s in top] == expected
    np.testing.assert_allclose([s.score for s in top], np.sort(scores)[::-1][:5], rtol=1e-4)
    assert catalog.topk_inner_product(hashes, query, k=0) == []
    with pytest.raises(ValueError, match="192"):
        catalog.topk_inner_product(hashes, query[:10], k=3)


def keys(hashes) -> set[BlockKey]:
    return {BlockKey(h, 0) for h in hashes}


def test_removal_by_node_and_by_hash_names_the_rows_that_went(catalog):
    a, b = chain(4, salt="a"), chain(3, salt="b")
    assert catalog.upsert(rows(a, node="node-a") + rows(b, node="node-b"))
    assert set(catalog.remove_node("node-a")) == keys(a)
    assert catalog.longest_chain(a) == ChainMatch()
    assert catalog.longest_chain(b).num_present == 3
    # A guarded remove leaves rows that point at another store.
    assert catalog.remove(b[:2], node_id="node-a", store_name="store-node-a") == []
    assert set(catalog.remove(b[:2], node_id="node-b", store_name="store-node-b")) == keys(b[:2])
    assert catalog.usage() == TierUsage(1, BLOCK_BYTES)
    assert catalog.remove(b) == [BlockKey(b[2], 0)]
    assert catalog.usage() == TierUsage(0, 0)


def test_rows_of_dead_nodes_are_pruned(catalog):
    # Hashes above 2**63 come back as rayapp's unsigned values, not the database's signed ones.
    gone = [BlockHash((1 << 64) - 1), BlockHash(1 << 63), BlockHash(7)]
    assert catalog.upsert(rows(chain(2, "a"), node="alive") + rows(gone, node="gone"))
    assert set(catalog.remove_nodes_except(["alive"])) == keys(gone)
    assert catalog.usage() == TierUsage(2, 2 * BLOCK_BYTES)


def test_touch_counts_the_rows_it_refreshed(catalog):
    hashes = chain(3)
    assert catalog.upsert(rows(hashes[:2]))
    assert catalog.touch(hashes) == 2
    assert catalog.touch(hashes, layer_group=3) == 0


def test_models_of_another_kv_width_share_the_database_in_a_table_of_their_own(dsn, catalog):
    # As when the next `serve run` (the embedded database outlives the cluster) serves a model of other KV heads.
    other = Catalog(dsn, 64)
    assert catalog.upsert(rows(chain(2, "wide")))
    narrow = chain(3, "narrow")
    assert other.upsert(rows(narrow, representations=[np.full(64, 0.5, dtype=np.float32)] * 3))
    assert other.longest_chain(narrow).num_present == 3
    assert other.longest_chain(chain(2, "wide")) == ChainMatch()
    assert catalog.longest_chain(chain(2, "wide")).num_present == 2
    other.close()


def test_opengauss_is_detected_from_its_version_text():
    text = "PostgreSQL 9.2.4 (openGauss 6.0.0 build aee4abd5) compiled at 2024-09-29 19:14:26 commit 0 last mr"
    assert detect_dialect(text) is Dialect.OPENGAUSS
    assert detect_dialect("PostgreSQL 18.6 on x86_64-pc-linux-gnu") is Dialect.POSTGRESQL


def test_opengauss_upserts_with_on_duplicate_key_update():
    og, pg = CatalogSQL(Dialect.OPENGAUSS, 8), CatalogSQL(Dialect.POSTGRESQL, 8)
    upsert = og.upsert(2)
    assert "ON DUPLICATE KEY UPDATE" in upsert and "ON CONFLICT" not in upsert
    # openGauss refuses to update key columns in ON DUPLICATE KEY UPDATE.
    updates = upsert.split("ON DUPLICATE KEY UPDATE", 1)[1]
    assert "block_hash =" not in updates and "layer_group =" not in updates and "created_at" not in updates
    assert "node_id = EXCLUDED.node_id" in updates and "last_used = EXCLUDED.last_used" in updates
    assert pg.upsert(2).startswith(upsert.split(" ON DUPLICATE", 1)[0])
    assert "ON CONFLICT (block_hash, layer_group) DO UPDATE SET " + updates.strip() in pg.upsert(2)
    # DataVec's vector type is built in; only PostgreSQL needs the extension.
    assert og.create_extension() is None and pg.create_extension() == "CREATE EXTENSION IF NOT EXISTS vector"
    assert "vector(8)" in og.create_table() and "PRIMARY KEY (block_hash, layer_group)" in og.create_table()
    assert "<#> %(query)s::vector" in og.topk_inner_product()
    # One statement for the whole batch: a VALUES tuple per row, each with one vector cast.
    assert og.upsert(3).count("::vector, now())") == 3


def test_every_value_is_a_parameter():
    sql = CatalogSQL(Dialect.OPENGAUSS, 8)
    statements = [sql.upsert(3), sql.locate(), sql.topk_inner_product(), sql.delete_node(),
                  sql.delete_nodes_except(), sql.delete_hashes(guarded=True), sql.delete_hashes(guarded=False),
                  sql.usage(per_node=True), sql.touch()]  # fmt: skip
    for statement in statements:
        assert "%(" in statement or "%s" in statement
        # No quoted literal anywhere: values arrive as parameters only.
        assert "'" not in statement


def test_a_table_dropped_under_the_catalog_is_recreated_on_retry(dsn, catalog):
    quick = Catalog(dsn, REPRESENTATION_DIM, retry_after_s=0.0)
    assert quick.upsert(rows(chain(2)))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE kv_blocks_v{REPRESENTATION_DIM}")  # as if the database were re-initialized
    assert quick.longest_chain(chain(2)) == ChainMatch()  # no error reaches the caller
    assert quick.upsert(rows(chain(2)))  # reconnected: the table is back
    assert quick.longest_chain(chain(2)).num_present == 2
    quick.close()
