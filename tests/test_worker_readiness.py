"""`computed_now` (server/worker/readiness.py), the worker's one readiness check: real JAX arrays
on this process's CPU device. jaxlib 0.10.2's `is_ready()` of an explicitly deleted array crashes
the process (SIGSEGV), so the check on such an array, through each of its callers, runs in a
subprocess: a crash there fails the test instead of killing pytest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from server.worker.readiness import computed_now

REPO = Path(__file__).resolve().parent.parent


@jax.jit
def _slow(x: jax.Array) -> jax.Array:
    """x, after 400 products of 256x256 matrices (a second or so on CPU)."""
    m = jax.numpy.ones((256, 256), x.dtype) * x[0]
    m = jax.lax.fori_loop(0, 400, lambda i, m: jax.numpy.tanh(m @ m), m)
    return x + 0 * jax.numpy.sum(m)


class _Ready:
    """A value with `is_ready` and no `is_deleted` (as the store's tests' stand-ins)."""

    def __init__(self, ready: bool) -> None:
        self.ready = ready

    def is_ready(self) -> bool:
        return self.ready


@pytest.mark.timeout(120)
def test_computed_now_tells_computed_computing_and_deleted_apart() -> None:
    x = jax.device_put(np.ones(4, np.float32))
    x.block_until_ready()
    assert computed_now(x) is True
    assert computed_now(np.ones(4)) is True  # a host value: nothing computes it
    y = _slow(x)
    assert computed_now(y) is False  # still computing
    y.block_until_ready()
    assert computed_now(y) is True
    donated = jax.numpy.ones(8)
    jax.jit(lambda a: a + 1, donate_argnums=0)(donated).block_until_ready()
    assert donated.is_deleted() and computed_now(donated) is None
    assert computed_now(_Ready(False)) is False and computed_now(_Ready(True)) is True


# Each caller of computed_now, on an explicitly deleted array; prints what each answered.
_DELETED = """
import json
import jax, numpy as np
from server.worker.buffers import BufferStore
from server.worker.completion import all_ready
from server.worker.readiness import computed_now
from server.worker.servicer import _at_hand
x = jax.device_put(np.ones(4, np.float32))
x.block_until_ready()
s = BufferStore()
s.expect([1], owner="client:1", visible=[True])
s.launched([1], [x], input_ids=[])
x.delete()
assert x.is_deleted()
print(json.dumps({"computed_now": computed_now(x), "all_ready": all_ready([x]), "at_hand": _at_hand(x),
                  "when_computed": s.computations.when_computed([1], lambda: None)}))
"""


@pytest.mark.timeout(120)
def test_an_explicitly_deleted_array_is_checked_without_crashing() -> None:
    done = subprocess.run([sys.executable, "-c", _DELETED], cwd=REPO, capture_output=True, text=True, timeout=100,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    # deleted: not computed as far as the caller can tell; the wait is not held for it (True: nothing to wait for)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "computed_now": None, "all_ready": False, "at_hand": False, "when_computed": True}
