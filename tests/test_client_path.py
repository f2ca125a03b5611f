"""The client's per-call path without a server: call signatures, the session stream's sender and
its message packing, the bounded map of failed runs."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pwctl.api.bounded import Bounded
from pwctl.api.functions import fast_key
from pwctl.api.packing import Release as _Release
from pwctl.api.packing import pack
from pwctl.api.sender import STOP, Sender
from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb


def test_fast_key_flat_and_pytree_arguments() -> None:
    a, b = np.zeros((2, 3), np.float32), np.ones(4, np.int32)
    key, flat = fast_key((a, b))
    assert key == (((2, 3), np.dtype(np.float32)), ((4,), np.dtype(np.int32)))
    assert flat[0] is a and flat[1] is b

    tree_key, leaves = fast_key(({"w": a, "b": [b, b]}, a))
    assert tree_key is not None and len(leaves) == 4
    # same structure and leaf types: same key; another structure or dtype: another key
    assert fast_key(({"w": a, "b": [b, b]}, a))[0] == tree_key
    assert fast_key(({"w": a, "b": [b]}, a))[0] != tree_key
    assert fast_key(({"w": a, "b": [b, b.astype(np.int64)]}, a))[0] != tree_key
    # scalars (and JAX arrays) need the full signature: no key, but the flat leaves
    key, leaves = fast_key(({"w": a}, 3.0))
    assert key is None and leaves == [a, 3.0]


def _release(address: str, *ids: int, owner: str = "") -> cpb.ClientMessage:
    return cpb.ClientMessage(release=wpb.ReleaseBuffers(buffer_ids=list(ids), address=address, owner=owner))


def test_adjacent_releases_of_one_worker_travel_as_one_message() -> None:
    run = cpb.ClientMessage(run=cpb.RunProgram(run_id=9, program_id="p"))
    packed = pack([_release("w1", 1), _release("w1", 2, 3), _release("w2", 4), run, _release("w1", 5),
                            _release("w1", owner="client:1"), _release("w1", 6)])
    msgs = packed.batch.messages
    kinds = [(m.WhichOneof("msg"), m.release.address if m.HasField("release") else "") for m in msgs]
    # a release never moves across a run (it may free a buffer that run reads) nor merges into an
    # owner-wide release
    assert kinds == [("release", "w1"), ("release", "w2"), ("run", ""), ("release", "w1"), ("release", "w1"),
                     ("release", "w1")]
    assert list(msgs[0].release.buffer_ids) == [1, 2, 3]
    assert list(msgs[3].release.buffer_ids) == [5]
    assert pack([_release("w1", 1), _release("w1", 2)]).release.buffer_ids == [1, 2]


def test_dropped_futures_are_queued_as_ids_and_leave_as_one_release_per_worker() -> None:
    run = cpb.ClientMessage(run=cpb.RunProgram(run_id=9, program_id="p"))
    packed = pack([_Release(1, "w1"), _Release(2, "w1"), _release("w1", 3), _Release(4, "w2"), run,
                            _Release(5, "w1")])
    msgs = packed.batch.messages
    assert [(m.WhichOneof("msg"), list(m.release.buffer_ids)) for m in msgs] == [
        ("release", [1, 2, 3]), ("release", [4]), ("run", []), ("release", [5])]
    assert msgs[1].release.address == "w2"
    assert list(pack([_Release(7, "w1")]).release.buffer_ids) == [7]


def test_the_bound_on_runs_in_flight_comes_from_the_environment() -> None:
    from pwctl.api.env import env_amount
    from pwctl.api.resume import RECONNECT_S
    from pwctl.api.runtime import MAX_IN_FLIGHT
    from pwctl.errors import InvalidArgument

    def runs(value: str) -> int:
        return env_amount("PWCTL_MAX_IN_FLIGHT", value, MAX_IN_FLIGHT, int, "a number of runs (0: no bound)")

    def seconds(value: str) -> float:
        return env_amount("PWCTL_RECONNECT_S", value, RECONNECT_S, float, "seconds (0: never reconnect)")

    assert runs("") == MAX_IN_FLIGHT and runs(" ") == MAX_IN_FLIGHT and runs("8") == 8 and runs("0") == 0
    assert seconds("") == RECONNECT_S and seconds("2.5") == 2.5 and seconds("0") == 0.0
    for bad in ("many", "-3", "1.5"):
        with pytest.raises(InvalidArgument, match=r"PWCTL_MAX_IN_FLIGHT=.*expected a number of runs"):
            runs(bad)
    for bad in ("soon", "-1"):
        with pytest.raises(InvalidArgument, match=r"PWCTL_RECONNECT_S=.*expected seconds"):
            seconds(bad)


_PLATFORMS = """
import jax, sys
from jax._src import xla_bridge
from pwctl.api.env import keep_local_jax_on_cpu
if sys.argv[1] == "started":
    jax.numpy.ones(1)  # the program ran JAX before it opened the runtime
keep_local_jax_on_cpu()
print(jax.config.jax_platforms, xla_bridge.backends_are_initialized())
"""


@pytest.mark.parametrize(("env", "case", "want"), [
    ({}, "fresh", "cpu False"),  # a client on a GPU host would otherwise start CUDA beside the worker
    ({"JAX_PLATFORMS": "cpu,cuda"}, "fresh", "cpu,cuda False"),  # the user's choice stands
    ({}, "started", "None True"),  # backends the program already started are left alone
])
def test_a_client_keeps_its_own_jax_on_the_cpu_unless_told_otherwise(env: dict[str, str], case: str,
                                                                     want: str) -> None:
    full = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | env
    out = subprocess.run([sys.executable, "-c", _PLATFORMS, case], env=full, capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == want


@pytest.mark.timeout(30)
def test_a_bounded_map_keeps_its_last_insertions_however_they_are_made() -> None:
    m: Bounded[int, str] = Bounded(3)
    for i in range(5):
        m[i] = str(i)
    assert list(m.items()) == [(2, "2"), (3, "3"), (4, "4")]
    m[3] = "again"  # already there: keeps its place, nothing forgotten
    assert list(m.items()) == [(2, "2"), (3, "again"), (4, "4")]
    m.update({5: "5", 6: "6"})
    assert list(m) == [4, 5, 6]
    assert m.setdefault(7, "7") == "7"
    assert list(m) == [5, 6, 7]
    m |= {8: "8"}
    assert list(m) == [6, 7, 8]
    with pytest.raises(ValueError, match="at least one"):
        Bounded(0)


@pytest.mark.timeout(60)
def test_a_bounded_map_keeps_its_bound_exactly_under_insertions_from_several_threads() -> None:
    m: Bounded[int, int] = Bounded(100)

    def insert(base: int) -> None:
        for i in range(5000):
            m[base + i] = i

    threads = [threading.Thread(target=insert, args=(n * 10_000,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(m) == 100


def _run(run_id: int) -> cpb.ClientMessage:
    return cpb.ClientMessage(run=cpb.RunProgram(run_id=run_id, output_ids=[run_id << 8]))


@pytest.mark.timeout(30)
def test_the_sender_batches_the_queue_and_a_new_stream_sends_what_was_kept_queued_first() -> None:
    """One stream's sender, then the next generation's after a resume took a run out of the queue."""
    out: queue.SimpleQueue[object] = queue.SimpleQueue()
    sender = Sender(out, lambda: False)
    hello = cpb.ClientMessage(hello=cpb.Hello(client_name="t"))
    got: list[cpb.ClientMessage] = []
    first = sender.requests(0, [hello], sender.ready, sender.done)
    consumer = threading.Thread(target=lambda: got.extend(first), daemon=True)
    consumer.start()
    out.put(_run(1))
    out.put(_run(2))
    time.sleep(0.1)
    assert got == [hello]  # nothing past the hello before the Welcome
    sender.ready.set()
    deadline = time.monotonic() + 10
    while sender.handed_total < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [m.run.run_id for m in got[1].batch.messages] == [1, 2]  # one message for both
    assert list(sender.handed) == [(1, (1 << 8,)), (2, (2 << 8,))]

    gen, ready, done = sender.next_stream()  # the old stream's sender wakes and ends
    consumer.join(10)
    assert not consumer.is_alive() and len(got) == 2
    out.put(_run(3))
    out.put(_Release(9, "w1"))
    out.put(_run(4))
    queued = sender.queued()
    assert len(queued) == 3
    sender.requeue([queued[0], queued[1]])  # run 4 taken out (it failed)
    out.put(_run(5))
    second = sender.requests(gen, [hello], ready, done)
    assert next(second) is hello
    ready.set()
    msg = next(second)
    kinds = [(m.WhichOneof("msg"), m.run.run_id, list(m.release.buffer_ids)) for m in msg.batch.messages]
    assert kinds == [("run", 3, []), ("release", 0, [9]), ("run", 5, [])]  # what was kept first, in order
    assert sender.handed_total == 4
    out.put(STOP)
    assert list(second) == [] and done.is_set()
