"""A new worker's warm-up: its requests under a salt no tenant has (a model that pools: embeddings),
the cache emptied after them, then the model's public prefixes primed under the salt the router
caches their requests under (none for a model that pools)."""

from gaas.contracts.kvhash import public_salt
from services.worker.engine import EngineInfo
from services.router.prepare import cache_salt
from services.worker.warmup import SALT, prime, warm_up


class FakeEngine:
    def __init__(self, fail_on: str = "", task: str = "generate") -> None:
        self.requests, self.resets, self._fail_on = [], 0, fail_on
        self.info = EngineInfo("tiny", "1.0", "vllm-cpu", "cpu", 32, 256, task=task)

    async def embed(self, r):
        self.requests.append(r)

    async def generate(self, r):
        self.requests.append(r)
        if self._fail_on and self._fail_on in r.request_id:
            raise RuntimeError("cannot")
        yield object()

    async def reset_prefix_cache(self):
        self.resets += 1
        return True


async def test_warm_up_runs_its_requests_under_its_own_salt_and_empties_the_cache():
    e = FakeEngine()
    await warm_up(e, 2)
    assert [r.cache_salt for r in e.requests] == [SALT, SALT] and e.resets == 1


async def test_public_prefixes_are_primed_in_both_forms_under_the_routers_salt():
    e = FakeEngine(fail_on="pub_b")
    assert await prime(e, [("pub_a", "You are helpful."), ("pub_b", "Other.")]) == 1, "one failing is skipped"
    chat, text = e.requests[:2]
    assert chat.messages == [("system", "You are helpful.")] and not chat.add_generation_prompt
    assert text.prompt == "You are helpful." and chat.max_tokens == text.max_tokens == 1
    assert chat.cache_salt == text.cache_salt == public_salt("pub_a") == cache_salt(("pub_a", "x"), "tenant-salt")


async def test_a_model_that_pools_warms_up_with_embeddings_and_primes_no_prefix():
    e = FakeEngine(task="embed")
    await warm_up(e, 2)
    assert [(type(r).__name__, r.cache_salt) for r in e.requests] == [("EmbeddingRequest", SALT)] * 2
    assert await prime(e, [("pub_a", "You are helpful.")]) == 0 and len(e.requests) == 2
