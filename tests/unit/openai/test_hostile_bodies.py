"""Fuzzing the request parsers of the new surfaces (chat's structured outputs and tools, the
Responses API, a batch's lines and create body) with hostile JSON at each field a client fills:
whatever comes, the answer is a result or an InvalidArgument, never another exception (a 500)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gaas.contracts import edge, errors, jsonbody
from gaas.model.tokenizer import ChatMessage
from gaas.openai import batches, responses
from gaas.openai.api import parse_chat, parse_completion
from gaas.openai.stream import dumps
from tests.hostile import at, fragments, splice

MAX_BODY = edge.MAX_BODY_BYTES * 2
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": USER}
CALLED = {"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
TOOLS = {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
CHAT_CASES = [
    (CHAT, ("structured_outputs", "json")), (CHAT, ("structured_outputs", "regex")),
    (CHAT, ("structured_outputs", "grammar")), (CHAT, ("structured_outputs", "choice")),
    (CHAT, ("structured_outputs", "choice", 0)), (CHAT, ("structured_outputs",)),
    (CHAT, ("response_format",)), (CHAT, ("response_format", "type")),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     ("response_format", "json_schema", "schema")),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     ("response_format", "json_schema", "name")),
    (CHAT, ("tools",)), (TOOLS, ("tools", 0)), (TOOLS, ("tools", 0, "function", "parameters")),
    (TOOLS, ("tools", 0, "function", "name")), (TOOLS, ("tools", 0, "function", "description")),
    (TOOLS, ("tool_choice",)), (TOOLS, ("tool_choice", "function", "name")),
    ({**TOOLS, "tool_choice": "required"}, ("tools", 0, "function", "parameters", "properties")),
    (TOOLS, ("parallel_tool_calls",)),
    (CALLED, ("messages", 0, "tool_calls", 0, "function", "arguments")),
    (CALLED, ("messages", 0, "tool_calls", 0, "function", "name")), (CALLED, ("messages", 0, "tool_calls")),
    (CALLED, ("messages", 0, "tool_calls", 0, "id")), (CALLED, ("messages", 1, "tool_call_id")),
    (CHAT, ("messages", 0, "content")), (CHAT, ("messages", 0)), (CHAT, ("messages",)),
    (CHAT, ("max_tokens",)), (CHAT, ("max_completion_tokens",)), (CHAT, ("n",)), (CHAT, ("temperature",)),
    (CHAT, ("top_p",)), (CHAT, ("seed",)), (CHAT, ("logit_bias",)), (CHAT, ("logit_bias", "12")),
    (CHAT, ("stop",)), (CHAT, ("top_logprobs",)), (CHAT, ("stream_options",)), (CHAT, ("model",)),
]


def _refused_or_served(call) -> None:
    try:
        call()
    except errors.InvalidArgument as err:
        assert err.message and len(err.message) <= errors.MAX_MESSAGE_CHARS


def _chat(raw: bytes) -> None:
    g = parse_chat(jsonbody.parse(raw, MAX_BODY)).generate
    g.SerializeToString()
    # (what the chat template is given, a sent-back call's arguments read as JSON when they are)
    json.dumps([ChatMessage.of(m).as_template_dict() for m in g.messages])


@FUZZ
@given(case=st.sampled_from(CHAT_CASES), fragment=fragments)
def test_chat_fields_refuse_hostile_values_with_invalid_argument(case, fragment):
    base, path = case
    _refused_or_served(lambda: _chat(splice(at(path, base), fragment)))


@FUZZ
@given(path=st.sampled_from([("structured_outputs", "json"), ("prompt",), ("prompt", 0), ("max_tokens",),
                             ("response_format", "json_schema", "schema"), ("echo",), ("suffix",)]),
       fragment=fragments)
def test_completion_fields_refuse_hostile_values_with_invalid_argument(path, fragment):
    raw = splice(at(path, {"model": "m", "prompt": "x"}), fragment)
    _refused_or_served(lambda: parse_completion(jsonbody.parse(raw, MAX_BODY)).generate.SerializeToString())


RESPONSE = {"model": "m", "input": "hi"}
ITEMS = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]},
                                 {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "c", "output": "ok"}]}
SCHEMA = {**RESPONSE, "text": {"format": {"type": "json_schema", "name": "x"}}}
RTOOLS = {**RESPONSE, "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}
RESPONSE_CASES = [
    (RESPONSE, ("input",)), (ITEMS, ("input", 0)), (ITEMS, ("input", 0, "content")),
    (ITEMS, ("input", 0, "content", 0, "text")), (ITEMS, ("input", 0, "role")), (ITEMS, ("input", 1, "arguments")),
    (ITEMS, ("input", 1, "name")), (ITEMS, ("input", 2, "output")), (ITEMS, ("input", 2, "call_id")),
    (SCHEMA, ("text", "format", "schema")), (SCHEMA, ("text", "format", "name")), (SCHEMA, ("text", "format")),
    (RESPONSE, ("text",)), (RTOOLS, ("tools",)), (RTOOLS, ("tools", 0)), (RTOOLS, ("tools", 0, "parameters")),
    (RTOOLS, ("tools", 0, "name")), (RTOOLS, ("tool_choice",)), (RTOOLS, ("tool_choice", "name")),
    (RESPONSE, ("metadata",)), (RESPONSE, ("metadata", "k")), (RESPONSE, ("max_output_tokens",)),
    (RESPONSE, ("temperature",)), (RESPONSE, ("top_p",)), (RESPONSE, ("instructions",)),
    (RESPONSE, ("previous_response_id",)), (RESPONSE, ("store",)), (RESPONSE, ("background",)),
    (RESPONSE, ("include",)), (RESPONSE, ("reasoning",)), (RESPONSE, ("stream_options",)), (RESPONSE, ("user",)),
]


def _response(raw: bytes) -> None:
    req = responses.parse(jsonbody.parse(raw, MAX_BODY))
    _chat(json.dumps(req.chat_body([])).encode())
    dumps(responses.ResponseBuilder(req, "resp_1", "m").response())
    dumps(responses.input_items_page(req.items, 20, "", "", ""))


@FUZZ
@given(case=st.sampled_from(RESPONSE_CASES), fragment=fragments)
def test_responses_fields_refuse_hostile_values_with_invalid_argument(case, fragment):
    base, path = case
    _refused_or_served(lambda: _response(splice(at(path, base), fragment)))


ENDPOINT = "/v1/chat/completions"
LINE = {"custom_id": "a", "method": "POST", "url": ENDPOINT, "body": CHAT}
LINE_PATHS = [("custom_id",), ("method",), ("url",), ("body",), ("body", "model"), ("body", "messages"),
              ("body", "stream"), ("body", "structured_outputs", "json"), ("body", "max_tokens"), ("extra",),
              ("body", "response_format", "json_schema", "schema")]


@FUZZ
@given(path=st.sampled_from(LINE_PATHS) | st.none(), fragment=fragments)
def test_batch_lines_answer_errors_per_line_never_an_exception(path, fragment):
    line = fragment.encode() if path is None else splice(at(path, LINE), fragment)
    data = line + b"\n" + json.dumps({**LINE, "custom_id": "b"}).encode()
    items, errs = batches.parse_lines(data, ENDPOINT, 100)
    assert len(items) + len(errs) >= 1 and all(e.message for e in errs)
    for item in items:  # what the batch runner does with each
        _refused_or_served(lambda: _chat(item.body))


@FUZZ
@given(path=st.sampled_from([("input_file_id",), ("endpoint",), ("completion_window",), ("metadata",),
                             ("metadata", "k"), ("output_expires_after",), ("x",)]),
       fragment=fragments)
def test_batch_create_bodies_refuse_hostile_values_with_invalid_argument(path, fragment):
    base = {"input_file_id": "file-1", "endpoint": ENDPOINT, "completion_window": "24h"}
    _refused_or_served(lambda: batches.parse_create(jsonbody.parse(splice(at(path, base), fragment), MAX_BODY)))


@FUZZ
@given(fragment=fragments)
def test_json_text_in_a_body_is_read_within_the_bodys_limits_or_refused(fragment):
    try:
        value = jsonbody.loads(fragment, "x")
    except errors.InvalidArgument as err:
        assert err.param == "x"
        return
    json.dumps(value)


@pytest.mark.parametrize("depth", [33, 1000, 60_000])
def test_a_batch_line_nested_past_the_limit_is_an_error_line_naming_it(depth):
    line = json.dumps({**LINE, "body": {**CHAT, "x": "HOLE"}}).replace('"HOLE"', "[" * depth + "]" * depth)
    items, errs = batches.parse_lines(line.encode(), ENDPOINT, 10)
    assert not items and errs[0].code == "invalid_json_line" and errs[0].line == 1
    assert f"nested more than {jsonbody.MAX_DEPTH + 1} levels deep" in errs[0].message
