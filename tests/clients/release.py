"""Buffers on workers go back to zero after futures are dropped; prints worker buffer counts."""

import gc
import json
import sys
import time

import grpc
import numpy as np

import pwctl as pw
from pwctl import settings
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc

addresses = sys.argv[1:]
token = settings.resolve().token  # the workers require the cluster token, as pwctl finds it
metadata = (("authorization", f"Bearer {token}"),) if token else ()


def buffers() -> int:
    total = 0
    for a in addresses:
        total += wgrpc.WorkerStub(grpc.insecure_channel(a)).Stats(wpb.WorkerStatsRequest(), metadata=metadata).buffers
    return total


sa = pw.make_virtual_device_set().add_slice(devices=1, island="a")
sb = pw.make_virtual_device_set().add_slice(devices=1, island="b")
inc = pw.pmap(lambda x: x + 1.0, devices=sa.devices)
dec = pw.pmap(lambda x: x - 1.0, devices=sb.devices)


@pw.program
def step(x):
    return dec(inc(inc(x)))  # crosses islands: a transfer and intermediates


futs = [step(np.ones(1)) for _ in range(100)]
vals = [f.result().tolist() for f in futs]
held = buffers()
del futs
gc.collect()
deadline = time.monotonic() + 20
while buffers() and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"values_ok": all(v == [2.0] for v in vals), "held": held, "after": buffers()}))
