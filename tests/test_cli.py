"""`pwctl` end to end against real local clusters: listing formats, `worker start|stop`, the
config file, `--debug`, and the options that only mean something together."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pwctl import local
from tests.conftest import LocalCluster, base_env, free_port, run_pwctl
from tests.together import together


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_listings_print_names_and_wide_columns(module_cluster: LocalCluster) -> None:
    lc = module_cluster
    # the listings of the unchanged cluster are independent reads: run at once (tests/together.py)
    (i_name, i_table, i_wide, i_json, d_json, d_name, d_wide, d_table, h_name, h_wide) = together(
        lambda: lc.pwctl("island", "list", "-o", "name"),
        lambda: lc.pwctl("island", "list"),
        lambda: lc.pwctl("island", "list", "-o", "wide"),
        lambda: lc.pwctl_json("island", "list"),
        lambda: lc.pwctl_json("device", "list"),
        lambda: lc.pwctl("device", "list", "-o", "name"),
        lambda: lc.pwctl("device", "list", "-o", "wide"),
        lambda: lc.pwctl("device", "list"),
        lambda: lc.pwctl("host", "list", "-o", "name"),
        lambda: lc.pwctl("host", "list", "-o", "wide"),
    )
    r = i_name
    assert r.returncode == 0 and r.stdout == "a\nb\n", r.stderr
    table, wide = i_table, i_wide
    assert table.returncode == wide.returncode == 0
    assert "CREATED" not in table.stdout and "CREATED" in wide.stdout.splitlines()[0]
    created = [i["created_at"] for i in i_json["items"]]
    assert all(ts in wide.stdout for ts in created)

    devices = d_json["items"]
    r = d_name
    assert r.returncode == 0 and r.stdout.split() == [str(d["id"]) for d in devices]
    wide = d_wide
    assert wide.returncode == 0 and "LOCAL" in wide.stdout.splitlines()[0]
    assert "LOCAL" not in d_table.stdout

    r = h_name
    assert r.returncode == 0 and r.stdout.split() == ["w-a", "w-b"]
    wide = h_wide
    assert wide.returncode == 0 and "PID" in wide.stdout.splitlines()[0]
    for name, w in lc.workers.items():
        row = next(line for line in wide.stdout.splitlines() if line.startswith(name))
        assert str(w.pid) in row.split()

    r = lc.pwctl("slice", "create", "cli", "--devices", "2", "--island", "a")
    assert r.returncode == 0, r.stderr
    try:
        r, wide, table = together(lambda: lc.pwctl("slice", "list", "-o", "name"),
                                  lambda: lc.pwctl("slice", "list", "-o", "wide"),
                                  lambda: lc.pwctl("slice", "list"))
        assert r.returncode == 0 and r.stdout == "cli\n"
        header = wide.stdout.splitlines()[0]
        assert wide.returncode == 0 and "MAPPING" in header and "GENERATION" in header
        assert "MAPPING" not in table.stdout
    finally:
        assert lc.pwctl("slice", "delete", "cli", "-y").returncode == 0

    r, wide, table = together(lambda: lc.pwctl("job", "list", "-o", "name"),
                              lambda: lc.pwctl("job", "list", "-o", "wide"),
                              lambda: lc.pwctl("job", "list"))
    assert r.returncode == 0 and r.stdout == ""  # no jobs: nothing on stdout
    assert wide.returncode == 0 and "PROGRAMS" in wide.stdout and "PROGRAMS" not in table.stdout


def test_debug_shows_the_traceback_and_without_it_one_line(module_cluster: LocalCluster) -> None:
    plain, debug = together(lambda: module_cluster.pwctl("slice", "describe", "nope"),
                            lambda: module_cluster.pwctl("--debug", "slice", "describe", "nope"))
    r = plain
    assert r.returncode == 3
    assert _one_line(r.stderr) == "error: no slice named 'nope' (see `pwctl slice list`)"
    r = debug
    assert r.returncode == 3
    assert "Traceback (most recent call last)" in r.stderr and "pwctl/cli/" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: no slice named 'nope' (see `pwctl slice list`)"


def test_status_interval_needs_watch(module_cluster: LocalCluster) -> None:
    r, plain = together(lambda: module_cluster.pwctl("status", "--interval", "2"),
                        lambda: module_cluster.pwctl("status"))
    assert r.returncode == 2 and "only with --watch" in r.stderr
    assert plain.returncode == 0


def _write_config(home: Path, **config: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.json").write_text(json.dumps(config))


def test_config_file_names_the_server_and_token(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    token = c.token
    assert token
    dead = f"127.0.0.1:{free_port()}"
    # one machine per config file, each with neither the token file nor PWCTL_* set, so that the
    # calls (independent reads) run at once (tests/together.py)
    env = {}
    for name, server, config_token in (("right", c.address, token), ("wrong", c.address, "not-the-token"),
                                       ("dead", dead, token)):
        _write_config(tmp_path / name, server=server, token=config_token)
        env[name] = base_env(tmp_path / name)
    right, wrong, variable, unreachable, flag, server_env = together(
        lambda: run_pwctl("island", "list", "-o", "name", env=env["right"]),
        lambda: run_pwctl("island", "list", env=env["wrong"]),
        lambda: run_pwctl("island", "list", "-o", "name", env={**env["wrong"], "PWCTL_TOKEN": token}),
        lambda: run_pwctl("island", "list", env=env["dead"]),
        # the flag, then $PWCTL_SERVER, win over the file
        lambda: run_pwctl("island", "list", "-o", "name", "--server", c.address, env=env["dead"]),
        lambda: run_pwctl("island", "list", "-o", "name", env={**env["dead"], "PWCTL_SERVER": c.address}),
    )
    assert right.returncode == 0 and right.stdout == "a\nb\n", right.stderr
    assert wrong.returncode == 4 and "rejected" in _one_line(wrong.stderr)
    assert variable.returncode == 0 and variable.stdout == "a\nb\n", variable.stderr  # the variable wins
    assert unreachable.returncode == 1 and f"cannot reach the server at {dead}" in _one_line(unreachable.stderr)
    for r in (flag, server_env):
        assert r.returncode == 0 and r.stdout == "a\nb\n", r.stderr


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

        r, host_list = together(lambda: run_pwctl("island", "list", "-o", "name", env=env),
                                lambda: run_pwctl("host", "list", "-o", "json", env=env))
        assert r.returncode == 0 and r.stdout == "a\nc\n", r.stderr
        hosts = {h["name"]: h for h in json.loads(host_list.stdout)["items"]}
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
