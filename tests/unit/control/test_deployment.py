"""The deployment control keeps in SQL (SQLite and PostgreSQL): revisions, pools, stable versions and
roll-outs, driven with a fake clock."""

from __future__ import annotations


import pytest

from gaas.contracts import errors
from gaas.contracts.rollout import State
from gaas.runtime.sql import Database
from services.control.catalog import ModelCatalog
from services.control.deployment import Deployment
from services.control.deploytables import TABLES
from services.control.rollout.figures import Window
from tests.fakeclock import FakeClock

FILE = "/srv/deploy/gaas.yaml"


def text(version="1", replicas=1, strategy="canary", extra="", pins=""):
    return f"""\
models:
  - name: tiny
    version: "{version}"
    source: /m/tiny-{version}
    replicas: {replicas}
    {pins}
    rollout: {{strategy: {strategy}, steps: [50, 100], hold_seconds: 10, guard: {{min_samples: 1, min_requests: 1}}}}
{extra}"""


SMALL = """\
  - name: small
    version: "1"
    source: /m/small
    replicas: 0
"""


@pytest.fixture
async def deployment(database_url):
    db = Database(database_url)
    for t in (*TABLES, "models", "model_prices"):
        db.execute_sync(f"DROP TABLE IF EXISTS {t}")
    catalog = ModelCatalog(db)
    await catalog.init_schema()
    clock = FakeClock(1000.0)
    d = Deployment(db, catalog, check_source=lambda m: None, clock=clock)
    await d.init_schema()
    d.clock = clock
    d.catalog = catalog
    yield d
    for t in (*TABLES, "models", "model_prices"):
        db.execute_sync(f"DROP TABLE IF EXISTS {t}")
    db.close()


async def apply(d, t, origin="gaas apply -f x.yaml", dry_run=False):
    return await d.apply_file(t, FILE, origin, dry_run)


def summary(pools):
    return sorted((p.model, p.version, p.role, p.spec["replicas"]) for p in pools)


async def test_the_first_apply_adds_every_model_at_its_version(deployment):
    number, changes = await apply(deployment, text(extra=SMALL))
    assert number == 1 and [c.line() for c in changes] == ["tiny: added: version 1, 1 worker",
                                                           "small: added: version 1, no workers (catalogued)"]
    assert summary(await deployment.pools()) == [("tiny", "1", "stable", 1)]
    served = {s.model.name: s for s in await deployment.served()}
    assert served["tiny"].split.stable == "1" and not served["tiny"].split.canary
    assert [m.name for m in await deployment.catalog.list()] == ["small", "tiny"]
    assert await apply(deployment, text(extra=SMALL)) == (0, []), "the same file again changes nothing"


async def test_a_dry_run_says_what_would_change_and_changes_nothing(deployment):
    await apply(deployment, text())
    number, changes = await apply(deployment, text(version="2"), dry_run=True)
    assert number == 0 and changes[0].kind == "rollout"
    assert summary(await deployment.pools()) == [("tiny", "1", "stable", 1)]
    assert len(await deployment.revisions()) == 1


def ticker(ready=True, failed="", window=None):
    def tick(r):
        return r.tick(r.since + 11, ready, window or Window(60), failed)
    return tick


async def test_a_new_version_runs_beside_the_stable_one_until_promoted(deployment):
    await apply(deployment, text())
    number, _ = await apply(deployment, text(version="2", replicas=2))
    assert number == 2
    assert summary(await deployment.pools()) == [("tiny", "1", "stable", 1), ("tiny", "2", "canary", 2)]
    split = (await deployment.served())[0].split
    assert (split.stable, split.canary, split.weight) == ("1", "2", 0), "starting: no share yet"
    d = await deployment.step("tiny", "2", ticker())
    assert (d.state, d.weight) == (State.PROGRESSING, 50)
    assert (await deployment.served())[0].split.weight == 50
    # Healthy at each step (a window the guard can judge, both versions alike).
    from services.control.rollout.figures import Outcome

    w = Window(60)
    for t in range(1000, 1200):
        for v in ("1", "2"):
            w.add(Outcome(at=t, version=v, tier="gold", ttft_ms=10, output_tokens=10, decode_s=0.1))
    for _ in range(2):
        await deployment.step("tiny", "2", lambda r: r.tick(r.since + 11, True, w))
    r, _ = await deployment.rollout("tiny")
    assert r.state is State.PROMOTED
    assert summary(await deployment.pools()) == [("tiny", "2", "stable", 2)]
    assert [m.version for m in await deployment.catalog.list()] == ["2"]


async def test_a_rolled_back_version_is_declared_away_and_the_file_rolls_it_out_again(deployment):
    await apply(deployment, text())
    await apply(deployment, text(version="2"))
    d = await deployment.step("tiny", "2", ticker(ready=False, failed="weights not found"))
    assert d.state is State.HALTED and "weights not found" in d.reason
    assert summary(await deployment.pools()) == [("tiny", "1", "stable", 1)]
    history = await deployment.revisions()
    assert history[-1]["origin"].startswith("control: 2's workers failed to start: weights not found")
    assert history[-1]["changes"] == ["tiny: rollback: 2 -> 1"]
    # The model is declared at 1 again: the file naming 2 is a roll-out again.
    _, changes = await apply(deployment, text(version="2"), dry_run=True)
    assert [c.kind for c in changes] == ["rollout"]


async def test_the_operator_undoes_a_live_rollout_and_then_a_promoted_one(deployment):
    await apply(deployment, text())
    await apply(deployment, text(version="2"))
    r = await deployment.change("tiny", "undo")
    assert r.state is State.ROLLED_BACK and r.decisions[-1].reason == "rolled back by the operator"
    assert summary(await deployment.pools()) == [("tiny", "1", "stable", 1)]
    with pytest.raises(errors.FailedPrecondition, match="no roll-out under way .its last one rolled-back."):
        await deployment.change("tiny", "pause")
    # 2 again, promoted by the operator; then undone: 1 rolled out again.
    await apply(deployment, text(version="2"))
    await deployment.step("tiny", "2", ticker())
    r = await deployment.change("tiny", "promote")
    assert r.state is State.PROMOTED
    r = await deployment.change("tiny", "undo")
    assert (r.stable, r.version, r.state) == ("2", "1", State.STARTING)
    assert (await deployment.revisions())[-1]["origin"] == "gaas rollout undo tiny"
    assert summary(await deployment.pools()) == [("tiny", "1", "canary", 1), ("tiny", "2", "stable", 1)]


async def test_a_pinned_tenant_keeps_its_version_running(deployment):
    await apply(deployment, text())
    await apply(deployment, text(version="2", pins='pins: {acme: "1"}'))
    with pytest.raises(errors.FailedPrecondition, match="still starting"):
        await deployment.change("tiny", "promote")
    await deployment.step("tiny", "2", ticker())
    await deployment.change("tiny", "promote")
    assert summary(await deployment.pools()) == [("tiny", "1", "kept", 1), ("tiny", "2", "stable", 1)]
    split = (await deployment.served())[0].split
    assert (split.stable, dict(split.pins), split.kept) == ("2", {"acme": "1"}, ("1",))


async def test_start_up_applies_the_file_only_when_it_changed_since_it_last_did(deployment):
    from gaas.settings.deployspec import parse_text
    from pathlib import Path

    spec = parse_text(text(), Path("/srv"), FILE)
    assert await deployment.startup(spec, FILE) == 1
    assert await deployment.startup(spec, FILE) == 0, "unchanged"
    await apply(deployment, text(replicas=3))  # the operator scales it
    assert await deployment.startup(spec, FILE) == 0, "the same file at the next start keeps the operator's change"
    assert summary(await deployment.pools()) == [("tiny", "1", "stable", 3)]
    changed = parse_text(text(extra=SMALL), Path("/srv"), FILE)
    assert await deployment.startup(changed, FILE) == 3


async def test_a_failure_report_is_kept_for_the_rollout(deployment):
    await deployment.report_failure("tiny", "2", "CUDA out of memory", "worker-3")
    assert await deployment.failures("tiny", "2", 0) == ["worker-3: CUDA out of memory"]
    assert await deployment.failures("tiny", "2", 2_000_000) == []


async def test_a_policy_changed_under_way_is_taken_by_the_live_rollout_but_not_a_strategy(deployment):
    await apply(deployment, text())
    await apply(deployment, text(version="2", strategy="shadow"))
    await deployment.step("tiny", "2", ticker())
    number, changes = await apply(deployment, text(version="2", strategy="shadow").replace(
        "steps: [50, 100]", "steps: [50, 100], shadow_percent: 40"))
    assert number and [c.kind for c in changes] == ["changed"]
    r, _ = await deployment.rollout("tiny")
    assert (r.state, r.policy.shadow) == (State.SHADOWING, 40) and "shadow 40%" in r.decisions[-1].reason
    assert (await deployment.served())[0].split.shadow == 40
    with pytest.raises(errors.FailedPrecondition, match="its strategy cannot change under way"):
        await apply(deployment, text(version="2", strategy="canary"))


async def test_undo_to_a_revision_rolls_its_version_out_again(deployment):
    await apply(deployment, text())                          # revision 1: 1
    await apply(deployment, text(version="2"))               # 2: rolling out 2
    await deployment.step("tiny", "2", ticker())
    await deployment.change("tiny", "promote")               # 2 is stable
    await apply(deployment, text(version="3"))               # 3: rolling out 3
    await deployment.step("tiny", "3", ticker())
    await deployment.change("tiny", "promote")               # 3 is stable
    with pytest.raises(errors.NotFound, match="there is no revision 99"):
        await deployment.change("tiny", "undo", to_revision=99)
    r = await deployment.change("tiny", "undo", to_revision=1)
    assert (r.stable, r.version, r.state) == ("3", "1", State.STARTING)
    assert (await deployment.revisions())[-1]["origin"] == "gaas rollout undo tiny --to-revision 1"
    with pytest.raises(errors.FailedPrecondition, match="under way"):
        await deployment.change("tiny", "undo", to_revision=1)
