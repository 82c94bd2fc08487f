"""The KubeRay manifests under k8s/: they parse, KubeRay would accept them, they run the same Serve
config as rayapp.config.yaml (the overlays differ only in device, engine, model and sizing), and each
overlay asks for the devices its replicas use.

Overlays are rendered by `kubectl kustomize` where kubectl is installed, else by `kustomize_build`
below, a small stand-in that knows exactly the kustomization fields k8s/ uses (and fails on any
other); where both run, a test holds them to the same output.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayapp.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
DEPLOYMENTS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu", "npu": K8S / "overlays" / "npu"}
DEVICE = {"base": "cpu", "gpu": "cuda", "npu": "npu"}
ACCELERATOR = {"gpu": "nvidia.com/gpu", "npu": "huawei.com/Ascend910"}
# The args an overlay may set apart from the base: what runs where (device, engine, model) and how big it is.
# Everything else (router, tier, limits, batching, dtype...) must stay as in rayapp.config.yaml.
OVERLAY_ARGS = {
    "device", "engine", "model", "served_model_name",
    "gpu_memory_utilization", "tensor_parallel_size", "kv_cache_memory_gb", "num_pages", "max_model_len",
    "replicas", "autoscaling_config", "num_cpus",
}  # fmt: skip


# --- a tiny kustomize -------------------------------------------------------------------------


def load_all(path: Path) -> list[Any]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize directory` would print, for the fields k8s/ uses."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - {"apiVersion", "kind", "resources", "patches", "images"}
    assert not unknown, f"{directory}/kustomization.yaml uses {unknown}: teach kustomize_build them"
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects += kustomize_build(path) if path.is_dir() else load_all(path)
    # kustomize runs patches before images, so a patch may set an image name `images:` maps.
    for patch in kustomization.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        assert isinstance(ops, list), (
            f"{patch['path']} is not a JSON 6902 patch; a strategic merge patch would replace "
            "RayService lists (kustomize has no schema for it) instead of merging into them"
        )
        targets = [obj for obj in objects if _selected(obj, patch["target"])]
        assert len(targets) == 1, f"{patch['path']} targets {len(targets)} objects, expected one"
        apply_json_patch(targets[0], ops)
    for image in kustomization.get("images", []):
        for container in _containers(objects):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
    return objects


def _selected(obj: dict[str, Any], target: dict[str, str]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    actual = {"group": group, "version": version, "kind": obj["kind"], "name": obj["metadata"]["name"]}
    return all(actual[key] == value for key, value in target.items())


def _containers(node: Any) -> list[dict[str, Any]]:
    """Every entry of every `containers` list, at any depth (what kustomize's images: rewrites)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                found += value
            else:
                found += _containers(value)
    elif isinstance(node, list):
        for item in node:
            found += _containers(item)
    return found


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """RFC 6902 add / replace / remove / test, strict as kustomize is (a missing parent fails)."""
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = last if isinstance(node, dict) else (len(node) if last == "-" else int(last))
        if op["op"] == "test":
            assert node[key] == op["value"], f"patch test failed at {op['path']}: {node[key]!r}"
        elif op["op"] == "remove":
            del node[key]
        elif op["op"] == "replace":
            node[key]  # noqa: B018 -- replace needs an existing value; KeyError/IndexError if not
            node[key] = copy.deepcopy(op["value"])
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(key, copy.deepcopy(op["value"]))
        elif op["op"] == "add":
            node[key] = copy.deepcopy(op["value"])
        else:
            raise AssertionError(f"unsupported patch op {op['op']!r}")


# --- reading the result -----------------------------------------------------------------------


def kubectl_kustomize(directory: Path) -> list[dict[str, Any]] | None:
    """What `kubectl kustomize directory` prints; None without kubectl."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    done = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


@functools.cache
def _rendered(name: str) -> list[dict[str, Any]]:
    directory = DEPLOYMENTS[name]
    objects = kubectl_kustomize(directory)
    return kustomize_build(directory) if objects is None else objects


def render(name: str) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k` would send for deployment `name` (a copy: tests may change it)."""
    return copy.deepcopy(_rendered(name))


def rayservice(name: str) -> dict[str, Any]:
    services = [obj for obj in render(name) if obj["kind"] == "RayService"]
    assert len(services) == 1
    return services[0]


def serve_config(service: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(service["spec"]["serveConfigV2"])


def worker_groups(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def ray_custom_resources(ray_start_params: dict[str, str]) -> dict[str, float]:
    """KubeRay's `resources: '"{\\"NPU\\": 1}"'`: JSON, inside the double quotes the shell strips."""
    text = ray_start_params.get("resources")
    return json.loads(text.strip('"').replace('\\"', '"')) if text else {}


def quantity(value: str | int | float) -> float:
    """A Kubernetes CPU/device quantity: 4, "4", "500m"."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# --- the stories ------------------------------------------------------------------------------


def test_every_yaml_file_under_k8s_parses():
    files = sorted([*K8S.rglob("*.yaml"), *K8S.rglob("*.yml")])
    assert len(files) >= 5
    for path in files:
        assert load_all(path), f"{path} holds no YAML document"


def test_base_serve_config_is_rayapp_config_yaml():
    local = yaml.safe_load((ROOT / "rayapp.config.yaml").read_text())
    cluster = serve_config(rayservice("base"))
    assert cluster["applications"] == local["applications"], (
        "k8s/base/rayservice.yaml serveConfigV2 drifted from rayapp.config.yaml: copy the "
        "applications over (and into the overlays' rayservice-patch.yaml)"
    )
    assert cluster == local


def _without_overlay_args(config: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(config)
    for app in config["applications"]:
        app["args"] = {k: v for k, v in app["args"].items() if k not in OVERLAY_ARGS}
    return config


@pytest.mark.parametrize("name", ["gpu", "npu"])
def test_overlay_changes_only_device_engine_model_and_sizing(name):
    base, overlay = serve_config(rayservice("base")), serve_config(rayservice(name))
    assert _without_overlay_args(overlay) == _without_overlay_args(base), (
        f"k8s/overlays/{name}/rayservice-patch.yaml's serveConfigV2 drifted from the base beyond the args an "
        f"overlay may change ({', '.join(sorted(OVERLAY_ARGS))}): copy the base's text over and change only those"
    )


@pytest.mark.parametrize("name", ["gpu", "npu"])
def test_overlay_serves_a_real_model_on_vllm_sized_by_gpu_memory_utilization(name):
    for app in serve_config(rayservice(name))["applications"]:
        config = AppConfig(**app["args"])
        assert config.engine == "vllm"
        assert config.model and "/" in config.model, "a Hugging Face repo id, as users of vLLM name models"
        # vLLM's accelerator sizing, not the CPU setting the base carries.
        assert config.gpu_memory_utilization is not None
        assert "kv_cache_memory_gb" not in config.model_fields_set


@pytest.mark.parametrize("name", ["gpu", "npu"])
def test_overlay_gives_vllm_no_fixed_kv_cache_size(name):
    pytest.importorskip("vllm")
    from rayapp.vllm_ext.engine import engine_kwargs

    for app in serve_config(rayservice(name))["applications"]:
        config = AppConfig(**app["args"])
        kwargs = engine_kwargs(config)
        assert "kv_cache_memory_bytes" not in kwargs
        assert kwargs["gpu_memory_utilization"] == config.gpu_memory_utilization
        assert kwargs["tensor_parallel_size"] == config.tensor_parallel()


def test_drift_check_lets_sizing_through_and_nothing_else():
    # The comparison the overlay test stands on: a sizing change passes, any other change is caught.
    base = serve_config(rayservice("base"))
    sized = copy.deepcopy(base)
    sized["applications"][0]["args"].update(tensor_parallel_size=2, autoscaling_config={"max_replicas": 4})
    assert _without_overlay_args(sized) == _without_overlay_args(base)
    drifted = copy.deepcopy(base)
    drifted["applications"][0]["args"]["kvtier"] = {"enabled": False}
    assert _without_overlay_args(drifted) != _without_overlay_args(base)


def test_tiny_kustomize_renders_what_kubectl_does():
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the overlays are rendered by kustomize_build alone")
    for directory in DEPLOYMENTS.values():
        assert kustomize_build(directory) == kubectl_kustomize(directory), directory


def test_npu_workers_allow_vllm_ascends_plugins():
    # VLLM_PLUGINS is an allow-list: without ascend's names there, vLLM on the NPU pods loads no platform.
    (group,) = worker_groups(rayservice("npu"))
    env = {e["name"]: e for e in group["template"]["spec"]["containers"][0].get("env", [])}
    assert {"ascend", "ascend_model", "ascend_kv_connector"} <= set(env["VLLM_PLUGINS"]["value"].split(","))
    assert "RAYAPP_API_KEYS" in env  # appended to the base's environment, not replacing it


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_every_pod_may_take_api_keys_from_a_secret_and_none_sit_in_the_config(name):
    spec = rayservice(name)["spec"]["rayClusterConfig"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        env = {e["name"]: e for e in group["template"]["spec"]["containers"][0]["env"]}
        ref = env["RAYAPP_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "rayapp-api-keys", "key": "keys", "optional": True}
    assert all(not app["args"].get("api_keys") for app in serve_config(rayservice(name))["applications"])


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_every_application_args_validate_and_ask_for_the_deployments_device(name):
    applications = serve_config(rayservice(name))["applications"]
    assert applications
    for app in applications:
        assert AppConfig(**app["args"]).device == DEVICE[name]


def test_app_config_rejects_args_a_typo_would_produce():
    # The validation the two tests above rely on is real: a misspelt key fails loudly.
    args = serve_config(rayservice("base"))["applications"][0]["args"]
    with pytest.raises(ValueError, match="devices"):
        AppConfig(**{**args, "devices": "cuda"})


@pytest.mark.parametrize("name", ["gpu", "npu"])
def test_accelerator_overlay_gives_each_worker_pod_the_devices_of_one_replica(name):
    # A replica's tensor-parallel workers share a node (STRICT_PACK), so a pod must hold all of them.
    service = rayservice(name)
    (group,) = worker_groups(service)
    resources = group["template"]["spec"]["containers"][0]["resources"]
    (app,) = serve_config(service)["applications"]
    devices = AppConfig(**app["args"]).devices_per_replica()
    assert resources["requests"][ACCELERATOR[name]] == devices, "set the pods' devices to tensor_parallel_size"
    assert resources["limits"][ACCELERATOR[name]] == devices, "set the pods' devices to tensor_parallel_size"
    other = ({"gpu", "npu"} - {name}).pop()
    assert ACCELERATOR[other] not in resources["limits"]


@pytest.mark.parametrize("name", ["gpu", "npu"])
def test_accelerator_overlay_says_how_to_set_image_and_node_selector(name):
    patch = (DEPLOYMENTS[name] / "rayservice-patch.yaml").read_text()
    kustomization = (DEPLOYMENTS[name] / "kustomization.yaml").read_text()
    assert "NODE SELECTOR" in patch and "nodeSelector" in patch and ACCELERATOR[name] in patch
    assert "SET THIS" in kustomization
    readme = (K8S / "README.md").read_text()
    assert "nodeSelector" in readme and ACCELERATOR[name] in readme


def test_base_worker_pods_ask_for_no_accelerator():
    (group,) = worker_groups(rayservice("base"))
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert not set(limits) & set(ACCELERATOR.values())


def test_npu_workers_declare_to_ray_the_npu_the_pod_was_given():
    (group,) = worker_groups(rayservice("npu"))
    pod_npus = group["template"]["spec"]["containers"][0]["resources"]["limits"]["huawei.com/Ascend910"]
    assert ray_custom_resources(group["rayStartParams"]) == {"NPU": pod_npus}


def replica_resources(config: AppConfig) -> dict[str, float]:
    """The Ray resources one replica takes on its node: its placement group's bundles, or its actor's options."""
    bundles = config.placement_group_options().get("placement_group_bundles")
    if bundles is None:
        options = config.ray_actor_options()
        bundles = [{"CPU": options["num_cpus"], "GPU": options.get("num_gpus", 0), **options.get("resources", {})}]
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            total[key] = total.get(key, 0) + amount
    return total


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_worker_group_has_room_for_every_replica(name):
    # What a replica asks Ray for (its actor, or its placement group's bundles) against what one
    # worker pod offers Ray: its CPU limit, its GPUs, its rayStartParams resources. The head offers none.
    service = rayservice(name)
    assert service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = worker_groups(service)
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    offered = {"CPU": quantity(limits["cpu"]), "GPU": quantity(limits.get("nvidia.com/gpu", 0))}
    offered.update(ray_custom_resources(group["rayStartParams"]))
    for app in serve_config(service)["applications"]:
        config = AppConfig(**app["args"])
        asked = replica_resources(config)
        per_pod = min(offered.get(key, 0) // amount for key, amount in asked.items() if amount)
        scaling = config.autoscaling_config
        first = config.replicas if scaling is None else (scaling.initial_replicas or scaling.min_replicas)
        most = config.replicas if scaling is None else scaling.max_replicas
        assert per_pod * group["replicas"] >= first, (name, asked, offered)
        assert per_pod * group["maxReplicas"] >= most, (name, asked, offered)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_rayservice_has_the_fields_kuberay_requires(name):
    service = rayservice(name)
    assert service["apiVersion"] == "ray.io/v1"
    assert service["kind"] == "RayService"
    assert service["metadata"]["name"]
    assert isinstance(service["spec"]["serveConfigV2"], str), "KubeRay takes serveConfigV2 as a string"
    cluster = service["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    groups = [head, *cluster["workerGroupSpecs"]]
    for group in groups:
        # rayStartParams is map[string]string: an unquoted number is rejected by the CRD.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), group["rayStartParams"]
        assert group["template"]["spec"]["containers"][0]["image"]
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {6379, 8265, 8000} <= head_ports
    assert cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_clients_reach_port_8000_through_one_kuberay_managed_service(name):
    service = rayservice(name)
    serve_service = service["spec"]["serveService"]
    assert serve_service["metadata"]["name"] == "rayapp"
    assert serve_service["spec"]["ports"] == [{"name": "serve", "port": 8000}]
    # KubeRay prefers the head container's `serve` port; it must say the same, as must Serve.
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "serve", "containerPort": 8000} in head["ports"]
    assert serve_config(service)["http_options"]["port"] == 8000
    # A plain Service of the same name would collide with the one KubeRay creates.
    objects = render(name)
    assert not [obj for obj in objects if obj["kind"] == "Service" and obj["metadata"]["name"] == "rayapp"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_every_container_runs_the_image_the_readme_tells_users_to_set(name):
    readme = (K8S / "README.md").read_text()
    images = {c["image"] for c in _containers(rayservice(name))}
    assert len(images) == 1, f"head and workers must run one image (one Ray, one Python): {images}"
    (image,) = images
    repository = image.rpartition(":")[0]
    assert "/" in repository, f"{image} was not mapped by an `images:` entry"
    assert repository in readme


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_every_pod_serves_through_haproxy_as_the_readme_command_does(name):
    assert "RAY_SERVE_ENABLE_HA_PROXY=1 serve run rayapp.config.yaml" in (K8S.parent / "README.md").read_text()
    for container in _containers(rayservice(name)):
        assert {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"} in container["env"], container["name"]


def test_image_is_built_with_the_clusters_ray_version():
    dockerfile = (K8S / "Dockerfile").read_text()
    (ray_version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    for name in DEPLOYMENTS:
        assert rayservice(name)["spec"]["rayClusterConfig"]["rayVersion"] == ray_version
    assert "rayapp prepare-model" in dockerfile


def test_kustomize_build_applies_patches_as_kustomize_does():
    # The helper the overlay tests stand on: add into a map, replace, test, escaped paths.
    doc = {"a": {"b": [{"name": "x", "r": {}}]}}
    apply_json_patch(
        doc,
        [
            {"op": "test", "path": "/a/b/0/name", "value": "x"},
            {"op": "add", "path": "/a/b/0/r/vendor.io~1dev", "value": 1},
            {"op": "replace", "path": "/a/b/0/name", "value": "y"},
        ],
    )
    assert doc == {"a": {"b": [{"name": "y", "r": {"vendor.io/dev": 1}}]}}
    with pytest.raises(AssertionError):
        apply_json_patch(doc, [{"op": "test", "path": "/a/b/0/name", "value": "x"}])
    with pytest.raises(KeyError):
        apply_json_patch(doc, [{"op": "add", "path": "/a/missing/key", "value": 1}])
    with pytest.raises(KeyError):
        apply_json_patch(doc, [{"op": "replace", "path": "/a/nothing", "value": 1}])
