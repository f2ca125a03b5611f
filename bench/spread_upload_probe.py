"""What an IFRT proxy upload of a 64 MiB array sharded over a slice spanning two workers costs.

`unshare -n sh -c 'ip link set lo up && python -m bench.spread_upload_probe [REPO]'`: a controller
and two workers of island a (2 CPU devices each) of the checkout REPO (default: this one), a
4-device slice over both, and an unmodified JAX program through the proxy that per round
`jax.device_put`s a float32 (4096, 4096) array with NamedSharding(P("d")) over the 4 devices
(timed to `block_until_ready`: "up"), runs `v * 2` over them ("run"), then downloads the result and
checks it ("check", untimed). Per phase it prints the bytes sent on loopback (/proc/net/dev `lo`:
in a network namespace of its own, only this probe's) and, after "up" and "run", each worker's
Stats `buffer_bytes`. Two workers on one machine send each other arrays through shared memory
(server/worker/locallink.py), which loopback does not see. Informational (bench/FINDINGS.md).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

PROGRAM = r"""
import sys, json, time
import numpy as np, jax
from jax.sharding import NamedSharding, PartitionSpec as P, Mesh
s = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
f = jax.jit(lambda v: v * 2, out_shardings=s)
base = np.arange(16 << 20, dtype=np.float32).reshape(4096, 4096)
print("ready", flush=True)
for i in range(int(sys.argv[1])):
    x = base + i
    sys.stdin.readline()
    t0 = time.perf_counter(); a = jax.device_put(x, s); a.block_until_ready()
    print(json.dumps({"up_s": time.perf_counter() - t0}), flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter(); b = f(a); b.block_until_ready()
    print(json.dumps({"run_s": time.perf_counter() - t0}), flush=True)
    sys.stdin.readline()
    print(json.dumps({"ok": bool(np.array_equal(np.asarray(b), 2 * x))}), flush=True)
    del a, b
"""


def lo_bytes() -> int:
    for ln in Path("/proc/net/dev").read_text().splitlines():
        if ln.strip().startswith("lo:"):
            return int(ln.split(":")[1].split()[8])  # transmitted
    raise RuntimeError("no loopback interface")


def main(repo: Path, rounds: int = 8) -> None:
    sys.path.insert(0, str(repo))
    import grpc

    from pwctl.client import Client
    from pwctl.local import stop_children
    from pwctl.paths import load_or_create_token
    from schemas.pathways.v1 import controller_pb2 as cpb
    from schemas.pathways.v1 import worker_pb2 as wpb
    from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
    from server.ports import reserve_port

    home = Path(tempfile.mkdtemp(prefix="pw-spread-probe-"))
    port = reserve_port()
    token = load_or_create_token(home / "token")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PWCTL_", "JAX_", "PATHWAYS_"))}
    env.update(PATHWAYS_HOME=str(home), PWCTL_SERVER=port.address, PYTHONUNBUFFERED="1", PYTHONPATH=str(repo))
    logs: list[Any] = []

    def spawn(args: list[str], name: str) -> subprocess.Popen[bytes]:
        fh = open(home / name, "wb")  # noqa: SIM115 (closed at the end)
        logs.append(fh)
        return subprocess.Popen([sys.executable, *args], env=env, cwd=repo, stdin=subprocess.DEVNULL, stdout=fh,
                                stderr=subprocess.STDOUT)

    procs = [spawn(["-m", "server.controller", "--listen", port.address, "--db", f"sqlite:///{home / 'pw.db'}",
                    "--log-level", "WARNING"], "controller.log")]
    procs += [spawn(["-m", "server.worker", "--island", "a", "--devices", "2", "--server", port.address, "--name",
                     n], f"worker-{n}.log") for n in ("w1", "w2")]
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with Client(server=port.address, token=token, timeout=2.0) as c:
                    if len(c.hosts()) == 2:
                        c.create_slice(cpb.SliceSpec(name="wide", devices=4))  # answers once the group formed
                        addresses = {h.name: h.address for h in c.hosts()}
                        break
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)
        site = home / "site" / "pathways_proxy_entry-0.0.dist-info"  # the plugin's entry point, as tests/proxy_env.py
        site.mkdir(parents=True)
        entry = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["entry-points"]["jax_plugins"]
        (site / "METADATA").write_text("Metadata-Version: 2.1\nName: pathways-proxy-entry\nVersion: 0.0\n")
        (site / "entry_points.txt").write_text("[jax_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry.items()))
        penv = dict(env, JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=f"grpc://{port.address}", PWCTL_TOKEN=token or "",
                    PATHWAYS_SLICE="wide", PYTHONPATH=f"{repo}{os.pathsep}{site.parent}")

        def held() -> dict[str, float]:
            out = {}
            for name, address in sorted(addresses.items()):
                with grpc.insecure_channel(address) as ch:
                    stats = wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), timeout=10,
                                                       metadata=[("authorization", f"Bearer {token}")])
                out[name] = round(stats.buffer_bytes / 2**20, 1)
            return out

        prog = subprocess.Popen([sys.executable, "-c", PROGRAM, str(rounds)], env=penv, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert prog.stdin is not None and prog.stdout is not None
        assert prog.stdout.readline().strip() == "ready"
        out = []
        for i in range(rounds):
            for phase in ("up", "run", "check"):
                before = lo_bytes()
                prog.stdin.write("go\n")
                prog.stdin.flush()
                got = json.loads(prog.stdout.readline())
                time.sleep(0.3)
                got.update(phase=phase, round=i, lo_mib=round((lo_bytes() - before) / 2**20, 1))
                if phase != "check":
                    got["held_mib"] = held()
                out.append(got)
                print(json.dumps(got), flush=True)
        prog.stdin.close()
        prog.wait(timeout=60)
        for k in ("up_s", "run_s"):
            vals = [o[k] for o in out if k in o][1:]
            print(k, f"median of rounds 2-{rounds}:", round(statistics.median(vals), 4), [round(v, 3) for v in vals])
        print("all checks ok:", all(o["ok"] for o in out if "ok" in o), "load average:", os.getloadavg())
    finally:
        stop_children(procs)
        for fh in logs:
            fh.close()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent).resolve())
