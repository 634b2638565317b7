"""GaaS's vLLM plugin (gaas/model/vllm_plugin.py): a fresh CPU engine whose first batch is a prompt
of a few tokens must not die of SIGILL (vLLM's AMX attention runs before anything asked Linux for
the tile registers); seeded requests whose prompts are prefilled in several steps neither crash
the CPU engine nor change what their seed draws."""

import json
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


# Seeded prompts of ~300 tokens prefilled 64 at a time: all at once (their chunks interleaved), then
# each alone. Prints each run's outputs as JSON.
SEEDED_CHUNKS = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model runner in this process
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], max_model_len=512, block_size=32, enforce_eager=True, enable_prefix_caching=False,
              max_num_batched_tokens=64, max_num_seqs=8)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * n) % 200 + 10 for n in range(300 + 9 * i)]} for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True) for i in range(6)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate(p, s, use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(prompts, params)]
    print(json.dumps({"together": together, "alone": alone}))
""")


def test_the_plugin_is_registered_with_vllm():
    assert any(e.value == "gaas.model.vllm_plugin:register" for e in entry_points(group="vllm.general_plugins"))


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="the failure needs a CPU with AMX tiles")
def test_a_fresh_cpu_engine_survives_a_two_token_first_prompt(tiny_model):
    r = subprocess.run([sys.executable, "-c", FIRST_BATCH, str(tiny_model)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    assert "generated 1" in r.stdout


def test_seeded_prompts_prefilled_in_chunks_survive_and_draw_what_their_seed_draws(tiny_model):
    r = subprocess.run([sys.executable, "-c", SEEDED_CHUNKS, str(tiny_model)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(len(t) == 12 for t in out["together"])
    assert out["together"] == out["alone"]
