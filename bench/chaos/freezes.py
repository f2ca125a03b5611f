"""The freeze part: a worker or the controller stopped with SIGSTOP for a while, then let go on
with SIGCONT, while the load of kills.py runs. A frozen process keeps its TCP connections (the
kernel still accepts and acknowledges) but answers nothing, as a host does in a long GC pause,
swapped out, stopped by a debugger or during a VM's live migration.

Durations (`SPANS`): a short freeze stays under half the heartbeat timeout (the host must not be
declared lost; calls wait, then go on), another lasts about the timeout (whether the loss comes
before the thaw is a race), a long one lasts two to four heartbeat timeouts, so a frozen worker
is declared lost while its process lives and must rejoin after SIGCONT (its stream was closed by
the controller: it registers again, same pid), and a frozen controller wakes up to workers and
sessions that waited on it and must carry on (it marks nobody lost for the silence it caused).

Compound faults (`COMPOUND` of the long ones): halfway through a worker's freeze the controller is
killed and started again (the new controller waits for the frozen host, declares it lost, and
must take it back when it thaws); halfway through the controller's, a worker is (its replacement
registers with a frozen controller).

Per freeze it measures, from the SIGSTOP (`at`):
- `lost_s`: a frozen worker, until `host list` shows it lost (a long freeze must reach it);
- `error_s`: for the first call the freeze failed, from the freeze (or the call's start, if
  later) to its error;
- `ready_s`, from the SIGCONT (`thaw_at`): until the controller answers and every worker is
  ready, the thawed one in the same process (`rejoined`);
- `recovery_s`, from the SIGCONT: until a call of the `across` workload that started after it
  succeeded;
- `stuck`: a workload silent `STUCK_S` after the freeze (kills.py);
- `others_lost`: hosts the controller lost meanwhile other than the frozen one (a frozen
  controller must lose nobody for the silence it caused itself);
- `consistent`: islands, hosts and named slices as before, and every host's state in the
  database the one the controller serves (`db_agrees`, after its writer caught up).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import sqlite3
import time
from typing import TYPE_CHECKING, Any

from schemas.pathways.v1 import common_pb2 as pb

if TYPE_CHECKING:
    from .kills import KillRun

# ("kill" | "freeze", "controller" | island, seconds frozen, what is killed and started again
# halfway through the freeze: "" nothing, "controller" (a worker's freeze) or an island's worker)
Fault = tuple[str, str, float, str]

# a freeze's length in heartbeat timeouts: long (a worker is declared lost while alive), short (it
# is not), and about the timeout (the loss races the thaw)
SPANS = ((2.0, 4.0), (0.1, 0.5), (0.8, 1.5))
LONG = SPANS[0][0]
# a worker's fourth: longer than a call may wait (kills.py STUCK_S, with the 2 s timeout), so a
# call that waits on the frozen worker rather than on the controller's verdict is found stuck (a
# frozen controller holds its callers for as long as it is frozen: no such span for it)
WORKER_LONGEST = (8.0, 10.0)
COMPOUND = 0.5  # the share of long freezes with a kill halfway through (`Fault`)
DB_CATCH_UP_S = 10.0  # the database writer may lag the controller's memory this long under load
# the controller's log line for a lost host (logging's default time format, local time)
LOST_LINE = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) WARNING server\.controller\.cluster: "
                       r"host (\S+) lost: (.*)")


def plan(rng: random.Random, kills: list[str], islands: tuple[str, ...], freezes: int, controller_freezes: int,
         heartbeat_timeout: float) -> list[Fault]:
    """The kills (in their seeded order) with `freezes` freezes put in at random places, each
    target's in turn long, short and about the heartbeat timeout (`SPANS`). No freeze draws nothing from `rng`, so a
    run without freezes is the run it was before they existed."""
    faults: list[Fault] = [("kill", t, 0.0, "") for t in kills]
    targets = ["controller"] * min(controller_freezes, freezes) + [
        rng.choice(islands) for _ in range(max(0, freezes - controller_freezes))]
    rng.shuffle(targets)
    seen: dict[str, int] = {}
    for target in targets:
        n = seen[target] = seen.get(target, -1) + 1
        spans = SPANS if target == "controller" else (*SPANS, WORKER_LONGEST)
        low, high = spans[n % len(spans)]  # each target's first freeze is long, its second short, ...
        seconds = round(rng.uniform(low, high) * heartbeat_timeout, 2)
        during = ""
        if low >= LONG and rng.random() < COMPOUND:
            during = rng.choice(islands) if target == "controller" else "controller"
        faults.insert(rng.randrange(len(faults) + 1), ("freeze", target, seconds, during))
    return faults


def _host_states(run: KillRun) -> dict[str, int]:
    try:
        return {name: int(h.state) for name, h in run.cluster.hosts().items()}
    except Exception:  # the controller is frozen or slow: no reading this time
        return {}


def _db_states(run: KillRun) -> dict[str, str]:
    """Each host's state as the database holds it (read-only, beside the controller's writer)."""
    uri = f"file:{run.cluster.home / 'pw.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
        return {str(name): str(state) for name, state in db.execute("SELECT name, state FROM hosts")}


def db_agrees(run: KillRun) -> bool:
    """Whether every host's state in the database is the controller's (ready or lost), waiting
    up to `DB_CATCH_UP_S` for its writer."""
    names: dict[int, str] = {pb.HOST_STATE_READY: "ready", pb.HOST_STATE_STALLED: "ready", pb.HOST_STATE_LOST: "lost"}
    deadline = time.time() + DB_CATCH_UP_S
    while True:
        served = {n: names.get(s, str(s)) for n, s in _host_states(run).items()}
        with contextlib.suppress(sqlite3.Error):
            if served and _db_states(run) == served:
                return True
        if time.time() > deadline:
            return False
        time.sleep(0.2)


def losses(run: KillRun, since: float, until: float) -> list[str]:
    """The hosts the controller's log says it lost between `since` and `until` (wall time), with why."""
    out = []
    for path in run.cluster.logs("controller"):
        for line in path.read_text(errors="replace").splitlines():
            m = LOST_LINE.match(line)
            if m and since <= time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) + int(m[2]) / 1000 <= until:
                out.append(f"{m[3]}: {m[4]}")
    return out


def freeze(run: KillRun, target: str, seconds: float, during: str, recovery_limit_s: float) -> dict[str, Any]:
    """One freeze of `target` (the controller or an island's worker) for `seconds`; halfway
    through, `during` (the controller or an island's worker, or "" nothing) is killed and started
    again: a controller restarted while a host is frozen, a worker while the controller is."""
    c = run.cluster
    proc = c.controller if target == "controller" else c.workers[target]
    assert proc is not None and proc.poll() is None
    host = f"chaos-{target}"
    long = seconds >= LONG * c.heartbeat_timeout
    rec: dict[str, Any] = {"fault": "freeze", "target": target if target == "controller" else f"worker {target}",
                           "seconds": seconds, "long": long, "lost_s": None, "ready_s": None, "error_s": None,
                           "recovery_s": None, "stuck": False, "during": during}
    at = time.time()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        rec["at"] = at
        while time.time() < at + seconds:  # calls meet the frozen part; none may wait too long
            if during and time.time() >= at + seconds / 2:
                if during == "controller":
                    c.kill(c.controller)
                    c.start_controller()
                else:
                    c.kill(c.workers[during])
                    c.start_worker(during)
                rec["killed_at"], during = time.time(), ""
            if target != "controller" and rec["lost_s"] is None and _host_states(run).get(host) == pb.HOST_STATE_LOST:
                rec["lost_s"] = round(time.time() - at, 3)
            for kind in run.kinds:
                run._check_stuck(run._current(kind), at, rec)
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    thaw_at = rec["thaw_at"] = time.time()
    c.wait_ready(recovery_limit_s)
    ready_at = time.time()
    rec["ready_s"] = round(ready_at - thaw_at, 3)
    rec["rejoined"] = proc.poll() is None and (target == "controller" or c.workers[target] is proc)
    run.await_recovery(rec, at, since=thaw_at, deadline=ready_at + recovery_limit_s, counted_from=thaw_at)
    # a frozen controller loses nobody, a frozen worker nobody but itself
    killed = f"chaos-{rec['during']}:"
    rec["others_lost"] = [x for x in losses(run, at, time.time()) if not x.startswith((f"{host}:", killed))]
    rec["db_agrees"] = db_agrees(run)
    rec["consistent"] = c.snapshot() == run.baseline and rec["db_agrees"]
    return rec
