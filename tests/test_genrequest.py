import pytest

from gaas import genrequest
from gaas.genrequest import RequestInvalid
from gaas.v1 import common_pb2, inference_pb2


def req(**kw):
    sampling = kw.pop("sampling", {})
    r = inference_pb2.GenerateRequest(**kw)
    for k, v in sampling.items():
        setattr(r.sampling, k, v)
    return r


def test_defaults():
    assert genrequest.check(req(prompt="hi")) == genrequest.DEFAULT_MAX_TOKENS
    assert genrequest.check(req(prompt_token_ids=[1, 2], max_tokens=5), 2048) == 5


@pytest.mark.parametrize(
    "request_, message",
    [
        (req(), "exactly one of prompt"),
        (req(prompt="a", prompt_token_ids=[1]), "exactly one of prompt"),
        (req(prompt="a", max_tokens=4096), "below the model's context"),
        (req(prompt_token_ids=[1] * 2000, max_tokens=100), "exceed the model's context"),
        (req(prompt="a", stop=[""]), "stop strings must be"),
        (req(prompt="a", stop=["x"] * 17), "at most 16 stop strings"),
        (req(prompt="a", priority=9), "unknown priority"),
        (req(prompt="a", request_id="x" * 200), "at most 128"),
        (req(prompt="a", sampling={"temperature": -1.0}), "temperature must be between"),
        (req(prompt="a", sampling={"top_p": 0.0}), "top_p must be between"),
        (req(prompt="a", sampling={"top_k": 0}), "top_k must be -1"),
    ],
)
def test_invalid_requests(request_, message):
    with pytest.raises(RequestInvalid, match=message):
        genrequest.check(request_, 2048)


def test_sampling_only_what_was_set():
    r = req(prompt="a", sampling={"temperature": 0.0, "seed": 7})
    assert genrequest.sampling_dict(r.sampling) == {"temperature": 0.0, "seed": 7}


def test_priorities_map_to_vllm_order():
    p = genrequest.VLLM_PRIORITY
    assert p[common_pb2.PRIORITY_HIGH] < p[common_pb2.PRIORITY_NORMAL] < p[common_pb2.PRIORITY_LOW]
    assert p[common_pb2.PRIORITY_UNSPECIFIED] == p[common_pb2.PRIORITY_NORMAL]
