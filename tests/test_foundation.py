"""The foundation as a user meets it: real controller and worker processes, driven through pwctl.

Registration, heartbeat loss and return, controller restart on the same database, the token,
exit codes and one-line errors, `pwctl up`/`down`, `pwctl server start|info|stop`.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import REPO, LocalCluster, base_env, free_port, run_pwctl, wait_for
from together import pwctls, together

from pwctl import local
from schemas.pathways.v1 import common_pb2 as pb

pytestmark = pytest.mark.cluster


def _ts(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def _assert_one_line_error(stderr: str, *fragments: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected a one-line error, got: {stderr!r}"
    assert lines[0].startswith("error: ")
    assert "Traceback" not in stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture
def pw_local(pw_home: Path) -> Iterator[Path]:
    """pw_home for tests that start detached processes through pwctl; on teardown stops what
    the pid files there name (identity-checked by pwctl.local), so a failing test leaks nothing."""
    yield pw_home
    local.down(grace=2.0)
    local.stop_controller(timeout=2.0)
    workers_dir = pw_home / "workers"
    for pid_file in workers_dir.glob("*.pid") if workers_dir.exists() else []:
        try:
            local.stop_worker(pid_file.stem, grace=2.0)
        except Exception:
            pass


# ---- registration and the read-only CLI (shared cluster) ----


def test_registration_lists_islands_hosts_devices(module_cluster: LocalCluster) -> None:
    c = module_cluster
    islands = c.pwctl_json("island", "list")
    assert islands["apiVersion"] == "pathways/v1"
    assert islands["kind"] == "IslandList"
    assert [(i["name"], i["hosts"], i["devices"], i["available_devices"]) for i in islands["items"]] == [
        ("a", 1, 2, 2),
        ("b", 1, 2, 2),
    ]

    hosts = c.pwctl_json("host", "list")
    assert hosts["kind"] == "HostList"
    by_name = {h["name"]: h for h in hosts["items"]}
    assert set(by_name) == {"w-a", "w-b"}
    for name, h in by_name.items():
        assert h["state"] == "ready"
        assert h["pid"] == c.workers[name].pid
        assert h["devices"] == 2 and h["device_kind"] == "cpu"
        assert _ts(h["last_heartbeat"]).tzinfo is not None

    devices = c.pwctl_json("device", "list")
    assert devices["kind"] == "DeviceList"
    assert len(devices["items"]) == 4
    assert len({d["id"] for d in devices["items"]}) == 4
    assert {d["state"] for d in devices["items"]} == {"available"}
    assert sorted((d["island"], d["host"], d["local_index"]) for d in devices["items"]) == [
        ("a", "w-a", 0), ("a", "w-a", 1), ("b", "w-b", 0), ("b", "w-b", 1),
    ]

    only_a = c.pwctl_json("device", "list", "--island", "a")
    assert {d["island"] for d in only_a["items"]} == {"a"} and len(only_a["items"]) == 2

    table = c.pwctl("device", "list")
    assert table.returncode == 0
    assert "w-a" in table.stdout and "available" in table.stdout


def test_server_info_json(module_cluster: LocalCluster) -> None:
    doc = module_cluster.pwctl_json("server", "info")
    assert doc["apiVersion"] == "pathways/v1" and doc["kind"] == "ServerInfo"
    info = doc["item"]
    assert info["address"] == module_cluster.address
    assert info["pid"] == module_cluster.controller.pid  # type: ignore[union-attr]
    assert (info["islands"], info["hosts"], info["devices"]) == (2, 2, 4)
    assert info["version"] and info["uptime_s"] >= 0
    assert info["database"].startswith("sqlite:///")
    assert _ts(info["started_at"]).tzinfo is not None


def test_cli_exit_codes(module_cluster: LocalCluster) -> None:
    c = module_cluster
    # reads and refusals: independent, run at once (tests/together.py)
    ok, usage, flag, noun, missing = pwctls(c, ["island", "list"], ["island", "list", "-o", "bogus"],
                                            ["device", "list", "--no-such-flag"], ["no-such-noun"],
                                            ["device", "list", "--island", "nope"])
    assert ok.returncode == 0

    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert flag.returncode == 2
    assert noun.returncode == 2

    assert missing.returncode == 3
    _assert_one_line_error(missing.stderr, "nope")
    assert missing.stdout == ""


def test_unreachable_server_is_one_line(pw_home: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    r, flag = together(
        lambda: run_pwctl("island", "list", env=base_env(pw_home, PWCTL_SERVER=address)),
        lambda: run_pwctl("device", "list", "--server", address, env=base_env(pw_home, PWCTL_SERVER="127.0.0.1:1")))
    assert r.returncode == 1
    _assert_one_line_error(r.stderr, f"cannot reach the server at {address}", "try `pwctl up`")
    # the flag wins over the environment
    r = flag
    assert r.returncode == 1
    _assert_one_line_error(r.stderr, f"cannot reach the server at {address}")


# ---- failures and restarts (own cluster each) ----


@pytest.mark.cluster(islands=1, devices=2, heartbeat_timeout=4.0)  # lost soon after it froze
def test_heartbeat_loss_and_return(cluster: LocalCluster) -> None:
    before = cluster.hosts()["w-a"]
    cluster.stop_worker("w-a")  # frozen: the connection stays open, heartbeats stop
    lost = cluster.wait_host_state("w-a", pb.HOST_STATE_LOST, timeout=15)
    assert lost.id == before.id
    devices = cluster.pwctl_json("device", "list")["items"]
    assert devices and {d["state"] for d in devices} == {"lost"}
    island = cluster.pwctl_json("island", "list")["items"][0]
    assert (island["devices"], island["available_devices"]) == (2, 0)

    cluster.cont_worker("w-a")
    back = cluster.wait_host_state("w-a", pb.HOST_STATE_READY, timeout=15)
    assert (back.id, back.pid) == (before.id, before.pid)  # re-registered as the same host
    devices_after = cluster.pwctl_json("device", "list")["items"]
    assert {d["state"] for d in devices_after} == {"available"}
    assert sorted(d["id"] for d in devices_after) == sorted(d["id"] for d in devices)


# The heartbeat timeout of the restart tests' cluster: a host restored from the database that does
# not come back is lost after it. Long enough for the calls of test_restored_host... to run before
# it on a slow machine too (they take ~1 s), short because that test waits it out.
RESTORED_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """2 islands x 2 devices for the controller restart tests (starting one takes seconds): each
    leaves it with its controller and both workers up and ready. Its logs are checked for broken
    invariants at the end of the module."""
    with LocalCluster(tmp_path_factory.mktemp("restartable"), heartbeat_timeout=RESTORED_TIMEOUT_S) as c:
        c.start([("a", 2), ("b", 2)])
        yield c


def test_controller_restart_keeps_state_and_workers_reconnect(restartable: LocalCluster) -> None:
    cluster = restartable
    hosts_before = cluster.pwctl_json("host", "list")["items"]
    devices_before = cluster.pwctl_json("device", "list")["items"]

    cluster.restart_controller(kill=True)  # a crash: nothing flushed on the way out
    restarted_at = datetime.now(UTC)

    # what the database knew is listed at once, before any worker reconnected
    assert [i["name"] for i in cluster.pwctl_json("island", "list")["items"]] == ["a", "b"]
    hosts = cluster.pwctl_json("host", "list")["items"]
    assert [(h["id"], h["name"], h["island"]) for h in hosts] == [
        (h["id"], h["name"], h["island"]) for h in hosts_before
    ]
    devices = cluster.pwctl_json("device", "list")["items"]
    assert [(d["id"], d["host"], d["local_index"]) for d in devices] == [
        (d["id"], d["host"], d["local_index"]) for d in devices_before
    ]

    # the same worker processes come back on their own and heartbeat again
    def reconnected() -> bool:
        now = cluster.hosts()
        return all(
            h.state == pb.HOST_STATE_READY and h.pid == cluster.workers[n].pid
            and _ts(h.last_heartbeat) > restarted_at
            for n, h in now.items()
        ) and set(now) == {"w-a", "w-b"}

    wait_for(reconnected, 30, "workers to reconnect to the restarted controller")
    assert all(w.proc.poll() is None for w in cluster.workers.values())
    ready = cluster.pwctl_json("device", "list")["items"]
    assert {d["state"] for d in ready} == {"available"}
    assert sorted(d["id"] for d in ready) == sorted(d["id"] for d in devices_before)


def test_restored_host_is_reconnecting_until_it_registers(restartable: LocalCluster) -> None:
    """After a restart the database's hosts are not shown ready before their workers are back:
    one that cannot come back (frozen here) is reconnecting, then lost after the timeout (long
    enough here for the four CLI calls below to run before it, on a slow machine too)."""
    cluster = restartable
    cluster.stop_controller()
    cluster.stop_worker("w-b")  # frozen while the controller is down: it cannot reconnect
    try:
        cluster.start_controller()

        # the four reads run at once (tests/together.py), all before the timeout
        hosts, devices_doc, islands_doc, table = together(
            cluster.hosts, lambda: cluster.pwctl_json("device", "list", "--island", "b"),
            lambda: cluster.pwctl_json("island", "list"), lambda: cluster.pwctl("host", "list"))
        assert hosts["w-b"].state == pb.HOST_STATE_RECONNECTING
        devices = devices_doc["items"]
        assert {d["state"] for d in devices} == {"reconnecting"}
        island_b = {i["name"]: i for i in islands_doc["items"]}["b"]
        assert (island_b["devices"], island_b["available_devices"]) == (2, 0)
        assert "reconnecting" in table.stdout

        cluster.wait_host_state("w-a", pb.HOST_STATE_READY, timeout=15)  # the live one registers again
        cluster.wait_host_state("w-b", pb.HOST_STATE_LOST, timeout=15)  # the frozen one times out
    finally:
        cluster.cont_worker("w-b")  # (after a failure too: the module's cluster stays usable)
    cluster.wait_host_state("w-b", pb.HOST_STATE_READY, timeout=15)


_WAITING_CLIENT = """
import sys, numpy as np, pwctl as pw
s = pw.make_virtual_device_set().add_slice(devices=1)
f = pw.jit(lambda x: x + 1, mesh=s.mesh("x"))
print(np.asarray(f(np.zeros(2))).tolist(), flush=True)
sys.stdin.readline()  # the controller stops meanwhile
try:
    f(np.zeros(2)).result(timeout=10)
except pw.PathwaysError as e:
    print(e)
"""


@pytest.mark.cluster(islands=1, devices=1)
def test_a_stopping_controller_ends_worker_watch_and_client_streams_cleanly(cluster: LocalCluster) -> None:
    """Every long-lived stream ends before the server stops: no handler is cancelled (gRPC logs
    those as errors with tracebacks), `status --watch` ends with 0, and a client learns why."""
    # PWCTL_RECONNECT_S=0: the client does not wait for a next controller (tests/test_restart_sessions.py)
    client = subprocess.Popen([sys.executable, "-c", _WAITING_CLIENT], env=cluster.env(PWCTL_RECONNECT_S="0"),
                              cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watch = subprocess.Popen([sys.executable, "-m", "pwctl.cli.main", "status", "--watch", "--interval", "0.2"],
                             env=cluster.env(), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert client.stdout is not None and watch.stdout is not None
        assert client.stdout.readline().strip() == "[1.0, 1.0]"
        assert watch.stdout.readline()  # the first status is out: the stream is open
        cluster.stop_controller()
        assert watch.wait(timeout=20) == 0
        assert "the controller ended the watch" in watch.communicate()[1]
        out, err = client.communicate("\n", timeout=30)
        assert "the controller is shutting down" in out, err[-2000:]
    finally:
        for p in (client, watch):
            if p.poll() is None:
                p.kill()
                p.communicate()
    logs = cluster.controller_logs()
    assert "controller shutting down" in logs
    assert "Traceback" not in logs and " ERROR " not in logs, logs[-3000:]


def test_token_required_and_accepted(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster  # only read: the module's cluster (2 islands) does
    token_file = c.home / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = c.token
    assert token

    # a client that has neither the token file nor PWCTL_TOKEN
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    no_token = base_env(elsewhere, PWCTL_SERVER=c.address)
    # independent calls, run at once (tests/together.py)
    r, wrong, ok, local_call = together(
        lambda: run_pwctl("island", "list", env=no_token),
        lambda: run_pwctl("island", "list", env={**no_token, "PWCTL_TOKEN": "not-the-token"}),
        lambda: run_pwctl("island", "list", "-o", "json", env={**no_token, "PWCTL_TOKEN": token}),
        # on the server's own machine pwctl finds the token file by itself
        lambda: c.pwctl("island", "list"))
    assert r.returncode == 4
    _assert_one_line_error(r.stderr, "rejected", "PWCTL_TOKEN")

    assert wrong.returncode == 4

    assert ok.returncode == 0, ok.stderr
    assert [i["name"] for i in json.loads(ok.stdout)["items"]] == ["a", "b"]  # the workers got in with it

    assert local_call.returncode == 0


# ---- pwctl server / up / down (detached processes under a temporary PATHWAYS_HOME) ----


def test_server_start_twice_info_stop(pw_local: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_local, PWCTL_SERVER=address)
    db = f"sqlite:///{pw_local / 'pw.db'}"

    first = run_pwctl("server", "start", "--listen", address, "--db", db, "--relay-min-hosts", "8",
                      "--group-wait", "12.5", env=env)
    assert first.returncode == 0, first.stderr
    pid_info = json.loads((pw_local / "server.pid").read_text())
    assert pid_info["address"] == address
    pid = pid_info["pid"]
    assert local.runs_module(pid, "server.controller")
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert args[args.index(b"--relay-min-hosts") + 1] == b"8" and args[args.index(b"--relay-group") + 1] == b"64"
    assert args[args.index(b"--group-wait") + 1] == b"12.5"
    assert (pw_local / "server.log").exists()

    second = run_pwctl("server", "start", "--listen", address, "--db", db, env=env)
    assert second.returncode == 0
    assert f"already running (pid {pid} at {address})" in second.stderr

    info, table = together(lambda: run_pwctl("server", "info", "-o", "json", env=env),
                           lambda: run_pwctl("server", "info", env=env))
    doc = json.loads(info.stdout)
    assert doc["kind"] == "ServerInfo"
    assert (doc["item"]["pid"], doc["item"]["address"]) == (pid, address)
    assert doc["item"]["database"] == db
    assert table.returncode == 0 and "uptime" in table.stdout

    stop = run_pwctl("server", "stop", env=env)
    assert stop.returncode == 0, stop.stderr
    assert not local.is_alive(pid)
    assert not (pw_local / "server.pid").exists()
    assert run_pwctl("island", "list", env=env).returncode == 1


def _read_sup(job_dir: Path) -> dict | None:
    """The job supervisor's record (its pid and the driver's), once it has written it."""
    try:
        doc = json.loads((job_dir / "sup.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if doc.get("driver_pid") else None


def test_up_down_stops_exactly_what_it_started(pw_local: Path, module_cluster: LocalCluster) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_local, PWCTL_SERVER=address)
    r = run_pwctl("up", "--islands", "2", "--devices", "2", "--listen", address, env=env)
    assert r.returncode == 0, r.stderr
    assert address in r.stdout
    # out of the box the cluster needs the token, which `up` made and every local caller finds
    assert stat.S_IMODE((pw_local / "token").stat().st_mode) == 0o600

    state = json.loads((pw_local / "cluster.json").read_text())
    assert state["address"] == address
    assert set(state["worker_pids"]) == {"local-a", "local-b"}
    pids = [state["controller_pid"], *state["worker_pids"].values()]
    assert all(local.is_alive(p) for p in pids)

    islands = json.loads(run_pwctl("island", "list", "-o", "json", env=env).stdout)
    assert [(i["name"], i["devices"], i["available_devices"]) for i in islands["items"]] == [
        ("a", 2, 2), ("b", 2, 2),
    ]

    again = run_pwctl("up", "--islands", "2", "--devices", "2", "--listen", address, env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads((pw_local / "cluster.json").read_text()) == state  # idempotent: nothing new

    # a running job outlives a controller restart, so `down` cancels it: not without -y when it cannot ask
    program = pw_local / "sleeper.py"
    program.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    sub = run_pwctl("submit", str(program), "-d", env=env)
    assert sub.returncode == 0, sub.stderr
    job_id = json.loads(run_pwctl("jobs", "list", "-o", "json", env=env).stdout)["items"][0]["id"]
    sup = wait_for(lambda: _read_sup(pw_local / "jobs" / job_id), what="the job's supervisor")
    refused = run_pwctl("down", env=env)
    assert refused.returncode == 2 and "pass -y" in refused.stderr and job_id in refused.stderr
    assert all(local.is_alive(p) for p in pids) and local.is_alive(sup["pid"])

    down = run_pwctl("down", "-y", env=env)
    assert down.returncode == 0, down.stderr
    assert f"cancelled {job_id}" in down.stderr
    assert not local.is_alive(sup["pid"]) and not local.is_alive(sup["driver_pid"])
    assert not any(local.is_alive(p) for p in pids)
    assert not (pw_local / "cluster.json").exists()
    # processes it did not start are untouched
    procs = [module_cluster.controller, *(w.proc for w in module_cluster.workers.values())]
    assert all(p is not None and p.poll() is None for p in procs)


def test_cluster_processes_validate_and_teardown_fails_on_a_logged_invariant_error(tmp_path: Path) -> None:
    """Every process a cluster starts validates its state machines; a broken invariant that any of
    them logged fails the test at teardown (it cannot pass unnoticed)."""
    c = LocalCluster(tmp_path / "c")
    assert c.env()["PATHWAYS_VALIDATE"] == "1"
    (c.home / "worker-w-a-0-0.log").write_text("INFO worker ready\n")
    c.check_invariants()  # a clean log passes
    (c.home / "controller-0.log").write_text(
        "ERROR InvariantError in CreateSlice: load {3: 1} != recomputed {}\n"
        "after these stimuli (oldest first):\n  1.000000 HostUp h1 devices [0, 1]\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)invariant broke.*controller-0.log.*HostUp h1"):
        c.check_invariants()


def test_the_cluster_controller_validates_its_state_machines(module_cluster: LocalCluster) -> None:
    assert "validate their invariants after every stimulus" in module_cluster.controller_logs()
