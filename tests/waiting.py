"""Waiting on a fact rather than for a time: the one polling helper of the test suite."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float = 10.0, *, every: float = 0.2,
               ignoring: tuple[type[BaseException], ...] = (), what: str | Callable[[], str] = "") -> T:
    """check()'s first truthy value, asked every `every` seconds for up to `timeout`; past that the
    test fails saying what was awaited (what, or what() for a message built then) and what check
    last gave. Exceptions of the types in `ignoring` (a service restarting) count as not yet; any
    other is the test's failure at once. An assert inside check is a failure at once too: return a
    falsy value for "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = check()
        except ignoring as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            _give_up(what, timeout, last)
        time.sleep(every)


async def eventually_async(check: Callable[[], T | Awaitable[T]], timeout: float = 10.0, *, every: float = 0.2,
                           ignoring: tuple[type[BaseException], ...] = (), what: str | Callable[[], str] = "") -> T:
    """eventually on the caller's event loop, which runs between the checks: check may be a
    coroutine function (awaited) or a plain one (a fact the loop's other tasks change)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            last = check()
            if inspect.isawaitable(last):
                last = await last
        except ignoring as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            _give_up(what, timeout, last)
        await asyncio.sleep(every)


def _give_up(what: str | Callable[[], str], timeout: float, last: object) -> None:
    said = what() if callable(what) else what
    pytest.fail(f"{said or 'waited for'} (not within {timeout:g} s; last: {last!r:.2000})")
