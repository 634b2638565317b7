"""gaas.v1.OpenAI: the routes of vLLM's OpenAI-compatible server over HttpBody methods behind the
ingress's transcoder. Generations are an adapter of the request pipeline (pipeline.py): a body
parsed into engine requests (one per prompt), the chunks formatted as OpenAI's answer. Failures before the first byte are raised (the interceptor turns them into
statuses, the ingress into HTTP statuses and OpenAI's error JSON); after it, an SSE error event
that says what happened ends the stream, as vLLM's server ends it."""

from __future__ import annotations

import asyncio
import logging
import time

from google.api import httpbody_pb2
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gaas.contracts import errors, jsonbody
from gaas.contracts import batches as batch_terms
from gaas.contracts.principal import Principal
from gaas.openai import api as openai_api, batches as openai_batches, embeddings as openai_embeddings, multipart, \
    responses as openai_responses, scores as openai_scores, stream as openai_stream
from gaas.runtime.status import translate
from gaas.openai.stream import EXPLAIN_HEADER, SESSION_HEADER
from gaas.v1 import billing_pb2, common_pb2, inference_pb2, openai_pb2, openai_pb2_grpc
from services.router.directory import READY, model_state
from services.router.pipeline import Generation, Pipeline, Timing, note_client_id
from services.router.responses import LEASE_RENEW_S, ResponseStore

log = logging.getLogger(__name__)


class OpenAIServicer(openai_pb2_grpc.OpenAIServicer):
    def __init__(self, pipeline: Pipeline, max_body_bytes: int, metrics: CollectorRegistry,
                 responses: ResponseStore | None = None, batches=None) -> None:
        self._pipeline = pipeline
        # The Files and Batch routes' calls to billing (services/router/batches.BatchFront); None: no batches.
        self._batches = batches
        # Stored responses (the Responses API); None: none are kept (store is refused).
        self._responses = responses
        # Background responses running here.
        self._running: set[asyncio.Task] = set()
        self._stages = pipeline.stages
        self._max_body = max_body_bytes
        self._metrics = metrics

    # ------------------------------------------------------------ models

    async def ListModels(self, request, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        # Every model that serves or is about to (its workers starting, or started by a first request),
        # those ready first and the default first of them: a client that takes the first listed
        # model gets one that answers at once.
        served = sorted(((m, n, by_version, state) for m, n, by_version in await self._stages.directory.serving()
                         if (state := model_state(m, n))), key=lambda s: (s[3] != READY, not s[0].is_default))
        listed = [openai_api.ListedModel(m.name, n, m.max_model_len, {v: m.role(v) for v in by_version}, state, m.task)
                  for m, n, by_version, state in served]
        adapters = [(a.name, m.name, n, m.max_model_len) for m, n, _, _ in served for a in m.adapters.values()
                    if a.may_use(principal.tenant)]
        return openai_stream.json_body(openai_api.models_list(listed, int(time.time()), adapters))

    # ------------------------------------------------------------ generation

    async def Completions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, openai_api.parse_completion):
            yield body

    async def ChatCompletions(self, request: httpbody_pb2.HttpBody, context):
        async for body in self._serve(request, context, openai_api.parse_chat):
            yield body

    async def _serve(self, http: httpbody_pb2.HttpBody, context, parse):
        timing = Timing()
        principal = await self._pipeline.authenticate(timing)
        metadata = dict(context.invocation_metadata() or ())
        parsed = parse(jsonbody.parse(http.data, self._max_body))
        note_client_id(parsed.client_request_id)
        session_id_of(parsed, metadata)  # (on the engine requests: the pipeline reads it there)
        g = await self._pipeline.start(principal, engine_requests(parsed), timing, check=answer_check(parsed))
        fmt = openai_stream.Formatter(parsed, g.request_id, g.prepared[0].model.served_name)
        usage = openai_stream.Usage(prompt=sum(p.prompt_tokens for p in g.prepared),
                                    explain=metadata.get(EXPLAIN_HEADER, "").lower() in ("1", "true", "yes"))
        chunks = self._pipeline.stream(g, context.time_remaining(), metadata)
        sessions = self._pipeline.sessions
        truncation = sessions.policy.truncation if sessions is not None else ""
        async for body in openai_stream.respond(parsed, fmt, usage, chunks, truncation):
            yield body

    # ------------------------------------------------------------ embeddings

    async def Embeddings(self, request: httpbody_pb2.HttpBody, context):
        """A vector per input from a model that pools, every input in one engine request on one
        worker, answered in vLLM's shape (in pieces: a long list of vectors is megabytes)."""
        parsed = openai_embeddings.parse_embedding(jsonbody.parse(request.data, self._max_body))
        async for piece in self._embeddings(parsed, context):
            yield piece

    async def Pooling(self, request: httpbody_pb2.HttpBody, context):
        parsed = openai_embeddings.parse_pooling(jsonbody.parse(request.data, self._max_body))
        async for piece in self._embeddings(parsed, context):
            yield piece

    async def _embeddings(self, parsed: openai_embeddings.EmbeddingRequest, context):
        g, last = await self._embed(parsed, context)
        answer = openai_embeddings.embeddings_json(g.request_id,
                                                   g.prepared[0].model.served_name, last.embeddings,
                                                   last.usage.prompt_tokens, parsed.encoding_format,
                                                   pooling=parsed.pooling)
        for piece in openai_stream.answer_pieces(answer):
            yield piece

    async def Score(self, request: httpbody_pb2.HttpBody, context):
        async for piece in self._score(openai_scores.parse_score(jsonbody.parse(request.data, self._max_body)),
                                       context):
            yield piece

    async def Rerank(self, request: httpbody_pb2.HttpBody, context):
        async for piece in self._score(openai_scores.parse_rerank(jsonbody.parse(request.data, self._max_body)),
                                       context):
            yield piece

    async def _score(self, parsed: openai_scores.ScoreRequest, context):
        """Queries and documents embedded in one engine request, each pair scored by its vectors'
        cosine (a bi-encoder, as vLLM's server scores with a model that embeds)."""
        g, last = await self._embed(openai_scores.embedding_request(parsed), context)
        answer = openai_scores.answer_json(parsed, ("rerank-" if parsed.rerank else "score-")
                                           + g.request_id.removeprefix("req-"), g.prepared[0].model.served_name,
                                           openai_scores.scores(parsed, last.embeddings), last.usage.prompt_tokens)
        for piece in openai_stream.answer_pieces(answer):
            yield piece

    async def _embed(self, parsed: openai_embeddings.EmbeddingRequest, context):
        timing = Timing()
        principal = await self._pipeline.authenticate(timing)
        note_client_id(parsed.client_request_id)
        return await embed(self._pipeline, principal, parsed, timing, context.time_remaining(),
                           dict(context.invocation_metadata() or ()))

    # ------------------------------------------------------------ the Responses API

    def _store(self) -> ResponseStore:
        if self._responses is None:
            raise errors.Unavailable("this router keeps no responses (it has no Redis)")
        return self._responses

    async def CreateResponse(self, request: httpbody_pb2.HttpBody, context):
        """A response served as the chat it means (gaas.openai.responses), stored for the tenant
        before its last event (a client that saw it complete can fetch it)."""
        timing = Timing()
        principal = await self._pipeline.authenticate(timing)
        metadata = dict(context.invocation_metadata() or ())
        req = openai_responses.parse(jsonbody.parse(request.data, self._max_body))
        before, version = [], 1
        if req.previous_response_id:
            stored = await self._store().get(principal.tenant, req.previous_response_id, param="previous_response_id")
            before, version = stored["conversation"], stored.get("v", 1) + 1
        parsed = openai_api.parse_chat(req.chat_body(before))
        if req.store:  # (a tenant whose stored responses fill its room spends no tokens on one more)
            await self._store().room(principal.tenant,
                                     {"input_items": req.items, "conversation": before + req.messages})
        g = await self._pipeline.start(principal, [parsed.generate], timing, check=answer_check(parsed))
        builder = openai_responses.ResponseBuilder(req, "resp_" + g.request_id.removeprefix("req-"),
                                                   g.prepared[0].model.served_name)
        usage = openai_stream.Usage(prompt=g.prepared[0].prompt_tokens,
                                    explain=metadata.get(EXPLAIN_HEADER, "").lower() in ("1", "true", "yes"))
        record = {"response": builder.response(), "input_items": req.items, "v": version,
                  "conversation": before + req.messages}
        if req.background:
            await self._store().lease(principal.tenant, builder.id, record)
            task = asyncio.create_task(self._background_logged(g, builder, usage, record, metadata, principal.tenant))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            yield openai_stream.json_body(builder.response())
            return
        final = None
        for event in builder.start():
            yield openai_stream.sse_body(event)
        started = bool(req.stream)
        try:
            async for _, c in self._pipeline.stream(g, context.time_remaining(), metadata):
                usage.count(c)
                if c.finish_reason:
                    final = c
                for event in builder.add(c):
                    yield openai_stream.sse_body(event)
        except Exception as exc:  # noqa: BLE001 - answered in the shape the client can read
            if not started or (err := translate(exc)) is None:
                raise
            yield openai_stream.sse_body(builder.failed(errors.openai_error(err)["error"]))
            return
        last = builder.finish(final or common_pb2.GenerateChunk(), usage.final())
        if req.store:
            record.update(response=builder.response(), conversation=record["conversation"] + builder.conversation())
            try:
                await self._store().put(principal.tenant, builder.id, record)
            except errors.ResourceExhausted as err:  # (the tenant's room filled while it was generated)
                if not started:
                    raise
                yield openai_stream.sse_body(builder.failed(errors.openai_error(err)["error"]))
                return
        if req.stream:
            for event in last:
                yield openai_stream.sse_body(event)
        else:
            yield openai_stream.json_body(builder.response())

    async def _background_logged(self, g, builder: openai_responses.ResponseBuilder, *args) -> None:
        try:
            await self._background(g, builder, *args)
        except errors.GaasError as err:  # (the store unreachable: the lease lapses, and it reads as failed)
            log.warning("background response %s: its progress cannot be stored (%s)", builder.id, err.message)

    async def _background(self, g, builder: openai_responses.ResponseBuilder, usage: openai_stream.Usage,
                          record: dict, metadata: dict, tenant: str) -> None:
        """A background response's generation, its lease renewed while it runs (with its output so
        far), stopped at the renewal after its cancel was asked for; its end stored."""
        store = self._store()
        final, renew_at = None, time.monotonic() + LEASE_RENEW_S
        chunks = self._pipeline.stream(g, None, metadata)
        conversation = record["conversation"]
        try:
            async for _, c in chunks:
                usage.count(c)
                if c.finish_reason:
                    final = c
                builder.add(c)
                if time.monotonic() >= renew_at:
                    renew_at = time.monotonic() + LEASE_RENEW_S
                    record["response"] = builder.response()
                    if not await store.lease(tenant, builder.id, record):
                        log.info("background response %s cancelled after %d tokens", builder.id, usage.completion)
                        return  # (closing the stream aborts the engine request; its tokens are metered)
            builder.finish(final or common_pb2.GenerateChunk(), usage.final())
        except Exception as exc:  # noqa: BLE001 - stored as the response's failure
            err = translate(exc)
            log.warning("background response %s failed: %s", builder.id, err.message if err else type(exc).__name__)
            builder.failed(errors.openai_error(err)["error"] if err else {"message": "the generation failed"})
        finally:
            await chunks.aclose()
        if await store.cancel_asked(tenant, builder.id):
            return
        record.update(response=builder.response(), conversation=conversation + builder.conversation())
        record.pop("lease_until_ms", None)
        try:
            await store.put(tenant, builder.id, record)
        except errors.ResourceExhausted as err:  # its output outgrew the tenant's room: stored failed, without it
            builder.failed(errors.openai_error(err)["error"])
            record.update(response={**builder.response(), "output": [], "error": {"code": err.openai_code,
                                                                                  "message": err.message}},
                          conversation=conversation)
            await store.put(tenant, builder.id, record)

    async def GetResponse(self, request: openai_pb2.ResponseRef, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        stored = await self._store().get(principal.tenant, request.response_id)
        return openai_stream.json_body(stored["response"])

    async def DeleteResponse(self, request: openai_pb2.ResponseRef, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        await self._store().delete(principal.tenant, request.response_id)
        return openai_stream.json_body({"id": request.response_id, "object": "response.deleted", "deleted": True})

    async def CancelResponse(self, request: openai_pb2.ResponseRef, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        stored = await self._store().get(principal.tenant, request.response_id)
        status = stored["response"]["status"]
        if status not in ("queued", "in_progress") or not stored["response"].get("background"):
            raise errors.InvalidArgument(
                f"response {request.response_id} is {status}: only a background response still in progress can "
                "be cancelled", param="response_id")
        await self._store().ask_cancel(principal.tenant, request.response_id, stored)
        return openai_stream.json_body(stored["response"])

    async def ListResponseInputItems(self, request: openai_pb2.ListInputItemsRequest, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        stored = await self._store().get(principal.tenant, request.response_id)
        return openai_stream.json_body(openai_responses.input_items_page(
            stored["input_items"], request.limit, request.order, request.after, request.before))

    # ------------------------------------------------------------ files and batches (kept by billing)

    def _front(self):
        if self._batches is None:
            raise errors.Unavailable("this router serves no batches (it has no billing service)")
        return self._batches

    async def CreateFile(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        # (off the event loop: its key checks, decisions and streams never wait on a parse)
        upload = await asyncio.to_thread(multipart.parse_upload, request.content_type, request.data,
                                         batch_terms.MAX_UPLOAD_BYTES)
        f = await self._front().call("CreateFile", billing_pb2.CreateFileRequest(
            tenant=principal.tenant, filename=upload.filename, purpose=upload.purpose, data=upload.data), "files")
        return openai_stream.json_body(openai_batches.file_object(f))

    async def ListFiles(self, request: openai_pb2.ListOpenAIFilesRequest, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        page = await self._front().call("ListFiles", billing_pb2.ListFilesRequest(
            tenant=principal.tenant, purpose=request.purpose, limit=request.limit, after=request.after,
            order=request.order), "files")
        return openai_stream.json_body(openai_batches.listing([openai_batches.file_object(f) for f in page.files],
                                                              page.has_more))

    async def GetFile(self, request: openai_pb2.OpenAIFileRef, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        f = await self._front().call("GetFile", billing_pb2.FileRef(tenant=principal.tenant, file_id=request.file_id),
                                     "files")
        return openai_stream.json_body(openai_batches.file_object(f))

    async def DeleteFile(self, request: openai_pb2.OpenAIFileRef, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        f = await self._front().call("DeleteFile", billing_pb2.FileRef(tenant=principal.tenant,
                                                                        file_id=request.file_id), "files")
        return openai_stream.json_body(openai_batches.file_deleted(f))

    async def GetFileContent(self, request: openai_pb2.OpenAIFileRef, context):
        principal = await self._pipeline.caller()
        async for data in self._front().read(principal.tenant, request.file_id):
            yield httpbody_pb2.HttpBody(content_type="application/octet-stream", data=data)

    async def CreateBatch(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        create = openai_batches.parse_create(jsonbody.parse(request.data, self._max_body))
        owner = billing_pb2.BatchOwner(tenant=principal.tenant, tier=principal.tier, key_id=principal.key_id,
                                       cache_salt=principal.cache_salt)
        b = await self._front().call("CreateBatch", billing_pb2.CreateBatchRequest(
            owner=owner, input_file_id=create.input_file_id, endpoint=create.endpoint,
            completion_window=batch_terms.COMPLETION_WINDOW, metadata=create.metadata))
        return openai_stream.json_body(openai_batches.batch_object(b))

    async def ListBatches(self, request: openai_pb2.ListOpenAIBatchesRequest, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        page = await self._front().call("ListBatches", billing_pb2.ListBatchesRequest(
            tenant=principal.tenant, limit=openai_batches.page_params(request.limit), after=request.after))
        return openai_stream.json_body(openai_batches.listing([openai_batches.batch_object(b) for b in page.batches],
                                                              page.has_more))

    async def GetBatch(self, request: openai_pb2.OpenAIBatchRef, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        b = await self._front().call("GetBatch", billing_pb2.BatchRef(tenant=principal.tenant,
                                                                       batch_id=request.batch_id))
        return openai_stream.json_body(openai_batches.batch_object(b))

    async def CancelBatch(self, request: openai_pb2.OpenAIBatchRef, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        b = await self._front().call("CancelBatch", billing_pb2.BatchRef(tenant=principal.tenant,
                                                                          batch_id=request.batch_id))
        return openai_stream.json_body(openai_batches.batch_object(b))

    # ------------------------------------------------------------ tokenizer

    async def Tokenize(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        timing = Timing()
        principal = await self._pipeline.authenticate(timing)
        t = openai_api.parse_tokenize(jsonbody.parse(request.data, self._max_body))
        model = await self._stages.preparer.resolve_model(t.model, principal.tenant)
        tok = await self._stages.preparer.tokenizer(model)
        text = inference_pb2.GenerateRequest(add_special_tokens=t.add_special_tokens)
        if t.prompt is not None:
            text.prompt = t.prompt
        else:
            text.messages.extend(t.messages)
            text.add_generation_prompt = t.add_generation_prompt
            text.continue_final_message = t.continue_final_message
        # A request against the tenant's quotas (not billed): its place and the most tokens it can
        # hold (its bytes, and the chat template's few per message) reserved, settled to its count.
        most = len(t.prompt.encode()) if t.prompt is not None else sum(len(x.content.encode()) + 16 for x in t.messages)
        m = await self._pipeline.counted(principal, model.name, model.version, most + 16, timing)
        ids: list[int] = []
        try:
            ids = await self._stages.preparer.tokenize(tok, text)  # (a long one off the event loop)
        finally:
            self._pipeline.settle(m, len(ids))
        strs = [tok.id_to_token(i) or "" for i in ids] if t.return_token_strs else None
        return openai_stream.json_body({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs})

    async def Detokenize(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        principal = await self._pipeline.caller()
        name, tokens = openai_api.parse_detokenize(jsonbody.parse(request.data, self._max_body))
        model = await self._stages.preparer.resolve_model(name, principal.tenant)
        tok = await self._stages.preparer.tokenizer(model)
        for i, t in enumerate(tokens):
            if t >= tok.vocab_size:
                raise errors.InvalidArgument(
                    f"'tokens[{i}]' is {t}, not a token id of {model.name} (its vocabulary has {tok.vocab_size})",
                    param="tokens",
                )
        return openai_stream.json_body({"prompt": tok.decode(tokens)})

    # ------------------------------------------------------------ probes (no API key, as on vLLM)

    async def Health(self, request, context) -> httpbody_pb2.HttpBody:
        if not any(n for _, n, _ in await self._stages.directory.serving()):
            raise errors.Unavailable("no model has a ready worker")
        return httpbody_pb2.HttpBody(content_type="text/plain", data=b"")

    async def Ping(self, request, context) -> httpbody_pb2.HttpBody:
        return await self.Health(request, context)

    async def Version(self, request, context) -> httpbody_pb2.HttpBody:
        return openai_stream.json_body({"version": await self._stages.directory.engine_version()})

    async def Load(self, request, context) -> httpbody_pb2.HttpBody:
        return openai_stream.json_body({"server_load": self._stages.in_flight})

    async def Metrics(self, request, context) -> httpbody_pb2.HttpBody:
        return httpbody_pb2.HttpBody(content_type=CONTENT_TYPE_LATEST, data=generate_latest(self._metrics))


async def embed(pipeline: Pipeline, principal: Principal, parsed: openai_embeddings.EmbeddingRequest, timing: Timing,
                time_remaining: float | None, metadata: dict, price_factor: float = 1.0,
                ) -> tuple[Generation, common_pb2.GenerateChunk]:
    """An embeddings request's vectors: (its pipeline's request, the engine's one chunk)."""
    g = await pipeline.start(principal, [openai_embeddings.engine_request(parsed)], timing, price_factor=price_factor)
    last = None
    async for _, last in pipeline.stream(g, time_remaining, metadata):
        pass
    if last is None or len(last.embeddings) != len(parsed.inputs):
        raise errors.Internal(errors.internal_message(g.request_id))
    return g, last


def session_id_of(parsed: openai_api.OpenAIRequest, metadata: dict) -> str:
    """The session a request is a turn of: the x-gaas-session header or the body's session_id
    (both: they must agree); set on the engine request."""
    header = metadata.get(SESSION_HEADER, "")
    body = parsed.generate.session_id
    if header and body and header != body:
        raise errors.InvalidArgument(f"the {SESSION_HEADER} header and the body's session_id name different sessions",
                                     param="session_id")
    parsed.generate.session_id = header or body
    return parsed.generate.session_id


def answer_check(parsed: openai_api.OpenAIRequest):
    """The pipeline's check of an OpenAI request: its answer within the limits, with max_tokens
    known for every prompt once they are prepared (a chat's without one included)."""
    return lambda prepared: openai_api.check_answer(parsed, [p.request.max_tokens for p in prepared])


def engine_requests(parsed: openai_api.OpenAIRequest) -> list[inference_pb2.GenerateRequest]:
    """One engine request per prompt (chat: the conversation)."""
    if parsed.kind == "chat":
        return [parsed.generate]
    out = []
    for prompt in parsed.prompts:
        r = inference_pb2.GenerateRequest()
        r.CopyFrom(parsed.generate)
        if isinstance(prompt, str):
            r.prompt = prompt
        else:
            r.prompt_token_ids.extend(prompt)
        out.append(r)
    return out

