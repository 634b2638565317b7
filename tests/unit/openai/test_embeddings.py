"""OpenAI's embeddings API (gaas/openai/embeddings.py): inputs read as OpenAI and vLLM read them (a
string, token ids, or a list of either), every field checked with a 400 naming it, vLLM's fields GaaS
cannot honour refused by name, hostile bodies refused, never an exception; the answer in vLLM's
shape, float vectors equal to the engine's float32 values and base64 ones decoding to them as the
openai client decodes them."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gaas.contracts import edge, errors, jsonbody
from gaas.openai.embeddings import MAX_INPUTS, embeddings_json, parse_embedding, parse_pooling, vector_bytes
from tests.hostile import at, fragments, splice

BODY = {"model": "m", "input": "hello"}


@pytest.mark.parametrize("given_input, inputs", [
    ("hello", ("hello",)),
    (["a", "b"], ("a", "b")),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2], [3]], ((1, 2), (3,))),
    (["a", [7]], ("a", (7,))),
])
def test_inputs_are_read_as_openai_reads_them_one_or_a_list_of_text_or_token_ids(given_input, inputs):
    assert parse_embedding({"model": "m", "input": given_input}).inputs == inputs


def test_the_settings_a_client_may_give_are_kept():
    r = parse_embedding({**BODY, "encoding_format": "base64", "dimensions": 64, "user": "u-1",
                         "add_special_tokens": False, "priority": -3, "request_id": "mine"})
    assert (r.encoding_format, r.dimensions, r.add_special_tokens, r.priority, r.client_request_id) == \
        ("base64", 64, False, -3, "mine")
    assert parse_embedding(BODY).encoding_format == "float"


@pytest.mark.parametrize("body, param, says", [
    ({"input": "x"}, "model", "'model' is required"),
    ({"model": "m"}, "input", "'input' is required"),
    ({"model": "m", "input": []}, "input", "not an empty array"),
    ({"model": "m", "input": [""]}, "input", "'input[0]' must be a non-empty string"),
    ({"model": "m", "input": ["a", []]}, "input", "'input[1]' must be a non-empty string"),
    ({"model": "m", "input": 5}, "input", "not a number"),
    ({"model": "m", "input": [[-1]]}, "input[0]", "between 0"),
    ({"model": "m", "input": ["x"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS} are accepted"),
    ({**BODY, "encoding_format": "bytes"}, "encoding_format", "must be one of float, base64"),
    ({**BODY, "dimensions": 0}, "dimensions", "between 1"),
    ({**BODY, "normalize": True}, "normalize", "use_activation"),
    ({**BODY, "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "never truncated"),
    ({**BODY, "messages": [{"role": "user", "content": "x"}]}, "messages", "send the text as input"),
    ({**BODY, "colour": "red"}, "colour", "unknown field"),
])
def test_a_wrong_field_is_a_400_naming_it(body, param, says):
    with pytest.raises(errors.InvalidArgument, match=re.escape(says)) as err:
        parse_embedding(body)
    assert err.value.param == param


def test_vllms_fields_at_their_defaults_are_accepted():
    parse_embedding({**BODY, "embed_dtype": "float32", "endianness": "native", "padding": "do_not_pad",
                     "mm_processor_kwargs": {}})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(path=st.sampled_from([("input",), ("input", 0), ("model",), ("encoding_format",), ("dimensions",),
                             ("user",), ("priority",), ("embed_dtype",)]), fragment=fragments)
def test_hostile_values_are_refused_with_invalid_argument_never_another_exception(path, fragment):
    raw = splice(at(path, {"model": "m", "input": ["x", [1]], "encoding_format": "float", "dimensions": 8,
                           "user": "u", "priority": 0, "embed_dtype": "float32"}), fragment)
    try:
        parse_embedding(jsonbody.parse(raw, edge.MAX_BODY_BYTES * 2))
    except errors.InvalidArgument as err:
        assert err.message and len(err.message) <= errors.MAX_MESSAGE_CHARS


VECTORS = [np.array([0.09639308601617813, -0.062220875173807144, 1.0], dtype=np.float32),
           np.array([0.5, -0.25, 3.4028234663852886e38], dtype=np.float32)]


def test_the_answer_is_vllms_shape_with_float_vectors_equal_to_the_engines():
    body = json.loads(embeddings_json("req-1", "m", [vector_bytes(v.tolist()) for v in VECTORS], 9, "float",
                                      created=7))
    assert body == {"id": "embd-1", "object": "list", "created": 7, "model": "m",
                    "data": [{"index": i, "object": "embedding", "embedding": v.tolist()} for i, v in enumerate(VECTORS)],
                    "usage": {"prompt_tokens": 9, "total_tokens": 9, "completion_tokens": 0,
                              "prompt_tokens_details": None}}


def test_base64_vectors_decode_as_the_openai_client_decodes_them():
    body = json.loads(embeddings_json("req-1", "m", [vector_bytes(v.tolist()) for v in VECTORS], 9, "base64"))
    for item, v in zip(body["data"], VECTORS):
        # (openai/resources/embeddings.py: np.frombuffer(base64.b64decode(data), dtype="float32"))
        assert np.frombuffer(base64.b64decode(item["embedding"]), dtype="float32").tolist() == v.tolist()


def test_a_pooling_request_is_an_embeddings_request_whose_task_is_embed():
    assert parse_pooling({**BODY, "task": "embed"}).inputs == parse_pooling(BODY).inputs == ("hello",)
    assert parse_pooling(BODY).pooling and not parse_embedding(BODY).pooling
    with pytest.raises(errors.InvalidArgument, match=re.escape("'task' must be \"embed\"")) as err:
        parse_pooling({**BODY, "task": "classify"})
    assert err.value.param == "task"
    with pytest.raises(errors.InvalidArgument, match="unknown field"):
        parse_embedding({**BODY, "task": "embed"})


def test_a_pooling_answer_carries_each_vector_as_data_of_a_pooling_object():
    body = json.loads(embeddings_json("req-1", "m", [vector_bytes(v.tolist()) for v in VECTORS], 9, "float",
                                      pooling=True))
    assert body["data"] == [{"index": i, "object": "pooling", "data": v.tolist()} for i, v in enumerate(VECTORS)]
    assert body["id"] == "pool-1"
