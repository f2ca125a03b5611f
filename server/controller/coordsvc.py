"""`python -m server.controller.coordsvc HOST:PORT N RECORD`: one coordination service of an
island's `jax.distributed` group (one generation; server/controller/groups.py starts and stops it).

It needs jaxlib only, no devices. ``recoverable=True``: a member that dies is dropped from the
group without the service telling the others to abort (docs/multihost.md, §1a). It prints
"ready" once it listens and runs until SIGTERM, or until it is an orphan: RECORD (the controller's
island-services.json) no longer lists it, or names a controller that has been gone for
ORPHAN_AFTER_S (a restarted controller rewrites it with its own pid at start, so a restart is not
an orphaning). Checked every CHECK_S.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 5
# (tests shorten both through the environment)
CHECK_S = float(os.environ.get("PATHWAYS_COORDSVC_CHECK_S", "5"))
ORPHAN_AFTER_S = float(os.environ.get("PATHWAYS_COORDSVC_ORPHAN_S", "60"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _still_wanted(record: Path, state: dict[str, float]) -> bool:
    """Whether the controller's record still lists this process with a live controller (module
    doc); `state` keeps when the controller was last seen and how many checks missed it."""
    try:
        doc = json.loads(record.read_text())
        pids, controller = doc.get("pids", []), int(doc.get("controller_pid", 0))
    except (OSError, ValueError, TypeError):
        pids, controller = [], 0
    now = time.monotonic()
    if os.getpid() not in pids:
        state["unlisted"] = state.get("unlisted", 0) + 1
        return state["unlisted"] < 2  # not on two checks in a row: the first may race its writing
    state["unlisted"] = 0
    if controller and _alive(controller):
        state["seen"] = now
    return now - state.setdefault("seen", now) < ORPHAN_AFTER_S


def main() -> None:
    if len(sys.argv) != 4 or not sys.argv[2].isdigit():
        sys.exit("usage: python -m server.controller.coordsvc HOST:PORT NUM_PROCESSES RECORD")
    address, n, record = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    from jaxlib import _jax

    service = _jax.get_distributed_runtime_service(address, n, heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
                                                   shutdown_timeout=SHUTDOWN_TIMEOUT_S, recoverable=True)
    print("ready", flush=True)
    state: dict[str, float] = {}
    while signal.sigtimedwait({signal.SIGTERM, signal.SIGINT}, CHECK_S) is None:
        if not _still_wanted(record, state):
            break
    service.shutdown()


if __name__ == "__main__":
    main()
