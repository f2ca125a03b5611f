"""A job's driver process: its command, its environment, its end, and its supervisor (jobsup.py)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pwctl import paths
from pwctl.settings import ENV_CA, ENV_CERT, ENV_KEY, ENV_SERVER_NAME
from pwctl.tls import TlsConfig

from ..credentials import JOB_SECRET_ENV
from . import jobsup

MEMORY_ENV = "PATHWAYS_JOB_MEMORY_MB"

# Sets the heap limit, then becomes the driver (argv: limit_bytes, python, entrypoint, args...).
_LIMIT_BOOT = (
    "import os, resource, sys\n"
    "n = int(sys.argv[1])\n"
    "resource.setrlimit(resource.RLIMIT_DATA, (n, n))\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def exit_reason(returncode: int) -> str:
    """A readable reason for a driver's exit status ('' for 0)."""
    if returncode == 0:
        return ""
    if returncode > 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGKILL:
        return f"killed by {name} (out of memory?)"
    return f"killed by {name}"


def pid_is_job(pid: int, job_id: str) -> bool:
    """True when /proc says `pid` is the driver of `job_id` (its environment names the job)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"PWCTL_JOB_ID={job_id}".encode() in env.split(b"\0")


def kill_group(pid: int, sig: int) -> None:
    if pid <= 0:
        return
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


INTERPRETERS = {".py": "python", ".sh": "bash"}  # what a driver script may be, by its suffix


def driver_command(entrypoint: str, args: list[str]) -> list[str]:
    """The driver's argv: `python entrypoint args` (`bash` for a .sh script), under a heap limit
    when MEMORY_ENV asks."""
    shell = entrypoint.endswith(".sh")
    cmd = [shutil.which("bash") or "/bin/bash" if shell else sys.executable, entrypoint, *args]
    limit_mb = os.environ.get(MEMORY_ENV, "").strip()
    if limit_mb.isdigit() and int(limit_mb) > 0:
        return [sys.executable, "-c", _LIMIT_BOOT, str(int(limit_mb) * 2**20), *cmd]
    return cmd


def driver_env(job_id: str, priority: int, weight: float, address: str, token: str | None,
               data_dir: Path, job_secret: str = "", tls: TlsConfig | None = None) -> dict[str, str]:
    """The driver's environment: this one without PWCTL_*, plus where and as whom to connect
    (the cluster token, and the job's secret that proves to the controller it is this job's driver;
    with TLS the CA that signs the controller's certificate, and where the controller requires
    client certificates the local clients' pair, or the controller's own, as the driver runs
    beside it as the same user)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PWCTL_")}
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    env.update(
        PWCTL_SERVER=f"{host}:{port}",
        PWCTL_JOB_ID=job_id,
        PWCTL_PRIORITY=str(priority),
        PWCTL_WEIGHT=repr(weight),
        PYTHONUNBUFFERED="1",
        PATHWAYS_HOME=str(data_dir),
    )
    if token:
        env["PWCTL_TOKEN"] = token
    if job_secret:
        env[JOB_SECRET_ENV] = job_secret
    if tls is not None and tls.ca:
        env[ENV_CA] = os.path.abspath(tls.ca)
        if tls.require_client_cert and tls.cert and tls.key:
            # the local clients' own pair where `pwctl up`/`server start` left one (pwctl/local/
            # tlsfiles.py), else the controller's (started otherwise: the driver runs beside it)
            cert, key = data_dir / paths.tls_client_cert_path().name, data_dir / paths.tls_client_key_path().name
            if not (cert.exists() and key.exists()):
                cert, key = Path(tls.cert), Path(tls.key)
            env[ENV_CERT], env[ENV_KEY] = os.path.abspath(cert), os.path.abspath(key)
        if tls.server_name:
            env[ENV_SERVER_NAME] = tls.server_name
    # `import pwctl` works in the driver even when the project is not installed
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([*parts, root])
    return env


# ---------------------------------------------------------------- the job's supervisor
JOBSUP = Path(__file__).with_name("jobsup.py")
START_TIMEOUT_S = 30.0
ADOPT_POLL_S = 0.5  # only where pidfd_open is missing


class SupervisorError(Exception):
    """The supervisor could not start the driver (the message says why)."""


@dataclass
class Supervisor:
    """A live job supervisor: its pid, start time (pid reuse), the driver's pid, a pidfd on it."""

    pid: int
    start: int
    driver_pid: int
    pidfd: int | None
    job_dir: Path

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            elif jobsup.start_time(self.pid) == self.start:
                os.kill(self.pid, sig)

    async def wait(self) -> None:
        """Until the supervisor exited (it wrote exit.json first unless it was killed)."""
        if self.pidfd is not None:
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[None] = loop.create_future()

            def readable() -> None:  # the pidfd reads as ready once the process exited
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(self.pidfd, readable)
            try:
                await exited
            finally:
                loop.remove_reader(self.pidfd)
                os.close(self.pidfd)
                self.pidfd = None
            with contextlib.suppress(ChildProcessError):  # ours to reap unless adopted
                os.waitpid(self.pid, os.WNOHANG)
        else:
            while lock_held(self.job_dir):
                await asyncio.sleep(ADOPT_POLL_S)


def _pidfd(pid: int, start: int) -> int | None:
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if jobsup.start_time(pid) != start:  # the pid was reused before we opened it
        os.close(fd)
        raise ProcessLookupError(pid)
    return fd


def lock_held(job_dir: Path) -> bool:
    """True while a supervisor of this job lives (it holds the lock file for its whole life)."""
    try:
        fd = os.open(job_dir / jobsup.LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops a lock we got
    return False


def _read_reply(fd: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data


async def start_supervisor(job_dir: Path, argv: list[str], env: dict[str, str], log_max_bytes: int,
                           grace: float) -> Supervisor:
    """Starts the job's supervisor in its own session; returns once it started the driver."""
    # -I: the supervisor needs only the standard library: neither this package's directory nor
    # the user's PYTHONPATH may shadow it (the driver still gets the whole environment)
    cmd = [sys.executable, "-I", str(JOBSUP), "--job-dir", str(job_dir), "--log-max-bytes", str(log_max_bytes),
           "--grace", repr(grace), "--", *argv]
    r, w = os.pipe()
    try:
        pid = os.posix_spawn(sys.executable, cmd, env, setsid=True, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, w, 1),
            (os.POSIX_SPAWN_OPEN, 2, str(job_dir / "supervisor.log"),
             os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
        ])
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    try:
        raw = await asyncio.to_thread(_read_reply, r, START_TIMEOUT_S)
    finally:
        os.close(r)
    try:
        reply = json.loads(raw)
    except ValueError:
        reply = {}
    if "driver_pid" not in reply:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        raise SupervisorError(str(reply.get("error") or "its supervisor did not start (see supervisor.log)"))
    return Supervisor(pid=pid, start=int(reply["start"]), driver_pid=int(reply["driver_pid"]),
                      pidfd=_pidfd(pid, int(reply["start"])), job_dir=job_dir)


def adopt(job_dir: Path) -> Supervisor | None:
    """The job's supervisor if it is still alive (a controller restarted), else None."""
    try:
        info = json.loads((job_dir / jobsup.INFO).read_text())
    except (OSError, ValueError):
        return None
    if not lock_held(job_dir):
        return None
    try:
        pidfd = _pidfd(int(info["pid"]), int(info["start"]))
    except ProcessLookupError:
        return None
    return Supervisor(pid=int(info["pid"]), start=int(info["start"]), driver_pid=int(info["driver_pid"]),
                      pidfd=pidfd, job_dir=job_dir)


def end_leftovers(job_dir: Path, driver_pid: int) -> int:
    """Ends what a job whose supervisor died left running: everything in the job's cgroup where
    the supervisor made one (a `setsid` grandchild included), else the driver's process group.
    Returns how many processes the cgroup held (0 without one)."""
    try:
        path = json.loads((job_dir / jobsup.INFO).read_text()).get("cgroup")
    except (OSError, ValueError, AttributeError):
        path = None
    killed = jobsup.kill_cgroup(Path(path)) if isinstance(path, str) and path else 0
    kill_group(driver_pid, signal.SIGKILL)
    return killed


def read_usage(job_dir: Path) -> dict[str, float]:
    """The job tree's resource use as its supervisor recorded it (cpu_s; memory_peak_bytes where
    the memory controller is on): empty without a cgroup."""
    try:
        doc = json.loads((job_dir / jobsup.EXIT).read_text())
        return {k: float(doc[k]) for k in ("cpu_s", "memory_peak_bytes") if k in doc}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def read_exit(job_dir: Path) -> tuple[int, bool, datetime | None] | None:
    """(the driver's exit code, whether it was cancelled, when it ended) as its supervisor recorded
    it, or None."""
    try:
        doc = json.loads((job_dir / jobsup.EXIT).read_text())
        ended = doc.get("ended_at")
        when = datetime.fromtimestamp(float(ended), UTC).replace(tzinfo=None) if ended else None
        return int(doc["code"]), bool(doc["cancelled"]), when
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return None


def end_all(jobs_dir: Path, grace: float = 10.0) -> int:
    """Ends every live job supervisor under `jobs_dir` (SIGTERM: each ends its tree), SIGKILL
    after `grace`; returns how many there were. For tearing a whole local cluster down (jobs
    outlive a controller by design)."""
    sups = [s for d in sorted(jobs_dir.glob("job-*")) if (s := adopt(d)) is not None]
    for s in sups:
        s.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(lock_held(s.job_dir) for s in sups) and time.monotonic() < deadline:
        time.sleep(0.05)
    for s in sups:
        if lock_held(s.job_dir):
            s.signal(signal.SIGKILL)
            end_leftovers(s.job_dir, s.driver_pid)
        if s.pidfd is not None:
            os.close(s.pidfd)
    return len(sups)
