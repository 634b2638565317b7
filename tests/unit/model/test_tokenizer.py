"""gaas.model.tokenizer against transformers (what vLLM runs): the same token ids for any text, the same
rendered chat for any conversation, the same template environment. A disagreement here would
make the router's token ids (and, later, its prefix hashes) differ from the engine's silently."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gaas.model.tokenizer import ChatMessage, Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def pair(tiny_model):
    from transformers import AutoTokenizer

    return Tokenizer.load(tiny_model), AutoTokenizer.from_pretrained(tiny_model)


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
_messages = st.lists(
    st.builds(ChatMessage, st.sampled_from(["system", "user", "assistant", "developer"]), _text), min_size=1, max_size=4
)


@settings(max_examples=150, deadline=None)
@given(text=_text, special=st.booleans())
def test_encode_and_decode_agree_with_transformers(pair, text, special):
    ours, hf = pair
    ids = ours.encode(text, special)
    assert ids == hf.encode(text, add_special_tokens=special)
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@settings(max_examples=100, deadline=None)
@given(messages=_messages, agp=st.booleans())
def test_chat_rendering_agrees_with_transformers(pair, messages, agp):
    ours, hf = pair
    as_dicts = [{"role": m.role, "content": m.content} for m in messages]
    expected = hf.apply_chat_template(as_dicts, tokenize=False, add_generation_prompt=agp)
    assert ours.render_chat(messages, agp) == expected
    assert ours.encode_chat(messages, agp) == hf.encode(expected, add_special_tokens=False)


def test_continue_final_message_agrees_with_transformers(pair):
    ours, hf = pair
    messages = [ChatMessage("user", "Write a word"), ChatMessage("assistant", "Sure, the word is")]
    expected = hf.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], tokenize=False, continue_final_message=True
    )
    assert ours.render_chat(messages, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.endswith("Sure, the word is")


def test_template_environment_matches_transformers(tiny_model, tmp_path):
    """raise_exception, tojson, loop controls and trimming behave as in apply_chat_template."""
    import shutil

    from transformers import AutoTokenizer

    template = (
        "{% for m in messages %}{% if m['role'] == 'robot' %}{{ raise_exception('no robots') }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}\n  {{ m | tojson }}\n{% endfor %}"
    )
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    (d / "chat_template.jinja").write_text(template)
    ours, hf = Tokenizer.load(d), AutoTokenizer.from_pretrained(d)
    msgs = [{"role": "user", "content": "é \"q\""}, {"role": "assistant", "content": "<b>"}, {"role": "user", "content": "3"}]
    assert ours.render_chat([ChatMessage(**m) for m in msgs], False) == hf.apply_chat_template(msgs, tokenize=False)
    with pytest.raises(TokenizerError, match="no robots"):
        ours.render_chat([ChatMessage("robot", "x")], False)


def test_a_model_without_template_or_tokenizer_is_a_clear_error(tiny_model, tmp_path):
    import shutil

    d = tmp_path / "bare"
    shutil.copytree(tiny_model, d)
    (d / "chat_template.jinja").unlink()
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.load(d).render_chat([ChatMessage("user", "hi")])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path / "nothing")


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(st.text(max_size=60), st.text(max_size=60)), min_size=1, max_size=5),
       system=st.text(max_size=40))
def test_a_sessions_next_prompt_reuses_the_last_ones_tokens_and_gets_exactly_the_whole_prompts_ids(pair, turns, system):
    from gaas.model.tokenizer import PromptPrefix

    ours, _ = pair
    prefix = PromptPrefix()
    messages = [ChatMessage("system", system)]
    for user, reply in turns:
        messages.append(ChatMessage("user", user))
        text = ours.render_chat(messages, True)
        assert ours.encode_continuing(text, prefix) == ours.encode(text, False), "what tokenizing it whole gives"
        assert text.startswith(prefix.text) and prefix.ids == ours.encode(prefix.text, False)
        messages.append(ChatMessage("assistant", reply))
    assert ours.continued_chars(ours.render_chat(messages + [ChatMessage("user", "x")], True), prefix) < len(
        ours.render_chat(messages + [ChatMessage("user", "x")], True)), "the next turn tokenizes only its new part"


def test_sent_back_arguments_nested_past_the_json_limit_reach_the_template_as_their_text():
    deep = "[" * 100_000 + "]" * 100_000
    message = ChatMessage("assistant", "", (("c1", "f", deep), ("c2", "g", '{"a": [1]}')))
    calls = message.as_template_dict()["tool_calls"]
    assert calls[0]["function"]["arguments"] == deep
    assert calls[1]["function"]["arguments"] == {"a": [1]}
