"""`python -m server.controller.coordsvc HOST:PORT N`: one coordination service of an island's
`jax.distributed` group (one generation; server/controller/groups.py starts and stops it).

It needs jaxlib only, no devices. ``recoverable=True``: a member that dies is dropped from the
group without the service telling the others to abort (docs/multihost.md, §1a). It prints
"ready" once it listens and runs until SIGTERM.
"""

from __future__ import annotations

import signal
import sys

HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 5


def main() -> None:
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        sys.exit("usage: python -m server.controller.coordsvc HOST:PORT NUM_PROCESSES")
    address, n = sys.argv[1], int(sys.argv[2])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    from jaxlib import _jax

    service = _jax.get_distributed_runtime_service(address, n, heartbeat_timeout=HEARTBEAT_TIMEOUT_S,
                                                   shutdown_timeout=SHUTDOWN_TIMEOUT_S, recoverable=True)
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    service.shutdown()


if __name__ == "__main__":
    main()
