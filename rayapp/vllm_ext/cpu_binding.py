"""vLLM replicas on CPU nodes: which process computes, and on which cores.

An engine of one worker runs it inside its engine core process (`one_process_engine`), so nothing spins between
steps. With vLLM's worker in a process of its own (several workers, or the user's choice), the worker and the
engine core's scheduler loop spin on the CPU between steps; vLLM keeps the last `VLLM_CPU_NUM_OF_RESERVED_CPU`
cores of a node for them and the frontends. Replicas sharing a node then compute on cores apart while there are
free ones, share them beyond that, and never take the reserved ones.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import tempfile
from pathlib import Path
from typing import Any


def one_process_engine(kwargs: dict[str, Any]) -> bool:
    """On CPU, run an engine of one worker in vLLM's engine core process (vLLM's `uni` executor) rather than in a
    worker process of its own; True when the engine will.

    vLLM on CPU moves even one worker into a process of its own, and the two hand every step over through
    shared memory, each spinning on it (`sched_yield`) for a second after each message: the engine core spins
    through the whole forward. Two replicas on 2 cores (`bench/serve_multiturn.py --workloads 2x`) burned 35.9
    CPU seconds in their engine cores beside 52.4 in the workers, whose compute threads vLLM's binding had put
    on one core. In one process the engine core steps the model itself and blocks on its input queue when idle;
    its compute threads (Ray's `OMP_NUM_THREADS`, the replica's `num_cpus`) are left to the OS to place, as
    rayapp's own engine's are. Leaves vLLM its worker process when the engine has several workers (tensor or
    pipeline parallel), the user chose an executor, bound the threads (`VLLM_CPU_OMP_THREADS_BIND`, which only
    the worker process applies) or set `VLLM_ENABLE_V1_MULTIPROCESSING`.
    """
    chosen = kwargs.get("distributed_executor_backend") not in (None, "uni")
    if _num_workers(kwargs) > 1 or chosen or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return False
    return os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0"


def bind_cpu_slot(num_cpus: float, kwargs: dict[str, Any]) -> Any:
    """On CPU, give this replica's vLLM compute cores apart from other replicas' where the node has them, and
    never the cores vLLM keeps for its scheduler loops and the frontends.

    vLLM's own choice (`VLLM_CPU_OMP_THREADS_BIND=auto`) binds every engine on a node to the same cores: all
    but the last `VLLM_CPU_NUM_OF_RESERVED_CPU` (one per worker by default), which it leaves to the engine
    core's scheduler loop and the API server. The first replica on a node keeps that choice. Each later one
    takes the first free replica number on the node, held by a file lock for the life of the process (a dead
    replica frees its number), and binds vLLM's threads to slot `number % slots` of `num_cpus` cores (at
    least one) cut from the cores vLLM does not reserve. With more replicas than slots, replicas share
    slots rather than spill onto the reserved cores: vLLM's worker and scheduler spin on the CPU between
    steps, and with a spinning worker on every core the schedulers, the replicas and the ingress starve
    (2 replicas on 2 cores, `bench/serve_multiturn.py --workloads 2x`: 11.8-18.6 output tok/s with a core
    each, 42.7 sharing one). Leaves the environment alone when the user set the binding, and to vLLM when
    the engine has several workers (tensor or pipeline parallel: vLLM binds each worker's threads itself).
    Returns the held lock (or None).
    """
    workers = _num_workers(kwargs)
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or workers > 1:
        return None
    cores = sorted(os.sched_getaffinity(0))
    reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or workers)
    compute = cores[: len(cores) - reserved] if len(cores) > reserved else cores
    width = min(max(1, int(num_cpus)), len(compute))
    slots = len(compute) // width
    number, lock = _replica_number()
    if number > 0:  # number 0 keeps vLLM's automatic binding
        slot = number % slots
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, compute[slot * width : (slot + 1) * width]))
    return lock


def _replica_number() -> tuple[int, Any]:
    """The first vLLM replica number on this node that no live process holds, and its lock, held for the life
    of this process."""
    for number in itertools.count():
        lock = open(Path(tempfile.gettempdir()) / f"rayapp-vllm-cpu-slot-{number}.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return number, lock


def keep_frontend_core(kwargs: dict[str, Any]) -> None:
    """On CPU with the cluster tier, keep the cores vLLM's automatic binding leaves to the engine core's scheduler
    loop and the frontends, as without a KV connector.

    With any KV connector, vLLM reserves one more core per worker (for NIXL's transfers between prefill and
    decode nodes); on a node with no more cores than that it reserves none, and its OMP threads share every core
    with the scheduler's busy loop and the replica. Measured with one replica on 2 cores (bench/serve_multiturn.py
    1x): 85-105 output tok/s, ITL p50 71-79 ms, against 127-147 tok/s and 48-51 ms with the core kept. The tier
    connector needs no core of its own: its threads mostly wait on the object store and the database. A user's
    `VLLM_CPU_NUM_OF_RESERVED_CPU` or explicit `VLLM_CPU_OMP_THREADS_BIND` wins.
    """
    auto = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto"
    if "kv_transfer_config" in kwargs and auto:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(_num_workers(kwargs)))


def _num_workers(kwargs: dict[str, Any]) -> int:
    """The engine's workers on this node: vLLM's reservation without a KV connector is one core each (x86, Arm
    and RISC-V)."""
    return kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
