"""What the benchmarks share (bench/common): the one percentile, the result files and the mesh's
lifecycle, without a mesh."""

import json
import math
from pathlib import Path

import pytest

from bench.common import mesh as bench_mesh
from bench.common.output import write_json
from bench.common.stats import percentile


@pytest.mark.parametrize("values, q, expected", [
    ([5, 1, 4, 2, 3], 0.5, 3),
    ([1, 2, 3, 4], 0.5, 2),  # nearest rank: a value that occurred, never the mean of two
    ([1, 2, 3, 4], 0.9, 4),
    (list(range(1, 101)), 0.99, 99),
    (list(range(1, 101)), 0.95, 95),
    ([7], 0.99, 7),
])
def test_percentile_is_the_nearest_rank(values, q, expected):
    assert percentile(values, q) == expected


def test_percentile_of_nothing_is_nan_not_a_figure():
    assert math.isnan(percentile([], 0.5))


def test_write_json_makes_the_folder_and_ends_with_a_newline(tmp_path):
    out = write_json(tmp_path / "results" / "x.json", {"a": [1, 2]})
    assert out == tmp_path / "results" / "x.json"
    assert out.read_text() == json.dumps({"a": [1, 2]}, indent=2) + "\n"


class FakeMesh:
    def __init__(self, run_dir: Path, fail_start: bool = False) -> None:
        self.run_dir, self.fail_start, self.calls = run_dir, fail_start, []
        self.progress = self.calls.append

    def start(self) -> None:
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("no mesh")

    def wait_ready(self, timeout: float) -> None:
        self.calls.append(f"ready {timeout:g}")

    def stop(self) -> None:
        self.calls.append("stop")


def test_running_stops_the_mesh_and_removes_its_run_directory(tmp_path):
    mesh = FakeMesh(tmp_path / "run")
    mesh.run_dir.mkdir()
    with bench_mesh.running(mesh, 400):
        assert mesh.calls == ["start", "ready 400"]
    assert mesh.calls == ["start", "ready 400", "stop"] and not mesh.run_dir.exists()


def test_a_mesh_that_fails_to_start_is_stopped_and_kept_when_asked(tmp_path):
    mesh = FakeMesh(tmp_path / "run", fail_start=True)
    mesh.run_dir.mkdir()
    with pytest.raises(RuntimeError), bench_mesh.running(mesh, 400, keep=True):
        pass
    assert mesh.calls == ["start", "stop", f"logs kept in {mesh.run_dir / 'logs'}"] and mesh.run_dir.exists()


def test_tenant_key_makes_an_unlimited_tenant_unless_told_its_quotas():
    calls = []

    class Admin:
        def create_tenant(self, name, tier):
            calls.append(("tenant", name, tier))

        def update_tenant(self, name, limits):
            calls.append(("limits", name, limits))

        def create_key(self, name):
            return "key_1", f"sk-{name}"

    assert bench_mesh.tenant_key(Admin(), "a", "gold") == "sk-a"
    assert bench_mesh.tenant_key(Admin(), "b", "silver", rpm=600) == "sk-b"
    assert calls == [("tenant", "a", "gold"), ("limits", "a", {"rpm": 0, "tpm": 0, "concurrency": 0}),
                     ("tenant", "b", "silver"), ("limits", "b", {"rpm": 600, "tpm": 0, "concurrency": 0})]


def test_latency_parts_are_summarised_over_the_requests_that_reported_them():
    from bench.common.stats import parts_p50_p95

    reports = [{"queue": float(i), "engine": 10.0 * i} for i in range(1, 21)] + [None, {}]
    assert parts_p50_p95(reports) == {"queue": {"p50": 10.0, "p95": 19.0}, "engine": {"p50": 100.0, "p95": 190.0}}
    assert parts_p50_p95([None]) == {}
