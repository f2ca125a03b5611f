"""Whether a value's computation is over, asked so that it cannot crash the worker.

jaxlib 0.10.2's `Array.is_ready()` on an explicitly deleted array (`x.delete()`) kills the process
with SIGSEGV; on a donated one it raises. `is_deleted()` is safe, so it is asked first. Every
readiness check of the worker goes through `computed_now` (waits.py, completion.py, computations.py,
servicer.py); tests/test_worker_readiness.py holds the crash's reproduction.
"""

from __future__ import annotations


def computed_now(value: object) -> bool | None:
    """True when the computation behind `value` is over (a host value, with no `is_ready`, always
    is); False while it is still computing; None when that cannot be asked: the array is deleted
    (explicitly or donated), or asking raised. Never blocks."""
    is_ready = getattr(value, "is_ready", None)
    if is_ready is None:
        return True
    try:
        is_deleted = getattr(value, "is_deleted", None)
        if is_deleted is not None and is_deleted():
            return None
        return bool(is_ready())
    except Exception:
        return None
