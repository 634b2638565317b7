"""What an apply changes, table-driven: each case is the file's models against what runs now."""

from __future__ import annotations

from pathlib import Path

import pytest

from gaas.contracts import errors
from gaas.settings.deployspec import parse
from services.control.deployplan import Current, plan, sections_of

ROOT = Path("/srv")


def spec(*models: dict, **sections):
    return parse({"models": [{"source": "/m/" + m["name"], **m} for m in models], **sections}, ROOT)


def current(*models: dict, stable: dict | None = None, rolling: dict | None = None, pools: dict | None = None):
    s = spec(*models)
    declared = {m.name: m for m in s.models}
    known = {(m.name, m.version): m.pool() for m in s.models}
    known.update(pools or {})
    return Current(models=declared, stable=stable or {m.name: m.version for m in s.models}, rolling=rolling or {},
                   pools=known, sections=sections_of(s))


def fine(m) -> None:
    return None


TINY = {"name": "tiny", "version": "1", "replicas": 1}


@pytest.mark.parametrize("now, new, kinds", [
    # Nothing changed.
    ((TINY,), (TINY,), []),
    # A model added; one removed.
    ((TINY,), (TINY, {"name": "small", "version": "1", "replicas": 2}), [("small", "added")]),
    ((TINY, {"name": "small", "version": "1"}), (TINY,), [("small", "removed")]),
    # A new version of a served model: a roll-out.
    ((TINY,), ({**TINY, "version": "2"},), [("tiny", "rollout")]),
    # A new version of a model nobody serves: no roll-out, it just is the version.
    (({**TINY, "replicas": 0},), ({**TINY, "version": "2", "replicas": 0},), [("tiny", "changed")]),
    # Replicas, tenants, pins and the policy change at once.
    ((TINY,), ({**TINY, "replicas": 3},), [("tiny", "scaled")]),
    ((TINY,), ({**TINY, "tenants": ["acme"]},), [("tiny", "changed")]),
    ((TINY,), ({**TINY, "rollout": {"strategy": "blue-green"}},), [("tiny", "changed")]),
    # A model nobody serves may change what it would run with.
    (({**TINY, "replicas": 0},), ({**TINY, "replicas": 0, "engine": {"max_num_seqs": 4}},), [("tiny", "changed")]),
])
def test_what_an_apply_changes(now, new, kinds):
    p = plan(current(*now), spec(*new), fine)
    assert [(c.subject, c.kind) for c in p.changes] == kinds
    assert p.changed is bool(kinds)


def test_a_new_version_rolls_out_from_the_stable_one_with_the_models_policy():
    p = plan(current(TINY), spec({**TINY, "version": "2", "rollout": {"steps": [10, 100]}}), fine)
    assert p.rollouts == {"tiny": ("1", "2")}
    assert "1 -> 2 (1 worker): canary 10% -> 100%" in p.changes[0].detail
    assert p.pools[("tiny", "2")]["version"] == "2" and not p.stable


def test_what_workers_run_with_needs_a_new_version():
    with pytest.raises(errors.FailedPrecondition, match=r"tiny 1: its workers run with its source, engine as applied; "
                                                        r"a change of source, engine needs a new version"):
        plan(current(TINY), spec({**TINY, "source": "/elsewhere", "engine": {"max_num_seqs": 4}}), fine)


def test_during_a_rollout_the_file_names_its_version_or_the_stable_one_only():
    now = current({**TINY, "version": "2"}, stable={"tiny": "1"}, rolling={"tiny": "2"},
                  pools={("tiny", "1"): spec(TINY).models[0].pool()})
    assert not plan(now, spec({**TINY, "version": "2"}), fine).changed
    back = plan(now, spec(TINY), fine)
    assert back.undo == ["tiny"] and back.changes[0].kind == "undo"
    with pytest.raises(errors.FailedPrecondition, match="a roll-out from 1 to 2 is under way"):
        plan(now, spec({**TINY, "version": "3"}), fine)


def test_a_missing_source_is_refused_before_anything_changes():
    def missing(m):
        return f"{m.name} {m.version}: source {m.source} does not exist"

    with pytest.raises(errors.InvalidArgument, match="tiny 2: source /m/tiny does not exist"):
        plan(current(TINY), spec({**TINY, "version": "2"}), missing)
    # A model that is not served needs no weights.
    assert plan(current(TINY), spec(TINY, {"name": "big", "replicas": 0}), missing).changed


def test_a_pin_names_a_version_the_model_served():
    now = current(TINY, pools={("tiny", "0.9"): {**spec(TINY).models[0].pool(), "version": "0.9"}})
    assert plan(now, spec({**TINY, "pins": {"acme": "0.9"}}), fine).changes[0].detail == "pins: acme -> 0.9"
    with pytest.raises(errors.InvalidArgument, match=r"pins: acme -> 0.5, a version tiny never served \(known: 0.9, 1\)"):
        plan(now, spec({**TINY, "pins": {"acme": "0.5"}}), fine)


def test_other_sections_say_when_they_take_effect():
    p = plan(current(TINY), spec(TINY, qos={"gold": {"ttft_target_ms": 100}},
                                 billing={"prices": {"gold": {"*": {"input": 1, "cached_input": 0, "output": 2}}}}),
             fine)
    said = {c.subject: c.detail for c in p.changes}
    assert said == {"prices": "takes effect at once (routers read prices from control)",
                    "qos": "takes effect when routers restart (gaas restart router)",
                    # The guard holds a version to the tiers' targets.
                    "tiny": "rollout guard: TTFT p95 targets bronze 5000 ms, gold 100 ms, silver 1500 ms, window 60 s"}
