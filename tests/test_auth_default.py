"""Issue 29: every controller RPC is authenticated on every address, loopback included.

A machine's loopback is shared by all its users, so the cluster token is required by default
(`--no-token` is the explicit opt-out for a private machine); a session may act as a job only
with that job's secret; one caller cannot hold every session the controller allows.

Real controllers and workers (tests/conftest.py), raw gRPC where a hostile caller would use it.
"""

from __future__ import annotations

import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import REPO, LocalCluster, base_env, run_pwctl, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_trust_controller import HeldStream

from schemas.pathways.v1 import controller_pb2 as cpb
from schemas.pathways.v1 import controller_pb2_grpc as cgrpc

pytestmark = pytest.mark.timeout(120)

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(120)\n"
CONNECTS = "import pwctl.api.runtime as rt\nrt.Runtime.get()\nprint('connected', flush=True)\n"


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class RawSession(HeldStream):
    """A Session stream driven by hand: the Hello, then open until closed."""

    def __init__(self, channel: grpc.Channel, hello: cpb.Hello, token: str | None) -> None:
        super().__init__(cgrpc.ControllerStub(channel).Session, cpb.ClientMessage(hello=hello), 60,
                         metadata=bearer(token))


def refused(channel: grpc.Channel, hello: cpb.Hello, token: str | None) -> grpc.RpcError:
    s = RawSession(channel, hello, token)
    try:
        with pytest.raises(grpc.RpcError) as info:
            s.first()
        return info.value
    finally:
        s.close()


# ---- the token, by default on loopback too ----
@pytest.mark.cluster(islands=1, devices=1, controller_args=["--metrics-listen", "127.0.0.1:0"])
def test_a_loopback_caller_without_the_token_is_refused_by_default(cluster: LocalCluster, tmp_path: Path) -> None:
    token = cluster.token
    assert token, "the controller writes the cluster token without being asked"
    assert stat.S_IMODE((cluster.home / "token").stat().st_mode) == 0o600

    # the CLI of a user who has neither the token file nor PWCTL_TOKEN: one line, nonzero exit
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = base_env(elsewhere, PWCTL_SERVER=cluster.address)
    r = run_pwctl("island", "list", env=env)
    assert r.returncode == 4, r.stdout + r.stderr
    line = one_line(r.stderr)
    assert "rejected the call" in line and "PWCTL_TOKEN" in line, line
    r = run_pwctl("island", "list", "-o", "name", env={**env, "PWCTL_TOKEN": token})
    assert r.returncode == 0 and r.stdout == "a\n", r.stderr  # the worker registered with it

    with grpc.insecure_channel(cluster.address) as ch:
        stub = cgrpc.ControllerStub(ch)
        for call in (lambda md: stub.GetInfo(cpb.GetInfoRequest(), metadata=md, timeout=10),
                     lambda md: next(iter(stub.Watch(cpb.WatchRequest(interval_s=5), metadata=md, timeout=10)))):
            with pytest.raises(grpc.RpcError) as info:
                call(())
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as info:
                call(bearer("not-the-token"))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        err = refused(ch, cpb.Hello(client_name="anonymous"), None)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetInfo(cpb.GetInfoRequest(), metadata=bearer(token), timeout=10).address == cluster.address
        # the standard health service needs none (Kubernetes probes send none)
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    # the Prometheus endpoint, the same way: a bearer token on loopback too
    url = cluster.pwctl_json("server", "info")["item"]["metrics_url"]
    assert url.startswith("http://127.0.0.1:")
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(url, timeout=10)
    assert http.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert b"pathways_hosts" in resp.read()


@pytest.mark.cluster(islands=1, devices=1, controller_args=["--no-token", "--metrics-listen", "127.0.0.1:0"])
def test_no_token_opts_out_on_a_private_machine(cluster: LocalCluster, tmp_path: Path) -> None:
    assert cluster.token is None, "--no-token writes no token"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run_pwctl("island", "list", "-o", "name", env=base_env(elsewhere, PWCTL_SERVER=cluster.address))
    assert r.returncode == 0 and r.stdout == "a\n", r.stderr
    with grpc.insecure_channel(cluster.address) as ch:
        s = RawSession(ch, cpb.Hello(client_name="private"), None)
        try:
            assert s.first().WhichOneof("msg") == "welcome"
        finally:
            s.close()
    url = cluster.pwctl_json("server", "info")["item"]["metrics_url"]
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert b"pathways_hosts" in resp.read()


def test_a_controller_makes_the_token_when_there_is_none(make_cluster: Any) -> None:
    c: LocalCluster = make_cluster(start=False)
    assert c.token is None
    c.start_controller(wait=False)
    wait_for(lambda: c.token, 30, "the controller to write the token")
    c.wait_controller()  # its client found the token as pwctl does
    assert stat.S_IMODE((c.home / "token").stat().st_mode) == 0o600
    with grpc.insecure_channel(c.address) as ch, pytest.raises(grpc.RpcError) as info:
        cgrpc.ControllerStub(ch).GetInfo(cpb.GetInfoRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_deprecated_require_token_flag_is_still_accepted(make_cluster: Any) -> None:
    """`--require-token` (the old opt-in) is now the default: kept as a hidden alias that changes nothing."""
    c: LocalCluster = make_cluster(islands=1, devices=1, controller_args=["--require-token"])
    assert c.token
    assert c.pwctl("island", "list").returncode == 0


# ---- a session acts as a job only with the job's secret ----
@pytest.mark.cluster(islands=1, devices=1)
def test_a_hello_naming_another_job_is_refused(cluster: LocalCluster, tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    r = cluster.pwctl("submit", str(script), "-d")
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    wait_for(lambda: cluster.pwctl_json("jobs", "describe", job_id)["item"]["state"] == "running", 30,
             "the job to run")
    token = cluster.token
    with grpc.insecure_channel(cluster.address) as ch:
        for hello in (cpb.Hello(client_name="thief", job_id=job_id),
                      cpb.Hello(client_name="thief", job_id=job_id, job_secret="guessed"),
                      cpb.Hello(client_name="thief", job_id="job-000000", job_secret="guessed")):
            err = refused(ch, hello, token)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
            assert "\n" not in err.details() and "PWCTL_JOB_SECRET" in err.details(), err.details()
        # resuming a session as a job needs the secret too
        err = refused(ch, cpb.Hello(job_id=job_id, resume_client_id="c0", resume_token="x"), token)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    # the pw runtime of a program claiming the job: one line, nonzero exit
    prog = tmp_path / "claim.py"
    prog.write_text(CONNECTS)
    out = subprocess.run([sys.executable, str(prog)], env=cluster.env(PWCTL_JOB_ID=job_id), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "connected" not in out.stdout
    assert "PWCTL_JOB_SECRET" in out.stderr.strip().splitlines()[-1], out.stderr
    assert cluster.pwctl_json("jobs", "describe", job_id)["item"]["state"] == "running"  # nothing changed
    assert cluster.pwctl("cancel", job_id, "-y").returncode == 0
    assert "Traceback" not in cluster.controller_logs()


# ---- sessions per caller ----
@pytest.mark.cluster(islands=1, devices=1, controller_args=["--max-sessions-per-caller", "2"])
def test_one_caller_cannot_hold_every_session(cluster: LocalCluster, tmp_path: Path) -> None:
    token = cluster.token
    with grpc.insecure_channel(cluster.address) as ch:
        sessions = [RawSession(ch, cpb.Hello(client_name=f"s{i}"), token) for i in range(2)]
        try:
            for s in sessions:
                assert s.first().WhichOneof("msg") == "welcome"
            err = refused(ch, cpb.Hello(client_name="one-too-many"), token)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "\n" not in err.details() and "--max-sessions-per-caller" in err.details(), err.details()
            # another caller still gets in: a job's driver (its secret proves it) counts on its own
            driver = tmp_path / "driver.py"
            driver.write_text(CONNECTS)
            r = cluster.pwctl("submit", str(driver))
            assert r.returncode == 0 and "connected" in r.stdout, r.stdout + r.stderr
            sessions[0].close()

            def opens() -> bool:
                s = RawSession(ch, cpb.Hello(client_name="later"), token)
                try:
                    return s.first().WhichOneof("msg") == "welcome"
                except grpc.RpcError:
                    return False
                finally:
                    s.close()

            wait_for(opens, 15, "a closed session to free its place")
        finally:
            for s in sessions:
                s.close()
    assert "Traceback" not in cluster.controller_logs()


def test_the_session_cap_per_caller_is_a_documented_limit() -> None:
    from server.controller import limits

    assert limits.DEFAULT_MAX_SESSIONS_PER_CALLER < limits.DEFAULT_MAX_SESSIONS
    assert "--max-sessions-per-caller" in (limits.__doc__ or "")
