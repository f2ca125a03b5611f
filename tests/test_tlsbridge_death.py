"""The TLS bridge of an unmodified JAX program (pwctl/tlsbridge.py) killed mid-run: the program's
calls fail at once, the one in flight too (the jaxlib client cannot resume a session, so the bridge
is not started again), and one line on its stderr names the bridge that ended, rather than only
the jaxlib client's "Connection to IFRT proxy server was terminated", which a controller restart
gives too.

Real processes: a TLS controller and worker, the program in its own process with its bridge child."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import LocalCluster
from proxy_env import proxy_env
from tlscerts import make_ca, make_cert

pytestmark = pytest.mark.timeout(180)

PROGRAM = """
import json, sys, time
import jax, jax.numpy as jnp, numpy as np


def slow(v):  # seconds of matrix products: still computing when the bridge is killed
    m = jnp.full((512, 512), 1.0, jnp.float32) * v[0]
    m = jax.lax.fori_loop(0, 20000, lambda i, m: jnp.tanh(m @ m * (1.0 / 512)), m)
    return v + m[0, :3] * 0.0


x = jax.device_put(np.arange(3, dtype=np.float32))
print(json.dumps({"ok": np.asarray(jax.jit(lambda v: v + 1)(x)).tolist()}), flush=True)
sys.stdin.readline()
y = jax.jit(slow)(x)
print(json.dumps({"sent": True}), flush=True)
for what in ("in flight", "after"):
    start = time.monotonic()
    try:
        out = {"value": np.asarray(y if what == "in flight" else jax.jit(lambda v: v * 2)(x)).tolist()}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    out["s"] = round(time.monotonic() - start, 3)
    print(json.dumps({what: out}), flush=True)
"""


def test_a_killed_bridge_fails_the_programs_calls_at_once_and_is_named(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ca = make_ca(tmp_path)
    host = make_cert(ca, tmp_path, "host", ["127.0.0.1", "localhost"])
    flags = ["--tls-cert", str(host.cert), "--tls-key", str(host.key), "--tls-ca", str(ca.cert)]
    monkeypatch.setenv("PWCTL_TLS_CA", str(ca.cert))  # this process's clients (the fixture's checks)
    worker_env = {"PATHWAYS_TLS_CA": str(ca.cert), "PATHWAYS_TLS_CERT": str(host.cert),
                  "PATHWAYS_TLS_KEY": str(host.key)}
    with LocalCluster(tmp_path / "c", controller_args=flags, worker_env=worker_env) as c:
        c.start([("a", 1)])
        env = proxy_env(c, tmp_path, PWCTL_TLS_CA=str(ca.cert), PATHWAYS_DEVICES="1")
        proc = subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            assert json.loads(proc.stdout.readline() or "{}").get("ok") == [1.0, 2.0, 3.0], proc.stderr
            (bridge,) = [p for p in psutil.Process(proc.pid).children() if "pwctl.tlsbridge" in " ".join(p.cmdline())]
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert json.loads(proc.stdout.readline() or "{}").get("sent"), proc.stderr
            time.sleep(0.5)  # the computation runs; the program waits for its value
            bridge.kill()
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"the program hung once its bridge was killed: {out} {err[-3000:]}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    got = {k: v for line in out.splitlines() for k, v in json.loads(line).items()}
    # the read in flight waits in its host-buffer lookup (a small read's CopyToHostBuffer is
    # answered once its fetch began: server/proxy/downloads.py `Fetching`), whose end the jaxlib
    # client reports as the lookup's transport error (or the session's end, should it see that
    # first); the next call, as the session's end
    assert any(m in got["in flight"].get("error", "") for m in
               ("UNAVAILABLE: Socket closed", "Connection to IFRT proxy server was terminated")), got
    assert "Connection to IFRT proxy server was terminated" in got["after"].get("error", ""), got
    for what in ("in flight", "after"):
        assert got[what]["s"] < 5, got
    named = [ln for ln in err.splitlines() if "TLS bridge" in ln]
    assert len(named) == 1, err[-3000:]
    assert f"the TLS bridge to 127.0.0.1:{c.address.rpartition(':')[2]} (pid {bridge.pid}" in named[0], named
    assert "ended (killed by SIGKILL)" in named[0] and "its calls fail from now on" in named[0], named
    assert proc.returncode == 0, err[-3000:]
