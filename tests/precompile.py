"""This checkout's bytecode, compiled once per test session for the processes the suite starts.

Where the environment sets PYTHONDONTWRITEBYTECODE (this project's machines do), Python never
writes a `.pyc` for this checkout's modules (the installed packages have theirs), so every process
the suite starts (each of the hundreds of `pwctl` calls, each controller, worker and client
script) compiled pwctl/, server/ and schemas/ from source again: about 0.3 s of CPU for each
controller or worker start. The variable only stops Python from *writing* bytecode: compiled
here once (`compileall` writes it whatever the variable says, and skips files whose `.pyc` is
current), every process reads it. A stale `.pyc` is never used: Python checks it against the
source's modification time and size. `__pycache__/` is in .gitignore.
"""

from __future__ import annotations

import compileall
from pathlib import Path

PACKAGES = ("pwctl", "server", "schemas", "migrations", "bench", "tests")


def compile_checkout(root: Path) -> bool:
    """Compiles the Python files under `root`'s PACKAGES where their bytecode is missing or stale;
    False when one failed to compile (a syntax error: its test fails on its own, and says where)."""
    return all(compileall.compile_dir(root / name, quiet=2) for name in PACKAGES if (root / name).is_dir())
