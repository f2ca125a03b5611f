"""Command-line values read without pydantic: the root group's class (`FastGroup`, app.py).

Typer 0.29 converts every parameter's value (a default included) through a pydantic TypeAdapter
it builds on first use (`typer._adapters`), so any command with an option, `pwctl down --help`
among them, imported pydantic and built adapters: ~0.1 s of a call that needs neither. Before the
command line is read, `FastGroup` gives each parameter of the types pwctl uses (str, int, float,
an enum's choices, a list of str) a converter that takes the values it is sure of, with the result
Typer's own would give: a str as it is, a plain decimal number within the option's bounds, a choice
as Typer matches it (`coerce_cli_choice`, which its adapter calls). Anything else goes to Typer's
own converter, built then, so a bad value gets Typer's message and exit code, word for word
(tests/test_cli_startup.py compares the two). Other types (paths, bool values that are not bools)
keep Typer's converter. Typer's internals change between releases: if these are not what this module
expects, it leaves every parameter alone (slower, never different).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, get_args, get_origin

import typer
from typer.core import TyperGroup

# The Typer releases whose internals this module was checked against (tests/test_cli_startup.py
# compares its converters with Typer's): any other keeps Typer's own converters, and those tests
# fail there until this module is checked against it and the release added.
CHECKED_TYPER = ("0.29",)

try:
    if ".".join(typer.__version__.split(".")[:2]) not in CHECKED_TYPER:
        raise ImportError(typer.__version__)
    from typer import _coercion
    from typer._param_types import coerce_cli_choice

    _Base: Any = _coercion.RuntimeParam
except (ImportError, AttributeError):  # another Typer: its own converters only
    _coercion = None  # type: ignore[assignment]
    _Base = object

INT = re.compile(r"-?(0|[1-9][0-9]*)")
FLOAT = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")


class _Miss(Exception):
    """A value the fast path is not sure of: Typer's own converter decides."""


def _in_bounds(number: Any, info: Any) -> Any:
    if (info.min is not None and number < info.min) or (info.max is not None and number > info.max):
        raise _Miss
    return number


def _int(value: Any, info: Any, ctx: Any) -> Any:
    if type(value) is int:
        return _in_bounds(value, info)
    if type(value) is str and INT.fullmatch(value):
        return _in_bounds(int(value), info)
    raise _Miss


def _float(value: Any, info: Any, ctx: Any) -> Any:
    if type(value) in (int, float):
        return _in_bounds(float(value), info)
    if type(value) is str and FLOAT.fullmatch(value):
        return _in_bounds(float(value), info)
    raise _Miss


def _str(value: Any, info: Any, ctx: Any) -> Any:
    if type(value) is str:
        return value
    raise _Miss


def _bool(value: Any, info: Any, ctx: Any) -> Any:
    if type(value) is bool:
        return value
    raise _Miss


def _strs(value: Any, info: Any, ctx: Any) -> Any:
    if isinstance(value, (list, tuple)) and all(type(v) is str for v in value):
        return list(value)
    raise _Miss


def _parser(annotation: Any, info: Any) -> Callable[[Any, Any, Any], Any] | None:
    """The fast converter for `annotation` (None: Typer's own only)."""
    if info.parser is not None or info.clamp:
        return None
    if annotation is str:
        return _str
    if annotation is bool:
        return _bool
    if annotation is int:
        return _int
    if annotation is float:
        return _float
    if get_origin(annotation) is list and get_args(annotation) == (str,):
        return _strs
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        choices, case_sensitive = tuple(annotation), info.case_sensitive

        def choice(value: Any, info: Any, ctx: Any) -> Any:
            try:
                return coerce_cli_choice(value, choices=choices, case_sensitive=case_sensitive, ctx=ctx)
            except ValueError:
                raise _Miss from None

        return choice
    return None


@dataclass(frozen=True)
class FastParam(_Base):
    """A parameter's converter: `parse` for the values it is sure of, Typer's own for the rest."""

    descriptor: Any
    parse: Callable[[Any, Any, Any], Any]

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            return self.parse(value, self.parameter_info, ctx)
        except _Miss:
            return _coercion.build_runtime_param(self.descriptor)._coerce_value(value, param=param, ctx=ctx)


def _params(command: Any, parent: Any = None) -> Iterator[Any]:
    """Every parameter under `command`, its --help option included: click makes that on first
    use (`get_help_option`, cached), from a context's option names, which come down from the
    parent's as they do when a command line is read."""
    yield from command.params
    if getattr(command, "_help_option", False) is None:
        ctx = command.context_class(command, parent=parent, **command.context_settings)
        help_option = command.get_help_option(ctx)
        if help_option is not None:
            yield help_option
    else:
        ctx = None
    for sub in getattr(command, "commands", {}).values():
        yield from _params(sub, ctx)


def install(command: Any) -> int:
    """Gives every parameter under `command` that has no converter yet a FastParam where its type has
    one; returns how many got one."""
    if _coercion is None:
        return 0
    count = 0
    for p in _params(command):
        desc = getattr(p, "type_descriptor", None)
        if desc is None or getattr(p, "_runtime_param", False) is not None or desc.file_annotation is not None:
            continue
        parse = _parser(desc.annotation, desc.parameter_info)
        if parse is not None:
            p._runtime_param = FastParam(parameter_info=desc.parameter_info, annotation=desc.annotation,
                                         descriptor=desc, parse=parse)
            count += 1
    return count


class FastGroup(TyperGroup):
    """The root group: installs the fast converters on the whole tree before reading a command line."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        install(self)
        return super().main(*args, **kwargs)
