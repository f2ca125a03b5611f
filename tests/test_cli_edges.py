"""The CLI's rough edges (issue 30), as a user meets them: driver scripts by suffix, `wait
--timeout` and Ctrl-C exit codes, `--server` before the subcommand, an unknown island is
"not found" everywhere."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import typer
from conftest import REPO, LocalCluster, base_env, connected_to, popen_interruptible, wait_for
from together import together

from pwctl.errors import InvalidArgument
from schemas.pathways.v1 import controller_pb2 as cpb

SLEEPER = "import time\nprint('started', flush=True)\ntime.sleep(120)\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_sh_script_runs_with_bash_and_others_are_refused(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    sh = write(tmp_path, "run.sh", 'echo "bash ${BASH_VERSINFO[0]} args: $1 $2"\nexit 3\n')
    r = c.pwctl("submit", str(sh), "--", "one", "two")
    assert r.returncode == 3, r.stderr  # attached: the job's own code
    assert r.stdout.startswith("bash ") and "args: one two" in r.stdout, r.stdout
    txt = write(tmp_path, "notes.txt", "print('no')\n")
    r = c.pwctl("submit", str(txt))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ".py scripts with Python and .sh scripts with bash" in r.stderr and "wrap" in r.stderr
    # the server refuses it too, whoever calls
    with c.client() as client, pytest.raises(InvalidArgument, match=r"\.py \(Python\) or \.sh \(bash\)"):
        client.submit_job(cpb.SubmitJobRequest(entrypoint="notes.txt", script=b"print(1)\n"))


def test_wait_timeout_exits_124_and_ctrl_c_exits_130(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    r = c.pwctl("submit", str(write(tmp_path, "sleeper.py", SLEEPER)), "-d")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    try:
        r = c.pwctl("wait", job, "--timeout", "0.5")
        assert r.returncode == 124 and f"job {job} still" in r.stderr
        proc = popen_interruptible([sys.executable, "-m", "pwctl.cli.main", "wait", job], env=c.env(), cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            # interrupted while it waits (connected to the controller), not while Python still
            # imports it: a fixed pause raced the child's start on a loaded machine (a traceback,
            # exit -2, and no "goes on")
            wait_for(lambda: proc.poll() is not None or connected_to(proc.pid, c.port), 30,
                     "`pwctl wait` to reach the controller")
            assert proc.poll() is None, proc.communicate()[1]  # waiting, as asked
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 130, err
        assert "Traceback" not in err and f"job {job} goes on" in err
    finally:
        assert c.pwctl("cancel", job, "-y").returncode == 0
    described = c.pwctl("jobs", "describe", job)
    # the state once, not "cancelled (cancelled)": a reason shows only where it says more
    assert described.returncode == 0 and "\nstate:      cancelled\n" in described.stdout, described.stdout


def test_server_before_the_subcommand_and_unknown_islands(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    env = base_env(c.home)  # no PWCTL_SERVER: only the flag says where
    unknown = (["slice", "create", "--devices", "1", "--island", "nope"], ["host", "list", "--island", "nope"],
               ["device", "list", "--island", "nope"])
    # independent: a read and three refusals, run at once (tests/together.py)
    r, *refused = together(
        lambda: subprocess.run([sys.executable, "-m", "pwctl.cli.main", "--server", c.address, "island", "list",
                                "-o", "name"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60),
        *(lambda args=args: c.pwctl(*args) for args in unknown))
    assert r.returncode == 0 and r.stdout.split() == ["a", "b"], r.stderr
    for args, r in zip(unknown, refused, strict=True):
        assert r.returncode == 3, (args, r.returncode, r.stderr)
        assert "nope" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_server_start_checks_the_metrics_address(pw_home: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pwctl.cli.main", "server", "start", "--metrics-listen", "nowhere"],
                       env=base_env(pw_home), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--metrics-listen" in r.stderr and "invalid address 'nowhere'" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_large_working_dir_shows_progress_and_stops_at_the_limit(module_cluster: LocalCluster,
                                                                   tmp_path: Path) -> None:
    """`submit --working-dir` says what it zips before it starts (it printed nothing for a minute),
    stops as soon as the zip passes 50 MiB, and says how far it got."""
    from pwctl.cli.workdir import zip_working_dir

    wd = tmp_path / "big"
    wd.mkdir()
    for k in range(9):  # 63 MiB that do not compress
        (wd / f"blob{k}.bin").write_bytes(os.urandom(7 * 2**20))
    (wd / "main.py").write_text("print('never')\n")
    r = module_cluster.pwctl("submit", str(wd / "main.py"), "--working-dir", str(wd), "-d")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"zipping {wd}: 10 files, 63 MiB (at most 50 MiB zipped) ...", lines
    assert lines[1].startswith(f"error: --working-dir {wd} is over 50 MiB zipped after 56 of its 63 MiB"), lines
    assert len(lines) == 2 and r.stdout == ""

    seen: list[tuple[int, int]] = []
    small = tmp_path / "small"
    small.mkdir()
    for k in range(3):
        (small / f"f{k}.txt").write_text("x" * (k + 1) * 1000)
    zip_working_dir(small, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1000, 6000), (3000, 6000), (6000, 6000)]


@pytest.mark.timeout(60)
def test_ctrl_c_while_pwctl_starts_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C while pwctl is still importing its CLI (a few tenths of a second): it printed a
    traceback from the middle of an import. Interrupted once the CLI's imports are under way
    (`-X importtime` says when Typer is in), it exits 130 and prints nothing."""
    for module in ("pwctl.cli.main", "pwctl"):
        proc = popen_interruptible([sys.executable, "-X", "importtime", "-m", module, "--server", "127.0.0.1:9",
                                    "wait", "job-x"], env=base_env(tmp_path), cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
        assert proc.stderr is not None
        try:
            lines = []
            for line in proc.stderr:
                lines.append(line)
                if re.search(r"\|\s+typer$", line.rstrip()):
                    break
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert re.search(r"\|\s+typer$", lines[-1].rstrip()), lines[-5:]
        err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith("import time:"))
        assert proc.returncode == 130 and "Traceback" not in err, (module, proc.returncode, err)


# A sitecustomize for the CLI's process: the first dataclass that module INTERRUPT_IN builds gets a
# KeyboardInterrupt inside the string `exec` that makes its methods, as a Ctrl-C landing there does.
INTERRUPT_A_DATACLASS = """\
import builtins, os, sys
_exec = builtins.exec
def _interrupted(source, *args):
    caller = sys._getframe(1)
    while caller is not None and caller.f_globals.get("__name__") == "dataclasses":
        caller = caller.f_back
    if (isinstance(source, str) and "__create_fn__" in source and caller is not None
            and caller.f_globals.get("__name__") == os.environ["INTERRUPT_IN"]):
        builtins.exec = _exec
        sys.stderr.write("interrupting\\n")
        return _exec("raise KeyboardInterrupt", {})
    return _exec(source, *args)
builtins.exec = _interrupted
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["pwctl.cli.fastparams", "pwctl.settings"])
def test_ctrl_c_inside_a_dataclass_exec_still_exits_130(tmp_path: Path, where: str) -> None:
    """The flake of the test above under load, made certain: a Ctrl-C that lands while a dataclass
    builds its methods (a string `exec`) made `python -m pwctl` die by SIGINT (-2, nothing
    printed) although the CLI caught it and exited 130: CPython marks a KeyboardInterrupt that
    leaves a string `exec` as unhandled and, under `-m`, acts on the mark at exit (main.py).
    Once while the CLI imports (main.py catches it), once while the root options are read
    (pwctl/settings.py, imported by `--server`: app.run catches it)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(INTERRUPT_A_DATACLASS)
    env = base_env(tmp_path, INTERRUPT_IN=where)
    env["PYTHONPATH"] += os.pathsep + str(hook)
    runs = together(*(lambda module=module: subprocess.run(
        [sys.executable, "-m", module, "--server", "127.0.0.1:9", "wait", "job-x"], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=60) for module in ("pwctl", "pwctl.cli.main")))
    for r in runs:
        assert r.stderr.startswith("interrupting\n"), r.stderr  # the Ctrl-C came where meant
        assert r.returncode == 130 and "Traceback" not in r.stderr, (r.args, r.returncode, r.stderr)


def test_server_info_counts_every_job_not_only_running_ones(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    assert c.pwctl("submit", str(write(tmp_path, "quick.py", "print('hi')\n"))).returncode == 0  # ended
    listed_doc, info_doc, table_r, name_r = together(
        lambda: c.pwctl_json("jobs", "list", "--all"), lambda: c.pwctl_json("server", "info"),
        lambda: c.pwctl("server", "info"), lambda: c.pwctl("server", "info", "-o", "name"))
    # -o name names the controller by its address (it printed an empty line: a ServerInfo has no name)
    assert name_r.returncode == 0 and name_r.stdout == f"{info_doc['item']['address']}\n", name_r.stdout
    listed = listed_doc["items"]
    info = info_doc["item"]
    active = sum(j["state"] in ("pending", "running") for j in listed)
    assert info["jobs_total"] == len(listed) >= 1 and info["jobs"] == active < len(listed), (info, listed)
    assert info["policy"] == "fifo"
    table = table_r.stdout
    assert re.search(rf"^jobs\s+{len(listed)} \({active} pending or running\)\s*$", table, re.M), table
    assert re.search(r"^policy\s+fifo\s*$", table, re.M), table


@pytest.mark.timeout(60)
def test_server_start_passes_the_lost_host_ttl_and_trace_retention(pw_home: Path) -> None:
    """`pwctl server start` takes --lost-host-ttl (it was only the controller's flag) and
    --trace-retention; a bad value is one line naming the flag."""
    cases = (("--lost-host-ttl", "soon", "invalid duration 'soon'"),
             ("--trace-retention", "lots", "invalid size 'lots'"))
    runs = together(*(lambda flag=flag, value=value: subprocess.run(
        [sys.executable, "-m", "pwctl.cli.main", "server", "start", "--listen", "127.0.0.1:0", flag, value],
        env=base_env(pw_home), cwd=REPO, capture_output=True, text=True, timeout=60) for flag, value, _ in cases))
    for (flag, _, message), r in zip(cases, runs, strict=True):
        assert r.returncode == 2 and f"{flag}: {message}" in r.stderr, r.stderr  # a usage error
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        assert not (pw_home / "server.pid").exists()  # refused before anything started


def test_server_start_checks_the_relay_and_group_wait_settings(pw_home: Path) -> None:
    cases = (("--relay-group", "0"), ("--relay-min-hosts", "-1"), ("--group-wait", "0"))
    runs = together(*(lambda flag=flag, value=value: subprocess.run(
        [sys.executable, "-m", "pwctl.cli.main", "server", "start", flag, value],
        env=base_env(pw_home), cwd=REPO, capture_output=True, text=True, timeout=60) for flag, value in cases))
    for (flag, _), r in zip(cases, runs, strict=True):
        assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_numbers_past_the_apis_int32_are_one_line(pw_home: Path) -> None:
    """They were "internal error: ValueError: Value out of range", exit 1 (protobuf building the
    request); checked before anything is sent, so no controller is needed."""
    big = "3000000000"
    cases = ((["slice", "create", "--devices", big], f"--devices {big} is out of range"),
             (["slice", "create", "--mesh", "50000x50000"], "--mesh 50000x50000: its size 2500000000 is out of range"),
             (["slice", "create", "--devices", "2", "--mesh", f"{big}x1"], f"--mesh {big} is out of range"),
             (["slice", "create", "--mesh", "1x2", "--host-axis", big], f"--host-axis {big} is out of range"),
             (["logs", "job-1", "--tail", big], f"--tail {big} is out of range"),
             (["trace", "job-1", "--last", big], f"--last {big} is out of range"),
             (["status", "-o", "json", "--limit", big], f"--limit {big} is out of range"))
    env = base_env(pw_home, PWCTL_SERVER="127.0.0.1:9")  # nobody there: nothing may be sent
    runs = together(*(lambda args=args: subprocess.run([sys.executable, "-m", "pwctl.cli.main", *args], env=env,
                                                       cwd=REPO, capture_output=True, text=True, timeout=60)
                      for args, _ in cases))
    for (args, message), r in zip(cases, runs, strict=True):
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert r.stderr == f"error: {message}: at most 2,147,483,647\n", (args, r.stderr)
    # a --since so long ago it is before 1970 (its Unix ns went negative: the same ValueError)
    r = subprocess.run([sys.executable, "-m", "pwctl.cli.main", "trace", "job-1", "--since", "99999999999d"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "'99999999999d' ago is before 1970" in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_local_island_counts_and_watch_intervals_are_bounded(pw_home: Path) -> None:
    """`up --islands 99999999999` spent minutes naming islands before anything started, and
    `status --watch --interval 1e400` (infinity) never updated: both are refused at once, exit 2,
    with nothing started."""
    env = base_env(pw_home, PWCTL_SERVER="127.0.0.1:9")  # nobody there: nothing may be sent
    # (an address no controller can listen on: were the bound gone, `up` fails instead of starting one)
    nowhere = ["--listen", "192.0.2.1:7070"]
    cases = ((["up", "--islands", "99999999999", *nowhere], "--islands"),
             (["up", "--islands", "65", *nowhere], "--islands"),
             (["status", "--watch", "--interval", "1e400"], "--interval"))
    runs = together(*(lambda args=args: subprocess.run([sys.executable, "-m", "pwctl.cli.main", *args], env=env,
                                                       cwd=REPO, capture_output=True, text=True, timeout=60)
                      for args, _ in cases))
    for (args, flag), r in zip(cases, runs, strict=True):
        assert r.returncode == 2 and flag in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
    assert not (pw_home / "server.pid").exists()  # nothing started


@pytest.mark.timeout(60)
def test_priority_is_checked_in_the_controllers_range(pw_home: Path) -> None:
    """`submit --priority` past -1000..1000 said "at most 2,147,483,647" (the int32 check) and left
    the real range to the controller; both sides check the one constant (pwctl/limits.py)."""
    from pwctl.limits import MAX_PRIORITY
    from server.controller import errors
    from server.controller.job_files import validate_submit

    seed = str(REPO / "examples" / "seed_program.py")
    env = base_env(pw_home, PWCTL_SERVER="127.0.0.1:9")  # nobody there: nothing may be sent
    values = (MAX_PRIORITY + 1, -MAX_PRIORITY - 1, 3_000_000_000, MAX_PRIORITY, -MAX_PRIORITY)
    runs = together(*(lambda value=value: subprocess.run(
        [sys.executable, "-m", "pwctl.cli.main", "submit", seed, "--priority", str(value), "-d"], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=60) for value in values))
    for value, r in zip(values, runs, strict=True):
        if abs(value) > MAX_PRIORITY:
            assert r.returncode == 2, (value, r.returncode, r.stderr)
            assert r.stderr == f"error: --priority {value} is out of range: use -1000..1000\n", (value, r.stderr)
        else:  # accepted: on to the (absent) controller
            assert r.returncode == 1 and "cannot reach the server at 127.0.0.1:9" in r.stderr, (value, r.stderr)
    request = cpb.SubmitJobRequest(entrypoint="a.py", script=b"print(1)\n")
    for value in (MAX_PRIORITY, -MAX_PRIORITY):
        request.priority = value
        validate_submit(request)
    for value in (MAX_PRIORITY + 1, -MAX_PRIORITY - 1):
        request.priority = value
        with pytest.raises(errors.InvalidArgument) as info:
            validate_submit(request)
        assert str(info.value) == f"job priority {value} is out of range: use -1000..1000"  # a session's wording
    # a weight past the controller's range is refused by pwctl before anything is sent (nobody at
    # :9 to reach), in the controller's words, which validate_submit gives too
    weights = ("1e7", "inf", "nan")
    runs = together(*(lambda weight=weight: subprocess.run(
        [sys.executable, "-m", "pwctl.cli.main", "submit", seed, "--weight", weight, "-d"], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=60) for weight in weights))
    request.priority = 0
    for weight, r in zip(weights, runs, strict=True):
        said = f"job weight {float(weight):g} is out of range: use a number in (0, 1e+06]"
        assert (r.returncode, r.stderr) == (2, f"error: {said}\n"), (weight, r.returncode, r.stderr)
        request.weight = float(weight)
        with pytest.raises(errors.InvalidArgument) as info:
            validate_submit(request)
        assert str(info.value) == said


@pytest.mark.timeout(60)
def test_click_usage_errors_are_one_line(pw_home: Path) -> None:
    """Typer's own parse errors printed Click's usage line, a "Try --help" line, a blank line and
    "Error: ..." (exit 2): now one line in pwctl's form, naming the option, still exit 2; the help
    (asked for, or for a group given no command) is as it was."""
    env = base_env(pw_home, PWCTL_SERVER="127.0.0.1:9")  # nobody there: nothing may be sent
    seed = str(REPO / "examples" / "seed_program.py")
    cases = ((["up", "--bogus"], "No such option: --bogus"),
             (["cancel"], "Missing argument 'job_ids'."),
             (["slice", "create", "--devices", "abc"], "Invalid value for '--devices' / '-n': Input should be"),
             (["up", "--islands", "0"], "Invalid value for '--islands': Input should be greater than or equal to 1"),
             (["submit", seed, "--priority", "high"], "Invalid value for '--priority': "),
             (["up", "--devices", "abc"], "Invalid value for --devices: 'abc' is neither a positive number nor 'all'"),
             (["worker", "start", "--devices", "1"], "Missing option '--island' / '-i'."),
             (["jobs", "list", "-o", "yaml"], "Invalid value for '--output' / '-o': "),
             (["up", "--islands"], "Option '--islands' requires an argument."),
             (["bogus"], "No such command 'bogus'."))
    runs = together(*(lambda args=args: subprocess.run([sys.executable, "-m", "pwctl.cli.main", *args], env=env,
                                                       cwd=REPO, capture_output=True, text=True, timeout=60)
                      for args, _ in cases))
    for (args, message), r in zip(cases, runs, strict=True):
        assert r.returncode == 2 and r.stdout == "", (args, r.returncode, r.stdout, r.stderr)
        assert r.stderr.startswith(f"error: {message}") and r.stderr.count("\n") == 1, (args, r.stderr)
    helped, grouped = together(*(lambda args=args: subprocess.run(
        [sys.executable, "-m", "pwctl.cli.main", *args], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=60) for args in (["up", "--help"], ["island"])))
    assert helped.returncode == 0 and helped.stdout.startswith("Usage: ") and "--islands" in helped.stdout
    assert helped.stderr == "", helped.stderr
    assert grouped.returncode == 2 and grouped.stderr.startswith("Usage: ") and "list" in grouped.stderr


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, sub in getattr(group, "commands", {}).items():
        if getattr(sub, "commands", None):
            yield from _commands(sub, (*path, name))
        else:
            yield (*path, name), sub


@pytest.mark.timeout(30)
def test_no_command_gives_one_option_name_two_meanings() -> None:
    """`host list` and `device list` once gave `-s` to --state and to --server: `-s ready` dialled
    a server named 'ready', and the help listed both."""
    from pwctl.cli.app import app

    commands = list(_commands(typer.main.get_command(app)))
    assert len(commands) > 20, [p for p, _ in commands]
    for path, command in commands:
        names = [n for p in command.params for n in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))]
        assert len(names) == len(set(names)), (" ".join(path), sorted({n for n in names if names.count(n) > 1}))


@pytest.mark.timeout(90)
def test_server_start_passes_the_session_and_job_log_limits(pw_home: Path) -> None:
    """--session-grace, --job-log-max-mb, --max-sessions and --max-sessions-per-caller were only
    `python -m server.controller`'s flags, which the README names beside `pwctl server start`;
    so is --no-bulk-links."""
    def start(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pwctl.cli.main", "server", "start", "--listen", "127.0.0.1:0",
                               "--metrics-listen", "off", *args], env=base_env(pw_home), cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    bad = start("--max-sessions-per-caller", "0")
    assert bad.returncode == 2 and "--max-sessions-per-caller" in bad.stderr, bad.stderr
    assert not (pw_home / "server.pid").exists()
    limits = ("--session-grace", "7", "--job-log-max-mb", "3", "--max-sessions", "5", "--max-sessions-per-caller", "2")
    r = start(*limits, "--no-bulk-links")
    try:
        assert r.returncode == 0, r.stderr
        pid = json.loads((pw_home / "server.pid").read_text())["pid"]
        cmdline = psutil.Process(pid).cmdline()
        assert "--no-bulk-links" in cmdline, cmdline
        for flag, value in zip(limits[::2], limits[1::2], strict=True):
            assert cmdline[cmdline.index(flag) + 1] == value, cmdline
    finally:
        stop = subprocess.run([sys.executable, "-m", "pwctl.cli.main", "server", "stop"], env=base_env(pw_home),
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0, stop.stderr


def test_trace_by_a_prefix_names_the_whole_job_id(module_cluster: LocalCluster, tmp_path: Path) -> None:
    c = module_cluster
    r = c.pwctl("submit", str(REPO / "examples" / "seed_program.py"), "-d")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    assert c.pwctl("wait", job).returncode == 0
    out = tmp_path / "trace.json"
    r = c.pwctl("trace", job[:8], "-o", str(out))
    assert r.returncode == 0, r.stderr
    # it said "node runs of job job-0f" (the prefix given) rather than the job
    assert f"wrote {out}: 3 node runs of job {job} on " in r.stderr, r.stderr
    assert json.loads(out.read_text())["otherData"]["node_runs"] == 3
    # a path that cannot be written is the caller's mistake: one line, exit 2 (it was "internal
    # error: FileNotFoundError", exit 1); a directory in place of the file fails only at the write
    (tmp_path / "a-dir").mkdir()
    for bad, why in ((tmp_path / "no" / "such" / "t.json", f"no directory {tmp_path / 'no' / 'such'}"),
                     (tmp_path / "a-dir", "Is a directory")):
        r = c.pwctl("trace", job, "-o", str(bad))
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
        assert f"cannot write {bad}: {why}" in r.stderr and "internal error" not in r.stderr, r.stderr


def test_piped_tables_have_no_trailing_spaces(module_cluster: LocalCluster) -> None:
    """Rich pads every cell to its column's width, the last column's too: piped into a script or a
    diff, each row ended in spaces. Piped tables end where their text does (common.print_table)."""
    c = module_cluster
    created = c.pwctl("slice", "create", "trailing", "--devices", "1")
    assert created.returncode == 0, created.stderr
    try:
        for args in (["island", "list"], ["host", "list"], ["slice", "list"], ["slice", "describe", "trailing"],
                     ["server", "info"]):
            r = c.pwctl(*args)
            assert r.returncode == 0, (args, r.stderr)
            lines = r.stdout.splitlines()
            assert len(lines) >= 2, (args, r.stdout)
            padded = [line for line in lines if line != line.rstrip()]
            assert not padded, (args, padded)
    finally:
        c.pwctl("slice", "delete", "trailing", "-y")
