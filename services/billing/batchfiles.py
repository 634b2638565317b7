"""Batch files (OpenAI's /v1/files): their rows in the ledger's database, their bytes in a
FileStore, and each tenant's limits on them: files kept (a batch's output and error files count),
the bytes of its files and of its running batches' answers together. Uploads arrive whole (at most
one gRPC message); output files are written as a stream of pieces and read back in pieces, so no
file is ever held whole in billing's memory."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from gaas.contracts import batches as terms, errors
from gaas.contracts.errors import quote
from gaas.openai import multipart
from gaas.runtime.sql import Database
from gaas.v1 import billing_pb2 as pb
from services.billing.filestore import FileStore

FILE_COLS = "id, tenant, filename, purpose, bytes, created_ms"
# Batches whose answers are still being gathered: their bytes count against the tenant's room.
LIVE_BATCHES = "('in_progress', 'cancelling', 'finalizing')"


def file_pb(row: Sequence) -> pb.BatchFile:
    fid, tenant, filename, purpose, size, created = row
    return pb.BatchFile(id=fid, tenant=tenant, filename=filename, purpose=purpose, bytes=size, created_at=created // 1000)


def file_not_found(file_id: str, param: str = "file_id") -> errors.NotFound:
    return errors.NotFound(f"no file {quote(file_id)}: it was never uploaded, or was deleted", param=param,
                           reason="file_not_found")


def derived_id(batch_id: str, what: str) -> str:
    """A batch's output (or error) file's id, the same each time it is written."""
    return terms.FILE_PREFIX + uuid.uuid5(uuid.NAMESPACE_URL, f"gaas:{batch_id}:{what}").hex


class BatchFiles:
    def __init__(self, db: Database, store: FileStore, policy: terms.BatchPolicy,
                 clock: Callable[[], float] = time.time) -> None:
        self._db = db
        self._store = store
        self._policy = policy
        self._clock = clock

    async def tenant_bytes(self, tenant: str) -> int:
        """The bytes a tenant holds: its files, and its running batches' answers so far."""
        (files,), = await self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM batch_files WHERE tenant = ?",
                                           (tenant,))
        (answers,), = await self._db.execute(
            f"SELECT COALESCE(SUM(output_bytes), 0) FROM batches WHERE tenant = ? AND status IN {LIVE_BATCHES}",
            (tenant,))
        return int(files) + int(answers)

    async def count(self, tenant: str) -> int:
        (count,), = await self._db.execute("SELECT COUNT(*) FROM batch_files WHERE tenant = ?", (tenant,))
        return int(count)

    async def create(self, tenant: str, filename: str, purpose: str, data: bytes) -> pb.BatchFile:
        """An upload, within the tenant's limits."""
        if purpose not in multipart.PURPOSES:
            raise errors.InvalidArgument(f"purpose {quote(purpose)} is not kept here: use \"batch\"", param="purpose")
        if len(data) > self._policy.max_file_bytes:
            raise errors.InvalidArgument(f"the file is {len(data)} bytes; a batch input file can be at most "
                                         f"{self._policy.max_file_bytes}", param="file", reason="file_too_large")
        count = await self.count(tenant)
        if count >= self._policy.max_files:
            raise errors.ResourceExhausted(f"this tenant keeps {count} files (batch outputs included), the most it "
                                           "may: delete some (DELETE /v1/files/{file_id}) first", reason="too_many_files")
        held = await self.tenant_bytes(tenant)
        if held + len(data) > self._policy.max_tenant_bytes:
            raise errors.ResourceExhausted(
                f"this tenant holds {held} bytes of files and batch answers; with this file it would pass its "
                f"{self._policy.max_tenant_bytes}: delete files (DELETE /v1/files/{{file_id}}) first",
                reason="too_many_file_bytes")
        key = terms.FILE_PREFIX + uuid.uuid4().hex
        await self._store.put(key, data)  # (the bytes first: a row never names missing bytes)
        return await self._add_row(key, tenant, filename, purpose, len(data))

    async def write_output(self, tenant: str, file_id: str, filename: str, pieces: AsyncIterator[bytes]) -> str:
        """A batch's output or error file, written from its pieces as they come; kept once
        however often it is written (its id is derived from the batch's)."""
        size = await self._store.put_stream(file_id, pieces)
        await self._add_row(file_id, tenant, filename, "batch_output", size)
        return file_id

    async def _add_row(self, file_id: str, tenant: str, filename: str, purpose: str, size: int) -> pb.BatchFile:
        row = (file_id, tenant, filename, purpose, size, int(self._clock() * 1000))
        await self._db.execute(f"INSERT INTO batch_files ({FILE_COLS}) VALUES (?, ?, ?, ?, ?, ?) "
                               "ON CONFLICT (id) DO NOTHING", row)
        return file_pb(row)

    async def get(self, tenant: str, file_id: str, param: str = "file_id") -> pb.BatchFile:
        rows = await self._db.execute(f"SELECT {FILE_COLS} FROM batch_files WHERE id = ? AND tenant = ?",
                                      (file_id, tenant))
        if not rows:
            raise file_not_found(file_id, param)
        return file_pb(rows[0])

    async def list(self, tenant: str, purpose: str, limit: int, after: str, order: str) -> tuple[list, bool]:
        if order not in ("", "asc", "desc"):
            raise errors.InvalidArgument("order must be \"asc\" or \"desc\"", param="order")
        asc = order == "asc"
        query, params = f"SELECT {FILE_COLS} FROM batch_files WHERE tenant = ?", [tenant]
        if purpose:
            query += " AND purpose = ?"
            params.append(purpose)
        if after:
            mark = await self._db.execute("SELECT created_ms FROM batch_files WHERE id = ? AND tenant = ?", (after, tenant))
            if not mark:
                raise file_not_found(after, "after")
            op = ">" if asc else "<"
            query += f" AND (created_ms {op} ? OR (created_ms = ? AND id {op} ?))"
            params += [mark[0][0], mark[0][0], after]
        query += f" ORDER BY created_ms {'ASC' if asc else 'DESC'}, id {'ASC' if asc else 'DESC'} LIMIT ?"
        params.append(limit + 1)
        rows = await self._db.execute(query, params)
        return [file_pb(r) for r in rows[:limit]], len(rows) > limit

    async def delete(self, tenant: str, file_id: str) -> pb.BatchFile:
        f = await self.get(tenant, file_id)
        await self._db.execute("DELETE FROM batch_files WHERE id = ? AND tenant = ?", (file_id, tenant))
        await self._store.delete(file_id)
        f.deleted = True
        return f

    async def read(self, tenant: str, file_id: str) -> AsyncIterator[bytes]:
        """A file's bytes in pieces (the tenant's own files only: NotFound before the first)."""
        await self.get(tenant, file_id)
        return self._store.read(file_id)

    async def read_input(self, tenant: str, file_id: str) -> bytes:
        """A batch input file whole (at most max_file_bytes: one upload)."""
        f = await self.get(tenant, file_id, "input_file_id")
        if f.purpose != "batch":
            raise errors.InvalidArgument(f"file {file_id} is a batch's output, not a batch input (purpose "
                                         "\"batch\")", param="input_file_id")
        return b"".join([piece async for piece in self._store.read(file_id)])
