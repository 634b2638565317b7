import pytest

from gaas import errors
from services.router.directory import MeshDirectory, ModelEntry
from services.router.picker import Candidate, WorkerId

MODELS = [ModelEntry("tiny", "1", 2048, True), ModelEntry("small", "1", 4096, False)]
WORKERS = [Candidate(WorkerId(f"worker-{i}"), f"127.0.0.1:{i}", "tiny", "1", 2048) for i in range(2)]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def setup():
    calls = []

    async def fetch():
        calls.append(1)
        return MODELS, WORKERS

    clock = Clock()
    return MeshDirectory(fetch, ttl_seconds=1.0, eject_seconds=5.0, clock=clock), clock, calls


async def test_caches_for_ttl(setup):
    d, clock, calls = setup
    await d.snapshot()
    await d.snapshot()
    assert len(calls) == 1
    clock.now = 1.5
    await d.snapshot()
    assert len(calls) == 2


async def test_resolve_model(setup):
    d, _, _ = setup
    assert (await d.resolve_model("")).name == "tiny"
    assert (await d.resolve_model("small")).max_model_len == 4096
    with pytest.raises(errors.NotFound, match="available: tiny, small") as err:
        await d.resolve_model("huge")
    assert err.value.param == "model" and err.value.openai_code == "model_not_found"
    with pytest.raises(errors.NotFound) as err:
        await d.resolve_model("x" * 100_000)
    assert len(err.value.message) < 200, "a huge name is cut before it is echoed"


async def test_ejection_and_exclusion(setup):
    d, clock, _ = setup
    d.eject(WorkerId("worker-0"))
    assert [c.worker_id for c in await d.candidates("tiny")] == ["worker-1"]
    # When everyone failed recently, ejected workers are tried rather than refusing.
    d.eject(WorkerId("worker-1"))
    assert len(await d.candidates("tiny")) == 2
    clock.now = 6.0
    assert len(await d.candidates("tiny", exclude={WorkerId("worker-0")})) == 1
    with pytest.raises(errors.Unavailable, match="failed this request"):
        await d.candidates("tiny", exclude={WorkerId("worker-0"), WorkerId("worker-1")})
    with pytest.raises(errors.Unavailable, match="no worker is serving 'small'"):
        await d.candidates("small")
