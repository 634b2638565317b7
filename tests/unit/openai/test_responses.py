"""The Responses API read into chat bodies and written from chunks (gaas/openai/responses.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gaas.contracts import errors, jsonbody
from gaas.openai import responses
from gaas.openai.api import parse_chat
from gaas.v1 import common_pb2


def test_input_items_become_chat_messages():
    req = responses.parse({"model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{\"a\":1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ], "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}]})
    body = req.chat_body([{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}])
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert [c["id"] for c in body["messages"][4]["tool_calls"]] == ["c1", "c2"]  # one assistant turn, two calls
    assert body["max_completion_tokens"] == 9 and body["tools"][0]["function"]["name"] == "get"
    g = parse_chat(body).generate
    assert g.messages[5].role == "tool" and g.messages[5].tool_call_id == "c1"
    assert [i["type"] for i in req.items] == ["message", "function_call", "function_call", "function_call_output"]
    assert all(i["id"] for i in req.items)


def test_text_format_and_tool_choice_translate():
    req = responses.parse({"model": "m", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": {"type": "object"}, "strict": True}}})
    assert req.chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert req.echo["text"]["format"]["type"] == "json_schema"
    req = responses.parse({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}],
                           "tool_choice": {"type": "function", "name": "f"}})
    assert req.chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}


def _chunks(*parts):
    for p in parts:
        yield p


def test_events_follow_openais_order_for_text_then_a_call():
    req = responses.parse({"model": "m", "input": "x", "stream": True})
    b = responses.ResponseBuilder(req, "resp_1", "m")
    events = b.start()
    events += b.add(common_pb2.GenerateChunk(text="Hel"))
    events += b.add(common_pb2.GenerateChunk(text="lo"))
    events += b.add(common_pb2.GenerateChunk(tool_calls=[common_pb2.ToolCall(index=0, id="call_1", name="f",
                                                                              arguments='{"a":')]))
    events += b.add(common_pb2.GenerateChunk(tool_calls=[common_pb2.ToolCall(index=0, arguments="1}")]))
    final = common_pb2.GenerateChunk(finish_reason=common_pb2.FINISH_REASON_STOP)
    events += b.finish(final, {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
    parsed = [json.loads(e.split(b"data: ", 1)[1]) for e in events]
    assert [e["type"] for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert all(e.startswith(b"event: " + p["type"].encode() + b"\n") for e, p in zip(events, parsed))
    done = parsed[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == 4
    assert done["output"][0]["content"][0]["text"] == "Hello"
    assert done["output"][1] | {"id": None} == {"id": None, "type": "function_call", "status": "completed",
                                                "call_id": "call_1", "name": "f", "arguments": '{"a":1}'}
    assert b.conversation() == [{"role": "assistant", "content": "Hello", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}]


def test_cut_by_max_output_tokens_is_incomplete():
    b = responses.ResponseBuilder(responses.parse({"model": "m", "input": "x"}), "resp_1", "m")
    assert b.start() == [] and b.add(common_pb2.GenerateChunk(text="a")) == []
    b.finish(common_pb2.GenerateChunk(finish_reason=common_pb2.FINISH_REASON_LENGTH),
             {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    r = b.response()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}


def test_input_items_pages():
    items = [{"id": f"i{n}"} for n in range(5)]
    page = responses.input_items_page(items, 2, "asc", "i1", "")
    assert [i["id"] for i in page["data"]] == ["i2", "i3"] and page["has_more"]
    page = responses.input_items_page(items, 0, "", "", "")
    assert [i["id"] for i in page["data"]] == ["i4", "i3", "i2", "i1", "i0"] and not page["has_more"]
    with pytest.raises(errors.InvalidArgument):
        responses.input_items_page(items, 2, "sideways", "", "")


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=10)
_fields = st.sampled_from(["model", "input", "instructions", "tools", "tool_choice", "text", "store", "stream",
                           "previous_response_id", "max_output_tokens", "metadata", "truncation", "include"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(_fields | st.text(max_size=5), _json, max_size=6),
       item=st.dictionaries(st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output"]),
                            _json, max_size=5))
def test_no_body_fails_other_than_invalid_argument(body, item):
    body = {"model": "m", "input": [item], **body} if "input" not in body else body
    try:
        req = responses.parse(jsonbody.parse(json.dumps(body).encode(), 1 << 20))
        parse_chat(req.chat_body([])).generate.SerializeToString()
    except errors.InvalidArgument as err:
        assert err.message and len(err.message) <= errors.MAX_MESSAGE_CHARS


def test_a_text_format_schema_nested_deeply_is_refused_naming_the_field_and_the_limit():
    deep = "[" * 60_000 + "]" * 60_000
    with pytest.raises(errors.InvalidArgument, match="'text.format.schema' is nested more than 32 levels deep") as e:
        responses.parse({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                                          "schema": deep}}})
    assert e.value.param == "text.format.schema"
    raw = json.dumps({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                                      "schema": "HOLE"}}}).replace('"HOLE"', deep)
    with pytest.raises(errors.InvalidArgument, match="the body is nested more than 32 levels deep"):
        responses.parse(jsonbody.parse(raw.encode(), 1 << 20))


def test_a_text_format_schema_given_as_json_text_is_read_as_its_object():
    req = responses.parse({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                                           "schema": '{"type": "object"}'}}})
    assert req.chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
