"""`rayapp.integrations.ray_serve_llm:build_openai_app`'s arguments: Ray Serve LLM's, validated by Ray, plus a
`rayapp:` section; what the built app runs (Ray's ingress over rayapp's server and router), and the errors a user
gets for what cannot work. No replica starts here: the builder's output is inspected."""

from __future__ import annotations

import copy
import json
import re

import pytest
import ray

pytest.importorskip("vllm")
pytest.importorskip("ray.serve.llm")

from pydantic import ValidationError  # noqa: E402
from ray.serve.llm import LLMConfig  # noqa: E402

from rayapp.integrations.ray_serve_llm import ROUTER_CLASS, build_openai_app  # noqa: E402
from rayapp.integrations.server import RayappLLMServer, Routing  # noqa: E402
from rayapp.vllm_ext.retrieval import SETTINGS_ENV  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    # Ray's builder reads the driver's runtime env (and the tier's config, the cluster's address).
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


MODEL = "SmolLM2-135M-Instruct"  # the model_id of conftest.serve_llm_args


@pytest.fixture
def args(serve_llm_args) -> dict:
    return serve_llm_args()


def _server(app):
    """The LLMServer deployment (and its LLMConfig) behind the app's OpenAI ingress."""
    ingress = app._bound_deployment
    assert ingress.name == "OpenAiIngress"
    server = ingress.init_kwargs["llm_deployments"][MODEL]._bound_deployment
    return server, server.init_kwargs["llm_config"]


def test_a_ray_serve_llm_config_is_served_by_rays_ingress_over_rayapps_server_and_router(cluster, args):
    given = copy.deepcopy(args)
    server, config = _server(build_openai_app(args))
    assert args == given  # the user's arguments are left as they were
    assert server.func_or_class is RayappLLMServer
    router = server._deployment_config.request_router_config
    assert router.request_router_class == ROUTER_CLASS
    kwargs = router.request_router_kwargs
    assert (kwargs["block_size"], kwargs["model_id"]) == (128, MODEL)  # vLLM's CPU page size, pinned for the router
    assert (
        config.engine_kwargs["block_size"] == 128
        and config.engine_kwargs["dtype"] == _llm(args)["engine_kwargs"]["dtype"]
    )
    assert "kv_transfer_config" not in config.engine_kwargs
    assert SETTINGS_ENV not in (config.runtime_env or {}).get("env_vars", {})
    assert Routing.of(config).router.prefill_weight == 1.0
    # The router's renderer is built from a JSON copy of the config, as the replica's vLLM is.
    assert LLMConfig.model_validate(kwargs["llm_config"]).model_id == MODEL
    json.dumps(kwargs)


def test_the_rayapp_section_sets_router_weights_the_tier_and_the_plugin(cluster, args, tmp_path):
    args["llm_configs"][0]["engine_kwargs"]["block_size"] = 64
    args["llm_configs"][0]["runtime_env"] = {"env_vars": {"TZ": "UTC"}}
    args["rayapp"] = {
        "router": {"queue_weight_tokens": 8, "event_batch_period_s": 0.2},
        "kvtier": {"enabled": True, "dsn": "host=catalog port=5432 dbname=rayapp"},
        "sparse": {
            "enabled": True,
            "init_tokens": 64,
            "local_tokens": 512,
            "retrieval_block_size": 64,
            "dense_boundary": 1024,
        },
    }
    server, config = _server(build_openai_app(args))
    routing = Routing.of(config)
    assert (routing.block_size, routing.router.queue_weight_tokens, routing.router.event_batch_period_s) == (64, 8, 0.2)
    tier = config.engine_kwargs["kv_transfer_config"]
    assert tier["kv_connector"] == "RayappKVTierConnector"
    settings = tier["kv_connector_extra_config"]["rayapp"]
    assert settings["dsn"] == "host=catalog port=5432 dbname=rayapp" and settings["model_id"] == MODEL
    assert settings["ray_address"] == ray.get_runtime_context().gcs_address  # vLLM's workers join this cluster
    env = config.runtime_env["env_vars"]
    assert "retrieval" in env["VLLM_PLUGINS"].split(",") and env["TZ"] == "UTC"  # the user's own kept
    assert json.loads(env[SETTINGS_ENV])["dense_boundary"] == 1024


POW2 = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


def _llm(args: dict) -> dict:
    return args["llm_configs"][0]


BAD = {
    "a bad router weight": (
        lambda a: a.update(rayapp={"router": {"prefill_weight": 0}}),
        "rayapp.router.prefill_weight: Input should be greater than 0",
    ),
    "sparse settings that contradict each other": (
        lambda a: a.update(
            rayapp={"sparse": {"enabled": True, "init_tokens": 512, "local_tokens": 512, "dense_boundary": 1024}}
        ),
        "rayapp.sparse: invalid sparse settings: init_tokens + local_tokens",
    ),
    "an unknown section": (lambda a: a.update(rayapp={"routr": {}}), "rayapp.routr: Extra inputs are not permitted"),
    "not a mapping": (lambda a: a.update(rayapp=["router"]), "rayapp: must be a mapping"),
    "another router class": (
        lambda a: a.update(rayapp={"router": {"request_router_class": "x:Y"}}),
        "request_router_class is set by this builder",
    ),
    "retrieval blocks of part pages": (
        lambda a: a.update(rayapp={"sparse": {"enabled": True, "retrieval_block_size": 96}}),
        "retrieval_block_size=96 must be a multiple of vLLM's block_size=128",
    ),
    "the user's own request router": (
        lambda a: _llm(a)["deployment_config"].update(request_router_config={"request_router_class": POW2}),
        "deployment_config.request_router_config is set by this builder",
    ),
    "the user's own kv events": (
        lambda a: _llm(a)["engine_kwargs"].update(kv_events_config={"enable_kv_cache_events": True}),
        "engine_kwargs.kv_events_config is set per replica",
    ),
    "no prefix caching": (
        lambda a: _llm(a)["engine_kwargs"].update(enable_prefix_caching=False),
        "enable_prefix_caching: false",
    ),
    "a second KV connector": (
        lambda a: (
            _llm(a)["engine_kwargs"].update(kv_transfer_config={"kv_connector": "NixlConnector", "kv_role": "kv_both"}),
            a.update(rayapp={"kvtier": {"enabled": True, "dsn": "host=db"}}),
        ),
        "kv_transfer_config is already set",
    ),
    "LoRA adapters": (
        lambda a: _llm(a).update(lora_config={"dynamic_lora_loading_path": "s3://bucket/loras"}),
        "lora_config is not served with rayapp's router",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_what_cannot_work_is_refused_saying_what_to_change(args, case):
    change, message = BAD[case]
    change(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        build_openai_app(args)


def test_ray_serve_llms_own_arguments_are_validated_by_ray(args):
    args["llm_configs"][0]["engine_kwarg"] = {}
    with pytest.raises(ValidationError, match="engine_kwarg"):
        build_openai_app(args)
    with pytest.raises(ValidationError, match="List of models is empty"):
        build_openai_app({"llm_configs": []})


def test_the_server_refuses_to_start_outside_the_builder(args):
    config = LLMConfig.model_validate(_llm(args))
    with pytest.raises(ValueError, match="use that builder as the application's import_path"):
        Routing.of(config)
