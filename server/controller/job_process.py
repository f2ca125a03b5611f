"""A job's driver process: its command, its environment, its end, and killing its group."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

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


def driver_command(entrypoint: str, args: list[str]) -> list[str]:
    """The driver's argv: `python entrypoint args`, under a heap limit when MEMORY_ENV asks."""
    cmd = [sys.executable, entrypoint, *args]
    limit_mb = os.environ.get(MEMORY_ENV, "").strip()
    if limit_mb.isdigit() and int(limit_mb) > 0:
        return [sys.executable, "-c", _LIMIT_BOOT, str(int(limit_mb) * 2**20), *cmd]
    return cmd


def driver_env(job_id: str, priority: int, weight: float, address: str, token: str | None,
               data_dir: Path) -> dict[str, str]:
    """The driver's environment: this one without PWCTL_*, plus where and as whom to connect."""
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
    # `import pwctl` works in the driver even when the project is not installed
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([*parts, root])
    return env
