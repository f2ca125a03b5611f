"""Plain JAX's side of a benchmark in a process of its own (`python -m bench.jaxrun`), driven line by
line so that its timed windows alternate with Pathways'."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from typing import Any

from bench.cluster import REPO, XLA_FLAGS


class JaxServer:
    """A plain-JAX benchmark kept alive in its own process (`python -m bench.jaxrun TASK JSON`):
    it prints one JSON line when ready, then one per request line it reads from stdin, so that
    its timed windows can alternate with Pathways' (see bench_transformer)."""

    def __init__(self, env: dict[str, str], task: str, args: dict[str, Any]) -> None:
        env = {**env, "XLA_FLAGS": XLA_FLAGS}
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.jaxrun", task, json.dumps(args)],
            env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self._first: dict[str, Any] | None = None

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            self._err.seek(0)
            tail = self._err.read().decode(errors="replace")[-1500:]
            raise RuntimeError(f"bench.jaxrun exited {self.proc.returncode}: {tail}")
        out: dict[str, Any] = json.loads(line)
        return out

    def first(self) -> dict[str, Any]:
        """Its first line (waits for compilation and warm-up)."""
        if self._first is None:
            self._first = self._reply()
        return self._first

    def ask(self, request: str) -> dict[str, Any]:
        self.first()
        assert self.proc.stdin is not None
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()
