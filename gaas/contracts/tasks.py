"""What a model serves, its task, as a deployment names it (a pool's engine: {task: ...}) and every
service reads it: generations (completions and chats), or a vector per input (embeddings, vLLM's
pooling runner). A request for what its model does not serve is refused with a 400 saying what
the model serves."""

from __future__ import annotations

from gaas.contracts.errors import InvalidArgument

GENERATE = "generate"
EMBED = "embed"
TASKS = (GENERATE, EMBED)

_WHAT = {GENERATE: "completions and chats (/v1/completions, /v1/chat/completions)",
         EMBED: "embeddings (/v1/embeddings, /pooling, /score, /rerank)"}


def check(model: str, task: str, wanted: str) -> None:
    """InvalidArgument when model (which serves task) is asked for what wanted serves."""
    if (task or GENERATE) != wanted:
        raise InvalidArgument(f"model {model!r} serves {_WHAT.get(task, task)}, not {_WHAT[wanted].split(' (')[0]}; "
                              "GET /v1/models lists what each model serves", param="model")
