"""The worker's Compile RPC (server/worker/compiling.py): a session's function compiled ahead of
its first run, answering the compiled output shardings, which are XLA's own choice where the
function leaves them to propagation; everything else a clear error, the worker unharmed.

Real processes: a controller and a worker from the `cluster` fixture, a session opened on the
controller's Session stream, raw gRPC calls to the worker; the function is exported (and its
shardings compiled for comparison) by plain JAX on 2 CPU devices in a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from tests.conftest import REPO, LocalCluster
from tests.test_trust_worker import code_of, meta, open_session, worker_log

pytestmark = [pytest.mark.timeout(180), pytest.mark.cluster(islands=1, devices=2)]

EXPORT = """
import json, numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
mesh = Mesh(np.array(jax.devices()), ("d",))
f = jax.jit(lambda x: (x * 2, x.T @ x, x.reshape(-1)), in_shardings=NamedSharding(mesh, P(None, "d")))
arg = jax.ShapeDtypeStruct((8, 4), np.float32)
exp = jax.export.export(f)(arg)
compiled = f.lower(arg).compile()
out = [s._to_xla_hlo_sharding(len(a.shape)).to_proto().SerializeToString().hex()
       for s, a in zip(compiled.output_shardings, exp.out_avals)]
print(json.dumps({"exported": bytes(exp.serialize()).hex(), "out": out,
                  "specs": [str(s.spec) for s in compiled.output_shardings]}))
"""


@pytest.fixture
def worker(cluster: LocalCluster) -> Iterator[tuple[grpc.Channel, wgrpc.WorkerStub, grpc.Channel]]:
    wch, cch = grpc.insecure_channel(cluster.hosts()["w-a"].address), grpc.insecure_channel(cluster.address)
    yield wch, wgrpc.WorkerStub(wch), cch
    wch.close()
    cch.close()


def _export() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", EXPORT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _blob(exported: bytes, name: str = "f") -> wpb.FunctionBlob:
    return wpb.FunctionBlob(function_id=hashlib.sha256(exported).hexdigest(), exported=exported, name=name)


def test_compile_answers_the_shardings_xla_picks_and_refuses_bad_requests(cluster: LocalCluster, worker: Any) -> None:
    wch, stub, cch = worker
    made = _export()
    exported = bytes.fromhex(made["exported"])
    # propagation shards the results (not all replicated): the worker must say so, exactly
    assert made["specs"] == ["P(None, 'd')", "P('d',)", "P()"]
    s = open_session(cluster, cch)
    md = meta(cluster, s)
    reply = stub.Compile(wpb.CompileRequest(function=_blob(exported), local_devices=[0, 1]), metadata=md, timeout=120)
    assert reply.error == ""
    assert [b.hex() for b in reply.out_shardings] == made["out"]
    executables = stub.Stats(wpb.WorkerStatsRequest(), metadata=md, timeout=10).executables
    assert executables >= 1  # in the cache the runs use: compiling it again adds nothing
    again = stub.Compile(wpb.CompileRequest(function=_blob(exported), local_devices=[0, 1]), metadata=md, timeout=60)
    assert list(again.out_shardings) == list(reply.out_shardings)
    assert stub.Stats(wpb.WorkerStatsRequest(), metadata=md, timeout=10).executables == executables
    # no session credential, undecodable bytes: refused before anything runs
    assert code_of(lambda: stub.Compile(wpb.CompileRequest(function=_blob(exported), local_devices=[0, 1]),
                                        metadata=meta(cluster), timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
    raw = wch.unary_unary("/pathways.v1.Worker/Compile")
    assert code_of(lambda: raw(b"\xff\xff\xff\xff\x0f" + os.urandom(32), metadata=md, timeout=10)) \
        == grpc.StatusCode.INVALID_ARGUMENT
    # bad requests: an answer saying why, one line each
    wrong_id = wpb.FunctionBlob(function_id="0" * 64, exported=exported, name="f")
    junk = b"not an exported function"
    cases = [
        (wpb.CompileRequest(function=wrong_id, local_devices=[0, 1]), "function f: its bytes do not match its id"),
        (wpb.CompileRequest(function=_blob(exported), local_devices=[0, 0]), "devices [0, 0]: not distinct"),
        (wpb.CompileRequest(function=_blob(exported), local_devices=[0, 7]), "devices [0, 7]: not distinct"),
        (wpb.CompileRequest(function=_blob(exported), local_devices=[]), "devices []: not distinct"),
        (wpb.CompileRequest(function=_blob(exported), local_devices=[0]), "cannot compile f: ValueError: "),
        (wpb.CompileRequest(function=_blob(junk, "junk"), local_devices=[0]), "cannot compile junk: "),
        (wpb.CompileRequest(local_devices=[0]), "a function of 0 bytes"),
        (wpb.CompileRequest(function=_blob(exported), local_devices=[0, 1], group_generation=99),
         "a function for island group generation 99, this worker is in generation 0"),
    ]
    for request, error in cases:
        answer = stub.Compile(request, metadata=md, timeout=60)
        assert answer.error.startswith(error), (answer.error, error)
        assert "\n" not in answer.error and not answer.out_shardings
    # the worker still serves, and logged no traceback
    assert stub.Compile(wpb.CompileRequest(function=_blob(exported), local_devices=[1, 0]), metadata=md,
                        timeout=120).error == ""
    assert "Traceback" not in worker_log(cluster)
    s.close()
