"""Pathways client: the `pw` API user programs import (`import pwctl as pw`), the typed
client library (`pwctl.client`) and the `pwctl` CLI (`pwctl.cli`).

The `pw` names load lazily so the CLI starts without importing JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Future",
    "PathwaysError",
    "ProgramError",
    "VirtualDevice",
    "VirtualMesh",
    "VirtualSlice",
    "block_until_ready",
    "jit",
    "make_virtual_device_set",
    "pmap",
    "program",
]

_LAZY = {
    "Future": "pwctl.api.futures",
    "VirtualDevice": "pwctl.api.devices",
    "VirtualMesh": "pwctl.api.devices",
    "VirtualSlice": "pwctl.api.devices",
    "make_virtual_device_set": "pwctl.api.devices",
    "block_until_ready": "pwctl.api.futures",
    "jit": "pwctl.api.functions",
    "pmap": "pwctl.api.functions",
    "program": "pwctl.api.programs",
    "PathwaysError": "pwctl.errors",
    "ProgramError": "pwctl.errors",
}

if TYPE_CHECKING:
    from .api.devices import VirtualDevice, VirtualMesh, VirtualSlice, make_virtual_device_set
    from .api.functions import jit, pmap
    from .api.futures import Future, block_until_ready
    from .api.programs import program
    from .errors import PathwaysError, ProgramError


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pwctl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
