"""Request bodies of the HTTP API: JSON parsed within limits, and a reader of their fields that
checks each one's type and range before it meets protobuf. Every failure is an InvalidArgument
naming the field (OpenAI's "param"), never a server error:

  - the body: at most max_bytes, UTF-8, a JSON object;
  - nesting at most MAX_DEPTH deep; numbers at most MAX_NUMBER_CHARS characters and finite (no
    NaN / Infinity); strings valid Unicode (a lone surrogate such as "\\ud800" is refused);
  - integers within the range of the field they fill; strings that are echoed capped.

A JSON value sent as text inside a body (a schema as a string, a tool call's arguments, a batch
file's line) is held to the same limits by loads(), before anything walks it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from gaas.contracts.errors import InvalidArgument, quote

MAX_DEPTH = 32
MAX_NUMBER_CHARS = 40
UINT32_MAX = 2**32 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def is_digits(text: str) -> bool:
    """Whether text is a non-empty run of ASCII digits 0-9 (str.isdigit also takes "²" and other
    Unicode digits, which int() refuses)."""
    return text.isascii() and text.isdigit()


def _number_limit(text: str) -> None:
    if len(text) > MAX_NUMBER_CHARS:
        raise InvalidArgument(f"a number in the body has {len(text)} characters; at most {MAX_NUMBER_CHARS} are accepted")


def _parse_int(text: str) -> int:
    _number_limit(text)
    return int(text)


def _parse_float(text: str) -> float:
    _number_limit(text)
    value = float(text)
    if not math.isfinite(value):
        raise InvalidArgument(f"the number {text} is out of range")
    return value


def _parse_constant(name: str):
    raise InvalidArgument(f"{name} is not valid JSON: send a finite number")


def type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _check_tree(body: Any, what: str = "the body", max_depth: int = MAX_DEPTH, param: str | None = None) -> None:
    """Depth and string validity of a parsed body, iteratively (no recursion to exhaust)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgument(
                    f"{what} holds a string that is not valid Unicode (a lone surrogate escape such as \\ud800)",
                    param=param) from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise InvalidArgument(_too_deep(what, max_depth), param=param)
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, depth))
                stack.append((v, depth + 1))
        else:
            stack.extend((v, depth + 1) for v in value)


def _too_deep(what: str, max_depth: int) -> str:
    return f"{what} is nested more than {max_depth} levels deep (the limit of JSON nesting)"


def loads(text: str, name: str, max_depth: int = MAX_DEPTH) -> Any:
    """A JSON value sent as text inside a request, held to a body's limits (nesting at most
    max_depth deep, numbers, strings), or InvalidArgument(param=name) saying what is wrong. The
    depth is known before anything walks the value: the decoder's own recursion is caught too."""
    what = f"'{name}'"
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        raise InvalidArgument(_too_deep(what, max_depth), param=name) from None
    except InvalidArgument as exc:
        raise InvalidArgument(f"{what}: {exc.message}", param=name) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
                              param=name) from None
    except ValueError as exc:  # (an integer past the interpreter's digit limit)
        raise InvalidArgument(f"{what} is not valid JSON: {exc}", param=name) from None
    _check_tree(value, what, max_depth, name)
    return value


def parse(raw: bytes, max_bytes: int) -> dict:
    """The JSON object of a request body, or InvalidArgument saying what is wrong with it."""
    if len(raw) > max_bytes:
        raise InvalidArgument(f"the request body is {len(raw)} bytes; the limit is {max_bytes} bytes")
    if not raw.strip():
        raise InvalidArgument("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidArgument("the request body is not UTF-8 text") from None
    try:
        body = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        raise InvalidArgument(_too_deep("the body", MAX_DEPTH)) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"the request body must be a JSON object, not {type_name(body)}")
    _check_tree(body)
    return body


class Fields:
    """Typed access to a body's fields. Each getter returns None for an absent (or null) field and
    raises InvalidArgument(param=name) for a wrong one; finish() refuses what nobody asked for."""

    def __init__(self, body: dict, prefix: str = "") -> None:
        self.body = body
        self._prefix = prefix
        self._seen: set[str] = set()

    def _name(self, name: str) -> str:
        return f"{self._prefix}{name}"

    def fail(self, name: str, message: str) -> InvalidArgument:
        return InvalidArgument(f"'{self._name(name)}' {message}", param=self._name(name))

    def raw(self, name: str) -> Any:
        self._seen.add(name)
        return self.body.get(name)

    def integer(self, name: str, lo: int, hi: int) -> int | None:
        value = self.raw(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer() and lo <= value <= hi:
            value = int(value)  # 16.0 is 16, as pydantic (vLLM's parser) reads it
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(name, f"must be an integer, not {type_name(value)}")
        if not lo <= value <= hi:
            raise self.fail(name, f"must be between {lo} and {hi}, got {quote(value)}")
        return value

    def number(self, name: str, lo: float, hi: float) -> float | None:
        value = self.raw(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(name, f"must be a number, not {type_name(value)}")
        if not lo <= value <= hi:
            raise self.fail(name, f"must be between {lo:g} and {hi:g}, got {quote(value)}")
        return float(value)

    def boolean(self, name: str) -> bool | None:
        value = self.raw(name)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, not {type_name(value)}")
        return value

    def string(self, name: str, max_chars: int, *, empty_ok: bool = True) -> str | None:
        value = self.raw(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(name, f"must be a string, not {type_name(value)}")
        if len(value) > max_chars:
            raise self.fail(name, f"is {len(value)} characters; at most {max_chars} are accepted")
        if not value and not empty_ok:
            raise self.fail(name, "must not be empty")
        return value

    def int_list(self, name: str, lo: int, hi: int, max_items: int) -> list[int] | None:
        value = self.raw(name)
        if value is None:
            return None
        return int_items(value, self._name(name), lo, hi, max_items)

    def str_list(self, name: str, max_items: int, max_chars: int, *, single_ok: bool = False) -> list[str] | None:
        value = self.raw(name)
        if value is None:
            return None
        if single_ok and isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(name, "must be a string or an array of strings" if single_ok else "must be an array of strings")
        if len(value) > max_items:
            raise self.fail(name, f"holds {len(value)} entries; at most {max_items} are accepted")
        for v in value:
            if not v or len(v) > max_chars:
                raise self.fail(name, f"entries must be 1 to {max_chars} characters")
        return value

    def object(self, name: str) -> "Fields | None":
        value = self.raw(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(name, f"must be an object, not {type_name(value)}")
        return Fields(value, prefix=f"{self._name(name)}.")

    def only_default(self, name: str, accepted: Callable[[Any], bool], what: str) -> None:
        """A field vLLM knows that GaaS cannot honour: accepted at its default, refused otherwise."""
        value = self.raw(name)
        if value is not None and not accepted(value):
            raise self.fail(name, f"is not supported by this server ({what}); leave it out")

    def finish(self) -> None:
        unknown = sorted(set(self.body) - self._seen)
        if unknown:
            names = ", ".join(quote(self._name(u), 40) for u in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise InvalidArgument(f"unknown field(s) {names}{more}", param=self._name(unknown[0])[:64])


def int_items(value: Any, name: str, lo: int, hi: int, max_items: int) -> list[int]:
    """value as a list of integers within [lo, hi], or InvalidArgument naming name[i]."""
    if not isinstance(value, list):
        raise InvalidArgument(f"'{name}' must be an array of integers, not {type_name(value)}", param=name)
    if len(value) > max_items:
        raise InvalidArgument(f"'{name}' holds {len(value)} entries; at most {max_items} are accepted", param=name)
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgument(f"'{name}[{i}]' must be an integer, not {type_name(v)}", param=name)
        if not lo <= v <= hi:
            raise InvalidArgument(f"'{name}[{i}]' must be between {lo} and {hi}, got {quote(v)}", param=name)
    return value
