"""The SITS2026 scorecard's parts that need no mesh (bench/sits): its matrix and outputs (the table,
the JSON's dimensions, the PNG, the self-contained HTML) from figures shaped as a run makes them,
a dimension without figures saying why, the workloads' shapes, and the KV sharing ceiling."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sits import batching, kvshare, routing
from bench.sits.card import DIMENSIONS, SEED_COLUMNS, Dimension, Unmeasured
from bench.sits.common import histogram_delta
from bench.sits.load import poisson
from bench.sits.report import chart_png, document, page, text, write_all
from bench.sits.run import chosen

SETUP = {"mesh": "the scorecard's own mesh", "host": "2 cores, no GPU", "when": "2026-12-05T12:00:00",
         "seconds": 321.0, "quick": True, "target": None}


def figures_of_a_run() -> list[Dimension]:
    """Every dimension as a run on a CPU host leaves it: some figures unmeasured, one failed."""
    trace = [{"t": i * 0.5, "workers": {"worker-0": {"window": 8 - i % 4, "in_flight": 2}}} for i in range(20)]
    phase = {"gold": {"ttft_p95_ms": 420.0, "target_ms": 500.0, "requests": 10, "served": 10, "refused": 0,
                      "within_target": True},
             "bronze": {"ttft_p95_ms": 2100.0, "target_ms": 5000.0, "requests": 90, "served": 90, "refused": 0,
                        "within_target": True}}
    run = {"phases": {"before": phase, "step": phase, "after": phase}, "trace": trace, "requests_per_s": 12.0,
           "output_tokens_per_s": 380.0, "refused": 0, "window_min": 5, "window_max": 8}
    return [
        Dimension("gpu_aware_routing", "yes (queue, KV-cache use)", {
            "policy": "kv_aware", "kv_aware": {"ttft_p95_ms": 300.0, "ttft_p50_ms": 80.0},
            "round_robin": {"ttft_p95_ms": 450.0, "ttft_p50_ms": 90.0}, "ttft_p95_gain": 0.333},
            [Unmeasured("signal: device memory free", "a CPU worker has no NVML device", "a GPU host")]),
        Dimension("kv_cache_sharing", "yes (request 95%)", {"block_size": 32, "levels": [
            {"level": "request", "hit_rate": 0.95, "ceiling": 0.96, "shared": True, "cached_tokens": 900},
            {"level": "never: another tenant", "hit_rate": 0.0, "ceiling": 0.95, "shared": False, "cached_tokens": 0}]}),
        Dimension("dynamic_batching", "yes", {"loop_on": run, "loop_off": run}),
        Dimension("memory_fragmentation", "1.2% internal", {"internal_fragmentation": 0.012, "preemptions": 3,
                                                             "directory": {"fragmentation": 0.0}}),
        Dimension("long_context_switch", error="the target serves no gaas-long (a 32K-context model)"),
        Dimension("heterogeneous_orchestration", "yes", {"profiles": [{"label": "CPU x", "kind": "cpu"}],
                                                         "decisions": [{"need": "any", "fits": ["CPU x"]}],
                                                         "decision_us": 3.0, "backends": ["vllm-cpu on cpu"]}),
    ]


def test_every_dimension_is_in_the_json_with_its_figures_or_the_reason_it_has_none():
    doc = document(figures_of_a_run(), SETUP)
    assert [d["key"] for d in doc["dimensions"]] == [k for k, _, _ in DIMENSIONS]
    by_key = {d["key"]: d for d in doc["dimensions"]}
    assert by_key["long_context_switch"]["status"] == "not_measured"
    assert "gaas-long" in by_key["long_context_switch"]["reason"]
    assert by_key["gpu_aware_routing"]["status"] == "partial"
    assert by_key["gpu_aware_routing"]["not_measured"][0]["where"] == "a GPU host"
    assert by_key["kv_cache_sharing"]["status"] == "measured" and by_key["kv_cache_sharing"]["reason"] is None
    for d in doc["dimensions"]:
        assert set(d["seed"]) == set(SEED_COLUMNS)
    json.dumps(doc)  # serialisable as it is


def test_the_table_prints_each_cell_beside_the_seeds_three_columns_and_says_what_is_not_here():
    out = text(document(figures_of_a_run(), SETUP))
    for column in SEED_COLUMNS:
        assert out.count(column) == len(DIMENSIONS)
    assert "19 ms" in out and "4.2%" in out
    assert "NOT measured" in out and "the target serves no gaas-long" in out
    assert "not here: signal: device memory free" in out


def test_the_chart_is_a_png_and_the_page_needs_nothing_from_outside(tmp_path):
    doc = document(figures_of_a_run(), SETUP)
    png = chart_png(doc)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    html = page(doc, png)
    assert "data:image/png;base64," in html
    assert "src=\"http" not in html and "href=\"http" not in html and "<script" not in html
    for column in SEED_COLUMNS:
        assert column in html
    paths = write_all(doc, tmp_path / "sits.json")
    assert [p.name for p in paths] == ["sits.json", "sits.png", "sits.html"]
    assert json.loads(paths[0].read_text())["dimensions"][0]["key"] == "gpu_aware_routing"


def test_a_dimension_keeps_the_seeds_number_when_measured_alone():
    assert text(document([Dimension("heterogeneous_orchestration", "yes", {"x": 1})], SETUP)).splitlines()[2] \
        .startswith("6. Heterogeneous orchestration")


def test_a_chart_of_some_dimensions_or_none_measured_is_still_drawn():
    assert chart_png(document([Dimension("kv_cache_sharing", error="failed")], SETUP)).startswith(b"\x89PNG")


@pytest.mark.parametrize("only, keys", [
    ("", [k for k, _, _ in DIMENSIONS]),
    ("1,5", ["gpu_aware_routing", "long_context_switch"]),
    ("kv_cache_sharing", ["kv_cache_sharing"]),
])
def test_only_takes_numbers_or_names(only, keys):
    assert chosen(only) == keys


@pytest.mark.parametrize("only", ["7", "0", "routing", "1,x"])
def test_only_refuses_what_is_not_a_dimension_naming_them(only):
    with pytest.raises(SystemExit, match="dimension numbers 1-6"):
        chosen(only)


def test_the_skewed_load_alternates_heavy_and_light_in_time_order():
    plan = routing.skewed(20.0, 5.0)
    assert [kind for _, kind, _ in plan[:4]] == ["heavy", "light", "heavy", "light"]
    times = [at for at, _, _ in plan]
    assert times == sorted(times) and all(0 <= t < 20 for t in times)
    assert len({p for _, _, p in plan}) == len(plan), "every prompt is unique (no cache hit decides it)"


def test_the_step_load_floods_bronze_in_its_step_only():
    plan = batching.plan(quick=False)
    counts = {(phase, tier): sum(1 for _, p, t, _ in plan if (p, t) == (phase, tier))
              for phase in ("before", "step", "after") for tier in ("gold", "bronze")}
    assert counts[("step", "bronze")] > 5 * counts[("before", "bronze")]
    assert counts[("step", "gold")] < 3 * counts[("before", "gold")] + 10


def test_the_first_token_the_mesh_measured_leaves_out_the_usage_write_and_the_slowest_tenths_parts_say_where():
    older = {"tenant": 5.0, "router": 1.0, "queue": 0.0, "prefill": 40.0, "decode": 300.0, "net": 4.0, "total": 350.0}
    assert batching.mesh_ttft_ms(older) == 50.0  # a mesh that does not give "ttft"
    assert batching.mesh_ttft_ms({**older, "tenant": 105.0, "total": 450.0, "ttft": 50.0}) == 50.0
    fast = [{**older, "ttft": 50.0 + i} for i in range(18)]
    slow = [{**older, "prefill": 900.0, "ttft": 910.0}, {**older, "net": 604.0, "ttft": 650.0}]
    got = batching.slowest_parts(fast + slow)
    assert set(got) == {"tenant", "router", "queue", "prefill", "net"}
    assert got["prefill"] == 470.0 and got["net"] == 304.0
    assert batching.slowest_parts([]) == {}


@given(rate=st.floats(0.5, 50), seconds=st.floats(0.5, 20), seed=st.integers(0, 1000))
@settings(max_examples=50, deadline=None)
def test_poisson_arrivals_are_ordered_and_within_the_window(rate, seconds, seed):
    times = poisson(random.Random(seed), rate, seconds, start=3.0)
    assert times == sorted(times) and all(3.0 <= t < 3.0 + seconds for t in times)


@given(ids=st.lists(st.integers(1, 4000), min_size=1, max_size=300), cut=st.integers(0, 300),
       block=st.sampled_from([4, 16, 32]))
@settings(max_examples=100, deadline=None)
def test_the_kv_ceiling_is_the_full_blocks_shared_with_an_earlier_prompt(ids, cut, block):
    assert kvshare.ceiling(block, [], ids) == 0
    assert kvshare.ceiling(block, [ids], ids) == (len(ids) - 1) // block * block
    prefix = ids[:cut]
    got = kvshare.ceiling(block, [prefix + [9999] * block], ids)
    assert got % block == 0 and got <= min(len(prefix), len(ids) - 1)


def test_a_histograms_gain_between_two_readings_is_read_by_label():
    before = {"h_sum": [({"plugin": "a"}, 1.0)], "h_count": [({"plugin": "a"}, 10.0)]}
    after = {"h_sum": [({"plugin": "a"}, 1.5), ({"plugin": "b"}, 0.2)],
             "h_count": [({"plugin": "a"}, 20.0), ({"plugin": "b"}, 4.0)]}
    assert histogram_delta(before, after, "h", "plugin") == {"a": (0.5, 10.0), "b": (0.2, 4.0)}
    assert histogram_delta({}, after, "h") == {"": (pytest.approx(1.7), 24.0)}


def test_a_histograms_quantile_between_two_readings_is_the_bound_of_its_bucket():
    from bench.sits.common import histogram_quantile

    before = {"h_bucket": [({"le": "0.001"}, 1.0), ({"le": "0.01"}, 1.0), ({"le": "+Inf"}, 1.0)]}
    after = {"h_bucket": [({"le": "0.001"}, 91.0), ({"le": "0.01"}, 100.0), ({"le": "+Inf"}, 101.0)]}
    assert histogram_quantile(before, after, "h", 0.5) == 0.001
    assert histogram_quantile(before, after, "h", 0.99) == 0.01
    assert histogram_quantile(before, after, "h", 1.0) == float("inf")
    assert histogram_quantile(after, after, "h", 0.99) is None


def test_the_skewed_load_runs_at_a_share_of_the_fleets_measured_capacity():
    from bench.sits.load import Outcome

    # The fleet finished a heavy request every half second once busy (the first end is the start).
    done = [Outcome(ok=True, started=10.0 + i * 0.5 - 3.0, ms=3000.0) for i in range(11)]
    done.append(Outcome(ok=False, started=10.0, ms=1.0))
    assert routing.load_rate(done) == {"heavy_per_s_at_capacity": 2.0, "load": routing.LOAD,
                                       "per_s": round(2 * routing.LOAD * 2.0, 2)}
    # Nothing measurable: the slowest load, not none.
    assert routing.load_rate([])["per_s"] == 0.5
