"""`pwctl` end to end against real local clusters: listing formats, `worker start|stop`, the
config file, `--debug`, and the options that only mean something together."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pwctl import local
from tests.conftest import LocalCluster, base_env, free_port, run_pwctl


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_listings_print_names_and_wide_columns(module_cluster: LocalCluster) -> None:
    lc = module_cluster
    r = lc.pwctl("island", "list", "-o", "name")
    assert r.returncode == 0 and r.stdout == "a\nb\n", r.stderr
    table, wide = lc.pwctl("island", "list"), lc.pwctl("island", "list", "-o", "wide")
    assert table.returncode == wide.returncode == 0
    assert "CREATED" not in table.stdout and "CREATED" in wide.stdout.splitlines()[0]
    created = [i["created_at"] for i in lc.pwctl_json("island", "list")["items"]]
    assert all(ts in wide.stdout for ts in created)

    devices = lc.pwctl_json("device", "list")["items"]
    r = lc.pwctl("device", "list", "-o", "name")
    assert r.returncode == 0 and r.stdout.split() == [str(d["id"]) for d in devices]
    wide = lc.pwctl("device", "list", "-o", "wide")
    assert wide.returncode == 0 and "LOCAL" in wide.stdout.splitlines()[0]
    assert "LOCAL" not in lc.pwctl("device", "list").stdout

    r = lc.pwctl("host", "list", "-o", "name")
    assert r.returncode == 0 and r.stdout.split() == ["w-a", "w-b"]
    wide = lc.pwctl("host", "list", "-o", "wide")
    assert wide.returncode == 0 and "PID" in wide.stdout.splitlines()[0]
    for name, w in lc.workers.items():
        row = next(line for line in wide.stdout.splitlines() if line.startswith(name))
        assert str(w.pid) in row.split()

    r = lc.pwctl("slice", "create", "cli", "--devices", "2", "--island", "a")
    assert r.returncode == 0, r.stderr
    try:
        r = lc.pwctl("slice", "list", "-o", "name")
        assert r.returncode == 0 and r.stdout == "cli\n"
        wide = lc.pwctl("slice", "list", "-o", "wide")
        header = wide.stdout.splitlines()[0]
        assert wide.returncode == 0 and "MAPPING" in header and "GENERATION" in header
        assert "MAPPING" not in lc.pwctl("slice", "list").stdout
    finally:
        assert lc.pwctl("slice", "delete", "cli", "-y").returncode == 0

    r = lc.pwctl("job", "list", "-o", "name")
    assert r.returncode == 0 and r.stdout == ""  # no jobs: nothing on stdout
    wide = lc.pwctl("job", "list", "-o", "wide")
    assert wide.returncode == 0 and "PROGRAMS" in wide.stdout and "PROGRAMS" not in lc.pwctl("job", "list").stdout


def test_debug_shows_the_traceback_and_without_it_one_line(module_cluster: LocalCluster) -> None:
    r = module_cluster.pwctl("slice", "describe", "nope")
    assert r.returncode == 3
    assert _one_line(r.stderr) == "error: no slice named 'nope' (see `pwctl slice list`)"
    r = module_cluster.pwctl("--debug", "slice", "describe", "nope")
    assert r.returncode == 3
    assert "Traceback (most recent call last)" in r.stderr and "pwctl/cli/" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: no slice named 'nope' (see `pwctl slice list`)"


def test_status_interval_needs_watch(module_cluster: LocalCluster) -> None:
    r = module_cluster.pwctl("status", "--interval", "2")
    assert r.returncode == 2 and "only with --watch" in r.stderr
    assert module_cluster.pwctl("status").returncode == 0


def _write_config(home: Path, **config: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.json").write_text(json.dumps(config))


def test_config_file_names_the_server_and_token(make_cluster: Callable[..., LocalCluster],
                                                tmp_path: Path) -> None:
    c = make_cluster(islands=1, devices=1)
    token = c.token
    assert token
    home = tmp_path / "elsewhere"  # a machine with neither the token file nor PWCTL_* set
    env = base_env(home)

    _write_config(home, server=c.address, token=token)
    r = run_pwctl("island", "list", "-o", "name", env=env)
    assert r.returncode == 0 and r.stdout == "a\n", r.stderr

    _write_config(home, server=c.address, token="not-the-token")
    r = run_pwctl("island", "list", env=env)
    assert r.returncode == 4 and "rejected" in _one_line(r.stderr)
    r = run_pwctl("island", "list", "-o", "name", env={**env, "PWCTL_TOKEN": token})  # the variable wins
    assert r.returncode == 0 and r.stdout == "a\n", r.stderr

    dead = f"127.0.0.1:{free_port()}"
    _write_config(home, server=dead, token=token)
    r = run_pwctl("island", "list", env=env)
    assert r.returncode == 1 and f"cannot reach the server at {dead}" in _one_line(r.stderr)
    for override in (["--server", c.address], []):  # the flag, then $PWCTL_SERVER, win over the file
        r = run_pwctl("island", "list", "-o", "name", *override,
                      env=env if override else {**env, "PWCTL_SERVER": c.address})
        assert r.returncode == 0 and r.stdout == "a\n", r.stderr


def test_worker_start_and_stop(make_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    c = make_cluster(islands=1, devices=1)
    home = tmp_path / "elsewhere"
    env = base_env(home)
    token = c.token
    assert token
    # the started worker gets the token from the config file too
    _write_config(home, server=c.address, token=token)
    pid = 0
    try:
        r = run_pwctl("worker", "start", "--island", "c", "--devices", "2", "--name", "w-c", env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("worker w-c started (pid ") and r.stdout.endswith(" on island c\n")
        pid = int(r.stdout.split("(pid ")[1].split(")")[0])
        assert local.runs_module(pid, local.WORKER_MODULE)
        assert json.loads((home / "workers" / "w-c.pid").read_text())["pid"] == pid

        r = run_pwctl("island", "list", "-o", "name", env=env)
        assert r.returncode == 0 and r.stdout == "a\nc\n", r.stderr
        hosts = {h["name"]: h for h in json.loads(run_pwctl("host", "list", "-o", "json", env=env).stdout)["items"]}
        assert hosts["w-c"]["pid"] == pid and hosts["w-c"]["state"] == "ready" and hosts["w-c"]["devices"] == 2

        r = run_pwctl("worker", "start", "--island", "c", "--devices", "1", "--name", "w-c", env=env)
        assert r.returncode == 4 and "already running" in _one_line(r.stderr)

        r = run_pwctl("worker", "stop", "w-c", env=env)
        assert r.returncode == 0 and r.stdout == f"worker w-c stopped (pid {pid})\n", r.stderr
        assert not local.is_alive(pid)
        assert not (home / "workers" / "w-c.pid").exists()
    finally:
        if pid and local.runs_module(pid, local.WORKER_MODULE):
            local.terminate([pid])

    r = run_pwctl("worker", "stop", "w-c", env=env)
    assert r.returncode == 3 and "no worker named 'w-c' is running" in _one_line(r.stderr)


@pytest.mark.parametrize("args, text", [
    (["--island", "c", "--devices", "0"], "--devices must be a positive number or 'all'"),
    (["--island", "c", "--devices", "2", "--name", "bad/name"], "invalid worker name"),
    (["--island", "c", "--devices", "2", "--server", "nowhere"], "invalid address 'nowhere'"),
])
def test_worker_start_refuses_bad_input(pw_home: Path, args: list[str], text: str) -> None:
    r = run_pwctl("worker", "start", *args, env=base_env(pw_home))
    assert r.returncode == 2 and text in _one_line(r.stderr)
    assert not (pw_home / "workers").exists() or not any((pw_home / "workers").iterdir())
