"""A job's supervisor: runs its driver as a whole process tree, apart from the controller's life.

`python -I jobsup.py --job-dir DIR --log-max-bytes N --grace S -- DRIVER ARGV...` (run by path, so
that it imports nothing beyond the standard library; its environment is the driver's). It

- holds `supervisor.lock` (flock) for as long as it lives: a controller that starts tells a live
  supervisor from a dead one by that lock, and signals it by pid + start time (`sup.json`);
- is a child subreaper (`PR_SET_CHILD_SUBREAPER`), so every descendant of the driver, a `setsid`
  grandchild included, stays its descendant when its parent dies; when the driver exits, whatever
  is left of the tree is killed (SIGKILL) and reaped;
- where the unified (v2) cgroup hierarchy is writable, moves itself into a cgroup of its own
  before it starts the driver (`Cgroup`), named in `sup.json`: the tree then cannot leave it, so
  a controller that finds the supervisor killed (an OOM kill, `kill -9`) still ends everything the
  job left (`kill_cgroup`), which the subreaper alone cannot do once it is dead; the tree's CPU
  time and, where the memory controller is on, peak memory go in `exit.json`;
- on SIGTERM (a cancel) sends SIGTERM to the whole tree, SIGKILL after the grace period;
- copies the tree's output (one pipe: stdout and stderr) to `output.log`, rotated at half of
  `--log-max-bytes` into `output.log.1`, so at most that many bytes are kept; what rotation
  dropped is counted in `log.json`;
- records the driver's exit status atomically in `exit.json`, then exits.

The first line of its stdout answers the controller that started it: JSON with its pid, start
time and the driver's pid, or an error; after that its stdout is /dev/null, so a controller that
dies takes nothing with it. Its own stderr (tracebacks only) is `supervisor.log`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import sys
import time
from pathlib import Path

LOCK = "supervisor.lock"
INFO = "sup.json"
EXIT = "exit.json"
LOG = "output.log"
LOG_OLD = "output.log.1"
LOG_STATE = "log.json"
CGROUP_PREFIX = "pathways-"  # a job's cgroup: pathways-<job id>-<supervisor pid>, beside the supervisor's own
PR_SET_CHILD_SUBREAPER = 36
CHUNK = 64 * 1024
DRAIN_S = 5.0  # after the tree is gone, output still buffered in the pipe is read for this long


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); 0 if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])


def write_json(path: Path, doc: dict[str, object]) -> None:
    """Writes atomically and durably: a temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def descendants(root: int) -> list[int]:
    """Every live descendant of `root`, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cgroup2_mount() -> tuple[Path, str] | None:
    """(mount point, the mount's root within the hierarchy) of the unified cgroup hierarchy:
    /sys/fs/cgroup on a v2 host, /sys/fs/cgroup/unified on a hybrid one; None without one."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if right.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return Path(fields[4]), fields[3]
    return None


def own_cgroup() -> Path | None:
    """The directory of this process's v2 cgroup, or None (no unified hierarchy, or ours is not
    under the mount, as in some containers)."""
    found = cgroup2_mount()
    if found is None:
        return None
    mount, root = found
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            rel = line[3:]
            if rel != root and not rel.startswith(root.rstrip("/") + "/"):
                return None
            return mount / rel[len(root.rstrip("/")):].lstrip("/")
    return None


class Cgroup:
    """The job's cgroup: a child of the supervisor's own, holding the supervisor and its tree."""

    def __init__(self, path: Path, home: Path) -> None:
        self.path = path
        self.home = home  # where the supervisor came from, and goes back to before removing it

    @classmethod
    def enter(cls, job_id: str) -> Cgroup | None:
        """Makes the cgroup and moves this process into it; None where that is not allowed."""
        home = own_cgroup()
        if home is None:
            return None
        path = home / f"{CGROUP_PREFIX}{job_id}-{os.getpid()}"
        try:
            path.mkdir()
        except OSError:
            return None
        try:
            (path / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return cls(path, home)

    def pids(self) -> list[int]:
        return cgroup_pids(self.path)

    def usage(self) -> dict[str, float]:
        """The tree's CPU seconds (cpu.stat exists with or without the cpu controller) and peak
        memory in bytes (memory.peak, only where the memory controller is enabled)."""
        out: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    out["cpu_s"] = int(value) / 1e6
        with contextlib.suppress(OSError, ValueError):
            out["memory_peak_bytes"] = int((self.path / "memory.peak").read_text())
        return out

    def leave(self) -> None:
        """Back into the cgroup it came from; the job's cgroup is removed once empty."""
        with contextlib.suppress(OSError):
            (self.home / "cgroup.procs").write_text(f"{os.getpid()}\n")
            self.path.rmdir()


def cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def kill_cgroup(path: Path) -> int:
    """SIGKILLs every process in a job's cgroup (`cgroup.kill` where the kernel has it, else each
    listed pid) and removes it once empty; returns how many processes were in it. For a
    controller whose job's supervisor is gone. A path that is not a job's cgroup is left alone."""
    found = cgroup2_mount()
    if found is None or not path.name.startswith(CGROUP_PREFIX) or not path.is_relative_to(found[0]) \
            or ".." in path.parts:
        return 0
    pids = cgroup_pids(path)
    if pids:
        try:
            (path / "cgroup.kill").write_text("1\n")
        except OSError:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        try:
            path.rmdir()  # fails (EBUSY) while a killed process has not exited
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.01)
    return len(pids)


def signal_tree(sig: int, cgroup: Cgroup | None = None) -> int:
    """Sends `sig` to every descendant, and to every other process of the job's cgroup; returns
    how many there were."""
    me = os.getpid()
    pids = set(descendants(me))
    if cgroup is not None:
        pids.update(p for p in cgroup.pids() if p != me)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return len(pids)


class Output:
    """The job's log: appends, rotates at `part` bytes, keeps one previous part."""

    def __init__(self, job_dir: Path, max_bytes: int) -> None:
        self.dir = job_dir
        self.part = max(1, max_bytes // 2)
        self.max_bytes = max_bytes
        self.fh = open(job_dir / LOG, "ab", buffering=0)  # noqa: SIM115 (open for the supervisor's life)
        self.size = self.fh.tell()
        self.dropped = 0

    def write(self, data: bytes) -> None:
        while data:
            room = self.part - self.size
            if len(data) <= room:
                self._write_all(data)
                return
            # rotate at a line's end where the part has one, so that parts start with a line
            cut = data.rfind(b"\n", 0, room) + 1 or room
            self._write_all(data[:cut])
            data = data[cut:]
            self.rotate()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = self.fh.write(view) or 0  # unbuffered: a reader sees every byte at once
            view = view[n:]
            self.size += n

    def rotate(self) -> None:
        self.fh.close()
        old = self.dir / LOG_OLD
        try:
            self.dropped += old.stat().st_size
        except FileNotFoundError:
            pass
        os.replace(self.dir / LOG, old)
        write_json(self.dir / LOG_STATE, {"dropped": self.dropped, "max_bytes": self.max_bytes})
        self.fh = open(self.dir / LOG, "ab", buffering=0)  # noqa: SIM115 (closed at the next rotation)
        self.size = 0

    def close(self) -> None:
        self.fh.close()


class Supervisor:
    def __init__(self, job_dir: Path, argv: list[str], log_max_bytes: int, grace: float,
                 cgroup: Cgroup | None = None) -> None:
        self.dir = job_dir
        self.cgroup = cgroup
        self.argv = argv
        self.grace = grace
        self.out = Output(job_dir, log_max_bytes)
        self.driver = 0
        self.status: int | None = None  # the driver's wait status once reaped
        self.term_at: float | None = None  # when a cancel's SIGTERM went out
        self.killed = False
        self.write_failed = False

    def spawn(self) -> int:
        r, w = os.pipe()
        self.pipe = r
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, w, 1),
            (os.POSIX_SPAWN_DUP2, w, 2),
        ]
        try:
            self.driver = os.posix_spawn(self.argv[0], self.argv, dict(os.environ),
                                         file_actions=actions, setsid=True)
        finally:
            os.close(w)
        return self.driver

    def on_term(self, signum: int, frame: object) -> None:
        if self.term_at is None:
            self.term_at = time.monotonic()
            signal_tree(signal.SIGTERM, self.cgroup)

    def write(self, data: bytes) -> None:
        try:
            self.out.write(data)
        except (OSError, ValueError) as e:  # a full disk loses output, not the job
            if self.out.fh.closed:  # a rotation failed half way
                with contextlib.suppress(OSError):
                    self.out.fh = open(self.dir / LOG, "ab", buffering=0)  # noqa: SIM115
                    self.out.size = self.out.fh.tell()
            if not self.write_failed:
                print(f"jobsup: writing the job's output failed, dropping it: {e}", file=sys.stderr, flush=True)
            self.write_failed = True
        else:
            self.write_failed = False

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.driver:
                self.status = status

    def run(self) -> int:
        """Copies output until the driver exited and the tree is gone; returns the driver's code."""
        fds = [self.pipe]
        tree_gone_at: float | None = None
        while True:
            if fds:
                ready, _, _ = select.select(fds, [], [], 0.2)
                if ready:
                    data = os.read(self.pipe, CHUNK)
                    if data:
                        self.write(data)
                    else:  # every writer closed the pipe
                        os.close(self.pipe)
                        fds = []
            else:
                time.sleep(0.2)
            self.reap()
            now = time.monotonic()
            if self.term_at is not None and not self.killed and now - self.term_at > self.grace:
                self.killed = True
                signal_tree(signal.SIGKILL, self.cgroup)
            if self.status is not None and tree_gone_at is None:
                # the driver ended: so does everything it left behind
                end = now + 10.0
                while signal_tree(signal.SIGKILL, self.cgroup) and time.monotonic() < end:
                    time.sleep(0.01)
                    self.reap()
                tree_gone_at = time.monotonic()
            if tree_gone_at is not None and (not fds or time.monotonic() - tree_gone_at > DRAIN_S):
                break
        self.out.close()
        assert self.status is not None
        return os.waitstatus_to_exitcode(self.status)


def main() -> None:
    p = argparse.ArgumentParser(prog="jobsup")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--log-max-bytes", type=int, required=True)
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("argv", nargs="+")
    ns = p.parse_args()
    job_dir = Path(ns.job_dir)
    reply = sys.stdout
    try:
        os.chdir(job_dir)  # the driver's working directory
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
        lock = os.open(job_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EBUSY, "another supervisor holds this job's lock") from None
        cgroup = Cgroup.enter(job_dir.name)  # before the driver: the whole tree is born inside it
        sup = Supervisor(job_dir, ns.argv, ns.log_max_bytes, ns.grace, cgroup)
        signal.signal(signal.SIGTERM, sup.on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        driver = sup.spawn()
        me = os.getpid()
        write_json(job_dir / INFO, {"pid": me, "start": start_time(me), "driver_pid": driver,
                                    "cgroup": str(cgroup.path) if cgroup else None})
    except OSError as e:
        reply.write(json.dumps({"error": str(e)}) + "\n")
        reply.flush()
        sys.exit(1)
    reply.write(json.dumps({"pid": me, "start": start_time(me), "driver_pid": driver}) + "\n")
    reply.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # the controller may go: nothing of ours may depend on its pipe
    os.close(null)
    code = sup.run()
    usage = cgroup.usage() if cgroup else {}
    if cgroup:
        cgroup.leave()
    write_json(job_dir / EXIT, {"code": code, "cancelled": sup.term_at is not None, "ended_at": time.time(),
                                **usage})


if __name__ == "__main__":
    main()
