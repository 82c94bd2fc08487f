"""Fixtures of the integration tests: a Ray Serve LLM user's config for the shipped model, and the cluster tier's
database (tests/kvtier's own fixtures: an embedded PostgreSQL + pgvector for the session, emptied per test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rayapp.kernels.cpu import cpu_plan

_spec = importlib.util.spec_from_file_location("kvtier_conftest", Path(__file__).parents[1] / "kvtier" / "conftest.py")
_kvtier = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_kvtier)
database, dsn, catalog = _kvtier.database, _kvtier.dsn, _kvtier.catalog

MODEL = "SmolLM2-135M-Instruct"
# What a user sets on this CPU: bfloat16 where oneDNN has a bf16 path, else float32 (rayapp's `dtype: auto`).
DTYPE = cpu_plan("auto").dtype_name


@pytest.fixture(scope="session")
def serve_llm_args(model_dir):
    """`serve_llm_args()`: a CPU user's Ray Serve LLM config, as they would write it for
    `ray.serve.llm:build_openai_app`, two replicas of the shipped model (a fresh copy each call)."""
    return lambda: {
        "llm_configs": [
            {
                "model_loading_config": {"model_id": MODEL, "model_source": str(model_dir)},
                "accelerator_config": {"kind": "cpu"},
                "placement_group_config": {"bundles": [{"CPU": 0.5}]},
                "engine_kwargs": {
                    "dtype": DTYPE, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 29, "max_num_seqs": 8,
                    "enable_prompt_tokens_details": True,
                },
                "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
            }
        ],
        "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}},
    }  # fmt: skip
