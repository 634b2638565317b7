import json

import pytest

from gaas.v1 import common_pb2
from services.router import openai_api
from services.router.openai_api import BadRequest, Formatter, parse_chat, parse_completion, parse_json


def completion(**kw):
    return {"model": "gaas-tiny", "prompt": "hi", **kw}


def chat(**kw):
    return {"model": "gaas-tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_completion_maps_every_supported_field():
    p = parse_completion(completion(
        max_tokens=7, temperature=0, top_p=0.5, top_k=4, seed=3, stop="END", presence_penalty=0.1,
        frequency_penalty=-0.1, user="u1", n=1, stream=True, stream_options={"include_usage": True},
    ))
    g = p.generate
    assert (g.model, g.prompt, g.max_tokens, list(g.stop)) == ("gaas-tiny", "hi", 7, ["END"])
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.top_k, g.sampling.seed) == (0.0, 0.5, 4, 3)
    assert p.stream and p.include_usage


@pytest.mark.parametrize(
    "prompt, field, value",
    [("hi", "prompt", "hi"), (["hi"], "prompt", "hi"), ([1, 2, 3], "prompt_token_ids", [1, 2, 3]), ([[5, 6]], "prompt_token_ids", [5, 6])],
)
def test_prompt_forms(prompt, field, value):
    got = getattr(parse_completion(completion(prompt=prompt)).generate, field)
    assert (list(got) if field == "prompt_token_ids" else got) == value


def test_chat_messages_and_parts():
    p = parse_chat(chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], max_completion_tokens=9))
    assert [(m.role, m.content) for m in p.generate.messages] == [("system", "be brief"), ("user", "ab")]
    assert p.generate.max_tokens == 9 and not p.stream


@pytest.mark.parametrize(
    "parse, body, message",
    [
        (parse_completion, completion(colour="red"), "unknown field(s) 'colour'"),
        (parse_completion, {"prompt": "hi"}, "'model' is required"),
        (parse_completion, completion(prompt=""), "'prompt' is required"),
        (parse_completion, completion(prompt=5), "'prompt' must be a string or an array of token ids"),
        (parse_completion, completion(prompt=["a", "b"]), "several prompts"),
        (parse_completion, completion(prompt=[1, -2]), "must be a string or an array of token ids"),
        (parse_completion, completion(max_tokens="10"), "'max_tokens' must be an integer, not a string"),
        (parse_completion, completion(max_tokens=0), "'max_tokens' must be at least 1"),
        (parse_completion, completion(max_tokens=True), "'max_tokens' must be an integer, not a boolean"),
        (parse_completion, completion(temperature=3), "'temperature' must be between 0 and 2"),
        (parse_completion, completion(temperature="hot"), "'temperature' must be a number, not a string"),
        (parse_completion, completion(n=2), "'n' must be 1"),
        (parse_completion, completion(stop=[1]), "'stop' must be a string or an array of strings"),
        (parse_completion, completion(stream="yes"), "'stream' must be true or false"),
        (parse_completion, completion(stream_options={"x": 1}), "'stream_options' must be an object"),
        (parse_completion, completion(echo=True), "'echo' is not supported"),
        (parse_completion, completion(logprobs=3), "'logprobs' is not supported"),
        (parse_completion, completion(top_k=0), "'top_k' must be -1"),
        (parse_chat, chat(messages=[]), "'messages' is required"),
        (parse_chat, chat(messages=["hi"]), "messages[0] must be an object"),
        (parse_chat, chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role must be one of"),
        (parse_chat, chat(messages=[{"role": "user", "content": 5}]), "messages[0].content must be a string"),
        (parse_chat, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "only text parts"),
        (parse_chat, chat(messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]), "unsupported field(s)"),
        (parse_chat, chat(tools=[{"type": "function"}]), "'tools' is not supported"),
        (parse_chat, chat(response_format={"type": "json_object"}), "'response_format'"),
    ],
)
def test_bad_bodies_name_the_problem(parse, body, message):
    with pytest.raises(BadRequest) as err:
        parse(body)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"", "empty"),
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object, not an array"),
        (b"\xff\xfe\x00", "not"),
        (b"{}" + b" " * 100, "the limit is 64 bytes"),
    ],
)
def test_parse_json(raw, message):
    with pytest.raises(BadRequest, match=message):
        parse_json(raw, max_bytes=64)


def final_chunk():
    c = common_pb2.GenerateChunk(text="!", finish_reason=common_pb2.FINISH_REASON_LENGTH)
    c.usage.prompt_tokens, c.usage.cached_tokens, c.usage.completion_tokens = 10, 4, 3
    return c


def test_formatter_shapes():
    f = Formatter("chat", "0123-abcd", "gaas-tiny")
    r = f.response("hello", final_chunk())
    assert r["id"] == "chatcmpl-0123abcd" and r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                          "prompt_tokens_details": {"cached_tokens": 4}}
    first = f.chunk("he", None, include_usage=True, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "he"} and first["usage"] is None
    assert f.chunk(None, "stop", include_usage=False)["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert f.usage_chunk(final_chunk())["choices"] == []
    c = Formatter("completion", "r1", "m")
    assert c.chunk("x", None, False)["object"] == "text_completion"
    assert c.response("x", final_chunk())["choices"][0]["text"] == "x"


def test_sse_framing():
    assert openai_api.sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    event = json.loads(openai_api.error_event("UNAVAILABLE", "worker died")[len(b"data: "):])
    assert event["error"]["message"] == "worker died" and event["error"]["type"] == "server_error"
