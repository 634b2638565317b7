"""Where a deployment file's model weights come from, as its `source` (or `hub`) says it:

  - an absolute path: a directory (gaas.model.build.check_source checks it when it is to serve);
  - a relative path: a directory of the project (relative to it, wherever the file is) that exists,
    or that `gaas model build` makes from the entry's `preset`;
  - a hub id, written as one: `source: hub:ORG/NAME`, or the field `hub: ORG/NAME`.

A relative path that is none of these is refused: a typo of a project directory would otherwise be
taken for a hub id and fail only when a worker tries to download it."""

from __future__ import annotations

import re
from pathlib import Path

HUB_PREFIX = "hub:"
# A hub id: NAME or ORG/NAME, each part letters, digits, '.', '_' or '-' (as the Hugging Face hub names them).
HUB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


class SourceError(ValueError):
    """What is wrong with a model's source; field: the entry's field that says it (source, hub, preset)."""

    def __init__(self, message: str, field: str = "source") -> None:
        super().__init__(message)
        self.field = field


def _hub_id(value: str, field: str, name: str) -> str:
    if not HUB_ID_RE.fullmatch(value) or ".." in value:
        raise SourceError(f"{name}: {value!r} is not a hub id (ORG/NAME: letters, digits, '.', '_' or '-')", field)
    return value


def resolve(source: object, hub: object, preset: str, root: Path, name: str) -> str:
    """The source a model entry's workers load: an absolute directory or a hub id (SourceError
    when the entry's source or hub cannot be one). root: what relative sources are relative to."""
    if hub is not None:
        if source is not None:
            raise SourceError(f"{name}: give source (a directory, or hub:ORG/NAME) or hub (ORG/NAME), not both", "hub")
        if not isinstance(hub, str):
            raise SourceError(f"{name}: hub must be a hub id (ORG/NAME), got {hub!r}", "hub")
        value, field = hub, "hub"
    else:
        if not source:
            raise SourceError(f"source is required ({name}: a model directory, or a hub id as hub:ORG/NAME)")
        if not isinstance(source, str):
            raise SourceError(f"{name}: source must be a directory or hub:ORG/NAME, got {source!r}")
        if not source.startswith(HUB_PREFIX):
            return _path(source, preset, root, name)
        value, field = source[len(HUB_PREFIX):], "source"
    if preset:
        raise SourceError(f"{name}: a hub model is downloaded, not built: leave preset out", "preset")
    return _hub_id(value.strip(), field, name)


def _path(source: str, preset: str, root: Path, name: str) -> str:
    if source.startswith("/"):
        return source
    local = root / source
    if preset or local.exists():
        return str(local.resolve())
    raise SourceError(f"{name}: source {source!r} is neither a directory of the project ({local} does not exist) "
                      "nor buildable (no preset): give an existing directory, a preset for `gaas model build`, or "
                      f"write a hub model as hub:{source} (or hub: {source})")
