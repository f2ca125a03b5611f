"""The pwctl CLI: registers one sub-app per noun and maps errors to exit codes (`run`; the entry
point, main.py, imports this module).

`app` is the whole CLI. `run` builds only the module of the command a command line names (Typer
builds every command it is given from its signature, ~50 ms for all of them, and each module's
import costs its share): `pwctl slice list` reads pwctl/cli/slices.py alone. A command line that
names no command of `COMMANDS` (`pwctl --help`, a typo, completion) gets the whole CLI, so the
root's help, suggestions and errors are as they were.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from types import ModuleType
from typing import TYPE_CHECKING, Any

import typer

from ..errors import EXIT_FAILED, EXIT_USAGE, PathwaysError
from .fastparams import FastGroup

# The top-level commands each module under pwctl/cli registers (`register(root)`); the modules'
# order is the help's. tests/test_cli_startup.py checks this against what they register.
COMMANDS: dict[str, tuple[str, ...]] = {
    "cluster": ("up", "down"),
    "jobs": ("submit", "logs", "cancel", "wait", "jobs", "job"),
    "status": ("status", "trace"),
    "islands": ("island",),
    "devices": ("device", "host"),
    "server": ("server",),
    "worker": ("worker",),
    "slices": ("slice",),
}
_MODULE_OF = {command: module for module, commands in COMMANDS.items() for command in commands}
_ROOT_VALUED = ("--server", "-s", "--tls-ca")  # _root's options that take a value

if TYPE_CHECKING:
    app: typer.Typer


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
        from ..settings import checked_address

        # the same place in the precedence as the flag; a bad one named as the flag it came from
        os.environ["PWCTL_SERVER"] = checked_address(server, "--server")
    if tls_ca:
        os.environ["PWCTL_TLS_CA"] = tls_ca  # likewise (pwctl/settings.py)


def make_app(modules: list[str]) -> typer.Typer:
    """The CLI with the commands of `modules` (names of COMMANDS)."""
    cli = typer.Typer(
        name="pwctl",
        cls=FastGroup,  # reads the command line without pydantic (fastparams.py)
        no_args_is_help=True,
        add_completion=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
    cli.callback()(_root)
    for name in modules:
        module: ModuleType = importlib.import_module(f"{__package__}.{name}")
        module.register(cli)
    return cli


def modules_for(args: list[str]) -> list[str]:
    """The modules a command line needs: the one whose command it names (after the root's own
    options), or all of them."""
    if any(k.startswith("_") and k.endswith("_COMPLETE") for k in os.environ):  # shell completion
        return list(COMMANDS)
    i = 0
    while i < len(args):
        a = args[i]
        if a in _ROOT_VALUED:
            i += 2
        elif a == "--debug" or a.startswith(("--server=", "--tls-ca=")) or (a.startswith("-s") and len(a) > 2):
            i += 1
        else:
            return [_MODULE_OF[a]] if a in _MODULE_OF else list(COMMANDS)
    return list(COMMANDS)


def __getattr__(name: str) -> Any:
    if name == "app":  # the whole CLI, built on first use (tests, documentation)
        globals()["app"] = make_app(list(COMMANDS))
        return globals()["app"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def one_line(message: str) -> str:
    """Click's message for a bad command line (`No such option: --bogus`, `Invalid value for
    '--islands': ...`, `Missing argument 'job_ids'.`) on one line: Click's own `show` puts the
    usage, a "Try --help" line and a blank line above it, and says "Error:"; pwctl prints only
    this, as `error: ...`, as it does its own errors."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _is_help(e: typer.TyperException) -> bool:
    """Whether `e` is Click's answer to a group given no command: its message is the help (Typer
    0.29 carries its own Click and does not export that error's class)."""
    ctx = getattr(e, "ctx", None)
    return ctx is not None and e.format_message() == ctx.get_help()


def run(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args or bool(os.environ.get("PWCTL_DEBUG"))
    modules = modules_for(args)
    cli = globals()["app"] if len(modules) == len(COMMANDS) and "app" in globals() else make_app(modules)
    try:
        rv = cli(args=argv, standalone_mode=False)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except typer.TyperException as e:  # usage errors (exit 2) and other CLI errors: one line, as pwctl's own
        if _is_help(e):  # `pwctl`, `pwctl jobs`: the help, as --help shows it (on stderr, exit 2)
            sys.stderr.write(e.format_message().rstrip("\n") + "\n")
        else:
            sys.stderr.write(f"error: {one_line(e.format_message())}\n")
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

