"""Sparse retrieval attention (RetrievalKV): which pages a long sequence attends, where they live.

`policy` splits a context into initial / middle / window and sizes the selection; `host_pool`
keeps offloaded middle blocks in host memory; `block_cache` is the device LRU those blocks are
copied back into. None of them schedules work or touches the model.
"""
