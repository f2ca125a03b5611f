"""Unmodified JAX programs (JAX_PLATFORMS=proxy) against a real local cluster: the proxy service on
the controller's own port, sessions on named and fresh slices, the cluster token, clear errors.

Single-device arrays move through the proxy into worker buffers and back; computing is in
tests/test_proxy_compute.py. The tests that leave the cluster as they found it share one
(`module_cluster`: one island of 2 devices).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import client_env, parts_output, proxy_env, start_parts

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

pytestmark = pytest.mark.cluster(islands=1, devices=2)  # the module's cluster (tests' own marks win)

PROGRAM = """
import sys
import jax, jax.numpy as jnp
print("devices", len(jax.devices()), jax.devices()[0].platform, flush=True)
sys.stdin.readline()
try:
    print("ones", jnp.ones(3).tolist(), flush=True)
except Exception as e:
    print("error", type(e).__name__, str(e).splitlines()[0], flush=True)
"""


def start(cluster: LocalCluster, tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    env = {"PWCTL_TOKEN": cluster.token or "", **env}  # a program elsewhere: the token from the environment
    full = client_env(tmp_path, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{cluster.address}",
                      PATHWAYS_CONNECT_TIMEOUT_S="3", **env)
    return subprocess.Popen([sys.executable, "-c", PROGRAM], env=full, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str]) -> tuple[int, list[str], str]:
    out, err = proc.communicate("go\n", timeout=90)
    return proc.returncode, out.splitlines(), err


def proxy_slices(cluster: LocalCluster) -> list[cpb.Slice]:
    with cluster.client() as c:
        return [s for s in c.slices() if s.owner.startswith("client:proxy-")]


@pytest.mark.cluster(islands=2, devices=2)
def test_proxy_sessions_on_the_cluster(cluster: LocalCluster, tmp_path: Path) -> None:
    token = cluster.token
    assert token
    with cluster.client() as c:
        c.create_slice(cpb.SliceSpec(name="train", devices=2, island="a"))

    # a named slice: its devices are the program's devices
    proc = start(cluster, tmp_path, PWCTL_TOKEN=token, PATHWAYS_SLICE="train")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "devices 2 cpu"
    rc, lines, err = finish(proc)
    assert rc == 0, err
    assert lines == ["ones [1.0, 1.0, 1.0]"]  # compiled and run by the slice's worker
    with cluster.client() as c:
        assert [s.name for s in c.slices()] == ["train"]  # a named slice outlives the program

    # a fresh slice of PATHWAYS_DEVICES devices, owned by the session and released at its end
    proc = start(cluster, tmp_path, PWCTL_TOKEN=token, PATHWAYS_DEVICES="1")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "devices 1 cpu"
    fresh = proxy_slices(cluster)
    assert len(fresh) == 1 and len(fresh[0].devices) == 1
    rc, lines, err = finish(proc)
    assert rc == 0, err
    wait_for(lambda: not proxy_slices(cluster), 30, "the proxy session's slice to be released")

    # without PATHWAYS_DEVICES: every free device of the island with the most free devices (b: 2)
    proc = start(cluster, tmp_path, PWCTL_TOKEN=token)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "devices 2 cpu"
    assert {d.island for s in proxy_slices(cluster) for d in s.devices} == {"b"}
    rc, lines, err = finish(proc)
    assert rc == 0, err
    wait_for(lambda: not proxy_slices(cluster), 30, "the proxy session's slice to be released")


def test_refused_proxy_sessions_say_why(module_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster = module_cluster
    token = cluster.token
    assert token
    cases = [
        ({"PWCTL_TOKEN": "wrong"}, "UNAUTHENTICATED", "missing or wrong cluster token"),
        ({"PWCTL_TOKEN": token, "PATHWAYS_SLICE": "nope"}, "NOT_FOUND", "no slice named 'nope'"),
        ({"PWCTL_TOKEN": token, "PATHWAYS_DEVICES": "5"}, "RESOURCE_EXHAUSTED", "5"),
    ]
    procs = [start(cluster, tmp_path, **env) for env, _, _ in cases]  # at once: each starts a JAX process
    for proc, (_env, code, message) in zip(procs, cases, strict=True):
        rc, lines, err = finish(proc)
        assert rc != 0 and lines == []
        last = err.strip().splitlines()[-1]
        assert "Unable to initialize backend 'proxy'" in last and code in last and message in last, last
    assert proxy_slices(cluster) == []
    with cluster.client() as c:
        assert c.slices() == []


@pytest.mark.cluster(islands=1, devices=2, controller_args=["--max-sessions-per-caller", "1"])
def test_proxy_sessions_count_against_their_callers_cap(cluster: LocalCluster, tmp_path: Path) -> None:
    """A proxy session takes a place among its caller's sessions like a `pw` session (one caller:
    this machine's loopback address), so proxy programs cannot get round the cap."""
    first = start(cluster, tmp_path, PATHWAYS_DEVICES="1")
    assert first.stdout is not None
    assert first.stdout.readline().strip() == "devices 1 cpu"  # holds the one place
    second = start(cluster, tmp_path, PATHWAYS_DEVICES="1")
    rc, lines, err = finish(second)
    assert rc != 0 and lines == []
    last = err.strip().splitlines()[-1]
    assert "RESOURCE_EXHAUSTED" in last and "--max-sessions-per-caller" in last, last
    rc, lines, err = finish(first)
    assert rc == 0 and lines == ["ones [1.0, 1.0, 1.0]"], err
    wait_for(lambda: not proxy_slices(cluster), 30, "the first session to end")
    third = start(cluster, tmp_path, PATHWAYS_DEVICES="1")  # the place came back with the session's end
    rc, lines, err = finish(third)
    assert rc == 0 and lines == ["devices 1 cpu", "ones [1.0, 1.0, 1.0]"], err
    assert "Traceback" not in cluster.controller_logs()


def test_a_controller_restart_ends_the_proxy_session(module_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster = module_cluster
    proc = start(cluster, tmp_path, PATHWAYS_DEVICES="1")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "devices 1 cpu"
    cluster.restart_controller(kill=True)
    rc, lines, err = finish(proc)  # the jaxlib client cannot resume a session: its next call fails
    assert rc == 0, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error JaxRuntimeError UNAVAILABLE: Connection to IFRT proxy server was terminated")
    assert proxy_slices(cluster) == []  # the new controller released the old session's slice
    cluster.wait_ready()  # the module's cluster as it was: its worker registered with the new controller


ARRAYS = """
import numpy as np, jax, jax.numpy as jnp
x = jax.device_put(np.arange(6.0, dtype=np.float32).reshape(2, 3))
print("x", np.asarray(x).tolist(), x.dtype, [d.id for d in x.devices()])
y = jax.device_put(np.array([1.5, 2.5], dtype=np.float16), jax.devices()[1])
print("y", jax.device_get(y).tolist(), y.dtype, [d.id for d in y.devices()])
y.block_until_ready()
z = jax.device_put(np.arange(1 << 20, dtype=np.int32))
print("z", int(np.asarray(z)[-1]), z.nbytes)
del x
print("ok")
"""

def run_program(code: str, env: dict[str, str]) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, "\n".join(ln for ln in out.stderr.splitlines() if "insecure" not in ln)[:3000]
    return out.stdout.splitlines()


def matches_local(cluster: LocalCluster, tmp_path: Path, program: str, devices: int) -> list[str]:
    """`program`'s lines on plain JAX with `devices` CPU devices, asserted equal to its lines
    through `cluster`'s proxy on as many devices."""
    local, proxied = local_and_proxied(cluster, tmp_path, {"program": program}, devices)
    return same_as_local(local, proxied, "program")


def local_env(tmp_path: Path, devices: int) -> dict[str, str]:
    """`client_env` of plain JAX on `devices` local CPU devices."""
    flags = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"} if devices > 1 else {}
    return client_env(tmp_path, JAX_PLATFORMS="cpu", **flags)


# each program's lines (name -> lines) on plain JAX, then through the proxy (`local_and_proxied`)
Outputs = tuple[dict[str, list[str]], dict[str, list[str]]]


def local_and_proxied(cluster: LocalCluster, tmp_path: Path, parts: dict[str, str], devices: int,
                      proxy_only: dict[str, str] | None = None, slice_name: str | None = None) -> Outputs:
    """The programs `parts` (name -> code) run in one process on plain JAX with `devices` CPU
    devices and, at the same time, in one process through `cluster`'s proxy on as many devices
    (on the slice `slice_name` if given; there followed by the programs `proxy_only`): each
    side's lines by program name. Compare them with `same_as_local`."""
    where = {"PATHWAYS_SLICE": slice_name} if slice_name else {"PATHWAYS_DEVICES": str(devices)}
    on_cpu = start_parts(parts, local_env(tmp_path, devices))
    proxy = start_parts({**parts, **(proxy_only or {})}, proxy_env(cluster, tmp_path, **where))
    try:
        return parts_output(on_cpu), parts_output(proxy)
    finally:
        for p in (on_cpu, proxy):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def same_as_local(local: dict[str, list[str]], proxied: dict[str, list[str]], name: str) -> list[str]:
    """Program `name`'s lines on plain JAX, asserted to have run to its end there and through the
    proxy, with the same lines."""
    assert name in local and name in proxied, f"program {name!r} did not run: {sorted(local)}, {sorted(proxied)}"
    for side, lines in (("plain JAX", local[name]), ("the proxy", proxied[name])):
        assert not any(ln.startswith("FAILED ") for ln in lines), f"program {name!r} raised on {side}: {lines}"
    assert proxied[name] == local[name], f"program {name!r}: its lines through the proxy differ from plain JAX's"
    return local[name]


def test_arrays_move_through_the_proxy(module_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster = module_cluster
    local = matches_local(cluster, tmp_path, ARRAYS, 2)
    assert local[-1] == "ok"
    with cluster.client() as c:  # the session's buffers and slice went with it
        wait_for(lambda: not c.slices(), 30, "the proxy session's slice to be released")
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the proxy session's buffers to be freed")


def worker_buffers(cluster: LocalCluster) -> int:
    total = 0
    for host in cluster.hosts().values():
        with cluster.channel(host.address) as ch:
            total += wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10).buffers
    return total


HOLD = """
import sys
import numpy as np, jax
x = jax.device_put(np.ones((256, 1024), np.float32))
x.block_until_ready()
print("holding", flush=True)
sys.stdin.readline()
"""


def test_a_killed_program_frees_its_buffers(module_cluster: LocalCluster, tmp_path: Path) -> None:
    cluster = module_cluster
    env = proxy_env(cluster, tmp_path, PATHWAYS_DEVICES="1")
    proc = subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "holding"
        assert worker_buffers(cluster) == 1
        assert len(proxy_slices(cluster)) == 1
    finally:
        proc.kill()
        proc.wait(timeout=30)
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the killed program's buffers to be freed")
    wait_for(lambda: not proxy_slices(cluster), 30, "the killed program's slice to be released")
    with cluster.client() as c:  # the cluster goes on: a new slice, a new session
        c.create_slice(cpb.SliceSpec(name="after", devices=2))
    try:
        proc = start(cluster, tmp_path, PATHWAYS_SLICE="after")
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "devices 2 cpu"
        assert finish(proc)[0] == 0
    finally:
        with cluster.client() as c:  # the module's cluster as it was
            c.delete_slice("after", force=True)
