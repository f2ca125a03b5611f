"""The controller's side of a proxy Compile, without a cluster: a client's StableHLO (as
`jax.jit(...).lower` makes it, the bytes the jaxlib client sends) becomes a `jax.export` function
that computes what the jitted function computes; its compile options name its devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.export._export import _module_to_bytecode
from proxy_env import REPO

from server.proxy import protocol as proto_mod
from server.proxy.backend import ArraySpec, BackendError
from server.proxy.executables import compile_options, device_ids
from server.proxy.handles import HandleError
from server.proxy.modules import describe


def portable(f: object, *args: object, **jit_args: object) -> bytes:
    lowered = jax.jit(f, **jit_args).lower(*args)  # type: ignore[call-overload]
    return bytes(_module_to_bytecode(lowered.compiler_ir("stablehlo")))


def test_a_module_becomes_a_function_the_workers_run() -> None:
    def step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return w - 0.1 * x * w, (x * w).sum()

    w, x = jnp.arange(3.0, dtype=jnp.float32), jnp.ones(3, jnp.bfloat16).astype(jnp.float32)
    module = portable(step, w, x, donate_argnums=0)
    info = describe(module, "cpu")
    assert info.inputs == (ArraySpec("float32", (3,)), ArraySpec("float32", (3,)))
    assert info.outputs == (ArraySpec("float32", (3,)), ArraySpec("float32", ()))
    assert info.donated == (0,)
    assert info.num_devices == 1
    assert describe(module, "cpu").function_id == info.function_id  # one id per content: the cache key
    exp = jax.export.deserialize(bytearray(info.exported))
    got = exp.call(w, x)
    want = jax.jit(step)(w, x)
    assert [np.asarray(g).tolist() for g in got] == [np.asarray(v).tolist() for v in want]


def test_modules_the_server_cannot_take_are_refused_in_one_line() -> None:
    with pytest.raises(BackendError) as e:
        describe(b"not a module", "cpu")
    assert e.value.code == "INVALID_ARGUMENT" and "\n" not in str(e.value)
    assert str(e.value).startswith("undecodable StableHLO program")


def test_compile_options_name_the_devices() -> None:
    P = proto_mod.protocol()
    opts = P.cls("xla.CompileOptionsProto")()
    assignment = opts.executable_build_options.device_assignment
    assignment.replica_count, assignment.computation_count = 1, 2
    for d in (2, 3):
        assignment.computation_devices.add().replica_device_ids.append(d)
    inner = opts.SerializeToString()
    size = len(inner)
    varint = bytearray()
    while True:
        varint.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            break
    data = b"\x0a" + bytes(varint) + inner  # XlaCompileOptions: the CompileOptionsProto is field 1
    assert device_ids(compile_options(data, P), 4) == (2, 3)
    with pytest.raises(HandleError) as many:  # more devices than the session has
        device_ids(compile_options(data, P), 1)
    assert many.value.code == "INVALID_ARGUMENT" and "at most 1" in str(many.value), str(many.value)
    with pytest.raises(HandleError) as e:
        compile_options(b"\x0a\x05ab", P)
    assert e.value.code == "INVALID_ARGUMENT"


NO_BACKEND = """
import sys
from server.proxy.modules import describe
info = describe(open(sys.argv[1], "rb").read(), "cpu")
from jax._src import xla_bridge
print(info.name, len(xla_bridge._backends))
"""


def test_the_controller_side_never_starts_a_backend(tmp_path: Path) -> None:
    """Control plane only: reading and wrapping a module starts no XLA backend (nothing compiles)."""
    module = tmp_path / "module.bin"
    module.write_bytes(portable(lambda x: x * 2, jnp.ones(2)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run([sys.executable, "-c", NO_BACKEND, str(module)], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["jit__lambda", "0"]


REORDERED = """
import numpy as np, jax
from jax._src import dispatch
from jax._src.lib import xla_client as xc
from jax._src.export._export import _module_to_bytecode
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
from server.proxy.modules import describe
from server.worker.executable import Executable
devs = jax.devices()
rev = Mesh(np.array(devs[::-1]), ("r",))
x = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(4, 4), NamedSharding(rev, P("r")))
for name, order in (("transposed", [3, 1, 2, 0]), ("reversed", [0, 1, 2, 3]), ("gspmd", [0, 1, 2, 3])):
    # a client that turned Shardy off sends the device order in an `mhlo.sharding` instead
    jax.config.update("jax_use_shardy_partitioner", name != "gspmd")
    target = NamedSharding(Mesh(np.array([devs[i] for i in order]), ("o",)), P("o"))
    # what jax.device_put between meshes of the same devices in other orders compiles
    logical = dispatch._cached_logical_device_ids(x.sharding._internal_device_list, target._internal_device_list)
    inner = NamedSharding(Mesh(target.mesh.devices, ("r",)), P("r"), _logical_device_ids=logical)
    lowered = jax.jit(dispatch._device_put_reshard, out_shardings=target).lower(
        jax.ShapeDtypeStruct((4, 4), np.float32, sharding=inner))
    text = str(lowered.compiler_ir("stablehlo"))
    jax.config.update("jax_use_shardy_partitioner", True)  # as the workers run
    info = describe(bytes(_module_to_bytecode(lowered.compiler_ir("stablehlo"))), "cpu", "", True)
    op = xc.OpSharding()
    op.ParseFromString(info.in_shardings[0])
    exact = xc.HloSharding.from_proto(op) == inner._to_xla_hlo_sharding(2)
    ex = Executable(info.exported, list(target.mesh.devices))
    y = ex([np.arange(16.0, dtype=np.float32).reshape(4, 4)])[0]
    same = np.asarray(y).ravel().tolist() == list(range(16))
    print(name, "device_ids" in text or "{devices=[4,1]3,2,1,0}" in text, exact, same,
          [d.id for d in ex.in_shardings[0]._device_assignment] == order)
"""


@pytest.mark.timeout(120)
def test_a_mesh_with_its_own_device_order_is_read_exactly(tmp_path: Path) -> None:
    """JAX's reshard between meshes of the same devices in other orders compiles a module whose
    argument's mesh has `device_ids` (with Shardy off: an `mhlo.sharding` over the devices out of
    order): the client is told its sharding exactly (as an HLO sharding over the program's
    devices), and the function computes the same value on the workers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    out = subprocess.run([sys.executable, "-c", REORDERED], env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["transposed True True True True", "reversed True True True True",
                                       "gspmd True True True True"]
