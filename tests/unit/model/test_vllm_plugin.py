"""GaaS's vLLM plugin: a fresh CPU engine whose first batch is a prompt of a few tokens must not
die of SIGILL (vLLM's AMX attention runs before anything asked Linux for the tile registers; see
gaas/model/vllm_plugin.py)."""

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch

from tests.conftest import ROOT

FIRST_BATCH = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model runner in this process
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], max_model_len=512, block_size=32, enforce_eager=True)
    out = llm.generate({"prompt_token_ids": [10, 11]}, SamplingParams(max_tokens=1))
    print("generated", len(out[0].outputs[0].token_ids))
""")


def test_the_plugin_is_registered_with_vllm():
    assert any(e.value == "gaas.model.vllm_plugin:register" for e in entry_points(group="vllm.general_plugins"))


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="the failure needs a CPU with AMX tiles")
def test_a_fresh_cpu_engine_survives_a_two_token_first_prompt(tiny_model):
    r = subprocess.run([sys.executable, "-c", FIRST_BATCH, str(tiny_model)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    assert "generated 1" in r.stdout
