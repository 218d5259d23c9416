"""The kustomize overlays render, validate against the Kubernetes schemas, and agree with the
server: every flag they pass is a real flag, every port and timeout lines up.

The server's own parser (`server.config.parse_config`) judges the flags, so renaming a flag in
the server without updating deploy/ fails here.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

from server.config import ENV_PREFIX, ServerConfig, parse_config
from tests.deploy.manifests import (
    DEPLOY,
    K8S_VERSIONS,
    OVERLAYS,
    Manifest,
    check_server_variables,
    find,
    server_cli_flags,
    server_container,
    server_environ,
)

EXPECTED_KINDS = {
    "ConfigMap",
    "Deployment",
    "HorizontalPodAutoscaler",
    "Ingress",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "Service",
    "ServiceAccount",
}
INGRESS_PREFIX = "nginx.ingress.kubernetes.io/"
# Dockerfile build argument JAX_FLAVOR value each overlay's image must be built with.
IMAGE_FLAVOUR = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
# The accelerator resource each overlay's pod asks for (None: CPU only).
ACCELERATOR = {
    "cpu": None,
    "gpu": "nvidia.com/gpu",
    "tpu": "google.com/tpu",
}


def _validate_all(objects: list[Manifest]) -> None:
    for version in K8S_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def _config(objects: list[Manifest]) -> ServerConfig:
    environ = {k: v for k, v in server_environ(objects).items() if k.startswith(ENV_PREFIX)}
    return parse_config([], environ=environ)


def _pod(objects: list[Manifest]) -> Manifest:
    return find(objects, "Deployment")["spec"]["template"]["spec"]


def _bytes(size: str) -> int:
    """An nginx size ("16m", "512k", "1024") in bytes."""
    match = re.fullmatch(r"(\d+)([kKmMgG]?)", size)
    assert match, f"not an nginx size: {size!r}"
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[match[2].lower()]
    return int(match[1]) * scale


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_whole_stack_and_validates(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    assert {o["kind"] for o in objects} == EXPECTED_KINDS
    _validate_all(objects)


def test_model_from_image_component_renders_and_validates(
    render_with_component: Callable[[str, str], list[Manifest]],
) -> None:
    objects = render_with_component("cpu", "model-from-image")
    _validate_all(objects)
    assert "PersistentVolumeClaim" not in {o["kind"] for o in objects}
    pod = _pod(objects)
    (model,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert set(model) == {"name", "emptyDir"}
    (init,) = pod["initContainers"]
    assert {m["name"] for m in init["volumeMounts"]} == {"model"}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False


def test_validator_rejects_a_misspelt_field(rendered: dict[str, list[Manifest]]) -> None:
    """The schema check can fail: a typo in a probe's name is caught."""
    deployment = copy.deepcopy(find(rendered["cpu"], "Deployment"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readynessProbe"] = container.pop("readinessProbe")
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_server_variable_is_a_real_flag(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    """Each LLM_SERVER_* variable is an exact flag of the server's parser, read the same way."""
    environ = server_environ(rendered[overlay])
    server_vars = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    assert "LLM_SERVER_MODEL" in server_vars
    check_server_variables(server_vars)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_command_is_the_server_entrypoint(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    container = server_container(rendered[overlay])
    assert container["command"] == ["python", "-m", "server"]
    assert importlib.util.find_spec("server.__main__") is not None
    flags = server_cli_flags()
    for arg in container.get("args", []):
        if arg.startswith("--"):
            assert arg.split("=", 1)[0] in flags, arg


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_line_up_from_ingress_to_server(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    config = _config(objects)
    container = server_container(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": config.port}

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ("http", config.port), probe
    annotations = find(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == config.port
    assert annotations["prometheus.io/path"] == "/metrics"

    service = find(objects, "Service")
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in ("http", config.port)
    backend = find(objects, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"] == service["metadata"]["name"]
    assert backend["service"]["port"]["name"] == service_port["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_readiness_for_warmup_and_health_for_liveness(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    container = server_container(rendered[overlay])
    startup, ready, live = (
        container["startupProbe"],
        container["readinessProbe"],
        container["livenessProbe"],
    )
    assert startup["httpGet"]["path"] == "/ready"
    assert ready["httpGet"]["path"] == "/ready"
    assert live["httpGet"]["path"] == "/health"
    # Liveness only starts once the startup probe passed, i.e. after warm-up: give warm-up at
    # least 10 minutes, and never let liveness kill a pod on one slow answer.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert live["failureThreshold"] >= 3
    assert "initialDelaySeconds" not in live, "startupProbe gates liveness; no fixed delay"


def test_probe_and_scrape_paths_are_routes_of_the_app(rendered: dict[str, list[Manifest]]) -> None:
    """The app `python -m server` serves has a GET route for every path the manifests use.

    Building the app loads nothing (the model loads at lifespan start), so this is cheap; the
    SSE tests also call these paths on a live server.
    """
    from fastapi.routing import APIRoute
    from starlette.routing import Route

    from server.app import create_app

    app = create_app(ServerConfig())
    get_paths = {
        route.path
        for route in app.routes
        if isinstance(route, (APIRoute, Route)) and "GET" in (route.methods or set())
    }
    # the routers' routes (server/routes/; FastAPI keeps an included router whole)
    get_paths |= {path for path, ops in app.openapi()["paths"].items() if "get" in ops}
    objects = rendered["cpu"]
    container = server_container(objects)
    used = {
        container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    annotations = find(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    used.add(annotations["prometheus.io/path"])
    assert used <= get_paths, f"not routes of the app: {used - get_paths}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_prestop_and_drain(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    config = _config(objects)
    pod = _pod(objects)
    command = server_container(objects)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pre_stop_s >= 5, "endpoint removal needs a few seconds to reach every proxy"
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + config.drain_timeout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ingress_is_sse_safe(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    objects = rendered[overlay]
    config = _config(objects)
    ingress = find(objects, "Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    annotations = {
        k.removeprefix(INGRESS_PREFIX): v
        for k, v in ingress["metadata"]["annotations"].items()
        if k.startswith(INGRESS_PREFIX)
    }
    assert annotations["proxy-buffering"] == "off"
    assert annotations["proxy-http-version"] == "1.1"
    # A keep-alive comment must arrive well within the read timeout, or idle streams are cut.
    assert config.sse_ping_interval > 0
    assert float(annotations["proxy-read-timeout"]) >= 4 * config.sse_ping_interval
    assert float(annotations["proxy-read-timeout"]) >= 600
    assert _bytes(annotations["proxy-body-size"]) >= config.max_request_bytes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_is_locked_down_with_writable_caches(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    pod = _pod(objects)
    container = server_container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert not security.get("privileged", False)

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    writable = {path for path, volume in mounts.items() if "emptyDir" in volume}
    config = _config(objects)
    assert "/tmp" in writable
    assert any(config.resolved_cache_dir.is_relative_to(path) for path in writable)
    assert config.model is not None
    assert any(config.model.is_relative_to(path) for path in mounts)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_accelerator_resources_and_image_flavour(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    pod = _pod(objects)
    resources = server_container(objects)["resources"]
    image = server_container(objects)["image"]
    assert image.endswith("-" + IMAGE_FLAVOUR[overlay]), image
    assert "memory" in resources["limits"] and "cpu" in resources["requests"]
    accelerators = {"nvidia.com/gpu", "google.com/tpu"} & set(resources["limits"])
    if ACCELERATOR[overlay] is None:
        assert not accelerators
    elif ACCELERATOR[overlay] == "nvidia.com/gpu":
        assert accelerators == {"nvidia.com/gpu"}
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    else:
        assert accelerators == {"google.com/tpu"}
        assert resources["requests"]["google.com/tpu"] == resources["limits"]["google.com/tpu"]
        selector = pod["nodeSelector"]
        assert {"cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"} <= set(
            selector
        )
        chips = 1
        for dim in selector["cloud.google.com/gke-tpu-topology"].split("x"):
            chips *= int(dim)
        # Single-host slice: the pod takes every chip of the topology.
        assert int(resources["limits"]["google.com/tpu"]) == chips


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_autoscaler_and_disruption_budget_target_the_pods(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    deployment = find(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = find(objects, "PodDisruptionBudget")["spec"]
    for kind, selector in (
        ("Deployment", deployment["spec"]["selector"]["matchLabels"]),
        ("Service", find(objects, "Service")["spec"]["selector"]),
        ("PodDisruptionBudget", pdb["selector"]["matchLabels"]),
    ):
        assert selector and selector.items() <= pod_labels.items(), kind
    # maxUnavailable, not minAvailable: with one replica a node drain must still proceed.
    assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb

    hpa = find(objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["kind"] == "Deployment"
    assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    kinds = {m["type"] for m in hpa["metrics"]}
    assert kinds == {"Pods", "Resource"}, "a queue metric plus the CPU fallback"


def test_autoscaler_metrics_have_an_adapter_rule(rendered: dict[str, list[Manifest]]) -> None:
    """Each custom metric the HPA asks for is served by a documented prometheus-adapter rule."""
    rules = yaml.safe_load((DEPLOY / "prometheus-adapter-rules.yaml").read_text())
    served = {rule["name"]["as"]: rule["seriesQuery"] for rule in rules["rules"]["custom"]}
    hpa = find(rendered["cpu"], "HorizontalPodAutoscaler")["spec"]
    wanted = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert wanted
    for name in wanted:
        assert name in served, f"no prometheus-adapter rule serves {name}"
        assert served[name].startswith(name + "{")


def test_readme_names_every_overlay_and_component() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for folder in [*(DEPLOY / "overlays").iterdir(), *(DEPLOY / "components").iterdir()]:
        assert folder.name in readme, f"deploy/README.md does not mention {folder.name}"
    for topic in ("kubectl apply -k", "prometheus-adapter", "multi-host", "sticky"):
        assert topic in readme, topic


def test_dockerfile_runs_as_the_pod_user(rendered: dict[str, list[Manifest]]) -> None:
    dockerfile = (DEPLOY.parent / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\d+)(?::(\d+))?\s*$", dockerfile, flags=re.M)
    assert users, "the Dockerfile's final USER must be numeric (runAsNonRoot can check it)"
    uid, gid = users[-1]
    security = _pod(rendered["cpu"])["securityContext"]
    assert security["runAsUser"] == int(uid)
    assert not gid or security["runAsGroup"] == int(gid)


def test_overlay_files_exist_for_every_overlay() -> None:
    for overlay in OVERLAYS:
        assert (DEPLOY / "overlays" / overlay / "kustomization.yaml").is_file()
    assert Path(DEPLOY / "base" / "kustomization.yaml").is_file()
