"""The OpenAI request parser and answer formatter, alone: every supported field lands where it
should, every bad body is an InvalidArgument naming the field, and no body whatsoever makes the
parser fail any other way (property-based)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gaas.contracts import errors
from gaas.v1 import common_pb2
from gaas.contracts import jsonbody
from gaas.openai import api as openai_api, stream as openai_stream
from gaas.openai.api import parse_chat, parse_completion, parse_detokenize, parse_tokenize
from gaas.openai.stream import Formatter


def completion(**kw):
    return {"model": "gaas-tiny", "prompt": "hi", **kw}


def chat(**kw):
    return {"model": "gaas-tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_completion_maps_every_supported_field():
    p = parse_completion(completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=4, min_p=0.05, seed=3, stop="END", presence_penalty=0.1,
        frequency_penalty=-0.1, repetition_penalty=1.1, min_tokens=2, ignore_eos=True, stop_token_ids=[7, 8],
        skip_special_tokens=False, include_stop_str_in_output=True, logit_bias={"11": 5, "12": -300},
        allowed_token_ids=[1, 2, 3], bad_words=["bad"], user="u1", n=3, logprobs=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, echo=False, best_of=1,
        request_id="client-7", session_id="s1", priority=-1, add_special_tokens=False,
    ))
    g, sp = p.generate, p.generate.sampling
    assert (g.model, g.max_tokens, list(g.stop), g.n, g.logprobs) == ("gaas-tiny", 7, ["END"], 3, 2)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.min_tokens) == (0.0, 0.5, 4, 3, 2)
    assert sp.min_p == pytest.approx(0.05) and sp.repetition_penalty == pytest.approx(1.1)
    assert sp.ignore_eos and sp.include_stop_str_in_output and not sp.skip_special_tokens
    assert list(sp.stop_token_ids) == [7, 8] and list(sp.allowed_token_ids) == [1, 2, 3] and list(sp.bad_words) == ["bad"]
    assert dict(sp.logit_bias) == {11: 5.0, 12: -100.0}, "logit_bias is clamped to +-100 as vLLM does"
    assert p.prompts == ["hi"] and p.stream and p.include_usage and p.continuous_usage and p.top_logprobs == 2
    assert p.client_request_id == "client-7" and g.session_id == "s1"
    assert g.priority == common_pb2.PRIORITY_HIGH and g.HasField("add_special_tokens") and not g.add_special_tokens


def test_what_vllm_bench_serve_sends_is_accepted():
    """vLLM's own load tester: repetition_penalty, logprobs null, ignore_eos, stream_options."""
    p = parse_completion(completion(
        repetition_penalty=1.0, max_tokens=128, logprobs=None, stream=True, stream_options={"include_usage": True},
        ignore_eos=True,
    ))
    assert p.top_logprobs is None and p.generate.sampling.ignore_eos and not p.generate.HasField("logprobs")
    c = parse_chat(chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], temperature=0.0,
        max_completion_tokens=16, stream=True, stream_options={"include_usage": True}, ignore_eos=True,
    ))
    assert c.generate.max_tokens == 16 and c.generate.messages[0].content == "hi"


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hi", ["hi"]),
        (["hi"], ["hi"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[5, 6]], [[5, 6]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        (["a", [4]], ["a", [4]]),
    ],
)
def test_prompt_forms(prompt, expected):
    assert parse_completion(completion(prompt=prompt)).prompts == expected


def test_chat_messages_parts_and_options():
    p = parse_chat(chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "Sure", "name": "bot"},
    ], max_completion_tokens=9, max_tokens=4, logprobs=True, top_logprobs=3, add_generation_prompt=False,
        continue_final_message=True, parallel_tool_calls=True, tools=[], tool_choice="none"))
    assert [(m.role, m.content) for m in p.generate.messages] == [("developer", "be brief"), ("user", "a\nb"),
                                                                   ("assistant", "Sure")]
    g = p.generate
    assert g.max_tokens == 9, "max_completion_tokens wins over the legacy max_tokens"
    assert p.top_logprobs == 3 and g.logprobs == 3 and not p.stream
    assert g.HasField("add_generation_prompt") and not g.add_generation_prompt and g.continue_final_message


@pytest.mark.parametrize(
    "parse, body, message, param",
    [
        (parse_completion, completion(colour="red"), "unknown field(s) 'colour'", "colour"),
        (parse_completion, {"prompt": "hi"}, "'model' is required", "model"),
        (parse_completion, completion(model="m" * 300), "'model' is 300 characters", "model"),
        (parse_completion, completion(prompt=""), "'prompt' is required", "prompt"),
        (parse_completion, completion(prompt=5), "'prompt' must be a string or an array of token ids", "prompt"),
        (parse_completion, completion(prompt=[1, -2]), "'prompt[1]' must be between 0 and", "prompt"),
        (parse_completion, completion(prompt=[2**40]), "'prompt[0]' must be between 0 and 4294967295", "prompt"),
        (parse_completion, completion(prompt=["a"] * 65), "at most 64 per request", "prompt"),
        (parse_completion, completion(prompt=["a", ""]), "'prompt[1]' must be a non-empty", "prompt"),
        (parse_completion, completion(prompt=["a"] * 10, n=7), "more than 64 choices", "n"),
        (parse_completion, completion(max_tokens="10"), "'max_tokens' must be an integer, not a string", "max_tokens"),
        (parse_completion, completion(max_tokens=0), "'max_tokens' must be between 1 and", "max_tokens"),
        (parse_completion, completion(max_tokens=2**33), "'max_tokens' must be between 1 and 4294967295", "max_tokens"),
        (parse_completion, completion(max_tokens=True), "'max_tokens' must be an integer, not a boolean", "max_tokens"),
        (parse_completion, completion(top_k=2**40), "'top_k' must be between -1 and 2147483647", "top_k"),
        (parse_completion, completion(seed=2**64), "'seed' must be between", "seed"),
        (parse_completion, completion(temperature=3), "'temperature' must be at least 0 and at most 2", "temperature"),
        (parse_completion, completion(temperature="hot"), "'temperature' must be a number, not a string", "temperature"),
        (parse_completion, completion(top_p=0), "'top_p' must be above 0", "top_p"),
        (parse_completion, completion(n=17), "'n' must be between 1 and 16", "n"),
        (parse_completion, completion(stop=[1]), "'stop' must be a string or an array of strings", "stop"),
        (parse_completion, completion(stream="yes"), "'stream' must be true or false", "stream"),
        (parse_completion, completion(stream_options={"x": 1}), "unknown field(s) 'stream_options.x'", "stream_options.x"),
        (parse_completion, completion(stream_options=[]), "'stream_options' must be an object", "stream_options"),
        (parse_completion, completion(echo=True), "'echo' is not supported", "echo"),
        (parse_completion, completion(suffix="x"), "'suffix' is not supported", "suffix"),
        (parse_completion, completion(logprobs=21), "'logprobs' must be between 0 and 20", "logprobs"),
        (parse_completion, completion(logit_bias={"x": 1}), "keys must be token ids", "logit_bias"),
        # Digits to str.isdigit, not to int(): refused as the other non-ids are, never a server error.
        (parse_completion, completion(logit_bias={"²": 1}), "keys must be token ids", "logit_bias"),
        (parse_completion, completion(logit_bias={"١٢": 1}), "keys must be token ids", "logit_bias"),
        (parse_completion, completion(logit_bias={"1": "a"}), "values must be numbers", "logit_bias"),
        (parse_completion, completion(stop_token_ids=[-1]), "'stop_token_ids[0]' must be between", "stop_token_ids"),
        (parse_completion, completion(cache_salt="x"), "'cache_salt' is not supported", "cache_salt"),
        (parse_completion, completion(use_beam_search=True), "'use_beam_search' is not supported", "use_beam_search"),
        (parse_completion, completion(prompt_logprobs=1), "'prompt_logprobs' is not supported", "prompt_logprobs"),
        (parse_chat, chat(messages=[]), "'messages' is required", "messages"),
        (parse_chat, chat(messages=["hi"]), "'messages[0]' must be an object", "messages"),
        (parse_chat, chat(messages=[{"role": "robot", "content": "x"}]), "'messages[0].role' must be one of", "messages"),
        (parse_chat, chat(messages=[{"role": "user", "content": 5}]), "'messages[0].content' must be a string", "messages"),
        (parse_chat, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "only text parts", "messages"),
        (parse_chat, chat(messages=[{"role": "user", "content": "x", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
         "only an assistant's message holds tool calls", "messages"),
        (parse_chat, chat(tools=[{"type": "function"}]), "'tools[0].function' is required", "tools[0].function"),
        (parse_chat, chat(tool_choice="required"), "'tool_choice' needs 'tools'", "tool_choice"),
        (parse_chat, chat(response_format={"type": "xml"}), "'response_format.type' must be text, json_object or json_schema",
         "response_format.type"),
        (parse_chat, chat(functions=[{"name": "f"}]), "'functions' is not supported", "functions"),
        (parse_chat, chat(chat_template="{{ x }}"), "'chat_template' is not supported", "chat_template"),
        (parse_chat, chat(top_logprobs=2), "needs 'logprobs': true", "top_logprobs"),
        (parse_chat, chat(continue_final_message=True), "needs 'add_generation_prompt': false", "continue_final_message"),
    ],
)
def test_bad_bodies_name_the_problem(parse, body, message, param):
    with pytest.raises(errors.InvalidArgument) as err:
        parse(body)
    assert message in err.value.message
    assert err.value.param == param


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"", "empty"),
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object, not an array"),
        (b"\xff\xfe\x00", "not UTF-8"),
        (b"{}" + b" " * (1 << 20), "the limit is 1048576 bytes"),
        (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", "nested more than 32 levels"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested more than 32 levels"),
        (b'{"a": ' + b"9" * 5000 + b"}", "5000 characters"),
        (b'{"a": NaN}', "NaN is not valid JSON"),
        (b'{"a": 1e999}', "out of range"),
        (b'{"a": "\\ud800"}', "not valid Unicode"),
        (b'{"\\udfff": 1}', "not valid Unicode"),
    ],
)
def test_parse_json_limits(raw, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        jsonbody.parse(raw, max_bytes=1 << 20)


def test_tokenize_bodies():
    t = parse_tokenize({"model": "m", "prompt": "hi", "add_special_tokens": False})
    assert (t.prompt, t.add_special_tokens, t.messages) == ("hi", False, [])
    t = parse_tokenize({"messages": [{"role": "user", "content": "x"}]})
    assert t.prompt is None and [m.content for m in t.messages] == ["x"]
    assert t.add_generation_prompt and not t.add_special_tokens
    assert parse_detokenize({"tokens": [1, 2]}) == ("", [1, 2])
    with pytest.raises(errors.InvalidArgument, match="'tokens' is required"):
        parse_detokenize({"model": "m"})
    with pytest.raises(errors.InvalidArgument, match="'tokens\\[0\\]' must be between"):
        parse_detokenize({"tokens": [2**40]})


# JSON values of every kind, nested a little, with the strings and numbers that broke servers.
_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["", "gaas-tiny", "\ud800", "x" * 300, "user", "assistant", "text"]),
)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_fields = sorted(
    {"model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
     "logprobs", "top_logprobs", "logit_bias", "stream", "stream_options", "stop_token_ids", "min_tokens",
     "ignore_eos", "echo", "best_of", "tools", "response_format", "priority", "bad_words", "user",
     "tool_choice", "structured_outputs", "parallel_tool_calls"}
)
_bodies = st.dictionaries(st.sampled_from(_fields) | st.text(max_size=6), _json, max_size=6)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_bodies, kind=st.sampled_from([parse_completion, parse_chat, parse_tokenize]))
def test_no_body_fails_other_than_invalid_argument(body, kind):
    try:
        parsed = kind(jsonbody.parse(json.dumps(body).encode(), 1 << 20))  # the way bodies arrive
    except errors.InvalidArgument as err:
        assert err.message and len(err.message) <= errors.MAX_MESSAGE_CHARS
        err.message.encode("utf-8")
        return
    if kind is not parse_tokenize:
        parsed.generate.SerializeToString()  # everything accepted fits its protobuf field


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | _json.map(lambda v: json.dumps(v).encode()))
def test_no_raw_body_fails_other_than_invalid_argument(raw):
    try:
        jsonbody.parse(raw, 1 << 20)
    except errors.InvalidArgument:
        pass


def final_chunk(index=0, text="!"):
    c = common_pb2.GenerateChunk(text=text, index=index, finish_reason=common_pb2.FINISH_REASON_STOP, stop_reason="END")
    c.usage.prompt_tokens, c.usage.cached_tokens, c.usage.completion_tokens = 10, 4, 3
    return c


def test_formatter_shapes():
    f = Formatter(parse_chat(chat(stream=True, stream_options={"include_usage": True})), "req-0123abcd", "gaas-tiny")
    r = json.loads(f.answer([(0, "hello", None, final_chunk(), [])], openai_stream.usage_json(10, 3, 4)))
    assert r["id"] == "chatcmpl-0123abcd" and r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["content"] == "hello" and r["choices"][0]["message"]["role"] == "assistant"
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == "END"
    assert r["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                          "prompt_tokens_details": {"cached_tokens": 4}}
    first = f.chunk(0, common_pb2.GenerateChunk(text="he"), first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "he"} and first["usage"] is None
    last = f.chunk(1, final_chunk(index=1, text=""), first=False)
    assert last["choices"][0] == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": "END"}
    assert f.usage_chunk(openai_stream.usage_json(10, 3, 4))["choices"] == []
    c = Formatter(parse_completion(completion()), "req-1", "m")
    assert c.chunk(0, common_pb2.GenerateChunk(text="x"), True)["object"] == "text_completion"
    assert "usage" not in c.chunk(0, common_pb2.GenerateChunk(text="x"), True)
    assert json.loads(c.answer([(0, "x", None, final_chunk(), [])], {}))["choices"][0]["text"] == "x"


def _logprob_chunk(index=0):
    c = common_pb2.GenerateChunk(text="ab", token_ids=[5, 6], index=index)
    for tid, tok, lp in ((5, "a", -0.5), (6, "b", float("-inf"))):
        e = c.logprobs.add(token_id=tid, token=tok, logprob=lp)
        e.top.add(token_id=tid, token=tok, logprob=lp, rank=2)
        e.top.add(token_id=9, token="z", logprob=-0.1, rank=1)
    return c


def test_completion_logprobs_in_openai_shape():
    f = Formatter(parse_completion(completion(logprobs=1)), "req-1", "m")
    lp = f.chunk(0, _logprob_chunk(), True)["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b"] and lp["token_logprobs"] == [-0.5, -9999.0]
    assert lp["top_logprobs"] == [{"a": -0.5, "z": -0.1}, {"b": -9999.0, "z": -0.1}]
    assert lp["text_offset"] == [0, 1]
    assert f.chunk(0, _logprob_chunk(), False)["choices"][0]["logprobs"]["text_offset"] == [2, 3], "offsets continue"
    ids = Formatter(parse_completion(completion(logprobs=0, return_tokens_as_token_ids=True)), "req-1", "m")
    assert ids.chunk(0, _logprob_chunk(), True)["choices"][0]["logprobs"]["tokens"] == ["token_id:5", "token_id:6"]


def test_chat_logprobs_in_openai_shape():
    f = Formatter(parse_chat(chat(logprobs=True, top_logprobs=1)), "req-1", "m")
    content = f.chunk(0, _logprob_chunk(), True)["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                          "top_logprobs": [{"token": "z", "logprob": -0.1, "bytes": [122]}]}
    assert content[1]["logprob"] == -9999.0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_an_answer_assembled_chunk_by_chunk_is_what_the_whole_would_be(kind):
    """Non-streamed answers keep each choice's logprobs serialized as they come: the answer must
    read exactly as one built from every entry at once, choices in index order, extra fields kept."""
    parsed = parse_chat(chat(logprobs=True, top_logprobs=1)) if kind == "chat" else \
        parse_completion(completion(logprobs=1, prompt=["a", "b"]))
    f, whole = Formatter(parsed, "req-1", "m"), Formatter(parsed, "req-1", "m")
    assembled = {1: f.answer_logprobs(1), 0: f.answer_logprobs(0)}
    for index in (1, 0):
        assembled[index].add(_logprob_chunk(index).logprobs)
        assembled[index].add(_logprob_chunk(index).logprobs)
    body = json.loads(f.answer([(1, "abab", assembled[1], final_chunk(1), []), (0, "abab", assembled[0], final_chunk(0), [])],
                               openai_stream.usage_json(3, 4, 0), {"gaas_session": {"id": "s"}}))
    entries = list(_logprob_chunk().logprobs) * 2
    expected = whole.logprobs(0, entries)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["logprobs"] == expected
    assert body["gaas_session"] == {"id": "s"} and body["usage"]["completion_tokens"] == 4


def test_sse_framing_and_errors():
    assert openai_stream.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    err = errors.Unavailable("worker died")
    event = errors.openai_error(err)
    assert event == {"error": {"message": "worker died", "type": "service_unavailable", "param": None, "code": "unavailable"}}


def test_models_list_is_shaped_like_vllms_model_cards():
    listed = openai_api.models_list([
        openai_api.ListedModel("gaas-tiny", 2, 2048, {"1.0.0": "stable", "2.0.0": "canary"}, "ready"),
        openai_api.ListedModel("gaas-embed", 0, 4096, {}, "starting", "embed")], 1)
    card, starting = listed["data"]
    assert card["id"] == card["root"] == "gaas-tiny" and card["object"] == "model" and card["max_model_len"] == 2048
    assert (card["state"], starting["state"], starting["ready_workers"]) == ("ready", "starting", 0)
    assert (card["task"], starting["task"]) == ("generate", "embed")
    assert card["versions"] == [{"version": "1.0.0", "role": "stable"}, {"version": "2.0.0", "role": "canary"}]


@pytest.mark.parametrize("body, param", [
    # The request: 64 prompts, 20 alternatives per token, 1,800 tokens each.
    (completion(prompt=["x"] * 64, logprobs=20, max_tokens=1800), "logprobs"),
    (completion(prompt=["x"] * 64, n=1, max_tokens=4096), "max_tokens"),
    (chat(n=16, max_tokens=9000), "max_tokens"),
    (chat(logprobs=True, top_logprobs=20, max_tokens=30_000), "top_logprobs"),
])
def test_a_non_streamed_answer_over_the_budget_is_refused_before_any_work_naming_the_limit(body, param):
    parse = parse_chat if "messages" in body else parse_completion
    with pytest.raises(errors.InvalidArgument) as info:
        parse(body)
    assert info.value.param == param and "at most" in info.value.message and "stream it" in info.value.message
    # Streamed, the same request is held nowhere: accepted.
    assert parse({**body, "stream": True}).stream


def test_the_budget_counts_the_max_tokens_a_chat_gets_once_tokenized():
    parsed = parse_chat(chat(logprobs=True, top_logprobs=20))  # no max_tokens: the rest of the context
    openai_api.check_answer(parsed, [2000])
    with pytest.raises(errors.InvalidArgument):
        openai_api.check_answer(parsed, [200_000])
