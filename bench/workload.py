"""A multi-tenant chat workload for the routing benchmarks: each tenant has its own system prompt,
shared by its conversations; each conversation runs several turns, each turn sending the whole
history so far (system prompt, earlier user messages and replies, the new message). Replies in
the history are scripted, not the generated text, so every policy (and the simulator) sees
exactly the same prompts. Deterministic for a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = (
    "river lamp window garden stone cloud winter harbor signal copper forest market ladder paper "
    "engine silver bridge orchard candle meadow compass thunder velvet anchor lantern marble canyon "
    "island feather violet pepper rocket saddle tunnel voyage walnut zephyr beacon cobalt dune ember "
    "fjord glacier hollow ivory jungle kettle lagoon mosaic nectar oasis prairie quartz ripple summit"
).split()


@dataclass(frozen=True, slots=True)
class Request:
    tenant: str
    conversation: str
    turn: int
    # OpenAI chat messages: the system prompt, the history, the new user message.
    messages: tuple[tuple[str, str], ...]
    max_tokens: int


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def multi_tenant_chat(
    tenants: int = 4,
    conversations: int = 8,
    turns: int = 4,
    system_words: int = 300,
    user_words: int = 40,
    reply_words: int = 12,
    max_tokens: int = 16,
    seed: int = 0,
) -> list[list[Request]]:
    """The requests, in rounds: round k holds every conversation's turn k (shuffled), and each
    turn may only start once the conversation's previous turn ended."""
    rng = random.Random(seed)
    systems = {f"tenant{t}": f"You are the assistant of tenant {t}. " + _text(rng, system_words) for t in range(tenants)}
    histories: dict[str, list[tuple[str, str]]] = {}
    owners: dict[str, str] = {}
    for t in systems:
        for c in range(conversations):
            conv = f"{t}-conv{c}"
            histories[conv] = [("system", systems[t])]
            owners[conv] = t
    rounds = []
    for turn in range(turns):
        batch = []
        for conv in sorted(histories):
            history = histories[conv]
            history.append(("user", _text(rng, user_words)))
            batch.append(Request(owners[conv], conv, turn, tuple(history), max_tokens))
            history.append(("assistant", _text(rng, reply_words)))
        rng.shuffle(batch)
        rounds.append(batch)
    return rounds
