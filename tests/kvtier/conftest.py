"""A real embedded PostgreSQL with pgvector for the kvtier tests, started once per session."""

from __future__ import annotations

import pytest
import ray

from rayapp.kvtier.catalog import Catalog
from rayapp.kvtier.postgres import EmbeddedPostgres

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


@pytest.fixture(scope="module")
def cluster():
    """A local Ray for one test module, with a small object store."""
    ray.init(address="local", num_cpus=2, object_store_memory=100 << 20, include_dashboard=False)
    yield
    ray.shutdown()
