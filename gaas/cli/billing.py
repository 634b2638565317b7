"""`gaas usage`, `gaas budget set|show`, `gaas invoice preview` and `gaas batch list|show|cancel`: a
tenant's metered usage and cost, monthly budget, bill so far and batches, through billing's admin API."""

from __future__ import annotations

import json
from pathlib import Path

from gaas.cli.common import add_mesh_args, admin_call, fail, mesh_state, mesh_topology
from gaas.contracts.usage import USAGE_GROUPS


def _billing_address(args) -> str:
    """Where billing is reached: --billing, else billing-0's sidecar of the running mesh."""
    if getattr(args, "billing", None):
        return args.billing
    topo = mesh_topology(args, mesh_state(Path(args.run_dir)))
    return topo.of("billing")[0].inbound


def _billing_call(args, fn):
    from gaas.sdk.admin import BillingAdmin

    return admin_call(args, fn, BillingAdmin, _billing_address(args))


def _tokens(n: int) -> str:
    return f"{n:,}"


def _usd(amount: float) -> str:
    from gaas.contracts import pricing

    return pricing.format_usd(pricing.micros(amount))


def cmd_usage(args) -> int:
    from gaas.contracts import usage as metering
    from gaas.contracts.errors import GaasError

    try:
        now = metering.now_ms()
        start = metering.parse_time(args.since or "", "--since", now)
        end = metering.parse_time(args.until or "", "--until", now)
    except GaasError as exc:
        return fail(exc.message, 2)
    if end and end <= start:
        return fail("--until must be after --since", 2)
    report, err = _billing_call(args, lambda b: b.usage(args.tenant, start, end, args.by or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    header = f"{args.by or '':<26} {'requests':>10} {'prompt':>14} {'cached':>14} {'completion':>14} {'cost USD':>12}"
    print(header)

    def line(r: dict, label: str) -> None:
        print(f"{label:<26} {r['requests']:>10,} {_tokens(r['prompt_tokens']):>14} {_tokens(r['cached_tokens']):>14} "
              f"{_tokens(r['completion_tokens']):>14} {r['cost_usd']:>12.6f}")

    for r in report["rows"]:
        line(r, r["group"] or "(none)")
    line(report["total"], "total")
    return 0


def cmd_budget_set(args) -> int:
    budget, err = _billing_call(args, lambda b: b.set_budget(args.tenant, args.amount))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(budget))
    elif budget["amount_usd"]:
        print(f"tenant {budget['tenant']}: monthly budget {_usd(budget['amount_usd'])}, {_usd(budget['spent_usd'])} "
              f"spent in {budget['month']}; routers enforce it within seconds")
    else:
        print(f"tenant {budget['tenant']}: no budget (requests are not limited by spend)")
    return 0


def cmd_budget_show(args) -> int:
    budget, err = _billing_call(args, lambda b: b.get_budget(args.tenant))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(budget))
    else:
        amount = _usd(budget["amount_usd"]) if budget["amount_usd"] else "none"
        print(f"tenant {budget['tenant']}: monthly budget {amount}, {_usd(budget['spent_usd'])} spent in {budget['month']}")
    return 0


def cmd_invoice_preview(args) -> int:
    inv, err = _billing_call(args, lambda b: b.invoice_preview(args.tenant, args.month or ""))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(inv, indent=2))
        return 0
    print(f"invoice preview: tenant {inv['tenant']}, {inv['month'][:4]}-{inv['month'][4:]}, {inv['requests']:,} requests")
    for x in inv["lines"]:
        print(f"  {x['model']:<20} {x['kind']:<13} {x['tokens']:>14,} tokens  ${x['amount_usd']:>12.6f}")
    print(f"  {'total':<20} {'':<13} {'':>14}         ${inv['total_usd']:>12.6f}")
    b = inv["budget"]
    print(f"budget: {_usd(b['amount_usd']) + ' a month' if b['amount_usd'] else 'none'}")
    if inv["stripe_customer"]:
        print(f"Stripe customer {inv['stripe_customer']}: {inv['meter_events_sent']} meter events sent, "
              f"{inv['meter_events_pending']} waiting")
    else:
        print(f"no Stripe customer: set one with `gaas tenant set {inv['tenant']} --stripe-customer cus_...`")
    return 0


def _when(ts) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def cmd_batch_list(args) -> int:
    page, err = _billing_call(args, lambda b: b.batches(args.tenant or "", args.limit, args.after or ""))
    if err is not None:
        return err
    found, more = page
    if args.json:
        print(json.dumps({"batches": found, "has_more": more}, indent=2))
        return 0
    if not found:
        print("no batches" + (f" of tenant {args.tenant}" if args.tenant else ""))
        return 0
    print(f"{'batch':<38} {'tenant':<16} {'status':<11} {'done':>13} {'failed':>7}  {'created (UTC)':<19}  endpoint")
    for b in found:
        c = b["request_counts"]
        print(f"{b['id']:<38} {b['tenant']:<16} {b['status']:<11} {c['completed'] + c['failed']:>6}/{c['total']:<6} "
              f"{c['failed']:>7}  {_when(b['created_at']):<19}  {b['endpoint']}")
    if more:
        print(f"more: gaas batch list --after {found[-1]['id']}")
    return 0


def cmd_batch_show(args) -> int:
    b, err = _billing_call(args, lambda x: x.batch(args.batch_id))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(b, indent=2))
        return 0
    c = b["request_counts"]
    print(f"batch {b['id']}: {b['status']}")
    print(f"  tenant {b['tenant']} ({b['tier']}), billed at {b['price_factor']:g}x the tier's price")
    print(f"  {b['endpoint']}, input {b['input_file_id']}")
    print(f"  requests: {c['total']} total, {c['completed']} completed, {c['failed']} failed")
    for what in ("created", "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled"):
        if b.get(f"{what}_at"):
            print(f"  {what + ':':<13} {_when(b[f'{what}_at'])} UTC")
    print(f"  expires:      {_when(b['expires_at'])} UTC")
    for what in ("output_file_id", "error_file_id"):
        if b[what]:
            print(f"  {what.removesuffix('_id').replace('_', ' ')}: {b[what]}")
    for e in (b["errors"] or {}).get("data", []):
        print(f"  line {e['line'] or '-'}: {e['code']}: {e['message']}")
    return 0


def cmd_batch_cancel(args) -> int:
    b, err = _billing_call(args, lambda x: x.cancel_batch(args.batch_id))
    if err is not None:
        return err
    if args.json:
        print(json.dumps(b))
    else:
        print(f"batch {b['id']}: {b['status']} (requests not started never run; those running may finish)")
    return 0


def _billing_args(sp) -> None:
    """The options of a command that calls billing."""
    add_mesh_args(sp, workers=False)
    sp.add_argument("--billing", default=None, help="host:port of billing (default: billing-0's sidecar of the running mesh)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")


def register(sub) -> None:
    """`gaas usage`, `gaas budget` and `gaas invoice`, with their actions."""
    usage = sub.add_parser(
        "usage", help="a tenant's metered usage and cost, from the ledger",
        description="Requests, prompt / cached / completion tokens and cost of a tenant's requests, from the billing "
        "ledger (a request is there about a second after it ends). Times: an ISO 8601 date or time (UTC unless it "
        "names an offset), Unix seconds, or a duration back from now (30m, 24h, 7d). A tenant reads its own with its "
        "API key: GET /v1/gaas/usage?since=7d&by=model at the ingress.")
    usage.add_argument("tenant")
    usage.add_argument("--since", default=None, help="from (inclusive); default: the beginning")
    usage.add_argument("--until", default=None, help="to (exclusive); default: now")
    usage.add_argument("--by", choices=list(USAGE_GROUPS), default=None,
                       help="also break the total down (version: by model and version, e.g. across a roll-out; adapter: by LoRA adapter)")
    _billing_args(usage)
    usage.set_defaults(func=cmd_usage)

    batch = sub.add_parser(
        "batch", help="tenants' batches (OpenAI's /v1/batches): list, show, cancel",
        description="Batches that tenants created with POST /v1/batches: their requests run in the band below bronze, "
        "with what interactive traffic leaves idle, within 24 h; each billed once at the batch price "
        "(deploy/gaas.yaml: batches.price_factor).")
    bsub = batch.add_subparsers(dest="batch_command", required=True, metavar="ACTION")
    blist = bsub.add_parser("list", help="batches, newest first")
    blist.add_argument("--tenant", default=None, help="one tenant's (default: every tenant's)")
    blist.add_argument("--limit", type=int, default=20, help="at most this many (1-1000)")
    blist.add_argument("--after", default=None, help="the page after this batch id")
    _billing_args(blist)
    blist.set_defaults(func=cmd_batch_list)
    bshow = bsub.add_parser("show", help="one batch: its state, counts, times and files")
    bshow.add_argument("batch_id")
    _billing_args(bshow)
    bshow.set_defaults(func=cmd_batch_show)
    bcancel = bsub.add_parser("cancel", help="cancel a batch in progress (its requests not started never run)")
    bcancel.add_argument("batch_id")
    _billing_args(bcancel)
    bcancel.set_defaults(func=cmd_batch_cancel)

    budget = sub.add_parser("budget", help="tenants' monthly budgets (USD)")
    bsub = budget.add_subparsers(dest="budget_command", required=True, metavar="ACTION")
    bset = bsub.add_parser("set", help="set a tenant's monthly budget; 0 removes it",
                           description="Past its budget a tenant's requests are refused (HTTP 429 / RESOURCE_EXHAUSTED, "
                           "naming the budget) within seconds, until the budget is raised or the month (UTC) turns. "
                           "A request is admitted only if its most possible cost still fits.")
    bset.add_argument("tenant")
    bset.add_argument("amount", type=float, help="USD per month (0: no budget)")
    _billing_args(bset)
    bset.set_defaults(func=cmd_budget_set)
    bshow = bsub.add_parser("show", help="a tenant's budget and this month's spend")
    bshow.add_argument("tenant")
    _billing_args(bshow)
    bshow.set_defaults(func=cmd_budget_show)

    invoice = sub.add_parser("invoice", help="invoices")
    isub = invoice.add_subparsers(dest="invoice_command", required=True, metavar="ACTION")
    ipreview = isub.add_parser("preview", help="a tenant's month so far, as it would be invoiced",
                               description="Lines per model and token kind (input, cached input, output) at the "
                               "prices of deploy/gaas.yaml, the budget, and how much was reported to Stripe.")
    ipreview.add_argument("tenant")
    ipreview.add_argument("--month", default=None, help="YYYYMM (default: this month, UTC)")
    _billing_args(ipreview)
    ipreview.set_defaults(func=cmd_invoice_preview)
