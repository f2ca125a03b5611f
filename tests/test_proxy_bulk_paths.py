"""Which path the IFRT proxy's bulk bytes take, end to end: an unmodified JAX program
(JAX_PLATFORMS=proxy) uploads and downloads arrays of 4 MiB and more on a plain (non-TLS)
cluster, once as it comes (on the workers' TCP transfer ports, server/proxy/bulk.py) and once on
a controller started with --no-bulk-links (by gRPC, the fallback); the bytes arrive exactly
either way, and the controller's Prometheus counters say which path each transfer took
(`pathways_proxy_bulk_transfers_total`, `pathways_proxy_bulk_bytes_total`). A small array's
download takes the same path (where it is the TCP port, its answer is read on the controller's
event loop) and is no bulk transfer: not counted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import LocalCluster, wait_for
from proxy_env import proxy_env
from test_metrics import Samples, metrics_url, scrape, value
from test_proxy_cluster import run_program, worker_buffers
from test_trust_worker import worker_log

MIB = 1 << 20
SIZES = (4 * MIB, 9 * MIB + 12)  # bytes of each array: exactly the threshold, and messages and a partial one

ROUND_TRIPS = """
import hashlib, numpy as np, jax, jax.numpy as jnp
for nbytes in SIZES:
    a = np.random.default_rng(nbytes).integers(-2**31, 2**31 - 1, nbytes // 4, dtype=np.int64).astype(np.int32)
    x = jax.device_put(a)                                   # up
    y = jax.jit(lambda v: v ^ jnp.int32(0x5A5A5A5A))(x)
    back, same = np.asarray(y), np.asarray(x)               # down, twice
    print(nbytes, back.tobytes() == (a ^ np.int32(0x5A5A5A5A)).tobytes(), same.tobytes() == a.tobytes(),
          hashlib.sha256(same.tobytes()).hexdigest() == hashlib.sha256(a.tobytes()).hexdigest())
"""


SMALL = """
import numpy as np, jax
a = np.arange(256, dtype=np.float32)                        # 1 KiB: no bulk transfer (under 4 MiB)
x, ok = jax.device_put(a), []
for k in range(3):
    x = jax.jit(lambda v: v + 1.0)(x)
    ok.append(np.asarray(x).tobytes() == (a + (k + 1)).tobytes())   # down: a small download
print(all(ok))
"""


def transfers(samples: Samples, direction: str, path: str) -> tuple[float, float]:
    return (value(samples, "pathways_proxy_bulk_transfers_total", direction=direction, path=path),
            value(samples, "pathways_proxy_bulk_bytes_total", direction=direction, path=path))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flags, path", [((), "tcp"), (("--no-bulk-links",), "grpc")], ids=["tcp", "no-bulk-links"])
def test_a_jax_programs_bulk_bytes_take_the_path_the_controller_says(
        make_cluster: Callable[..., LocalCluster], tmp_path: Path, flags: tuple[str, ...], path: str) -> None:
    cluster = make_cluster(islands=1, devices=1, controller_args=["--metrics-listen", "127.0.0.1:0", *flags])
    url = metrics_url(cluster)
    before = scrape(url, cluster.token)
    for direction in ("upload", "download"):
        assert transfers(before, direction, "tcp") == transfers(before, direction, "grpc") == (0, 0)
    env = proxy_env(cluster, tmp_path, PATHWAYS_DEVICES="1")
    assert run_program(SMALL, env) == ["True"]
    small = scrape(url, cluster.token)
    for direction in ("upload", "download"):  # no bulk transfer
        assert transfers(small, direction, "tcp") == transfers(small, direction, "grpc") == (0, 0)
    # the small upload and downloads made the session's only connection to the worker's transfer port, or none
    assert ("bulk connection from" in worker_log(cluster)) == (path == "tcp")
    code = ROUND_TRIPS.replace("SIZES", repr(SIZES))
    out = run_program(code, env)
    assert out == [f"{n} True True True" for n in SIZES], out
    after = scrape(url, cluster.token)
    other = "grpc" if path == "tcp" else "tcp"
    nbytes = sum(SIZES)
    # each array: one upload, two downloads (the result, the upload read back), all on `path`
    assert transfers(after, "upload", path) == (len(SIZES), nbytes)
    assert transfers(after, "download", path) == (2 * len(SIZES), 2 * nbytes)
    assert transfers(after, "upload", other) == transfers(after, "download", other) == (0, 0)
    logs = cluster.controller_logs()
    assert "Traceback" not in logs
    assert "gRPC carries its transfers" not in logs  # no connection refused: not tried (off), or made
    wait_for(lambda: worker_buffers(cluster) == 0, 30, "the program's buffers to be freed")
