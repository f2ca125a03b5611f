"""The `pwctl` entry point (`pwctl.cli.main:main`, also `python -m pwctl.cli.main` and
`python -m pwctl`), light on purpose.

Importing the CLI (Typer, Rich, gRPC, the protocol stubs) takes a few tenths of a second, more on
a loaded machine; a Ctrl-C in that time would print a traceback from the middle of an import.
Here it exits 130 quietly, as a Ctrl-C while a command runs does (app.py).

Under `python -m pwctl` (and `-m pwctl.cli.main`), CPython itself can turn that 130 into a death
by SIGINT (exit -2, nothing printed): a KeyboardInterrupt that leaves a string `exec`/`eval` (a
dataclass building its methods, as pwctl/cli/fastparams.py's does at import) marks the run as
"interrupted, unhandled" even when it is caught later, and `Py_RunMain` checks that mark after a
`-m` module's SystemExit (a script, the installed `pwctl`, goes through `Py_Exit` and never
does). Every string `exec` clears the mark as it starts, so `main` runs an empty one on the way
out (`_forget_interrupt`): whatever exit code the CLI chose is the process's.
"""

from __future__ import annotations

import os
import sys

EXIT_INTERRUPTED = 130  # pwctl.errors.EXIT_INTERRUPTED, without importing it
# gRPC's own log lines (a failed TLS handshake's, at INFO) would come before the one-line error;
# set before gRPC loads. Marked, so the controller and workers `pwctl` starts log as they would
# (pwctl/local/processes.py drops both).
QUIET_MARK = "PWCTL_QUIETED_GRPC"


def main(argv: list[str] | None = None) -> None:
    if "GRPC_VERBOSITY" not in os.environ:
        os.environ["GRPC_VERBOSITY"] = "ERROR"
        os.environ[QUIET_MARK] = "1"
    try:
        from .app import run

        run(argv)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    finally:
        _forget_interrupt()


def _forget_interrupt() -> None:
    """Clear CPython's mark of an unhandled KeyboardInterrupt (module docstring): every
    KeyboardInterrupt that reached here was handled, since `main` is leaving with an exit code.
    An empty string `exec` resets the mark as it starts and, raising nothing, leaves it clear."""
    exec("pass", {})  # a constant string: the reset is the point


if __name__ == "__main__":
    main()
