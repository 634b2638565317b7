"""Tool calls read out of a chat's output as the worker streams it (GenerateRequest.tool_calling):
each chunk's text becomes the content that is not a call, and its tool_calls the pieces of the
calls (gaas.v1 ToolCall: index, id and name on a call's first piece, arguments piece by piece).

- named function: the output, constrained to the function's parameters, is the call's arguments,
  streamed as they come;
- "required": the output, constrained to a JSON array of {"name", "parameters"}, gives each call
  whole as soon as its array item closes;
- "auto": the tool parser configured for the model (vLLM's: gaas.settings.worker tool_parser) reads
  the text, as it streams or, for an answer that is not streamed, once at the end (its whole-text
  reading, the more reliable one); until then the chunks carry no text.

One reader per choice. Pure Python but for the vLLM parser the engine hands "auto" (Engine.tool_parser).
"""

from __future__ import annotations

import json
import logging
from typing import Protocol

from gaas.contracts import tools as tool_contract
from gaas.v1 import common_pb2, inference_pb2

log = logging.getLogger(__name__)

Mode = inference_pb2.ToolCalling


class Reader(Protocol):
    def feed(self, text: str, token_ids: list[int]) -> tuple[str, list[common_pb2.ToolCall]]:
        """A chunk's text and tokens -> (its content, pieces of calls)."""

    def finish(self) -> tuple[str, list[common_pb2.ToolCall]]:
        """The choice ended: what is left of its content and calls."""


class NamedReader:
    """The output is the named function's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, list[common_pb2.ToolCall]]:
        if not text:
            return "", []
        if not self._started:
            self._started = True
            return "", [common_pb2.ToolCall(index=0, id=tool_contract.call_id(), name=self._name, arguments=text)]
        return "", [common_pb2.ToolCall(index=0, arguments=text)]

    def finish(self) -> tuple[str, list[common_pb2.ToolCall]]:
        if self._started:
            return "", []
        # (no output at all: still the one call, with empty arguments the client can see)
        return "", [common_pb2.ToolCall(index=0, id=tool_contract.call_id(), name=self._name, arguments="{}")]


class RequiredReader:
    """The output is a JSON array of {"name", "parameters"}: each item becomes a call once it closes."""

    def __init__(self) -> None:
        self._item: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._calls = 0

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, list[common_pb2.ToolCall]]:
        out = []
        for ch in text:
            if self._depth >= 2:
                self._item.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item = [ch]
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and ch == "}":
                    if (call := self._call("".join(self._item))) is not None:
                        out.append(call)
                    self._item = []
        return "", out

    def _call(self, item: str) -> common_pb2.ToolCall | None:
        try:
            value = json.loads(item)
            name, params = value["name"], value["parameters"]
            arguments = json.dumps(params, ensure_ascii=False)
        except (ValueError, KeyError, TypeError, RecursionError):  # (a schema may let output nest past the stack)
            log.warning("a required tool call's item is not {name, parameters}: %.200s", item)
            return None
        call = common_pb2.ToolCall(index=self._calls, id=tool_contract.call_id(), name=str(name),
                                   arguments=arguments)
        self._calls += 1
        return call

    def finish(self) -> tuple[str, list[common_pb2.ToolCall]]:
        return "", []


class AutoReader:
    """vLLM's tool parser for the model; parser, request: what Engine.tool_parser made."""

    def __init__(self, parser, request, whole: bool) -> None:
        self._parser = parser
        self._request = request
        self._whole = whole
        self._text = ""
        self._ids: list[int] = []
        self._done = False

    def feed(self, text: str, token_ids: list[int]) -> tuple[str, list[common_pb2.ToolCall]]:
        previous, previous_ids = self._text, self._ids
        self._text += text
        self._ids = previous_ids + list(token_ids)
        if self._whole:
            return "", []
        try:
            delta = self._parser.extract_tool_calls_streaming(previous, self._text, text, previous_ids, self._ids,
                                                               token_ids, self._request)
        except Exception:  # noqa: BLE001 - a parser's bug must not end the client's stream
            log.exception("the tool parser failed on a streamed chunk; its text goes out as content")
            return text, []
        if delta is None:
            return "", []
        return delta.content or "", [_piece(t) for t in delta.tool_calls or ()]

    def finish(self) -> tuple[str, list[common_pb2.ToolCall]]:
        if not self._whole or self._done:
            return "", []
        self._done = True
        try:
            info = self._parser.extract_tool_calls(self._text, self._request)
        except Exception:  # noqa: BLE001
            log.exception("the tool parser failed on a whole answer; its text goes out as content")
            return self._text, []
        if not info.tools_called:
            return self._text, []
        calls = [common_pb2.ToolCall(index=i, id=t.id or tool_contract.call_id(), name=t.function.name,
                                     arguments=t.function.arguments) for i, t in enumerate(info.tool_calls)]
        return info.content or "", calls


def _piece(t) -> common_pb2.ToolCall:
    fn = t.function
    return common_pb2.ToolCall(index=t.index, id=t.id or "", name=(fn.name if fn is not None else None) or "",
                               arguments=(fn.arguments if fn is not None else None) or "")


class ChoiceReaders:
    """The readers of a request's choices, rewriting its chunks in place. adjusted: for "auto",
    vLLM's request as the tool parser adjusted it (what the engine request must do for it)."""

    def __init__(self, make, adjusted=None) -> None:
        self._make = make
        self.adjusted = adjusted
        self._readers: dict[int, Reader] = {}

    def rewrite(self, chunk: common_pb2.GenerateChunk) -> None:
        reader = self._readers.get(chunk.index)
        if reader is None:
            reader = self._readers[chunk.index] = self._make()
        content, calls = reader.feed(chunk.text, list(chunk.token_ids))
        if chunk.finish_reason:
            more, last = reader.finish()
            content, calls = content + more, calls + last
        chunk.text = content
        chunk.tool_calls.extend(calls)


def readers(calling: inference_pb2.ToolCalling, auto_parser) -> ChoiceReaders | None:
    """The readers for a request's tool calling (None: its output is content). auto_parser():
    a fresh (vLLM parser, its request) for "auto" (Engine.tool_parser)."""
    if calling.mode == Mode.MODE_NAMED:
        return ChoiceReaders(lambda: NamedReader(calling.name))
    if calling.mode == Mode.MODE_REQUIRED:
        return ChoiceReaders(RequiredReader)
    if calling.mode == Mode.MODE_AUTO:
        # Made here, before any token (a model without a parser is refused now); the first choice
        # reads with it, the others with their own.
        first = [auto_parser()]
        return ChoiceReaders(lambda: AutoReader(*(first.pop() if first else auto_parser()), whole=calling.whole),
                             first[0][1])
    return None
