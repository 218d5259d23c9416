"""One server over several hosts: the LeaderWorkerSet overlays (lws, lws-tpu).

A LeaderWorkerSet has no schema in the validator: it is checked by the structure of the fields
we use, its pod templates by the Kubernetes PodTemplate schema, and the config of every
process of a group by the server's own config (field names and parser), with the variables
LeaderWorkerSet injects expanded the way the kubelet does.
"""

from __future__ import annotations

import copy
import re

import pytest
from kubernetes_validate.utils import ValidationError

from server.config import ServerConfig
from tests.deploy.manifests import (
    LWS_API,
    LWS_ENUMS,
    LWS_INJECTED,
    LWS_OVERLAYS,
    LWS_STRUCTURE,
    LWS_WORKER_INDEX_LABEL,
    Manifest,
    check_server_variables,
    check_structure,
    container_environ,
    find,
    group_size,
    lws_templates,
    pod_container,
    server_vars,
    validate_builtins,
    validate_pod_template,
)

LWS_KINDS = {
    "ConfigMap",
    "LeaderWorkerSet",
    "HorizontalPodAutoscaler",
    "Ingress",
    "PersistentVolumeClaim",
    "PodDisruptionBudget",
    "Service",
    "ServiceAccount",
}
ACCELERATORS = ("google.com/tpu", "nvidia.com/gpu")
# The TPU runtime's own process port on every host (LeaderWorkerSet's TPU_PROCESS_PORT
# default, one port per TPU container from it): the coordinator must not take it.
TPU_PROCESS_PORT = 8476
NAMESPACE = "llm"


def _injected(objects: list[Manifest], index: int) -> dict[str, str]:
    """What LeaderWorkerSet puts in the env of pod `index` of group 0."""
    name = find(objects, "LeaderWorkerSet")["metadata"]["name"]
    return {
        "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{NAMESPACE}",
        "LWS_GROUP_SIZE": str(group_size(objects)),
        "LWS_WORKER_INDEX": str(index),
    }


def _process_config(objects: list[Manifest], container: Manifest, index: int) -> ServerConfig:
    """The config process `index` of a group runs with (its container's environment)."""
    environ = container_environ(objects, container, _injected(objects, index))
    return check_server_variables(server_vars(environ))


def _pod_labels(objects: list[Manifest]) -> list[tuple[int, dict[str, str]]]:
    """(worker index, labels) of each pod of a group, with the labels LeaderWorkerSet adds."""
    templates = lws_templates(objects)
    pods = []
    for index in range(group_size(objects)):
        template = templates["leader" if index == 0 else "worker"]
        labels = dict(template["metadata"]["labels"])
        labels[LWS_WORKER_INDEX_LABEL] = str(index)
        pods.append((index, labels))
    return pods


def _devices_per_pod(container: Manifest) -> int:
    limits = container["resources"].get("limits", {})
    counts = [int(limits[name]) for name in ACCELERATORS if name in limits]
    assert len(counts) <= 1, "one kind of accelerator per pod"
    return counts[0] if counts else 1  # the CPU backend: one device per process


def _sleep_s(container: Manifest) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


# --- LeaderWorkerSet: one server over several hosts ---


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_lws_overlay_renders_and_validates(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    assert {o["kind"] for o in objects} == LWS_KINDS
    validate_builtins(objects)
    lws = find(objects, "LeaderWorkerSet")
    assert lws["apiVersion"] == LWS_API
    check_structure(lws, LWS_STRUCTURE, LWS_ENUMS)
    templates = lws_templates(objects)
    assert set(templates) == {"leader", "worker"} and all(templates.values())
    for template in templates.values():
        validate_pod_template(template)


def test_lws_checks_reject_misspelt_and_wrong_fields(rendered: dict[str, list[Manifest]]) -> None:
    """The structural check and the template check can fail."""
    lws = find(rendered["lws"], "LeaderWorkerSet")
    for path, change in (
        (("spec", "leaderWorkerTemplate"), lambda t: t.update(restartPolicies=t["restartPolicy"])),
        (("spec",), lambda s: s.update(startupPolicy="LeaderStarted")),
        (("spec",), lambda s: s.pop("leaderWorkerTemplate")),
    ):
        broken = copy.deepcopy(lws)
        node = broken
        for key in path:
            node = node[key]
        change(node)
        with pytest.raises(AssertionError):
            check_structure(broken, LWS_STRUCTURE, LWS_ENUMS)
    template = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    container = template["spec"]["containers"][0]
    container["readynessProbe"] = container.pop("readinessProbe")
    with pytest.raises(ValidationError):
        validate_pod_template(template)


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_lws_group_starts_together_and_restarts_whole(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    spec = find(rendered[overlay], "LeaderWorkerSet")["spec"]
    assert group_size(rendered[overlay]) >= 2, "a multi-host group has workers"
    # The leader turns ready only after every process joined: LeaderReady would deadlock.
    assert spec["startupPolicy"] == "LeaderCreated"
    # One SPMD program: a restarted process cannot rejoin the others' collectives.
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    rolling = spec.get("rolloutStrategy", {}).get("rollingUpdateConfiguration", {})
    assert rolling.get("maxSurge", 0) != 0 or rolling.get("maxUnavailable", 1) != 0


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_lws_every_process_gets_its_own_valid_config(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    """Leader and workers run the same program; with what LeaderWorkerSet injects, process k
    of a group of n gets process id k, n processes and the leader's coordinator."""
    objects = rendered[overlay]
    templates = lws_templates(objects)
    leader, worker = (pod_container(templates[role]) for role in ("leader", "worker"))
    for key in ("image", "command", "args", "envFrom", "env"):
        assert leader.get(key) == worker.get(key), f"leader and workers differ in {key}"
    assert leader["command"] == ["python", "-m", "server"]

    for source in leader["envFrom"]:
        data = find(objects, "ConfigMap", source["configMapRef"]["name"])["data"]
        assert not any("$(" in v for v in data.values()), "envFrom values are not expanded"
    referenced = {m for var in leader["env"] for m in re.findall(r"\$\((\w+)\)", var["value"])}
    assert referenced <= set(LWS_INJECTED), referenced

    coordinator_ports = {p["containerPort"] for p in leader["ports"] if p["name"] == "coordinator"}
    assert len(coordinator_ports) == 1, "the leader exposes the coordinator port"
    size = group_size(objects)
    for index in range(size):
        injected = _injected(objects, index)
        container = leader if index == 0 else worker
        config = _process_config(objects, container, index)
        assert config.num_processes == size
        assert config.process_id == index
        assert config.coordinator_address is not None
        host, port = config.coordinator_address.rsplit(":", 1)
        assert host == injected["LWS_LEADER_ADDRESS"]
        assert int(port) in coordinator_ports


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_lws_only_the_leader_serves_http(rendered: dict[str, list[Manifest]], overlay: str) -> None:
    objects = rendered[overlay]
    templates = lws_templates(objects)
    leader, worker = (pod_container(templates[role]) for role in ("leader", "worker"))
    config = _process_config(objects, leader, 0)
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert ports["http"] == config.port
    probes = {p: leader[p]["httpGet"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {p: g["path"] for p, g in probes.items()} == {
        "startupProbe": "/ready",
        "readinessProbe": "/ready",
        "livenessProbe": "/health",
    }
    assert all(g["port"] in ("http", config.port) for g in probes.values())
    startup = leader["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    annotations = templates["leader"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == config.port

    # Processes other than 0 serve no HTTP: no probe, no HTTP port, nothing to scrape.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe not in worker, f"a worker has a {probe}"
    assert "http" not in {p["name"] for p in worker.get("ports", [])}
    worker_annotations = templates["worker"]["metadata"].get("annotations", {})
    assert worker_annotations.get("prometheus.io/scrape") != "true"


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_lws_service_autoscaler_and_budget_target_the_right_pods(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    lws = find(objects, "LeaderWorkerSet")
    pods = _pod_labels(objects)
    service = find(objects, "Service")
    selector = service["spec"]["selector"]
    chosen = [index for index, labels in pods if selector.items() <= labels.items()]
    assert chosen == [0], f"the Service selects pods {chosen}, not only the leader"
    backend = find(objects, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]
    assert backend["service"]["name"] == service["metadata"]["name"]
    # LeaderWorkerSet creates a headless Service of its own name for the pods' DNS names.
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    assert lws["metadata"]["name"] not in names

    # Evicting any pod takes its group down: the budget counts every pod of every group.
    budget = find(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    assert all(budget.items() <= labels.items() for _, labels in pods)
    target = find(objects, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    name = lws["metadata"]["name"]
    assert target == {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": name}


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_lws_workers_outlive_the_leaders_drain(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    templates = lws_templates(objects)
    leader, worker = (pod_container(templates[role]) for role in ("leader", "worker"))
    config = _process_config(objects, leader, 0)
    leader_grace = templates["leader"]["spec"]["terminationGracePeriodSeconds"]
    assert leader_grace >= _sleep_s(leader) + config.drain_timeout
    assert templates["worker"]["spec"]["terminationGracePeriodSeconds"] >= leader_grace
    assert _sleep_s(worker) >= _sleep_s(leader)


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_lws_pods_are_locked_down_with_writable_caches(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    for role, template in lws_templates(objects).items():
        pod = template["spec"]
        container = pod_container(template)
        config = _process_config(objects, container, 0)
        assert pod["securityContext"]["runAsNonRoot"] is True, role
        assert pod["automountServiceAccountToken"] is False, role
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, role
        assert security["allowPrivilegeEscalation"] is False, role
        assert security["capabilities"]["drop"] == ["ALL"], role
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        writable = {path for path, volume in mounts.items() if "emptyDir" in volume}
        assert "/tmp" in writable, role
        assert any(config.resolved_cache_dir.is_relative_to(p) for p in writable), role
        assert config.model is not None
        assert any(config.model.is_relative_to(p) for p in mounts), role


@pytest.mark.parametrize("overlay", LWS_OVERLAYS)
def test_lws_mesh_spans_every_device_of_the_group(
    rendered: dict[str, list[Manifest]], overlay: str
) -> None:
    objects = rendered[overlay]
    templates = lws_templates(objects)
    leader, worker = (pod_container(templates[role]) for role in ("leader", "worker"))
    assert leader["resources"] == worker["resources"], "every host holds the same share"
    per_pod = _devices_per_pod(leader)
    size = group_size(objects)
    config = _process_config(objects, leader, 0)
    assert config.tensor_parallel_size == size * per_pod
    tpu = "google.com/tpu" in leader["resources"].get("limits", {})
    assert leader["image"].endswith("-tpu" if tpu else "-cpu"), leader["image"]
    if not tpu:
        return
    # A multi-host slice: every host of it, each pod taking its host's chips whole.
    resources = leader["resources"]
    assert resources["requests"]["google.com/tpu"] == resources["limits"]["google.com/tpu"]
    selector = templates["leader"]["spec"]["nodeSelector"]
    assert templates["worker"]["spec"]["nodeSelector"] == selector
    chips = 1
    for dim in selector["cloud.google.com/gke-tpu-topology"].split("x"):
        chips *= int(dim)
    assert chips == size * per_pod, "size must be the slice's host count"
    annotations = find(objects, "LeaderWorkerSet")["metadata"].get("annotations", {})
    exclusive = annotations.get("leaderworkerset.sigs.k8s.io/exclusive-topology")
    assert exclusive == "cloud.google.com/gke-nodepool", "one group per slice"
    assert config.coordinator_address is not None
    port = int(config.coordinator_address.rsplit(":", 1)[1])
    runtime = int(container_environ(objects, leader).get("TPU_PROCESS_PORT", TPU_PROCESS_PORT))
    assert port != runtime, "the coordinator would take the TPU runtime's port"
