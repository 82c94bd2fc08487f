"""A real embedded PostgreSQL with pgvector for the kvtier tests, started once per session."""

from __future__ import annotations

import pytest

from rayapp.kvtier.catalog import Catalog
from rayapp.kvtier.embedded import EmbeddedPostgres

# SmolLM2-135M: 3 KV heads of 64 dims, one representation per head, flattened.
REPRESENTATION_DIM = 192


@pytest.fixture(scope="session")
def database(tmp_path_factory) -> EmbeddedPostgres:
    db = EmbeddedPostgres(tmp_path_factory.mktemp("kvtier-db"))
    db.start()
    yield db
    db.stop()


@pytest.fixture(scope="session")
def dsn(database) -> str:
    return database.start()


@pytest.fixture
def catalog(dsn) -> Catalog:
    """A catalog over an emptied table (no live node ids: every row goes)."""
    cat = Catalog(dsn, REPRESENTATION_DIM)
    cat.remove_nodes_except([])
    yield cat
    cat.close()
