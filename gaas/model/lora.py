"""LoRA adapters in PEFT's format (adapter_config.json and adapter_model.safetensors), as vLLM loads
them at run time: building one for a local model (the tests' and benchmarks' adapters: random
low-rank weights on the attention projections, a seed apart), and reading one to check it fits its
base model before anything loads it: the adapter's matrices must have the base's shapes (an adapter
made for another model does not), and its rank must be within the pool's limit.

    python -m gaas.model.lora build models/gaas-tiny models/gaas-tiny-lora-a --rank 8 --seed 1
    python -m gaas.model.lora check models/gaas-tiny models/gaas-tiny-lora-a --max-rank 16
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# The projections an adapter built here adapts (Llama's attention).
TARGETS = ("q_proj", "v_proj")
# base_model.model.model.layers.{layer}.self_attn.{module}.lora_{A|B}.weight
KEY_RE = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class AdapterError(ValueError):
    """The adapter cannot serve on that base model; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class Adapter:
    path: Path
    rank: int
    alpha: float
    # The base model the adapter says it was made for (its base_model_name_or_path).
    declared_base: str
    target_modules: tuple[str, ...]
    # (layer, module, "A" or "B") -> shape.
    shapes: dict


def _base_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """module -> (out_features, in_features) of a Llama-like base's linear layers."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    inter = int(config.get("intermediate_size") or 4 * hidden)
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden), "v_proj": (kv * head_dim, hidden),
            "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def _config(base: Path) -> dict:
    try:
        return json.loads((base / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read the base model's config.json in {base}: {exc}") from None


def build_adapter(base: Path, out: Path, rank: int = 8, seed: int = 0, scale: float = 0.2) -> Path:
    """A PEFT LoRA adapter for the local model at base, written to out (random weights: its answers
    differ from the base's, which is what the tests need)."""
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise AdapterError(f"rank must be at least 1, got {rank}")
    config = _config(base)
    shapes = _base_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in TARGETS:
            out_f, in_f = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g) * scale).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * scale).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps({
        "base_model_name_or_path": str(base), "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "target_modules": list(TARGETS),
    }, indent=2))
    return out


# A safetensors file's header (its first 8 bytes: the JSON header's length) is at most this large.
MAX_HEADER = 100 << 20


def _tensor_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of the tensors in a safetensors file, from its JSON header alone (no torch: the
    control plane checks adapters without loading a framework)."""
    try:
        with open(weights, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= MAX_HEADER:
                raise AdapterError(f"{weights} is not a safetensors file")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise AdapterError(f"cannot read {weights}: {exc.strerror or exc}") from None
    except ValueError:
        raise AdapterError(f"{weights} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{weights} is not a safetensors file")
    return {k: tuple(int(d) for d in v.get("shape", ())) for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict)}


def read_adapter(path: Path) -> Adapter:
    """The adapter at path (AdapterError when it is not a PEFT LoRA adapter)."""
    path = Path(path)
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except OSError:
        raise AdapterError(f"{path} holds no {CONFIG}: not a PEFT adapter directory") from None
    except ValueError as exc:
        raise AdapterError(f"{path / CONFIG} is not JSON: {exc}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path} is a {cfg.get('peft_type')} adapter; only LoRA adapters are served")
    try:
        rank = int(cfg["r"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"{path / CONFIG} names no rank (r)") from None
    weights = path / WEIGHTS
    if not weights.exists():
        raise AdapterError(f"{path} holds no {WEIGHTS} (adapters in .bin files are not served: convert them)")
    shapes = {}
    for key, shape in _tensor_shapes(weights).items():
        m = KEY_RE.fullmatch(key)
        if m:
            shapes[(int(m.group(1)), m.group(2), m.group(3))] = shape
    if not shapes:
        raise AdapterError(f"{weights} holds no LoRA matrices of a decoder layer")
    targets = cfg.get("target_modules") or []
    return Adapter(path, rank, float(cfg.get("lora_alpha", rank)), str(cfg.get("base_model_name_or_path", "")),
                   tuple(targets) if isinstance(targets, list) else (str(targets),), shapes)


def check_fits(adapter: Adapter, base: Path, max_rank: int) -> None:
    """AdapterError unless the adapter's matrices fit the base model's layers and its rank is
    within max_rank (the pool's max_lora_rank)."""
    if adapter.rank > max_rank:
        raise AdapterError(f"{adapter.path.name} has rank {adapter.rank}, over the pool's limit of {max_rank}: "
                           "raise the pool's max_lora_rank (engine settings) or use an adapter of lower rank")
    config = _config(base)
    shapes, layers = _base_shapes(config), int(config["num_hidden_layers"])
    for (layer, module, ab), shape in sorted(adapter.shapes.items()):
        if layer >= layers:
            raise AdapterError(f"{adapter.path.name} adapts layer {layer}; the base model has {layers} layers: it was "
                               f"made for another model ({adapter.declared_base or 'unnamed'})")
        if module not in shapes:
            raise AdapterError(f"{adapter.path.name} adapts {module}, which the base model does not have")
        out_f, in_f = shapes[module]
        want = (adapter.rank, in_f) if ab == "A" else (out_f, adapter.rank)
        if shape != want:
            raise AdapterError(f"{adapter.path.name}'s {module}.lora_{ab} of layer {layer} is {list(shape)}, the base "
                               f"model's needs {list(want)}: it was made for another model "
                               f"({adapter.declared_base or 'unnamed'})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build a random LoRA adapter for a local model")
    b.add_argument("base", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--rank", type=int, default=8)
    b.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("check", help="check an adapter fits a base model")
    c.add_argument("base", type=Path)
    c.add_argument("adapter", type=Path)
    c.add_argument("--max-rank", type=int, default=16)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            print(build_adapter(args.base, args.out, args.rank, args.seed))
        else:
            a = read_adapter(args.adapter)
            check_fits(a, args.base, args.max_rank)
            print(f"{args.adapter}: rank {a.rank}, {', '.join(a.target_modules)}: fits {args.base}")
    except AdapterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
