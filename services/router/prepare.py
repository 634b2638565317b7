"""Stage 2 of a generation (services/router/pipeline.py): a request made ready for a worker. Its
model resolved, its prompt tokenized once (the worker gets token ids; a chat with the model's
template applied), checked against the model's window, salted for the prefix cache (the tenant's
salt, or a declared public prefix's), and its blocks hashed and the KV directory asked where they
live, without waiting for the answer: the lookup overlaps the tenant's admission."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gaas.contracts import errors, genrequest, kvhash, tasks
from gaas.openai import embeddings
from gaas.contracts.principal import Principal
from gaas.model.tokenizer import ChatMessage, PromptPrefix, Tokenizer, template_tools
from gaas.v1 import inference_pb2
from services.router.demand import Demand
from services.router.directory import MeshDirectory, ModelEntry
from services.router.kvclient import KVDirectoryClient
from services.router.kvreplica import PrefixMatch
from services.router.scheduling import Scheduler
from services.router.versions import VersionChooser

log = logging.getLogger(__name__)

# Prompts longer than this are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 8192


@dataclass(slots=True)
class Prepared:
    """A request ready for a worker: its model resolved, its prompt as token ids."""

    model: ModelEntry
    request: inference_pb2.GenerateRequest
    prompt_tokens: int
    # The prefix-cache salt: the tenant's, or a public prefix's when the prompt begins with one.
    cache_salt: str
    # The prompt's block hashes, and what the KV directory knows of them (this router's replica
    # of it; None: not looked up, when routing has no use for it).
    block_hashes: list[int] = field(default_factory=list)
    prefix: PrefixMatch | None = None
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
    return kvhash.public_salt(shared[0]) if shared else tenant_salt


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


# How often a request waiting for an autoscaled model's first worker looks again, s.
SCALE_UP_POLL_S = 0.5


class ScalingUp(errors.Unavailable):
    """No worker serves an autoscaled model yet, and this request may not wait for one here (its
    autoscaler has been told): whoever decides passes it on to where it may wait."""


class Preparer:
    def __init__(self, directory: MeshDirectory, scheduler: Scheduler, tokenizer_for: Callable[[ModelEntry], Tokenizer],
                 kv: KVDirectoryClient | None, lookup_seconds=None, demand: Demand | None = None,
                 queue_timeout: Callable[[str], float] = lambda tier: 0.0) -> None:
        """demand: where a request for an autoscaled model no worker serves says it waits;
        queue_timeout(tier): how long it may wait for one to start."""
        self._demand = demand
        self._queue_timeout = queue_timeout
        self._directory = directory
        self._scheduler = scheduler
        self._tokenizer_for = tokenizer_for
        self._tokenizers: dict[str, Tokenizer] = {}
        self._versions = VersionChooser()
        self._kv = kv
        self._lookup_seconds = lookup_seconds

    async def resolve_model(self, name: str, tenant: str | None = None) -> ModelEntry:
        """The named model (tenant: whose request it is; it may name an adapter of its own or a public one)."""
        return await self._directory.resolve_model(name, tenant)

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

    def version(self, model: ModelEntry, principal: Principal, session_version: str = "") -> ModelEntry:
        """The model as served by the version this request of principal's goes to (the split's
        choice: services/router/versions.py)."""
        if model.split is None:
            return model
        available = self._directory.versions_serving(model.name)
        return model.at(self._versions.choose(model.split, principal.tenant, session_version, available or None))

    async def prepare(self, request: inference_pb2.GenerateRequest, principal: Principal,
                      prefix: PromptPrefix | None = None, session_version: str = "", *,
                      for_ingress: bool = False) -> Prepared:
        """Resolve the model and its version, tokenize the prompt (chat template applied), check
        what the worker will get: the prompt as token ids and an explicit max_tokens. prefix: the
        token ids of how a session's last prompt began, reused when this one begins the same way
        (and updated); session_version: the version a session's first turn took; for_ingress: the
        ingress waits on this decision (direct path: never held while a pool scales up)."""
        if len(request.model) > genrequest.MAX_MODEL_NAME:
            raise errors.InvalidArgument(f"'model' is at most {genrequest.MAX_MODEL_NAME} characters", param="model")
        model = self.version(await self.resolve_model(request.model, principal.tenant), principal, session_version)
        return await self.prepare_at(request, principal, model, prefix, for_ingress=for_ingress)

    async def prepare_at(self, request: inference_pb2.GenerateRequest, principal: Principal, model: ModelEntry,
                         prefix: PromptPrefix | None = None, *, for_ingress: bool = False) -> Prepared:
        """prepare() for the given model version (a shadow copy's: services/router/shadow.py)."""
        if request.HasField("embed"):
            return await self._prepare_embed(request, principal, model, for_ingress)
        tasks.check(model.name, model.task, tasks.GENERATE)
        genrequest.check(request, model.max_model_len or None)
        # A model (version) nobody serves is refused before any work (an autoscaled one's waits
        # for a worker to start first).
        workers = await self.serving(model, principal, for_ingress)
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

    async def _prepare_embed(self, request: inference_pb2.GenerateRequest, principal: Principal, model: ModelEntry,
                             for_ingress: bool) -> Prepared:
        """An embeddings request: every input tokenized and checked against the model's window, the
        worker sent their token ids (no generation: its tokens are the prompt's alone)."""
        tasks.check(model.name, model.task, tasks.EMBED)
        e = request.embed
        if not e.inputs or len(e.inputs) > embeddings.MAX_INPUTS:
            raise errors.InvalidArgument(f"an embeddings request takes 1 to {embeddings.MAX_INPUTS} inputs, not "
                                         f"{len(e.inputs)}", param="input")
        await self.serving(model, principal, for_ingress)
        tok = await self.tokenizer(model)
        forwarded = inference_pb2.GenerateRequest(model=model.name, priority=request.priority,
                                                  request_id=request.request_id)
        if e.HasField("dimensions"):
            forwarded.embed.dimensions = e.dimensions
        special = e.add_special_tokens if e.HasField("add_special_tokens") else True
        total, limit = 0, model.max_model_len
        for i, item in enumerate(e.inputs):
            if item.token_ids:
                ids = list(item.token_ids)
            elif not item.text:
                raise errors.InvalidArgument(f"'input[{i}]' is empty: give it text or token ids", param="input")
            elif len(item.text) > INLINE_TOKENIZE_CHARS:
                ids = await asyncio.to_thread(tok.encode, item.text, special)
            else:
                ids = tok.encode(item.text, special)
            if not ids:
                raise errors.InvalidArgument(f"'input[{i}]' has no tokens", param="input")
            if limit and len(ids) > limit:
                raise errors.InvalidArgument(f"'input[{i}]' is {len(ids)} tokens; {model.name!r} embeds at most {limit} "
                                             "tokens per input: shorten it or split it", param="input")
            if max(ids) >= tok.vocab_size:
                raise errors.InvalidArgument(f"'input[{i}]' holds token id {max(ids)}; this model's vocabulary has "
                                             f"{tok.vocab_size} tokens", param="input")
            total += len(ids)
            if total > embeddings.MAX_TOKENS:
                raise errors.InvalidArgument(f"the inputs hold more than {embeddings.MAX_TOKENS} tokens; send at most "
                                             "that many in one request", param="input")
            forwarded.embed.inputs.add(token_ids=ids)
        return Prepared(model, forwarded, total, principal.cache_salt)

    async def serving(self, model: ModelEntry, principal: Principal, for_ingress: bool = False):
        """The workers serving model's pool; for an autoscaled model none of whose workers serves,
        the autoscaler is told and the request waits up to its tier's queue timeout for one
        (errors.Unavailable, with Retry-After, past it), unless the ingress waits on this decision
        (ScalingUp: passed on to the router's own route, to wait there; holding.py)."""
        try:
            return await self._directory.workers(model.name, model.pool)
        except errors.Unavailable:
            if not model.autoscaled or self._demand is None:
                raise
        if for_ingress:
            await self._demand.mark(model.name)
            raise ScalingUp(f"no worker serves {model.name!r} yet; its pool is scaling up")
        wait = self._queue_timeout(principal.tier)
        deadline = time.monotonic() + wait
        log.info("no worker serves %s: the request waits up to %g s while its autoscaler starts one", model.name, wait)
        with self._demand.awaiting(model.name):
            while True:
                await self._demand.mark(model.name)
                await asyncio.sleep(SCALE_UP_POLL_S)
                try:
                    return await self._directory.workers(model.name, model.pool)
                except errors.Unavailable:
                    if time.monotonic() >= deadline:
                        raise errors.Unavailable(
                            f"no worker of {model.name!r} started within the {principal.tier} tier's queue timeout "
                            f"({wait:g} s); its pool is scaling up from zero: retry in a few seconds",
                            retry_after=5.0) from None

    def _ask_prefix(self, prepared: Prepared, workers) -> None:
        """Hash the prompt's blocks and look them up in this router's replica of the KV
        directory. With one worker to choose from its answer could change nothing: neither is
        done (5 ms of hashing for a 32K-token prompt)."""
        block_size = workers[0].block_size if workers else 0
        if self._kv is None or not self._scheduler.needs_prefix or not block_size or len(workers) < 2:
            return
        adapter = prepared.model.adapter.name if prepared.model.adapter is not None else ""
        prepared.block_hashes = kvhash.prefix_hashes(prepared.request.prompt_token_ids, block_size, prepared.cache_salt,
                                                     adapter)
        if prepared.block_hashes:
            started = time.perf_counter()
            prepared.prefix = self._kv.lookup(prepared.block_hashes)
            if self._lookup_seconds is not None:
                self._lookup_seconds.observe(time.perf_counter() - started)

    async def tokenize(self, tok: Tokenizer, request: inference_pb2.GenerateRequest,
                       prefix: PromptPrefix | None = None) -> list[int]:
        """The token ids of request's prompt or messages (as its fields say: special tokens, the
        generation prompt); a long one is tokenized off the event loop."""
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.messages:
            messages = [ChatMessage.of(m) for m in request.messages]
            agp = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
            tools = template_tools(request.tools)
            if prefix is not None and not request.add_special_tokens:
                text = tok.render_chat(messages, agp, request.continue_final_message, tools)
                args, fn, size = (text, prefix), tok.encode_continuing, tok.continued_chars(text, prefix)
            else:
                args = (messages, agp, request.continue_final_message, request.add_special_tokens, tools)
                fn = tok.encode_chat
                size = sum(len(m.content) + sum(len(c[2]) for c in m.tool_calls) for m in messages) + \
                    sum(len(t.parameters) + len(t.description) for t in request.tools)
        else:
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            args, fn, size = (request.prompt, special), tok.encode, len(request.prompt)
        if size > INLINE_TOKENIZE_CHARS:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)
