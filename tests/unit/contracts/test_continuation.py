"""A stream whose worker fails mid-stream carried on by another worker (gaas/contracts/continuation.py):
the continuation's request, and the one stream and usage the client sees."""

from hypothesis import given, strategies as st

from gaas.v1 import common_pb2, worker_pb2
from gaas.contracts.continuation import Carried
from tests.unit.contracts.support import tok


def request(prompt=(5, 6, 7), max_tokens=10, n=0, **sampling):
    r = worker_pb2.WorkerGenerateRequest(request_id="req-1", cache_salt="salt", engine_priority=3)
    r.request.prompt_token_ids[:] = prompt
    r.request.max_tokens = max_tokens
    r.request.n = n
    r.request.stop[:] = ["END"]
    for k, v in sampling.items():
        setattr(r.request.sampling, k, v)
    return r


def test_the_continuation_is_the_prompt_and_the_tokens_sent_with_the_rest_of_max_tokens():
    carried = Carried(3)
    carried.seen(tok(40, "a", prefill=(3, 2)))
    carried.seen(tok(41, "b"))
    original = request(temperature=0.0, seed=7, min_tokens=5)
    cont = carried.continuation(original)
    assert list(cont.request.prompt_token_ids) == [5, 6, 7, 40, 41]
    assert cont.request.max_tokens == 8 and cont.request.sampling.min_tokens == 3
    # The same sampling, seed, stops, salt, priority and id.
    assert cont.request.sampling.seed == 7 and cont.request.sampling.temperature == 0.0
    assert list(cont.request.stop) == ["END"] and cont.cache_salt == "salt" and cont.engine_priority == 3
    assert cont.request_id == "req-1"
    assert list(original.request.prompt_token_ids) == [5, 6, 7], "the original request is left as it was"


@given(prompt=st.lists(st.integers(0, 999), min_size=1, max_size=20),
       sent=st.lists(st.integers(0, 999), max_size=30), max_tokens=st.integers(1, 40))
def test_a_continuation_never_asks_for_more_than_the_client_was_owed(prompt, sent, max_tokens):
    carried = Carried(len(prompt))
    carried.seen(common_pb2.GenerateChunk(token_ids=sent))
    cont = carried.continuation(request(prompt, max_tokens))
    if len(sent) >= max_tokens:
        assert cont is None
    else:
        assert list(cont.request.prompt_token_ids) == prompt + sent
        assert len(sent) + cont.request.max_tokens == max_tokens


def test_only_a_single_choice_and_a_failed_worker_are_carried_on():
    carried = Carried(3)
    assert carried.can_carry_on(request(), "UNAVAILABLE")
    assert carried.can_carry_on(request(), "INTERNAL")  # a reset stream: the sidecar's answer
    assert not carried.can_carry_on(request(n=2), "UNAVAILABLE")
    assert not carried.can_carry_on(request(), "INVALID_ARGUMENT")
    assert not carried.can_carry_on(request(), "DEADLINE_EXCEEDED")


def test_the_continuations_usage_is_what_the_client_received():
    carried = Carried(3)
    carried.seen(tok(40, "a", prefill=(3, 2)))
    carried.seen(tok(41, "b"))
    first = tok(42, "c", prefill=(5, 0))
    carried.adjust(first, before=2)
    assert not first.HasField("prefill"), "the client's stream has one prefill, the first worker's"
    last = tok(43, "d", final=(5, 0, 2))
    carried.adjust(last, before=2)
    assert (last.usage.prompt_tokens, last.usage.cached_tokens, last.usage.completion_tokens) == (3, 2, 4)
    assert carried.recomputed(tok(42, "c", prefill=(5, 1))) == 4


def test_a_stream_whose_last_token_went_out_ends_without_another_worker():
    carried = Carried(3)
    carried.seen(common_pb2.GenerateChunk(token_ids=[1, 2], prefill=common_pb2.Usage(prompt_tokens=3)))
    assert carried.continuation(request(max_tokens=2)) is None
    end = carried.ended("req-1", "w0", "tiny", "1.0")
    assert end.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (end.usage.prompt_tokens, end.usage.completion_tokens) == (3, 2)
