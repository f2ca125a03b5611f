"""Futures: handles to arrays that exist, or will exist, in a worker's buffer store."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ProgramError
from .runtime import Runtime

FETCH_POLL_S = 1.0
# a worker call that took this much longer than the wait it asked for was not answered (its
# deadline is the wait plus 5 s: worker_client.py): the worker may be frozen (`_poll`)
SILENT_S = 4.0


class _Moved(Exception):
    """A run of the futures waited on was sent again, planned anew (its slice moved: replan.py):
    they are waited for again where they are now (their `home` and `run_id` were changed first)."""


def _where(future: Future) -> tuple[set[int], str]:
    """The run id of `future` and its home, read in this order (`Future.result`,
    `Future.block_until_ready`, `settle`; `_gather` and `block_until_ready` read the run ids before
    the addresses inline, in the same order).

    A wait reads a future's run id before its home (its members' addresses), and waits there
    under that run id. A re-sending (programs.py `_Sent.send`, on the session's reader) moves a
    future's home and peers first, then its run id, and then says the old run was sent again
    (replan.py `replanned`): a run id read first is the old one (the wait sees it moved: `_Moved`,
    and looks again) or the new one with the new home. Read the other way round, an old home could
    go with the new run id, which nothing moves any more: the wait looked for the future at its old
    worker until it failed there."""
    run_ids = {future.run_id}
    return run_ids, future.home


class Future:
    """A (possibly sharded) array on a worker. Passing it to another call never moves its
    bytes through the client; `result()`, `np.asarray(f)` and `print(f)` fetch the value.
    Dropping the last reference releases the worker's buffer."""

    __slots__ = ("__weakref__", "_rt", "_value", "dtype", "home", "id", "peers", "run_id", "shape")

    def __init__(self, rt: Runtime, buffer_id: int, home: str, shape: tuple[int, ...], dtype: Any, run_id: int,
                 peers: tuple[str, ...] = ()):
        self._rt = rt
        self.id = buffer_id
        self.home = home
        # an array of a multi-host slice: the other member workers, each holding its own shards
        self.peers = peers
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.run_id = run_id
        self._value: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def result(self, timeout: float | None = None) -> np.ndarray:
        """Fetches the value from the worker that owns it (cached afterwards)."""
        while True:
            try:
                return self._result(timeout)
            except _Moved:
                continue

    def _result(self, timeout: float | None) -> np.ndarray:
        if self._value is None and self.peers:
            self._value = self._gather(timeout)
        if self._value is None:
            run_ids, home = _where(self)
            conn = self._rt.worker(home)
            nbytes = self.size * self.dtype.itemsize

            def fetch(wait_s: float) -> tuple[bool, str]:
                unsure = _check_uncertain(self._rt, home, [self], wait_s)
                if unsure is not None and not unsure[0]:
                    return unsure
                value, error = conn.fetch(self.id, wait_s, nbytes, gone=_gone(self._rt, home))
                if value is not None:
                    value.flags.writeable = False
                    self._value = value
                return value is not None, error

            _poll(self._rt, run_ids, timeout, fetch, f"future {self.id:#x} not ready", home)
        assert self._value is not None
        return self._value

    @property
    def wire_home(self) -> str:
        """Where the run that reads this future finds it (RunProgram.input_homes): every member's
        address for an array of a multi-host slice (the controller checks its readers are there)."""
        return "|".join((self.home, *self.peers)) if self.peers else self.home

    def _gather(self, timeout: float | None) -> np.ndarray:
        """The global value of a multi-host slice's array, put together from its members' parts
        (a replicated value comes whole from the first member)."""
        out = np.empty(self.shape, dtype=self.dtype)
        covered = 0
        seen: set[tuple[int, ...]] = set()
        run_ids = {self.run_id}  # before its members' addresses (`_where`)
        for address in (self.home, *self.peers):
            conn = self._rt.worker(address)
            got: list[list[tuple[tuple[int, ...], np.ndarray]]] = []

            def fetch(wait_s: float, conn: Any = conn, got: list[Any] = got) -> tuple[bool, str]:
                unsure = _check_uncertain(self._rt, conn.address, [self], wait_s)
                if unsure is not None and not unsure[0]:
                    return unsure
                parts, error = conn.fetch_parts(self.id, wait_s, self.size * self.dtype.itemsize,
                                                gone=_gone(self._rt, conn.address))
                if parts is not None:
                    got.append(parts)
                return parts is not None, error

            _poll(self._rt, run_ids, timeout, fetch, f"future {self.id:#x} not ready", conn.address)
            for start, part in got[0]:
                if start in seen:
                    continue
                seen.add(start)
                out[tuple(slice(b, b + n) for b, n in zip(start, part.shape, strict=True))] = part
                covered += part.size
            if covered >= out.size:
                break
        if covered < out.size:
            raise ProgramError(f"future {self.id:#x}: its members hold {covered} of {out.size} elements")
        out.flags.writeable = False
        return out

    def block_until_ready(self, timeout: float | None = None) -> Future:
        """Waits until the value is computed, without fetching it (as `jax.Array.block_until_ready`)."""
        while self._value is None:
            try:
                run_ids, home = _where(self)
                _wait_computed(self._rt, home, [self], run_ids, timeout)
                break
            except _Moved:  # sent again elsewhere (replan.py): waited for where it is now
                continue
        return self

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        value = self.result()
        if dtype is not None and np.dtype(dtype) != value.dtype:
            return value.astype(dtype)
        return value.copy() if copy else value

    def __repr__(self) -> str:
        return repr(self.result())

    def __str__(self) -> str:
        return str(self.result())

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d future")
        return self.shape[0]

    def __del__(self) -> None:
        try:
            for address in (self.home, *self.peers):
                self._rt.release(self.id, address)
        except Exception:
            pass  # interpreter shutdown


def block_until_ready(x: Any, timeout: float | None = None) -> Any:
    """Waits until every future in the pytree `x` is computed (one call per worker, no bytes
    moved) and returns `x`, as `jax.block_until_ready`; raises ProgramError if one failed."""
    import jax

    leaves = [leaf for leaf in jax.tree_util.tree_leaves(x) if isinstance(leaf, Future) and leaf._value is None]
    while True:
        # grouped by worker, each group's run ids read with its homes (before them: `_where`), not
        # when its turn comes: a run sent again while an earlier group is waited on is seen moved
        by_home: dict[tuple[int, str], tuple[list[Future], set[int]]] = {}
        for leaf in leaves:
            run_id = leaf.run_id
            futures, run_ids = by_home.setdefault((id(leaf._rt), leaf.home), ([], set()))
            futures.append(leaf)
            run_ids.add(run_id)
        try:
            for (_, home), (futures, run_ids) in by_home.items():
                _wait_computed(futures[0]._rt, home, futures, run_ids, timeout)
            return x
        except _Moved:  # looked for again where they are now (those computed already answer at once)
            continue


def _wait_computed(rt: Runtime, home: str, futures: list[Future], run_ids: set[int], timeout: float | None) -> None:
    """Waits until `futures` (at `home`, of runs `run_ids`, read before `home`: `_where`) are computed."""
    conn = rt.worker(home)
    ids = [f.id for f in futures]

    def wait(wait_s: float) -> tuple[bool, str]:
        unsure = _check_uncertain(rt, home, futures, wait_s)
        if unsure is not None and not unsure[0]:
            return unsure
        return conn.wait(ids, wait_s, gone=_gone(rt, home))

    _poll(rt, run_ids, timeout, wait, "not computed", home)


def _gone(rt: Runtime, home: str) -> Callable[[], str]:
    """Why the worker at `home` is lost now ("" while it is not): `_poll` looks before each call,
    and the call itself once it took its abandon mark (worker_client.py `WorkerClient._mark`)."""
    return lambda: rt.still_lost(home) if home in rt.lost_workers else ""


def _check_uncertain(rt: Runtime, home: str, futures: list[Future], wait_s: float) -> tuple[bool, str] | None:
    """For futures of runs in flight when the controller restarted (`rt.resume`, checked on
    every look: a restart may come while a caller waits): asks their worker whether they exist,
    waiting up to `wait_s` while they compute. None when no future is uncertain; (True, "") once
    they are computed; (False, error) when one failed or never reached the worker; (False, "")
    while they compute."""
    resume = rt.resume
    if not resume.uncertain:
        return None
    unsure = [f for f in futures if f.id not in resume.confirmed and resume.is_uncertain(f.run_id)]
    if not unsure:
        return None
    ids = [f.id for f in unsure]
    done, error = rt.worker(home).wait(ids, wait_s, must_exist=True)
    if done:
        resume.confirmed.update(ids)
    elif "does not exist" in error:
        error = f"the run of future {unsure[0].id:#x} " + resume.error(error)
    return done, error


def settle(rt: Runtime, future: Future, timeout: float | None) -> None:
    """Returns once `future`, if its run was in flight at a controller restart, is known computed;
    ProgramError when it failed or never reached its worker (a call made with it as an input would
    wait for it for ever). Its run sent again meanwhile (replan.py), it is looked for where it is
    now (its run id read before its home: `_where`)."""
    lost_buffers = rt.resume.lost_buffers
    if not rt.resume.uncertain:
        return
    why = lost_buffers.get(future.id, "")
    if why:
        raise ProgramError(f"an input of this call was lost at the controller restart: {why}")
    while True:
        run_ids, home = _where(future)

        def attempt(wait_s: float, home: str = home) -> tuple[bool, str]:
            return _check_uncertain(rt, home, [future], wait_s) or (True, "")

        try:
            _poll(rt, run_ids, timeout, attempt, "inputs of runs in flight at a restart not computed", home)
            return
        except _Moved:
            continue


def _poll(rt: Runtime, run_ids: set[int], timeout: float | None, attempt: Callable[[float], tuple[bool, str]],
          what: str, home: str = "") -> None:
    """Calls `attempt(wait_s)` (a worker call that waits up to wait_s: (done, error)) until it is
    done, checking between calls whether one of the runs failed (the controller says why), and,
    when the worker at `home` did not answer a call, whether the controller declared its host
    lost: a frozen host (stopped, swapped out, paused) keeps its connections, so the calls would
    otherwise go on until it continues, however long after its loss. A worker whose host the
    controller declared lost (`rt.lost_workers`, told by the session) fails the call at once while
    it stays lost, rather than after a call's deadline. Raises _Moved once one of the runs was
    sent again (replan.py): its futures are elsewhere now. Before failing, for its worker or for a
    run that failed here (an input's upload lost: `Runtime._uploads_lost`), a wait waits for the
    controller's answer to the runs (their refusal for their plan, should one come, is behind the
    news of the worker's loss on the session's stream, or not told yet when the upload failed)."""
    replans = rt.replans
    moved = replans.moved
    gone = _gone(rt, home)
    deadline = None if timeout is None else time.monotonic() + timeout

    def first_failure() -> str:
        """The controller's reason for the first of the runs that failed, or ""."""
        return next((msg for msg in map(rt.run_failed, run_ids) if msg), "")

    def fail(error: str, runs_first: bool = False) -> ProgramError:
        """The error to raise (the first run's failure first, with `runs_first`, or when a run was
        refused for its plan and not sent again: it never reached the worker, whose loss does not
        say why the call failed); raises _Moved instead when a run was sent again meanwhile. Both
        are looked at after the controller's answer came (the refusal, behind the news of the
        worker's loss on the session's stream, often comes during this wait)."""
        if replans.unanswered(run_ids):
            replans.wait_answer(run_ids, deadline)
        if moved(run_ids):
            raise _Moved
        return ProgramError((first_failure() if runs_first or replans.gave_up(run_ids) else "") or error)

    while True:
        if moved(run_ids):
            raise _Moved
        if lost := gone():  # (or told since the last look; a run refused, never admitted: its reason)
            raise fail(lost)
        if failed := first_failure():  # (failed here, an input's upload lost, it may still be sent again)
            raise fail(failed, runs_first=True)
        wait = FETCH_POLL_S if deadline is None else max(0.001, min(FETCH_POLL_S, deadline - time.monotonic()))
        started = time.monotonic()
        done, error = attempt(wait)
        if done:
            return
        if error:
            raise fail(error, runs_first=True)
        if home and time.monotonic() - started >= wait + SILENT_S and (lost := rt.lost_host(home)):
            raise fail(f"the worker at {home} does not answer: its {lost} (the controller declared it)")
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{what} after {timeout:g} s")
