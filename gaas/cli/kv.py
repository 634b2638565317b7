"""`gaas kv stats` (the KV-cache directory's figures) and `gaas kv public add|list|remove` (prompt
beginnings every tenant shares in the prefix cache, kept by control)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gaas.cli.common import add_admin_args, add_mesh_args, admin_call, fail, mesh_state, mesh_topology


def cmd_kv_stats(args) -> int:
    from gaas.ops import probe

    topo = mesh_topology(args, mesh_state(Path(args.run_dir)))
    kvs = topo.of("kvcache")
    stats = probe.kv_stats(kvs[0].inbound, timeout=args.timeout) if kvs else None
    if stats is None:
        return fail(f"the KV directory at {kvs[0].inbound if kvs else '?'} does not answer: is the mesh up? (`gaas status`)")
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    s = stats
    print(f"KV directory: {s['blocks']} blocks indexed on {s['workers']} worker(s), {s['events']} event batches applied")
    for w in s["per_worker"]:
        print(f"  {w['worker_id']:<12} {w['blocks']:>8} blocks  {w['unreachable_blocks']:>6} unreachable  "
              f"{w['provisional_blocks']:>5} provisional  (epoch {w['epoch']}, last batch {w['last_seq']})")
    for t in s["per_tenant"]:
        print(f"  tenant {t['tenant'] or '(unknown)':<20} {t['blocks']:>8} blocks")
    print(f"lookups {s['lookups']}: {s['hit_blocks']} of {s['lookup_blocks']} blocks held by the best worker "
          f"(hit ratio {s['hit_ratio']:.1%}); fragmentation {s['fragmentation']:.1%} (blocks no lookup can reach)")
    provisioned = int(s["provisioned"])
    print(f"provisions {provisioned}: {s['provision_confirmed']} confirmed by the engines, {s['provision_expired']} "
          f"expired unconfirmed; {s['unchained_blocks']} blocks unchained, {s['wrong_size_blocks']} of the wrong size, "
          f"{s['resyncs']} resyncs, {s['sequence_gaps']} sequence gaps")
    if provisioned >= 20 and int(s["provision_expired"]) > provisioned // 2:
        print("warning: most provisions were never confirmed: the routers' block hashes and the engines' blocks "
              "disagree (tokenization, cache salt or block size)", file=sys.stderr)
    if int(s["wrong_size_blocks"]):
        print("warning: engines store blocks of another size than they registered with", file=sys.stderr)
    return 0


def cmd_kv_public_add(args) -> int:
    if (args.text is None) == (args.file is None):
        return fail("give the prefix with exactly one of --text and --file", 2)
    text = args.text if args.text is not None else Path(args.file).read_text()
    prefix, err = admin_call(args, lambda a: a.add_public_prefix(args.model, text))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(prefix))
    else:
        print(f"{prefix['prefix_id']}: prompts of {prefix['model']} that begin with these {len(text)} characters are "
              "cached for every tenant alike (routers pick it up within a second)")
    return 0


def cmd_kv_public_list(args) -> int:
    prefixes, err = admin_call(args, lambda a: a.list_public_prefixes(args.model or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(prefixes, indent=2))
    else:
        for p in prefixes:
            preview = p["text"][:60].replace("\n", " ")
            print(f"{p['prefix_id']:<22} {p['model']:<16} {len(p['text']):>6} chars  {preview!r}")
    return 0


def cmd_kv_public_remove(args) -> int:
    _, err = admin_call(args, lambda a: a.remove_public_prefix(args.prefix_id))
    if err is not None:
        return err
    print(f"removed {args.prefix_id}: its prompts are cached per tenant again")
    return 0


def register(sub) -> None:
    """`gaas kv` and its actions."""
    kv = sub.add_parser("kv", help="the KV-cache directory")
    kvsub = kv.add_subparsers(dest="kv_command", required=True, metavar="ACTION")
    kvstats = kvsub.add_parser("stats", help="blocks per worker and tenant, lookups, hit ratio, fragmentation",
                               description="The KV directory's figures: blocks indexed per worker and tenant, "
                               "unreachable blocks (fragmentation), lookups and their hit ratio, and whether the "
                               "routers' provisions are confirmed by the engines (if not, their hashes disagree).")
    add_mesh_args(kvstats, workers=False)
    kvstats.add_argument("--timeout", type=float, default=2.0, help="seconds to wait (2)")
    kvstats.add_argument("--json", action="store_true", help="machine-readable output")
    kvstats.set_defaults(func=cmd_kv_stats)
    public = kvsub.add_parser(
        "public", help="prompt beginnings every tenant shares in the prefix cache (e.g. a common system prompt)",
        description="Sharing is per tenant by default: no tenant hits another's cached blocks. A public prefix (a "
        "chat's system prompt, or the text a completion prompt begins with) is cached for every tenant alike. Its "
        "whole chain of blocks is shared, so tenants sending the same continuation after it share those blocks too.")
    psub = public.add_subparsers(dest="public_command", required=True, metavar="ACTION")
    padd = psub.add_parser("add", help="mark a prompt beginning public")
    padd.add_argument("model", help="the model it applies to")
    padd.add_argument("--text", default=None, help="the system prompt or prompt beginning")
    padd.add_argument("--file", default=None, help="read it from a file instead")
    add_admin_args(padd)
    padd.set_defaults(func=cmd_kv_public_add)
    plist = psub.add_parser("list", help="list public prefixes")
    plist.add_argument("model", nargs="?", default="", help="only this model's")
    add_admin_args(plist)
    plist.set_defaults(func=cmd_kv_public_list)
    premove = psub.add_parser("remove", help="make a public prefix per tenant again")
    premove.add_argument("prefix_id")
    add_admin_args(premove)
    premove.set_defaults(func=cmd_kv_public_remove)
