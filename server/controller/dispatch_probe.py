"""An opt-in probe of the dispatch latency: a run's arrival to its last Enqueue handed to gRPC.

Off unless the controller starts with `PATHWAYS_DISPATCH_PROBE=<file>` in its environment (the
scale benchmark sets it, bench/scale.py); off, the dispatch path pays one `is None` test per run
and one per message to a worker. On, per run it records:

- `arrived`: when the dispatcher was handed the run's `RunProgram` (`Dispatcher.submit`, called
  as the session's reader takes the message off the stream);
- `queued`: when the dispatcher's flush after its arrival returned: the scheduler admitted it and
  every member's `Enqueue` is in its worker link's queue (the controller's own work);
- `handed`: when the last `Enqueue` carrying one of its tasks was taken off a worker link's queue
  by that worker's WorkerConnect stream, to be written by gRPC (`links.WorkerLink.messages`); with
  relays (relays.py), the last relay batch carrying one: the controller's part ends there, the
  relay's forwarding is the relay worker's;

and when the run ends writes one JSON line to the file: `{"run", "ok", "segments", "tasks",
"arrived", "queued", "handed", "queued_cpu", "cpu"}`: the three times are `time.monotonic()`
seconds; `tasks` counts the tasks handed (the run's segments once every one left); `queued_cpu` and
`cpu` are the CPU time the event loop's thread used from the arrival to the flush's end and to the
last hand-off (`time.thread_time()`: on a shared machine, what the interval would take had the
thread had a core to itself; it also counts the other work the loop did meanwhile, heartbeats for
instance). Lines are written after the run is
over, outside what they measure.

What it costs inside the interval it measures: per message a stream takes, one `WhichOneof`, a
clock read (`time.monotonic()`, no system call) and an append; the messages' run ids are read
only when the run is over. The loop thread's CPU time (a system call, ~1 µs) is read once per
event-loop pass that handed messages, by a callback the first hand-off of the pass schedules:
the streams a flush wakes all take their messages in one pass of the loop, and the callback runs
right after them (so `cpu` also counts whatever else that pass ran after the last hand-off).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import IO

from schemas.pathways.v1 import controller_pb2 as cpb

from . import links

ENV = "PATHWAYS_DISPATCH_PROBE"


class DispatchProbe:
    """Arrival and last hand-off to gRPC per run (see the module docstring)."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._arrived: dict[int, float] = {}
        self._arrived_cpu: dict[int, float] = {}
        self._unflushed: list[int] = []
        self._queued: dict[int, float] = {}
        self._queued_cpu: dict[int, float] = {}
        # per enqueue taken by a stream: (message, when, index of the CPU mark after it)
        self._taken: list[tuple[cpb.ControllerToWorker, float, int]] = []
        self._marks: dict[int, float] = {}  # the loop thread's CPU time after each pass that handed messages
        self._next_mark = 0
        self._mark_pending = False

    @classmethod
    def from_env(cls) -> DispatchProbe | None:
        """The probe `PATHWAYS_DISPATCH_PROBE` asks for, hooked into the worker links, or None."""
        path = os.environ.get(ENV, "")
        if not path:
            return None
        probe = cls(open(path, "a", encoding="utf-8"))  # noqa: SIM115 (open for the process's life)
        links.on_handed = probe.handed
        return probe

    def arrived(self, run_id: int) -> None:
        self._arrived[run_id] = time.monotonic()
        self._arrived_cpu[run_id] = time.thread_time()
        self._unflushed.append(run_id)

    def flushed(self) -> None:
        if self._unflushed:
            now, cpu = time.monotonic(), time.thread_time()
            for run in self._unflushed:
                self._queued[run] = now
                self._queued_cpu[run] = cpu
            self._unflushed.clear()

    def handed(self, msg: cpb.ControllerToWorker) -> None:
        if msg.WhichOneof("msg") not in ("enqueue", "relay"):
            return
        self._taken.append((msg, time.monotonic(), self._next_mark))
        if not self._mark_pending:
            self._mark_pending = True
            asyncio.get_running_loop().call_soon(self._mark)

    def _mark(self) -> None:
        self._marks[self._next_mark] = time.thread_time()
        self._next_mark += 1
        self._mark_pending = False

    def finished(self, run_id: int, ok: bool, segments: int) -> None:
        arrived = self._arrived.pop(run_id, None)
        if arrived is None:
            return
        arrived_cpu = self._arrived_cpu.pop(run_id)
        handed: float | None = None
        handed_cpu: float | None = None
        tasks = 0
        keep = []
        for entry in self._taken:
            msg, when, mark = entry
            runs = _task_runs(msg)
            if run_id in runs:
                tasks += runs.count(run_id)
                if handed is None or when >= handed:
                    handed = when
                    handed_cpu = self._marks.get(mark)
            if any(r in self._arrived for r in runs):
                keep.append(entry)  # a run still going reads it later
        self._taken = keep
        oldest = min((mark for _, _, mark in keep), default=self._next_mark)
        for mark in [m for m in self._marks if m < oldest]:
            del self._marks[mark]  # no entry points at it any more
        self._out.write(json.dumps({"run": run_id, "ok": ok, "segments": segments, "tasks": tasks,
                                    "arrived": arrived, "queued": self._queued.pop(run_id, None),
                                    "queued_cpu": self._queued_cpu.pop(run_id, arrived_cpu) - arrived_cpu,
                                    "handed": handed,
                                    "cpu": None if handed_cpu is None else handed_cpu - arrived_cpu}) + "\n")
        self._out.flush()


def _task_runs(msg: cpb.ControllerToWorker) -> list[int]:
    """The run id of each task a handed message carries: an Enqueue's, or those of the Enqueues in
    a relay batch's parts and gangs (relays.py; parsed here, after the run, outside what is measured)."""
    if msg.WhichOneof("msg") == "enqueue":
        return [t.run_id for t in msg.enqueue.tasks]
    runs: list[int] = []
    for part in msg.relay.messages:
        inner = cpb.ControllerToWorker.FromString(part.message)
        runs.extend(t.run_id for t in inner.enqueue.tasks)
    for gang in msg.relay.gangs:  # one body for its members (controller.proto RelayedGang)
        body = cpb.ControllerToWorker.FromString(gang.body)
        runs.extend(t.run_id for t in body.enqueue.tasks for _ in gang.hosts)
    return runs
