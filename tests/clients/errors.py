"""Each error case of the pw API; prints one JSON object of messages."""

import json

import numpy as np

import pwctl as pw
from pwctl.compile import export_pmap

out = {}
vds = pw.make_virtual_device_set()
s = vds.add_slice(devices=2)
double = pw.pmap(lambda x: x * 2.0, devices=s.devices)

try:  # wrong leading axis at trace time: names the function and argument
    double(np.ones(3))
except Exception as e:
    out["shape"] = f"{type(e).__name__}: {e}"


def boom(x):
    raise ValueError("boom from user code")


try:
    pw.pmap(boom, devices=s.devices)(np.ones(2))
except Exception as e:
    out["user_exception"] = f"{type(e).__name__}: {e}"

# a node that fails on the worker (exported for a platform the worker does not have)
bad = pw.pmap(lambda x: x + 1.0, devices=s.devices)
bad._exporter = lambda args: export_pmap(lambda x: x + 1.0, num_devices=2, axis_name=None, args=args,
                                         platform="cuda", name="bad")
y = bad(np.ones(2))
z = double(y)  # depends on the failed node
for key, fut in (("failed_node", y), ("dependent", z)):
    try:
        fut.result(timeout=60)
        out[key] = "no error"
    except Exception as e:
        out[key] = f"{type(e).__name__}: {e}"
try:  # waiting (without fetching) reports the failure the same way
    pw.block_until_ready([z, double(np.ones(2))], timeout=60)
    out["wait_failed"] = "no error"
except Exception as e:
    out["wait_failed"] = f"{type(e).__name__}: {e}"
try:  # so does the method, on a future never fetched
    double(z).block_until_ready(timeout=60)
    out["method_wait_failed"] = "no error"
except Exception as e:
    out["method_wait_failed"] = f"{type(e).__name__}: {e}"
out["still_fine"] = np.asarray(double(np.array([1.0, 2.0]))).tolist()

# a function on a deleted slice fails with the slice's name
t = vds.add_slice(devices=2)
gone = pw.pmap(lambda x: x - 1.0, devices=t.devices)
t.delete()
try:
    gone(np.ones(2)).result(timeout=60)
    out["deleted_slice"] = "no error"
except Exception as e:
    out["deleted_slice"] = f"{type(e).__name__}: {e}"
out["slice_name"] = t.name
print(json.dumps(out))
