"""Build a small Llama-architecture model that vLLM can load, without any model hub.

The weights are random (seeded, so a build is reproducible); the tokenizer is a byte-level BPE
trained on text that is on every machine with Python: the standard library's own sources. The
result is a normal Hugging Face directory (config.json, model.safetensors, tokenizer.json, a
chat template), so vLLM, transformers and the router's tokenizer all load it the usual way.
"""

from __future__ import annotations

import json
import logging
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT]

# Llama-3 style chat template: every message is "<header>role<end>\n\ncontent<eot>". With tools,
# Hermes' conventions (what vLLM's "hermes" tool parser reads): the functions in a system block
# first, an assistant's calls as <tool_call>{"name", "arguments"}</tool_call>, a tool's answer as
# <tool_response>...</tool_response>. Without tools it renders as it always did.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nYou may call one or more functions. Their signatures "
    "are within <tools></tools>:\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools>\nTo call a function, answer with its name and arguments as JSON within <tool_call></tool_call>:"
    "\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\n</tool_call><|eot_id|>' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\n' }}{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "{{ '\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|start_header_id|>tool<|end_header_id|>\n\n<tool_response>\n' + message['content'] + '\n</tool_response><|eot_id|>' }}"
    "{% else %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

MARKER_FILE = "gaas-model.json"


@dataclass(frozen=True, slots=True)
class Preset:
    """Shape of one buildable model."""

    name: str
    # Width of the residual stream.
    hidden_size: int
    # Width of the MLP's inner layer.
    intermediate_size: int
    # Transformer blocks.
    num_layers: int
    # Query heads; hidden_size / num_heads must be 64 (vLLM's CPU attention needs head_dim 64).
    num_heads: int
    # Key/value heads (grouped-query attention).
    num_kv_heads: int
    # Tokenizer vocabulary, special tokens included.
    vocab_size: int
    # Longest context the model accepts.
    max_position_embeddings: int
    # What the preset is for, shown by `gaas model build --help`.
    purpose: str


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny", 128, 256, 2, 2, 1, 4096, 4096, "tests and the local demo: ~5-15 ms TTFT on a CPU core"),
        Preset("small", 512, 1536, 8, 8, 2, 8192, 8192, "benchmarks where prefill must cost something"),
        Preset("long", 128, 256, 2, 2, 1, 4096, 32768,
               "tiny's shape with a 32K-token context: long sessions and their switching cost (bench.sessions)"),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def corpus_lines(max_bytes: int = 8 << 20) -> Iterator[str]:
    """Text to train the tokenizer on: the Python standard library's sources, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen = 0
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        seen += len(text)
        yield text
        if seen >= max_bytes:
            return


def train_tokenizer(preset: Preset):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=preset.max_position_embeddings,
    )


def build_model(
    preset_name: str,
    out_dir: Path,
    *,
    seed: int = 0,
    progress: Callable[[str], None] = lambda msg: None,
) -> Path:
    """Build the preset into out_dir (replacing what is there) and return the directory."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    preset = get_preset(preset_name)
    started = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    progress(f"training a {preset.vocab_size}-token byte-level BPE tokenizer on the Python stdlib sources")
    tokenizer = train_tokenizer(preset)
    vocab = len(tokenizer)

    progress(
        f"initialising a Llama model: hidden {preset.hidden_size}, {preset.num_layers} layers, "
        f"{preset.num_heads} heads / {preset.num_kv_heads} KV heads, vocab {vocab}, seed {seed}"
    )
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.hidden_size // preset.num_heads,
        max_position_embeddings=preset.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(EOT)],
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())

    progress(f"saving {n_params / 1e6:.2f} M parameters to {out_dir}")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    marker = {"preset": asdict(preset), "seed": seed, "parameters": n_params, "built_at": int(time.time())}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    progress(f"model ready in {time.monotonic() - started:.1f} s")
    return out_dir


def is_built(model_dir: Path) -> bool:
    """True when model_dir holds a complete build (the marker is written last)."""
    d = Path(model_dir)
    return (d / MARKER_FILE).is_file() and (d / "config.json").is_file() and (d / "tokenizer.json").is_file()


def refresh_chat_template(model_dir: Path) -> bool:
    """Bring the chat template of a model this module built earlier to CHAT_TEMPLATE (a build from
    before tool calling renders no tools); True when it changed. A model it did not build is left alone."""
    d = Path(model_dir)
    if not (d / MARKER_FILE).is_file():
        return False
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        if jinja.read_text() == CHAT_TEMPLATE:
            return False
        jinja.write_text(CHAT_TEMPLATE)
        return True
    config_path = d / "tokenizer_config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text())
    if config.get("chat_template") == CHAT_TEMPLATE:
        return False
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return True


def check_source(name: str, version: str, source: str, preset: str) -> str | None:
    """What is wrong with a model version's weights, as a deployment names them (None: nothing):
    a local directory that is missing with no preset to build it, an unknown preset, or a
    directory without a model's config. A hub id (not a path) is taken as given."""
    if preset and preset not in PRESETS:
        return f"{name} {version}: unknown preset {preset!r}; choose one of {', '.join(PRESETS)}"
    if not source.startswith("/"):
        return None
    d = Path(source)
    if preset:
        if d.exists() and not d.is_dir():
            return f"{name} {version}: source {source} is not a directory"
        return None  # built when missing
    if not d.is_dir():
        return f"{name} {version}: source {source} does not exist, and no preset is given to build it"
    if not (d / "config.json").is_file():
        return f"{name} {version}: source {source} has no config.json: not a model directory"
    return None


def check_model(m) -> str | None:
    """check_source of a deployment's model (gaas.settings.deployspec.ModelSpec); only one that is
    to have workers needs its weights, but a preset gaas cannot build is wrong in any entry."""
    if m.serves:
        return check_source(m.name, m.version, m.source, m.preset)
    return check_source(m.name, m.version, "", m.preset) if m.preset else None


def check_sources(spec) -> None:
    """Every served model's weights of a deployment (gaas.settings.deployspec.DeploySpec) checked;
    SpecError at the first whose source cannot be had (parse_text(check=...) places it in the file)."""
    from gaas.settings.deployspec import SpecError

    for i, m in enumerate(spec.models):
        if wrong := check_model(m):
            raise SpecError(wrong, ("models", i, "source"))
