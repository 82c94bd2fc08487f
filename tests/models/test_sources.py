"""Models named the way users name them: a shipped name, a .gguf file, a local folder, a Hugging Face repo id
(from an offline cache the test lays out); and each way a name can be wrong is one error saying what to change."""

from __future__ import annotations

import hashlib
import shutil
import sys

import pytest

from rayapp.config import AppConfig
from rayapp.deployments.engines import pin_model
from rayapp.models import gguf
from rayapp.models.gguf import ShippedGGUF, prepare_shipped
from rayapp.models.loader import ModelInfo, model_id, resolve_model, served_name

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hf_cache(tmp_path, model_dir, monkeypatch):
    """An offline Hugging Face cache holding the shipped model's files as `REPO` at `REVISION` (refs/main)."""
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    repo = hub / f"models--{REPO.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    # huggingface_hub reads HF_HOME when imported; the cache path is read again at each call.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_a_repo_id_resolves_from_an_offline_cache_and_pins_its_commit(hf_cache):
    path = resolve_model(REPO)
    assert path == hf_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    pinned = pin_model(AppConfig(model=REPO))
    assert pinned.revision == REVISION and "revision" in pinned.model_dump(exclude_unset=True)
    assert served_name(REPO) == REPO
    assert model_id(REPO, REVISION) == f"{REPO}@{REVISION}"
    assert ModelInfo.from_dir(path).context_length == 8192


def test_a_repo_id_missing_from_the_offline_cache_says_how_to_fill_it(hf_cache):
    with pytest.raises(ValueError, match=r"cannot be resolved offline.*hf download Qwen/Qwen3-8B"):
        resolve_model("Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match="at revision 'v2'"):
        resolve_model(REPO, "v2")


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        ("/no/such/model", "does not exist here and is not a Hugging Face repo id"),
        ("./weights", "does not exist here"),
        ("a/b/c", "does not exist here"),
    ],
)
def test_a_name_that_is_neither_a_path_nor_a_repo_id_is_one_error(model, problem):
    with pytest.raises(ValueError, match=problem):
        resolve_model(model)


def test_a_file_that_is_not_a_gguf_and_a_folder_without_config_are_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="without a config.json"):
        resolve_model(str(tmp_path))


def test_a_corrupt_gguf_is_one_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYAPP_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 64)
    with pytest.raises(ValueError, match=r"broken.gguf is not a GGUF file transformers can read"):
        resolve_model(str(bad))
    assert not list((tmp_path / "cache" / "models").glob("broken-*/config.json"))


def test_a_model_without_a_chat_template_fails_the_deploy(tiny_model, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model("qwen3"), folder)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        path = folder / name
        if name.endswith(".json") and path.exists():
            path.write_text(path.read_text().replace('"chat_template"', '"_chat_template_removed"'))
        elif path.exists():
            path.unlink()
    with pytest.raises(ValueError, match="has no chat template; set chat_template"):
        pin_model(AppConfig(model=str(folder)))


def test_an_architecture_rayapps_engine_does_not_run_fails_the_deploy_naming_it(tiny_model):
    with pytest.raises(ValueError, match=r"is MistralForCausalLM: rayapp's engine runs .*set engine: vllm"):
        pin_model(AppConfig(model=str(tiny_model("mistral", sliding_window=None))))


def _fake_parts(root, sizes: list[int]) -> tuple[list[tuple[str, str, int]], bytes]:
    """Packages `fakepart1..N` under `root`, each with data/part.bin of the given size; their joined bytes."""
    parts, whole = [], b""
    for i, size in enumerate(sizes, start=1):
        data = bytes((i * 7 + j) % 251 for j in range(size))
        package = root / f"fakepart{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / "part.bin").write_bytes(data)
        parts.append((f"fakepart{i}", "data/part.bin", size))
        whole += data
    return parts, whole


@pytest.fixture()
def split_model(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("RAYAPP_CACHE_DIR", str(tmp_path / "cache"))
    parts, whole = _fake_parts(tmp_path / "site", [1000, 1000, 300])
    yield ShippedGGUF("Fake", (), "pip install fake-parts", tuple(parts), hashlib.sha256(whole).hexdigest()), whole
    for name in [m for m in sys.modules if m.startswith("fakepart")]:
        del sys.modules[name]


def test_split_parts_join_in_order_and_convert(split_model, monkeypatch):
    model, whole = split_model
    seen = {}

    def convert(path, target):
        seen["bytes"] = path.read_bytes()
        return target

    monkeypatch.setattr(gguf, "convert_gguf", convert)
    assert prepare_shipped(model).name == "Fake"
    assert seen["bytes"] == whole


def test_a_truncated_part_is_named(split_model, tmp_path):
    model, _ = split_model
    part = tmp_path / "site" / "fakepart2" / "data" / "part.bin"
    part.write_bytes(part.read_bytes()[:500])
    with pytest.raises(ValueError, match=r"part 2 .* has 500 bytes, expected 1,000.*pip install fake-parts"):
        prepare_shipped(model)


def test_parts_whose_sha256_differs_are_refused(split_model, tmp_path):
    model, _ = split_model
    part = tmp_path / "site" / "fakepart3" / "data" / "part.bin"
    part.write_bytes(b"\0" * 300)
    with pytest.raises(ValueError, match=r"the joined parts have sha256 [0-9a-f]{64}, expected"):
        prepare_shipped(model)
    assert not (tmp_path / "cache" / "models" / "Fake").exists()


def test_a_missing_part_names_the_install_command(split_model, tmp_path):
    model, _ = split_model
    shutil.rmtree(tmp_path / "site" / "fakepart3")
    with pytest.raises(ValueError, match=r"needs the wheels that ship it: pip install fake-parts"):
        prepare_shipped(model)


def test_the_shipped_long_model_is_known_by_name_and_alias():
    assert gguf.shipped("qwen2.5-coder-0.5b") is gguf.shipped("Qwen2.5-Coder-0.5B-Instruct") is gguf.SHIPPED[1]
    assert served_name("qwen2.5-coder-0.5b") == "Qwen2.5-Coder-0.5B-Instruct"
    assert served_name(None) == "SmolLM2-135M-Instruct"
