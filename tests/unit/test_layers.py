"""The layout's rules, enforced: gaas's packages are layers whose imports point down, services import
no operator tooling and not each other, and no module takes another's _private names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("gaas", "services", "bench")


def test_imports_follow_the_layers_in_pyproject():
    lint = Path(sys.executable).parent / "lint-imports"
    run = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def private_uses(source: str) -> list[str]:
    """Where source takes a _private name (not a dunder) of a project module: imported by name,
    or read as an attribute of a project module or of a name imported from one."""
    tree = ast.parse(source)
    found, imported = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in PROJECT:
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
                imported.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            imported.update(a.asname or a.name for a in node.names if a.name.split(".")[0] in PROJECT)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_private_uses_are_found():
    assert private_uses("from gaas.metering.meter import _Script\n") == ["1: from gaas.metering.meter import _Script"]
    assert private_uses("from gaas.envoy import config\nconfig._listener()\n") == ["2: config._listener"]
    assert private_uses("from os import _exit\nimport gaas\ngaas.__name__\n") == []


def test_no_module_takes_another_modules_private_names():
    found = []
    for top in PROJECT:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "v1" in path.relative_to(ROOT).parts:
                continue  # generated
            found += [f"{path.relative_to(ROOT)}:{where}" for where in private_uses(path.read_text())]
    assert not found, "make these public where they belong, or keep them in their module:\n" + "\n".join(found)
