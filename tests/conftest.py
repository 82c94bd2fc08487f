"""Shared fixtures: the shipped model (converted once per machine) and engines built on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayapp.models.loader import prepare_default_model
from rayapp.models.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)
