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
from gaas.openai import batches as wire, multipart
from gaas.runtime.migrations import migrate
from gaas.runtime.sql import Database
from gaas.v1 import billing_pb2 as pb
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
]

_BATCH_COLS = ("id, tenant, tier, key_id, cache_salt, endpoint, input_file_id, status, ending, price_factor, metadata, "
               "errors, total, completed, failed, output_file_id, error_file_id, created_ms, expires_ms, in_progress_ms, "
               "finalizing_ms, ended_ms, cancelling_ms")
_FILE_COLS = "id, tenant, filename, purpose, bytes, created_ms"
# A batch whose items still run (or may be claimed).
_LIVE = ("in_progress", "cancelling")


def _s(ms: int) -> int:
    return ms // 1000


def file_pb(row: Sequence) -> pb.BatchFile:
    fid, tenant, filename, purpose, size, created = row
    return pb.BatchFile(id=fid, tenant=tenant, filename=filename, purpose=purpose, bytes=size, created_at=_s(created))


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


def _file_not_found(file_id: str, param: str = "file_id") -> errors.NotFound:
    return errors.NotFound(f"no file {quote(file_id)}: it was never uploaded, or was deleted", param=param,
                           reason="file_not_found")


class BatchStore:
    def __init__(self, db: Database, files: FileStore, policy: terms.BatchPolicy = terms.DEFAULT_POLICY,
                 clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._files = files
        self.policy = policy
        self._clock = clock
        self._pg = db.dialect == "postgresql"

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    async def init_schema(self) -> None:
        await migrate(self._db, "batches", MIGRATIONS)

    # ------------------------------------------------------------ files

    async def create_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> pb.BatchFile:
        if purpose not in multipart.PURPOSES:
            raise errors.InvalidArgument(f"purpose {quote(purpose)} is not kept here: use \"batch\"", param="purpose")
        if len(data) > self.policy.max_file_bytes:
            raise errors.InvalidArgument(f"the file is {len(data)} bytes; a batch input file can be at most "
                                         f"{self.policy.max_file_bytes}", param="file", reason="file_too_large")
        (count,), = await self._db.execute("SELECT COUNT(*) FROM batch_files WHERE tenant = ?", (tenant,))
        if count >= self.policy.max_files:
            raise errors.ResourceExhausted(f"this tenant keeps {count} files, the most it may: delete some "
                                           "(DELETE /v1/files/{file_id}) first", reason="too_many_files")
        return await self._add_file(tenant, filename, purpose, data)

    async def _add_file(self, tenant: str, filename: str, purpose: str, data: bytes, file_id: str = "") -> pb.BatchFile:
        """A new file (file_id: this one, kept once however often it is written: a batch's output)."""
        row = (file_id or terms.FILE_PREFIX + uuid.uuid4().hex, tenant, filename, purpose, len(data), self._now_ms())
        await self._files.put(row[0], data)  # (the bytes first: a row never names missing bytes)
        await self._db.execute(f"INSERT INTO batch_files ({_FILE_COLS}) VALUES (?, ?, ?, ?, ?, ?) "
                               "ON CONFLICT (id) DO NOTHING", row)
        return file_pb(row)

    async def get_file(self, tenant: str, file_id: str, param: str = "file_id") -> pb.BatchFile:
        rows = await self._db.execute(f"SELECT {_FILE_COLS} FROM batch_files WHERE id = ? AND tenant = ?",
                                      (file_id, tenant))
        if not rows:
            raise _file_not_found(file_id, param)
        return file_pb(rows[0])

    async def list_files(self, tenant: str, purpose: str, limit: int, after: str, order: str) -> tuple[list, bool]:
        if order not in ("", "asc", "desc"):
            raise errors.InvalidArgument("order must be \"asc\" or \"desc\"", param="order")
        asc = order == "asc"
        query, params = f"SELECT {_FILE_COLS} FROM batch_files WHERE tenant = ?", [tenant]
        if purpose:
            query += " AND purpose = ?"
            params.append(purpose)
        if after:
            mark = await self._db.execute("SELECT created_ms FROM batch_files WHERE id = ? AND tenant = ?", (after, tenant))
            if not mark:
                raise _file_not_found(after, "after")
            op = ">" if asc else "<"
            query += f" AND (created_ms {op} ? OR (created_ms = ? AND id {op} ?))"
            params += [mark[0][0], mark[0][0], after]
        query += f" ORDER BY created_ms {'ASC' if asc else 'DESC'}, id {'ASC' if asc else 'DESC'} LIMIT ?"
        params.append(limit + 1)
        rows = await self._db.execute(query, params)
        return [file_pb(r) for r in rows[:limit]], len(rows) > limit

    async def delete_file(self, tenant: str, file_id: str) -> pb.BatchFile:
        f = await self.get_file(tenant, file_id)
        await self._db.execute("DELETE FROM batch_files WHERE id = ? AND tenant = ?", (file_id, tenant))
        await self._files.delete(file_id)
        f.deleted = True
        return f

    async def read_file(self, tenant: str, file_id: str) -> bytes:
        await self.get_file(tenant, file_id)
        return await self._files.get(file_id)

    # ------------------------------------------------------------ batches

    async def create_batch(self, owner: pb.BatchOwner, input_file_id: str, endpoint: str,
                           metadata: dict[str, str]) -> pb.Batch:
        tenant = owner.tenant
        f = await self.get_file(tenant, input_file_id, "input_file_id")
        if f.purpose != "batch":
            raise errors.InvalidArgument(f"file {input_file_id} is a batch's output, not a batch input (purpose "
                                         "\"batch\")", param="input_file_id")
        (active,), = await self._db.execute(
            "SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN ('in_progress', 'cancelling', 'finalizing')",
            (tenant,))
        if active >= self.policy.max_active_batches:
            raise errors.ResourceExhausted(
                f"this tenant has {active} batches running, the most it may; wait for one to finish or cancel one",
                reason="too_many_batches")
        items, bad = wire.parse_lines(await self._files.get(input_file_id), endpoint, self.policy.max_items)
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

    async def _end_items(self, batch_id: str, ending: str) -> None:
        """Stop a batch (cancelled or expired): its items not claimed never run (each gets an error
        line when it finishes), its running ones may still finish. A cancelled batch reads as
        cancelling until then."""
        now = self._now_ms()
        if ending == "cancelled":
            await self._db.execute("UPDATE batches SET status = 'cancelling', ending = ?, cancelling_ms = ? WHERE "
                                   "id = ? AND status = 'in_progress'", (ending, now, batch_id))
        else:
            await self._db.execute("UPDATE batches SET ending = ? WHERE id = ? AND status = 'in_progress'",
                                   (ending, batch_id))

    # ------------------------------------------------------------ the runners

    async def claim(self, runner: str, most: int, lease_s: float, fresh: bool = False) -> list[pb.BatchItem]:
        """Up to most items to run, oldest batch first, each leased to runner for lease_s. fresh:
        the runner just started, so the items leased to its name are lapsed already."""
        now = self._now_ms()
        if fresh:
            await self._db.execute("UPDATE batch_items SET lease_ms = 0 WHERE owner = ? AND state = 'running'", (runner,))
        until = now + int(lease_s * 1000)
        lock = " FOR UPDATE OF i SKIP LOCKED" if self._pg else ""

        def run(execute) -> list[tuple]:
            rows = execute(
                "SELECT i.batch_id, i.idx, i.custom_id, i.body, i.attempts, b.endpoint, b.tenant, b.tier, b.key_id, "
                "b.cache_salt, b.price_factor FROM batch_items i JOIN batches b ON b.id = i.batch_id "
                "WHERE b.status = 'in_progress' AND b.ending = '' AND b.expires_ms > ? AND "
                "(i.state = 'pending' OR (i.state = 'running' AND i.lease_ms < ?)) "
                f"ORDER BY b.created_ms, i.batch_id, i.idx LIMIT ?{lock}", (now, now, most))
            for r in rows:
                execute("UPDATE batch_items SET state = 'running', owner = ?, lease_ms = ?, attempts = attempts + 1 "
                        "WHERE batch_id = ? AND idx = ?", (runner, until, r[0], r[1]))
            return rows

        rows = await self._db.run(run)
        return [pb.BatchItem(batch_id=bid, index=idx, custom_id=cid, body=body.encode(), attempt=attempts + 1,
                             endpoint=endpoint, price_factor=factor,
                             owner=pb.BatchOwner(tenant=tenant, tier=tier, key_id=key, cache_salt=salt))
                for bid, idx, cid, body, attempts, endpoint, tenant, tier, key, salt, factor in rows]

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

    async def release(self, runner: str, items: Sequence[pb.BatchItemRef]) -> None:
        """Items runner gives back unrun: claimable again at once (their run not counted)."""
        await self._db.transaction(
            ("UPDATE batch_items SET state = 'pending', owner = '', lease_ms = 0, attempts = attempts - 1 "
             "WHERE batch_id = ? AND idx = ? AND owner = ? AND state = 'running'", (ref.batch_id, ref.index, runner))
            for ref in items)

    async def complete(self, runner: str, ref: pb.BatchItemRef, status_code: int, body: bytes, request_id: str) -> bool:
        """An item's answer, kept once; False when it was done before. The batch finishes with its
        last item."""
        ok = status_code == 200

        def run(execute) -> bool:
            item = execute("SELECT custom_id FROM batch_items WHERE batch_id = ? AND idx = ? AND state != 'done'",
                           (ref.batch_id, ref.index))
            if not item:
                return False
            try:
                answer = json.loads(body) if body else None
            except ValueError:
                answer = {"error": {"message": "the answer could not be read", "type": "server_error"}}
            line = wire.output_line(item[0][0], request_id, status_code, answer).decode()
            # (state != 'done' again: a billing replica beside this one may have completed it meanwhile)
            if not execute("UPDATE batch_items SET state = 'done', ok = ?, result = ?, owner = ? WHERE batch_id = ? AND "
                           "idx = ? AND state != 'done' RETURNING idx",
                           (1 if ok else 0, line, runner, ref.batch_id, ref.index)):
                return False
            execute(f"UPDATE batches SET {'completed = completed' if ok else 'failed = failed'} + 1 WHERE id = ?",
                    (ref.batch_id,))
            return True

        recorded = await self._db.run(run)
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
        """The batch's files written (items that never ran get their error line first), then its end."""
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
        results = await self._db.execute("SELECT ok, result FROM batch_items WHERE batch_id = ? ORDER BY idx",
                                         (batch_id,))
        good = "".join(r for ok, r in results if ok).encode()
        bad = "".join(r for ok, r in results if not ok).encode()
        out = err = ""
        if good:
            out = _derived_id(batch_id, "output")
            await self._add_file(b.tenant, f"{batch_id}_output.jsonl", "batch_output", good, out)
        if bad:
            err = _derived_id(batch_id, "error")
            await self._add_file(b.tenant, f"{batch_id}_error.jsonl", "batch_output", bad, err)
        await self._db.execute(
            "UPDATE batches SET status = ?, output_file_id = ?, error_file_id = ?, ended_ms = ? WHERE id = ? AND "
            "status = 'finalizing'", (ending or "completed", out, err, now, batch_id))
        log.info("batch %s %s: %d completed, %d failed", batch_id, ending or "completed", b.completed, b.failed)


def _derived_id(batch_id: str, what: str) -> str:
    """A batch's output (or error) file's id, the same each time it is written."""
    return terms.FILE_PREFIX + uuid.uuid5(uuid.NAMESPACE_URL, f"gaas:{batch_id}:{what}").hex
