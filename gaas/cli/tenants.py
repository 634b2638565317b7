"""`gaas tenant create|set|list` and `gaas key create|list|revoke`: tenants, their tiers, quotas and
Stripe customer, and their API keys, through control's admin API."""

from __future__ import annotations

import argparse
import json

from gaas.contracts.tenancy import DEFAULT_TIER, TIERS_BY_PRIORITY
from gaas.cli.common import add_admin_args, admin_call, fail, say

# An option not given on the command line (where None means something).
_UNSET = object()


def cmd_tenant_create(args) -> int:
    tenant, err = admin_call(args, lambda a: a.create_tenant(args.name, args.tier))
    if err is not None:
        return err
    print(json.dumps(tenant) if args.json else f"created tenant {tenant['name']} ({tenant['tier']}); "
          f"give it a key with: gaas key create {tenant['name']}")
    return 0


def cmd_tenant_list(args) -> int:
    tenants, err = admin_call(args, lambda a: a.list_tenants())
    if err is not None:
        return err
    if args.json:
        print(json.dumps(tenants, indent=2))
    else:
        for t in tenants:
            print(f"{t['name']:<24} {t['tier']:<7} {_limits_text(t)}")
    return 0


def _limit(text: str) -> int | None:
    """A quota from the command line: a whole number (0: unlimited), or 'default' (the tier's)."""
    if text == "default":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number (0: unlimited) or 'default', not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 (unlimited) or more")
    return value


def _limits_text(t: dict) -> str:
    own = set(t.get("own_limits") or ())
    parts = []
    for key, label in (("rpm", "requests/min"), ("tpm", "tokens/min"), ("concurrency", "at once")):
        value = t["limits"][key]
        parts.append(f"{value:,} {label}" if value else f"unlimited {label}")
        if key not in own:
            parts[-1] += " (tier)"
    return ", ".join(parts)


def cmd_tenant_set(args) -> int:
    limits = {k: getattr(args, k) for k in ("rpm", "tpm", "concurrency") if getattr(args, k) is not _UNSET}
    if args.tier is None and args.stripe_customer is None and not limits:
        return fail("nothing to change: give --tier, --stripe-customer, --rpm, --tpm and/or --concurrency", 2)
    tenant, err = admin_call(args, lambda a: a.update_tenant(args.name, args.tier, args.stripe_customer, limits))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(tenant))
    else:
        customer = tenant["stripe_customer"] or "no Stripe customer (its usage is not reported to Stripe)"
        print(f"tenant {tenant['name']}: {tenant['tier']}, {customer}\n  quotas: {_limits_text(tenant)}")
    return 0


def cmd_key_create(args) -> int:
    result, err = admin_call(args, lambda a: a.create_key(args.tenant))
    if err is not None:
        return err
    key, secret = result
    if args.json:
        print(json.dumps({**key, "api_key": secret}))
    else:
        print(secret)
        say(f"API key {key['key_id']} for tenant {key['tenant']}: shown this once, only its hash is kept")
    return 0


def cmd_key_list(args) -> int:
    keys, err = admin_call(args, lambda a: a.list_keys(args.tenant or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(keys, indent=2))
    else:
        for k in keys:
            state = "revoked" if k["revoked"] else "active"
            print(f"{k['key_id']:<18} {k['tenant']:<20} {k['prefix']}...  {state}")
    return 0


def cmd_key_revoke(args) -> int:
    key, err = admin_call(args, lambda a: a.revoke_key(args.key_id))
    if err is not None:
        return err
    print(json.dumps(key) if args.json else f"revoked {key['key_id']} of tenant {key['tenant']}; "
          "routers refuse it within seconds")
    return 0


def register(sub) -> None:
    """`gaas tenant` and `gaas key`, with their actions."""
    tenant = sub.add_parser("tenant", help="tenants")
    tsub = tenant.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    tcreate = tsub.add_parser("create", help="create a tenant")
    tcreate.add_argument("name", help="lower-case letters, digits, '-' and '_'")
    tcreate.add_argument("--tier", choices=list(TIERS_BY_PRIORITY), default=DEFAULT_TIER, help=f"service tier ({DEFAULT_TIER})")
    add_admin_args(tcreate)
    tcreate.set_defaults(func=cmd_tenant_create)
    tset = tsub.add_parser("set", help="change a tenant's tier, quotas or Stripe customer",
                           description="Change a tenant's tier (its priority band and default quotas, deploy/gaas.yaml "
                           "qos), its own quotas (enforced across every router within a second; over them requests get "
                           "HTTP 429 rate_limit_exceeded with Retry-After), or the Stripe customer its usage is reported "
                           "to (meter events are sent once each usage window closes; an empty --stripe-customer stops it).")
    tset.add_argument("name")
    tset.add_argument("--tier", choices=list(TIERS_BY_PRIORITY), default=None, help="new service tier")
    tset.add_argument("--stripe-customer", default=None, metavar="CUS_ID", help="Stripe customer id (cus_...); '' removes it")
    for flag, what in (("rpm", "requests per minute"), ("tpm", "tokens per minute (prompt + completion)"),
                       ("concurrency", "requests at once")):
        tset.add_argument(f"--{flag}", type=_limit, default=_UNSET, metavar="N",
                          help=f"its own quota of {what}: N (0: unlimited), or 'default' for its tier's")
    add_admin_args(tset)
    tset.set_defaults(func=cmd_tenant_set)
    tlist = tsub.add_parser("list", help="list tenants")
    add_admin_args(tlist)
    tlist.set_defaults(func=cmd_tenant_list)

    key = sub.add_parser("key", help="API keys")
    ksub = key.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    kcreate = ksub.add_parser("create", help="create an API key for a tenant (printed once; only its hash is kept)")
    kcreate.add_argument("tenant")
    add_admin_args(kcreate)
    kcreate.set_defaults(func=cmd_key_create)
    klist = ksub.add_parser("list", help="list API keys (ids and prefixes, never the keys)")
    klist.add_argument("tenant", nargs="?", default="", help="only this tenant's keys")
    add_admin_args(klist)
    klist.set_defaults(func=cmd_key_list)
    krevoke = ksub.add_parser("revoke", help="revoke an API key by its id (see `gaas key list`)")
    krevoke.add_argument("key_id")
    add_admin_args(krevoke)
    krevoke.set_defaults(func=cmd_key_revoke)
