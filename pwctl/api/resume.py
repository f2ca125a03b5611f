"""Resuming a `pw` session after its controller restarted.

When the session stream breaks (or the controller says it is going away) the runtime
(runtime.py) hands over to `Resume.reconnect`, which opens the stream again, with backoff, for up
to PWCTL_RECONNECT_S (default 60 s, the controller's default grace period; 0: never) and resumes
the session with the token of its Welcome: same client id and id prefix, its slices and its
buffers on the workers. The new stream first registers every program registered before (the new
controller has none), then sends what was queued meanwhile: calls made while the controller was
away wait, they do not fail. Runs handed to the old stream are *uncertain*: the workers know
whether each finished, so a future of such a run asks its worker (`Wait` with `must_exist`): a
value that was computed is returned, one whose run never reached the worker fails with a clear
error, and nothing waits forever.

The runtime keeps the stream machinery (the queue, and its sender's generations in sender.py); this
module asks it for what it needs through a few methods documented there as hooks for `Resume`.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from schemas.pathways.v1 import common_pb2 as pb
from schemas.pathways.v1 import controller_pb2 as cpb

from ..errors import PathwaysError

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger(__name__)

# How long the runtime tries to resume its session after losing the controller (PWCTL_RECONNECT_S).
RECONNECT_S = 60.0
UNCERTAIN = ("was in flight when the controller at {address} restarted and never reached the worker "
             "({error}); call again")


class Resume:
    """A runtime's session across controller restarts: the resume loop, and what it knows about
    the runs in flight at a restart (read by futures.py and programs.py)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.uncertain: set[int] = set()  # runs handed to a stream that broke before they were known over
        self.confirmed: set[int] = set()  # buffers of uncertain runs that their workers computed
        self.outputs: set[int] = set()  # the output buffers of the uncertain runs
        self.lost_buffers: dict[int, str] = {}  # outputs of queued runs not sent after a restart: why
        self.reconnects = 0

    def strand(self, run_id: int, outputs: tuple[int, ...]) -> None:
        """Run `run_id` (with these outputs) was handed to a stream that broke before it was known over."""
        self.uncertain.add(run_id)
        self.outputs.update(outputs)

    def is_uncertain(self, run_id: int) -> bool:
        """Whether run `run_id` was handed to a stream that broke before it was known over."""
        return run_id in self.uncertain

    def error(self, error: str) -> str:
        """The error of an uncertain run that never reached its worker (`error`: the worker's)."""
        return UNCERTAIN.format(address=self.rt.client.address, error=error)

    def reconnect(self, reason: str) -> tuple[Iterator[cpb.SessionEvent] | None, str]:
        """Resumes the session on a new stream, retrying with backoff for the runtime's
        `reconnect_s`: (the new stream's events, its Welcome read; "") or (None, why not)."""
        rt = self.rt
        address = rt.client.address
        log.warning("lost the session with the server at %s (%s); resuming it (for up to %g s)", address, reason,
                    rt.reconnect_s)
        rt._next_stream()  # from here on, no run is handed to the old stream
        rt._strand_handed()  # runs handed to the old stream: uncertain, and over for the bound on runs in flight
        deadline = time.monotonic() + rt.reconnect_s
        pause = 0.1
        last = reason
        while not rt.closed:
            call, ready = rt._open_stream()
            events = iter(call)
            try:
                ev = next(events)
            except (PathwaysError, StopIteration) as e:
                call.cancel()
                last = f"{e.code.name.lower()} {e.details}".strip() if isinstance(e, PathwaysError) and e.code else last
                if time.monotonic() + pause > deadline:
                    break
                time.sleep(pause * random.uniform(0.8, 1.2))
                pause = min(2.0, pause * 2)
                continue
            if ev.WhichOneof("msg") != "welcome":
                call.cancel()
                return None, ev.error or f"the server at {address} did not resume the session"
            rt._resumed(call, ev.welcome)
            self.reconnects += 1
            self._refresh_slices()
            self._wait_hosts(deadline)
            self._check_queued(deadline)
            ready.set()  # what was queued meanwhile goes now
            log.warning("resumed session %s with the server at %s", rt.client_id, address)
            return events, ""
        return None, (f"lost the session with the server at {address}: {reason}; it did not come "
                      f"back within {rt.reconnect_s:g} s (last: {last})")

    def _refresh_slices(self) -> None:
        """Slice changes the stream missed while it was down (a remap meanwhile)."""
        for name, vs in list(self.rt.slices.items()):
            try:
                vs._update(self.rt.client.get_slice(name))
            except PathwaysError as e:
                log.warning("slice %s after resuming the session: %s", name, e)

    def _wait_hosts(self, deadline: float) -> None:
        """Waits (until `deadline`) for the hosts of the session's slices to register with the
        new controller: a run sent before its host is back would be admitted into a queue the
        host's registration then fails.

        Hosts are waited for by name, and the slices read again each time: a host that comes
        back at a new address (a restarted worker), or a slice remapped meanwhile, is seen, as
        the stream's slice events are not read while this waits. A host the controller has
        marked lost is not waited for (its slices fail their runs with a clear error until it
        returns or they are remapped)."""
        rt = self.rt
        while rt.slices and not rt.closed:
            try:
                states = {h.name: h.state for h in rt.client.hosts()}
            except PathwaysError:
                states = {}
            # read after the hosts: a host seen back has its new address in them (read before,
            # a host registering in between left the slices naming its old address, and every
            # later call of the session went there)
            self._refresh_slices()
            wanted = {d.host for vs in list(rt.slices.values()) for d in vs.info.devices if d.host}
            if not any(states.get(h, pb.HOST_STATE_RECONNECTING) == pb.HOST_STATE_RECONNECTING for h in wanted):
                return  # every host registered again, or marked lost
            if time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def _check_queued(self, deadline: float) -> None:
        """Runs queued before the restart was noticed were sent without asking whether their
        inputs exist: those reading an output of an uncertain run are checked now, and one whose
        input failed or never reached its worker is not sent (it would wait for that input for
        ever) but fails, with its outputs as inputs of later queued runs."""
        rt = self.rt
        lost: dict[int, str] = {}  # buffer -> why it will never exist
        keep: list[object] = []
        failed_runs = 0
        for item in rt._queued():
            if not (isinstance(item, cpb.ClientMessage) and item.HasField("run")):
                keep.append(item)
                continue
            run = item.run
            why = next((lost[b] for b in run.input_ids if b in lost), "")
            if not why:
                for b, home in zip(run.input_ids, run.input_homes, strict=False):
                    if b in self.outputs and b not in self.confirmed and home:
                        why = self._exists(b, home.split("|")[0], deadline)
                        if why:
                            lost[b] = why
                            break
            if why:
                rt._fail_run(run.run_id, f"an input of this call was lost at the controller restart: {why}")
                rt.replans.never_sent(run.run_id)
                lost.update(dict.fromkeys(run.output_ids, why))
                failed_runs += 1
            else:
                keep.append(item)
        self.lost_buffers.update(lost)
        if failed_runs:
            rt._requeue(keep, failed_runs)

    def _exists(self, buffer_id: int, home: str, deadline: float) -> str:
        """'' once buffer `buffer_id` (of an uncertain run) is computed on `home`; else why not."""
        conn = self.rt.worker(home)
        while not self.rt.closed:
            wait = max(0.001, min(1.0, deadline - time.monotonic()))
            done, error = conn.wait([buffer_id], wait, must_exist=True)
            if done:
                self.confirmed.add(buffer_id)
                return ""
            if error:
                return self.error(error) if "does not exist" in error else error
            if time.monotonic() >= deadline:
                return ""  # still computing: the run waits for it
        return ""
