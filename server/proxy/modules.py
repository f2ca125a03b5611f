"""A client's StableHLO program as a function the workers can compile like a `pw.jit` one.

A Compile carries an `xla::ifrt::XlaProgram` whose bytes are a StableHLO portable artifact: the
format `jax.export` keeps in `Exported.mlir_module_serialized`. So the controller reads the
argument and result types off the module (parsing only: it never compiles), wraps the artifact,
unchanged, in a `jax.export.Exported` and serializes that; the workers deserialize and compile it
exactly as they do every `pw.jit` function. The serialized bytes are deterministic for one
module, so the program registry's content hash (its function id) is the compile cache's key.

Supported: modules whose `main` takes and returns ranked tensors on one device (no tokens, no
shape polymorphism, no host callbacks); others are refused with UNIMPLEMENTED naming what.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from .backend import ArraySpec, BackendError

# MLIR element types -> numpy dtype names (what the workers' buffers and the client's DTypeProto use)
ELEMENT_TYPES = {
    "i1": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "ui8": "uint8", "ui16": "uint16", "ui32": "uint32", "ui64": "uint64",
    "f16": "float16", "f32": "float32", "f64": "float64", "bf16": "bfloat16",
    "complex<f32>": "complex64", "complex<f64>": "complex128",
}
DONOR_ATTRS = ("tf.aliasing_output", "jax.buffer_donor")
CALLING_CONVENTION = 9  # jax.export's current calling convention (no platform or token arguments)


@dataclass(frozen=True)
class ModuleInfo:
    """What the proxy needs to know of one client module, and the function the workers compile."""

    name: str
    inputs: tuple[ArraySpec, ...]
    outputs: tuple[ArraySpec, ...]
    donated: tuple[int, ...]  # input indices the module lets XLA reuse for outputs
    num_devices: int
    exported: bytes  # a serialized jax.export.Exported wrapping the module
    function_id: str  # sha256 of `exported`: the program registry's id for it

    @property
    def key(self) -> str:
        return self.function_id


def _spec(t: Any, what: str) -> ArraySpec:
    from jax._src.lib.mlir import ir

    try:
        rt = ir.RankedTensorType(t)
    except ValueError:
        raise BackendError("UNIMPLEMENTED", f"{what} of type {t} (only tensors are supported by the Pathways IFRT "
                           "proxy server: no tokens, no host callbacks)") from None
    dtype = ELEMENT_TYPES.get(str(rt.element_type))
    if dtype is None:
        raise BackendError("UNIMPLEMENTED", f"{what} of element type {rt.element_type}")
    if not rt.has_static_shape:
        raise BackendError("UNIMPLEMENTED", f"{what} with a dynamic shape {t}")
    return ArraySpec(dtype, tuple(int(d) for d in rt.shape))


def describe(module: bytes, platform: str) -> ModuleInfo:
    """Reads a StableHLO portable artifact and wraps it for the workers; BackendError if it cannot."""
    import jax
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib.mlir import ir

    try:
        with mlir.make_ir_context():
            mod = _jax.mlir.deserialize_portable_artifact(module)
            name = ir.StringAttr(mod.operation.attributes["sym_name"]).value if "sym_name" in \
                mod.operation.attributes else "proxy"
            attrs = mod.operation.attributes
            parts = ir.IntegerAttr(attrs["mhlo.num_partitions"]).value if "mhlo.num_partitions" in attrs else 1
            replicas = ir.IntegerAttr(attrs["mhlo.num_replicas"]).value if "mhlo.num_replicas" in attrs else 1
            main = next((op for op in mod.body.operations
                         if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main"),
                        None)
            if main is None:
                raise BackendError("INVALID_ARGUMENT", "the compiled module has no main function")
            ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
            inputs = tuple(_spec(t, f"argument {i}") for i, t in enumerate(ftype.inputs))
            outputs = tuple(_spec(t, f"result {i}") for i, t in enumerate(ftype.results))
            donated: list[int] = []
            if "arg_attrs" in main.attributes:
                for i, d in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"])):
                    if any(a in ir.DictAttr(d) for a in DONOR_ATTRS):
                        donated.append(i)
    except BackendError:
        raise
    except Exception as e:  # MLIR raises plain exceptions for bytes that are no module
        raise BackendError("INVALID_ARGUMENT", f"undecodable StableHLO program: {str(e).splitlines()[0]}") from None
    if replicas != 1:
        raise BackendError("UNIMPLEMENTED", f"a module with {replicas} replicas (pmap-style): use jit over a mesh")
    if parts != 1:
        raise BackendError("UNIMPLEMENTED", f"a module partitioned over {parts} devices (only single-device "
                           "programs are supported by the Pathways IFRT proxy server yet)")

    in_avals = tuple(core.ShapedArray(s.shape, jax.numpy.dtype(s.dtype)) for s in inputs)
    out_avals = tuple(core.ShapedArray(s.shape, jax.numpy.dtype(s.dtype)) for s in outputs)
    exp = jax.export.Exported(
        fun_name=name,
        in_tree=jax.tree.structure((tuple(range(len(inputs))), {})),
        in_avals=in_avals,
        out_tree=jax.tree.structure(tuple(range(len(outputs)))),
        out_avals=out_avals,
        _has_named_shardings=True,  # all None: unspecified, as for one device
        _in_named_shardings=(None,) * len(inputs),
        _out_named_shardings=(None,) * len(outputs),
        in_shardings_hlo=(None,) * len(inputs),
        out_shardings_hlo=(None,) * len(outputs),
        nr_devices=parts * replicas,
        platforms=(platform,),
        ordered_effects=(),
        unordered_effects=(),
        disabled_safety_checks=(),
        mlir_module_serialized=module,
        calling_convention_version=CALLING_CONVENTION,
        module_kept_var_idx=tuple(range(len(inputs))),
        uses_global_constants=False,
        _get_vjp=None,
    )
    exported = bytes(exp.serialize())
    return ModuleInfo(name=name, inputs=inputs, outputs=outputs, donated=tuple(donated),
                      num_devices=parts * replicas, exported=exported,
                      function_id=hashlib.sha256(exported).hexdigest())
