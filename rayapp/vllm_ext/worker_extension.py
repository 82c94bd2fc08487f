"""What rayapp's vLLM replicas mix into vLLM's worker (`worker_extension_cls=REPLICA_EXTENSION`): the numbers the
retrieval plugin and the cluster tier's writer count in the worker process, which the replica reads with
`collective_rpc` for `/metrics`."""

from __future__ import annotations

from rayapp.vllm_ext.retrieval import RetrievalWorkerExtension

REPLICA_EXTENSION = "rayapp.vllm_ext.worker_extension.ReplicaWorkerExtension"


class ReplicaWorkerExtension(RetrievalWorkerExtension):
    def tier_stats(self) -> dict[str, int]:
        from rayapp.vllm_ext.tier_worker import tier_stats  # Ray and the tier only where the tier is on

        return tier_stats()
