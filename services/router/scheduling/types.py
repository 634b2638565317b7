"""What the scheduler works on: the request's context, the candidate workers with their latest
load, the three kinds of plugin a scheduling cycle runs (filter, scorer, picker), and the three
kinds of hook around it (pre-cycle, post-cycle, post-response: services/router/scheduling/hooks.py).
Pure data, no I/O."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from gaas.contracts import errors
from gaas.contracts.ids import WorkerId


@dataclass(frozen=True, slots=True)
class Load:
    """A worker's load as it last reported it (with its lease renewals)."""

    running: int = 0
    waiting: int = 0
    # Fraction of its KV-cache blocks in use, 0..1, and the cache's size in blocks.
    kv_usage: float = 0.0
    kv_blocks: int = 0
    # Device memory, bytes (0 when unknown), and busy share of the device, 0..1.
    memory_used: int = 0
    memory_total: int = 0
    utilization: float = 0.0
    # When the worker measured it, Unix ms (0: never reported).
    reported_ms: int = 0
    # LoRA: the adapters its engine holds, and how many it may hold (0: it serves none).
    adapters: frozenset[str] = frozenset()
    adapter_slots: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker that could take a request."""

    worker_id: WorkerId
    # Sidecar inbound host:port, named in x-gaas-worker.
    address: str
    model: str
    model_version: str
    max_model_len: int
    # Version of the engine (vLLM) the worker runs.
    engine_version: str = ""
    # The engine's KV block size, tokens.
    block_size: int = 0
    load: Load = field(default_factory=Load)


@dataclass(slots=True)
class RequestContext:
    """One request, as the scheduler sees it."""

    model: str
    tenant: str = ""
    # bronze, silver or gold.
    tier: str = ""
    prompt_tokens: int = 0
    max_tokens: int = 0
    # GaaS's hashes of the prompt's full blocks (gaas/contracts/kvhash.py), tenant-salted.
    block_hashes: Sequence[int] = ()
    # The request's priority band (gaas.contracts.qos: 0 gold, 1 silver, 2 bronze).
    band: int = 0
    # Workers that already failed this request, and workers whose circuit breaker is open.
    tried: frozenset[WorkerId] = frozenset()
    blocked: frozenset[WorkerId] = frozenset()
    # Requests of this band each worker's batching window has room for now; None: no windows.
    room: Mapping[WorkerId, int] | None = None
    # Gathered before scheduling: leading blocks of the prompt each worker holds (the KV
    # directory's, in this router's replica), and requests this router sent each worker since its
    # last load report.
    prefix: Mapping[WorkerId, int] = field(default_factory=dict)
    inflight: Mapping[WorkerId, int] = field(default_factory=dict)
    # A session's turn: the worker that served its last turn (its prefix is likely there).
    session_worker: WorkerId = WorkerId("")
    # The LoRA adapter it is served with ("": the base model alone), and the adapters this router
    # sent each worker lately (which its load report may not list yet).
    adapter: str = ""
    adapters_sent: Mapping[WorkerId, frozenset[str]] = field(default_factory=dict)
    # Of those leading blocks, the ones each worker's engine confirmed; whom the blocks are cached
    # for (the tenant, or a public prefix's owner), which the directory files provisioned blocks under.
    confirmed: Mapping[WorkerId, int] = field(default_factory=dict)
    cache_owner: str = ""

    def queue(self, c: Candidate) -> int:
        """Requests ahead of this one at c: running and waiting as reported, plus those sent since."""
        return c.load.running + c.load.waiting + self.inflight.get(c.worker_id, 0)


class Plugin(ABC):
    # Type name, as profiles and metrics name it.
    name: str


class Filter(Plugin):
    """Removes candidates that must not (or, for a soft filter, should not) take the request."""

    # A soft filter that would remove every candidate removes none: better a busy worker than none.
    soft: bool = False
    # A filter that removes every candidate only for now (no room yet): the request may wait for
    # room (NoCapacity) rather than be refused.
    waitable: bool = False

    @abstractmethod
    def keep(self, ctx: RequestContext, c: Candidate) -> bool: ...

    def why(self, ctx: RequestContext) -> str:
        """Why nobody was kept (for the error the caller gets)."""
        return f"no worker passes {self.name}"


class Scorer(Plugin):
    """Rates a candidate from 0 (worst) to 1 (best); the scheduler weighs and sums the scores."""

    # Whether it needs the directory's prefix answer (the scheduler only asks when one does).
    needs_prefix: bool = False

    @abstractmethod
    def score(self, ctx: RequestContext, c: Candidate) -> float: ...


class Picker(Plugin):
    """Chooses one of the candidates from their total scores."""

    @abstractmethod
    def pick(self, ctx: RequestContext, candidates: Sequence[Candidate], scores: Mapping[WorkerId, float]) -> Candidate: ...


class PreCycle(Plugin):
    """Runs before a request is scheduled: gathers what filters and scorers read into its context.
    The one place that may wait (the KV directory's answer), so the cycle itself stays pure."""

    @abstractmethod
    async def before(self, ctx: RequestContext, candidates: Sequence[Candidate]) -> None: ...


class PostCycle(Plugin):
    """Runs once a cycle picked the worker, before the request is sent there."""

    @abstractmethod
    def picked(self, ctx: RequestContext, worker: Candidate, candidates: Sequence[Candidate]) -> None: ...


@dataclass(frozen=True, slots=True)
class Response:
    """What a worker did with a request it was sent, as post-response hooks learn it."""

    worker: WorkerId
    tier: str = ""
    # Its first token: ms from when the worker was sent the request, and what the tenant waited
    # (less the router's queue); the prompt's work (breakers.prompt_work).
    ttft_ms: float = 0.0
    seen_ms: float | None = None
    work: float = 1.0
    # A failure: the worker's status and its detail.
    code: grpc.StatusCode | None = None
    detail: str = ""
    # Served: the cached tokens its usage reports, beside the leading blocks the KV directory said
    # the worker held (and the worker's block size).
    cached_tokens: int = 0
    confirmed_blocks: int = 0
    block_size: int = 0


class PostResponse(Plugin):
    """Told how a worker did with a request, in order: its first token (or success without one, or
    a failure), its usage when it finished, and its end (the request left the worker). Each is a
    no-op unless a hook overrides it."""

    def first_token(self, r: Response) -> None:
        pass

    def succeeded(self, r: Response) -> None:
        """It ended well without producing a token (nothing to time)."""

    def failed(self, r: Response) -> None:
        pass

    def served(self, r: Response) -> None:
        """It finished, with its usage."""

    def ended(self, r: Response) -> None:
        """It left the worker, however it went."""


class NoCapacity(errors.Unavailable):
    """Every candidate is able but busy right now: the request may wait for room."""


def clamp(x: float) -> float:
    return 0.0 if x != x or x < 0.0 else 1.0 if x > 1.0 else x
