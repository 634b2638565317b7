"""A stream carried on by another worker after its worker failed mid-stream, one definition for
whoever is in the stream: the router on its own route (services/router/relay.py), or, on the
direct path, the worker the ingress streams from, when its engine stops (services/worker/carryon.py).
The continuation's request and what the client is told of it.

The continuation is the same engine request with the tokens already sent appended to its prompt
(token ids, not text: the new worker's prefill sees exactly what the first one had produced), the
rest of max_tokens and min_tokens, and the same sampling settings, seed, stops and priority. With
greedy decoding its tokens are those an undisturbed run would have produced. The client sees one
stream: the continuation's first chunk loses its prefill (the client's request had one already),
and its usage says the client's prompt, as cached as the first worker found it, and every token the
client received; the recomputed prefill (the prompt plus the tokens sent, less what the new worker
had cached) is the mesh's cost, counted apart (the stream_moved_prefill_tokens_total metrics), not billed.

Only a single-choice request is carried on (n > 1 runs its choices together on one worker), and
not one whose output is constrained or read for tool calls: the grammar's state and the tool
parser's live in the first worker's engine, and a new one would start them over mid-output. Its
limits: a stop string that would have spanned the two workers' texts is not seen, and a seeded
sampler starts over on the new worker (so only greedy decoding reproduces an undisturbed run)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gaas.v1 import common_pb2, worker_pb2

# Failures of a worker after tokens went out that another worker can carry on from (gRPC status
# code names): the worker or its sidecar gone (UNAVAILABLE, a reset stream: INTERNAL, UNKNOWN,
# CANCELLED), the worker handing its streams over as it stops (UNAVAILABLE, ABORTED), or the
# worker asked to carry a stream on refusing it as busy or serving another model
# (RESOURCE_EXHAUSTED, FAILED_PRECONDITION: the next may take it). A deadline is the request's own.
CARRIED_ON = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "CANCELLED", "ABORTED", "RESOURCE_EXHAUSTED",
                        "FAILED_PRECONDITION"})


@dataclass(slots=True)
class Carried:
    """What a stream has given its client so far, across the workers that served it."""

    # The prompt's tokens as the client's request had them (prepared), and as cached as the first
    # worker's prefill found them.
    prompt_tokens: int
    cached_tokens: int | None = None
    # Token ids the client was sent, in order, from every worker.
    sent: list[int] = field(default_factory=list)
    # Times the stream moved to another worker.
    moves: int = 0

    def seen(self, chunk: common_pb2.GenerateChunk) -> None:
        """Note a chunk about to be sent to the client."""
        if self.cached_tokens is None and chunk.HasField("prefill"):
            self.cached_tokens = chunk.prefill.cached_tokens
        self.sent.extend(chunk.token_ids)

    def can_carry_on(self, request: worker_pb2.WorkerGenerateRequest, code: str) -> bool:
        """Whether the stream of request, whose worker failed with code (a gRPC status code's
        name) after tokens went out, can be carried on by another."""
        r = request.request
        return code in CARRIED_ON and (r.n or 1) == 1 and not r.HasField("structured_output") and \
            not r.tool_calling.mode

    def continuation(self, request: worker_pb2.WorkerGenerateRequest) -> worker_pb2.WorkerGenerateRequest | None:
        """The request that carries the stream on (None when the tokens sent already reach its
        max_tokens: nothing is left to generate, only its end to tell: ended())."""
        left = request.request.max_tokens - len(self.sent)
        if left <= 0:
            return None
        out = worker_pb2.WorkerGenerateRequest()
        out.CopyFrom(request)
        r = out.request
        r.prompt_token_ids.extend(self.sent)
        r.max_tokens = left
        if r.sampling.HasField("min_tokens"):
            r.sampling.min_tokens = max(0, r.sampling.min_tokens - len(self.sent))
        # The prompt is longer than the first worker's: a public prefix's bound stays as it was.
        return out

    def adjust(self, chunk: common_pb2.GenerateChunk, before: int) -> None:
        """A continuation's chunk as the client's stream has it: no second prefill, and a usage of
        the client's prompt and every token it received. before: tokens sent before this worker."""
        if chunk.HasField("prefill"):
            chunk.ClearField("prefill")
        if chunk.HasField("usage"):
            chunk.usage.prompt_tokens = self.prompt_tokens
            chunk.usage.cached_tokens = self.cached_tokens or 0
            chunk.usage.completion_tokens = before + chunk.usage.completion_tokens

    def ended(self, request_id: str, worker_id: str, model: str, model_version: str) -> common_pb2.GenerateChunk:
        """The last chunk of a stream whose worker failed after sending its max_tokens' last token
        and before its end."""
        chunk = common_pb2.GenerateChunk(
            request_id=request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH, worker_id=worker_id,
            model=model, model_version=model_version,
        )
        chunk.usage.prompt_tokens = self.prompt_tokens
        chunk.usage.cached_tokens = self.cached_tokens or 0
        chunk.usage.completion_tokens = len(self.sent)
        return chunk

    def recomputed(self, chunk: common_pb2.GenerateChunk) -> int:
        """The prefill a continuation's first chunk says the new worker computed: the mesh's cost."""
        if not chunk.HasField("prefill"):
            return 0
        return max(0, chunk.prefill.prompt_tokens - chunk.prefill.cached_tokens)
