import pytest

from gaas.contracts import genrequest
from gaas.contracts.errors import InvalidArgument
from gaas.v1 import common_pb2, inference_pb2


def req(**kw):
    sampling = kw.pop("sampling", {})
    return inference_pb2.GenerateRequest(**kw, sampling=common_pb2.SamplingParams(**sampling))


def test_defaults():
    assert genrequest.check(req(prompt="hi")) == genrequest.DEFAULT_MAX_TOKENS
    assert genrequest.check(req(prompt_token_ids=[1, 2], max_tokens=5), 2048) == 5


@pytest.mark.parametrize(
    "request_, message",
    [
        (req(), "exactly one of prompt"),
        (req(prompt="a", prompt_token_ids=[1]), "exactly one of prompt"),
        (req(prompt="a", max_tokens=4096), "below the model's context"),
        (req(prompt_token_ids=[1] * 2000, max_tokens=100), "maximum context length is 2048"),
        (req(prompt="a", stop=[""]), "strings must be 1 to"),
        (req(prompt="a", stop=["x"] * 17), "at most 16 are accepted"),
        (req(prompt="a", priority=9), "not a priority"),
        (req(prompt="a", request_id="x" * 200), "at most 128"),
        (req(prompt="a", n=17), "at most 16 choices"),
        (req(prompt="a", n=2, sampling={"temperature": 0.0}), "must be 1 with greedy sampling"),
        (req(prompt="a", logprobs=21), "at most 20 alternatives"),
        (req(prompt="a", model="m" * 300), "model names are at most 256"),
        (req(messages=[inference_pb2.ChatMessage(role="robot", content="x")]), "must be one of"),
        (req(prompt="a", sampling={"temperature": -1.0}), "'temperature' must be at least 0"),
        (req(prompt="a", sampling={"temperature": 2.5}), "at most 2"),
        (req(prompt="a", sampling={"top_p": 0.0}), "'top_p' must be above 0"),
        (req(prompt="a", sampling={"top_k": -2}), "'top_k' must be -1 or 0"),
        (req(prompt="a", sampling={"min_p": 1.5}), "'min_p' must be"),
        (req(prompt="a", sampling={"repetition_penalty": 0.0}), "'repetition_penalty' must be above 0"),
        (req(prompt="a", max_tokens=4, sampling={"min_tokens": 5}), "must not exceed max_tokens"),
        (req(prompt="a", sampling={"bad_words": [""]}), "'bad_words' entries"),
    ],
)
def test_invalid_requests(request_, message):
    with pytest.raises(InvalidArgument, match=message):
        genrequest.check(request_, 2048)


@pytest.mark.parametrize(
    "field, ids, param",
    [
        ("stop_token_ids", [5, 4096], "stop_token_ids"),
        ("allowed_token_ids", [4096], "allowed_token_ids"),
    ],
)
def test_token_ids_are_checked_against_the_vocabulary(field, ids, param):
    r = req(prompt="a")
    getattr(r.sampling, field).extend(ids)
    with pytest.raises(InvalidArgument, match="holds 4096, which is not a token id of this model") as err:
        genrequest.check(r, 2048, vocab_size=4096)
    assert err.value.param == param
    genrequest.check(r, 2048)  # without a vocabulary (the worker's first check) only the length is bounded


def test_prompt_token_ids_beyond_the_vocabulary_name_their_position():
    with pytest.raises(InvalidArgument, match=r"'prompt\[1\]' is 5000"):
        genrequest.check(req(prompt_token_ids=[1, 5000], max_tokens=1), 2048, vocab_size=4096)


def test_logit_bias_is_clamped_like_vllm():
    r = req(prompt="a")
    r.sampling.logit_bias[3] = 250.0
    r.sampling.logit_bias[4] = -7.5
    assert genrequest.sampling_dict(r.sampling)["logit_bias"] == {3: 100.0, 4: -7.5}


def test_sampling_only_what_was_set():
    r = req(prompt="a", sampling={"temperature": 0.0, "seed": 7})
    assert genrequest.sampling_dict(r.sampling) == {"temperature": 0.0, "seed": 7}
    r = req(prompt="a", sampling={"min_p": 0.1, "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False})
    assert genrequest.sampling_dict(r.sampling) == {
        "min_p": pytest.approx(0.1), "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False,
    }


def test_priorities_map_to_vllm_order():
    p = genrequest.VLLM_PRIORITY
    assert p[common_pb2.PRIORITY_HIGH] < p[common_pb2.PRIORITY_NORMAL] < p[common_pb2.PRIORITY_LOW]
    assert p[common_pb2.PRIORITY_UNSPECIFIED] == p[common_pb2.PRIORITY_NORMAL]


@pytest.mark.parametrize("what, noun", [("prompt", "the prompt is 2621 tokens"), ("messages", "the conversation is 2621 tokens")])
def test_a_prompt_that_leaves_no_room_says_so_in_a_sentence(what, noun):
    err = genrequest.no_room_error(2048, 2621, what)
    assert err.message.startswith(noun) and "2048" in err.message and err.param == what
