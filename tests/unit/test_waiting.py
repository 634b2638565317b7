"""tests/waiting.eventually: the suite's one way of waiting on a fact."""

from __future__ import annotations

import asyncio

import pytest

from tests.waiting import eventually, eventually_async


def test_eventually_returns_the_first_truthy_value_the_check_gives():
    answers = iter([None, 0, "", "ready", "later"])
    assert eventually(lambda: next(answers), timeout=5, every=0) == "ready"


def test_eventually_fails_saying_what_it_waited_for_and_what_it_last_saw():
    with pytest.raises(pytest.fail.Exception) as failed:
        eventually(lambda: ["still", "busy"][:0] or "", timeout=0.05, every=0.01, what="the worker to be idle")
    assert "the worker to be idle" in str(failed.value) and "0.05 s" in str(failed.value)


def test_eventually_counts_only_the_exceptions_it_is_told_to_ignore_as_not_yet():
    calls = []

    def restarting():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("billing is restarting")
        return len(calls)

    assert eventually(restarting, timeout=5, every=0, ignoring=(ConnectionError,)) == 3
    with pytest.raises(KeyError):
        eventually(lambda: {}["missing"], timeout=5, every=0, ignoring=(ConnectionError,))


def test_eventually_async_awaits_its_check_until_it_holds():
    answers = iter([False, False, 7])

    async def check():
        await asyncio.sleep(0)
        return next(answers)

    assert asyncio.run(eventually_async(check, timeout=5, every=0)) == 7


def test_eventually_async_takes_a_plain_check_of_what_the_loops_other_tasks_change():
    seen: list[int] = []

    async def scenario():
        task = asyncio.create_task(_append_soon(seen))
        got = await eventually_async(lambda: len(seen) >= 2 and len(seen), timeout=5, every=0)
        await task
        return got

    assert asyncio.run(scenario()) == 2


async def _append_soon(seen: list[int]) -> None:
    for i in range(2):
        await asyncio.sleep(0)
        seen.append(i)
