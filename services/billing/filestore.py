"""Where batch files' bytes are kept, behind one interface: a directory (the run directory's
files/, or a volume on Kubernetes). An object store is another FileStore with the same three
calls. Keys are GaaS's file ids (file-<hex>), never a client's file name."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Protocol

from gaas.contracts import errors

_KEY = re.compile(r"file-[0-9a-f]{32}")


class FileStore(Protocol):
    async def put(self, key: str, data: bytes) -> None: ...

    async def get(self, key: str) -> bytes: ...

    async def delete(self, key: str) -> None: ...


class DirectoryFileStore:
    """Each file in its own file under root, written whole before it is visible (a temporary
    name, fsync, rename), so a crash never leaves half a file under a key."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not _KEY.fullmatch(key):
            raise errors.InvalidArgument(f"{errors.quote(key)} is not a file id", param="file_id")
        return self.root / key[5:7] / key

    async def put(self, key: str, data: bytes) -> None:
        path = self._path(key)

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)

        await asyncio.to_thread(write)

    async def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            raise errors.NotFound(f"the content of file {key} is gone from the file store", reason="file_not_found") \
                from None

    async def delete(self, key: str) -> None:
        await asyncio.to_thread(self._path(key).unlink, True)
