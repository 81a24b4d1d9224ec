#!/usr/bin/env bash
# Renders each kustomization under deploy/k8s with `kubectl kustomize` and validates every rendered
# object against the Kubernetes API schemas, offline, with `kubernetes-validate --strict` (unknown
# fields are errors). Run by `make check-deploy`, which installs both tools into .venv first.
set -euo pipefail

KUBECTL=${KUBECTL:-kubectl}
KUBERNETES_VALIDATE=${KUBERNETES_VALIDATE:-kubernetes-validate}
# The oldest Kubernetes minor the manifests target, and the newest the validator knows.
K8S_VERSIONS=${K8S_VERSIONS:-"1.30.0 1.37.0"}

for tool in "$KUBECTL" "$KUBERNETES_VALIDATE"; do
    command -v "$tool" >/dev/null || { echo "check-deploy: '$tool' not found (run 'make check-deploy')" >&2; exit 2; }
done

root=$(cd "$(dirname "$0")/k8s" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

for dir in base overlays/cpu overlays/gpu; do
    rendered="$out/${dir//\//-}.yaml"
    "$KUBECTL" kustomize "$root/$dir" > "$rendered"
    count=$(grep -c '^kind:' "$rendered")
    for version in $K8S_VERSIONS; do
        "$KUBERNETES_VALIDATE" --strict --quiet --kubernetes-version "$version" "$rendered"
    done
    echo "deploy/k8s/$dir: $count objects render and validate against Kubernetes $K8S_VERSIONS"
done

# The security component (TLS, mTLS, tokens, Redis AUTH) on top of each overlay, as an operator's own
# overlay adds it; the Secrets it mounts are the operator's and are not rendered here.
for overlay in cpu gpu; do
    dir="$out/secure-$overlay"
    mkdir -p "$dir"
    printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [%s]\ncomponents: [%s]\n' \
        "$(realpath --relative-to="$dir" "$root/overlays/$overlay")" \
        "$(realpath --relative-to="$dir" "$root/components/security")" > "$dir/kustomization.yaml"
    rendered="$out/secure-$overlay.yaml"
    "$KUBECTL" kustomize "$dir" > "$rendered"
    count=$(grep -c '^kind:' "$rendered")
    for version in $K8S_VERSIONS; do
        "$KUBERNETES_VALIDATE" --strict --quiet --kubernetes-version "$version" "$rendered"
    done
    echo "deploy/k8s/overlays/$overlay + components/security: $count objects render and validate against Kubernetes $K8S_VERSIONS"
done
