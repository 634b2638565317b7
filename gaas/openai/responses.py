"""OpenAI's Responses API over GaaS's chat: a request body read strictly into the Chat Completions
body it means (so one parser checks every field of both: gaas.openai.api.parse_chat), and a
generation's chunks formatted as a Response object or as its stream of events, in OpenAI's order:
response.created, response.in_progress, then per output item (the message's text, each function
call) output_item.added, content_part.added / output_text.delta... / output_text.done /
content_part.done (or function_call_arguments.delta... / .done), output_item.done, and last
response.completed (its response's status "incomplete" when max_output_tokens cut it, as vLLM's
server says it: the openai client's stream helper waits for response.completed).

A stored response keeps its conversation (the chat messages that continue it: the ones before it,
its input, its output) for previous_response_id; instructions are not carried over, as on OpenAI.
Pure: no I/O, no gRPC; failures are InvalidArgument naming the field."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from gaas.contracts import genrequest, jsonbody
from gaas.contracts.errors import InvalidArgument, quote
from gaas.contracts.jsonbody import Fields, type_name
from gaas.openai.stream import dumps
from gaas.v1 import common_pb2

MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_INPUT_ITEMS = genrequest.MAX_MESSAGES
ROLES = ("user", "system", "developer", "assistant")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ResponsesRequest:
    """A Responses request read: the chat body it means without the conversation before it
    (chat_body adds that), and what the Response object echoes."""

    chat: dict
    # The input as items, each with an id (what input_items lists), and as chat messages.
    items: list[dict]
    messages: list[dict]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    echo: dict = field(default_factory=dict)
    # Run after the answer (status in_progress), fetched with GET /v1/responses/{id} and cancellable.
    background: bool = False

    def chat_body(self, before: list[dict]) -> dict:
        """The Chat Completions body: the instructions as the first system message, the stored
        conversation before (previous_response_id's), then this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return {**self.chat, "messages": system + before + self.messages}


def _text(content: Any, name: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or parts of the given kinds joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"'{name}' must be a string or an array of content parts", param="input")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            raise InvalidArgument(f"'{name}[{j}]' must be a text part ({' or '.join(kinds)}): this server takes no "
                                  "images, audio or files", param="input")
        out.append(part["text"])
    return "".join(out)


def _input(raw: Any) -> tuple[list[dict], list[dict]]:
    """(items with ids, chat messages) of the input."""
    if isinstance(raw, str):
        item = {"id": _item_id("msg"), "type": "message", "role": "user", "status": "completed",
                "content": [{"type": "input_text", "text": raw}]}
        return [item], [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise InvalidArgument("'input' is required: a string, or a non-empty array of input items", param="input")
    if len(raw) > MAX_INPUT_ITEMS:
        raise InvalidArgument(f"'input' holds {len(raw)} items; at most {MAX_INPUT_ITEMS} are accepted", param="input")
    items, messages = [], []
    for i, it in enumerate(raw):
        name = f"input[{i}]"
        if not isinstance(it, dict):
            raise InvalidArgument(f"'{name}' must be an object (a message or a function call item)", param="input")
        f = Fields(it, prefix=f"{name}.")
        kind = f.string("type", 32) or "message"
        given_id = f.string("id", 128)
        f.string("status", 32)
        if kind == "message":
            role = f.raw("role")
            if role not in ROLES:
                raise InvalidArgument(f"'{name}.role' must be one of {', '.join(ROLES)}, got {quote(role)}",
                                      param="input")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text(f.raw("content"), f"{name}.content", kinds)
            items.append({"id": given_id or _item_id("msg"), "type": "message", "role": role, "status": "completed",
                          "content": [{"type": kinds[0], "text": text}]})
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id = f.string("call_id", 128, empty_ok=False)
            fname = f.string("name", 64, empty_ok=False)
            args = f.string("arguments", 256 << 10)
            if call_id is None or fname is None or args is None:
                raise InvalidArgument(f"'{name}': a function_call item needs call_id, name and arguments", param="input")
            items.append({"id": given_id or _item_id("fc"), "type": "function_call", "status": "completed",
                          "call_id": call_id, "name": fname, "arguments": args})
            call = {"id": call_id, "type": "function", "function": {"name": fname, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = f.string("call_id", 128, empty_ok=False)
            output = f.raw("output")
            if call_id is None or not isinstance(output, (str, list)):
                raise InvalidArgument(f"'{name}': a function_call_output item needs call_id and output", param="input")
            text = _text(output, f"{name}.output", ("input_text",))
            items.append({"id": given_id or _item_id("fco"), "type": "function_call_output", "status": "completed",
                          "call_id": call_id, "output": text})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise InvalidArgument(f"'{name}.type' {quote(kind)} is not supported: input items are messages, "
                                  "function_call and function_call_output", param="input")
        f.finish()
    return items, messages


def _tools(raw: Any) -> list[dict] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise InvalidArgument(f"'tools' must be an array of tools, not {type_name(raw)}", param="tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidArgument(f"'tools[{i}].type' must be \"function\" (this server runs no built-in tools such "
                                  f"as web or file search), got {quote(kind)}", param="tools")
        fn = {k: v for k, v in t.items() if k != "type"}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(raw: Any):
    if isinstance(raw, dict) and raw.get("type") == "function":
        extra = set(raw) - {"type", "name"}
        if extra:
            raise InvalidArgument(f"'tool_choice' has unknown field(s) {', '.join(sorted(extra))}", param="tool_choice")
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw


def _format(f: Fields) -> dict | None:
    """text.format -> the chat's response_format."""
    text = f.object("text")
    if text is None:
        return None
    fmt = text.object("format")
    text.string("verbosity", 16)
    text.finish()
    if fmt is None:
        return None
    kind = fmt.string("type", 32)
    if kind in ("text", "json_object"):
        fmt.finish()
        return {"type": kind}
    if kind == "json_schema":
        schema = {k: fmt.raw(k) for k in ("name", "schema", "strict", "description") if fmt.raw(k) is not None}
        if isinstance(schema.get("schema"), str):  # (JSON text, read here to name this field when it is wrong)
            schema["schema"] = jsonbody.loads(schema["schema"], "text.format.schema")
        fmt.finish()
        return {"type": "json_schema", "json_schema": schema}
    raise fmt.fail("type", f"must be text, json_object or json_schema, got {quote(kind)}")


def _metadata(f: Fields) -> dict:
    meta = f.raw("metadata")
    if meta is None:
        return {}
    if not isinstance(meta, dict) or len(meta) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in meta.items()):
        raise f.fail("metadata", f"must map at most {MAX_METADATA} keys (64 characters) to strings (512 characters)")
    return meta


def parse(body: dict) -> ResponsesRequest:
    f = Fields(body)
    model = f.string("model", genrequest.MAX_MODEL_NAME)
    if not model:
        raise InvalidArgument("'model' is required: the name of a model (GET /v1/models lists them)", param="model")
    items, messages = _input(f.raw("input"))
    instructions = f.string("instructions", genrequest.MAX_PROMPT_CHARS)
    previous = f.string("previous_response_id", 128, empty_ok=False)
    store = f.boolean("store")
    stream = bool(f.boolean("stream"))
    chat: dict[str, Any] = {"model": model, "stream": stream}
    if (most := f.raw("max_output_tokens")) is not None:
        chat["max_completion_tokens"] = most
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if (value := f.raw(name)) is not None:
            chat[name] = value
    if stream:
        chat["stream_options"] = {"include_usage": True}
    tools = _tools(f.raw("tools"))
    if tools is not None:
        chat["tools"] = tools
    if (choice := f.raw("tool_choice")) is not None:
        chat["tool_choice"] = _tool_choice(choice)
    if (fmt := _format(f)) is not None:
        chat["response_format"] = fmt
    metadata = _metadata(f)
    f.string("safety_identifier", 64)
    f.string("prompt_cache_key", 64)
    f.only_default("truncation", lambda v: v == "disabled", "a conversation longer than the model's window is refused, "
                   "never cut")
    background = bool(f.boolean("background"))
    if background and stream:
        raise f.fail("background", "and stream both set: stream a response, or run it in the background and fetch it")
    if background and store is False:
        raise f.fail("background", "needs \"store\": true (a background response is fetched from the store)")
    f.only_default("include", lambda v: v == [], "nothing more to include")
    f.only_default("reasoning", lambda v: v == {} or v == {"effort": None}, "no reasoning control")
    f.only_default("service_tier", lambda v: v in ("auto", "default"), "a tenant's tier sets its service")
    f.only_default("top_logprobs", lambda v: v == 0, "no logprobs in responses")
    f.only_default("max_tool_calls", lambda v: False, "no built-in tools")
    f.only_default("conversation", lambda v: False, "continue a response with previous_response_id")
    f.only_default("prompt", lambda v: False, "no stored prompts")
    if (opts := f.object("stream_options")) is not None:
        opts.boolean("include_obfuscation")
        opts.finish()
    f.finish()
    echo = {
        "instructions": instructions, "max_output_tokens": most, "metadata": metadata,
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "previous_response_id": previous,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "text": {"format": fmt or {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "user": body.get("user"), "truncation": "disabled",
        "store": store is not False, "background": background, "reasoning": None, "service_tier": "default",
    }
    if fmt is not None and fmt["type"] == "json_schema":
        echo["text"] = {"format": {"type": "json_schema", **fmt["json_schema"]}}
    return ResponsesRequest(chat, items, messages, instructions, previous, store is not False, stream, echo, background)


# ------------------------------------------------------------------ the answer


def sse_event(obj: dict) -> bytes:
    return b"event: " + obj["type"].encode() + b"\ndata: " + dumps(obj) + b"\n\n"


def usage(u: dict) -> dict:
    """Chat usage -> the Responses API's."""
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


class ResponseBuilder:
    """A response's output items from its chunks (content and tool-call pieces), with the events
    that stream them (stream=True) in OpenAI's order."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.id = response_id
        self.created = int(time.time())
        self.model = model
        self._echo = req.echo
        self._stream = req.stream
        self._seq = 0
        self.output: list[dict] = []
        # The open message item (its index in output), and each open function call's by call index.
        self._message: int | None = None
        self._calls: dict[int, int] = {}
        self.status = "in_progress"
        self.incomplete: dict | None = None
        self.usage: dict | None = None

    def response(self) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "error": None, "incomplete_details": self.incomplete, "model": self.model, "output": self.output,
                "usage": self.usage, **self._echo}

    def _event(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse_event(obj)

    def start(self) -> list[bytes]:
        if not self._stream:
            return []
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def add(self, c: common_pb2.GenerateChunk) -> list[bytes]:
        """A chunk's text and tool-call pieces (the events, when streaming)."""
        out: list[bytes] = []
        if c.text:
            out += self._text(c.text)
        for piece in c.tool_calls:
            out += self._call(piece)
        return out

    def _text(self, text: str) -> list[bytes]:
        out = []
        if self._message is None:
            self._message = len(self.output)
            item = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            self.output.append(item)
            if self._stream:
                out.append(self._event("response.output_item.added", output_index=self._message, item=dict(item)))
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            if self._stream:
                out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._message,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        item = self.output[self._message]
        item["content"][0]["text"] += text
        if self._stream:
            out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._message,
                                   content_index=0, delta=text, logprobs=[]))
        return out

    def _close_message(self) -> list[bytes]:
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self.output[index]
        item["status"] = "completed"
        if not self._stream:
            return []
        part = item["content"][0]
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, piece: common_pb2.ToolCall) -> list[bytes]:
        out = self._close_message()
        index = self._calls.get(piece.index)
        if index is None:
            index = self._calls[piece.index] = len(self.output)
            item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": piece.id or _item_id("call"), "name": piece.name, "arguments": ""}
            self.output.append(item)
            if self._stream:
                out.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        item = self.output[index]
        item["arguments"] += piece.arguments
        if self._stream and piece.arguments:
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=piece.arguments))
        return out

    def finish(self, final: common_pb2.GenerateChunk, usage_obj: dict) -> list[bytes]:
        """The last events (the closing of each open item, then response.completed or .incomplete)."""
        out = self._close_message()
        for index in sorted(self._calls.values()):
            item = self.output[index]
            item["status"] = "completed"
            if self._stream:
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, name=item["name"], arguments=item["arguments"]))
                out.append(self._event("response.output_item.done", output_index=index, item=item))
        self._calls.clear()
        if final.finish_reason == common_pb2.FINISH_REASON_LENGTH:
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        self.usage = usage(usage_obj)
        if self._stream:
            # (response.completed whatever the status, as vLLM's server ends it: the openai client's
            # stream helper waits for that event, and the response it carries says "incomplete")
            out.append(self._event("response.completed", response=self.response()))
        return out

    def failed(self, error: dict) -> bytes:
        """The event of a stream that failed after it began (error: OpenAI's error object)."""
        self.status = "failed"
        body = self.response()
        body["error"] = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        return self._event("response.failed", response=body)

    def cancelled(self) -> None:
        """A background response cancelled: its output so far, closed."""
        self._close_message()
        for index in self._calls.values():
            self.output[index]["status"] = "incomplete"
        self._calls.clear()
        self.status = "cancelled"

    def conversation(self) -> list[dict]:
        """The output as chat messages (what a later response's conversation continues with)."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message" and i["content"])
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        message: dict = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        return [message]


def input_items_page(items: list[dict], limit: int, order: str, after: str, before: str) -> dict:
    """OpenAI's list object of a response's input items."""
    if order not in ("", "asc", "desc"):
        raise InvalidArgument(f"'order' must be asc or desc, got {quote(order)}", param="order")
    if limit > 100:
        raise InvalidArgument("'limit' must be between 1 and 100", param="limit")
    ordered = list(items) if order == "asc" else list(reversed(items))
    ids = [i["id"] for i in ordered]
    start = 0
    if after:
        if after not in ids:
            raise InvalidArgument(f"'after': no input item {quote(after)} in this response", param="after")
        start = ids.index(after) + 1
    end = len(ordered)
    if before:
        if before not in ids:
            raise InvalidArgument(f"'before': no input item {quote(before)} in this response", param="before")
        end = ids.index(before)
    page = ordered[start:end][: limit or 20]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}
