"""Render manifests as a user does (import as ``import k8s_manifests``): :func:`render` runs
``triton-disagg launch k8s`` and reads back every file it wrote; :func:`schema_errors`
validates them, strictly (no unknown field), against the Kubernetes ``KUBERNETES_VERSION``
schemas of ``kubernetes-validate``. Those schemas hold no CRD: ``CRD_KINDS`` (the
PodMonitor) are left out, and checked by the tests against the pods they select."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

IMAGE = "registry.example.com/triton-disagg:cpu"
KUBERNETES_VERSION = "1.37.0"
CRD_KINDS = {"PodMonitor"}


def render(config: Path, out: Path, *flags: str) -> dict[str, dict]:
    """``launch k8s -c config --image IMAGE --out out *flags``; file name -> object."""
    done = subprocess.run([sys.executable, "-m", "triton_disagg.cli", "launch", "k8s",
                           "-c", str(config), "--image", IMAGE, "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}


def of_kind(objects: dict[str, dict], kind: str) -> list[dict]:
    return [obj for obj in objects.values() if obj["kind"] == kind]


def schema_errors(objects: dict[str, dict]) -> list[str]:
    """One line per object that fails its schema (the Kustomization and CRDs skipped)."""
    errors = []
    for name, obj in objects.items():
        if obj["kind"] in CRD_KINDS or obj["kind"] == "Kustomization":
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{name}: {exc.message} at {list(exc.path)}")
    return errors
