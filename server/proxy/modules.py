"""A client's StableHLO program as a function the workers can compile like a `pw.jit` one.

A Compile carries an `xla::ifrt::XlaProgram` whose bytes are a StableHLO portable artifact: the
format `jax.export` keeps in `Exported.mlir_module_serialized`. So the controller reads the
argument and result types off the module (parsing only: it never compiles), wraps the artifact,
unchanged, in a `jax.export.Exported` and serializes that; the workers deserialize and compile it
exactly as they do every `pw.jit` function. The serialized bytes are deterministic for one
module, so the program registry's content hash (its function id) is the compile cache's key.

Supported: modules whose `main` takes and returns ranked tensors (no tokens, no shape
polymorphism, no host callbacks), on one device or partitioned over several (SPMD, jit over a
mesh, shard_map): the arguments' and results' `mhlo.sharding` become the export's HLO shardings,
which the workers place the arguments onto. A Shardy mesh with its own device order
(`device_ids`, what JAX compiles to reshard between meshes of the same devices in other orders)
is read exactly: its shardings are told to the client as HLO shardings over the program's
devices, and an argument whose sharding no mesh in device order can say is placed replicated
(XLA reshards it inside). A result the module gives no sharding is left to XLA's propagation
when the workers compile it at Compile time (`propagate`; cluster_backend.py asks them for it).
Replicated modules (pmap) are refused with UNIMPLEMENTED.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, fields
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
    in_shardings: tuple[bytes | None, ...]  # serialized xla.OpSharding per input (None: replicated)
    out_shardings: tuple[bytes | None, ...]
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


def _attr(attrs: Any, name: str) -> Any:
    return attrs[name] if name in attrs else None  # noqa: SIM401 (MLIR attribute maps have no get())


def _shardings(attrs: Any, count: int) -> tuple[str | None, ...]:
    """The `mhlo.sharding` text of each argument or result (None where there is none)."""
    from jax._src.lib.mlir import ir

    out: list[str | None] = [None] * count
    if attrs is None:
        return tuple(out)
    for i, d in enumerate(ir.ArrayAttr(attrs)):
        dic = ir.DictAttr(d)
        if "sdy.sharding" in dic:
            out[i] = str(dic["sdy.sharding"])
        elif "mhlo.sharding" in dic:
            out[i] = ir.StringAttr(dic["mhlo.sharding"]).value
    return tuple(out)


def _abstract_mesh(n: int) -> Any:
    """A mesh over `n` devices in order whose axes are n's prime factors: every HLO sharding over
    the devices in iota order (what jit over a mesh and shard_map produce) is a NamedSharding of it."""
    from jax.sharding import AbstractMesh

    sizes, rest, p = [], n, 2
    while rest > 1:
        while rest % p == 0:
            sizes.append(p)
            rest //= p
        p += 1
    sizes = sizes or [1]
    return AbstractMesh(tuple(sizes), tuple(f"_pw{i}" for i in range(len(sizes))))


def _named(hlo: Any, mesh: Any, ndim: int) -> Any:
    """The NamedSharding over `mesh` that is `hlo`; BackendError when there is none."""
    if hlo is None:
        return None
    from jax._src import sharding_impls
    from jax.sharding import NamedSharding, PartitionSpec

    if hlo.is_replicated():
        return NamedSharding(mesh, PartitionSpec(*([None] * ndim)))
    try:
        spec = sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0]
        named = NamedSharding(mesh, spec)
        ok = named._to_xla_hlo_sharding(ndim) == hlo
    except Exception:
        ok = False
    if not ok:
        raise BackendError("UNIMPLEMENTED", f"the sharding {hlo} (devices not in mesh order) is not supported by "
                           "the Pathways IFRT proxy server")
    return named


_SDY_PER_VALUE = re.compile(r"<@([\w.$-]+), \[(.*?)\]>")


def _returned_sharding(main: Any, i: int, in_text: tuple[str | None, ...]) -> str | None:
    """The sharding of result `i` that main does not annotate but the module still fixes: an
    argument returned as is, or a result of a shard_map (`sdy.manual_computation` out_shardings)."""
    from jax._src.lib.mlir import ir

    try:
        value = main.regions[0].blocks[0].operations[-1].operands[i]
        if isinstance(value, ir.BlockArgument):
            return in_text[value.arg_number]
        if not isinstance(value, ir.OpResult):
            return None
        result = value
        op = result.owner
        if op.name != "sdy.manual_computation":
            return None
        found = _SDY_PER_VALUE.findall(str(op.attributes["out_shardings"]))
        mesh, dims = found[result.result_number]
        return f"#sdy.sharding<@{mesh}, [{dims}]>"
    except Exception:  # anything else is left to XLA's propagation (made replicated)
        return None


_SDY_MESH = re.compile(r'"([^"]+)"=(\d+)')
_SDY_SHARDING = re.compile(r"#sdy\.sharding<@([\w.$-]+), \[(.*)\]>$")
_SDY_DEVICE_IDS = re.compile(r"device_ids=\[([\d, ]*)\]")


def _sdy_mesh(text: str) -> tuple[Any, tuple[int, ...] | None]:
    """(abstract mesh, its device order: positions in the program's devices, None for in order)."""
    from jax.sharding import AbstractMesh

    axes = _SDY_MESH.findall(text)
    mesh = AbstractMesh(tuple(int(n) for _, n in axes), tuple(a for a, _ in axes))
    ids = _SDY_DEVICE_IDS.search(text)
    if ids is None:
        return mesh, None
    order = tuple(int(x) for x in ids.group(1).replace(" ", "").split(",") if x)
    if sorted(order) != list(range(math.prod(mesh.axis_sizes))):
        raise BackendError("UNIMPLEMENTED", f"a mesh with device order {list(order)} ({text}) is not supported by "
                           "the Pathways IFRT proxy server")
    return mesh, None if order == tuple(range(len(order))) else order


def _reordered(hlo: Any, order: tuple[int, ...]) -> Any:
    """`hlo`, a sharding over a mesh's devices in mesh order, over the program's devices: mesh
    device k is program device order[k]."""
    from jax._src.lib import xla_client as xc

    if hlo.is_replicated():
        return hlo
    op = hlo.to_proto()
    tiles = [order[t] for t in hlo.tile_assignment_devices()]
    op.iota_reshape_dims, op.iota_transpose_perm, op.tile_assignment_devices = [], [], tiles
    return xc.HloSharding.from_proto(op)


def _sdy_named(text: str, meshes: dict[str, str]) -> tuple[str, Any]:
    """(mesh name, PartitionSpec) of an `sdy.sharding` attribute's text."""
    from jax.sharding import PartitionSpec

    m = _SDY_SHARDING.match(text)
    if m is None or m.group(1) not in meshes or ":" in m.group(2):
        raise BackendError("UNIMPLEMENTED", f"the sharding {text} is not supported by the Pathways IFRT proxy server")
    dims = []
    for dim in re.findall(r"\{([^}]*)\}", m.group(2)):
        names = tuple(n for n in re.findall(r'"([^"]+)"', dim))
        dims.append(None if not names else names[0] if len(names) == 1 else names)
    return m.group(1), PartitionSpec(*dims)


@dataclass(frozen=True)
class Shardings:
    """A module's argument and result shardings: as NamedShardings over one abstract mesh (what
    an export records and the workers place arrays with; None: unspecified), and exactly, as HLO
    shardings over the program's devices where the named ones cannot say them (a mesh with its
    own device order: its arguments are placed replicated, and XLA reshards them inside)."""

    in_named: tuple[Any, ...]
    out_named: tuple[Any, ...]
    in_exact: dict[int, Any]
    out_exact: dict[int, Any]


def _named_shardings(in_text: tuple[str | None, ...], out_text: tuple[str | None, ...], meshes: dict[str, str],
                     parts: int, inputs: tuple[ArraySpec, ...], outputs: tuple[ArraySpec, ...],
                     propagate: bool = False) -> Shardings:
    """The module's argument and result shardings (`Shardings`) over one abstract mesh (the
    module's own Shardy mesh, else one over the devices in order). On one device, all None. A
    result without a sharding is left to XLA's propagation (None) with `propagate`, which only a
    compile decides; else it is made replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    if parts == 1:
        return Shardings((None,) * len(inputs), (None,) * len(outputs), {}, {})
    used: set[str] = set()
    specs: list[tuple[str, Any] | None] = []
    for text in (*in_text, *out_text):
        if text is not None and text.startswith("#sdy.sharding"):
            name, spec = _sdy_named(text, meshes)
            if _SDY_MESH.search(meshes[name]) is None and "device_ids" not in meshes[name]:
                spec = PartitionSpec()  # a mesh without axes: replicated
            else:
                used.add(name)
            specs.append((name, spec))
        else:
            specs.append(None)
    own = {name: _sdy_mesh(meshes[name]) for name in used}
    for name, (m, _) in own.items():
        if math.prod(m.axis_sizes) != parts:
            raise BackendError("UNIMPLEMENTED", f"mesh {name} of {math.prod(m.axis_sizes)} devices in a module over "
                               f"{parts}")
    # one mesh in device order: the module's own (its axis names); several (an array moving from
    # one to another), or one with its own device order: each sharding as the same HLO sharding
    # over one mesh of the devices in order
    single = len(own) == 1 and next(iter(own.values()))[1] is None
    mesh = next(iter(own.values()))[0] if single else _abstract_mesh(parts)
    from jax._src.lib import xla_client as xc

    out: list[Any] = []
    exact: dict[int, Any] = {}

    def over_mesh(i: int, hlo: Any, ndim: int) -> None:
        try:
            out.append(_named(hlo, mesh, ndim))
        except BackendError:  # devices in an order no mesh in device order can say
            if i >= len(inputs) and not propagate:
                raise
            out.append(None)  # placed replicated (an argument) or as XLA compiles it (a result)
            exact[i] = hlo

    for i, (text, spec) in enumerate(zip((*in_text, *out_text), specs, strict=True)):
        ndim = len((*inputs, *outputs)[i].shape)
        if spec is not None and not single and spec[0] in used:
            amesh, order = own[spec[0]]
            hlo = NamedSharding(amesh, spec[1])._to_xla_hlo_sharding(ndim)
            over_mesh(i, hlo if order is None else _reordered(hlo, order), ndim)
        elif spec is not None:
            out.append(NamedSharding(mesh, spec[1]))
        elif text is not None:
            over_mesh(i, xc.HloSharding.from_string(text), ndim)
        elif i >= len(inputs) and not propagate:
            out.append(NamedSharding(mesh, PartitionSpec(*([None] * ndim))))
        else:
            out.append(None)
    n = len(inputs)
    return Shardings(tuple(out[:n]), tuple(out[n:]), {i: h for i, h in exact.items() if i < n},
                     {i - n: h for i, h in exact.items() if i >= n})


def describe(module: bytes, platform: str, suffix: str = "", propagate: bool = False) -> ModuleInfo:
    """Reads a StableHLO portable artifact and wraps it for the workers; BackendError if it cannot.
    `suffix` goes into the function's name (a variant of the same module gets other bytes).
    With `propagate`, a result the module gives no sharding gets the one XLA's propagation picks
    when the workers compile it (its `out_shardings` entry is then None: not known here);
    without, it is made replicated."""
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
            meshes = {ir.StringAttr(op.attributes["sym_name"]).value: str(op.attributes["mesh"])
                      for op in mod.body.operations if op.operation.name == "sdy.mesh"}
            main_attrs = main.attributes
            in_text = _shardings(_attr(main_attrs, "arg_attrs"), len(inputs))
            out_text = _shardings(_attr(main_attrs, "res_attrs"), len(outputs))
            out_text = tuple(t if t is not None else _returned_sharding(main, i, in_text)
                             for i, t in enumerate(out_text))
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
    try:
        shardings = _named_shardings(in_text, out_text, meshes, parts, inputs, outputs, propagate)
    except BackendError:
        raise
    except Exception as e:
        raise BackendError("INVALID_ARGUMENT", f"unreadable sharding in the module: {e}") from None
    in_named, out_named = shardings.in_named, shardings.out_named

    def hlo(named: Any, ndim: int) -> Any:
        return None if named is None else named._to_xla_hlo_sharding(ndim)

    in_hlo = tuple(hlo(n, len(a.shape)) for n, a in zip(in_named, inputs, strict=True))
    out_hlo = tuple(hlo(n, len(a.shape)) for n, a in zip(out_named, outputs, strict=True))

    def op(h: Any) -> bytes | None:
        return None if h is None or h.is_replicated() else bytes(h.to_proto().SerializeToString())

    # what the client is told: exact, also where the export places an argument replicated
    in_op = tuple(op(shardings.in_exact.get(i, h)) for i, h in enumerate(in_hlo))
    out_op = tuple(op(shardings.out_exact.get(j, h)) for j, h in enumerate(out_hlo))

    in_avals = tuple(core.ShapedArray(s.shape, jax.numpy.dtype(s.dtype)) for s in inputs)
    out_avals = tuple(core.ShapedArray(s.shape, jax.numpy.dtype(s.dtype)) for s in outputs)
    # jax 0.10 marks an export with named shardings (`_has_named_shardings`); 0.11 dropped the
    # field (every export has them) and rejects it
    has_marker = "_has_named_shardings" in {f.name for f in fields(jax.export.Exported)}
    marker = {"_has_named_shardings": True} if has_marker else {}
    exp = jax.export.Exported(
        fun_name=name + suffix,
        in_tree=jax.tree.structure((tuple(range(len(inputs))), {})),
        in_avals=in_avals,
        out_tree=jax.tree.structure(tuple(range(len(outputs)))),
        out_avals=out_avals,
        **marker,  # a None sharding: unspecified, as on one device
        _in_named_shardings=in_named,
        _out_named_shardings=out_named,
        in_shardings_hlo=in_hlo,
        out_shardings_hlo=out_hlo,
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
                      num_devices=parts * replicas, in_shardings=in_op, out_shardings=out_op, exported=exported,
                      function_id=hashlib.sha256(exported).hexdigest())
