"""deploy/gateway-lora: the gateway's pool serving LoRA adapters, rendered and validated;
the server reads the adapters from its variables, each on the model volume; the EPP flags
its README section gives name gauges the server exports with LoRA on."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from prometheus_client import CollectorRegistry

from engine.types import EngineStats
from server.metrics import EngineMetrics
from tests.deploy.manifests import (
    DEPLOY,
    Manifest,
    check_server_variables,
    find,
    kustomize,
    server_container,
    server_environ,
    server_vars,
    validate_builtins,
)


def test_gateway_lora_serves_adapters_from_the_model_volume() -> None:
    objects: list[Manifest] = kustomize(DEPLOY / "gateway-lora")
    gateway = kustomize(DEPLOY / "gateway")
    assert sorted(o["kind"] for o in objects) == sorted(o["kind"] for o in gateway)
    validate_builtins(objects)
    assert find(objects, "InferencePool")["spec"] == find(gateway, "InferencePool")["spec"]
    config = check_server_variables(server_vars(server_environ(objects)))
    assert config.enable_lora and config.max_loras >= 1
    assert config.max_cpu_loras is None or config.max_cpu_loras >= config.max_loras
    assert [m.name for m in config.lora_modules] == ["sql-lora", "chat-lora"]
    mounts = {m["name"]: m["mountPath"] for m in server_container(objects)["volumeMounts"]}
    model_dir = PurePosixPath(mounts["model"])
    for module in config.lora_modules:
        assert model_dir in PurePosixPath(module.path).parents, module.path


def _section(title: str) -> str:
    readme = (DEPLOY / "README.md").read_text()
    start = readme.index(f"## {title}")
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end != -1 else None]


def test_readme_gives_the_picker_the_lora_gauge_the_server_exports() -> None:
    registry = CollectorRegistry()
    stats = EngineStats(0, 0, 0, 1, True, False, lora=(("a",), (), 4))
    EngineMetrics(registry, "model", lambda: stats)
    families = {family.name: family.type for family in registry.collect()}
    section = _section("LoRA adapters behind the gateway")
    flags = dict(re.findall(r"--([a-z-]+-metric)[= ]\"?([^\s\"]*)\"?", section))
    assert flags["lora-info-metric"] == "llm_lora_requests_info"
    for flag, name in flags.items():
        assert not name or families.get(name) == "gauge", f"--{flag}: {name} is not a gauge"
    assert "deploy/gateway-lora" in section
