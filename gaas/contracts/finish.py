"""Why a generation ended: one mapping for every process, between the engine's word for it (vLLM's),
the wire's enum (common.proto's FinishReason), the OpenAI API's finish_reason and the label metrics
and summaries give it. The four share their names, so a reason is one word wherever it is read.

stop: an end-of-sequence token or a stop string; length: max_tokens or the model's context reached;
abort: cancelled or aborted by the engine; error: the engine failed after some tokens. Pure: no I/O.
"""

from __future__ import annotations

from gaas.v1 import common_pb2

STOP, LENGTH, ABORT, ERROR = "stop", "length", "abort", "error"
# The label of a chunk that is not its stream's last (the wire's FINISH_REASON_UNSPECIFIED).
UNSPECIFIED = "unspecified"

TO_PB = {
    STOP: common_pb2.FINISH_REASON_STOP,
    LENGTH: common_pb2.FINISH_REASON_LENGTH,
    ABORT: common_pb2.FINISH_REASON_ABORT,
    ERROR: common_pb2.FINISH_REASON_ERROR,
}
FROM_PB = {pb: reason for reason, pb in TO_PB.items()}


def from_engine(reason: str | None) -> str | None:
    """The engine's finish reason as ours: None while it generates; one we do not know is an error."""
    if reason is None:
        return None
    return reason if reason in (STOP, LENGTH, ABORT) else ERROR


def openai(reason: int) -> str | None:
    """The OpenAI API's finish_reason for a chunk's FinishReason: None until the stream's last chunk."""
    return FROM_PB.get(reason)


def label(reason: int) -> str:
    """A chunk's FinishReason as metrics and summaries name it: its reason, or "unspecified" (not finished)."""
    return FROM_PB.get(reason, UNSPECIFIED)
