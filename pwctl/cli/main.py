"""The `pwctl` entry point (`pwctl.cli.main:main`, also `python -m pwctl.cli.main` and
`python -m pwctl`), light on purpose.

Importing the CLI (Typer, Rich, gRPC, the protocol stubs) takes a few tenths of a second, more on
a loaded machine; a Ctrl-C in that time would print a traceback from the middle of an import.
Here it exits 130 quietly, as a Ctrl-C while a command runs does (app.py).
"""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130  # pwctl.errors.EXIT_INTERRUPTED, without importing it


def main(argv: list[str] | None = None) -> None:
    try:
        from .app import run

        run(argv)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
