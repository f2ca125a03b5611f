"""`kill -USR1 PID` makes a controller or worker write every thread's Python stack to its
stderr (its log), and go on: what an operator (or the chaos run, on a stuck call) reads to see
where a process waits, without a debugger or py-spy on the machine."""

from __future__ import annotations

import faulthandler
import signal


def install() -> None:
    """Registers the SIGUSR1 handler (faulthandler: safe in any thread, even one stuck in C)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
