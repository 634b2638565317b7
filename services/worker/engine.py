"""The interface of the inference engine behind a worker: what the rest of the worker sees of it
(Engine, the request it takes, the deltas it streams, its load and info) and the errors it raises.
vllm_engine.py is the engine itself (vLLM's AsyncLLM); the servicer is tested with a fake engine,
the engine without gRPC."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

from gaas.contracts import errors, tasks
from gaas.contracts.tasks import EMBED, GENERATE

log = logging.getLogger(__name__)

# How long a request whose caller left before its first output still runs to get it (past this
# the engine had not started it: it is aborted unbilled).
ABANDONED_FIRST_OUTPUT_S = 30.0


NO_TOOL_PARSER = ("tool_choice \"auto\" needs a tool parser for this model, and it has none: choose \"none\", "
                  "\"required\" or a named function, or give the model one (engine: {tool_parser: hermes} in its "
                  "entry of deploy/gaas.yaml, then `gaas apply`)")


class InvalidRequest(errors.InvalidArgument):
    """The request can never succeed as sent (too long, bad parameter); the message says why."""


class EngineUnavailable(errors.Unavailable):
    """The engine is not running (not started yet, shutting down, or dead); try another worker.
    Raised before a request's first token, nothing of it was done (untaken)."""

    untaken = True


class EngineBusy(errors.ResourceExhausted):
    """The engine's queue is full; another worker (or a later retry) may take the request."""

    untaken = True


class AdapterUnavailable(errors.FailedPrecondition):
    """The request's LoRA adapter cannot be served here (not loadable, or no adapters on this engine)."""


class EngineFailed(errors.Internal):
    """The engine failed while serving the request (a bug or a fault, not the caller's doing); the
    message is for the caller, the detail went to the log."""


@dataclass(slots=True)
class GenerationRequest:
    # Id the engine request carries (the router's request id).
    request_id: str
    # Exactly one of prompt / prompt_token_ids / messages is non-empty.
    prompt: str
    prompt_token_ids: list[int]
    # Most tokens to generate; 0: the rest of the context (chat messages only).
    max_tokens: int
    # (role, content) pairs, rendered with the model's chat template.
    messages: list[tuple[str, str]] = field(default_factory=list)
    # vLLM sampling fields that were set (temperature, top_p, ...); unset ones keep defaults.
    sampling: dict[str, float | int] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    # vLLM priority: lower is served first.
    priority: int = 1
    # Prefix-cache salt; requests with different salts never share cached blocks.
    cache_salt: str = ""
    # Choices to generate (vLLM's n).
    n: int = 1
    # Top alternatives per token to return with its logprob; None for no logprobs.
    logprobs: int | None = None
    # Text prompts: add the tokenizer's special tokens (BOS); messages: add them on top of the template's.
    add_special_tokens: bool = True
    # Chat messages: open the assistant's turn / continue the last message.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Tokens per streamed delta (0 or 1: each token; never below the engine's own setting).
    stream_interval: int = 0
    # Output constrained while decoding: vLLM's StructuredOutputsParams fields (None: free output).
    structured: dict | None = None
    # The LoRA adapter to serve it with (None: the base model): loaded on its first request.
    adapter: "AdapterRef | None" = None
    # Told, with a future of the first delta (None if none came), when the caller leaves before
    # it: the engine may be computing the prompt, so the request runs on to that delta (and is
    # billed for it by whoever meters it), bounded by ABANDONED_FIRST_OUTPUT_S.
    on_abandoned: Callable[["asyncio.Future[Delta | None]"], None] | None = None


@dataclass(slots=True)
class EmbeddingRequest:
    """Inputs of a model that pools (its task: embed), embedded together: one engine batch."""

    request_id: str
    # Each input's token ids, or its text (the router sends ids).
    inputs: list[list[int] | str]
    # The vector's length (a Matryoshka model's); None: the model's own.
    dimensions: int | None = None
    priority: int = 1
    cache_salt: str = ""
    add_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class Embeddings:
    # One per input, in order: the engine's float32 values, little-endian (embeddings.vector_bytes).
    vectors: list[bytes]
    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A LoRA adapter as the engine loads it (gaas.contracts.adapters.Adapter's engine part)."""

    name: str
    adapter_id: int
    path: str


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    # (token_id, token, logprob, rank): the sampled token first, then the top alternatives.
    top: list[tuple[int, str, float, int]]


@dataclass(slots=True)
class Delta:
    """What one engine step added to a request."""

    text: str
    token_ids: list[int]
    # The choice (0 to n-1) this delta extends.
    index: int = 0
    # None until the choice's last delta, then one of gaas.contracts.finish's reasons.
    finish_reason: str | None = None
    # The stop string that matched, if any.
    stop_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # Tokens generated so far, all choices together.
    completion_tokens: int = 0
    # Time in the engine's queue before the first schedule (last delta only).
    queue_ms: float = 0.0
    # True on the request's last delta (every choice finished): it carries the usage. The first
    # delta carries prompt_tokens and cached_tokens too (first=True): the prompt as the engine took it.
    done: bool = False
    first: bool = False
    # One per token of token_ids, when the request asked for logprobs.
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    model_version: str
    # "vllm-cpu" or "vllm-cuda".
    backend: str
    device: str
    block_size: int
    max_model_len: int
    # Version of vLLM.
    engine_version: str = ""
    # KV-cache size, blocks.
    kv_cache_blocks: int = 0
    # ipc:// endpoints of the engine's KV events and their replay; "" when it publishes none.
    kv_events_endpoint: str = ""
    kv_replay_endpoint: str = ""
    # LoRA adapters it keeps loaded at most (0: it serves none).
    adapter_slots: int = 0
    # What its model serves (gaas.contracts.tasks).
    task: str = GENERATE


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int
    # Fraction of KV blocks in use.
    kv_cache_usage: float
    # The names of the LoRA adapters it holds loaded.
    adapters: tuple[str, ...] = ()
    # Requests preempted since the engine started (a KV block it could not allocate).
    preemptions: int = 0


class Engine(ABC):
    info: EngineInfo

    @abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream the request's deltas; cancelling the iteration aborts the engine request."""

    async def embed(self, request: EmbeddingRequest) -> Embeddings:
        """Each input's vector (a model that pools); InvalidRequest from a model that generates."""
        tasks.check(self.info.model, self.info.task, EMBED)
        raise NotImplementedError

    @abstractmethod
    def load(self) -> EngineLoad: ...

    @property
    def dead(self) -> bool:
        """The engine's processes failed (not a shutdown this worker asked for)."""
        return not self._closed and bool(self._llm.errored)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False when the engine cannot now."""
        return False

    async def retain_adapters(self, adapter_ids: Collection[int]) -> None:
        """Unload the adapters it holds that are not among adapter_ids (removed from the catalogue)."""

    def tool_parser(self, tools: list[dict]):
        """A fresh (tool parser, its request) reading tool calls for tool_choice "auto" out of the
        model's output (services/worker/toolcalls.py); InvalidRequest when the model has none. The
        request is vLLM's, as the parser adjusted it (skip_special_tokens: what the output needs)."""
        raise InvalidRequest(NO_TOOL_PARSER)

    @abstractmethod
    async def shutdown(self) -> None: ...
