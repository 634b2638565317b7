"""Batches at the router: the Files and Batch routes' calls to billing (which keeps files,
batches and items, services/billing/batches.py), and the runner that serves batch items.

The runner claims items from billing with a lease while this router has room for them: none
while any interactive request waits in its queue, at most GAAS_BATCH_CONCURRENCY at once. Each
item goes through the request pipeline like an OpenAI request of its tenant, as a batch item
(gaas.contracts.principal.Principal.batch): in the band below bronze in the router's queue and
windows and in vLLM's priority scheduling, so interactive requests are served first and a busy
router sheds items first; billed at the batch's price. Its request id is the item's, the same
on every run, so the ledger bills an item once even when it ran twice (a router that stopped
mid-item, its lease lapsed, another ran it).

An item runs as its batch's key's tenant now: the key (by its public id) is checked with control
before each item, as a request's key is (cached alike), and the item is admitted against the
tenant's current quotas and budget. A revoked key (or a removed tenant) fails the item and cancels
its batch. An item shed for the mesh's load is given back uncounted and the runner pauses; one that
lacks something of its own (its tenant's quota or budget, a worker for its model, session room) is
given back with the reason, backs off in billing and fails after ITEM_ATTEMPTS runs, while the
runner goes on with other tenants' items. Any other refusal is its answer (the error file); an
answer over MAX_ANSWER_BYTES is stopped as soon as it passes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from gaas.contracts import batches as terms, errors, jsonbody
from gaas.contracts.principal import Principal
from gaas.openai import api as openai_api, embeddings as openai_embeddings, stream as openai_stream
from gaas.runtime import status
from gaas.runtime.context import client_request_id_var, request_id_var, sanitize_client_id, tenant_var
from gaas.runtime.status import translate
from gaas.v1 import billing_pb2 as pb, billing_pb2_grpc
from services.router.auth import Authenticator
from services.router.openai_servicer import answer_check, embed, engine_requests
from services.router.pipeline import Pipeline, Timing

log = logging.getLogger(__name__)

BILLING_TIMEOUT = 10.0
# With nothing to run, billing is asked again this often.
IDLE_POLL_S = 1.0
# After an item was shed for the mesh's load, no new ones are claimed for this long.
BACKOFF_S = 2.0
# An engine chunk's protobuf is smaller than its JSON in the answer: an answer is stopped once its
# chunks pass MAX_ANSWER_BYTES, and refused whole once its JSON does.
_ANSWER_TOO_LARGE = (f"the answer passed {terms.MAX_ANSWER_BYTES} bytes, the most a batch answer may be: ask for "
                     "fewer choices (n), tokens (max_tokens) or top_logprobs")


def billing_error(exc: grpc.aio.AioRpcError, what: str) -> errors.GaasError:
    """Billing's answer as the caller's error: its refusals (not found, invalid, limits) pass as
    it wrote them; its silence is Unavailable."""
    if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                          grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION):
        log.warning("billing did not answer %s: %s %s", what, exc.code().name, exc.details())
    return status.from_peer(exc, "billing", passes=("NOT_FOUND", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED",
                                                    "FAILED_PRECONDITION"),
                            unanswered=status.ALL_CODES,
                            message=f"{what} cannot be reached now (billing does not answer); retry shortly")


class BatchFront:
    """The routes' calls to billing, each for the caller's own tenant."""

    def __init__(self, stub: billing_pb2_grpc.BillingStub) -> None:
        self._stub = stub

    async def call(self, method: str, request, what: str = "batches"):
        try:
            return await getattr(self._stub, method)(request, timeout=BILLING_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            raise billing_error(exc, what) from None

    async def read(self, tenant: str, file_id: str):
        """A file's bytes, in pieces as billing sends them."""
        try:
            async for chunk in self._stub.ReadFile(pb.FileRef(tenant=tenant, file_id=file_id), timeout=60.0):
                yield chunk.data
        except grpc.aio.AioRpcError as exc:
            raise billing_error(exc, "files") from None


def item_request_id(item: pb.BatchItem) -> str:
    """An item's request id: the same on every run of it (the ledger keeps one row per id)."""
    return f"batchreq-{item.batch_id.removeprefix(terms.BATCH_PREFIX)}-{item.index}"


class BatchRunner:
    """owners: an Authenticator whose keys are API keys' public ids (controlclient.key_lookup by
    key_id): whose each item is, now."""

    def __init__(self, pipeline: Pipeline, stub: billing_pb2_grpc.BillingStub, runner: str, concurrency: int,
                 max_body_bytes: int, busy: Callable[[], bool], owners: Authenticator) -> None:
        self._pipeline = pipeline
        self._stub = stub
        self._owners = owners
        self._runner = runner
        self._concurrency = concurrency
        self._max_body = max_body_bytes
        self._busy = busy
        # (batch id, index) -> the task running it.
        self._running: dict[tuple[str, int], asyncio.Task] = {}
        self._backoff_until = 0.0
        self.completed = 0

    def _ref(self, key: tuple[str, int]) -> pb.BatchItemRef:
        return pb.BatchItemRef(batch_id=key[0], index=key[1])

    async def run(self) -> None:
        renewing = asyncio.create_task(self._renew_loop(), name="batch-leases")
        fresh = True
        try:
            while True:
                room = self._concurrency - len(self._running)
                if room <= 0 or self._busy() or time.monotonic() < self._backoff_until:
                    await asyncio.sleep(0.2)
                    continue
                try:
                    claimed = await self._stub.ClaimBatchItems(pb.ClaimBatchItemsRequest(
                        runner=self._runner, max_items=room, lease_seconds=terms.LEASE_SECONDS, fresh=fresh),
                        timeout=BILLING_TIMEOUT)
                    fresh = False
                except grpc.aio.AioRpcError as exc:
                    log.info("batches: billing does not answer a claim (%s); trying again shortly", exc.code().name)
                    await asyncio.sleep(IDLE_POLL_S * 2)
                    continue
                if not claimed.items:
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                for item in claimed.items:
                    key = (item.batch_id, item.index)
                    task = asyncio.create_task(self._run_item(item), name=f"batch-item-{item.index}")
                    self._running[key] = task
                    task.add_done_callback(lambda _t, key=key: self._running.pop(key, None))
        finally:
            renewing.cancel()
            await self.stop()

    async def drain(self, wait_s: float) -> None:
        """Claim no more; give the items running here up to wait_s to finish (one stopped
        mid-way runs again elsewhere, billed once: for what its first run used)."""
        self._concurrency = 0
        if self._running:
            await asyncio.wait(list(self._running.values()), timeout=wait_s)

    async def stop(self) -> None:
        """Stop the items running here, giving them back to billing (claimable again at once)."""
        tasks = list(self._running.items())
        for _, task in tasks:
            task.cancel()
        await asyncio.gather(*(t for _, t in tasks), return_exceptions=True)
        if tasks:
            await self._release([k for k, _ in tasks])

    async def _release(self, keys: list[tuple[str, int]], reason: str = "") -> None:
        try:
            await self._stub.ReleaseBatchItems(pb.RenewBatchItemsRequest(
                runner=self._runner, items=[self._ref(k) for k in keys], reason=reason), timeout=BILLING_TIMEOUT)
        except grpc.aio.AioRpcError as exc:  # (their leases lapse instead)
            log.info("batches: cannot give back %d items (%s)", len(keys), exc.code().name)

    async def _renew_loop(self) -> None:
        """Every LEASE_RENEW_S, the running items' leases renewed; an item no longer this
        runner's (its batch cancelled or expired) is stopped."""
        while True:
            await asyncio.sleep(terms.LEASE_RENEW_S)
            keys = list(self._running)
            if not keys:
                continue
            try:
                kept = await self._stub.RenewBatchItems(pb.RenewBatchItemsRequest(
                    runner=self._runner, items=[self._ref(k) for k in keys], lease_seconds=terms.LEASE_SECONDS),
                    timeout=BILLING_TIMEOUT)
            except grpc.aio.AioRpcError as exc:
                log.info("batches: billing does not answer a renewal (%s)", exc.code().name)
                continue
            held = {(r.batch_id, r.index) for r in kept.items}
            for key in keys:
                if key not in held and (task := self._running.get(key)) is not None:
                    log.info("batch %s item %d: no longer this router's (its batch stopped); stopping it", *key)
                    task.cancel()

    async def _run_item(self, item: pb.BatchItem) -> None:
        request_id = item_request_id(item)
        request_id_var.set(request_id)
        tenant_var.set(item.owner.tenant)
        client_request_id_var.set(sanitize_client_id(item.custom_id))
        key = (item.batch_id, item.index)
        try:
            code, body = 200, await self._answer(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the item's answer, or given back
            err = translate(exc) or errors.Internal(errors.internal_message(request_id))
            if isinstance(err, errors.Unavailable) and err.reason == "overloaded":
                log.info("batch %s item %d given back (shed): %s", item.batch_id, item.index, err.message)
                self._backoff_until = time.monotonic() + BACKOFF_S
                await self._release([key])
                return
            if err.retryable or isinstance(err, (errors.Unavailable, errors.DeadlineExceeded, errors.ResourceExhausted)):
                log.info("batch %s item %d given back: %s", item.batch_id, item.index, err.message)
                await self._release([key], err.message)
                return
            code, body = err.info.http_status, openai_stream.dumps(errors.openai_error(err))
            if isinstance(err, errors.Unauthenticated):
                await self._complete(item, code, body, request_id)
                await self._cancel(item, err.message)
                return
        await self._complete(item, code, body, request_id)

    async def _cancel(self, item: pb.BatchItem, why: str) -> None:
        """The item's batch cancelled: its key was revoked (or its tenant removed)."""
        log.warning("batch %s of %s cancelled: %s", item.batch_id, item.owner.tenant, why)
        try:
            await self._stub.CancelBatch(pb.BatchRef(tenant=item.owner.tenant, batch_id=item.batch_id),
                                         timeout=BILLING_TIMEOUT)
        except grpc.aio.AioRpcError as exc:  # (each of its items is refused alike until it is)
            log.info("batches: cannot cancel batch %s (%s)", item.batch_id, exc.code().name)

    async def _answer(self, item: pb.BatchItem) -> bytes:
        """The item's answer, as POST {endpoint} answers it without streaming."""
        body = jsonbody.parse(item.body, self._max_body)
        if item.endpoint == "/v1/embeddings":
            return await self._embeddings(item, openai_embeddings.parse_embedding(body))
        parse = openai_api.parse_chat if item.endpoint == "/v1/chat/completions" else openai_api.parse_completion
        parsed = parse(body)
        if parsed.stream:
            raise errors.InvalidArgument("a batch request cannot be streamed", param="stream")
        principal = await self._principal(item.owner)
        g = await self._pipeline.start(principal, engine_requests(parsed), Timing(), check=answer_check(parsed),
                                       price_factor=item.price_factor)
        fmt = openai_stream.Formatter(parsed, g.request_id, g.prepared[0].model.served_name)
        usage = openai_stream.Usage(prompt=sum(p.prompt_tokens for p in g.prepared))
        chunks = bounded(self._pipeline.stream(g, None, {}))
        try:
            pieces, size = [], 0
            async for b in openai_stream.respond(parsed, fmt, usage, chunks):
                size += len(b.data)
                if size > terms.MAX_ANSWER_BYTES:
                    raise errors.InvalidArgument(_ANSWER_TOO_LARGE, reason="answer_too_large")
                pieces.append(b.data)
            return b"".join(pieces)
        finally:
            await chunks.aclose()

    async def _embeddings(self, item: pb.BatchItem, parsed: openai_embeddings.EmbeddingRequest) -> bytes:
        g, last = await embed(self._pipeline, await self._principal(item.owner), parsed, Timing(), None, {},
                              price_factor=item.price_factor)
        answer = openai_embeddings.embeddings_json(g.request_id,
                                                   g.prepared[0].model.served_name, last.embeddings,
                                                   last.usage.prompt_tokens, parsed.encoding_format)
        if len(answer) > terms.MAX_ANSWER_BYTES:
            raise errors.InvalidArgument(f"the answer is {len(answer)} bytes, over {terms.MAX_ANSWER_BYTES}, the most a "
                                         "batch answer may be: send fewer inputs per line, or encoding_format base64",
                                         reason="answer_too_large")
        return answer

    async def _principal(self, o: pb.BatchOwner) -> Principal:
        """The batch's key's tenant now, as a batch item (a revoked key: Unauthenticated)."""
        now = await self._owners.authenticate(f"Bearer {o.key_id}")
        if now.tenant != o.tenant:
            raise errors.Unauthenticated(f"the batch's API key is no longer tenant {o.tenant}'s")
        return Principal(now.tenant, now.tier, o.key_id, o.cache_salt, limits=now.limits, batch=True)

    async def _complete(self, item: pb.BatchItem, code: int, body: bytes, request_id: str) -> None:
        """The answer kept in billing; while billing does not answer, tried again (until the
        item's lease would have lapsed: then another run answers it)."""
        give_up = time.monotonic() + terms.LEASE_SECONDS
        request = pb.CompleteBatchItemRequest(runner=self._runner, item=self._ref((item.batch_id, item.index)),
                                              status_code=code, body=body, request_id=request_id)
        while True:
            try:
                await self._stub.CompleteBatchItem(request, timeout=BILLING_TIMEOUT)
                self.completed += 1
                return
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > give_up:
                    log.warning("batch %s item %d: billing did not take its answer (%s); it runs again",
                                item.batch_id, item.index, exc.code().name)
                    return
                await asyncio.sleep(1.0)


async def bounded(chunks):
    """The engine's chunks, stopped (InvalidArgument answer_too_large) once they pass
    MAX_ANSWER_BYTES: the engine stops generating what no answer could hold."""
    size = 0
    try:
        async for which, c in chunks:
            size += c.ByteSize()
            if size > terms.MAX_ANSWER_BYTES:
                raise errors.InvalidArgument(_ANSWER_TOO_LARGE, reason="answer_too_large")
            yield which, c
    finally:
        await chunks.aclose()
