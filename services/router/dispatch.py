"""Taking a generation to a worker: resolve the model, tokenize the prompt once (the worker gets
token ids), check the request against the model, hash its blocks and ask the KV directory where
its prefix lives (the one async step before scheduling), schedule (filters, scorers, picker) within
the workers' batching windows, or wait in the router's queue by priority band when no window has
room (services/router/flow.py), forward the stream through the sidecar (naming the worker in
x-gaas-worker) with the tier's engine priority, relay the chunks, and tell the flow how the worker
did (first token time, failures: windows and circuit breakers). Retries on another worker only
while no token has been relayed, so a client never sees a token twice.

Both public APIs (gaas.v1.Inference and the OpenAI-compatible one) go through here; failures are
gaas.contracts.errors, which the server interceptor turns into statuses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from prometheus_client import Counter, Histogram

from gaas.contracts import errors, genrequest, kvhash, latency, qos
from gaas.runtime import status
from gaas.runtime.context import WORKER_HEADER
from gaas.model.tokenizer import ChatMessage, PromptPrefix, Tokenizer
from gaas.v1 import common_pb2, inference_pb2, worker_pb2, worker_pb2_grpc
from services.router.activity import TenantActivity
from services.router.breakers import prompt_work
from gaas.contracts.principal import Principal
from services.router.coalescing import Coalescing
from services.router.directory import MeshDirectory, ModelEntry
from services.router.flow import Flow
from services.router.kvclient import KVDirectoryClient
from services.router.scheduling import Candidate, RequestContext, Scheduler, WorkerId

log = logging.getLogger(__name__)

# Codes that mean "this worker could not take the request": another may.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
# Whom the KV directory counts blocks under a public prefix for.
PUBLIC_OWNER = "(public)"
# Prompts longer than this are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 8192
# How long a call whose client left before its first chunk still waits for it (the worker's own
# bound, services.worker.engine.ABANDONED_FIRST_OUTPUT_S, and a little more).
ABANDONED_FIRST_CHUNK_S = 35.0


@dataclass(slots=True)
class Prepared:
    """A request ready for a worker: its model resolved, its prompt as token ids."""

    model: ModelEntry
    request: inference_pb2.GenerateRequest
    prompt_tokens: int
    # The prefix-cache salt: the tenant's, or a public prefix's when the prompt begins with one.
    cache_salt: str
    # The prompt's block hashes, and the KV directory's answer for them: asked for as soon as the
    # prompt is tokenized, so that it overlaps the tenant's admission (None: not asked, when
    # routing has no use for it).
    block_hashes: list[int] = field(default_factory=list)
    prefix_lookup: asyncio.Task | None = None
    # A session turn: the worker that served the session's last turn ("": none).
    session_worker: str = ""
    # Under a public prefix's salt: the prompt's leading tokens that are the prefix's own, the
    # most cached tokens its usage may say (None: the tenant's own salt).
    cached_cap: int | None = None


def public_prefix(model: ModelEntry, request: inference_pb2.GenerateRequest) -> tuple[str, str] | None:
    """(id, text) of the public prefix a request begins with: its chat opens with that system
    prompt, or its text prompt begins with it."""
    for prefix_id, text in model.public_prefixes:
        if request.messages:
            first = request.messages[0]
            if first.role in ("system", "developer") and first.content == text:
                return prefix_id, text
        elif request.prompt.startswith(text):
            return prefix_id, text
    return None


def cache_salt(shared: tuple[str, str] | None, tenant_salt: str) -> str:
    """The salt a request's blocks are cached under: the public prefix's it begins with (shared,
    from public_prefix), else the tenant's own."""
    return f"public:{shared[0]}" if shared else tenant_salt


def shared_tokens(tok: Tokenizer, request: inference_pb2.GenerateRequest, text: str, ids: list[int]) -> int:
    """How many of the prompt's leading token ids (ids) are the public prefix's own (text, as the
    request's first message or the start of its prompt): where they stop, the tenant's own part
    begins, whose cache hits under the shared salt would be other tenants' continuations."""
    if request.messages:
        first = request.messages[0]
        own = tok.encode_chat([ChatMessage(first.role, text)], False, False, request.add_special_tokens)
    else:
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        own = tok.encode(text, special)
    n = 0
    for a, b in zip(own, ids):
        if a != b:
            break
        n += 1
    return n


class Inflight:
    """Requests this router sent each worker, with when: what a worker's last load report cannot
    know yet is added to it (so a burst does not pile onto the worker that looked idle)."""

    def __init__(self) -> None:
        self._started: dict[WorkerId, dict[int, int]] = {}
        self._next = 0

    def start(self, worker: WorkerId) -> int:
        self._next += 1
        self._started.setdefault(worker, {})[self._next] = int(time.time() * 1000)
        return self._next

    def finish(self, worker: WorkerId, token: int) -> None:
        self._started.get(worker, {}).pop(token, None)

    def since(self, worker: WorkerId, reported_ms: int) -> int:
        """Requests still running that were sent to worker after it reported at reported_ms."""
        return sum(1 for t in self._started.get(worker, {}).values() if t > reported_ms)

    @property
    def total(self) -> int:
        return sum(len(v) for v in self._started.values())


@dataclass(frozen=True, slots=True)
class RouterMetrics:
    """What the dispatcher records, when the server gives it a registry."""

    # Requests sent, by policy and worker.
    routed: Counter | None = None
    # Engines serving fewer cached tokens than the directory said they held.
    prediction_misses: Counter | None = None
    lookup_seconds: Histogram | None = None
    # The latency decomposition of every request, by part (gaas.contracts.latency) and tier.
    latency_seconds: Histogram | None = None
    # Requests by model, tier and outcome (a finish reason: stop, length...; a status: UNAVAILABLE...;
    # or cancelled), and their tokens by kind (prompt, completion, cached): cached / prompt is the
    # prefix cache's hit ratio.
    requests: Counter | None = None
    tokens: Counter | None = None
    # The ingress's arrival to the first token, and the time per output token after it.
    ttft_seconds: Histogram | None = None
    tpot_seconds: Histogram | None = None


@dataclass(slots=True)
class DirectPlacement:
    """A request placed for the ingress to send straight to its worker (Dispatcher.place_direct):
    its room in the worker's window and its place in flight are held until ended() says how the
    worker did."""

    dispatcher: "Dispatcher"
    prepared: Prepared
    principal: Principal
    worker: Candidate
    request: worker_pb2.WorkerGenerateRequest
    queued_s: float
    token: int
    # Leading blocks of the prompt the KV directory said the worker holds.
    confirmed_blocks: int = 0
    # Where the ingress sends it should the worker not take it (None: no other worker).
    fallback: Candidate | None = None
    done: bool = False

    @property
    def addresses(self) -> str:
        """What the ingress is told (x-gaas-worker): the worker, then the second choice."""
        return ",".join(w.address for w in (self.worker, self.fallback) if w is not None)

    def ended(self, code: grpc.StatusCode | None, detail: str = "", final: common_pb2.GenerateChunk | None = None) -> None:
        """The request is over. code: the worker's status (None: unknown, the client went away or
        the ingress never reached the worker); final: the worker's final chunk, without its text
        (usage, finish reason, the latency decomposition), when it finished."""
        if self.done:
            return
        self.done = True
        self.dispatcher.end_direct(self, code, detail, final)


class Dispatcher:
    def __init__(
        self,
        directory: MeshDirectory,
        scheduler: Scheduler,
        worker_stub: worker_pb2_grpc.WorkerStub,
        tokenizer_for: Callable[[ModelEntry], Tokenizer],
        *,
        retries: int,
        max_stream_seconds: float,
        kv: KVDirectoryClient | None = None,
        metrics: RouterMetrics = RouterMetrics(),
        flow: Flow | None = None,
        activity: TenantActivity | None = None,
        coalescing: Coalescing = Coalescing(),
    ) -> None:
        self._coalescing = coalescing
        self._directory = directory
        self.activity = activity or TenantActivity()
        self._scheduler = scheduler
        self._workers = worker_stub
        self._tokenizer_for = tokenizer_for
        self._tokenizers: dict[str, Tokenizer] = {}
        self._retries = retries
        self._max_stream_seconds = max_stream_seconds
        self._kv = kv
        self._metrics = metrics
        self._inflight = Inflight()
        self._flow = flow or Flow(qos.DEFAULT_POLICIES)
        self._last_miss_log = 0.0
        # Calls whose client left before their first chunk, running on to it.
        self._abandoned: set[asyncio.Future] = set()

    @property
    def flow(self) -> Flow:
        return self._flow

    @property
    def in_flight(self) -> int:
        """Requests streaming now (what /load reports)."""
        return self._inflight.total

    async def models(self) -> list[tuple[ModelEntry, int]]:
        """The deployed models, each with how many serving workers it has now."""
        snap = await self._directory.snapshot()
        ready: dict[str, int] = {}
        for w in snap.workers:
            ready[w.model] = ready.get(w.model, 0) + 1
        return [(m, ready.get(m.name, 0)) for m in snap.models]

    async def engine_version(self) -> str:
        """The engine version the serving workers report (one of them, should they differ)."""
        versions = sorted({w.engine_version for w in (await self._directory.snapshot()).workers if w.engine_version})
        return versions[0] if versions else "unknown"

    async def resolve_model(self, name: str) -> ModelEntry:
        return await self._directory.resolve_model(name)

    async def tokenizer(self, model: ModelEntry) -> Tokenizer:
        # Loaded once per model source, in a thread (it reads files); then taken from here
        # without leaving the event loop (a thread handoff per request costs more than tokenizing).
        if (tok := self._tokenizers.get(model.source)) is not None:
            return tok
        try:
            tok = await asyncio.to_thread(self._tokenizer_for, model)
        except (OSError, ValueError) as exc:
            log.error("cannot load the tokenizer of %s from %s: %s", model.name, model.source, exc)
            raise errors.Unavailable(f"model {model.name!r} cannot be served: its tokenizer is missing on this router") from None
        self._tokenizers[model.source] = tok
        return tok

    async def prepare(self, request: inference_pb2.GenerateRequest, principal: Principal,
                      prefix: PromptPrefix | None = None) -> Prepared:
        """Resolve the model, tokenize the prompt (chat template applied), check what the worker
        will get: the prompt as token ids and an explicit max_tokens. prefix: the token ids of how
        a session's last prompt began, reused when this one begins the same way (and updated)."""
        if len(request.model) > genrequest.MAX_MODEL_NAME:
            raise errors.InvalidArgument(f"'model' is at most {genrequest.MAX_MODEL_NAME} characters", param="model")
        model = await self.resolve_model(request.model)
        genrequest.check(request, model.max_model_len or None)
        workers = await self._directory.workers(model.name)  # a model nobody serves is refused before any work
        tok = await self.tokenizer(model)
        forwarded = inference_pb2.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.model = model.name
        ids = await self.tokenize(tok, request, prefix)
        if not ids:
            raise errors.InvalidArgument("the prompt has no tokens", param="prompt")
        forwarded.ClearField("prompt")
        forwarded.ClearField("messages")
        forwarded.ClearField("add_special_tokens")
        forwarded.ClearField("add_generation_prompt")
        forwarded.ClearField("continue_final_message")
        forwarded.prompt_token_ids[:] = ids
        what = "messages" if request.messages else "prompt"
        limit = model.max_model_len
        if not forwarded.max_tokens:
            forwarded.max_tokens = genrequest.DEFAULT_MAX_TOKENS if not request.messages else limit - len(ids)
        if limit and len(ids) + forwarded.max_tokens > limit:
            if forwarded.max_tokens < 1 or len(ids) >= limit:
                raise genrequest.no_room_error(limit, len(ids), what)
            raise genrequest.context_error(limit, len(ids), forwarded.max_tokens, what)
        genrequest.check(forwarded, limit or None, tok.vocab_size)
        shared = public_prefix(model, request)
        prepared = Prepared(model, forwarded, len(ids), cache_salt(shared, principal.cache_salt))
        if shared is not None:
            prepared.cached_cap = shared_tokens(tok, request, shared[1], ids)
        self._ask_prefix(prepared, workers)
        return prepared

    def _ask_prefix(self, prepared: Prepared, workers) -> None:
        """Hash the prompt's blocks and start the KV directory lookup without waiting for it.
        With one worker to choose from its answer could change nothing: neither is done (5 ms of
        hashing for a 32K-token prompt)."""
        block_size = workers[0].block_size if workers else 0
        if self._kv is None or not self._scheduler.needs_prefix or not block_size or len(workers) < 2:
            return
        prepared.block_hashes = kvhash.prefix_hashes(prepared.request.prompt_token_ids, block_size, prepared.cache_salt)
        if prepared.block_hashes:
            task = asyncio.create_task(self._lookup(prepared.block_hashes))
            # A request refused at admission never reads it.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            prepared.prefix_lookup = task

    async def _lookup(self, hashes: list[int]) -> tuple[dict, dict]:
        started = time.perf_counter()
        found = await self._kv.lookup(hashes)
        if self._metrics.lookup_seconds is not None:
            self._metrics.lookup_seconds.observe(time.perf_counter() - started)
        return found

    async def tokenize(self, tok: Tokenizer, request: inference_pb2.GenerateRequest,
                       prefix: PromptPrefix | None = None) -> list[int]:
        """The token ids of request's prompt or messages (as its fields say: special tokens, the
        generation prompt); a long one is tokenized off the event loop."""
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.messages:
            messages = [ChatMessage(m.role, m.content) for m in request.messages]
            agp = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
            if prefix is not None and not request.add_special_tokens:
                text = tok.render_chat(messages, agp, request.continue_final_message)
                args, fn, size = (text, prefix), tok.encode_continuing, tok.continued_chars(text, prefix)
            else:
                args = (messages, agp, request.continue_final_message, request.add_special_tokens)
                fn = tok.encode_chat
                size = sum(len(m.content) for m in messages)
        else:
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            args, fn, size = (request.prompt, special), tok.encode, len(request.prompt)
        if size > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    def _worker_failure(self, worker: WorkerId, exc: grpc.aio.AioRpcError, sent_any: bool, request_id: str) -> errors.GaasError:
        """What the client is told when worker failed the request (its detail stays in the log)."""
        code = exc.code()
        log.warning("worker %s failed (%s: %s)%s", worker, code.name, exc.details(), " mid-stream" if sent_any else "")
        if sent_any:
            return errors.Unavailable(
                f"the worker serving this request failed after it had streamed tokens (request id {request_id}); "
                "the request may be retried"
            )
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return errors.Unavailable("no worker could take the request right now; retry shortly")
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS):
            return errors.Internal(errors.internal_message(request_id))
        # The worker's own answers (invalid argument, busy...) are written for the caller.
        return status.from_rpc(exc)

    async def _context(self, prepared: Prepared, principal: Principal, workers) -> tuple[RequestContext, dict]:
        """The scheduler's view of the request, with the directory's prefix answer gathered."""
        req = prepared.request
        ctx = RequestContext(
            model=prepared.model.name, tenant=principal.tenant, tier=principal.tier,
            prompt_tokens=prepared.prompt_tokens, max_tokens=req.max_tokens,
            session_worker=WorkerId(prepared.session_worker),
        )
        confirmed: dict = {}
        ctx.block_hashes = prepared.block_hashes
        if prepared.prefix_lookup is not None:
            ctx.prefix, confirmed = await prepared.prefix_lookup
        ctx.inflight = {w.worker_id: self._inflight.since(w.worker_id, w.load.reported_ms) for w in workers}
        return ctx, confirmed

    def _check_prediction(self, worker: WorkerId, confirmed: int, block_size: int, cached_tokens: int) -> None:
        """The directory said the worker's engine holds `confirmed` leading blocks; the engine
        served fewer from its cache. Now and then an eviction in between; always, a disagreement
        between the router's hashes and the engine's blocks: counted, and logged."""
        if confirmed < 2 or cached_tokens >= (confirmed - 1) * block_size:
            return
        if self._metrics.prediction_misses is not None:
            self._metrics.prediction_misses.inc()
        now = time.monotonic()
        if now - self._last_miss_log > 30:
            self._last_miss_log = now
            log.warning(
                "the KV directory said %s holds %d blocks of this prompt, but its engine served %d tokens from cache "
                "(an eviction in between, or hashes that disagree: see `gaas kv stats`)",
                worker, confirmed, cached_tokens,
            )

    def observe_latency(self, t: common_pb2.Timings, tier: str) -> None:
        """Record a request's latency decomposition once it is complete (after metering: the
        servicers call this on the last chunk they release)."""
        h = self._metrics.latency_seconds
        if h is None:
            return
        for part in latency.PARTS:
            h.labels(part, tier).observe(latency.part_ms(t, part) / 1000)
        h.labels("total", tier).observe(t.total_ms / 1000)

    async def stream(
        self,
        prepared: Prepared,
        principal: Principal,
        request_id: str,
        time_remaining: float | None,
        arrived: float,
        tenant_s: float = 0.0,
        ingress_s: float = 0.0,
        on_abandoned: Callable[[asyncio.Future], None] | None = None,
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        """The chunks of a prepared request, from whichever worker the scheduler picks. arrived:
        the router's arrival (perf_counter); tenant_s: its admission so far; ingress_s: ingress to
        router. The last chunk carries the request's latency decomposition (latency.complete).
        Each request is counted by its outcome, with its tokens, TTFT and time per output token.
        on_abandoned: told, with a future of the worker's first chunk, when the client leaves after
        the request reached a worker and before that chunk (the metering side bills it)."""
        m = self._metrics
        labels = (prepared.model.name, principal.tier)
        outcome = "cancelled"
        first_at = None
        tokens = 0
        self.activity.started(principal.tenant, principal.tier)
        try:
            async for chunk in self._stream(prepared, principal, request_id, time_remaining, arrived, tenant_s,
                                            ingress_s, on_abandoned):
                if first_at is None and chunk.token_ids:
                    first_at = time.perf_counter()
                    if m.ttft_seconds is not None:
                        m.ttft_seconds.labels(*labels).observe(ingress_s + first_at - arrived)
                if chunk.HasField("usage"):
                    outcome = common_pb2.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()
                    tokens = self._count(labels, chunk.usage,
                                         None if first_at is None else time.perf_counter() - first_at)
                yield chunk
        except errors.GaasError as exc:
            outcome = exc.code
            raise
        except Exception:  # (a client going away stops the generator: outcome stays "cancelled")
            outcome = "INTERNAL"
            raise
        finally:
            self.activity.finished(principal.tenant, tokens)
            if m.requests is not None:
                m.requests.labels(*labels, outcome).inc()

    async def _place(
        self, prepared: Prepared, principal: Principal, ctx: RequestContext, workers, time_remaining: float | None,
        span, attempt: int = 0,
    ):
        """One placement: the scheduler's pick within the windows (waiting in the queue when they
        are full), the decision on the request's span, the prefix's blocks provisioned where they
        will be, the request counted in flight there. Returns (worker, seconds queued, in-flight token,
        every candidate's score)."""
        placing = time.perf_counter()
        decision = await self._flow.place(self._scheduler, ctx, workers, principal.tier, principal.tenant, time_remaining)
        queued_s = time.perf_counter() - placing
        worker = decision.worker
        if span.is_recording():
            span.set_attributes({
                "gaas.worker": worker.worker_id, "gaas.policy": self._scheduler.name, "gaas.attempt": attempt,
                "gaas.queue_ms": round(queued_s * 1000, 3),
                "gaas.prefix_tokens": ctx.prefix.get(worker.worker_id, 0) * worker.block_size,
                "gaas.scores": ", ".join(f"{w}={s:.3g}" for w, s in sorted(decision.scores.items())),
            })
        if ctx.block_hashes and self._kv is not None and len(workers) > 1:
            # Where the blocks will be, before the engine says so (with one worker nothing
            # is decided by it; the engine's own events tell the directory).
            owner = principal.tenant if prepared.cache_salt == principal.cache_salt else PUBLIC_OWNER
            self._kv.provision(worker.worker_id, ctx.block_hashes, owner)
        if self._metrics.routed is not None:
            self._metrics.routed.labels(self._scheduler.name, worker.worker_id).inc()
        return worker, queued_s, self._inflight.start(worker.worker_id), decision.scores

    def _worker_request(self, prepared: Prepared, principal: Principal, request_id: str) -> worker_pb2.WorkerGenerateRequest:
        """What the worker is sent: the prepared request, with the tier's engine priority and the
        stream's coalescing for this router's load."""
        worker_request = worker_pb2.WorkerGenerateRequest(
            request=prepared.request, request_id=request_id, cache_salt=prepared.cache_salt
        )
        if prepared.cached_cap is not None:
            worker_request.cached_tokens_cap = prepared.cached_cap
        # Fuller messages as this router's streams grow (the first token still goes alone).
        interval = self._coalescing.interval(self._inflight.total)
        if interval > 1:
            worker_request.stream_interval = interval
        priority = self._flow.engine_priority(principal.tier, prepared.request.priority)
        if priority is not None:
            worker_request.engine_priority = priority
        return worker_request

    async def place_direct(
        self, prepared: Prepared, principal: Principal, request_id: str, time_remaining: float | None,
    ) -> "DirectPlacement":
        """Place a request that the ingress will send to the worker itself (ingress.path: direct):
        the same decision as for a stream of the router's own, without a retry (the router is out
        of the stream); the caller reports its end (DirectPlacement.ended)."""
        workers = await self._directory.workers(prepared.model.name)
        ctx, confirmed = await self._context(prepared, principal, workers)
        self.activity.started(principal.tenant, principal.tier)
        try:
            worker, queued_s, token, scores = await self._place(prepared, principal, ctx, workers, time_remaining,
                                                                trace.get_current_span())
        except BaseException:
            self.activity.finished(principal.tenant, 0)
            raise
        # The second choice, should the first not take the request (the ingress then sends it there):
        # the best-scored other worker whose breaker lets requests through.
        blocked = self._flow.breakers.blocked()
        others = [w for w in workers if w.worker_id != worker.worker_id and w.worker_id not in blocked]
        fallback = max(others, key=lambda w: scores.get(w.worker_id, float("-inf")), default=None)
        return DirectPlacement(self, prepared, principal, worker, self._worker_request(prepared, principal, request_id),
                               queued_s, token, confirmed.get(worker.worker_id, 0), fallback)

    def _count(self, labels: tuple[str, str], u: common_pb2.Usage, decode_s: float | None) -> int:
        """Count a finished request's tokens by kind, and its time per output token from decode_s
        (first token to last; None: unknown). Returns its tokens, prompt and completion."""
        m = self._metrics
        if m.tokens is not None:
            m.tokens.labels(*labels, "prompt").inc(u.prompt_tokens)
            m.tokens.labels(*labels, "completion").inc(u.completion_tokens)
            m.tokens.labels(*labels, "cached").inc(u.cached_tokens)
        if m.tpot_seconds is not None and decode_s is not None and u.completion_tokens > 1:
            m.tpot_seconds.labels(*labels).observe(decode_s / (u.completion_tokens - 1))
        return u.prompt_tokens + u.completion_tokens

    def end_direct(self, p: DirectPlacement, code: grpc.StatusCode | None, detail: str,
                   final: common_pb2.GenerateChunk | None) -> None:
        """A direct generation is over: the flow learns how its worker did, and the request is
        recorded as one of the router's own streams is (Dispatcher.stream), from the worker's final."""
        worker, m, labels = p.worker.worker_id, self._metrics, (p.prepared.model.name, p.principal.tier)
        tokens = 0
        if final is not None and final.worker_id and final.worker_id != worker:
            # The ingress found the worker would not take it (unreachable, busy) and sent it to the
            # second choice, which served it.
            self._flow.failed(worker, grpc.StatusCode.UNAVAILABLE, "did not take a request the ingress sent it")
            worker = WorkerId(final.worker_id)
        if final is not None:
            t, u = final.timings, final.usage
            # What the tenant waited for the first token, from the ingress's arrival; the window's
            # measure leaves out the ingress's hop and the router's queue, as for the router's streams.
            seen_ms = t.total_ms - t.decode_ms
            self._flow.first_token(worker, p.principal.tier, t.ttft_ms, seen_ms - t.ingress_ms - t.router_queue_ms,
                                   prompt_work(u.prompt_tokens - u.cached_tokens))
            outcome = common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower()
            if m.ttft_seconds is not None:
                m.ttft_seconds.labels(*labels).observe(seen_ms / 1000)
            tokens = self._count(labels, u, t.decode_ms / 1000)
            self.observe_latency(t, p.principal.tier)
            log.info("served for %s by %s straight to the ingress: %d prompt (%d cached, %d blocks predicted) + %d "
                     "completion tokens, %s, TTFT %.1f ms at the worker", p.principal.tenant, worker, u.prompt_tokens,
                     u.cached_tokens, p.confirmed_blocks, u.completion_tokens,
                     common_pb2.FinishReason.Name(final.finish_reason), t.ttft_ms)
            if worker == p.worker.worker_id:
                self._check_prediction(worker, p.confirmed_blocks, p.worker.block_size, u.cached_tokens)
        elif code is not None and code != grpc.StatusCode.OK:
            self._flow.failed(worker, code, detail)
            outcome = code.name
        else:
            outcome = "cancelled"
        if m.requests is not None:
            m.requests.labels(*labels, outcome).inc()
        # The room taken was the first choice's.
        self._inflight.finish(p.worker.worker_id, p.token)
        self._flow.finished(p.worker.worker_id)
        self.activity.finished(p.principal.tenant, tokens)

    async def _stream(
        self,
        prepared: Prepared,
        principal: Principal,
        request_id: str,
        time_remaining: float | None,
        arrived: float,
        tenant_s: float,
        ingress_s: float,
        on_abandoned: Callable[[asyncio.Future], None] | None = None,
    ) -> AsyncIterator[common_pb2.GenerateChunk]:
        model = prepared.model
        workers = await self._directory.workers(model.name)
        ctx, confirmed = await self._context(prepared, principal, workers)
        worker_request = self._worker_request(prepared, principal, request_id)

        tried: set[WorkerId] = set()
        sent_any = False
        started = time.monotonic()

        def remaining() -> float | None:
            return None if time_remaining is None else max(0.0, time_remaining - (time.monotonic() - started))

        # The routing decision goes on the request's span (the router's server span, when traced).
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"gaas.request_id": request_id, "gaas.tenant": principal.tenant,
                                 "gaas.tier": principal.tier, "gaas.model": model.name,
                                 "gaas.stream_interval": worker_request.stream_interval or 1})
        loop = asyncio.get_running_loop()
        for attempt in range(self._retries + 1):
            ctx.tried = frozenset(tried)
            worker, queued_s, token, _ = await self._place(prepared, principal, ctx, workers, remaining(), span, attempt)
            tried.add(worker.worker_id)
            left = remaining()
            timeout = self._max_stream_seconds if left is None else min(left, self._max_stream_seconds)
            sent_at = time.perf_counter()
            # The first token's work: the prompt less what the directory says the worker caches.
            work = prompt_work(prepared.prompt_tokens - ctx.prefix.get(worker.worker_id, 0) * worker.block_size)
            threshold = self._flow.breakers.threshold_ms(worker.worker_id, work)
            watchdog = loop.call_later(threshold / 1000, self._flow.slow, worker.worker_id, threshold)
            call = self._workers.Generate(worker_request, timeout=timeout, metadata=((WORKER_HEADER, worker.address),))
            first = True
            handed_off = False
            try:
                # Until its first chunk the worker's engine may be computing the prompt: a client
                # that leaves meanwhile leaves the call running to that chunk, which is billed
                # (on_abandoned; _run_to_first_chunk), rather than a prefill nobody pays for.
                reading = asyncio.ensure_future(call.read())
                try:
                    chunk = await asyncio.shield(reading)
                except asyncio.CancelledError:
                    handed_off = True
                    self._run_to_first_chunk(call, reading, worker.worker_id, token, on_abandoned)
                    raise
                while chunk is not grpc.aio.EOF:
                    if first and chunk.token_ids:
                        first = False
                        watchdog.cancel()
                        now = time.perf_counter()
                        # The worker's breaker judges the worker's own time; the window judges what the
                        # tenant waits for, less the queue the window itself decides (the router's
                        # own delays under load count: a smaller window relieves them too).
                        self._flow.first_token(worker.worker_id, principal.tier, (now - sent_at) * 1000,
                                               (now - arrived - queued_s) * 1000, work)
                    if chunk.HasField("usage"):
                        now = time.perf_counter()
                        latency.complete(chunk.timings, total_s=now - arrived, tenant_s=tenant_s,
                                         router_queue_s=queued_s, call_s=now - sent_at, ingress_s=ingress_s)
                        chunk.tenant = principal.tenant
                        if span.is_recording():
                            chunk.timings.trace_id = format(span.get_span_context().trace_id, "032x")
                        log.info(
                            "served for %s by %s: %d prompt (%d cached, %d blocks predicted) + %d completion "
                            "tokens, %s, TTFT %.1f ms at the worker",
                            principal.tenant, worker.worker_id, chunk.usage.prompt_tokens, chunk.usage.cached_tokens,
                            ctx.prefix.get(worker.worker_id, 0), chunk.usage.completion_tokens,
                            common_pb2.FinishReason.Name(chunk.finish_reason), chunk.timings.ttft_ms,
                        )
                        self._check_prediction(
                            worker.worker_id, confirmed.get(worker.worker_id, 0), worker.block_size,
                            chunk.usage.cached_tokens,
                        )
                    sent_any = True
                    yield chunk
                    chunk = await call.read()
                if first:
                    self._flow.succeeded(worker.worker_id)
                return
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                self._flow.failed(worker.worker_id, code, exc.details() or "")
                if not sent_any and code in RETRYABLE and attempt < self._retries:
                    log.warning("worker %s failed before its first token (%s: %s); trying another",
                                worker.worker_id, code.name, exc.details())
                    continue
                raise self._worker_failure(worker.worker_id, exc, sent_any, request_id) from None
            finally:
                watchdog.cancel()
                if not handed_off:
                    # A client that went away cancels the caller; take the worker's stream with it.
                    call.cancel()
                    self._inflight.finish(worker.worker_id, token)
                    self._flow.finished(worker.worker_id)

    def _run_to_first_chunk(self, call, reading: asyncio.Future, worker: WorkerId, token: int,
                            on_abandoned: Callable[[asyncio.Future], None] | None) -> None:
        """The client left before the worker's first chunk: the call goes on until it comes (its
        worker keeps the engine request to it as well), then ends; on_abandoned gets a future of
        that chunk (None when the call failed or the engine never got to it in time), and the
        worker's room is given back only then."""

        async def finish() -> common_pb2.GenerateChunk | None:
            try:
                chunk = await asyncio.wait_for(reading, ABANDONED_FIRST_CHUNK_S)
                return None if chunk is grpc.aio.EOF else chunk
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - none came: nothing to bill
                return None
            finally:
                call.cancel()
                self._inflight.finish(worker, token)
                self._flow.finished(worker)

        task = asyncio.ensure_future(finish())
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        if on_abandoned is not None:
            on_abandoned(task)


# The prompts of one request that are generated at once (the others wait their turn here, not in
# the router's queue, whose timeout is for requests that have not started).
PARTS_AT_ONCE = 8


async def merge(streams: list[AsyncIterator[common_pb2.GenerateChunk]],
                at_once: int = PARTS_AT_ONCE) -> AsyncIterator[tuple[int, common_pb2.GenerateChunk]]:
    """(which stream, chunk) of several streams as their chunks arrive; the first failure ends all.
    At most at_once streams run at a time (a stream starts when it is first read: a request's
    prompts go to the workers a few at a time, in order). Bounded: while the consumer (a slow
    client) is behind, the streams wait, and the workers' streams with them, rather than their
    chunks piling up here."""
    if len(streams) == 1:
        async for c in streams[0]:
            yield 0, c
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(streams))
    turns = asyncio.Semaphore(max(1, at_once))
    done = object()

    async def pump(i: int, s: AsyncIterator) -> None:
        try:
            async with turns:
                async for c in s:
                    await queue.put((i, c))
            await queue.put((i, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, who re-raises it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
