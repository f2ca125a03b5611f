"""The pwctl CLI: registers one sub-app per noun and maps errors to exit codes (`run`; the entry
point, main.py, imports this module)."""

from __future__ import annotations

import os
import sys
import traceback

import typer

from ..errors import EXIT_FAILED, EXIT_USAGE, PathwaysError
from . import cluster, devices, islands, jobs, server, slices, status, worker

app = typer.Typer(
    name="pwctl",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    server: str | None = typer.Option(None, "--server", "-s", show_default=False,
                                      help="Controller address HOST:PORT for every command (as $PWCTL_SERVER; "
                                           "a subcommand's own --server wins)"),
    tls_ca: str | None = typer.Option(None, "--tls-ca", show_default=False,
                                      help="CA bundle (PEM) to check a TLS controller's certificate with "
                                           "(as $PWCTL_TLS_CA; default: config, the data directory's copy)"),
) -> None:
    """Pathways: run JAX programs on a shared cluster of accelerator islands.

    Exit codes: 0 ok, 1 failed, 2 usage, 3 not found, 4 rejected (capacity, conflict, auth),
    124 `wait --timeout` expired, 130 interrupted (Ctrl-C).
    """
    if debug:
        os.environ["PWCTL_DEBUG"] = "1"
    if server:
        os.environ["PWCTL_SERVER"] = server  # the same place in the precedence as the flag
    if tls_ca:
        os.environ["PWCTL_TLS_CA"] = tls_ca  # likewise (pwctl/settings.py)


for noun in (cluster, jobs, status, islands, devices, server, worker, slices):
    noun.register(app)  # one module per noun; the order is the help's


def run(argv: list[str] | None = None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv) or bool(os.environ.get("PWCTL_DEBUG"))
    try:
        rv = app(args=argv, standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except typer.TyperException as e:  # usage errors (exit 2) and other CLI errors
        show = getattr(e, "show", None)
        if callable(show):
            show()
        else:
            sys.stderr.write(f"error: {e.format_message()}\n")
        sys.exit(e.exit_code if e.exit_code else EXIT_USAGE)
    except PathwaysError as e:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"error: {e}\n")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if debug:
            raise
        sys.stderr.write(f"error: internal error: {type(e).__name__}: {e} (rerun with --debug for details)\n")
        sys.exit(EXIT_FAILED)
    sys.exit(rv if isinstance(rv, int) else 0)

