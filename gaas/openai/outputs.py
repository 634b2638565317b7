"""Structured output and tools in an OpenAI request body, read strictly into the engine request's
fields (gaas.v1 StructuredOutput, Tool, ToolCalling): response_format (json_schema, json_object,
text), vLLM's structured_outputs extension (json, regex, choice, grammar, json_object), tools,
tool_choice and parallel_tool_calls, and the tool calls of the messages sent back. Pure
functions; failures are InvalidArgument naming the field.

What a schema or grammar means is the engine's to say: one it cannot compile is refused by the
worker, before any token, with the engine's reason."""

from __future__ import annotations

import json

from gaas.contracts import tools as tool_contract
from gaas.contracts.errors import InvalidArgument, quote
from gaas.contracts import jsonbody
from gaas.contracts.jsonbody import Fields, type_name
from gaas.v1 import common_pb2, inference_pb2

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_text(value, name: str, engine: bool = False) -> str:
    """A JSON schema given as an object (or as JSON text, which vLLM's extension accepts); engine:
    as the engine decodes it (gaas.contracts.tools.for_engine)."""
    if isinstance(value, str):
        if len(value) > tool_contract.MAX_SCHEMA_BYTES:
            raise InvalidArgument(f"'{name}' is {len(value):,} characters; at most {tool_contract.MAX_SCHEMA_BYTES:,} "
                                  "are accepted", param=name)
        value = jsonbody.loads(value, name)
    if not isinstance(value, (dict, bool)):
        raise InvalidArgument(f"'{name}' must be a JSON schema (an object), not {type_name(value)}", param=name)
    text = json.dumps(tool_contract.for_engine(value) if engine else value, separators=(",", ":"))
    if len(text) > tool_contract.MAX_SCHEMA_BYTES:
        raise InvalidArgument(f"'{name}' is {len(text):,} bytes as JSON; at most {tool_contract.MAX_SCHEMA_BYTES:,} "
                              "are accepted", param=name)
    return text


def _response_format(f: Fields) -> common_pb2.StructuredOutput | None:
    rf = f.object("response_format")
    if rf is None:
        return None
    kind = rf.string("type", 32)
    if kind == "text":
        rf.finish()
        return None
    if kind == "json_object":
        rf.finish()
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        js = rf.object("json_schema")
        if js is None:
            raise rf.fail("json_schema", "is required with type json_schema: {\"name\", \"schema\", \"strict\"}")
        js.string("name", tool_contract.MAX_TOOL_NAME)
        js.string("description", tool_contract.MAX_DESCRIPTION_CHARS)
        js.boolean("strict")
        schema = js.raw("schema")
        js.finish()
        rf.finish()
        if schema is None:
            return common_pb2.StructuredOutput(json_object=True)
        return common_pb2.StructuredOutput(json_schema=_schema_text(schema, "response_format.json_schema.schema", engine=True))
    raise rf.fail("type", f"must be text, json_object or json_schema, got {quote(kind)}")


def _extension(f: Fields) -> common_pb2.StructuredOutput | None:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    so = f.object("structured_outputs")
    if so is None:
        return None
    given = [k for k in _KINDS if so.body.get(k) is not None]
    if len(given) != 1:
        raise f.fail("structured_outputs", "must set exactly one of json, regex, choice, grammar and json_object"
                     + (f" (it sets {', '.join(given)})" if given else ""))
    out = common_pb2.StructuredOutput()
    kind = given[0]
    if kind == "json":
        out.json_schema = _schema_text(so.raw("json"), "structured_outputs.json", engine=True)
    elif kind == "json_object":
        if not so.boolean("json_object"):
            raise so.fail("json_object", "must be true when it is the only constraint")
        out.json_object = True
    elif kind == "choice":
        choices = so.str_list("choice", tool_contract.MAX_CHOICES, tool_contract.MAX_CHOICE_CHARS)
        out.choice.choices.extend(choices or [])
    else:
        out.MergeFrom(common_pb2.StructuredOutput(**{kind: so.string(kind, tool_contract.MAX_PATTERN_CHARS,
                                                                      empty_ok=False)}))
    for name, what in (("disable_any_whitespace", "GaaS always decodes JSON without free whitespace"),
                       ("disable_additional_properties", "declare additionalProperties in the schema"),
                       ("whitespace_pattern", "GaaS always decodes JSON without free whitespace"),
                       ("structural_tag", "no structural tags")):
        so.only_default(name, lambda v: v is False, what)
    so.finish()
    return out


def structured_output(f: Fields) -> common_pb2.StructuredOutput | None:
    """The request's output constraint from response_format or structured_outputs (not both)."""
    fmt, ext = _response_format(f), _extension(f)
    if fmt is not None and ext is not None:
        raise f.fail("structured_outputs", "and response_format both constrain the output: set one")
    return fmt or ext


def _function(raw, i: int) -> inference_pb2.Tool:
    name = f"tools[{i}]"
    if not isinstance(raw, dict):
        raise InvalidArgument(f"'{name}' must be an object {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
    t = Fields(raw, prefix=f"{name}.")
    kind = t.string("type", 32)
    if kind != "function":
        raise t.fail("type", f"must be \"function\" (the only kind of tool this server calls), got {quote(kind)}")
    fn = t.object("function")
    if fn is None:
        raise t.fail("function", "is required: {\"name\", \"description\", \"parameters\"}")
    fname = fn.string("name", tool_contract.MAX_TOOL_NAME)
    if not fname or not tool_contract.TOOL_NAME.match(fname):
        raise fn.fail("name", "must be 1 to 64 letters, digits, _ . : or -")
    tool = inference_pb2.Tool(name=fname, description=fn.string("description", tool_contract.MAX_DESCRIPTION_CHARS) or "")
    if (params := fn.raw("parameters")) is not None:
        if not isinstance(params, dict):
            raise fn.fail("parameters", f"must be a JSON schema (an object), not {type_name(params)}")
        tool.parameters = _schema_text(params, f"{name}.function.parameters")
    fn.boolean("strict")  # (every forced call is decoded strictly)
    fn.finish()
    t.finish()
    return tool


def _named(choice: dict, names: set[str]) -> str:
    c = Fields(choice, prefix="tool_choice.")
    if c.string("type", 32) != "function":
        raise c.fail("type", "must be \"function\"")
    fn = c.object("function")
    name = fn.string("name", tool_contract.MAX_TOOL_NAME) if fn is not None else None
    if not name:
        raise InvalidArgument("'tool_choice.function.name' is required: the function to call", param="tool_choice")
    fn.finish()
    c.finish()
    if name not in names:
        raise InvalidArgument(f"'tool_choice' names {quote(name)}, which is not one of the request's tools",
                              param="tool_choice")
    return name


def tools(f: Fields, req: inference_pb2.GenerateRequest, streamed: bool) -> None:
    """tools, tool_choice and parallel_tool_calls onto req: its tools (for the chat template), how
    the worker reads calls out of the output, and, for a forced call, the output's schema."""
    raw = f.raw("tools")
    choice = f.raw("tool_choice")
    parallel = f.boolean("parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise InvalidArgument("'tool_choice' needs 'tools': the functions the model may call", param="tool_choice")
        return
    if not isinstance(raw, list):
        raise f.fail("tools", f"must be an array of tools, not {type_name(raw)}")
    if len(raw) > tool_contract.MAX_TOOLS:
        raise f.fail("tools", f"holds {len(raw)} tools; at most {tool_contract.MAX_TOOLS} are accepted")
    declared = [_function(t, i) for i, t in enumerate(raw)]
    names = {t.name for t in declared}
    if len(names) != len(declared):
        raise f.fail("tools", "declares a function name twice")
    req.tools.extend(declared)
    calling = req.tool_calling
    calling.whole = not streamed
    if choice is None or choice == "auto":
        calling.mode = inference_pb2.ToolCalling.MODE_AUTO
    elif choice == "none":
        calling.mode = inference_pb2.ToolCalling.MODE_NONE
    elif choice == "required":
        calling.mode = inference_pb2.ToolCalling.MODE_REQUIRED
        functions = [(t.name, json.loads(t.parameters) if t.parameters else None) for t in declared]
        _constrain(req, tool_contract.required_schema(functions, parallel is not False))
    elif isinstance(choice, dict):
        name = _named(choice, names)
        calling.mode, calling.name = inference_pb2.ToolCalling.MODE_NAMED, name
        params = next(t.parameters for t in declared if t.name == name)
        _constrain(req, tool_contract.named_schema(json.loads(params) if params else None))
    else:
        raise InvalidArgument("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")


def _constrain(req: inference_pb2.GenerateRequest, schema: str) -> None:
    if req.HasField("structured_output"):
        raise InvalidArgument("a forced tool call ('tool_choice' \"required\" or a named function) constrains the "
                              "output itself: leave response_format and structured_outputs out", param="tool_choice")
    req.structured_output.json_schema = schema


def message_tool_calls(m: Fields, i: int) -> list[common_pb2.ToolCall]:
    """An assistant message's tool_calls, as the client sends its earlier calls back."""
    raw = m.raw("tool_calls")
    if raw is None or raw == []:
        return []
    name = f"messages[{i}].tool_calls"
    if not isinstance(raw, list):
        raise InvalidArgument(f"'{name}' must be an array of tool calls", param="messages")
    if len(raw) > tool_contract.MAX_MESSAGE_TOOL_CALLS:
        raise InvalidArgument(f"'{name}' holds {len(raw)} calls; at most {tool_contract.MAX_MESSAGE_TOOL_CALLS}",
                              param="messages")
    out = []
    for j, call in enumerate(raw):
        if not isinstance(call, dict):
            raise InvalidArgument(f"'{name}[{j}]' must be an object {{id, type, function}}", param="messages")
        c = Fields(call, prefix=f"{name}[{j}].")
        call_id = c.string("id", 256) or ""
        if c.string("type", 32) not in (None, "function"):
            raise c.fail("type", "must be \"function\"")
        fn = c.object("function")
        if fn is None:
            raise c.fail("function", "is required: {\"name\", \"arguments\"}")
        fname = fn.string("name", tool_contract.MAX_TOOL_NAME, empty_ok=False)
        if fname is None:
            raise fn.fail("name", "is required")
        args = fn.string("arguments", tool_contract.MAX_ARGUMENTS_CHARS) or ""
        fn.finish()
        c.finish()
        out.append(common_pb2.ToolCall(index=j, id=call_id, name=fname, arguments=args))
    return out
