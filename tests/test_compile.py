"""Export in this (1-CPU-device) process; run the bytes in one worker-like subprocess with 8 CPU devices."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pwctl.compile import (
    CompileError,
    ExportedFunction,
    avals_of,
    export_jit,
    export_platform,
    export_pmap,
    signature_key,
)
from schemas.arrays import from_bytes, to_bytes

REPO = Path(__file__).resolve().parents[1]


def _psum(x):
    return jax.lax.psum(x, "i")


def _tree_fn(d):
    return {"sum": d["a"] + d["b"][0], "parts": (d["a"] * 2.0, jax.lax.psum(d["b"][1], "i"))}


def _cases() -> dict[str, tuple[ExportedFunction, list[int], list[np.ndarray]]]:
    """name -> (exported function, worker device ids, flat inputs)."""
    two = np.array([1.0, 2.0], np.float32)
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    grid = np.arange(16, dtype=np.float32).reshape(4, 4)
    tree = {"a": np.ones((2, 3), np.float32), "b": (np.full((2, 3), 2.0, np.float32), np.arange(2.0))}
    c: dict[str, tuple[ExportedFunction, list[int], list[np.ndarray]]] = {}
    for nm, fn in {"x2": lambda x: x * 2.0, "plus1": lambda x: x + 1.0, "half": lambda x: x / 2.0}.items():
        c[nm] = (export_pmap(fn, num_devices=2, axis_name=None, args=(two,), name=nm), [4, 5], [two])
    x4 = np.arange(4, dtype=np.float32)
    c["psum"] = (export_pmap(_psum, num_devices=4, axis_name="i", args=(x4,)), [3, 1, 6, 0], [x4])
    c["sumsq"] = (
        export_jit(lambda x: jnp.sum(x**2, axis=0), mesh_shape=(4,), axis_names=("data",),
                   in_shardings=P("data"), args=(rows,)),
        [7, 6, 5, 4],
        [rows],
    )
    c["grid"] = (
        export_jit(lambda x: (x * 2.0, x.sum(axis=1)), mesh_shape=(2, 2), axis_names=("x", "y"),
                   in_shardings=P("x", "y"), out_shardings=(P("x", "y"), P("x")), args=(grid,)),
        [7, 2, 5, 0],
        [grid],
    )
    flat_tree, _ = jax.tree.flatten(tree)
    c["tree_pmap"] = (export_pmap(_tree_fn, num_devices=2, axis_name="i", args=(tree,)), [0, 1], flat_tree)
    c["tree_jit"] = (
        export_jit(lambda t, s: {"y": (t["a"] * s, t["b"][1] + 1.0)}, mesh_shape=(2,), axis_names=("d",),
                   in_shardings=({"a": P("d"), "b": None}, P()), args=(tree, np.float32(3.0))),
        [2, 3],
        [*flat_tree, np.asarray(3.0, np.float32)],
    )
    c["inc_1dev"] = (export_jit(lambda x: x + 1.0, mesh_shape=(1,), axis_names=("d",), args=(two,)), [2], [two])
    c["donate"] = (
        export_jit(lambda x, y: x + y, mesh_shape=(2,), axis_names=("d",), in_shardings=P("d"),
                   out_shardings=P("d"), donate_argnums=0, args=(x4, x4)),
        [6, 7],
        [x4, x4],
    )
    return c


WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from schemas.arrays import from_bytes
    from schemas.arrays import to_bytes, to_numpy
    from server.worker.executable import ExecutableCache

    full = json.load(open(sys.argv[1]))
    spec = full["cases"]
    devs = {d.id: d for d in jax.devices()}
    cache = ExecutableCache(max_entries=64)
    out = {}
    for name, case in spec.items():
        exported = open(case["file"], "rb").read()
        ds = [devs[i] for i in case["devices"]]
        ex = cache.get_or_compile(case["id"], exported, ds, tuple(case["donate"]))
        assert cache.get_or_compile(case["id"], exported, ds, tuple(case["donate"])) is ex
        inputs = [from_bytes(dt, shape, bytes.fromhex(h)) for dt, shape, h in case["inputs"]]
        placed = [jax.device_put(x, s) for x, s in zip(inputs, ex.in_shardings)]
        in_shards = [[s.device.id, [[i.start, i.stop] for i in s.index]]
                     for s in placed[0].addressable_shards]
        # numpy inputs are placed by the executable; donated ones must already be jax Arrays
        res = ex(placed if ex.donate else inputs)
        out[name] = {
            "outputs": [to_numpy(r).tolist() for r in res],
            "has_collectives": ex.has_collectives,
            "donated_deleted": [placed[i].is_deleted() for i in ex.donate],
            "in_shards": in_shards,
            "out_devices": sorted({d.id for r in res for d in r.devices()}),
            "avals": [[list(a.shape), a.dtype.name] for a in ex.in_avals],
        }
    # An output of one slice feeds the same function on another slice (device_put across slices).
    a = cache.get_or_compile(spec["x2"]["id"], open(spec["x2"]["file"], "rb").read(), [devs[4], devs[5]])
    b = cache.get_or_compile(spec["x2"]["id"], open(spec["x2"]["file"], "rb").read(), [devs[1], devs[0]])
    r = b(a([np.array([1.0, 2.0], np.float32)]))[0]
    out["chain"] = {"value": to_numpy(r).tolist(), "devices": sorted(d.id for d in r.devices())}
    # The same between two 1-device slices (a pipeline's hop between stages): moved onto the device.
    inc = open(spec["inc_1dev"]["file"], "rb").read()
    a1 = cache.get_or_compile(spec["inc_1dev"]["id"], inc, [devs[2]])
    b1 = cache.get_or_compile(spec["inc_1dev"]["id"], inc, [devs[6]])
    r = b1(a1([np.array([1.0, 2.0], np.float32)]))[0]
    out["chain_1dev"] = {"value": to_numpy(r).tolist(), "devices": sorted(d.id for d in r.devices()),
                         "moves_onto": [d.id for d in b1._one_device], "multi": [repr(d) for d in b._one_device]}
    bf = jax.device_put(from_bytes(*full["bf16"][:2], bytes.fromhex(full["bf16"][2])), devs[3])
    dt, shape, data = to_bytes(to_numpy(bf * 2))
    out["bf16"] = [dt, shape, data.hex()]
    out["cache_len"] = len(cache)
    # Unloading drops every compiled program; the next call compiles it again, same results.
    from server.worker.executable import unload_unused
    live = [cache.get(c["id"], [devs[i] for i in c["devices"]], tuple(c["donate"])) for c in spec.values()]
    out["unloaded"] = unload_unused(0.0)
    out["all_unloaded"] = not any(ex.loaded for ex in live)
    again = {}
    for name, case in spec.items():
        ex = cache.get_or_compile(case["id"], open(case["file"], "rb").read(), [devs[i] for i in case["devices"]],
                                  tuple(case["donate"]))
        inputs = [from_bytes(dt, shape, bytes.fromhex(h)) for dt, shape, h in case["inputs"]]
        placed = [jax.device_put(x, s) for x, s in zip(inputs, ex.in_shardings)]
        again[name] = [to_numpy(r).tolist() for r in ex(placed if ex.donate else inputs)]
    out["same_after_unload"] = all(again[k] == out[k]["outputs"] for k in spec)
    out["reloaded"] = all(ex.loaded for ex in live)
    out["unused_now"] = unload_unused(3600.0)
    # Backend compilations of a multi-device function: its construction compiles it (for its
    # output shardings); the first call, with uploads (host arrays), runs that program, and so do
    # calls with jax.Arrays; host arrays again: jit compiles its program for them.
    from jax._src.dispatch import BACKEND_COMPILE_EVENT
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_kw: compiles.append(1) if event == BACKEND_COMPILE_EVENT else None)
    case = spec["sumsq"]
    fresh = ExecutableCache().get_or_compile(case["id"], open(case["file"], "rb").read(),
                                             [devs[i] for i in case["devices"]])
    counts = [len(compiles)]
    host = [from_bytes(dt, shape, bytes.fromhex(h)) for dt, shape, h in case["inputs"]]
    fresh(host)
    counts.append(len(compiles))
    fresh([jax.device_put(x, s) for x, s in zip(host, fresh.in_shardings)])
    counts.append(len(compiles))
    out["host_again"] = [to_numpy(r).tolist() for r in fresh(host)]
    counts.append(len(compiles))
    out["host_first"] = out["sumsq"]["outputs"]
    out["compiles"] = counts
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("exports")
    cases = _cases()
    spec: dict[str, Any] = {}
    for name, (ef, devices, inputs) in cases.items():
        path = tmp / f"{ef.function_id}.bin"
        path.write_bytes(ef.exported)
        ins = [[dt, shape, data.hex()] for dt, shape, data in map(to_bytes, inputs)]
        spec[name] = {"file": str(path), "id": ef.function_id, "devices": devices,
                      "donate": list(ef.donate), "inputs": ins}
    bf_dt, bf_shape, bf_data = to_bytes(np.array([[1.5, -2.0], [3.0, 0.25]], dtype=jnp.bfloat16))
    (tmp / "spec.json").write_text(json.dumps({"cases": spec, "bf16": [bf_dt, bf_shape, bf_data.hex()]}))
    (tmp / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=30"}
    proc = subprocess.run([sys.executable, str(tmp / "worker.py"), str(tmp / "spec.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: v[0] for k, v in cases.items()}, results


def test_seed_functions(worker_run):
    _, res = worker_run
    assert res["x2"]["outputs"] == [[2.0, 4.0]]
    assert res["plus1"]["outputs"] == [[2.0, 3.0]]
    assert res["half"]["outputs"] == [[0.5, 1.0]]
    assert res["x2"]["out_devices"] == [4, 5]
    assert res["chain"] == {"value": [4.0, 8.0], "devices": [0, 1]}
    assert res["chain_1dev"] == {"value": [3.0, 4.0], "devices": [6], "moves_onto": [6], "multi": ["None"]}


def test_pmap_psum(worker_run):
    _fns, res = worker_run
    assert res["psum"]["outputs"] == [[6.0] * 4]
    assert res["psum"]["has_collectives"]
    assert not res["x2"]["has_collectives"]
    assert res["psum"]["out_devices"] == [0, 1, 3, 6]


def test_jit_sharded_reduction(worker_run):
    _fns, res = worker_run
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    np.testing.assert_allclose(res["sumsq"]["outputs"][0], np.sum(rows**2, axis=0))
    assert res["sumsq"]["has_collectives"]
    # Virtual device i -> devices[i]: rows 0:2 on device 7, ..., rows 6:8 on device 4.
    shards = {d: tuple(idx[0]) for d, idx in res["sumsq"]["in_shards"]}
    assert shards == {7: (0, 2), 6: (2, 4), 5: (4, 6), 4: (6, 8)}


def test_worker_knows_a_sharded_elementwise_function_does_not_communicate(worker_run):
    _fns, res = worker_run
    # sharded over 4 devices but elementwise: the compiled program has no collective, and the
    # worker's executor goes by that (the client, before partitioning, could not tell)
    assert not res["donate"]["has_collectives"]


def test_2x2_mesh_order(worker_run):
    _, res = worker_run
    grid = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.testing.assert_allclose(res["grid"]["outputs"][0], grid * 2)
    np.testing.assert_allclose(res["grid"]["outputs"][1], grid.sum(axis=1))
    # devices [7, 2, 5, 0] fill the ("x", "y") mesh row-major.
    shards = {d: [tuple(i) for i in idx] for d, idx in res["grid"]["in_shards"]}
    assert shards == {7: [(0, 2), (0, 2)], 2: [(0, 2), (2, 4)], 5: [(2, 4), (0, 2)], 0: [(2, 4), (2, 4)]}


def test_pytrees(worker_run):
    fns, res = worker_run
    ef = fns["tree_pmap"]
    out = jax.tree.unflatten(ef.out_tree, [np.asarray(o) for o in res["tree_pmap"]["outputs"]])
    np.testing.assert_allclose(out["sum"], np.full((2, 3), 3.0))
    np.testing.assert_allclose(out["parts"][0], np.full((2, 3), 2.0))
    np.testing.assert_allclose(out["parts"][1], [1.0, 1.0])  # psum of [0, 1]
    assert [a.shape for a in ef.out_avals] == [(2, 3), (2,), (2, 3)]
    jt = fns["tree_jit"]
    out = jax.tree.unflatten(jt.out_tree, [np.asarray(o) for o in res["tree_jit"]["outputs"]])
    np.testing.assert_allclose(out["y"][0], np.full((2, 3), 3.0))
    np.testing.assert_allclose(out["y"][1], [1.0, 2.0])
    assert jt.in_tree == avals_of(({"a": 0, "b": (0, 0)}, 0))[1]
    assert res["tree_jit"]["avals"] == [
        [[2, 3], "float32"], [[2, 3], "float32"], [[2], "float32"], [[], "float32"]
    ]


def test_donation(worker_run):
    fns, res = worker_run
    assert fns["donate"].donate == (0,)
    assert res["donate"]["outputs"] == [[0.0, 2.0, 4.0, 6.0]]
    assert res["donate"]["donated_deleted"] == [True]
    ef = export_jit(lambda a, b: a, mesh_shape=(1,), axis_names=("d",), donate_argnums=(1,),
                    args=(np.ones(2), {"p": np.ones(2), "q": (np.ones(1),)}))
    assert ef.donate == (1, 2)


def test_cache_and_bf16_on_worker(worker_run):
    fns, res = worker_run
    # one entry per (function, devices, donate); x2 and inc_1dev on one extra slice each for the
    # chain checks
    assert res["cache_len"] == len(fns) + 2
    dt, shape, data = res["bf16"]
    got = from_bytes(dt, shape, bytes.fromhex(data))
    assert dt == "bfloat16" and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), [[3.0, -4.0], [6.0, 0.5]])


def test_unload_and_recompile_on_worker(worker_run):
    _fns, res = worker_run
    # every cached executable was unloaded, ran again with the same results, and is loaded again
    assert res["unloaded"] >= res["cache_len"]
    assert res["all_unloaded"] and res["reloaded"] and res["same_after_unload"]
    assert res["unused_now"] == 0  # all of them ran within the hour


def test_a_first_call_with_uploads_runs_the_program_compiled_with_the_function(worker_run):
    _fns, res = worker_run
    # construction 1; the first call, with host arrays as uploads arrive, compiles nothing more
    # (it compiled once more when it went through jit); jax.Arrays nothing; host arrays again 1
    assert res["compiles"] == [1, 1, 1, 2]
    assert res["host_again"] == res["host_first"]


def test_exported_metadata():
    ef = export_pmap(lambda x: x * 2.0, num_devices=2, axis_name=None, args=(np.array([1.0, 2.0]),))
    assert ef.function_id == hashlib.sha256(ef.exported).hexdigest()
    assert ef.num_devices == 2 and ef.name == "<lambda>"
    assert ef.in_avals == (jax.ShapeDtypeStruct((2,), jnp.float32),)  # float64 canonicalized
    assert ef.out_avals == (jax.ShapeDtypeStruct((2,), jnp.float32),)
    rep = export_jit(lambda x: x * 2, mesh_shape=(4,), axis_names=("d",), in_shardings=P(),
                     args=(np.ones(8, np.float32),))
    assert rep.num_devices == 4 and rep.out_avals == (jax.ShapeDtypeStruct((8,), jnp.float32),)


def test_trace_error_message():
    def f(x):
        raise RuntimeError("boom")

    with pytest.raises(CompileError, match=r"function 'f' failed to trace .*RuntimeError: boom"):
        export_pmap(f, num_devices=2, axis_name="i", args=(np.ones(2),))
    with pytest.raises(CompileError, match=r"function 'g' failed to trace .*float32\[2\], float32\[3\]"):
        export_jit(lambda a, b: a + b, mesh_shape=(1,), axis_names=("d",), args=(np.ones(2), np.ones(3)),
                   name="g")
    with pytest.raises(CompileError, match=r"function 'h': argument 1\['w'\] has shape \(3,\)"):
        export_jit(lambda a, b: a, mesh_shape=(2,), axis_names=("d",), in_shardings=(P(), {"w": P("d")}),
                   args=(np.ones(2), {"w": np.ones(3)}), name="h")


def test_pmap_argument_errors():
    def f(x, y=None):
        return x

    msg = "pmap function 'f': argument 0 has leading axis 3, the slice has 2 devices"
    with pytest.raises(CompileError, match=msg):
        export_pmap(f, num_devices=2, axis_name="i", args=(np.ones(3),))
    with pytest.raises(CompileError, match="pmap function 'f': argument 1 is a scalar"):
        export_pmap(f, num_devices=2, axis_name="i", args=(np.ones(2), 1.0))
    with pytest.raises(CompileError, match=r"argument 0\['k'\]\[1\] has leading axis 5"):
        export_pmap(f, num_devices=2, axis_name="i", args=({"k": (np.ones(2), np.ones(5))},))
    with pytest.raises(CompileError, match="argument 0 is a str"):
        export_jit(f, mesh_shape=(1,), axis_names=("d",), args=("nope",))


def test_signature_and_platform():
    a = signature_key((np.ones((2, 3), np.float32), {"k": 1.0}))
    assert a == signature_key((np.zeros((2, 3), np.float32), {"k": 2.0}))
    assert a != signature_key((np.zeros((2, 4), np.float32), {"k": 2.0}))
    assert a != signature_key((np.zeros((2, 3), np.float32), (2.0,)))
    assert hash(a) == hash(signature_key((np.ones((2, 3), np.float32), {"k": 1.0})))
    assert export_platform("gpu") == "cuda" and export_platform("cpu") == "cpu"
    ef = export_pmap(lambda x: x + 1.0, num_devices=2, axis_name=None, args=(np.ones(2),), platform="gpu")
    assert jax.export.deserialize(bytearray(ef.exported)).platforms == ("cuda",)


def test_bytes_round_trip():
    for arr in (np.array([[1.5, -2.0, 3.25]], dtype=jnp.bfloat16), np.arange(6, dtype=np.int8).reshape(2, 3),
                np.array(True), np.zeros((0, 3), np.float32)):
        dt, shape, data = to_bytes(arr)
        back = from_bytes(dt, shape, memoryview(data))
        assert back.dtype == arr.dtype and back.shape == arr.shape
        np.testing.assert_array_equal(back, arr)
    with pytest.raises(ValueError, match="expected 8"):
        from_bytes("float32", [2], b"\x00" * 4)
    with pytest.raises(ValueError, match="unknown dtype"):
        from_bytes("float99", [1], b"\x00")


def test_byte_view_gives_raw_bytes_for_every_dtype():
    from schemas.arrays import byte_view

    for arr in (np.array([[1.5, -2.0, 3.25]], dtype=jnp.bfloat16), np.array(2.5, dtype=jnp.bfloat16),
                np.arange(12, dtype=np.float32).reshape(3, 4).T, np.zeros((0, 3), np.float16)):
        view = byte_view(arr)
        assert view.format == "B" and view.nbytes == arr.nbytes
        assert bytes(view) == to_bytes(arr)[2]


def test_64_bit_types_only_when_an_argument_has_one():
    from pwctl.api.functions import CompiledFunction

    def body(x):
        return x + jnp.zeros(x.shape), jnp.arange(3)  # constants take JAX's default widths

    def exporter(args):
        return export_jit(body, mesh_shape=(1,), axis_names=("d",), args=args)

    f = CompiledFunction(body, None, exporter)  # type: ignore[arg-type]
    narrow = f.export((np.ones(2, np.float32),))  # as in plain JAX: 32-bit constants
    assert [a.dtype for a in narrow.out_avals] == [jnp.float32, jnp.int32]
    wide = f.export((np.ones(2, np.float64),))  # a float64 input computes in float64, as NumPy would
    assert [a.dtype for a in wide.out_avals] == [jnp.float64, jnp.int64]
    assert [a.dtype for a in f.export((2.0,)).out_avals] == [jnp.float64, jnp.int64]  # a Python float is
