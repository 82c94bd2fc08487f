"""vLLM replicas on CPU step an engine of one worker in its engine core process; with a worker process, replicas
sharing a node compute on cores of their own, not all on vLLM's first core, share cores rather than take the ones
vLLM keeps for its scheduler loops, and leave those free with the cluster tier on."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.utils.ompmultiprocessing import OMPProcessManager  # noqa: E402

from rayapp.vllm_ext.cpu_binding import bind_cpu_slot, keep_frontend_core, one_process_engine  # noqa: E402

BIND = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"
PROCESSES = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture
def unset(monkeypatch):
    """Neither the worker process nor a binding chosen by the user; what the test sets is undone after it (set
    first, so that monkeypatch restores the variables' absence)."""
    for name in (PROCESSES, BIND):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_an_engine_of_one_worker_steps_in_its_engine_core_process(unset):
    assert one_process_engine({}) and one_process_engine({"distributed_executor_backend": "uni"})
    assert os.environ[PROCESSES] == "0"  # what vLLM's CPU platform reads to keep its `uni` executor


@pytest.mark.parametrize(
    "engine_kwargs",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"distributed_executor_backend": "mp"}],
)
def test_several_workers_or_a_chosen_executor_keep_vllms_worker_processes(unset, engine_kwargs):
    assert not one_process_engine(engine_kwargs)
    assert PROCESSES not in os.environ


def test_a_users_worker_process_or_binding_wins(unset, monkeypatch):
    monkeypatch.setenv(PROCESSES, "1")
    assert not one_process_engine({})
    assert os.environ[PROCESSES] == "1"
    monkeypatch.delenv(PROCESSES)
    monkeypatch.setenv(BIND, "0")  # only vLLM's worker process applies it
    assert not one_process_engine({})
    assert PROCESSES not in os.environ


@pytest.fixture
def node(monkeypatch, tmp_path):
    """A 4-core node of our own: slot locks in tmp_path, no binding set by the user."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv(BIND, raising=False)


def _replica(num_cpus: float, **engine_kwargs) -> tuple[object, str | None]:
    """Start one replica's binding and report the binding its engine would see (then forget it, as a new
    replica process would not have it)."""
    lock = bind_cpu_slot(num_cpus, engine_kwargs)
    return lock, os.environ.pop(BIND, None)


def test_replicas_on_one_node_take_distinct_cores_and_a_dead_ones_core_is_reused(node):
    first, second, third = _replica(1), _replica(1), _replica(1)
    # The first keeps vLLM's own choice (first core, one left for the frontends); the others move over.
    assert (first[1], second[1], third[1]) == (None, "1", "2")
    second[0].close()  # that replica died
    again = _replica(1)
    assert again[1] == "1"
    for lock, _ in (first, third, again):
        lock.close()


def test_a_replica_of_two_cpus_takes_two_cores_and_replicas_beyond_the_free_cores_share_them(node):
    first, second = _replica(2), _replica(2)
    # Cores 0-2 are vLLM's to compute on (3 is kept for its scheduler loops and the frontends): one slot of two.
    assert second[1] == "0,1"
    third = _replica(2)
    assert third[1] == "0,1"
    for lock, _ in (first, second, third):
        lock.close()


def test_on_two_cores_a_second_replica_computes_beside_the_first_not_on_the_schedulers_core(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv(BIND, raising=False)
    first, second = _replica(0.5), _replica(0.5)
    assert (first[1], second[1]) == (None, "0")
    first[0].close()
    second[0].close()


def test_the_cores_vllm_reserves_are_never_a_slot(node, monkeypatch):
    monkeypatch.setenv(RESERVED, "2")  # the tier's reservation, or a user's
    replicas = [_replica(1) for _ in range(4)]
    assert [bind for _, bind in replicas] == [None, "1", "0", "1"]
    for lock, _ in replicas:
        lock.close()
    monkeypatch.setenv(RESERVED, "0")  # nothing kept back: every core is a slot
    replicas = [_replica(1) for _ in range(4)]
    assert [bind for _, bind in replicas] == [None, "1", "2", "3"]
    for lock, _ in replicas:
        lock.close()


def test_a_users_binding_wins(node, monkeypatch):
    monkeypatch.setenv(BIND, "0-1")
    assert bind_cpu_slot(1, {}) is None
    assert os.environ[BIND] == "0-1"


def test_engines_of_several_workers_keep_vllms_binding_of_each_worker(node):
    first = _replica(1)
    assert [_replica(1, tensor_parallel_size=2), _replica(1, pipeline_parallel_size=2)] == [(None, None)] * 2
    first[0].close()


def _vllm_binding(kv_connector: bool) -> OMPProcessManager:
    """vLLM's own automatic binding for one worker on this host, with or without a KV connector."""
    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=0, _api_process_count=1)
    return OMPProcessManager(SimpleNamespace(parallel_config=parallel, kv_transfer_config=kv_connector or None))


def test_the_cluster_tier_keeps_the_core_vllm_leaves_to_its_scheduler_and_the_replica(monkeypatch):
    monkeypatch.delenv(BIND, raising=False)
    monkeypatch.delenv(RESERVED, raising=False)
    without = _vllm_binding(kv_connector=False)
    keep_frontend_core({"kv_transfer_config": object()})
    with_tier = _vllm_binding(kv_connector=True)
    os.environ.pop(RESERVED, None)  # a new replica process would not have it
    assert with_tier.reserve_cpu_num == without.reserve_cpu_num
    if len(os.sched_getaffinity(0)) > 1:  # vLLM's OMP threads leave a core to the scheduler loop and the replica
        assert with_tier.reserved_cpu_list == without.reserved_cpu_list != []


def test_a_users_reservation_or_binding_wins_over_the_tiers(monkeypatch):
    monkeypatch.setenv(RESERVED, "3")
    keep_frontend_core({"kv_transfer_config": object()})
    assert os.environ[RESERVED] == "3"
    monkeypatch.delenv(RESERVED)
    monkeypatch.setenv(BIND, "0-1")
    keep_frontend_core({"kv_transfer_config": object()})
    assert RESERVED not in os.environ
