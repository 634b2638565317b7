"""Hostile JSON for fuzzing the request parsers: values a client can send that a well-formed
generator never makes (nesting thousands deep, numbers past every range, strings of brackets,
huge strings, lone surrogates, wrong types), written as JSON text so that nesting deeper than
Python's own json.dumps can go is still sent, and spliced into a valid body at a field's place."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Where a fragment goes in a template body: a string value equal to HOLE.
HOLE = "\x00hole\x00"


def nested(depth: int, kind: str = "[") -> str:
    """JSON text nested depth deep: arrays ("["), objects ('{"a":'), or both in turn ("mix")."""
    if kind == "[":
        return "[" * depth + "]" * depth
    if kind == "{":
        return '{"a":' * depth + "1" + "}" * depth
    opens = "".join("[" if i % 2 else '{"a":' for i in range(depth))
    closes = "".join("]" if i % 2 else "}" for i in reversed(range(depth)))
    return opens + "0" + closes


_plain = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False,
                      allow_infinity=False) | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                   max_size=3),
                      max_leaves=8).map(json.dumps)

_depths = st.sampled_from([31, 32, 33, 34, 100, 999, 1000, 1500, 5000, 60_000])

# Fragments of JSON text.
fragments = st.one_of(
    _plain,
    st.builds(nested, _depths, st.sampled_from(["[", "{", "mix"])),
    # nesting as a string (a schema or arguments given as JSON text)
    st.builds(lambda d, k: json.dumps(nested(d, k)), _depths, st.sampled_from(["[", "{", "mix"])),
    st.builds(lambda n: json.dumps("[" * n), st.integers(1, 100_000)),
    # numbers past every range
    st.sampled_from(["1" * 39, "1" * 41, "1" * 5000, "-" + "9" * 30, "1e308", "1e309", "-1e400", "1" * 45 + ".5",
                     "1e-400", "4294967296", "9223372036854775808", "-9223372036854775809", "NaN", "Infinity",
                     "-Infinity", "0.0", "-0", "1.5", "3e0"]),
    # strings: long, empty, odd
    st.builds(lambda n: json.dumps("x" * n), st.sampled_from([0, 1, 64, 65, 129, 513, 65_537, 300_000])),
    st.sampled_from(['"\\ud800"', '"a\\udfffb"', '"\\u0000"', '"\\"}]"', '"  "', '"\\n"', '"1"', '"true"', '"{}"',
                     '"[]"', '"null"']),
    # wrong types
    st.sampled_from(["null", "true", "false", "[]", "{}", "[null]", '[""]', '[{}]', '{"": null}', "[[]]",
                     '{"type": 5}', '{"type": "function"}', '{"type": []}']),
)


def splice(template: Any, fragment: str) -> bytes:
    """template as JSON text, its HOLE replaced by fragment (JSON text)."""
    return json.dumps(template).replace(json.dumps(HOLE), fragment, 1).encode()


def at(path: tuple, base: dict | None = None) -> dict:
    """A copy of base (or {}) with HOLE at path (keys and list indices), creating what is missing."""
    doc = json.loads(json.dumps(base or {}))
    node: Any = doc
    for key, nxt in zip(path, path[1:]):
        if isinstance(key, int):
            while len(node) <= key:
                node.append({} if not isinstance(nxt, int) else [])
        elif key not in node or not isinstance(node[key], (dict, list)):
            node[key] = [] if isinstance(nxt, int) else {}
        node = node[key]
    last = path[-1]
    if isinstance(last, int):
        while len(node) <= last:
            node.append(None)
    node[last] = HOLE
    return doc
