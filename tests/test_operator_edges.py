"""Rough edges an operator meets first: `pwctl up --devices all`, `pwctl up` twice, a config.json
that is not what it should be, and a pwctl that does not match the controller's version. Real
processes throughout (a local cluster started by `pwctl up`, a controller that reports another
version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from conftest import REPO, base_env, free_port, log_tail, run_pwctl, wait_for
from together import together

from pwctl import local
from pwctl.version import compatible, release


@pytest.mark.timeout(120)
def test_up_with_every_device_then_again(pw_home: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address)
    try:
        r = run_pwctl("up", "--devices", "all", "--listen", address, env=env, timeout=90)
        assert r.returncode == 0, r.stderr
        islands = json.loads(run_pwctl("island", "list", "-o", "json", env=env).stdout)["items"]
        assert [i["name"] for i in islands] == ["a"] and islands[0]["devices"] >= 1  # one worker, every device
        # no --server, $PWCTL_SERVER or config: pwctl talks to the controller this data directory
        # runs, on the port `up --listen` gave it (it dialled 127.0.0.1:7070, "cannot reach")
        found = run_pwctl("island", "list", "-o", "name", env=base_env(pw_home))
        assert found.returncode == 0 and found.stdout.split() == ["a"], found.stderr
        assert r.stdout.startswith(f"cluster up at {address}: 1 island(s): a ({islands[0]['devices']} device(s))")
        assert r.stderr.startswith("starting 1 island(s) x all ...\n"), r.stderr

        # twice: says what runs, starts nothing, exits 0
        state = json.loads((pw_home / "cluster.json").read_text())
        again = run_pwctl("up", "--devices", "all", "--listen", address, env=env, timeout=60)
        assert again.returncode == 0, again.stderr
        worker_pid = state["worker_pids"]["local-a"]
        assert again.stdout.startswith(f"already up at {address}: 1 island(s): a (")
        assert "nothing started" in again.stdout and "starting" not in again.stderr, again.stderr
        assert f"local-a pid {worker_pid}" in again.stdout
        assert json.loads((pw_home / "cluster.json").read_text()) == state
        # another --listen cannot be honoured while this controller runs: said, not silently dropped
        elsewhere = f"127.0.0.1:{free_port()}"
        moved = run_pwctl("up", "--devices", "all", "--listen", elsewhere, env=env, timeout=60)
        assert moved.returncode == 0 and moved.stdout.startswith(f"already up at {address}: "), moved.stderr
        assert f"--listen {elsewhere} not used: this data directory's controller runs at {address}" in moved.stderr
        assert "not used" not in again.stderr  # the same address again, or none: nothing to say

        # usage errors: exit 2, one line, nothing started (refusals: run at once, tests/together.py)
        usage = ((["--devices", "all", "--islands", "2"], "one island"),
                 (["--devices", "0"], "neither a positive number nor 'all'"),
                 (["--devices", "lots"], "neither a positive number nor 'all'"))
        refused = together(*(lambda args=args: run_pwctl("up", *args, "--listen", address, env=env)
                             for args, _ in usage))
        for (_, message), bad in zip(usage, refused, strict=True):
            assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert json.loads((pw_home / "cluster.json").read_text()) == state

        # a listing piped at 80 columns keeps each row on one line, headers included
        name = "a-slice-whose-name-alone-takes-more-than-forty-columns"
        assert run_pwctl("slice", "create", name, "--devices", "1", env=env).returncode == 0
        listings = ((["slice", "list", "-o", "wide"], name, "REASON"),
                    (["host", "list", "-o", "wide"], "local-a", "LAST HEARTBEAT"))
        outputs = together(*(lambda args=args: run_pwctl(*args, env={**env, "COLUMNS": "80"})
                             for args, _, _ in listings))
        for (_, first, last), listed in zip(listings, outputs, strict=True):
            assert listed.returncode == 0, listed.stderr
            lines = listed.stdout.splitlines()
            assert len(lines) == 2 and lines[0].rstrip().endswith(last), listed.stdout
            assert lines[1].split()[0] == first, listed.stdout
    finally:
        down = run_pwctl("down", "-y", env=env, timeout=60)
    assert down.returncode == 0, down.stderr
    assert not local.is_alive(state["controller_pid"]) and not local.is_alive(worker_pid)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("content", "message"), [
    ("{bad", "is not valid JSON"),
    ('["127.0.0.1:7070"]', "must hold a JSON object"),
    ('{"server": 7070}', "'server' must be a string"),
    ('{"sever": "127.0.0.1:7070"}',
     "unknown key(s) 'sever' (known: server, token, tls_ca, tls_cert, tls_key, tls_server_name)"),
])
def test_an_invalid_config_file_is_an_error(pw_home: Path, content: str, message: str) -> None:
    (pw_home / "config.json").write_text(content)
    r = run_pwctl("island", "list", env=base_env(pw_home))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line, no traceback
    assert str(pw_home / "config.json") in r.stderr and message in r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("where", "address", "source"), [
    ("flag", "nonsense", "--server"),                  # no port
    ("subcommand", "127.0.0.1:99999", "--server"),      # no such port
    ("env", "grpc://127.0.0.1:7070", "PWCTL_SERVER"),  # JAX_BACKEND_TARGET's form
    ("config", "10.0.0.5", '"server" in'),
])
def test_a_controller_address_that_is_no_host_port_is_a_usage_error(pw_home: Path, where: str, address: str,
                                                                     source: str) -> None:
    """Said as such, naming where it came from: it was "cannot reach the server at nonsense: is it
    running?", exit 1, as if a controller were down."""
    env, args = base_env(pw_home), ["island", "list"]
    if where == "flag":
        args = ["--server", address, *args]
    elif where == "subcommand":
        args = [*args, "--server", address]
    elif where == "env":
        env["PWCTL_SERVER"] = address
    else:
        (pw_home / "config.json").write_text(json.dumps({"server": address}))
    r = run_pwctl(*args, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]  # one line, no traceback
    assert r.stderr.startswith(f"error: {source}") and f"invalid address {address!r}" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_a_data_directory_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    """It was "internal error: NotADirectoryError", exit 1, for any command."""
    (tmp_path / "a-file").write_text("")
    home = tmp_path / "a-file" / "home"
    runs = together(*(lambda args=args: run_pwctl(*args, env=base_env(home))
                      for args in (["island", "list"], ["up", "--listen", "127.0.0.1:9"])))
    for r in runs:  # `up` said "starting 1 island(s) ..." first: nothing starts
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr == f"error: cannot use {home} ($PATHWAYS_HOME) as the data directory: Not a directory\n"
        assert "internal error" not in r.stderr and "Traceback" not in r.stderr


def test_versions_are_compatible_within_a_minor_release() -> None:
    assert release("0.1.0") == (0, 1) and release("1.12.3rc1") == (1, 12) and release("dev") is None
    assert compatible("0.1.0", "0.1.7") and not compatible("0.1.0", "0.2.0") and not compatible("0.1.0", "")


OTHER_VERSION_CONTROLLER = textwrap.dedent("""
    import runpy, sys
    import server
    server.__version__ = "0.99.0"  # what a controller of another release reports
    sys.argv = ["server.controller", *sys.argv[1:]]
    runpy.run_module("server.controller", run_name="__main__")
""")


@pytest.mark.timeout(60)
def test_a_controller_of_another_version_is_refused_up_front(pw_home: Path, tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address)
    log = tmp_path / "controller.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-c", OTHER_VERSION_CONTROLLER, "--listen", address, "--db",
                                 f"sqlite:///{tmp_path / 'pw.db'}", "--metrics-listen", "off"],
                                env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    try:
        def answers() -> subprocess.CompletedProcess[str] | None:
            r = run_pwctl("server", "info", "-o", "json", env=env)
            return r if r.returncode == 0 else None

        info = wait_for(answers, 30, "the controller to answer")
        assert json.loads(info.stdout)["item"]["version"] == "0.99.0", log_tail(log)
        assert "warning: pwctl 0.1.0 does not talk to the controller" in info.stderr  # info shows, and warns

        r, skipped = together(lambda: run_pwctl("island", "list", env=env),
                              lambda: run_pwctl("island", "list", env={**env, "PWCTL_SKIP_VERSION_CHECK": "1"}))
        assert r.returncode == 4, r.stdout + r.stderr
        assert r.stderr.strip() == (
            f"error: pwctl 0.1.0 does not talk to the controller at {address}, which runs version 0.99.0: install "
            "the same version on both sides (pip install 'pathways==0.99.0'), or use the pwctl installed with the "
            "controller (PWCTL_SKIP_VERSION_CHECK=1 skips this check)")
        assert skipped.returncode == 0, skipped.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.timeout(120)
def test_down_stops_the_cluster_after_its_controller_and_a_worker_restarted(pw_home: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address)
    r = run_pwctl("up", "--islands", "2", "--devices", "1", "--listen", address, env=env, timeout=90)
    assert r.returncode == 0, r.stderr
    first = json.loads((pw_home / "cluster.json").read_text())
    pids: list[int] = []
    try:
        for args in (["server", "stop"], ["server", "start", "--listen", address], ["worker", "stop", "local-a"],
                     ["worker", "start", "--island", "a", "--devices", "1", "--name", "local-a"]):
            step = run_pwctl(*args, env=env, timeout=90)
            assert step.returncode == 0, f"{args}: {step.stderr}"
        controller = json.loads((pw_home / "server.pid").read_text())["pid"]
        worker = json.loads((pw_home / "workers" / "local-a.pid").read_text())["pid"]
        pids = [controller, worker, first["worker_pids"]["local-b"]]
        assert controller != first["controller_pid"] and worker != first["worker_pids"]["local-a"]
        assert all(local.is_alive(p) for p in pids)
        # `up` again after the restarts: it runs, and the restarted controller stays the cluster's
        again = run_pwctl("up", "--islands", "2", "--devices", "1", "--listen", address, env=env, timeout=90)
        assert again.returncode == 0 and again.stdout.startswith(f"already up at {address}"), again.stderr
        assert "not by `pwctl up`" not in again.stderr, again.stderr
        assert json.loads((pw_home / "cluster.json").read_text())["controller_pid"] == controller
    finally:
        down = run_pwctl("down", "-y", env=env, timeout=60)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == f"stopped 2 worker(s) and the controller (pid {controller})"
    assert not any(local.is_alive(p) for p in pids)
    assert run_pwctl("island", "list", env=env).returncode == 1  # nothing answers any more


@pytest.mark.timeout(120)
def test_up_starts_workers_with_its_own_token_when_the_environment_names_another(pw_home: Path) -> None:
    """A user whose shell carries another cluster's PWCTL_TOKEN: `pwctl up` must start workers
    that present this cluster's token (they used to take the environment's and be refused)."""
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address, PWCTL_TOKEN="the-token-of-some-other-cluster")
    try:
        r = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, env=env, timeout=90)
        assert r.returncode == 0, r.stderr
        token = (pw_home / "token").read_text().strip()
        assert token and token != env["PWCTL_TOKEN"]
        hosts = json.loads(run_pwctl("host", "list", "-o", "json", env={**env, "PWCTL_TOKEN": token}).stdout)
        assert [(h["name"], h["state"]) for h in hosts["items"]] == [("local-a", "ready")], hosts
        refused = run_pwctl("host", "list", env=env)  # the environment's token is still the caller's
        assert refused.returncode != 0 and "PWCTL_TOKEN" in refused.stderr, refused.stderr
        assert "$PWCTL_TOKEN is not this cluster's token" in r.stderr, r.stderr
    finally:
        down = run_pwctl("down", "-y", env=env, timeout=60)
    assert down.returncode == 0, down.stderr
    # `down` asked the controller to stop with this cluster's token (the environment's was
    # refused, and the controller was only terminated after waiting 10 s for it)
    log = (pw_home / "server.log").read_text()
    assert "shutdown requested by a caller" in log and "shutdown requested by SIGTERM" not in log, log[-2000:]


@pytest.mark.timeout(120)
def test_up_says_when_it_reuses_a_controller_it_did_not_start_and_down_leaves_it(pw_home: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address)
    assert run_pwctl("server", "start", "--listen", address, env=env, timeout=90).returncode == 0
    controller = json.loads((pw_home / "server.pid").read_text())["pid"]
    try:
        up = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, env=env, timeout=90)
        assert up.returncode == 0, up.stderr
        assert (f"the controller (pid {controller}) was started by `pwctl server start`, not by `pwctl up`: "
                "`pwctl down` leaves it running (`pwctl server stop` stops it)") in up.stderr
        worker = json.loads((pw_home / "cluster.json").read_text())["worker_pids"]["local-a"]
        down = run_pwctl("down", "-y", env=env, timeout=60)
        assert down.returncode == 0 and down.stdout.strip() == "stopped 1 worker(s)", down.stdout + down.stderr
        assert f"left the controller (pid {controller}) running: `pwctl up` did not start it" in down.stderr
        assert local.is_alive(controller) and not local.is_alive(worker)
    finally:
        stop = run_pwctl("server", "stop", env=env, timeout=60)
    assert stop.returncode == 0 and not local.is_alive(controller)


def _workers_of(home: Path) -> list[int]:
    """Pids of worker processes running with this data directory."""
    found = []
    for pid in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            cmd = (pid / "cmdline").read_bytes()
            env = (pid / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"server.worker" in cmd and f"PATHWAYS_HOME={home}".encode() in env:
            found.append(int(pid.name))
    return found


@pytest.mark.timeout(120)
def test_up_whose_controller_cannot_start_leaves_no_worker_behind(pw_home: Path) -> None:
    """The controller's port is taken: `up` fails saying so, and the worker it started beside the
    controller goes too (before, it stayed, retrying that address, with nothing recorded for
    `down`)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        env = base_env(pw_home, PWCTL_SERVER=address)
        r = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, "--no-token", env=env,
                      timeout=90)
        assert r.returncode != 0 and "the controller failed to start" in r.stderr, r.stderr
        assert "cannot listen on" in r.stderr, r.stderr
        assert _workers_of(pw_home) == []
        assert not (pw_home / "cluster.json").exists()


@pytest.mark.timeout(30)
def test_pwctl_finds_the_data_directorys_controller_while_it_runs(pw_home: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from pwctl import settings

    monkeypatch.delenv("PWCTL_SERVER", raising=False)
    pid_file = pw_home / "server.pid"
    pid_file.write_text(json.dumps({"pid": os.getpid(), "address": "0.0.0.0:7391"}))
    assert settings.resolve().address == "127.0.0.1:7391"  # a wildcard listen address is dialled at loopback
    assert settings.resolve("10.0.0.5:7070").address == "10.0.0.5:7070"  # a flag wins
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=30)
    pid_file.write_text(json.dumps({"pid": int(gone.stdout), "address": "127.0.0.1:7391"}))
    assert settings.resolve().address == "127.0.0.1:7070"  # a controller that is gone: the default
    pid_file.write_text("{")
    assert settings.resolve().address == "127.0.0.1:7070"


@pytest.mark.timeout(120)
def test_down_says_which_workers_it_left_running(pw_home: Path) -> None:
    """`down` stops only what `up` started: a worker `pwctl worker start` added to the cluster goes
    on (retrying a controller that is gone), and down now says so, with how to stop it."""
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home)  # no PWCTL_SERVER: `worker start` finds the cluster of this data directory
    try:
        r = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, env=env, timeout=90)
        assert r.returncode == 0, r.stderr
        r = run_pwctl("worker", "start", "--island", "c", "--devices", "1", "--name", "extra", env=env, timeout=90)
        assert r.returncode == 0, r.stderr
        extra = json.loads((pw_home / "workers" / "extra.pid").read_text())
        assert extra["server"] == address
    finally:
        down = run_pwctl("down", "-y", env=env, timeout=60)
    assert down.returncode == 0, down.stderr
    try:
        assert (f"left worker(s) extra (pid {extra['pid']}) running: `pwctl up` did not start them "
                "(`pwctl worker stop NAME` stops one)") in down.stderr, down.stderr
        assert "local-a" not in down.stderr and local.is_alive(extra["pid"])
    finally:
        stop = run_pwctl("worker", "stop", "extra", env=env, timeout=60)
    assert stop.returncode == 0 and not local.is_alive(extra["pid"]), stop.stderr


@pytest.mark.timeout(120)
def test_up_passes_no_bulk_links_to_the_controller_it_starts(pw_home: Path) -> None:
    """`pwctl up --no-bulk-links` starts the controller with --no-bulk-links, as `pwctl server start`
    does (test_cli_edges.py; what the flag does: test_proxy_bulk_paths.py); run again, it says
    what runs, leaves the controller as it is and does not say it starts anything; with one more
    island, it starts that island's worker alone and says so."""
    address = f"127.0.0.1:{free_port()}"
    env = base_env(pw_home, PWCTL_SERVER=address)

    def controller_args() -> list[str]:
        return list(psutil.Process(json.loads((pw_home / "server.pid").read_text())["pid"]).cmdline())

    try:
        r = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, "--no-bulk-links", env=env,
                      timeout=90)
        assert r.returncode == 0, r.stderr
        assert "--no-bulk-links" in controller_args()
        again = run_pwctl("up", "--islands", "1", "--devices", "1", "--listen", address, env=env, timeout=90)
        assert again.returncode == 0 and again.stdout.startswith("already up"), again.stdout + again.stderr
        assert "starting" not in again.stderr, again.stderr  # it said "starting 1 island(s) ..." all the same
        assert "--no-bulk-links" in controller_args()
        # one more island: only its worker starts, and it says so
        more = run_pwctl("up", "--islands", "2", "--devices", "1", "--listen", address, env=env, timeout=90)
        assert more.returncode == 0 and more.stdout.startswith(f"cluster up at {address}: 2 island(s)"), more.stderr
        assert more.stderr.startswith("starting worker(s) local-b (1 device(s) each) ...\n"), more.stderr
    finally:
        down = run_pwctl("down", "-y", env=env, timeout=60)
    assert down.returncode == 0, down.stderr
