"""What tests of a stream's chunks share (the continuation's, the worker's carry-on, the router's
migration): a chunk of one token."""

from gaas.v1 import common_pb2


def tok(token_id, text, prefill=None, final=None):
    c = common_pb2.GenerateChunk(text=text, token_ids=[token_id])
    if prefill is not None:
        c.prefill.prompt_tokens, c.prefill.cached_tokens = prefill
    if final is not None:
        c.finish_reason = common_pb2.FINISH_REASON_LENGTH
        c.usage.prompt_tokens, c.usage.cached_tokens, c.usage.completion_tokens = final
        c.worker_id = "w1"
    return c
