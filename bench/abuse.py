"""What a hostile tenant's batch and upload can cost the shared services, replayed in process on
the code that serves them (no mesh needed):

  upload    POST /v1/files bodies built to be slow to parse (82,000 tiny parts in 4 MiB; a file
            of near-boundary bytes) parsed as the router does (gaas.openai.multipart in a thread):
            the parse's CPU and the longest stall of an event loop ticking every millisecond
            beside it (the issue's goal: no stall over 50 ms)
  billing   a batch whose answers are at the per-answer cap (--answers of 4 MiB - 64 KiB, and as
            many small ones), completed, finished and read back through billing's BatchStore on
            SQLite: the peak of Python's allocations while it does (the goal: under 256 MB
            whatever a batch holds)

Prints a table and writes bench/results/abuse.json.

    python -m bench.abuse [--answers 16]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import tracemalloc
from pathlib import Path

from bench.common.output import RESULTS, progress, write_json
from gaas.contracts import batches as terms
from gaas.contracts.errors import InvalidArgument
from gaas.openai import multipart
from gaas.runtime.sql import Database
from gaas.v1 import billing_pb2 as pb
from services.billing.batches import BatchStore
from services.billing.filestore import DirectoryFileStore

say = progress("abuse")


def many_parts() -> bytes:
    part = b'--b\r\nContent-Disposition: form-data; name="x"\r\n\r\ny\r\n'
    return part * 82_000 + b"--b--\r\n"


def near_boundaries() -> bytes:
    head = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n')
    return head + b"\r\n--b\r" * (terms.MAX_UPLOAD_BYTES // 6) + b"\r\n--b--\r\n"


async def upload_stall(body: bytes) -> dict:
    """The parse's CPU seconds and the event loop's longest stall meanwhile."""
    worst = 0.0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last - 0.001)
            last = now

    ticker = asyncio.create_task(tick())
    cpu = time.process_time()
    try:
        await asyncio.to_thread(multipart.parse_upload, "multipart/form-data; boundary=b", body,
                                terms.MAX_UPLOAD_BYTES)
        outcome = "parsed"
    except InvalidArgument as exc:
        outcome = f"400 {exc.message[:60]}"
    cpu = time.process_time() - cpu
    done.set()
    await ticker
    return {"bytes": len(body), "outcome": outcome, "cpu_ms": round(cpu * 1000, 1),
            "max_loop_stall_ms": round(worst * 1000, 1)}


async def billing_peak(answers: int, root: Path) -> dict:
    """A batch of answers at the cap and as many small ones through billing: the allocation peak."""
    db = Database(f"sqlite:///{root / 'ledger.db'}")
    store = BatchStore(db, DirectoryFileStore(root / "files"), terms.BatchPolicy(max_output_bytes=1 << 30,
                                                                                max_tenant_bytes=2 << 30))
    await store.init_schema()
    n = 2 * answers
    lines = b"".join(b'{"custom_id":"r%d","method":"POST","url":"/v1/chat/completions","body":{"model":"m"}}\n' % i
                     for i in range(n))
    f = await store.files.create("acme", "in.jsonl", "batch", lines)
    owner = pb.BatchOwner(tenant="acme", tier="gold", key_id="k", cache_salt="s")
    b = await store.create_batch(owner, f.id, "/v1/chat/completions", {})
    big = b'{"choices":[{"text":"' + b"x" * (terms.MAX_ANSWER_BYTES - 64) + b'"}]}'
    tracemalloc.start()
    started = time.perf_counter()
    while items := await store.claim("router-0", 8, 60):
        for item in items:
            body = big if item.index % 2 == 0 else b'{"choices":[{"text":"short"}]}'
            await store.complete("router-0", pb.BatchItemRef(batch_id=item.batch_id, index=item.index), 200, body,
                                 f"req-{item.index}")
    done = await store.get_batch("acme", b.id)
    size = 0
    async for piece in await store.files.read("acme", done.output_file_id):
        size += len(piece)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    db.close()
    return {"items": n, "answers_at_cap": answers, "output_bytes": size, "status": done.status,
            "seconds": round(time.perf_counter() - started, 2), "peak_alloc_mb": round(peak / 2**20, 1)}


async def run(answers: int) -> dict:
    say("parsing the uploads")
    uploads = {"82k_parts": await upload_stall(many_parts()), "near_boundaries": await upload_stall(near_boundaries())}
    say(f"a batch of {answers} answers at the cap through billing")
    with tempfile.TemporaryDirectory() as tmp:
        billing = await billing_peak(answers, Path(tmp))
    return {"uploads": uploads, "billing": billing}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.abuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=16, help="answers at the per-answer cap in the batch (default 16)")
    ap.add_argument("--out", default=str(RESULTS / "abuse.json"))
    args = ap.parse_args(argv)
    doc = asyncio.run(run(args.answers))
    print(f"{'upload':<18}{'bytes':>10}{'cpu ms':>10}{'max stall ms':>14}  outcome")
    for name, u in doc["uploads"].items():
        print(f"{name:<18}{u['bytes']:>10}{u['cpu_ms']:>10}{u['max_loop_stall_ms']:>14}  {u['outcome']}")
    b = doc["billing"]
    print(f"billing: {b['items']} items ({b['answers_at_cap']} at {terms.MAX_ANSWER_BYTES} bytes), output "
          f"{b['output_bytes'] / 2**20:.0f} MiB, {b['status']} in {b['seconds']} s, peak allocations "
          f"{b['peak_alloc_mb']} MB (goal < 256)")
    print(f"wrote {write_json(args.out, doc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
