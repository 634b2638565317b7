"""Dimension 2, KV-cache sharing granularity (kvcache's directory, the router's salts): each level at
which GaaS lets one request reuse another's KV blocks, measured by the cached tokens the engine
reports on a workload built for that level; and the levels it never shares across, measured the
same way (a hit there would be a leak). A level's ceiling is what an engine holding every earlier
request's blocks, ignoring who sent them, could have reused (the requests' own token ids, chained
block by block as the engines hash them).

  request         the same request sent again by its tenant
  session         a session's next turns (x-gaas-session: GaaS keeps the context and puts it first)
  tenant          another API key (user) of the tenant, the same system prompt, another question
  public prefix   another tenant, beginning with a system prompt the operator declared public
  never: tenant   another tenant sending exactly a tenant's undeclared prompt
  never: model    the same prompt to another model
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from pathlib import Path

from bench.common import sse
from bench.sits.card import Dimension, Unmeasured
from bench.sits.load import Outcome, stream, text
from bench.sits.target import Target

MODEL = "gaas-tiny"
SHARED_TOKENS = 600
# Time for the engines' KV events to reach the directory before a request that should hit them.
SETTLE_S = 0.5


class Chats:
    """Chat requests to the ingress, one at a time, each remembered with its messages."""

    def __init__(self, t: Target) -> None:
        self.t = t
        self.sent: list[tuple[str, list[dict], Outcome]] = []

    def __call__(self, key: str, messages: list[dict], model: str = MODEL, session: str = "") -> Outcome:
        headers = [("x-gaas-session", session)] if session else []
        body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        async def one() -> Outcome:
            async with sse.session(self.t.base_url, timeout=120) as c:
                return await stream(c, key, body, chat=True, headers=headers)

        out = asyncio.run(one())
        if not out.ok:
            raise RuntimeError(f"a {model} chat request failed with HTTP {out.status}")
        self.sent.append((model, messages, out))
        return out


def ceiling(block_size: int, earlier: list[list[int]], ids: list[int]) -> int:
    """Tokens of ids an engine holding every earlier prompt's blocks could reuse (vLLM recomputes at
    least the last token)."""
    from gaas.contracts import kvhash

    held = {h for e in earlier for h in kvhash.prefix_hashes(e, block_size, "")}
    n = 0
    for h in kvhash.prefix_hashes(ids, block_size, ""):
        if h not in held:
            break
        n += 1
    return min(n, (len(ids) - 1) // block_size) * block_size


def measure(t: Target, say, quick: bool = False) -> Dimension:
    from gaas.launcher.mesh import ROOT
    from gaas.model.tokenizer import ChatMessage, Tokenizer

    d = Dimension("kv_cache_sharing")
    rng = random.Random(11)
    reuse = 2 if quick else 3
    models = {m["name"]: m for m in t.models()}
    workers = t.workers(MODEL)
    if not workers:
        d.error = f"the target serves no {MODEL}"
        return d
    block_size = workers[0]["block_size"] or 16
    source = Path(models[MODEL]["source"])
    tok = Tokenizer.load(source if source.is_absolute() else ROOT / source)
    a, a_key = t.tenant("kv-a", "gold")
    _, b_key = t.tenant("kv-b", "gold")
    a_key2 = t.key_of(a)
    chat = Chats(t)

    def shared(label: str) -> str:
        return f"{label} {uuid.uuid4().hex} " + text(rng, SHARED_TOKENS)

    def question() -> str:
        return f"question {uuid.uuid4().hex[:6]}: " + text(rng, 12)

    levels: dict[str, list[Outcome]] = {}
    # Which earlier requests a level's requests could reuse (their sent index), for its ceiling.
    say("kv sharing: request level (the same request again)")
    p = [{"role": "user", "content": shared("request")}]
    chat(a_key, p)
    time.sleep(SETTLE_S)
    levels["request"] = [chat(a_key, p) for _ in range(reuse)]

    say("kv sharing: session level (the next turns of a session)")
    session = f"sits-{uuid.uuid4().hex[:8]}"
    history = [{"role": "system", "content": shared("session")}, {"role": "user", "content": question()}]
    first = chat(a_key, history, session=session)
    history.append({"role": "assistant", "content": first.text})
    turns = []
    for _ in range(reuse):
        time.sleep(SETTLE_S)
        msg = {"role": "user", "content": question()}
        out = chat(a_key, [msg], session=session)
        chat.sent[-1] = (MODEL, [*history, msg], out)  # the prompt the engine saw: the context first
        history += [msg, {"role": "assistant", "content": out.text}]
        turns.append(out)
    levels["session"] = turns

    say("kv sharing: tenant level (another user of the tenant, the same system prompt)")
    system = shared("tenant")
    chat(a_key, [{"role": "system", "content": system}, {"role": "user", "content": question()}])
    time.sleep(SETTLE_S)
    levels["tenant"] = [chat(a_key2, [{"role": "system", "content": system}, {"role": "user", "content": question()}])
                        for _ in range(reuse)]

    say("kv sharing: a declared public prefix (another tenant)")
    public = shared("public")
    with t.admin() as adm:
        prefix = adm.add_public_prefix(MODEL, public)
    try:
        time.sleep(2.0)  # the routers' next read of the registry
        chat(a_key, [{"role": "system", "content": public}, {"role": "user", "content": question()}])
        time.sleep(SETTLE_S)
        levels["public prefix"] = [chat(b_key, [{"role": "system", "content": public},
                                                {"role": "user", "content": question()}]) for _ in range(reuse)]
    finally:
        with t.admin() as adm:
            adm.remove_public_prefix(prefix["prefix_id"])

    say("kv sharing: never across tenants (an undeclared prompt of another tenant)")
    private = [{"role": "system", "content": shared("private")}, {"role": "user", "content": "the same question"}]
    chat(a_key, private)
    time.sleep(SETTLE_S)
    # Each from a tenant of its own, sent once: a tenant's second request would hit its own first.
    others = [t.tenant(f"kv-other-{i}", "gold")[1] for i in range(reuse)]
    levels["never: another tenant"] = [chat(k, private) for k in others]
    other = next((m for m in models if m != MODEL and t.workers(m)), None)
    if other:
        say(f"kv sharing: never across models ({MODEL}'s prompt to {other}, by the same tenant)")
        levels["never: another model"] = [chat(a_key, private, model=other)]
    else:
        d.unmeasured.append(Unmeasured("never across models", "the target serves one model",
                                       "a mesh serving two models (the scorecard's own)"))

    # Each request's token ids as its engine saw them (the chat template of the model it went to).
    ids = [tok.encode_chat([ChatMessage(m["role"], m["content"]) for m in msgs]) for _, msgs, _ in chat.sent]
    index = {id(o): i for i, (_, _, o) in enumerate(chat.sent)}
    rows = []
    for level, outs in levels.items():
        prompt = sum(o.prompt_tokens for o in outs)
        cached = sum(o.cached_tokens for o in outs)
        reusable = sum(ceiling(block_size, ids[:index[id(o)]], ids[index[id(o)]]) for o in outs)
        rows.append({"level": level, "requests": len(outs), "prompt_tokens": prompt, "cached_tokens": cached,
                     "hit_rate": round(cached / prompt, 3) if prompt else None,
                     "ceiling": round(reusable / prompt, 3) if prompt else None,
                     "shared": not level.startswith("never")})
    d.figures = {"block_size": block_size, "levels": rows}
    shares = [r["level"] for r in rows if r["shared"] and r["hit_rate"] and r["hit_rate"] > 0]
    leaks = [r["level"] for r in rows if not r["shared"] and r["cached_tokens"] > 0]
    d.figures["leaks"] = leaks
    d.cell = ("yes (" + ", ".join(f"{r['level']} {r['hit_rate']:.0%}" for r in rows if r["level"] in shares) + ")"
              + ("; never across tenants/models: 0 cached" if not leaks else f"; LEAK: {', '.join(leaks)} hit"))
    return d
