"""Everything that imports vLLM: the `engine: vllm` replica backend and its KV-event feed for the
prefix router. Imported only by `rayapp.deployments` (when a replica runs vLLM), so rayapp installs
and serves without vLLM."""
