"""LoRA adapters in PEFT's format: one built for a base model reads back with its rank and targets
and fits that base; against another base (other shapes) or over the pool's rank limit it is
refused saying why and what to change; a directory that is no adapter is refused too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gaas.model.lora import AdapterError, build_adapter, check_fits, main, read_adapter

TINY = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "intermediate_size": 256, "num_hidden_layers": 2}
SMALL = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1536,
         "num_hidden_layers": 8}


def base(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_an_adapter_built_for_a_base_reads_back_and_fits_it(tmp_path):
    tiny = base(tmp_path, "tiny", TINY)
    a = read_adapter(build_adapter(tiny, tmp_path / "a", rank=4, seed=1))
    assert (a.rank, a.target_modules, a.declared_base) == (4, ("q_proj", "v_proj"), str(tiny))
    assert a.shapes[(1, "q_proj", "A")] == (4, 128) and a.shapes[(1, "v_proj", "B")] == (64, 4)
    check_fits(a, tiny, max_rank=16)


def test_an_adapter_for_another_base_or_over_the_rank_limit_is_refused_with_what_to_change(tmp_path):
    tiny, small = base(tmp_path, "tiny", TINY), base(tmp_path, "small", SMALL)
    a = read_adapter(build_adapter(small, tmp_path / "for-small", rank=8))
    with pytest.raises(AdapterError, match="the base model's needs .*: it was made for another model"):
        check_fits(a, tiny, max_rank=16)
    with pytest.raises(AdapterError, match="has rank 8, over the pool's limit of 4: raise the pool's max_lora_rank"):
        check_fits(a, small, max_rank=4)


def test_a_directory_that_is_no_lora_adapter_is_refused(tmp_path):
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(AdapterError, match="only LoRA adapters"):
        read_adapter(tmp_path)


def test_the_command_builds_and_checks(tmp_path, capsys):
    tiny = base(tmp_path, "tiny", TINY)
    assert main(["build", str(tiny), str(tmp_path / "a"), "--rank", "2"]) == 0
    assert main(["check", str(tiny), str(tmp_path / "a"), "--max-rank", "2"]) == 0
    assert main(["check", str(tiny), str(tmp_path / "a"), "--max-rank", "1"]) == 2
    assert "over the pool's limit of 1" in capsys.readouterr().err
