"""`pwctl` starts light: reading the command line imports Typer and the command modules, not gRPC,
the protocol stubs, the pydantic views, Rich, `pwctl.local` (psutil) or platformdirs; each command imports
what it uses when it runs (pwctl/cli/common.py says why). `pwctl --help` then takes a fraction
of the time, and so does every one of the hundreds of pwctl calls the suite makes.

A command line also builds only the module of the command it names (pwctl/cli/app.py), and reads
its options without Typer's pydantic converters (pwctl/cli/fastparams.py): here too, what loads is
checked, not how long it takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from enum import Enum
from typing import Any, get_origin

import pytest
import typer
import typer.main
from conftest import REPO

pytestmark = pytest.mark.timeout(60)

HEAVY = ("grpc", "google.protobuf", "pydantic", "rich", "schemas", "psutil", "jax", "pwctl.local", "pwctl.client",
         "platformdirs")

LOADED = """
import json, sys
{setup}
print(json.dumps(sorted(m for m in sys.modules if m.startswith({heavy!r}))))
"""


RUN = """
from pwctl.cli.main import main
try:
    main({argv!r})
except SystemExit:
    pass
"""


def loaded(setup: str) -> list[str]:
    """The heavy modules (HEAVY and their submodules) loaded after running `setup` in a fresh Python."""
    heavy = tuple(h for m in HEAVY for h in (m, m + "."))
    code = LOADED.format(setup=setup, heavy=heavy)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    out: list[str] = json.loads(r.stdout.strip().splitlines()[-1])
    return [m for m in out if m in HEAVY or m.startswith(tuple(h + "." for h in HEAVY))]


def test_the_cli_loads_without_grpc_pydantic_rich_or_the_stubs() -> None:
    assert loaded("from pwctl.cli.app import app") == []


def test_help_builds_every_command_without_them() -> None:
    # --help builds every command from its signature, as any invocation does
    assert loaded(RUN.format(argv=["--help"])) == []


def test_a_command_loads_what_it_uses_when_it_runs() -> None:
    # the same check on a command that calls the controller (none listens at port 1: exit 1)
    found = loaded(RUN.format(argv=["slice", "list", "--server", "127.0.0.1:1"]))
    assert "grpc" in found and "pwctl.client" in found, found


@pytest.mark.parametrize("argv", [["slice", "list"], ["slice", "describe", "s"], ["island", "list", "-o", "json"],
                                  ["device", "list"], ["host", "list"], ["jobs", "list"], ["jobs", "describe", "j"],
                                  ["server", "info"], ["status"], ["status", "-o", "json"],
                                  ["status", "--watch", "-o", "json"], ["status", "--watch"]])
def test_a_listing_loads_its_views_once_the_controller_answered(argv: list[str]) -> None:
    # no controller at port 1: the call fails (exit 1) without loading pydantic for the views
    found = loaded(RUN.format(argv=[*argv, "--server", "127.0.0.1:1"]))
    assert "pwctl.client" in found and not [m for m in found if m.startswith(("pydantic", "schemas.views"))], found


MODULES = """
import json, sys
from pwctl.cli.main import main
try:
    main({argv!r})
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def modules_after(argv: list[str]) -> set[str]:
    """Every module loaded after running `pwctl ARGV` in a fresh Python (no server listens at port 1)."""
    code = MODULES.format(argv=argv)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PWCTL_SERVER": "127.0.0.1:1"})
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


NOUN_MODULES = {f"pwctl.cli.{m}" for m in ("cluster", "jobs", "status", "islands", "devices", "server", "worker",
                                           "slices")}


@pytest.mark.parametrize("argv", [["down", "--help"], ["slice", "list", "--help"], ["server", "stop", "--help"],
                                  ["--debug", "-s", "127.0.0.1:1", "slice", "create", "--help"]])
def test_reading_options_loads_no_pydantic(argv: list[str]) -> None:
    # Typer converts every option's value (defaults too) with a pydantic TypeAdapter it builds:
    # pwctl's own converters (pwctl/cli/fastparams.py) take the values it is sure of
    found = modules_after(argv)
    assert not {m for m in found if m.split(".")[0] == "pydantic" or m == "typer._adapters"}, argv


def test_a_command_builds_its_own_module_only() -> None:
    found = modules_after(["slice", "list", "-o", "json", "--owner", "x"])
    assert found & NOUN_MODULES == {"pwctl.cli.slices"}
    assert "typer._adapters" not in found  # the listing's views load pydantic, not Typer's adapters
    assert modules_after(["--help"]) >= NOUN_MODULES  # the root's help lists every command


def test_modules_for_finds_the_command_after_the_roots_options() -> None:
    from pwctl.cli.app import COMMANDS, modules_for

    every = list(COMMANDS)
    assert modules_for(["slice", "list"]) == ["slices"]
    assert modules_for(["--server", "h:1", "--tls-ca", "ca.pem", "--debug", "up"]) == ["cluster"]
    assert modules_for(["-sh:1", "--server=h:1", "--tls-ca=x", "job", "list"]) == ["jobs"]
    # no command named: the whole CLI (its help, "No such command", a missing value as before)
    for argv in ([], ["--help"], ["slcie", "list"], ["--server", "slice", "list"], ["--server"], ["--", "slice"],
                 ["--install-completion"], ["--debug=1", "slice"]):
        assert modules_for(argv) == every, argv


def test_each_module_registers_the_commands_listed_for_it() -> None:
    """app.COMMANDS says which module builds a command line's command: a command missing there only
    costs time (the whole CLI is built), one listed under the wrong module would not be found. Each
    command's help, from the one module, is the whole CLI's."""
    from pwctl.cli.app import COMMANDS, app, make_app

    full = typer.main.get_command(app)
    assert sorted(full.commands) == sorted(c for cs in COMMANDS.values() for c in cs)  # type: ignore[attr-defined]
    for module, names in COMMANDS.items():
        part = typer.main.get_command(make_app([module]))
        assert sorted(part.commands) == sorted(names), module  # type: ignore[attr-defined]
        for path, command in _tree(part):
            whole = _lookup(full, path)
            assert _help(command, path) == _help(whole, path), path


def _tree(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, sub in getattr(group, "commands", {}).items():
        yield (*path, name), sub
        yield from _tree(sub, (*path, name))


def _lookup(group: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        group = group.commands[name]
    return group


def _help(command: Any, path: tuple[str, ...]) -> str:
    return str(command.get_help(command.context_class(command, info_name=" ".join(("pwctl", *path)))))


# values on the fast converters' side of the line and past it, for each type pwctl's options have
SAMPLES: dict[str, list[Any]] = {
    "str": ["abc", "", " x ", "-1", 7, b"b"],
    "bool": [True, False, "true", "0", 1],
    "int": ["0", "7", "-3", "123456789012", "007", "+5", " 5", "5_0", "1e3", "abc", "", 5, -1, 2.0, True],
    "float": ["0", "0.5", "2", "-1.25", "007.5", "1e-3", "nan", "inf", ".5", "abc", 3, 2.5, 0.05, True],
    "list[str]": [("a", "b"), (), ["x"], ("a", 1)],
}


def test_the_fast_converters_agree_with_typers() -> None:
    """Each parameter's fast converter, on values it takes and values it leaves to Typer, gives what
    Typer's own pydantic converter gives: the same value, or the same error message."""
    from typer import _coercion

    from pwctl.cli.app import app
    from pwctl.cli.fastparams import FastParam, install

    command = typer.main.get_command(app)
    install(command)
    seen: set[str] = set()
    for path, sub in _tree(command):
        ctx = sub.context_class(sub, info_name=" ".join(path))
        for p in [*sub.params, sub.get_help_option(ctx)]:
            fast = getattr(p, "_runtime_param", None)
            if p is None or not isinstance(fast, FastParam):
                continue
            ann = p.type_descriptor.annotation
            if isinstance(ann, type) and issubclass(ann, Enum):
                kind, samples = "enum", [*ann, *(c.value for c in ann), *(c.value.upper() for c in ann), "bogus", ""]
            else:
                kind = str(ann) if get_origin(ann) else ann.__name__
                samples = SAMPLES[kind]
            seen.add(kind)
            own = _coercion.build_runtime_param(p.type_descriptor)
            for value in samples:
                assert _outcome(fast, value, p, ctx) == _outcome(own, value, p, ctx), (path, p.name, value)
    assert seen == {*SAMPLES, "enum"}, seen


def _outcome(runtime: Any, value: Any, param: Any, ctx: Any) -> tuple[str, Any]:
    try:
        out = runtime.coerce(value, param=param, ctx=ctx)
    except typer.BadParameter as e:
        return "error", e.format_message()
    return type(out).__name__, repr(out)  # repr: nan == nan


@pytest.mark.parametrize("argv", [["slice", "create", "-n", "4", "--mesh", "2x2", "--host-axis", "0", "-o", "JSON"],
                                  ["wait", "job-1", "--timeout", "0.5"], ["logs", "job-1", "--tail", "5"]])
def test_the_usual_values_need_no_typer_converter(argv: list[str]) -> None:
    # the commands fail (no server at port 1) after reading their options
    assert "typer._adapters" not in modules_after(argv)
