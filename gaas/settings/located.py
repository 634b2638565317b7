"""YAML read with where each value came from, so an error in a file the operator wrote names the
file, the line and the field ("deploy/gaas.yaml:14: models[0].rollout.steps: ...").

A value is found by its path: the keys and list indices from the document's root, as the code that
checks the document walks it (("models", 0, "rollout", "steps")). A path the document lacks (a
field that is missing) is placed at its nearest enclosing value."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import yaml

Path = tuple[Hashable, ...]


def dotted(path: Iterable[Hashable]) -> str:
    """models[0].rollout.steps"""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True, slots=True)
class Located:
    """A parsed document and the line (1-based) each path in it starts on."""

    doc: object
    lines: dict[Path, int] = field(default_factory=dict)
    # The file it was read from, as the operator named it ("" when none).
    name: str = ""

    def line(self, path: Path) -> int | None:
        """The line of path, or of its nearest enclosing value that the document has."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get(())

    def where(self, path: Path) -> str:
        """'FILE:LINE: PATH' (the parts known)."""
        line = self.line(path)
        place = ":".join(str(p) for p in (self.name or None, line) if p is not None)
        field_ = dotted(path)
        return ": ".join(p for p in (place, field_) if p)


def parse(text: str, name: str = "") -> Located:
    """text as YAML (yaml.YAMLError when it is not), with the line of every value."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    doc = yaml.safe_load(text)
    lines: dict[Path, int] = {}
    if node is not None:
        _walk(node, (), lines)
    return Located(doc, lines, name)


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int]) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            k = key.value if isinstance(key, yaml.ScalarNode) else None
            if k is None:
                continue
            # The key's own line: where the operator looks for the field.
            sub = (*path, k)
            _walk(value, sub, lines)
            lines[sub] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, (*path, i), lines)
