"""Helpers of the deploy tests: render kustomizations with the real kubectl and pick objects.

Rendering goes through the real `kubectl kustomize`, so a manifest kustomize cannot build
fails here the same way it would fail for a user.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# Overlays whose server is a Deployment (one host per replica), and the multi-host ones.
OVERLAYS = ("cpu", "gpu", "tpu")
LWS_OVERLAYS = ("lws", "lws-tpu")

Manifest = dict[str, Any]

# Oldest Kubernetes still served by the big clouds, and the newest the validator knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def kustomize(directory: Path) -> list[Manifest]:
    """Render one kustomization with kubectl and parse every object it emits."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: run deploy/ci-setup.sh")
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(objects: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    """The one object of `kind` (and `name`, when given) in a rendered overlay."""
    matches = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def server_container(objects: list[Manifest]) -> Manifest:
    pod = find(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "server"]
    return container


def server_environ(objects: list[Manifest]) -> dict[str, str]:
    """The environment the server process sees: its ConfigMap plus the container's own env."""
    container = server_container(objects)
    environ: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = find(objects, "ConfigMap", source["configMapRef"]["name"])
        environ.update(config_map["data"])
    for var in container.get("env", []):
        environ[var["name"]] = var["value"]
    return environ


def server_cli_flags() -> frozenset[str]:
    """Every option the real `python -m server` parser accepts, read from its --help."""
    from server.config import parse_config

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parse_config(["--help"], environ={})
    flags = frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))
    assert "--model" in flags, out.getvalue()
    return flags


def check_server_variable(name: str, value: str) -> None:
    """One LLM_SERVER_* variable: see check_server_variables."""
    check_server_variables({name: value})


def check_server_variables(variables: dict[str, str]) -> Any:
    """LLM_SERVER_* variables, together (some flags only make sense with others): each names
    a ServerConfig field and an exact flag (argparse's prefix matching aside), no $(...) is
    left unexpanded, and the server reads the same config from them as from the same values
    given as flags. Returns that config."""
    from server.config import ENV_PREFIX, parse_config

    unknown = set(variables) - server_env_names()
    assert not unknown, f"not ServerConfig fields: {sorted(unknown)}"
    flags = server_cli_flags()
    argv: list[str] = []
    for name, value in variables.items():
        flag = "--" + name.removeprefix(ENV_PREFIX).lower().replace("_", "-")
        assert flag in flags, f"{name}: the server has no flag {flag}"
        assert "$(" not in value, f"{name}={value!r}: a reference nothing expands"
        argv += [flag, value]
    config = parse_config([], environ=variables)
    assert parse_config(argv, environ={}) == config
    return config


# --- Custom resources: checked by structure, since the Kubernetes schemas do not cover them ---

# Where LeaderWorkerSet puts what it injects into every container of a group (its pod
# webhook): the leader's DNS name, the pod count and this pod's index, first in `env`.
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_INJECTED = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

# A structure is {dotted path: (allowed keys, required keys)} over the object's dicts;
# `enums` is {dotted path: allowed values}. Only the fields a manifest may use are listed.
Structure = dict[str, tuple[frozenset[str], frozenset[str]]]


def _fields(allowed: str, required: str = "") -> tuple[frozenset[str], frozenset[str]]:
    return frozenset(allowed.split()), frozenset(required.split())


LWS_STRUCTURE: Structure = {
    "": _fields("apiVersion kind metadata spec", "apiVersion kind metadata spec"),
    "spec": _fields(
        "replicas leaderWorkerTemplate rolloutStrategy startupPolicy networkConfig",
        "leaderWorkerTemplate",
    ),
    "spec.leaderWorkerTemplate": _fields(
        "leaderTemplate workerTemplate size restartPolicy subGroupPolicy volumeClaimTemplates"
        " persistentVolumeClaimRetentionPolicy",
        "workerTemplate",
    ),
    "spec.rolloutStrategy": _fields("type rollingUpdateConfiguration", "type"),
    "spec.rolloutStrategy.rollingUpdateConfiguration": _fields("partition maxUnavailable maxSurge"),
    "spec.networkConfig": _fields("subdomainPolicy", "subdomainPolicy"),
}
LWS_ENUMS = {
    "spec.startupPolicy": {"LeaderCreated", "LeaderReady"},
    "spec.leaderWorkerTemplate.restartPolicy": {
        "RecreateGroupOnPodRestart",
        "RecreateGroupAfterStart",
        "None",
        "Default",
    },
    "spec.rolloutStrategy.type": {"RollingUpdate"},
    "spec.networkConfig.subdomainPolicy": {"Shared", "UniquePerReplica"},
}
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
INFERENCE_POOL_STRUCTURE: Structure = {
    "": _fields("apiVersion kind metadata spec", "apiVersion kind metadata spec"),
    "spec": _fields("selector targetPorts endpointPickerRef appProtocol", "selector targetPorts"),
    "spec.selector": _fields("matchLabels", "matchLabels"),
    "spec.endpointPickerRef": _fields("group kind name port failureMode", "name"),
    "spec.endpointPickerRef.port": _fields("number", "number"),
}
INFERENCE_POOL_ENUMS = {"spec.endpointPickerRef.failureMode": {"FailOpen", "FailClose"}}
HTTP_ROUTE_STRUCTURE: Structure = {
    "": _fields("apiVersion kind metadata spec", "apiVersion kind metadata spec"),
    "spec": _fields("parentRefs hostnames rules", "parentRefs rules"),
}
HTTP_ROUTE_RULE = _fields("name matches filters backendRefs timeouts sessionPersistence")
HTTP_ROUTE_BACKEND = _fields("group kind name namespace port weight filters", "name")


def check_structure(
    obj: Manifest, structure: Structure, enums: dict[str, set[str]] | None = None
) -> None:
    """Every listed dict of `obj` has only allowed keys and all required ones; enum fields
    hold one of their values. Raises AssertionError naming the path."""
    for path, (allowed, required) in structure.items():
        node: Any = obj
        for key in path.split(".") if path else []:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue
        assert isinstance(node, dict), f"{path or 'the object'}: not a mapping"
        unknown = set(node) - allowed
        missing = required - set(node)
        assert not unknown, f"{path or 'the object'}: unknown fields {sorted(unknown)}"
        assert not missing, f"{path or 'the object'}: missing fields {sorted(missing)}"
    for path, values in (enums or {}).items():
        node = obj
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        assert node is None or node in values, f"{path}: {node!r} is not one of {sorted(values)}"


def lws_templates(objects: list[Manifest]) -> dict[str, Manifest]:
    """The LeaderWorkerSet's pod templates: {"leader": ..., "worker": ...}."""
    template = find(objects, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def group_size(objects: list[Manifest]) -> int:
    return int(find(objects, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"].get("size", 1))


def pod_container(pod: Manifest, name: str = "server") -> Manifest:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == name]
    return container


def expand_env(value: str, defined: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value: a variable defined before it is replaced,
    $$ is a literal $, an unknown reference stays as written."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and (end := value.find(")", i)) != -1:
            name = value[i + 2 : end]
            out.append(defined.get(name, value[i : end + 1]))
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def container_environ(
    objects: list[Manifest], container: Manifest, injected: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment the process sees: ConfigMaps (not expanded), then `injected` (what a
    controller puts first in `env`), then the container's env in order, each expanded."""
    environ: dict[str, str] = {}
    for source in container.get("envFrom", []):
        environ.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    defined = dict(injected or {})
    for var in container.get("env", []):
        if "value" in var:
            defined[var["name"]] = expand_env(var["value"], defined)
    environ.update(defined)
    return environ


def server_env_names() -> frozenset[str]:
    """Every LLM_SERVER_* name the server can read: one per ServerConfig field."""
    from dataclasses import fields

    from server.config import ENV_PREFIX, ServerConfig

    return frozenset(ENV_PREFIX + f.name.upper() for f in fields(ServerConfig))


CUSTOM_APIS = {LWS_API, INFERENCE_POOL_API, "gateway.networking.k8s.io/v1"}


def validate_builtins(objects: list[Manifest]) -> None:
    """Every object of a built-in kind, strictly against the Kubernetes schemas."""
    for version in K8S_VERSIONS:
        for obj in objects:
            if obj["apiVersion"] not in CUSTOM_APIS:
                kubernetes_validate.validate(obj, version, strict=True)


def validate_pod_template(template: Manifest) -> None:
    """A custom resource's pod template, strictly, as the template of a PodTemplate."""
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
    for version in K8S_VERSIONS:
        kubernetes_validate.validate({**wrapped, "template": template}, version, strict=True)


def server_vars(environ: dict[str, str]) -> dict[str, str]:
    """The LLM_SERVER_* part of an environment."""
    from server.config import ENV_PREFIX

    return {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
