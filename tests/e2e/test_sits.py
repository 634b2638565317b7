"""`gaas bench sits --target RUN_DIR` on the session's mesh, as an operator points it at a mesh
they run: the dimensions asked for are measured there (short workloads), the JSON names every one
with its figures, and what a target cannot give (round robin beside its own policy: its routers are
not restarted; a second model) is a cell that says why and where it would be measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import on_direct_path
from tests.meshutil import ROOT

pytestmark = [pytest.mark.mesh]


@on_direct_path("the scorecard points at a run directory, whichever path its mesh serves")
def test_the_scorecard_measures_a_running_mesh_and_says_what_it_could_not(mesh, tmp_path):
    out = tmp_path / "sits.json"
    r = subprocess.run([sys.executable, "-m", "gaas.cli.main", "bench", "sits", "--target", str(mesh.run_dir),
                        "--only", "1,2,6", "--quick", "--json", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc == json.loads(out.read_text())
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert "<table>" in out.with_suffix(".html").read_text()
    dims = {d["key"]: d for d in doc["dimensions"]}
    assert list(dims) == ["gpu_aware_routing", "kv_cache_sharing", "heterogeneous_orchestration"]

    routing = dims["gpu_aware_routing"]
    assert routing["figures"]["policy"] == "kv_aware"
    assert routing["figures"]["kv_aware"]["served"] > 0
    assert routing["figures"]["decision"]["total_ms"] > 0
    not_here = {u["what"]: u for u in routing["not_measured"]}
    assert "own mesh" in not_here["TTFT gain over round robin"]["where"]

    levels = {row["level"]: row for row in dims["kv_cache_sharing"]["figures"]["levels"]}
    for level in ("request", "session", "tenant", "public prefix"):
        assert levels[level]["hit_rate"] > 0, f"{level}: nothing reused"
    assert levels["never: another tenant"]["cached_tokens"] == 0, "a tenant reused another's undeclared prompt"
    assert dims["kv_cache_sharing"]["figures"]["leaks"] == []

    hetero = dims["heterogeneous_orchestration"]["figures"]
    assert any(d["need"].startswith("gaas-tiny") and d["fits"] for d in hetero["decisions"])
    assert any(d["refused"] for d in hetero["decisions"]), "a refused device names its reason"
    for d in doc["dimensions"]:
        assert d["cell"] and d["status"] in ("measured", "partial")
