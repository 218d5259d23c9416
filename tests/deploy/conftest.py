"""Fixtures of the deploy tests: the kustomize overlays, rendered once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import DEPLOY, LWS_OVERLAYS, OVERLAYS, Manifest, kustomize


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Manifest]]:
    """Every overlay (Deployment and LeaderWorkerSet ones), rendered: overlay name -> objects."""
    overlays = (*OVERLAYS, *LWS_OVERLAYS)
    return {overlay: kustomize(DEPLOY / "overlays" / overlay) for overlay in overlays}


@pytest.fixture(scope="session")
def gateway() -> list[Manifest]:
    """deploy/gateway rendered: the gpu overlay as an InferencePool behind a Gateway route."""
    return kustomize(DEPLOY / "gateway")


@pytest.fixture(scope="session")
def render_with_component(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, str], list[Manifest]]:
    """Render an overlay with an optional component added, from a throw-away kustomization."""

    def render(overlay: str, component: str) -> list[Manifest]:
        folder = tmp_path_factory.mktemp(f"{overlay}-{component}")
        # kustomize accepts only relative paths to other kustomizations.
        rel = Path(os.path.relpath(DEPLOY, folder))
        (folder / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [str(rel / "overlays" / overlay)],
                    "components": [str(rel / "components" / component)],
                }
            )
        )
        return kustomize(folder)

    return render
