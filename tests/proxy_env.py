"""The environment of an unmodified JAX program run against the proxy service in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def plugin_path(tmp_path: Path) -> Path:
    """A dist-info declaring the `jax_plugins` entry point exactly as pyproject.toml does (the
    shared editable install may predate it), so JAX's own discovery finds the plugin."""
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["jax_plugins"]
    info = tmp_path / "site" / "pathways_proxy_entry-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pathways-proxy-entry\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[jax_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items())
    )
    return info.parent


def client_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "PWCTL_", "PATHWAYS_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(plugin_path(tmp_path))])
    env["PATHWAYS_HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


def proxy_env(cluster: Any, tmp_path: Path, **extra: str) -> dict[str, str]:
    """`client_env` of a program sent to `cluster`'s proxy service (a `LocalCluster`), with its token."""
    return client_env(tmp_path, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{cluster.address}",
                      PWCTL_TOKEN=cluster.token or "", **extra)


class Program:
    """An unmodified JAX program run as a subprocess that a test steps through, line by line:
    `line()` is its next line of output (failing with its stderr when it ended instead), `go()`
    lets it past its next `sys.stdin.readline()`, `finish()` closes its input, checks it exits 0
    and returns the rest of its output. Killed when the `with` block is left early."""

    def __init__(self, code: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def line(self) -> str:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out = self.proc.stdout.readline().strip()
        assert out, self.proc.stderr.read()[-3000:]
        return out

    def lines_within(self, n: int, seconds: float) -> list[str]:
        """Its next `n` lines, which must all come within `seconds` (a call that should end, on
        a worker that stopped answering: the reader is not left blocking the test)."""
        got: list[str] = []

        def read() -> None:
            for _ in range(n):
                got.append(self.line())

        reader = threading.Thread(target=read, daemon=True)  # ends with the program's output at the latest
        reader.start()
        reader.join(seconds)
        assert len(got) == n, f"after {seconds:g} s, the calls to the frozen worker still wait: only {got}"
        return got

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, send: str | None = None, timeout: float = 60) -> str:
        """Sends `send` (if any), closes the program's input; the rest of its output once it
        exited 0."""
        out, err = self.proc.communicate(send, timeout=timeout)
        assert self.proc.returncode == 0, f"exit status {self.proc.returncode}: {err[-3000:]}"
        return out


# Runs several independent programs in one Python process (one JAX import and one proxy session
# instead of one each): each in a fresh namespace, its output after a header line; an exception
# ends only its own program, recorded as a "FAILED" line with the traceback's last line, and the
# next program still runs. Each program's globals are dropped (its arrays freed) before the next.
_PARTS_RUNNER = """
import gc, json, sys, traceback
for name, code in json.loads(sys.argv[1]):
    print("\\x1epart " + name, flush=True)
    ns = {"__name__": "__main__"}
    try:
        exec(compile(code, "<" + name + ">", "exec"), ns)
    except BaseException as e:
        sys.stdout.flush()
        traceback.print_exc()
        why = (str(e).splitlines() or [""])[0]
        print("FAILED " + type(e).__name__ + (": " + why if why else ""))
    sys.stdout.flush()
    ns.clear()
    del ns
    gc.collect()
"""


def start_parts(parts: dict[str, str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Starts the programs `parts` (name -> code) in one process; `parts_output` reads them."""
    return subprocess.Popen([sys.executable, "-c", _PARTS_RUNNER, json.dumps(list(parts.items()))], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def parts_output(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, list[str]]:
    """Each program's lines (name -> lines) once the process started by `start_parts` exited 0;
    a program that raised ends with its "FAILED ..." line, so comparing its lines shows why."""
    out, err = proc.communicate(timeout=timeout)
    err = "\n".join(ln for ln in err.splitlines() if "insecure" not in ln)
    assert proc.returncode == 0, f"the programs' process exited {proc.returncode}:\n{err[-3000:]}"
    got: dict[str, list[str]] = {}
    lines: list[str] = []
    for ln in out.removesuffix("\n").split("\n"):  # not splitlines(): it splits at the \x1e of the header too
        if ln.startswith("\x1epart "):
            lines = got.setdefault(ln[len("\x1epart "):], [])
        else:
            lines.append(ln)
    for part in got.values():
        if part and part[-1].startswith("FAILED "):
            part.append(f"(stderr of the programs' process: {err[-2000:]})")
    return got


def run_parts(parts: dict[str, str], env: dict[str, str], timeout: float = 240) -> dict[str, list[str]]:
    """`start_parts` then `parts_output`: every program's lines, by name."""
    return parts_output(start_parts(parts, env), timeout)


def start_plain(code: str, env: dict[str, str], send: str = "") -> subprocess.Popen[str]:
    """Starts `code` (on plain JAX, say) with its whole input `send` given at once, to run while
    the test steps a `Program` through the proxy; `plain_lines` waits for its output."""
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(send)  # a few lines: the pipe takes them without a reader
    proc.stdin.close()
    proc.stdin = None  # given already: communicate() must not flush it
    return proc


def plain_lines(proc: subprocess.Popen[str], timeout: float = 120) -> list[str]:
    """The lines of a program started by `start_plain`, once it exited 0."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err[-3000:]
    return out.splitlines()
