import json

import pytest

from gaas.model.build import BOS, EOS, MARKER_FILE, PRESETS, build_model, get_preset, is_built


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model


def test_builds_a_loadable_hf_directory(tiny):
    from transformers import AutoConfig, AutoTokenizer

    assert is_built(tiny)
    cfg = AutoConfig.from_pretrained(tiny)
    assert cfg.model_type == "llama"
    assert cfg.hidden_size // cfg.num_attention_heads == 64  # vLLM's CPU attention needs head_dim 64
    tok = AutoTokenizer.from_pretrained(tiny)
    ids = tok("Once upon a time").input_ids
    assert ids[0] == tok.convert_tokens_to_ids(BOS)
    assert tok.decode(ids, skip_special_tokens=True) == "Once upon a time"
    assert tok.eos_token == EOS
    assert len(tok) <= cfg.vocab_size


def test_chat_template(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_marker_records_the_preset(tiny):
    marker = json.loads((tiny / MARKER_FILE).read_text())
    assert marker["preset"]["name"] == "tiny" and marker["parameters"] > 0


def test_same_seed_same_weights(tmp_path, tiny):
    other = build_model("tiny", tmp_path / "again")
    assert (other / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


def test_presets():
    assert set(PRESETS) >= {"tiny", "small"}
    for p in PRESETS.values():
        assert p.hidden_size // p.num_heads == 64
    with pytest.raises(ValueError, match="choose one of"):
        get_preset("huge")


def test_incomplete_directory_is_not_built(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert not is_built(tmp_path)
