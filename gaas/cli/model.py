"""`gaas model build`: build a local random-weight model with a trained tokenizer (gaas.model.build)."""

from __future__ import annotations

from pathlib import Path

from gaas.cli.common import ROOT, fail, say


def cmd_model_build(args) -> int:
    from gaas.model.build import PRESETS, build_model, is_built

    out = Path(args.out or ROOT / "models" / f"gaas-{args.preset}")
    if args.preset not in PRESETS:
        return fail(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}", 2)
    if is_built(out) and not args.force:
        say(f"{out} already holds a built model (use --force to rebuild)")
        return 0
    build_model(args.preset, out, seed=args.seed, progress=say)
    print(out)
    return 0


def register(sub) -> None:
    """`gaas model build`."""
    from gaas.model.build import PRESETS

    model = sub.add_parser("model", help="local models")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    build = msub.add_parser("build", help="build a random-weight Llama model with a trained BPE tokenizer",
                            description="Presets: " + "; ".join(f"{k}: {v.purpose}" for k, v in PRESETS.items()))
    build.add_argument("--preset", default="tiny", help=f"one of {', '.join(PRESETS)} (tiny)")
    build.add_argument("--out", default=None, help="output directory (default: models/gaas-<preset>)")
    build.add_argument("--seed", type=int, default=0, help="weight initialisation seed (0)")
    build.add_argument("--force", action="store_true", help="rebuild even if the directory holds a model")
    build.set_defaults(func=cmd_model_build)
