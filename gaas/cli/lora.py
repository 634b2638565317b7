"""`gaas lora add|list|remove`: LoRA adapters on a deployed model, kept in control's catalogue.
Workers load an adapter on its first request (no restart) and unload it when it is removed; a
request names it as its model ("support-bot", or "gaas-tiny:support-bot"). `gaas lora build`
makes a random adapter for a local model (to try the feature, and the tests' and benchmarks')."""

from __future__ import annotations

import json
from pathlib import Path

from gaas.cli.common import add_admin_args, admin_call, fail


def cmd_lora_add(args) -> int:
    if bool(args.owner) == args.public:
        return fail("say who may use the adapter: --owner TENANT (only that tenant) or --public (every tenant)", 2)
    price = None
    if args.price is not None:
        try:
            parts = tuple(float(x) for x in args.price.split(","))
        except ValueError:
            parts = ()
        if len(parts) != 3 or min(parts) < 0:
            return fail("--price is INPUT,CACHED_INPUT,OUTPUT in USD per 1M tokens, e.g. 0.8,0.08,3.2", 2)
        price = parts
    path = Path(args.path).expanduser().resolve()
    if not path.is_dir():
        return fail(f"{path} is not a directory: give the adapter's directory (adapter_config.json and "
                    "adapter_model.safetensors)", 2)
    added, err = admin_call(args, lambda a: a.add_adapter(args.name, args.base_model, str(path), args.owner or "", price))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(added))
        return 0
    who = f"tenant {added['owner']}" if added["owner"] else "every tenant"
    print(f"adapter {added['name']} (rank {added['rank']}) on {added['base_model']}, for {who}: request it as model "
          f"{added['name']!r} or {added['base_model'] + ':' + added['name']!r} (routers see it within a second; a "
          "worker loads it on its first request)")
    return 0


def cmd_lora_list(args) -> int:
    adapters, err = admin_call(args, lambda a: a.list_adapters(args.base_model or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(adapters, indent=2))
        return 0
    if not adapters:
        print("no adapters (`gaas lora add NAME BASE_MODEL PATH --owner TENANT` adds one)")
    for a in adapters:
        price = a.get("price")
        priced = f"{price['input']:g}/{price['cached_input']:g}/{price['output']:g} USD/1M" if price else "base prices"
        print(f"{a['name']:<24} {a['base_model']:<14} rank {a['rank']:<4} {a['owner'] or '(public)':<16} {priced:<24} "
              f"{a['path']}")
    return 0


def cmd_lora_remove(args) -> int:
    _, err = admin_call(args, lambda a: a.remove_adapter(args.name))
    if err is not None:
        return err
    print(f"removed adapter {args.name}: requests for it get 404, and workers unload it within a second")
    return 0


def cmd_lora_build(args) -> int:
    from gaas.model import lora

    try:
        out = lora.build_adapter(Path(args.base), Path(args.out), args.rank, args.seed)
    except lora.AdapterError as exc:
        return fail(str(exc), 2)
    print(f"built a random rank-{args.rank} adapter for {args.base} in {out}")
    return 0


def register(sub) -> None:
    """`gaas lora` and its actions."""
    lora = sub.add_parser("lora", help="LoRA adapters served on a model's workers, loaded at run time",
                          description=__doc__)
    lsub = lora.add_subparsers(dest="lora_command", required=True, metavar="ACTION")
    add = lsub.add_parser(
        "add", help="catalogue an adapter (checked against its base model before anything changes)",
        description="Checks, before anything changes: the name is free, the base model is deployed with workers whose "
        "engine serves adapters (engine: {max_loras: N} in deploy/gaas.yaml), the directory holds a PEFT LoRA adapter "
        "whose matrices fit the base model, its rank is within the pool's max_lora_rank, the owner is a tenant.")
    add.add_argument("name", help="its name: lower-case letters, digits, '.', '_', '-'")
    add.add_argument("base_model", help="the deployed model it adapts")
    add.add_argument("path", help="its directory (adapter_config.json, adapter_model.safetensors), as the workers read it")
    add.add_argument("--owner", default="", help="the only tenant that may use it")
    add.add_argument("--public", action="store_true", help="every tenant may use it")
    add.add_argument("--price", default=None, metavar="IN,CACHED,OUT",
                     help="its own prices, USD per 1M tokens for every tier (default: the base model's)")
    add_admin_args(add)
    add.set_defaults(func=cmd_lora_add)
    ls = lsub.add_parser("list", help="the catalogued adapters")
    ls.add_argument("base_model", nargs="?", default="", help="only this model's")
    add_admin_args(ls)
    ls.set_defaults(func=cmd_lora_list)
    rm = lsub.add_parser("remove", help="remove an adapter: its requests get 404, workers unload it")
    rm.add_argument("name")
    add_admin_args(rm)
    rm.set_defaults(func=cmd_lora_remove)
    build = lsub.add_parser("build", help="build a random adapter for a local model (to try adapters out)")
    build.add_argument("base", help="the local model's directory, e.g. models/gaas-tiny")
    build.add_argument("out", help="where to write the adapter")
    build.add_argument("--rank", type=int, default=8, help="its rank (8)")
    build.add_argument("--seed", type=int, default=0, help="another seed, other weights (0)")
    build.set_defaults(func=cmd_lora_build)
