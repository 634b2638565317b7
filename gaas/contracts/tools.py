"""Tool calling and structured output, as one definition for the edge and the worker: the limits
on what a request may declare, the JSON schemas that constrain a forced tool call's output, and
the ids of the calls.

A named tool choice constrains the output to the function's parameters; "required" to a JSON
array of {"name", "parameters"} whose items are the declared functions (vLLM's shape). Each
function's parameters are closed for decoding: an object (whatever the declaration forgot), no
properties beyond the declared ones unless it allows them, and every declared property present
unless it lists the required ones. So a forced call's arguments are always a JSON object with the
declared fields and types, even from a model that never learnt to call tools.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

# What one request may declare.
MAX_TOOLS = 128
MAX_TOOL_NAME = 64
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
MAX_DESCRIPTION_CHARS = 8192
# A JSON schema (a response format's or a function's parameters), as JSON text.
MAX_SCHEMA_BYTES = 64 << 10
# A regular expression or grammar.
MAX_PATTERN_CHARS = 16 << 10
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# A message's tool calls (an assistant's earlier ones, sent back).
MAX_MESSAGE_TOOL_CALLS = 128
MAX_ARGUMENTS_CHARS = 256 << 10


def for_engine(schema):
    """A JSON schema as the engine is given it. A string with minLength / maxLength gets a pattern
    of its lengths instead, whose characters are JSON's own (no quote, backslash or control
    character: a value needs no escapes). xgrammar decoded such strings from a character class that
    let control characters through unescaped, which is not JSON; the worker's backend now is
    guidance (services/worker/structured.py), which keeps them out either way: the pattern stays so
    any backend decodes the same strings."""
    if isinstance(schema, list):
        return [for_engine(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: for_engine(v) for k, v in schema.items()}
    if out.get("type") == "string" and "pattern" not in out and not {"enum", "const", "format"} & out.keys() \
            and ("minLength" in out or "maxLength" in out):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        if isinstance(lo, int) and (hi == "" or isinstance(hi, int)):
            out["pattern"] = '^[^"\\\\\\x00-\\x1f]{%d,%s}$' % (lo, hi)
    return out


def call_id() -> str:
    """A new tool call's id, as OpenAI shapes them."""
    return "call_" + secrets.token_hex(12)


def closed(parameters: dict | None) -> dict:
    """A function's parameters schema as decoding is constrained to it (see the module's text)."""
    schema = dict(parameters or {})
    if "type" not in schema and not any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref")):
        schema["type"] = "object"
    if schema.get("type") == "object":
        props = schema.get("properties")
        if not isinstance(props, dict):
            props = schema["properties"] = {}
        schema.setdefault("additionalProperties", False)
        schema.setdefault("required", sorted(props))
    return schema


def named_schema(parameters: dict | None) -> str:
    """The output schema of a named tool choice: the function's arguments."""
    return json.dumps(for_engine(closed(parameters)), separators=(",", ":"))


def required_schema(functions: list[tuple[str, dict | None]], parallel: bool) -> str:
    """The output schema of tool_choice "required": an array of calls, at least one (exactly one
    when parallel calls are off), each {"name": one of the functions, "parameters": its arguments}."""
    items, defs = [], {}
    for name, params in functions:
        params = closed(params)
        # (references are resolved from the document's root: the definitions go there)
        defs.update(params.pop("$defs", None) or {})
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return json.dumps(for_engine(schema), separators=(",", ":"))
