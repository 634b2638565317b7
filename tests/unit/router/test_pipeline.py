"""The request pipeline's own rules, before any stage reaches a worker."""

from __future__ import annotations

import pytest

from gaas.contracts import errors
from gaas.contracts.principal import Principal
from gaas.v1 import inference_pb2
from services.router.pipeline import Pipeline, Timing

ACME = Principal("acme", "gold", "key-1", "salt-acme")


async def test_a_session_turn_of_several_prompts_is_refused_before_anything_is_prepared():
    # (no stages: nothing may be prepared, tokenized or admitted for it)
    pipeline = Pipeline(stages=None, authenticator=None)
    turn = [inference_pb2.GenerateRequest(prompt=p, session_id="chat-1") for p in ("a", "b")]
    with pytest.raises(errors.InvalidArgument, match="a session turn is one prompt, not a batch"):
        await pipeline.start(ACME, turn, Timing())
