"""`pwctl status --watch` in a real terminal: tmux at 80x24 and 160x45.

A real local cluster runs a job whose program has a gang on both islands; `pwctl status --watch`
runs inside a detached tmux session of a given size, and the tests read the screen back with
`tmux capture-pane -p` and assert what a person would see: the cluster line first, what each
device runs (never "-" while busy), the slice's registered programs, every table row on one
line, nothing past the bottom, and, with worker w-b frozen (SIGSTOP), the stuck gang in red
naming w-b and for how long.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import REPO, LocalCluster, wait_for

pytestmark = [
    # a window of 4 nodes in flight per island: the job's pipelined runs also wait (the queues' section)
    pytest.mark.cluster(islands=2, devices=2, controller_args=["--hang-timeout", "40", "--window", "4"],
                        heartbeat_timeout=60),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/test.sh installs it)"),
]

DRIVER = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np
    import pwctl as pw

    stop = Path(sys.argv[1])
    vs = pw.make_virtual_device_set()
    fa = pw.pmap(lambda x: x * 2.0, devices=vs.add_slice(devices=2, island="a").devices)
    fb = pw.pmap(lambda x: x + 1.0, devices=vs.add_slice(devices=2, island="b").devices)

    @pw.program
    def busy_step(x):
        return fb(fa(x))

    x = np.ones((2, 512), np.float32)
    busy_step(x).result()
    (stop.parent / "warm").write_text("ok")
    while not stop.exists():
        for _ in range(20):
            y = busy_step(x)
        y.result(timeout=120)
    print("done", flush=True)
""")


@pytest.fixture(scope="module")
def busy(module_cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, str]]:
    """The module's cluster with a job computing on both islands until the module ends."""
    work = tmp_path_factory.mktemp("busy-job")
    script = work / "busy_driver.py"
    script.write_text(DRIVER)
    stop = work / "stop"
    r = module_cluster.pwctl("submit", str(script), "-d", "--", str(stop))
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().splitlines()[-1]
    wait_for(lambda: (work / "warm").exists(), 50, "the job's program to warm up", interval=0.2)
    yield module_cluster, job
    stop.write_text("stop")
    module_cluster.pwctl("wait", job, "--timeout", "30")


class Tmux:
    """A private tmux server (its own socket) running one command in a detached session."""

    def __init__(self, socket: Path, width: int, height: int, command: list[str], env: dict[str, str]) -> None:
        self.base = ["tmux", "-S", str(socket)]
        # the terminal decides the size: no COLUMNS/LINES from the test's environment
        assignments = [f"{k}={v}" for k, v in env.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "TMUX")]
        line = "env -u COLUMNS -u LINES " + shlex.join([*assignments, *command]) + '; echo "exited $?"; sleep 60'
        subprocess.run([*self.base, "-f", "/dev/null", "new-session", "-d", "-s", "w", "-x", str(width),
                        "-y", str(height), line], check=True, timeout=10)
        self.width, self.height = width, height

    def screen(self, colours: bool = False) -> list[str]:
        """The screen's lines; with `colours`, with their escape sequences (SGR) as the terminal has them."""
        r = subprocess.run([*self.base, "capture-pane", "-p", *(["-e"] if colours else []), "-t", "w"],
                           capture_output=True, text=True, timeout=10, check=True)
        lines = r.stdout.split("\n")
        return lines[: self.height]

    def wait_screen(self, ok: Callable[[list[str]], bool], timeout: float, what: str) -> list[str]:
        last: list[list[str]] = [[]]

        def check() -> list[str] | None:
            last[0] = self.screen()
            return last[0] if ok(last[0]) else None

        try:
            return wait_for(check, timeout, what, interval=0.3)
        except TimeoutError as e:
            raise AssertionError(f"{e}; the screen:\n" + "\n".join(last[0])) from None

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "w", *keys], check=True, timeout=10)

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def tmux(tmp_path: Path) -> Iterator[Callable[..., Tmux]]:
    made: list[Tmux] = []

    def start(cluster: LocalCluster, width: int, height: int) -> Tmux:
        t = Tmux(tmp_path / f"tmux-{len(made)}.sock", width, height,
                 [sys.executable, "-m", "pwctl.cli.main", "status", "--watch", "--interval", "0.3"],
                 {k: v for k, v in cluster.env().items() if k in ("PATHWAYS_HOME", "PWCTL_SERVER")}
                 | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))})
        made.append(t)
        return t

    yield start
    for t in made:
        t.close()


def section(screen: list[str], header: str) -> list[str]:
    """The rows of the table whose header line starts with `header`, up to the next blank line."""
    start = next(i for i, line in enumerate(screen) if line.startswith(header))
    rows = []
    for line in screen[start + 1:]:
        if not line.strip() or line.startswith("..."):
            break
        rows.append(line)
    return rows


def shows_work(job: str) -> Callable[[list[str]], bool]:
    """The screen shows the busy job, and the whole frame is drawn. tmux parses what a program
    writes a few KiB at a time and answers `capture-pane` in between, so a capture can hold the
    top of a frame still being drawn over the bottom of the previous one (blank under the first
    frame): the check waits for the last sections the tests read, which are drawn last."""
    def ok(screen: list[str]) -> bool:
        text = "\n".join(screen)
        drawn = all(any(line.startswith(h) for line in screen) for h in ("ISLAND ", "HOST ", "JOB ", "SLICE "))
        return drawn and "computations/s" in text and "busy_step/" in text and job in text
    return ok


def queues_agree(screen: list[str]) -> bool:
    """Whether the islands' WAITING counts add up to the waiting gangs the queues' section lists
    (a row's RUNS in each of its islands, and its "... and N more"), as they do in one frame. A
    capture can hold the islands of a new frame over the queues of the previous one (shows_work):
    with 0 waiting at the top and the old waits below it (seen on a loaded machine), or the
    reverse; the two halves of one update always agree (server/controller/status_view.py)."""
    try:
        waiting = sum(int(row.split()[6]) for row in section(screen, "ISLAND "))
        rows = section(screen, "WAITING ")
        listed = sum(int(row.split()[4]) * len(row.split()[1].split(",")) for row in rows)
    except (ValueError, IndexError, StopIteration):  # a row torn mid-line
        return False
    end = next(i for i, line in enumerate(screen) if line.startswith("WAITING ")) + 1 + len(rows)
    more = re.match(r"\.\.\. and (\d+) more waiting gang", screen[end]) if end < len(screen) else None
    return waiting == listed + (int(more.group(1)) if more else 0)


def check_common(screen: list[str], width: int, address: str, job: str) -> None:
    assert len(screen) <= width and all(len(line) <= width for line in screen)
    assert screen[0].startswith(address) and "island" in screen[0], screen[0]  # the cluster line first
    text = "\n".join(screen)
    assert "computations/s" in text and "hosts 2/2 ready" in text
    # every device row is one line: it starts with a host name and ends with its JOB cell
    devices = section(screen, "HOST ")
    assert devices and all(re.match(r"w-[ab] +\d", row) for row in devices), devices
    busy_rows = [row for row in devices if "busy_step/" in row]
    assert busy_rows, devices
    for row in busy_rows:  # busy: what runs is named, with its job
        assert row.rstrip().endswith(job), row
        assert re.search(r"\d+%", row)
    for row in devices:
        util = int(re.search(r"(\d+)%", row).group(1))  # type: ignore[union-attr]
        if util > 0:
            assert " idle " not in row and not row.rstrip().endswith(" -  -"), row
    islands = section(screen, "ISLAND ")
    assert [row.split()[0] for row in islands] == ["a", "b"]
    jobs = section(screen, "JOB ")
    assert any(row.startswith(job) and "running" in row for row in jobs), jobs
    slices = section(screen, "SLICE ")
    assert len(slices) == 2 and all(int(row.split()[4]) >= 1 for row in slices), slices  # PROGRAMS


@pytest.mark.cluster
@pytest.mark.timeout(120)  # the module's job warms up in the first test's fixture
def test_watch_at_80x24(busy: tuple[LocalCluster, str], tmux: Callable[..., Tmux]) -> None:
    cluster, job = busy
    t = tmux(cluster, 80, 24)
    screen = t.wait_screen(shows_work(job), 40, "the screen to show the busy job")
    check_common(screen, 80, cluster.address, job)
    assert "POLICY" not in "\n".join(screen)  # the narrow layout
    # Ctrl-C leaves the full-screen view: the terminal is back as it was, no traceback
    t.keys("C-c")
    after = t.wait_screen(lambda s: any(line.startswith("exited ") for line in s), 20, "pwctl to exit")
    assert "exited 0" in after and "Traceback" not in "\n".join(after), after
    assert not any("computations/s" in line for line in after), after


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_watch_at_160x45(busy: tuple[LocalCluster, str], tmux: Callable[..., Tmux]) -> None:
    cluster, job = busy
    t = tmux(cluster, 160, 45)
    screen = t.wait_screen(shows_work(job), 40, "the screen to show the busy job")
    check_common(screen, 160, cluster.address, job)
    text = "\n".join(screen)
    assert "POLICY" in text and "(id " in text  # the wide layout: more columns
    assert screen[1] == ""  # room for blank lines between the sections
    # the queues: the island's waiting count and longest wait, then the longest waits, one row per
    # program, job and reason, with how many runs it stands for
    screen = t.wait_screen(lambda s: any(line.startswith("WAITING ") for line in s) and shows_work(job)(s)
                           and queues_agree(s), 40, "the job's waiting gangs on the screen, one frame's")
    check_common(screen, 160, cluster.address, job)
    header = next(i for i, line in enumerate(screen) if line.startswith("WAITING "))
    assert screen[header].split()[:7] == ["WAITING", "ISLAND", "PROGRAM", "JOB", "RUNS", "PRIORITY", "WHY"]
    waits = section(screen, "WAITING ")
    assert waits and all(re.match(r" *\d+(\.\d)?s +a(,b)? +busy_step +" + job + r" +\d+ +0 +\S", row)
                         for row in waits), waits
    assert not re.search(r"\d{12}", "\n".join(waits))  # no 64-bit run ids in the reasons
    islands = section(screen, "ISLAND ")
    assert any(int(row.split()[6]) > 0 and row.split()[7].endswith("s") for row in islands), islands  # WAITING, LONGEST


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_watch_shows_the_stuck_gang_and_its_host(busy: tuple[LocalCluster, str], tmux: Callable[..., Tmux]) -> None:
    cluster, job = busy
    t = tmux(cluster, 80, 24)
    t.wait_screen(shows_work(job), 40, "the screen to show the busy job")
    cluster.stop_worker("w-b")
    try:
        # the stall threshold is a quarter of the 40 s hang timeout, at most 5 s
        def stuck_drawn(s: list[str]) -> bool:  # the STUCK line and the one below it (a torn frame: shows_work)
            at = next((i for i, line in enumerate(s) if line.startswith("STUCK")), None)
            return at is not None and at + 1 < len(s) and "has not" in s[at + 1]

        screen = t.wait_screen(stuck_drawn, 25, "the stuck gang on the screen")
        stuck = next(i for i, line in enumerate(screen) if line.startswith("STUCK"))
        assert stuck <= 3, screen  # right below the cluster line (two lines at 80 columns, a blank one)
        line = screen[stuck]
        assert re.match(r"STUCK for \d+(\.\d)?s: host w-b holds back busy_step of " + job, line), line
        assert "has not" in screen[stuck + 1] and "w-b" in screen[stuck + 1], screen[stuck + 1]
        assert "1 stalled" in screen[0], screen[0]  # the cluster line counts it
        assert sum("STUCK" in row for row in screen) == 1, screen  # one gang over two islands: one entry
        assert len(screen) <= 24 and all(len(row) <= 80 for row in screen)
        # the stuck line in red (SGR 31)
        coloured = next(line for line in t.screen(colours=True) if "STUCK for" in line)
        assert re.search(r"\x1b\[(?:[0-9;]*;)?31m(?:\x1b\[[0-9;]*m)*STUCK for", coloured), repr(coloured)
    finally:
        cluster.cont_worker("w-b")
    t.wait_screen(lambda s: not any(line.startswith("STUCK") for line in s), 30, "the stuck gang to go")
