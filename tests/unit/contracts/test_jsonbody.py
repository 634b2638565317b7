"""Request bodies and the JSON text inside them read within limits (gaas/contracts/jsonbody.py)."""

from __future__ import annotations

import pytest

from gaas.contracts import errors, jsonbody
from tests.hostile import nested

LIMIT = f"nested more than {jsonbody.MAX_DEPTH} levels deep"


@pytest.mark.parametrize("text", [nested(jsonbody.MAX_DEPTH + 1), nested(1000, "{"), nested(100_000),
                                  nested(100_000, "mix"), "[" * 100_000, '{"a":' * 100_000])
def test_json_text_nested_past_the_limit_is_refused_naming_the_field_and_the_limit(text):
    with pytest.raises(errors.InvalidArgument, match=f"'structured_outputs.json' is {LIMIT}") as e:
        jsonbody.loads(text, "structured_outputs.json")
    assert e.value.param == "structured_outputs.json"


def test_json_text_at_the_limit_is_read():
    assert jsonbody.loads(nested(jsonbody.MAX_DEPTH), "x") is not None
    assert jsonbody.loads('{"a": [1, 2.5, "b", null]}', "x") == {"a": [1, 2.5, "b", None]}


@pytest.mark.parametrize("text, says", [
    ("1" * 5000, "a number in the body has 5000 characters"), ("[1e999]", "out of range"),
    ("NaN", "send a finite number"), ('"\\ud800"', "not valid Unicode"), ("[1,", "not valid JSON"),
    ("", "not valid JSON"),
])
def test_json_text_held_to_the_bodys_other_limits(text, says):
    with pytest.raises(errors.InvalidArgument, match=says) as e:
        jsonbody.loads(text, "x")
    assert e.value.param == "x"


@pytest.mark.parametrize("raw", [nested(100_000).encode(), b'{"a":' + nested(jsonbody.MAX_DEPTH).encode() + b"}"])
def test_a_body_nested_past_the_limit_is_refused_naming_it(raw):
    with pytest.raises(errors.InvalidArgument, match=f"the body is {LIMIT}"):
        jsonbody.parse(raw, 1 << 20)
