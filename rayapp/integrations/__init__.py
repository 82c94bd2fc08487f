"""rayapp inside other people's apps, their arguments unchanged.

- `ray_serve_llm:build_openai_app`: Ray Serve LLM's `build_openai_app` with rayapp's prefix router fed by the
  replicas' vLLM KV events, and the cluster KV tier and `retrieval` plugin when asked for.
- `stock_vllm`: the cluster tier's `kv_transfer_config` JSON and the plugin's environment for a vLLM rayapp does
  not start (`vllm serve`, `vllm.LLM`); `rayapp kv-transfer-config` prints the JSON.

Imported by name only (they need Ray Serve LLM or vLLM, which rayapp installs and serves without).
"""
