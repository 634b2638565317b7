"""Where batch files' bytes are kept, behind one interface: a directory (the run directory's
files/, or a volume every billing replica mounts on Kubernetes). An object store is another
FileStore with the same calls. Keys are GaaS's file ids (file-<hex>), never a client's file name.
Files are written whole or from a stream of pieces and read back in pieces, never held whole."""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol

from gaas.contracts import errors
from gaas.contracts.edge import ANSWER_PIECE_BYTES

_KEY = re.compile(r"file-[0-9a-f]{32}")


class FileStore(Protocol):
    async def put(self, key: str, data: bytes) -> None: ...

    async def put_stream(self, key: str, pieces: AsyncIterator[bytes]) -> int:
        """The file written from its pieces; its size."""

    def read(self, key: str) -> AsyncIterator[bytes]:
        """The file's bytes in pieces (NotFound when it is gone)."""

    async def delete(self, key: str) -> None: ...


class DirectoryFileStore:
    """Each file in its own file under root, written whole before it is visible (a temporary
    name of the writer's own, fsync, rename), so a crash never leaves half a file under a key and
    two replicas writing the same file on a shared volume never mix their bytes."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise errors.InvalidArgument(f"{errors.quote(key)} is not a file id", param="file_id")
        return self.root / key[5:7] / key

    async def put(self, key: str, data: bytes) -> None:
        async def whole():
            yield data

        await self.put_stream(key, whole())

    async def put_stream(self, key: str, pieces: AsyncIterator[bytes]) -> int:
        path = self._path(key)
        tmp = path.with_name(f"{key}.{uuid.uuid4().hex[:12]}.tmp")
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
        f = await asyncio.to_thread(open, tmp, "wb")
        size = 0
        try:
            async for piece in pieces:
                await asyncio.to_thread(f.write, piece)
                size += len(piece)
            await asyncio.to_thread(_sync_close, f)
            await asyncio.to_thread(os.replace, tmp, path)
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)
            raise
        return size

    async def read(self, key: str) -> AsyncIterator[bytes]:
        path = self._path(key)
        try:
            f = await asyncio.to_thread(open, path, "rb")
        except FileNotFoundError:
            raise errors.NotFound(f"the content of file {key} is gone from the file store",
                                  reason="file_not_found") from None
        try:
            while piece := await asyncio.to_thread(f.read, ANSWER_PIECE_BYTES):
                yield piece
        finally:
            f.close()

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._path(key).unlink, True)


def _sync_close(f) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()
