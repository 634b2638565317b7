"""gaas.v1.Billing: protobuf <-> ledger, budgets and the Stripe sync."""

from __future__ import annotations

from gaas.contracts import errors, pricing, usage
from gaas.contracts.jsonbody import is_digits
from gaas.v1 import billing_pb2 as pb
from gaas.v1 import billing_pb2_grpc
from gaas.contracts import batches as batch_terms
from services.billing.batches import BatchStore
from services.billing.budgets import Budgets
from services.billing.consumer import UsageConsumer
from services.billing.ledger import Ledger, UsageRow
from services.billing.stripe_sync import StripeSync


def row_pb(r: UsageRow) -> pb.UsageRow:
    return pb.UsageRow(
        group=r.group, requests=r.requests, prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
        completion_tokens=r.completion_tokens, cost_micros=r.cost_micros,
        cost_usd=pricing.usd(r.cost_micros), sessions=r.sessions,
    )


class BillingServicer(billing_pb2_grpc.BillingServicer):
    def __init__(
        self, ledger: Ledger, budgets: Budgets, sync: StripeSync, consumer: UsageConsumer,
        customers=None, disabled_reason: str = "", batches: BatchStore | None = None,
    ) -> None:
        self._batches = batches
        self._ledger = ledger
        self._budgets = budgets
        self._sync = sync
        self._consumer = consumer
        self._customers = customers
        self._disabled_reason = disabled_reason

    @staticmethod
    def _tenant(tenant: str) -> str:
        if not tenant:
            raise errors.InvalidArgument("tenant is required", param="tenant")
        return tenant

    async def GetUsage(self, request: pb.GetUsageRequest, context) -> pb.UsageReport:
        tenant = self._tenant(request.tenant)
        if request.end_unix_ms and request.end_unix_ms <= request.start_unix_ms:
            raise errors.InvalidArgument("end_unix_ms must be after start_unix_ms", param="end_unix_ms")
        if request.group_by and request.group_by not in usage.USAGE_GROUPS:
            raise errors.InvalidArgument(f"group_by must be {', '.join(usage.USAGE_GROUPS)}", param="group_by")
        total = await self._ledger.totals(tenant, request.start_unix_ms, request.end_unix_ms)
        rows = (
            await self._ledger.usage(tenant, request.start_unix_ms, request.end_unix_ms, request.group_by)
            if request.group_by else []
        )
        return pb.UsageReport(tenant=tenant, total=row_pb(total), rows=[row_pb(r) for r in rows])

    async def _budget(self, tenant: str) -> pb.Budget:
        month = usage.month_of(usage.now_ms())
        return pb.Budget(
            tenant=tenant, amount_usd=pricing.usd(await self._budgets.get(tenant)), month=month,
            spent_usd=pricing.usd(await self._budgets.spent(tenant, month)),
        )

    async def SetBudget(self, request: pb.SetBudgetRequest, context) -> pb.Budget:
        tenant = self._tenant(request.tenant)
        if not 0 <= request.amount_usd <= 1e9 or request.amount_usd != request.amount_usd:
            raise errors.InvalidArgument("amount_usd must be between 0 (no budget) and 1e9", param="amount_usd")
        await self._budgets.set(tenant, pricing.micros(request.amount_usd))
        return await self._budget(tenant)

    async def GetBudget(self, request: pb.GetBudgetRequest, context) -> pb.Budget:
        return await self._budget(self._tenant(request.tenant))

    async def GetInvoicePreview(self, request: pb.GetInvoicePreviewRequest, context) -> pb.InvoicePreview:
        tenant = self._tenant(request.tenant)
        month = request.month or usage.month_of(usage.now_ms())
        if len(month) != 6 or not is_digits(month) or not 1 <= int(month[4:]) <= 12:
            raise errors.InvalidArgument("month is YYYYMM, e.g. 202611", param="month")
        start, end = usage.month_bounds(month)
        lines, total, requests = [], 0, 0
        for model, n, uncached, cached, output, c_in, c_cached, c_out in await self._ledger.invoice_lines(tenant, start, end):
            requests += n
            for kind, tokens, cost in (("input", uncached, c_in), ("cached_input", cached, c_cached), ("output", output, c_out)):
                if tokens:
                    lines.append(pb.InvoiceLine(model=model, kind=kind, tokens=tokens, amount_usd=pricing.usd(cost)))
                    total += cost
        counts = await self._sync.counts(tenant, start, end)
        customers = await self._customers(max_age=0) if self._customers else {}  # as control has it now
        return pb.InvoicePreview(
            tenant=tenant, month=month, lines=lines, total_usd=pricing.usd(total), requests=requests,
            budget=await self._budget(tenant), stripe_customer=customers.get(tenant, ""),
            meter_events_sent=counts.sent, meter_events_pending=counts.pending,
        )

    async def GetStatus(self, request: pb.GetBillingStatusRequest, context) -> pb.BillingStatus:
        counts = await self._sync.counts()
        return pb.BillingStatus(
            stripe_enabled=self._sync.enabled, stripe_disabled_reason=self._disabled_reason,
            outbox_pending=counts.pending, outbox_sent=counts.sent, outbox_failed=counts.failed,
            outbox_expired=counts.expired, outbox_reconcile=counts.reconcile, last_stripe_error=self._sync.last_error,
            stream_backlog=max(0, await self._consumer.backlog()), ledger_rows=await self._ledger.rows(),
            dead_letters=await self._ledger.dead_letters(),
        )

    # ------------------------------------------------------------ batches

    def _store(self) -> BatchStore:
        if self._batches is None:
            raise errors.Unimplemented("this billing service keeps no batches")
        return self._batches

    async def CreateFile(self, request: pb.CreateFileRequest, context) -> pb.BatchFile:
        return await self._store().files.create(self._tenant(request.tenant), request.filename, request.purpose,
                                                request.data)

    async def GetFile(self, request: pb.FileRef, context) -> pb.BatchFile:
        return await self._store().files.get(self._tenant(request.tenant), request.file_id)

    async def ListFiles(self, request: pb.ListFilesRequest, context) -> pb.BatchFileList:
        if request.limit > 10_000:
            raise errors.InvalidArgument("limit must be between 1 and 10000", param="limit")
        files, more = await self._store().files.list(self._tenant(request.tenant), request.purpose,
                                                     request.limit or 10_000, request.after, request.order)
        return pb.BatchFileList(files=files, has_more=more)

    async def DeleteFile(self, request: pb.FileRef, context) -> pb.BatchFile:
        return await self._store().files.delete(self._tenant(request.tenant), request.file_id)

    async def ReadFile(self, request: pb.FileRef, context):
        pieces = await self._store().files.read(self._tenant(request.tenant), request.file_id)
        sent = False
        async for piece in pieces:
            yield pb.FileChunk(data=piece)
            sent = True
        if not sent:
            yield pb.FileChunk()

    async def CreateBatch(self, request: pb.CreateBatchRequest, context) -> pb.Batch:
        self._tenant(request.owner.tenant)
        if request.endpoint not in batch_terms.ENDPOINTS:
            raise errors.InvalidArgument(f"endpoint must be one of {', '.join(batch_terms.ENDPOINTS)}", param="endpoint")
        return await self._store().create_batch(request.owner, request.input_file_id, request.endpoint,
                                                dict(request.metadata))

    async def GetBatch(self, request: pb.BatchRef, context) -> pb.Batch:
        return await self._store().get_batch(request.tenant, request.batch_id)

    async def ListBatches(self, request: pb.ListBatchesRequest, context) -> pb.BatchList:
        if request.limit > 1000:
            raise errors.InvalidArgument("limit must be between 1 and 1000", param="limit")
        found, more = await self._store().list_batches(request.tenant, request.limit or 20, request.after)
        return pb.BatchList(batches=found, has_more=more)

    async def CancelBatch(self, request: pb.BatchRef, context) -> pb.Batch:
        return await self._store().cancel_batch(request.tenant, request.batch_id)

    async def ClaimBatchItems(self, request: pb.ClaimBatchItemsRequest, context) -> pb.ClaimedBatchItems:
        items = await self._store().claim(request.runner, min(request.max_items, 256),
                                          request.lease_seconds or batch_terms.LEASE_SECONDS, request.fresh)
        return pb.ClaimedBatchItems(items=items)

    async def RenewBatchItems(self, request: pb.RenewBatchItemsRequest, context) -> pb.RenewBatchItemsResponse:
        kept = await self._store().renew(request.runner, request.items,
                                         request.lease_seconds or batch_terms.LEASE_SECONDS)
        return pb.RenewBatchItemsResponse(items=kept)

    async def ReleaseBatchItems(self, request: pb.RenewBatchItemsRequest, context) -> pb.RenewBatchItemsResponse:
        await self._store().release(request.runner, request.items, request.reason)
        return pb.RenewBatchItemsResponse()

    async def CompleteBatchItem(self, request: pb.CompleteBatchItemRequest, context) -> pb.CompleteBatchItemResponse:
        recorded = await self._store().complete(request.runner, request.item, request.status_code or 200,
                                                request.body, request.request_id)
        return pb.CompleteBatchItemResponse(recorded=recorded)

