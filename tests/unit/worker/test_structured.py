"""Structured output as the worker's engine decodes it (services/worker/structured.py): under a
schema, every string is valid UTF-8 within its length, for every seed, not only the one a test
happens to draw. The tiny model in-process (vLLM's LLM, its model runner in this process) with the
worker's structured-outputs configuration; 200 seeds at temperature 1 per case."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gaas.contracts.tools import for_engine

ROOT = Path(__file__).resolve().parents[3]
SEEDS = 200
NAME_12 = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}

# Prints one JSON line per case and seed: its output's raw bytes (hex), text and finish reason.
DECODE_SEEDS = """
import json, os, sys
if __name__ == "__main__":
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from gaas.model.tokenizer import ChatMessage, Tokenizer
    from services.worker.structured import structured_outputs_config

    model, cases, seeds = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    # GPT-2's byte-level alphabet, read backwards: a token's characters to the bytes they stand for.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = printable + [256 + i for i in range(256 - len(printable))]
    byte_of = dict(zip(map(chr, chars), printable + [b for b in range(256) if b not in printable]))
    tok = Tokenizer.load(model)
    vocab = json.load(open(os.path.join(model, "tokenizer.json")))["model"]["vocab"]
    token_of_byte = {b: vocab[ch] for ch, b in byte_of.items()}
    # Drawn to bad bytes: leads of the 3- and 4-byte forms that have forbidden continuations, and
    # every continuation byte, made likelier than anything else.
    bad_bytes = {token_of_byte[b]: 8.0 for b in (0xE0, 0xED, 0xF0, 0xF4)}
    bad_bytes.update({token_of_byte[b]: 6.0 for b in range(0x80, 0xC0)})
    llm = LLM(model=model, max_model_len=512, block_size=32, enforce_eager=True,
              structured_outputs_config=structured_outputs_config())
    prompt = {"prompt_token_ids": tok.encode_chat([ChatMessage("user", "Describe a person.")])}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=100, logit_bias=bad_bytes if drawn else None,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for schema, drawn in cases.values() for s in range(seeds)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for n, out in enumerate(outs):
        c = out.outputs[0]
        text_ids = [i for i in c.token_ids if tok.decode([i], skip_special_tokens=True)]  # no end-of-text token
        raw = bytes(byte_of[ch] for i in text_ids for ch in tok.id_to_token(i))
        print(json.dumps({"case": list(cases)[n // seeds], "seed": n % seeds, "hex": raw.hex(), "text": c.text,
                          "finish": c.finish_reason}))
"""


# Each case: a schema as the mesh sends it (gaas.contracts.tools.for_engine) or as written, and
# whether the model is drawn to bytes that are not UTF-8 (logit bias): at random such bytes come
# about once in 200 answers; drawn, in most, so only the grammar keeps them out.
CASES = {f"{form}{drawn}": (schema, bool(drawn))
         for form, schema in (("as-the-mesh-sends-it", for_engine(NAME_12)), ("as-written", NAME_12))
         for drawn in ("", "-drawn-to-bad-bytes")}


@pytest.fixture(scope="module")
def answers(tiny_model) -> dict[str, list[dict]]:
    """Each of CASES' answers, one per seed, from one engine."""
    r = subprocess.run([sys.executable, "-c", DECODE_SEEDS, str(tiny_model), json.dumps(CASES), str(SEEDS)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, list[dict]] = {name: [] for name in CASES}
    for line in r.stdout.splitlines():
        if line.startswith('{"case"'):
            answer = json.loads(line)
            out[answer["case"]].append(answer)
    return out


def what_is_wrong(answer: dict) -> str | None:
    """Why the answer breaks the schema's promise (None: it keeps it)."""
    if answer["finish"] != "stop":
        return f"cut off ({answer['finish']})"
    try:
        text = bytes.fromhex(answer["hex"]).decode("utf-8")  # strict: no byte sequence that is not UTF-8
    except UnicodeDecodeError as exc:
        return f"not UTF-8: {exc}"
    try:
        name = json.loads(text)["name"]  # strict: no raw control characters in a string
    except ValueError as exc:
        return f"not JSON: {exc}"
    return f"name of {len(name)} characters" if len(name) > 12 else None


@pytest.mark.parametrize("case", CASES)
def test_a_length_bounded_string_is_valid_utf8_within_its_length_for_every_seed(answers, case):
    assert len(answers[case]) == SEEDS
    wrong = {a["seed"]: (why, a["text"]) for a in answers[case] if (why := what_is_wrong(a))}
    assert not wrong, f"{len(wrong)} of {SEEDS} seeds broke the schema: {dict(list(wrong.items())[:5])}"
    # And what the client reads is those bytes: the engine's text has no replacement characters.
    assert all(a["text"] == bytes.fromhex(a["hex"]).decode() for a in answers[case])
