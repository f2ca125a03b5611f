"""Kernel-visible names for the servers' threads.

Python 3.11 names only its own `Thread` objects: the kernel, and so `top -H`, `perf`, py-spy's
thread list and `python -m bench.threads`, sees every thread as "python". A thread that calls
`name_native_thread()` first shows under its Python name (cut to the kernel's 15 characters)."""

from __future__ import annotations

import threading


def name_native_thread() -> None:
    """Gives the calling thread its Python name in the kernel; a no-op without /proc."""
    label = threading.current_thread().name[:15]
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as fh:
            fh.write(label)
    except OSError:
        pass
