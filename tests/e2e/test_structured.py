"""Structured output and tool calls through the ingress, driven by the official `openai` client
unmodified: the engine constrains decoding, so even the random tiny model answers with output that
validates against the schema it was given. Uses the shared mesh of the session."""

from __future__ import annotations

from functools import partial
import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.meshutil import http, openai_client

pytestmark = pytest.mark.mesh

MODEL = "gaas-tiny"


client = partial(openai_client, timeout=120)


class Person(pydantic.BaseModel):
    """Fields whose values end: a random model stops a free string only by chance."""

    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=130)
    role: Literal["admin", "user", "guest"]
    active: bool


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}}},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_parse_with_a_pydantic_model_validates(mesh):
    r = client(mesh).chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], response_format=Person,
        max_tokens=200)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person), r.choices[0].message.content
    # Decoded without free whitespace: compact JSON, its fields in the model's order. Only what lies
    # outside the strings is compared: inside them the random model may write a character raw or as
    # its escape (DEL as itself or as \u007f), both valid JSON.
    content = r.choices[0].message.content
    assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', content)), content
    assert list(json.loads(content)) == list(Person.model_fields)


def test_json_schema_streamed_on_completions_validates(mesh):
    schema = Person.model_json_schema()
    text = "".join(c.choices[0].text for c in client(mesh).completions.create(
        model=MODEL, prompt="A person:", max_tokens=200, stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
        if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_vllm_structured_outputs_regex_choice_grammar(mesh):
    c = client(mesh)
    r = c.completions.create(model=MODEL, prompt="A code:", max_tokens=20,
                             extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{3}"}})
    # ([0-9], not \d: the engine's grammar takes \d as any Unicode digit, newer ones than Python's re knows.)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", r.choices[0].text)
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10,
                                  extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=10,
                             extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert r.choices[0].text in ("yes", "no")
    # Any object: its keys are free strings, which a random model ends only by chance (within the
    # tokens it has, the answer is a whole object; else it was cut at max_tokens).
    r = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=300, response_format={"type": "json_object"})
    content = r.choices[0].message.content
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_a_schema_the_engine_cannot_compile_is_a_400_that_says_why(mesh):
    with pytest.raises(openai.BadRequestError) as err:
        client(mesh).chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    assert "foo" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client(mesh).completions.create(model=MODEL, prompt="x", max_tokens=5,
                                        extra_body={"structured_outputs": {"regex": "(("}})
    assert "regex" in err.value.message.lower()


def _arguments_valid(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_named_tool_choice_gives_an_object_of_the_declared_fields(mesh):
    r = client(mesh).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # (a named call ends as "stop", as on vLLM and OpenAI)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = _arguments_valid(call, WEATHER)
    # Every declared field is there (the closed schema requires what the declaration lists, here all).
    assert {"city", "unit"} <= set(args)


def test_named_tool_choice_streamed_in_openai_deltas(mesh):
    stream = client(mesh).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=200, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    pieces = [d for c in stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].index == 0
    assert all(p.index == 0 and not p.id for p in pieces[1:])
    args = json.loads("".join(p.function.arguments or "" for p in pieces))
    jsonschema.validate(args, WEATHER["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_declared_functions(mesh, stream):
    c = client(mesh)
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=300, tool_choice="required",
                  parallel_tool_calls=False)
    if not stream:
        r = c.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        calls = r.choices[0].message.tool_calls
    else:
        chunks = list(c.chat.completions.create(**kwargs, stream=True))
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert finish == ["tool_calls"]
        calls = [d for ch in chunks if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1  # parallel_tool_calls false: one call
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
    _arguments_valid(calls[0], tool)


def test_auto_tool_choice_and_a_conversation_with_tool_results(mesh):
    c = client(mesh)
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8)
    # The random model calls nothing (its text has no <tool_call>): content, finish as usual.
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = c.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=8)
    assert r.usage.prompt_tokens > 0 and r.choices[0].message.role == "assistant"
    # The chat template rendered the call and its result: the prompt holds them.
    status, body = http(mesh, "/tokenize", json.dumps({"model": MODEL, "messages": ASK}).encode())
    assert status == 200 and r.usage.prompt_tokens > json.loads(body)["count"] + 20


def test_tool_errors_are_400s_in_openai_shape(mesh):
    c = client(mesh)
    cases = [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not one of"),
        (dict(tool_choice="required"), "needs 'tools'"),
        (dict(tools=[{"type": "retrieval"}]), "must be \"function\""),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "constrains the output"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **kwargs)
        assert message in err.value.message, (kwargs, err.value.message)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_reads_calls_with_the_models_tool_parser(mesh, stream):
    """The model's output made a Hermes call (here by constraining it to one: a random model never
    writes one itself); the hermes parser configured for gaas-tiny reads it into tool_calls."""
    said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=100,
                  extra_body={"structured_outputs": {"choice": [said]}})
    c = client(mesh)
    if not stream:
        r = c.chat.completions.create(**kwargs)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    else:
        chunks = [ch for ch in c.chat.completions.create(**kwargs, stream=True) if ch.choices]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert not "".join(ch.choices[0].delta.content or "" for ch in chunks).strip()
        pieces = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert pieces[0].id and all(p.index == 0 for p in pieces)
        name, arguments = pieces[0].function.name, "".join(p.function.arguments or "" for p in pieces)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
