"""The `pwctl` entry point (`pwctl.cli.main:main`, also `python -m pwctl.cli.main` and
`python -m pwctl`), light on purpose.

Importing the CLI (Typer, Rich, gRPC, the protocol stubs) takes a few tenths of a second, more on
a loaded machine; a Ctrl-C in that time would print a traceback from the middle of an import.
Here it exits 130 quietly, as a Ctrl-C while a command runs does (app.py).
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


if __name__ == "__main__":
    main()
