"""Batches' durable state, in the ledger's database: files (their bytes in a FileStore), batches
and each batch's items. The routers' runners claim items with a lease and complete each once;
an item whose runner stopped (its lease lapsed) is claimed again, and its second run has the
same request id, so the ledger bills it once whatever happens (services/billing/ledger.py keys
usage by request id).

A batch: in_progress from its creation (its lines were checked then: failed, with the lines'
errors, when the file is not a batch input), finalizing once its last item is done (the output
and error files are written), then completed. A cancel makes it cancelling: its items not yet
claimed never run, the running ones may finish, then it is cancelled. Past its 24 h window it
expires alike. Finishing is idempotent (done again by maintain() after a restart mid-way)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from gaas.contracts import batches as terms, errors
from gaas.contracts.errors import quote
from gaas.openai import batches as wire
from gaas.runtime.migrations import migrate
from gaas.runtime.sql import Database
from gaas.v1 import billing_pb2 as pb
from services.billing.batchfiles import LIVE_BATCHES, BatchFiles, derived_id
from services.billing.filestore import FileStore

log = logging.getLogger(__name__)

MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE IF NOT EXISTS batch_files (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            filename TEXT NOT NULL,
            purpose TEXT NOT NULL,
            bytes BIGINT NOT NULL,
            created_ms BIGINT NOT NULL
        )""",
        "CREATE INDEX IF NOT EXISTS batch_files_tenant ON batch_files (tenant, created_ms)",
        """CREATE TABLE IF NOT EXISTS batches (
            id TEXT PRIMARY KEY,
            tenant TEXT NOT NULL,
            tier TEXT NOT NULL,
            key_id TEXT NOT NULL,
            cache_salt TEXT NOT NULL,
            endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL,
            status TEXT NOT NULL,
            ending TEXT NOT NULL DEFAULT '',
            price_factor DOUBLE PRECISION NOT NULL,
            metadata TEXT NOT NULL,
            errors TEXT NOT NULL DEFAULT '[]',
            total INTEGER NOT NULL,
            completed INTEGER NOT NULL DEFAULT 0,
            failed INTEGER NOT NULL DEFAULT 0,
            output_file_id TEXT NOT NULL DEFAULT '',
            error_file_id TEXT NOT NULL DEFAULT '',
            created_ms BIGINT NOT NULL,
            expires_ms BIGINT NOT NULL,
            in_progress_ms BIGINT NOT NULL DEFAULT 0,
            finalizing_ms BIGINT NOT NULL DEFAULT 0,
            ended_ms BIGINT NOT NULL DEFAULT 0,
            cancelling_ms BIGINT NOT NULL DEFAULT 0
        )""",
        "CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_ms)",
        "CREATE INDEX IF NOT EXISTS batches_status ON batches (status, created_ms)",
        # state: pending (not claimed, or given back), running (leased to owner until lease_ms), done.
        """CREATE TABLE IF NOT EXISTS batch_items (
            batch_id TEXT NOT NULL,
            idx INTEGER NOT NULL,
            custom_id TEXT NOT NULL,
            body TEXT NOT NULL,
            state TEXT NOT NULL,
            owner TEXT NOT NULL DEFAULT '',
            lease_ms BIGINT NOT NULL DEFAULT 0,
            attempts INTEGER NOT NULL DEFAULT 0,
            ok INTEGER NOT NULL DEFAULT 0,
            result TEXT NOT NULL DEFAULT '',
            PRIMARY KEY (batch_id, idx)
        )""",
        "CREATE INDEX IF NOT EXISTS batch_items_state ON batch_items (state, lease_ms)",
    ],
    [
        # An item given back for a reason is not claimed again before not_before_ms; last_error is
        # that reason (its error line's, once it has run out of attempts).
        "ALTER TABLE batch_items ADD COLUMN not_before_ms BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE batch_items ADD COLUMN last_error TEXT NOT NULL DEFAULT ''",
        # The bytes of the batch's answers kept so far (its output and error files to be).
        "ALTER TABLE batches ADD COLUMN output_bytes BIGINT NOT NULL DEFAULT 0",
        "CREATE INDEX IF NOT EXISTS batches_tenant_status ON batches (tenant, status)",
    ],
]

_BATCH_COLS = ("id, tenant, tier, key_id, cache_salt, endpoint, input_file_id, status, ending, price_factor, metadata, "
               "errors, total, completed, failed, output_file_id, error_file_id, created_ms, expires_ms, in_progress_ms, "
               "finalizing_ms, ended_ms, cancelling_ms")
# The status a batch ends in, by why it stopped (none: completed).
_ENDED_AS = {"": "completed", "expired": "expired", "cancelled": "cancelled", "output_limit": "failed"}
# Finishing reads the answers back in pages of at most this many rows and about this many bytes.
_PAGE_ROWS = 1000
_PAGE_BYTES = 8 << 20


def _s(ms: int) -> int:
    return ms // 1000


def batch_pb(row: Sequence) -> pb.Batch:
    (bid, tenant, tier, _key, _salt, endpoint, input_file, status, ending, factor, metadata, errs, total, completed,
     failed, out_id, err_id, created, expires, in_progress, finalizing, ended, cancelling) = row
    b = pb.Batch(id=bid, tenant=tenant, tier=tier, endpoint=endpoint, input_file_id=input_file,
                 completion_window=terms.COMPLETION_WINDOW, status=status, output_file_id=out_id, error_file_id=err_id,
                 created_at=_s(created), in_progress_at=_s(in_progress), expires_at=_s(expires),
                 finalizing_at=_s(finalizing), cancelling_at=_s(cancelling), total=total, completed=completed,
                 failed=failed, metadata=json.loads(metadata), price_factor=factor)
    b.errors.extend(pb.BatchError(**e) for e in json.loads(errs))
    if status in terms.FINAL:
        setattr(b, f"{status}_at", _s(ended))
    return b


def _batch_not_found(batch_id: str) -> errors.NotFound:
    return errors.NotFound(f"no batch {quote(batch_id)}", param="batch_id", reason="batch_not_found")


class BatchStore:
    def __init__(self, db: Database, files: FileStore, policy: terms.BatchPolicy = terms.DEFAULT_POLICY,
                 clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self.files = BatchFiles(db, files, policy, clock)
        self.policy = policy
        self._clock = clock
        self._pg = db.dialect == "postgresql"
        # Which tenant a claim serves first: the next one each time (claims go round the tenants).
        self._turn = 0

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    async def init_schema(self) -> None:
        await migrate(self._db, "batches", MIGRATIONS)

    # ------------------------------------------------------------ batches

    async def create_batch(self, owner: pb.BatchOwner, input_file_id: str, endpoint: str,
                           metadata: dict[str, str]) -> pb.Batch:
        tenant = owner.tenant
        data = await self.files.read_input(tenant, input_file_id)
        (active,), = await self._db.execute(
            f"SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN {LIVE_BATCHES}", (tenant,))
        if active >= self.policy.max_active_batches:
            raise errors.ResourceExhausted(
                f"this tenant has {active} batches running, the most it may; wait for one to finish or cancel one",
                reason="too_many_batches")
        # Room for the output and error files of every running batch, this one's too.
        kept = await self.files.count(tenant)
        if kept + 2 * (active + 1) > self.policy.max_files:
            raise errors.ResourceExhausted(
                f"this tenant keeps {kept} files and a batch needs room for two more (its output and error files) "
                f"within its {self.policy.max_files}: delete some (DELETE /v1/files/{{file_id}}) first",
                reason="too_many_files")
        items, bad = wire.parse_lines(data, endpoint, self.policy.max_items)
        del data
        now = self._now_ms()
        bid = terms.BATCH_PREFIX + uuid.uuid4().hex
        status = "failed" if bad else "in_progress"
        errs = [{"code": e.code, "message": e.message, "param": e.param, "line": e.line} for e in bad]
        row = (bid, tenant, owner.tier, owner.key_id, owner.cache_salt, endpoint, input_file_id, status, "",
               self.policy.factor(owner.tier), json.dumps(metadata), json.dumps(errs), 0 if bad else len(items), 0, 0,
               "", "", now, now + terms.WINDOW_SECONDS * 1000, 0 if bad else now, 0, now if bad else 0, 0)
        statements = [(f"INSERT INTO batches ({_BATCH_COLS}) VALUES ({', '.join('?' * len(row))})", row)]
        statements += [("INSERT INTO batch_items (batch_id, idx, custom_id, body, state) VALUES (?, ?, ?, ?, 'pending')",
                        (bid, i, it.custom_id, it.body.decode())) for i, it in enumerate([] if bad else items)]
        await self._db.transaction(statements)
        log.info("batch %s of %s: %s, %d requests", bid, tenant, status, len(items))
        return batch_pb(row)

    async def get_batch(self, tenant: str, batch_id: str) -> pb.Batch:
        where, params = ("id = ? AND tenant = ?", (batch_id, tenant)) if tenant else ("id = ?", (batch_id,))
        rows = await self._db.execute(f"SELECT {_BATCH_COLS} FROM batches WHERE {where}", params)
        if not rows:
            raise _batch_not_found(batch_id)
        return batch_pb(rows[0])

    async def list_batches(self, tenant: str, limit: int, after: str) -> tuple[list[pb.Batch], bool]:
        query, params = f"SELECT {_BATCH_COLS} FROM batches WHERE 1 = 1", []
        if tenant:
            query += " AND tenant = ?"
            params.append(tenant)
        if after:
            mark = await self._db.execute("SELECT created_ms FROM batches WHERE id = ?" +
                                          (" AND tenant = ?" if tenant else ""), (after, tenant) if tenant else (after,))
            if not mark:
                raise _batch_not_found(after)
            query += " AND (created_ms < ? OR (created_ms = ? AND id < ?))"
            params += [mark[0][0], mark[0][0], after]
        query += " ORDER BY created_ms DESC, id DESC LIMIT ?"
        params.append(limit + 1)
        rows = await self._db.execute(query, params)
        return [batch_pb(r) for r in rows[:limit]], len(rows) > limit

    async def cancel_batch(self, tenant: str, batch_id: str) -> pb.Batch:
        b = await self.get_batch(tenant, batch_id)
        if b.status not in ("in_progress", "cancelling"):
            raise errors.FailedPrecondition(f"batch {batch_id} is {b.status}: only a batch in progress can be cancelled",
                                            param="batch_id")
        await self._end_items(batch_id, "cancelled")
        await self.maintain(batch_id)
        return await self.get_batch(tenant, batch_id)

    async def _end_items(self, batch_id: str, ending: str, error: dict | None = None) -> None:
        """Stop a batch (cancelled, expired, its output full): its items not claimed never run
        (each gets an error line when it finishes), its running ones may still finish. A
        cancelled batch reads as cancelling until then. error: an entry for the batch's errors."""
        now = self._now_ms()
        if ending == "cancelled":
            await self._db.execute("UPDATE batches SET status = 'cancelling', ending = ?, cancelling_ms = ? WHERE "
                                   "id = ? AND status = 'in_progress'", (ending, now, batch_id))
            return

        def run(execute) -> None:
            rows = execute("SELECT errors FROM batches WHERE id = ? AND status = 'in_progress' AND ending = ''",
                           (batch_id,))
            if rows:
                errs = json.loads(rows[0][0]) + ([error] if error else [])
                execute("UPDATE batches SET ending = ?, errors = ? WHERE id = ?", (ending, json.dumps(errs), batch_id))

        await self._db.run(run)

    # ------------------------------------------------------------ the runners

    async def claim(self, runner: str, most: int, lease_s: float, fresh: bool = False) -> list[pb.BatchItem]:
        """Up to most items to run, each leased to runner for lease_s: the tenants in turn (a
        tenant's oldest batch first), so one tenant's batches never hold another's back; items
        waiting out a back-off are skipped. fresh: the runner just started, so the items leased to
        its name are lapsed already."""
        now = self._now_ms()
        if fresh:
            await self._db.execute("UPDATE batch_items SET lease_ms = 0 WHERE owner = ? AND state = 'running'", (runner,))
        until = now + int(lease_s * 1000)
        lock = " FOR UPDATE OF i SKIP LOCKED" if self._pg else ""
        turn = self._turn
        self._turn += 1

        def run(execute) -> list[pb.BatchItem]:
            live = execute("SELECT id, tenant, tier, key_id, cache_salt, endpoint, price_factor FROM batches WHERE "
                           "status = 'in_progress' AND ending = '' AND expires_ms > ? ORDER BY created_ms, id", (now,))
            batches = {r[0]: r for r in live}
            tenants = list(dict.fromkeys(r[1] for r in live))
            if not tenants:
                return []
            start = turn % len(tenants)
            tenants = tenants[start:] + tenants[:start]
            share = max(1, -(-most // len(tenants)))
            claimed: list[pb.BatchItem] = []
            for tenant in tenants:
                rows = execute(
                    "SELECT i.batch_id, i.idx, i.custom_id, i.body, i.attempts FROM batch_items i JOIN batches b ON "
                    "b.id = i.batch_id WHERE b.tenant = ? AND b.status = 'in_progress' AND b.ending = '' AND "
                    "b.expires_ms > ? AND (i.state = 'pending' OR (i.state = 'running' AND i.lease_ms < ?)) AND "
                    f"i.not_before_ms <= ? ORDER BY b.created_ms, i.batch_id, i.idx LIMIT ?{lock}",
                    (tenant, now, now, now, min(share, most - len(claimed))))
                for bid, idx, custom_id, body, attempts in rows:
                    execute("UPDATE batch_items SET state = 'running', owner = ?, lease_ms = ?, attempts = attempts + 1 "
                            "WHERE batch_id = ? AND idx = ?", (runner, until, bid, idx))
                    _, tenant_, tier, key, salt, endpoint, factor = batches[bid]
                    claimed.append(pb.BatchItem(
                        batch_id=bid, index=idx, custom_id=custom_id, body=body.encode(), attempt=attempts + 1,
                        endpoint=endpoint, price_factor=factor,
                        owner=pb.BatchOwner(tenant=tenant_, tier=tier, key_id=key, cache_salt=salt)))
                if len(claimed) >= most:
                    break
            return claimed

        return await self._db.run(run)

    async def renew(self, runner: str, items: Sequence[pb.BatchItemRef], lease_s: float) -> list[pb.BatchItemRef]:
        """The items still runner's, their leases renewed (an item of a batch that stopped is not)."""
        until = self._now_ms() + int(lease_s * 1000)

        def run(execute) -> list[pb.BatchItemRef]:
            kept = []
            for ref in items:
                held = execute(
                    "UPDATE batch_items SET lease_ms = ? WHERE batch_id = ? AND idx = ? AND owner = ? AND "
                    "state = 'running' AND batch_id IN (SELECT id FROM batches WHERE status = 'in_progress' AND ending = '') "
                    "RETURNING idx", (until, ref.batch_id, ref.index, runner))
                if held:
                    kept.append(ref)
            return kept

        return await self._db.run(run)

    async def release(self, runner: str, items: Sequence[pb.BatchItemRef], reason: str = "") -> None:
        """Items runner gives back unrun. No reason (the runner stopped): claimable again at once,
        their run not counted. A reason (what the item lacked): the run counts, the item waits out
        its back-off, and after ITEM_ATTEMPTS runs it fails with that reason."""
        if not reason:
            await self._db.transaction(
                ("UPDATE batch_items SET state = 'pending', owner = '', lease_ms = 0, attempts = attempts - 1 "
                 "WHERE batch_id = ? AND idx = ? AND owner = ? AND state = 'running'", (r.batch_id, r.index, runner))
                for r in items)
            return
        now = self._now_ms()
        reason = reason[:errors.MAX_MESSAGE_CHARS]

        def run(execute) -> list[str]:
            failed = []
            for ref in items:
                rows = execute("SELECT attempts, custom_id FROM batch_items WHERE batch_id = ? AND idx = ? AND owner = ? "
                               "AND state = 'running'", (ref.batch_id, ref.index, runner))
                if not rows:
                    continue
                attempts, custom_id = rows[0]
                if attempts < terms.ITEM_ATTEMPTS:
                    execute("UPDATE batch_items SET state = 'pending', owner = '', lease_ms = 0, not_before_ms = ?, "
                            "last_error = ? WHERE batch_id = ? AND idx = ?",
                            (now + int(terms.item_backoff_s(attempts) * 1000), reason, ref.batch_id, ref.index))
                    continue
                line = wire.error_line(custom_id, "not_run", f"not run after {attempts} attempts: {reason}").decode()
                execute("UPDATE batch_items SET state = 'done', ok = 0, result = ?, last_error = ? WHERE batch_id = ? "
                        "AND idx = ?", (line, reason, ref.batch_id, ref.index))
                execute("UPDATE batches SET failed = failed + 1, output_bytes = output_bytes + ? WHERE id = ?",
                        (len(line), ref.batch_id))
                failed.append(ref.batch_id)
            return failed

        for batch_id in dict.fromkeys(await self._db.run(run)):
            await self.maintain(batch_id)

    async def complete(self, runner: str, ref: pb.BatchItemRef, status_code: int, body: bytes, request_id: str) -> bool:
        """An item's answer, kept once; False when it was done before. An answer over
        MAX_ANSWER_BYTES is kept as its error; one that would take the batch's answers past
        max_output_bytes, or its tenant's past max_tenant_bytes, stops the batch. The batch
        finishes with its last item."""
        tenant_rows = await self._db.execute("SELECT b.tenant FROM batches b WHERE b.id = ?", (ref.batch_id,))
        if not tenant_rows:
            return False
        room = self.policy.max_tenant_bytes - await self.files.tenant_bytes(tenant_rows[0][0])
        too_large = len(body) > terms.MAX_ANSWER_BYTES
        ok = status_code == 200 and not too_large

        def run(execute) -> tuple[bool, bool]:
            item = execute("SELECT i.custom_id, b.output_bytes FROM batch_items i JOIN batches b ON b.id = i.batch_id "
                           "WHERE i.batch_id = ? AND i.idx = ? AND i.state != 'done'", (ref.batch_id, ref.index))
            if not item:
                return False, False
            custom_id, output_bytes = item[0]
            if too_large:
                line = wire.error_line(custom_id, "answer_too_large", f"the answer was {len(body)} bytes, over the "
                                       f"{terms.MAX_ANSWER_BYTES} a batch answer may be: ask for fewer choices (n), "
                                       "tokens (max_tokens) or top_logprobs")
            else:
                line = wire.answer_line(custom_id, request_id, status_code, body)
            full = output_bytes + len(line) > self.policy.max_output_bytes or len(line) > room
            if full:
                line = wire.unrun_line(custom_id, "output_limit")
            # (state != 'done' again: a billing replica beside this one may have completed it meanwhile)
            if not execute("UPDATE batch_items SET state = 'done', ok = ?, result = ?, owner = ? WHERE batch_id = ? AND "
                           "idx = ? AND state != 'done' RETURNING idx",
                           (1 if ok and not full else 0, line.decode(), runner, ref.batch_id, ref.index)):
                return False, False
            execute(f"UPDATE batches SET {'completed = completed' if ok and not full else 'failed = failed'} + 1, "
                    "output_bytes = output_bytes + ? WHERE id = ?", (len(line), ref.batch_id))
            return True, full

        recorded, full = await self._db.run(run)
        if full:
            log.warning("batch %s: its answers reached their limit; its other requests will not run", ref.batch_id)
            await self._end_items(ref.batch_id, "output_limit", {
                "code": "output_limit_exceeded", "param": "", "line": 0,
                "message": f"the batch's answers reached the most it may keep ({self.policy.max_output_bytes} bytes), "
                           f"or its tenant's files and answers theirs ({self.policy.max_tenant_bytes}); its other "
                           "requests were not run"})
        if recorded:
            await self.maintain(ref.batch_id)
        return recorded

    # ------------------------------------------------------------ finishing

    async def maintain(self, batch_id: str | None = None) -> None:
        """Expire the batches past their window, and finish those with every item done, or stopped
        with none still running (one, or all of them): their output and error files written,
        their end recorded."""
        now = self._now_ms()
        if batch_id is None:
            for (bid,) in await self._db.execute(
                    "SELECT id FROM batches WHERE status = 'in_progress' AND ending = '' AND expires_ms <= ?", (now,)):
                await self._end_items(bid, "expired")
        rows = await self._db.execute(
            f"SELECT id FROM batches WHERE {'id = ? AND ' if batch_id else ''}"
            "status IN ('in_progress', 'cancelling', 'finalizing') AND NOT EXISTS (SELECT 1 FROM batch_items i "
            "WHERE i.batch_id = batches.id AND ((batches.ending = '' AND i.state != 'done') OR "
            "(i.state = 'running' AND i.lease_ms >= ?)))", (batch_id, now) if batch_id else (now,))
        for (bid,) in rows:
            await self._finish(bid)

    async def _finish(self, batch_id: str) -> None:
        """The batch's files written (items that never ran get their error line first), each read
        back from the database a page at a time, then its end."""
        now = self._now_ms()
        rows = await self._db.execute(f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?", (batch_id,))
        b, ending = batch_pb(rows[0]), rows[0][8]
        if b.status != "finalizing":
            def stop(execute) -> None:
                for idx, custom_id in execute("SELECT idx, custom_id FROM batch_items WHERE batch_id = ? AND "
                                              "state != 'done'", (batch_id,)):
                    execute("UPDATE batch_items SET state = 'done', ok = 0, result = ? WHERE batch_id = ? AND idx = ?",
                            (wire.unrun_line(custom_id, ending or "expired").decode(), batch_id, idx))
                execute("UPDATE batches SET status = 'finalizing', finalizing_ms = ? WHERE id = ?", (now, batch_id))

            await self._db.run(stop)
        counts = dict(await self._db.execute("SELECT ok, COUNT(*) FROM batch_items WHERE batch_id = ? GROUP BY ok",
                                             (batch_id,)))
        out = err = ""
        if counts.get(1):
            out = await self.files.write_output(b.tenant, derived_id(batch_id, "output"), f"{batch_id}_output.jsonl",
                                                self._results(batch_id, 1))
        if counts.get(0):
            err = await self.files.write_output(b.tenant, derived_id(batch_id, "error"), f"{batch_id}_error.jsonl",
                                                self._results(batch_id, 0))
        await self._db.execute(
            "UPDATE batches SET status = ?, output_file_id = ?, error_file_id = ?, ended_ms = ? WHERE id = ? AND "
            "status = 'finalizing'", (_ENDED_AS.get(ending, "completed"), out, err, now, batch_id))
        log.info("batch %s %s: %d completed, %d failed", batch_id, ending or "completed", b.completed, b.failed)

    async def _results(self, batch_id: str, ok: int):
        """The batch's answer lines of one kind (ok 1: output, 0: errors) in input order, read a
        page at a time: at most about _PAGE_BYTES (or one answer) in memory at once."""
        after = -1
        while True:
            sizes = await self._db.execute(
                "SELECT idx, LENGTH(result) FROM batch_items WHERE batch_id = ? AND ok = ? AND idx > ? ORDER BY idx "
                "LIMIT ?", (batch_id, ok, after, _PAGE_ROWS))
            if not sizes:
                return
            last, total = sizes[0][0], 0
            for idx, size in sizes:
                if total and total + size > _PAGE_BYTES:
                    break
                last, total = idx, total + size
            for (result,) in await self._db.execute(
                    "SELECT result FROM batch_items WHERE batch_id = ? AND ok = ? AND idx > ? AND idx <= ? ORDER BY idx",
                    (batch_id, ok, after, last)):
                yield result.encode()
            after = last
