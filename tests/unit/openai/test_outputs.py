"""Structured output and tools in OpenAI bodies (gaas/openai/outputs.py) and the schemas that
constrain forced tool calls (gaas/contracts/tools.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gaas.contracts import errors, jsonbody, tools
from gaas.openai.api import parse_chat, parse_completion
from gaas.v1 import inference_pb2

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
NOARGS = {"type": "function", "function": {"name": "ping"}}


def chat(**kw):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_response_format_kinds():
    assert not chat(response_format={"type": "text"}).generate.HasField("structured_output")
    assert chat(response_format={"type": "json_object"}).generate.structured_output.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert json.loads(r.generate.structured_output.json_schema) == schema
    c = parse_completion({"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert list(c.generate.structured_output.choice.choices) == ["a", "b"]
    c = parse_completion({"model": "m", "prompt": "x", "structured_outputs": {"json": json.dumps(schema)}})
    assert json.loads(c.generate.structured_output.json_schema) == schema


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema' is required"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "is not supported"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "both constrain"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"tools": [WEATHER, WEATHER]}, "declares a function name twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "must be 1 to 64"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "ping"}}}, "not one of"),
])
def test_bad_bodies_name_the_field(body, message):
    with pytest.raises(errors.InvalidArgument) as err:
        chat(**body)
    assert message in err.value.message


def test_forced_choices_constrain_to_closed_schemas():
    named = chat(tools=[WEATHER, NOARGS], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    g = named.generate
    assert g.tool_calling.mode == inference_pb2.ToolCalling.MODE_NAMED and g.tool_calling.name == "get_weather"
    schema = json.loads(g.structured_output.json_schema)
    assert schema["additionalProperties"] is False and schema["required"] == ["city"]
    jsonschema.validate({"city": "Paris", "days": 2}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "extra": 1}, schema)
    required = chat(tools=[WEATHER, NOARGS], tool_choice="required", parallel_tool_calls=False).generate
    schema = json.loads(required.structured_output.json_schema)
    jsonschema.validate([{"name": "ping", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel calls off: one
        jsonschema.validate([{"name": "ping", "parameters": {}}] * 2, schema)
    with pytest.raises(jsonschema.ValidationError):  # a name not declared
        jsonschema.validate([{"name": "rm", "parameters": {}}], schema)
    assert chat(tools=[WEATHER]).generate.tool_calling.mode == inference_pb2.ToolCalling.MODE_AUTO
    assert chat(tools=[WEATHER], stream=True).generate.tool_calling.whole is False


def test_definitions_go_to_the_root_of_a_required_schema():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    schema = json.loads(tools.required_schema([("f", params)], True))
    assert "P" in schema["$defs"]
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": "x"}}], schema)


def test_messages_carry_tool_calls_and_results():
    g = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"}]}).generate
    assert g.messages[1].tool_calls[0].name == "f" and g.messages[1].tool_calls[0].arguments == '{"x": 1}'
    assert g.messages[2].role == "tool" and g.messages[2].tool_call_id == "call_1"


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(0, 20), span=st.integers(0, 20), value=st.text(max_size=45))
def test_length_bounded_strings_become_json_safe_patterns(lo, span, value):
    schema = tools.for_engine({"type": "object", "properties": {"s": {"type": "string", "minLength": lo,
                                                                        "maxLength": lo + span}}})
    pattern = schema["properties"]["s"]["pattern"]
    safe = not re.search(r'["\\\x00-\x1f]', value)
    assert bool(re.fullmatch(pattern.strip("^$"), value)) == (safe and lo <= len(value) <= lo + span)


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=10)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tools_=_json, choice=_json, fmt=_json, so=_json)
def test_no_tools_or_formats_fail_other_than_invalid_argument(tools_, choice, fmt, so):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools_, "tool_choice": choice,
            "response_format": fmt, "structured_outputs": so}
    try:
        parsed = parse_chat(jsonbody.parse(json.dumps(body).encode(), 1 << 20))
    except errors.InvalidArgument as err:
        assert err.message and len(err.message) <= errors.MAX_MESSAGE_CHARS
        return
    parsed.generate.SerializeToString()


def _chat_raw(raw: bytes):
    return parse_chat(jsonbody.parse(raw, 4 << 20))


@pytest.mark.parametrize("depth, says", [
    (30_000, f"'structured_outputs.json' is nested more than {jsonbody.MAX_DEPTH} levels deep"),
    (100_000, "'structured_outputs.json' is 200,000 characters; at most 65,536"),
])
def test_a_schema_string_nested_deeply_is_refused_naming_the_limit(depth, says):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "structured_outputs": {"json": "[" * depth + "]" * depth}}
    with pytest.raises(errors.InvalidArgument, match=re.escape(says)) as e:
        _chat_raw(json.dumps(body).encode())
    assert e.value.param == "structured_outputs.json"


def test_a_response_format_schema_nested_deeply_is_refused_naming_the_limit():
    deep = '{"type":"object","properties":{"a":' * 1500 + "{}" + "}}" * 1500
    as_text = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    with pytest.raises(errors.InvalidArgument, match="'response_format.json_schema.schema' is nested more than 32"):
        chat(response_format=as_text)
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": "HOLE"}}}).replace('"HOLE"', deep)
    with pytest.raises(errors.InvalidArgument, match="the body is nested more than 32 levels deep"):
        _chat_raw(raw.encode())
