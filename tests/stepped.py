"""A `pw` program run as a subprocess that a test steps through: it prints one JSON object a line
and waits on its stdin where the test acts (freezes a worker, holds a relay's events, ...)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay import Relay


def start(env: dict[str, str], relay: Relay, program: str, *args: str) -> subprocess.Popen[str]:
    """`program` (Python source) as a subprocess whose pw session goes through `relay`, with
    `env` (a cluster's) and `args` as its argv."""
    env = {**env, "PWCTL_SERVER": relay.address}
    return subprocess.Popen([sys.executable, "-c", program, *args], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The program's next line, as JSON; fails with its stderr when it ended instead."""
    text = proc.stdout.readline() if proc.stdout else ""
    assert text, f"the program ended: {proc.stderr.read()[-3000:] if proc.stderr else ''}"
    return json.loads(text)


def say(proc: subprocess.Popen[str]) -> None:
    """Lets the program past its next `sys.stdin.readline()`."""
    assert proc.stdin is not None
    proc.stdin.write("\n")
    proc.stdin.flush()


def end(proc: subprocess.Popen[str], relay: Relay | None = None) -> None:
    """At a test's end, passed or not: the relay's held bytes go (the program is not left blocked
    on them), the program is killed if it still runs, and the relay closes."""
    if relay is not None:
        relay.release()
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    if relay is not None:
        relay.close()
