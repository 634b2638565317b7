"""Tool calls read out of a chat's output on the worker (services/worker/toolcalls.py)."""

from __future__ import annotations

import json

from hypothesis import given, settings, strategies as st

from gaas.v1 import common_pb2, inference_pb2
from services.worker import toolcalls

Mode = inference_pb2.ToolCalling


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def _run(readers: toolcalls.ChoiceReaders, pieces: list[str], index: int = 0) -> tuple[str, list]:
    content, calls = "", []
    for i, piece in enumerate(pieces):
        chunk = common_pb2.GenerateChunk(text=piece, index=index)
        if i == len(pieces) - 1:
            chunk.finish_reason = common_pb2.FINISH_REASON_STOP
        readers.rewrite(chunk)
        content += chunk.text
        calls.extend(chunk.tool_calls)
    return content, calls


def _assembled(calls) -> list[dict]:
    out: dict[int, dict] = {}
    for c in calls:
        call = out.setdefault(c.index, {"id": c.id, "name": c.name, "arguments": ""})
        call["arguments"] += c.arguments
    return [out[i] for i in sorted(out)]


_args = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=8), st.booleans(),
                                                      st.lists(st.integers(), max_size=3)), max_size=4)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]), _args), min_size=1, max_size=4),
       cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_required_calls_are_the_same_however_the_output_is_cut(calls, cuts):
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], separators=(",", ":"))
    content, pieces = _run(toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_REQUIRED), None), _split(text, cuts))
    got = _assembled(pieces)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == [(n, a) for n, a in calls]
    assert all(c["id"].startswith("call_") for c in got) and len({c["id"] for c in got}) == len(got)


def test_a_required_call_cut_short_is_no_call():
    content, pieces = _run(toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_REQUIRED), None),
                           ['[{"name":"f","parameters":{"a":1}},', '{"name":"g","param'])
    assert [c.name for c in pieces] == ["f"]


@settings(max_examples=100, deadline=None)
@given(args=_args, cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8))
def test_named_arguments_stream_as_one_call(args, cuts):
    text = json.dumps(args)
    content, pieces = _run(toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_NAMED, name="f"), None),
                           _split(text, cuts))
    (call,) = _assembled(pieces)
    assert content == "" and call["name"] == "f" and json.loads(call["arguments"]) == args
    assert pieces[0].id and not any(p.id for p in pieces[1:])


def test_each_choice_has_its_own_reader():
    readers = toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_NAMED, name="f"), None)
    _, first = _run(readers, ['{"a":', "1}"], index=0)
    _, second = _run(readers, ['{"a":2}'], index=1)
    assert first[0].id and second[0].id and first[0].id != second[0].id


class _Parser:
    """A stand-in for vLLM's hermes parser: whole-text reading only."""

    def extract_tool_calls(self, text, request):
        from types import SimpleNamespace as NS
        if "<tool_call>" not in text:
            return NS(tools_called=False, tool_calls=[], content=text)
        body = json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0])
        fn = NS(name=body["name"], arguments=json.dumps(body["arguments"]))
        return NS(tools_called=True, tool_calls=[NS(id="", function=fn)], content=text.split("<tool_call>")[0] or None)


def test_auto_on_a_whole_answer_reads_once_at_the_end():
    readers = toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_AUTO, whole=True), lambda: (_Parser(), None))
    content, pieces = _run(readers, ["Let me look. <tool", '_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'])
    assert content == "Let me look. "
    assert [(p.name, json.loads(p.arguments)) for p in pieces] == [("f", {"x": 1})] and pieces[0].id
    content, pieces = _run(toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_AUTO, whole=True),
                                             lambda: (_Parser(), None)), ["just ", "text"])
    assert content == "just text" and not pieces


def test_auto_without_a_parser_is_refused_before_any_token():
    from services.worker.engine import NO_TOOL_PARSER, InvalidRequest

    def none():
        raise InvalidRequest(NO_TOOL_PARSER)

    try:
        toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_AUTO), none)
    except InvalidRequest as err:
        assert "tool_parser" in err.message
    else:
        raise AssertionError("no refusal")


def test_no_tools_no_readers():
    assert toolcalls.readers(inference_pb2.ToolCalling(), None) is None
    assert toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_NONE), None) is None


def test_auto_makes_one_parser_per_choice():
    made = []

    def parser():
        made.append(1)
        return _Parser(), "adjusted"

    readers = toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_AUTO, whole=True), parser)
    assert readers.adjusted == "adjusted" and len(made) == 1
    _run(readers, ["a"], index=0)
    assert len(made) == 1  # the first choice reads with the parser made to check the model has one
    _run(readers, ["b"], index=1)
    assert len(made) == 2


def test_a_required_call_nested_past_the_stack_is_no_call_and_no_crash():
    deep = "[" * 5000 + "]" * 5000
    content, pieces = _run(toolcalls.readers(inference_pb2.ToolCalling(mode=Mode.MODE_REQUIRED), None),
                           ['[{"name":"f","parameters":{"a":' + deep + '}},', '{"name":"g","parameters":{}}]'])
    assert [c.name for c in pieces] == ["g"]
