"""The worker's Wait answers on its event loop when the computations behind the buffers are
over, and hands the wait to a pool thread only when one may still be computing (real JAX
computations on this process's CPU device, a real buffer store)."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import numpy as np
import pytest

from server.worker.buffers import BufferStore
from server.worker.executor import Executor
from server.worker.servicer import INLINE_FETCH_BYTES, MAX_CHECKED_NOW, WorkerServicer, _at_hand
from server.worker.transfer import TransferSender
from server.worker.waits import Verdict

X = np.arange(4, dtype=np.float32)


@jax.jit
def _slow(x: jax.Array) -> jax.Array:
    """x, after 400 products of 256x256 matrices (a second or so on CPU)."""
    m = jax.numpy.ones((256, 256), x.dtype) * x[0]
    m = jax.lax.fori_loop(0, 400, lambda i, m: jax.numpy.tanh(m @ m), m)
    return x + 0 * jax.numpy.sum(m)


@pytest.fixture
def servicer() -> Iterator[WorkerServicer]:
    store, sender = BufferStore(), TransferSender()
    ex = Executor(store, jax.devices("cpu")[:1], lambda *a: None, sender)
    s = WorkerServicer(store, ex, "w", "a")
    yield s
    s.close()
    ex.stop()
    sender.close()


def put(s: WorkerServicer, buffer_id: int, value: object) -> None:
    s.store.put(buffer_id, value, 16, owner="client:1", client_ref=True)


@pytest.mark.timeout(120)
def test_buffers_whose_computations_are_over_are_answered_at_once(servicer: WorkerServicer) -> None:
    x = jax.device_put(X)
    _slow(x).block_until_ready()  # compiled
    put(servicer, 1, x)
    put(servicer, 2, X)  # an upload kept as host memory is computed too
    values = servicer._values_now([1, 2], must_exist=True)
    assert isinstance(values, list) and [np.asarray(v).tolist() for v in values] == [X.tolist()] * 2
    assert servicer._computed([1, 2], True, values).ready

    y = _slow(x)
    put(servicer, 3, y)
    assert servicer._values_now([1, 3], must_exist=True) is Verdict.WAIT  # still computing: a pool thread waits
    y.block_until_ready()
    assert isinstance(servicer._values_now([1, 3], must_exist=True), list)
    assert servicer._values_now([], must_exist=True) == []  # no buffers: no values, and nothing to wait for

    servicer.store.expect([4], owner="client:1", visible=[True])
    servicer.store.fail(4, "p/0 f: it broke")
    assert servicer._values_now([1, 4], must_exist=True) is Verdict.ANSWER  # answered at once, with the error
    assert servicer._computed([1, 4], True).error == "p/0 f: it broke"
    assert servicer._values_now([99], must_exist=True) is Verdict.ANSWER  # gone: answered at once too
    assert "does not exist" in servicer._computed([99], True).error


@pytest.mark.timeout(60)
def test_too_many_buffers_are_left_to_a_pool_thread(servicer: WorkerServicer) -> None:
    x = jax.device_put(X)
    ids = list(range(1, MAX_CHECKED_NOW + 2))
    for b in ids:
        put(servicer, b, x)
    assert isinstance(servicer._values_now(ids[:-1], must_exist=True), list)
    assert servicer._values_now(ids, must_exist=True) is Verdict.WAIT


@pytest.mark.timeout(60)
def test_a_fetch_reads_on_the_loop_only_what_is_at_hand() -> None:
    """`Fetch` reads a host array, or a computed device array of at most INLINE_FETCH_BYTES, on the
    event loop; one still computing, a larger one, or a deleted (donated) one goes to a pool
    thread, which reports what is wrong. jaxlib's `is_ready` of a deleted array crashes the
    process: it must not be asked."""
    small = jax.numpy.ones(8)
    small.block_until_ready()
    assert _at_hand(small) and _at_hand(np.ones(1 << 22))
    assert not _at_hand(jax.numpy.ones(INLINE_FETCH_BYTES // 4 + 1))
    assert not _at_hand(_slow(jax.numpy.ones(8)))  # still computing
    donated = jax.numpy.ones(8)
    jax.jit(lambda a: a + 1, donate_argnums=0)(donated).block_until_ready()
    assert donated.is_deleted() and not _at_hand(donated)
    assert not _at_hand(object())
