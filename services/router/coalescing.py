"""How many tokens the router asks a worker to put in each streamed message (vLLM's per-request
stream_interval; the first token always goes at once). Every message costs each process on its
path (the worker, two sidecars, the router, the ingress) about the same whatever it carries, and
on a busy host that CPU is what the engines run short of. So: each token its own message while the
router has few streams in flight, fuller messages as they grow (streams // per_step tokens each,
at most max_interval). The OpenAI and gRPC streams allow any number of tokens per chunk, and
vLLM's own server sends several when its client falls behind.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Coalescing:
    # Streams in flight on this router per token of a message (0: always one token a message).
    per_step: int = 2
    max_interval: int = 8

    def interval(self, in_flight: int) -> int:
        """Tokens per message for a request starting with in_flight streams already running."""
        if self.per_step <= 0:
            return 1
        return max(1, min(self.max_interval, in_flight // self.per_step))
