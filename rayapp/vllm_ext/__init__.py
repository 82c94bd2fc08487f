"""Everything that imports vLLM: the `engine: vllm` replica backend, its KV-event feed for the prefix
router, the cluster tier as vLLM's KV connector, and the `retrieval` plugin with its sparse attention
backend. Imported only by `rayapp.deployments` (when a replica runs vLLM) and by vLLM's own plugin and
connector loaders, so rayapp installs and serves without vLLM."""
