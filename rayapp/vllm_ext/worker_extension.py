"""What rayapp's vLLM replicas mix into vLLM's worker (`worker_extension_cls=REPLICA_EXTENSION`): the numbers the
retrieval plugin and the cluster tier's writer count in the worker process, which the replica reads with
`collective_rpc` for `/metrics`."""

from __future__ import annotations

from rayapp.vllm_ext.retrieval import RetrievalWorkerExtension

REPLICA_EXTENSION = "rayapp.vllm_ext.worker_extension.ReplicaWorkerExtension"


class ReplicaWorkerExtension(RetrievalWorkerExtension):
    def worker_stats(self, retrieval: bool, tier: bool) -> dict[str, int]:
        """The counters the replica asks for, in one call: the retrieval plugin's and the tier writer's."""
        stats = self.retrieval_stats() if retrieval else {}
        if tier:
            from rayapp.vllm_ext.tier_worker import tier_stats  # Ray and the tier only where the tier is on

            stats.update(tier_stats())
        return stats
