"""Which backend the retrieval plugin puts in place on each platform, without the platform's hardware.

CUDA: vLLM's `CUSTOM` backend, which rayapp's CUDA replicas select. Ascend: vllm-ascend is not installed here,
so its modules are stood in for by a minimal tree in `sys.modules` carrying the names vllm-ascend 0.23 has
(`vllm_ascend.platform.NPUPlatform.get_attn_backend_cls` returning fixed class paths; the classes of
`vllm_ascend.attention.attention_v1`); what is checked is the plugin's wrapping of that function and that its
Ascend backend is built on those names. Other platforms run vLLM's own attention, said once.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
import types
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import vllm.platforms  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.utils.import_utils import resolve_obj_by_qualname  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from rayapp.config import AppConfig  # noqa: E402
from rayapp.vllm_ext import retrieval  # noqa: E402
from rayapp.vllm_ext.engine import engine_kwargs  # noqa: E402

STOCK = "vllm_ascend.attention.attention_v1.AscendAttentionBackend"
MLA = "vllm_ascend.attention.mla_v1.AscendMLABackend"


def _platform(**kind) -> SimpleNamespace:
    flags = {"is_cpu": False, "is_cuda": False, **kind}
    return SimpleNamespace(
        device_name=kind.get("device_type", "cuda"), device_type=kind.get("device_type", "cuda"),
        is_cpu=lambda: flags["is_cpu"], is_cuda=lambda: flags["is_cuda"],
    )  # fmt: skip


@pytest.fixture
def plugin_on(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "retrieval")
    monkeypatch.setattr(retrieval, "_LOGGED", set())
    yield
    AttentionBackendEnum.CUSTOM.clear_override()


def _modules(monkeypatch, attention_v1: dict) -> type:
    """vllm-ascend 0.23's modules as far as the plugin reads them; returns its NPUPlatform."""

    class NPUPlatform:
        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return MLA if attn_selector_config.use_mla else STOCK  # fixed classes, whatever vLLM selected

    tree = {
        "vllm_ascend": {},
        "vllm_ascend.platform": {"NPUPlatform": NPUPlatform},
        "vllm_ascend.attention": {},
        "vllm_ascend.attention.attention_v1": attention_v1,
        "vllm_ascend.attention.utils": {"enable_cp": lambda: False},
    }
    for name, members in tree.items():
        module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(members)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "rayapp.vllm_ext.retrieval_ascend", raising=False)
    monkeypatch.setattr(retrieval, "version", lambda dist: {"vllm-ascend": "0.23.0"}[dist])
    return NPUPlatform


def _ascend_attention() -> dict:
    """The classes of vllm_ascend.attention.attention_v1 the plugin's Ascend backend builds on."""

    class AscendAttentionBackendImpl:
        pass

    class AscendAttentionMetadataBuilder:
        pass

    class AscendAttentionBackend:
        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return AscendAttentionBackendImpl

        @staticmethod
        def get_builder_cls():
            return AscendAttentionMetadataBuilder

    @dataclasses.dataclass
    class AscendMetadata:
        num_actual_tokens: int = 0

    AscendAttentionState = enum.Enum("AscendAttentionState", "PrefillNoCache PrefillCacheHit DecodeOnly")
    classes = (AscendAttentionBackend, AscendAttentionBackendImpl, AscendAttentionMetadataBuilder, AscendMetadata)
    return {cls.__name__: cls for cls in (*classes, AscendAttentionState)}


@pytest.fixture
def forget_ascend_backend():
    yield
    sys.modules.pop("rayapp.vllm_ext.retrieval_ascend", None)
    vars(sys.modules["rayapp.vllm_ext"]).pop("retrieval_ascend", None)


def test_on_cuda_the_plugin_is_vllms_custom_backend_which_rayapps_replicas_select(plugin_on, monkeypatch):
    with monkeypatch.context() as on_cuda:
        on_cuda.setattr(vllm.platforms, "current_platform", _platform(is_cuda=True))
        retrieval.register()
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert AttentionBackendEnum.CUSTOM.get_path() == retrieval.CUDA_BACKEND_PATH
    assert backend.get_name() == "CUSTOM" and backend.get_builder_cls()._cudagraph_support is AttentionCGSupport.NEVER


def test_rayapps_cuda_replicas_with_sparse_on_select_the_plugins_backend(monkeypatch):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)  # naming `retrieval` there turns sparse on
    args = AsyncEngineArgs(model="Qwen/Qwen2.5-7B-Instruct", **engine_kwargs(
        AppConfig(engine="vllm", device="cuda", sparse={"enabled": True})))  # fmt: skip
    assert args.attention_config.backend is AttentionBackendEnum.CUSTOM
    assert "attention_config" not in engine_kwargs(AppConfig(engine="vllm", device="cuda"))  # sparse off: vLLM's pick
    assert "attention_config" not in engine_kwargs(AppConfig(engine="vllm", sparse={"enabled": True}))  # CPU
    named = engine_kwargs(AppConfig(engine="vllm", device="cuda", sparse={"enabled": True},
                                    engine_kwargs={"attention_config": {"backend": "FLASH_ATTN"}}))  # fmt: skip
    assert named["attention_config"] == {"backend": "FLASH_ATTN"}  # the user's choice stays


@pytest.mark.parametrize("device_type", ["rocm", "npu"])
def test_a_platform_without_a_backend_runs_vllms_attention_and_says_so_once(plugin_on, monkeypatch, caplog,
                                                                             device_type):  # fmt: skip
    monkeypatch.setattr(vllm.platforms, "current_platform", _platform(device_type=device_type))
    monkeypatch.delitem(sys.modules, "vllm_ascend", raising=False)
    with caplog.at_level(logging.WARNING, logger="rayapp.retrieval"):
        retrieval.register()
        retrieval.register()  # rayapp's replica and vLLM both call it in one process
    said = [r.getMessage() for r in caplog.records if r.name == "rayapp.retrieval"]
    reason = "no backend for it" if device_type == "rocm" else "vllm-ascend is not importable"
    assert len(said) == 1 and f"no sparse attention on {device_type} ({reason}" in said[0]
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def test_on_vllm_ascend_its_plain_backend_becomes_the_retrieval_one(monkeypatch, forget_ascend_backend):
    attention = _ascend_attention()
    platform = _modules(monkeypatch, attention)
    assert retrieval.install_ascend() is None
    wrapped = platform.get_attn_backend_cls.__func__
    assert retrieval.install_ascend() is None and platform.get_attn_backend_cls.__func__ is wrapped  # once
    plain, mla = SimpleNamespace(use_mla=False), SimpleNamespace(use_mla=True)
    assert platform.get_attn_backend_cls(AttentionBackendEnum.FLASH_ATTN, mla) == MLA  # MLA stays vllm-ascend's
    path = platform.get_attn_backend_cls(None, plain)
    assert path == retrieval.ASCEND_BACKEND_PATH
    backend = resolve_obj_by_qualname(path)
    assert issubclass(backend, attention["AscendAttentionBackend"]) and backend.get_name() == "CUSTOM"
    assert issubclass(backend.get_impl_cls(), attention["AscendAttentionBackendImpl"])
    builder = backend.get_builder_cls()
    assert issubclass(builder, attention["AscendAttentionMetadataBuilder"])
    assert builder.get_cudagraph_support(None, None) is AttentionCGSupport.NEVER


def test_another_vllm_ascend_release_keeps_its_own_attention(monkeypatch, forget_ascend_backend):
    platform = _modules(monkeypatch, _ascend_attention())
    monkeypatch.setattr(retrieval, "version", lambda dist: "0.25.1")
    assert retrieval.install_ascend() == "vllm-ascend 0.25.1; the Ascend backend follows 0.23.x"
    assert platform.get_attn_backend_cls(None, SimpleNamespace(use_mla=False)) == STOCK


def test_an_ascend_backend_that_does_not_import_leaves_vllm_ascends_in_place(monkeypatch, caplog, plugin_on,
                                                                              forget_ascend_backend):  # fmt: skip
    attention = _ascend_attention()
    del attention["AscendMetadata"]  # a release whose classes are named otherwise
    platform = _modules(monkeypatch, attention)
    assert retrieval.install_ascend() is None
    with caplog.at_level(logging.WARNING, logger="rayapp.retrieval"):
        assert platform.get_attn_backend_cls(None, SimpleNamespace(use_mla=False)) == STOCK
        assert platform.get_attn_backend_cls(None, SimpleNamespace(use_mla=False)) == STOCK
    said = [r.getMessage() for r in caplog.records if r.name == "rayapp.retrieval"]
    assert len(said) == 1 and "AscendMetadata" in said[0] and "vllm-ascend runs its own attention" in said[0]
