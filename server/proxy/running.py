"""Running a proxy session's requests in the order they are read, most without a task.

Each request is a coroutine (`ProxyService._answer`) whose answer goes to the session's writer
(answers.py). A task per request costs the event loop a task, a scheduled first step and a done
callback per call; the per-call kinds of a training loop (an Execute of ready arguments, a
DestructArray of an array nobody else reads) finish without waiting at all. So `Runner.start`
steps such a request by hand, in the reader, up to its first wait: done there, it is answered at
once; stopped at a wait, it goes on in a task from where it stopped (`resume`).

Order: a request's first step (where it reserves its result handles and claims what it reads:
handles.py) must come after every earlier request's first step. A request that runs in a task
takes its first step when the task first runs, so while any such task has not started yet, a
later request runs in a task too, behind it (tasks start in the order they were made).
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, cast

from .answers import AnswerWriter


@types.coroutine
def resume(coro: Coroutine[Any, Any, bytes], waiting: Any) -> Generator[Any, Any, bytes]:
    """Goes on with `coro`, which was stepped by hand and stopped at `waiting` (what it yielded:
    a future it awaits, or None for a bare yield), to its end, in the task that awaits this,
    exactly as `yield from` would have."""
    while True:
        try:
            sent = yield waiting
        except BaseException as e:  # the task's cancellation, or the awaited future's error
            try:
                waiting = coro.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                waiting = coro.send(sent)
            except StopIteration as stop:
                return stop.value


class Runner:
    """Runs one session's requests: `unclaim` gives back what a request claimed when it is done;
    answers go to `out`. `pending`: the requests running in tasks."""

    def __init__(self, out: AnswerWriter, unclaim: Callable[[list[int]], None]) -> None:
        self.out = out
        self._unclaim = unclaim
        self.pending: set[asyncio.Task[None]] = set()
        self._unstarted = 0  # tasks made whose first step has not run yet

    def start(self, answer: Coroutine[Any, Any, bytes], used: list[int], inline: bool) -> None:
        """Runs `answer` (a request that claimed `used`); `inline`: its handler may be stepped
        here (it awaits nothing that binds the current task, such as `asyncio.timeout`)."""
        if not inline or self._unstarted:
            self._unstarted += 1
            self._spawn(self._finish(answer, used, first=True))
            return
        try:
            waiting = answer.send(None)
        except StopIteration as done:
            self._unclaim(used)
            self.out.put(done.value)
            return
        except BaseException:
            self._unclaim(used)
            raise
        self._spawn(self._finish(cast(Awaitable[bytes], resume(answer, waiting)), used, first=False))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _finish(self, answer: Awaitable[bytes], used: list[int], first: bool) -> None:
        if first:
            self._unstarted -= 1  # its first step is this one
        try:
            resp = await answer
        finally:
            self._unclaim(used)
        self.out.put(resp)

    def cancel(self) -> None:
        for task in list(self.pending):
            task.cancel()
