"""The other scale-out form: many replicas behind the Gateway API inference extension
(gateway); every overlay runs interleaved (one device set), and the device-set forms a
disaggregated server reads.

InferencePool and HTTPRoute have no schema in the validator: they are checked by the
structure of the fields we use; the EPP's metric flags in deploy/README.md against the
metric families the server really exports.
"""

from __future__ import annotations

import copy
import re

import pytest
from prometheus_client import CollectorRegistry

from engine.mesh import device_sets
from server.metrics import EngineMetrics
from tests.deploy.manifests import (
    DEPLOY,
    HTTP_ROUTE_BACKEND,
    HTTP_ROUTE_RULE,
    HTTP_ROUTE_STRUCTURE,
    INFERENCE_POOL_API,
    INFERENCE_POOL_ENUMS,
    INFERENCE_POOL_STRUCTURE,
    Manifest,
    check_server_variables,
    check_structure,
    container_environ,
    find,
    lws_templates,
    pod_container,
    server_container,
    server_environ,
    server_vars,
    validate_builtins,
)

GATEWAY_KINDS = {
    "ConfigMap",
    "Deployment",
    "HorizontalPodAutoscaler",
    "HTTPRoute",
    "InferencePool",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "Service",
    "ServiceAccount",
}

# --- Disaggregated device sets: parsed, but no overlay asks for them ---


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "tpu", "lws", "lws-tpu"])
def test_every_overlay_runs_interleaved(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    objects = rendered[overlay]
    if overlay.startswith("lws"):
        environ = container_environ(objects, pod_container(lws_templates(objects)["leader"]))
    else:
        environ = server_environ(objects)
    assert not {"LLM_SERVER_PREFILL_DEVICES", "LLM_SERVER_GENERATE_DEVICES"} & set(environ)


def test_device_set_forms() -> None:
    devices = range(4)
    assert device_sets("0-1", "2,3", devices) == ((0, 1), (2, 3))
    assert device_sets("0, 2-3", "1", devices) == ((0, 2, 3), (1,))  # the one left
    assert device_sets("2", "2", devices) == ((0, 1), (2, 3))  # counts: generate after prefill
    for prefill, generate, problem in (
        ("0-1", "1-2", "share devices"),
        ("3", "2", "only 1 of 4"),
        ("0,7", "1", "each must be one of"),
        ("0-x", "1", "a device set is a count or ids"),
    ):
        with pytest.raises(ValueError, match=problem):
            device_sets(prefill, generate, devices)


# --- Gateway API inference extension: many replicas, an endpoint picker per request ---


def test_gateway_renders_and_validates(gateway: list[Manifest]) -> None:
    assert {o["kind"] for o in gateway} == GATEWAY_KINDS
    validate_builtins(gateway)
    pool = find(gateway, "InferencePool")
    assert pool["apiVersion"] == INFERENCE_POOL_API
    check_structure(pool, INFERENCE_POOL_STRUCTURE, INFERENCE_POOL_ENUMS)
    route = find(gateway, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    check_structure(route, HTTP_ROUTE_STRUCTURE)
    for rule in route["spec"]["rules"]:
        check_structure(rule, {"": HTTP_ROUTE_RULE})
        for backend in rule["backendRefs"]:
            check_structure(backend, {"": HTTP_ROUTE_BACKEND})
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPort"] = broken["spec"].pop("targetPorts")
    with pytest.raises(AssertionError):
        check_structure(broken, INFERENCE_POOL_STRUCTURE)


def test_inference_pool_routes_to_the_serving_pods(gateway: list[Manifest]) -> None:
    pool = find(gateway, "InferencePool")["spec"]
    deployment = find(gateway, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = pool["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector == find(gateway, "Service")["spec"]["selector"], "the same pods"
    config = check_server_variables(server_vars(server_environ(gateway)))
    (port,) = pool["targetPorts"]
    http = {p["name"]: p["containerPort"] for p in server_container(gateway)["ports"]}["http"]
    assert port["number"] == config.port == http
    assert pool["endpointPickerRef"]["name"] and pool["endpointPickerRef"]["port"]["number"]

    (rule,) = find(gateway, "HTTPRoute")["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend["group"] == INFERENCE_POOL_API.split("/")[0]
    assert backend["kind"] == "InferencePool"
    assert backend["name"] == find(gateway, "InferencePool")["metadata"]["name"]
    # A streamed completion lives within the route's request timeout.
    timeout = re.fullmatch(r"(\d+)s", rule["timeouts"]["request"])
    assert timeout and int(timeout[1]) >= 600


def _readme_section(title: str) -> str:
    readme = (DEPLOY / "README.md").read_text()
    start = readme.index(f"## {title}")
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end != -1 else None]


def _exported_families() -> dict[str, str]:
    """Every metric family the server's engine metrics export: name -> type."""
    registry = CollectorRegistry()
    EngineMetrics(registry, "model", lambda: None)
    return {family.name: family.type for family in registry.collect()}


def test_readme_maps_the_endpoint_pickers_metrics_to_exported_gauges() -> None:
    """The EPP flags in deploy/README.md name gauges the server really exports, with the
    meaning the EPP expects; every llm_* name the section mentions exists."""
    section = _readme_section("Behind the Gateway API inference extension")
    flags = dict(re.findall(r"--([a-z-]+-metric)[= ]\"?([^\s\"]*)\"?", section))
    families = _exported_families()
    assert flags == {
        "total-queued-requests-metric": "llm_requests_waiting",
        "total-running-requests-metric": "llm_requests_running",
        "kv-cache-usage-percentage-metric": "llm_kv_cache_usage_perc",
        "lora-info-metric": "",  # no LoRA adapters: the EPP's LoRA affinity is off
        "cache-info-metric": "",  # no block-size info: the prefix scorer uses its config
    }, flags
    for flag, name in flags.items():
        assert not name or families.get(name) == "gauge", f"--{flag}: {name} is not a gauge"
    for name in set(re.findall(r"\bllm_[a-z_]+", section)):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert name in families or base in families, f"README names {name}, not exported"
    assert "deploy/gateway" in section and "InferencePool" in section
