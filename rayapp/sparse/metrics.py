"""What sparse retrieval counts, in rayapp's engine (`SparseKV`) and in the vLLM retrieval plugin: one place for
the names both report, so the same number means the same thing on either engine's `/metrics`."""

from __future__ import annotations

from rayapp.observability import counters, gauges

_SELECTED = {"sparse_selected_blocks": "Middle retrieval blocks selected for attention, summed over steps and layers"}
_LAST_STEP = {"sparse_selected_blocks_last_step": "Retrieval blocks selected in the last step"}

ENGINE_METRICS = counters(
    {
        "sparse_seqs_dense": "Sequences whose prompt put them in dense attention mode",
        "sparse_seqs_sparse": "Sequences in sparse retrieval mode, all pages on device",
        "sparse_seqs_offload": "Sequences in sparse retrieval mode with their middle offloaded to host memory",
        **_SELECTED,
        "sparse_blocks_offloaded": "Retrieval blocks moved to the host pool",
        "sparse_blocks_resumed_to_host": "Retrieval blocks a cluster-tier load put straight into the host pool",
        "sparse_cache_hits": "Selected offloaded blocks already in the device block cache",
        "sparse_cache_misses": "Selected offloaded blocks copied in from the host pool",
    }
) + gauges(
    {
        "sparse_running_sparse": "Running sequences in sparse retrieval mode",
        "sparse_running_offload": "Running sequences in sparse retrieval mode with offload",
        **_LAST_STEP,
        "sparse_blocks_copied_last_step": "Blocks copied host-to-device in the last step",
        "sparse_host_pages_held": "KV pages held in the host pool",
        "sparse_device_cache_pages": "KV pages of the device block cache",
    }
)

# The vLLM plugin decides per decode step, by context length, and cannot offload.
PLUGIN_METRICS = counters(
    {
        "sparse_decode_steps_dense": "Decode steps of sequences attending densely, summed over sequences",
        "sparse_decode_steps_sparse": "Decode steps of sequences attending sparsely, summed over sequences",
        **_SELECTED,
        "sparse_blocks_represented": "Retrieval blocks whose representation was computed (prefix-cached ones are kept)",
    }
) + gauges(
    {
        "sparse_running_dense": "Sequences that decoded densely in the last step",
        "sparse_running_sparse": "Sequences that decoded sparsely in the last step",
        **_LAST_STEP,
    }
)
