"""The faults `bench/chaos.py` injects into a served rayapp application, and how it sees each one healed.

Each is what a production cluster sees: a process killed with SIGKILL (a replica, the PrefixIndex actor, a node's
tier store, the MetricsHub), the catalog database frozen with SIGSTOP for seconds and then let go on, and a client
that vanishes mid-stream (the load's part: `chaos.py` drops the connection). Actor processes are found by the
titles Ray gives its workers (`ray::<class>`), the database by its data directory's `postmaster.pid`.

A fault heals when what it broke works again: a killed replica once Serve runs as many replicas as it should again
(none of them the dead one); the index once it answers and knows every live replica again (they resend snapshots);
a store once its restarted actor answers; the hub once `/metrics` shows every live replica's series again; the
catalog once a fresh connection answers after the SIGCONT. Heal times count from the kill, or from the release
of a frozen catalog.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import psycopg
import ray
from ray import serve

from rayapp.kvtier.store import NAMESPACE, store_name
from rayapp.prefix_router.actor import CLUSTER_HOLDER

KINDS = ("replica", "index", "store", "hub", "catalog", "client")
# How long a fault may take to heal before it counts as not healed.
HEAL_BOUND_S = 300.0
FREEZE_S = (2.0, 8.0)  # a frozen catalog stays stopped this long (uniform)


@dataclass
class Fault:
    kind: str
    event: int  # the schedule's event that injected it (two faults of one event land together)
    at_s: float  # since the soak started
    target: str
    heal_s: float | None = None  # None: not healed (yet, or within HEAL_BOUND_S)
    done: bool = False


def live_replicas(app: str) -> list[str]:
    """The IDs of the application's LLMReplica replicas whose actors are alive (as the index and /metrics name them)."""
    prefix = f"SERVE_REPLICA::{app}#LLMReplica#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return sorted(n[len(prefix) :] for n in names)


def _running(app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None or "LLMReplica" not in status.deployments:
        return 0
    return status.deployments["LLMReplica"].replica_states.get("RUNNING", 0)


def _processes(title: str) -> list[psutil.Process]:
    """Ray workers whose title is `ray::<title>` (idle) or `ray::<title>.<method>` (in a call)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error, IndexError, TypeError):
            name = p.info["cmdline"][0].split()[0]
            if name == f"ray::{title}" or name.startswith(f"ray::{title}."):
                found.append(p)
    return found


def _postgres(data_dir: Path) -> list[psutil.Process]:
    postmaster = psutil.Process(int((data_dir / "pgdata" / "postmaster.pid").read_text().split()[0]))
    return [postmaster, *postmaster.children(recursive=True)]


def _signal(processes: list[psutil.Process], sig: signal.Signals) -> None:
    for p in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


class Faults:
    """Injects faults into application `app` (`replicas` LLMReplica replicas, served at `base_url`, its PrefixIndex
    `index`, its tier's embedded database in `data_dir`, reached at `dsn`) and times their healing, each on a thread
    of its own. At most one fault of a kind is out at a time (a second replica killed while the first heals would
    take the whole app down on two replicas: a fleet's disruption budget allows one); `vanish()` asks the load to
    drop a stream."""

    def __init__(self, app: str, replicas: int, base_url: str, index: ray.actor.ActorHandle, data_dir: Path, dsn: str,
                 vanish: Callable[[], None], seed: int) -> None:  # fmt: skip
        self.app, self.replicas, self.base_url, self.index = app, replicas, base_url, index
        self.data_dir, self.dsn = data_dir, dsn
        self._vanish = vanish
        self._rng = random.Random(seed)
        self._start = time.monotonic()
        self.faults: list[Fault] = []
        self._threads: list[threading.Thread] = []
        self._frozen: list[psutil.Process] = []
        self._lock = threading.Lock()

    def outstanding(self, kind: str) -> bool:
        return any(f.kind == kind and not f.done for f in self.faults)

    def inject(self, kind: str, event: int) -> Fault:
        now = time.monotonic()
        fault = Fault(kind, event, round(now - self._start, 1), "")
        heal: Callable[[], bool] | None = None
        if kind == "replica":
            before = set(live_replicas(self.app))
            victim = self._rng.choice(_processes(f"ServeReplica:{self.app}:LLMReplica"))
            fault.target = f"pid {victim.pid}"
            victim.kill()

            def heal() -> bool:
                live = set(live_replicas(self.app))
                return live != before and len(live) == self.replicas and _running(self.app) == self.replicas
        elif kind in ("index", "store", "hub"):
            title = {"index": "PrefixIndexService", "store": "KVTierStore", "hub": "MetricsHub"}[kind]
            (victim,) = _processes(title)
            fault.target = f"pid {victim.pid}"
            victim.kill()
            heal = {"index": self._index_heals, "store": self._store_answers, "hub": self._hub_heals}[kind]
        elif kind == "catalog":
            with self._lock:
                self._frozen = _postgres(self.data_dir)
            hold_s = self._rng.uniform(*FREEZE_S)
            fault.target = f"postgres frozen {hold_s:.1f} s"
            _signal(self._frozen, signal.SIGSTOP)
            now = time.monotonic()
        elif kind == "client":
            fault.target = "a stream dropped after its first delta"
            self._vanish()
            fault.heal_s, fault.done = 0.0, True
        else:
            raise ValueError(f"unknown fault kind {kind!r}; one of {KINDS}")
        self.faults.append(fault)
        if kind == "catalog":
            self._watch(fault, self._catalog_answers, now, release_after_s=hold_s)
        elif heal is not None:
            self._watch(fault, heal, now)
        return fault

    def _watch(self, fault: Fault, healed: Callable[[], bool], since: float, release_after_s: float = 0.0) -> None:
        def run() -> None:
            nonlocal since
            if release_after_s:
                time.sleep(release_after_s)
                self.release()
                since = time.monotonic()
            time.sleep(0.5)  # Ray and Serve notice a death within moments; before that, nothing looks broken
            while time.monotonic() - since < HEAL_BOUND_S:
                with contextlib.suppress(Exception):
                    if healed():
                        fault.heal_s = round(time.monotonic() - since, 1)
                        break
                time.sleep(0.5)
            fault.done = True

        thread = threading.Thread(target=run, name=f"chaos-heal-{fault.kind}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def release(self) -> None:
        """Let a frozen catalog go on (also on the way out, whatever happened)."""
        with self._lock:
            frozen, self._frozen = self._frozen, []
        _signal(frozen, signal.SIGCONT)

    def wait_healed(self) -> None:
        for thread in self._threads:
            thread.join()

    def _index_heals(self) -> bool:
        known = set(ray.get(self.index.replicas.remote(), timeout=5)) - {CLUSTER_HOLDER}
        return known >= set(live_replicas(self.app))

    def _store_answers(self) -> bool:
        store = ray.get_actor(store_name(ray.get_runtime_context().get_node_id()), namespace=NAMESPACE)
        ray.get(store.stats.remote(), timeout=5)
        return True

    def _hub_heals(self) -> bool:
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        return all(f'rayapp_pages_total{{replica="{r}"}}' in text for r in live_replicas(self.app))

    def _catalog_answers(self) -> bool:
        with psycopg.connect(self.dsn, connect_timeout=5) as connection:
            connection.execute("SELECT 1")
        return True
