"""Sparse retrieval attention (RetrievalKV): which pages a long sequence attends, where they live.

`extension` is the engine's `SparseKV` (found by the engine's extension registry as `sparse`): per-sequence
state, each step's plan (`plans`, and the recent queries of `queries`) and the per-layer attention; `resume`
places a history resumed from the cluster tier. `policy` splits a context into initial / middle / window and
sizes the selection; `host_pool` keeps offloaded middle blocks in host memory; `block_cache` is the device LRU
those blocks are copied back into.
"""
