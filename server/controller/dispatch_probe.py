"""An opt-in probe of the dispatch latency: a run's arrival to its last Enqueue handed to gRPC.

Off unless the controller starts with `PATHWAYS_DISPATCH_PROBE=<file>` in its environment (the
scale benchmark sets it, bench/scale.py); off, the dispatch path pays one `is None` test per run
and one per message to a worker. On, per run it records:

- `arrived`: when the dispatcher was handed the run's `RunProgram` (`Dispatcher.submit`, called
  as the session's reader takes the message off the stream);
- `queued`: when the dispatcher's flush after its arrival returned: the scheduler admitted it and
  every member's `Enqueue` is in its worker link's queue (the controller's own work);
- `handed`: when the last `Enqueue` carrying one of its tasks was taken off a worker link's queue
  by that worker's WorkerConnect stream, to be written by gRPC (`links.WorkerLink.messages`);

and when the run ends writes one JSON line to the file: `{"run", "ok", "segments", "tasks",
"arrived", "queued", "handed", "queued_cpu", "cpu"}`: the three times are `time.monotonic()`
seconds; `tasks` counts the tasks handed (the run's segments once every one left); `queued_cpu` and
`cpu` are the CPU time the event loop's thread used from the arrival to the flush's end and to the
last hand-off (`time.thread_time()`: on a shared machine, what the interval would take had the
thread had a core to itself; it also counts the other work the loop did meanwhile, heartbeats for
instance). Lines are written after the run is
over, outside what they measure.
"""

from __future__ import annotations

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
        self._handed_cpu: dict[int, float] = {}
        self._unflushed: list[int] = []
        self._queued: dict[int, float] = {}
        self._queued_cpu: dict[int, float] = {}
        self._handed: dict[int, float] = {}
        self._tasks: dict[int, int] = {}

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
        if msg.WhichOneof("msg") != "enqueue":
            return
        now, cpu = time.monotonic(), time.thread_time()
        for task in msg.enqueue.tasks:
            run = task.run_id
            if run in self._arrived:
                self._handed[run] = now
                self._handed_cpu[run] = cpu
                self._tasks[run] = self._tasks.get(run, 0) + 1

    def finished(self, run_id: int, ok: bool, segments: int) -> None:
        arrived = self._arrived.pop(run_id, None)
        if arrived is None:
            return
        arrived_cpu = self._arrived_cpu.pop(run_id)
        handed_cpu = self._handed_cpu.pop(run_id, None)
        self._out.write(json.dumps({"run": run_id, "ok": ok, "segments": segments,
                                    "tasks": self._tasks.pop(run_id, 0), "arrived": arrived,
                                    "queued": self._queued.pop(run_id, None),
                                    "queued_cpu": self._queued_cpu.pop(run_id, arrived_cpu) - arrived_cpu,
                                    "handed": self._handed.pop(run_id, None),
                                    "cpu": None if handed_cpu is None else handed_cpu - arrived_cpu}) + "\n")
        self._out.flush()
