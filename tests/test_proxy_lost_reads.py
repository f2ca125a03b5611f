"""Calls of the proxy to a worker that stops answering (frozen: its connections stay open,
nothing comes back) end with an error naming the lost host as soon as the controller declares it
lost (4 s of missed heartbeats here), not after the proxy's own wait bounds (an hour, ten
minutes) or never (server/proxy/host_watch.py): a download (`np.asarray`, the worker's `Fetch`)
and a readiness check (`block_until_ready`, its `Wait`) of an array computed there before it
froze, a compile of a program over its devices (its `Compile`), a large upload streaming to it
(its `PutBuffers`, staging.py); a later read of another of its arrays fails at once; the session
answers its next request (the slice degraded); another session on the cluster runs meanwhile."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import LocalCluster
from proxy_env import Program, proxy_env
from test_proxy_staged_move import other_session
from test_proxy_submesh import PRELUDE, two_workers

HEARTBEAT_TIMEOUT_S = 4.0  # the controller declares a frozen worker's host lost after this long

FROZEN = PRELUDE + """
import sys, threading, time
lock = threading.Lock()
def say(*parts, flush=True):  # one line whole: print writes the text and its newline apart, and threads interleave
    with lock:
        sys.stdout.write(" ".join(map(str, parts)) + chr(10))
        sys.stdout.flush()
x = jax.device_put(np.arange(8.0, dtype=np.float32), devs[2])  # on the second worker
# runs sent before the program blocked on anything: their outputs' readiness is the worker's Wait
y = jax.jit(lambda v: v * 3)(x)
z = jax.jit(lambda v: v + 1)(y)
z.block_until_ready()  # y is computed too
say("ready", flush=True)
sys.stdin.readline()
def said(what, e):
    return " ".join([what, "error", type(e).__name__, str(e).replace(chr(10), " ")[:400]])
def block():
    try:
        y.block_until_ready()
        say("block ok", flush=True)
    except Exception as e:
        say(said("block", e), flush=True)
def compile():  # a program over the frozen worker's two devices: compiled there now (compiling.py)
    try:
        arg = jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(back, P("s")))
        jax.jit(lambda v: (v * 5).sum()).lower(arg).compile()
        say("compile ok", flush=True)
    except Exception as e:
        say(said("compile", e), flush=True)
waiting = [threading.Thread(target=block), threading.Thread(target=compile)]
for t in waiting:
    t.start()
try:
    say("download", np.asarray(y).tolist(), flush=True)
except Exception as e:
    say(said("download", e), flush=True)
for t in waiting:
    t.join()
start = time.monotonic()
try:
    say("again", np.asarray(x).tolist(), flush=True)  # an upload: no run of the lost host fails it
except Exception as e:
    say(said("again", e), f"{time.monotonic() - start:.1f}", flush=True)
try:
    w = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(line, P("d")))
    say("after", np.asarray(w).tolist(), flush=True)
except Exception as e:
    say(said("after", e), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
def test_reads_from_a_worker_that_stops_answering_fail_when_its_host_is_lost(
        cluster: LocalCluster, tmp_path: Path) -> None:
    where = two_workers(cluster)
    home, dest = where[0][0], where[2][0]
    assert home != dest == where[3][0]
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")
    try:
        with Program(FROZEN, env) as prog, other_session(cluster, tmp_path) as other:
            assert prog.line() == "ready"
            cluster.stop_worker(dest)
            start = time.monotonic()
            prog.go()
            block, compiled, download = sorted(prog.lines_within(3, 4 * HEARTBEAT_TIMEOUT_S))
            took = time.monotonic() - start
            address = cluster.hosts()[dest].address
            lost = f"worker {address} failed: its host {dest} was lost"
            assert block.startswith("block error JaxRuntimeError UNAVAILABLE: ") and block.endswith(
                f"waiting on {lost}"), block
            assert compiled.startswith("compile error JaxRuntimeError UNAVAILABLE: ") and compiled.endswith(
                f"on {lost}"), compiled
            assert download.startswith("download error JaxRuntimeError UNAVAILABLE: ") and download.endswith(
                f"downloading from {lost}"), download
            assert HEARTBEAT_TIMEOUT_S - 1 < took < 3 * HEARTBEAT_TIMEOUT_S, took
            # a read from the lost host later fails at once (no call sent, no wait for a timer)
            again = prog.line()
            assert again.startswith("again error JaxRuntimeError UNAVAILABLE: ") and f"downloading from {lost} " \
                in again and float(again.rsplit(" ", 1)[1]) < 2, again
            # the session answers: the slice is degraded now, and says so
            line = prog.line()
            assert line.startswith("after error JaxRuntimeError") and f"host {dest} lost" in line, line
            # the cluster goes on: another session, on the surviving worker's devices, runs
            assert other.finish("go\n", timeout=60) == "[0.0, 2.0, 4.0, 6.0]\n"
            prog.finish(timeout=30)
    finally:
        cluster.cont_worker(dest)


STAGED = PRELUDE + """
import sys
big = np.arange(4 << 20, dtype=np.float32) / 7  # 16 MiB: streamed on to the slice's first worker as it comes
warm = jax.device_put(np.arange(8.0, dtype=np.float32), devs[0])  # the proxy's channel to worker 0 is open
warm.block_until_ready()
del warm
print("ready", flush=True)
sys.stdin.readline()
try:
    x = jax.device_put(big, devs[0])
    x.block_until_ready()
    print("stored", flush=True)
except Exception as e:
    print("error", type(e).__name__, str(e).replace(chr(10), " ")[:400], flush=True)
try:
    v = jax.device_put(big, devs[3])  # staged again: on the degraded slice
    v.block_until_ready()
    print("again stored", flush=True)
except Exception as e:
    print("again error", type(e).__name__, str(e).replace(chr(10), " ")[:400], flush=True)
try:
    w = jax.device_put(np.arange(8.0, dtype=np.float32), devs[3])
    print("after", np.asarray(w).tolist(), flush=True)
except Exception as e:
    print("after error", type(e).__name__, str(e).replace(chr(10), " ")[:400], flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
def test_a_staged_upload_to_a_first_worker_that_stops_answering_fails_when_its_host_is_lost(
        cluster: LocalCluster, tmp_path: Path) -> None:
    """The slice's first worker freezes before a large upload streams to it (staging.py): the
    stream's writes stop (flow control), and the array fails naming the lost host, in the
    session, which answers its next request."""
    where = two_workers(cluster)
    first = where[0][0]
    env = proxy_env(cluster, tmp_path, PATHWAYS_SLICE="wide")
    try:
        with Program(STAGED, env) as prog:
            assert prog.line() == "ready"
            cluster.stop_worker(first)
            start = time.monotonic()
            prog.go()
            (line,) = prog.lines_within(1, 4 * HEARTBEAT_TIMEOUT_S)
            took = time.monotonic() - start
            address = cluster.hosts()[first].address
            assert line.startswith("error JaxRuntimeError UNAVAILABLE: ") and line.endswith(
                f"uploading to worker {address} failed: its host {first} was lost"), line
            assert HEARTBEAT_TIMEOUT_S - 1 < took < 3 * HEARTBEAT_TIMEOUT_S, took
            # the session goes on (the jaxlib client ends its session when a HostBufferStore
            # fails: the staging's failure is the array's): the slice is degraded now, and says so
            for step in ("again", "after"):  # a large upload (staged), a small one
                line = prog.line()
                assert line.startswith(f"{step} error JaxRuntimeError") and f"host {first} lost" in line, line
            prog.finish(timeout=30)
    finally:
        cluster.cont_worker(first)
