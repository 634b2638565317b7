"""Choosing the worker for a request. A picker sees the live, non-ejected workers serving the
request's model and returns one; an empty candidate set is a typed error, never None."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

from gaas import errors

WorkerId = NewType("WorkerId", str)


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: WorkerId
    # Sidecar inbound host:port, named in x-gaas-worker.
    address: str
    model: str
    model_version: str
    max_model_len: int
    # Version of the engine (vLLM) the worker runs.
    engine_version: str = ""


class Picker(ABC):
    name: str

    @abstractmethod
    def pick(self, candidates: Sequence[Candidate]) -> Candidate: ...


class RoundRobinPicker(Picker):
    """Each model's workers in turn (ordered by id, so replicas agree on the order)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Candidate]) -> Candidate:
        if not candidates:
            raise errors.Unavailable("no worker can take the request right now; retry shortly")
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        return ordered[next(self._counter) % len(ordered)]


PICKERS: dict[str, type[Picker]] = {RoundRobinPicker.name: RoundRobinPicker}


def make_picker(name: str) -> Picker:
    try:
        return PICKERS[name]()
    except KeyError:
        raise ValueError(f"unknown picker {name!r}; choose one of {', '.join(PICKERS)}") from None
