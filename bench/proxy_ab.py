"""A/B of the IFRT proxy's tiny-call rate between two source trees (two commits' `git archive`s):
each tree gets its own local cluster (`pwctl up --islands 1 --devices 4`, its own data directory
and port, processes started with `PYTHONPATH` = that tree) and its own unmodified JAX client
(`bench.jaxrun calls_serve`, the `x + 1` loop of bench/proxy.py, on a 4-device slice through
`JAX_PLATFORMS=proxy`), both up side by side; then windows alternate between the two, op-by-op
(block each call) and pipelined (one block at the end), a fixed number of calls per window, the
order within a pair flipping every pair. Prints one JSON line per window (calls/s, and the CPU
per call of the side's controller, worker and client, from /proc: steadier than the rate on a
shared machine) and a summary: each side's medians, and the median of the per-pair ratios B / A
(a pair shares most of the machine's drift).

    python -m bench.proxy_ab /tmp/base /tmp/new --pairs 10 --calls 1500,6000

`--tls B` (or A) starts that side's cluster with TLS (a throwaway CA, bench/tlscerts.py): its
client reaches the controller through the plugin's TLS bridge (pwctl/tlsbridge.py). With the same
tree on both sides that measures what TLS costs; the `updown` mode times a `--mib` MiB upload
(`jax.device_put`) and the download of its double (`np.asarray`), as bench/proxy.py's transfer rows.

    python -m bench.proxy_ab . . --tls B --modes pipelined,updown --pairs 6

`--tls AB`: both sides with TLS (two trees' bridges compared).

The `transformer` mode times the proxy suite's training step (bench/jaxrun.py `Trainer`, the
default bench/model.py config; made at the mode's first window, untimed): a window is a warm-up
step and then `--steps` steps back to back, waiting for the last loss; its rate is tokens/s and
its CPU figures are the window's CPU over `--steps` (the warm-up step's included: 1/steps high).

    python -m bench.proxy_ab /tmp/base /tmp/new --modes transformer --pairs 6

The `smallread` mode times a training loop's read of a small result each step (`float(loss)`):
a jitted `v + 1` of a 1 KiB float32 array on device 0, then `np.asarray` of its output, a fixed
number of calls per window (calls/s; `--calls`' third figure).

    python -m bench.proxy_ab /tmp/base /tmp/new --modes smallread --pairs 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SLICE = "ab"
# The client: bench/jaxrun.py calls_serve's loop (a jitted x + 1 on device 0), but each window a
# fixed number of calls, so that the processes' CPU per call is exact.
CLIENT = """
import json, sys, time
import jax, numpy as np
from bench import model  # the transformer mode's (bench/jaxrun.py sets its config before any backend starts)
from bench.jaxrun import Trainer
step = jax.jit(lambda x: x + 1.0)
double = jax.jit(lambda v: v * 2.0)
x0 = jax.device_put(np.zeros((1,), np.float32), jax.devices()[0])
step(x0).block_until_ready()
small0 = jax.device_put(np.zeros((256,), np.float32), jax.devices()[0])  # the smallread mode's 1 KiB
print(json.dumps({"ready": True, "backend": str(jax.devices()[0].client.platform_version)}), flush=True)
trainer, first = None, 0
for line in sys.stdin:
    mode, n = line.split()
    if mode == "transformer":  # n training steps (bench/jaxrun.py Trainer), after an untimed one
        if trainer is None:
            trainer = Trainer(model.Config().to_dict())
            trainer.run(0).block_until_ready()
            first = 1
        rate = trainer.window(first, int(n))
        first += int(n) + 1
        print(json.dumps({"per_s": rate, "calls": int(n), "value": float(n)}), flush=True)
        continue
    if mode == "updown":  # n MiB up, and its double down
        host = np.arange(int(n) * 2**18, dtype=np.float32) + np.float32(len(line))
        t0 = time.perf_counter()
        y = jax.device_put(host, jax.devices()[0])
        y.block_until_ready()
        up = time.perf_counter() - t0
        z = double(y)
        z.block_until_ready()
        t1 = time.perf_counter()
        back = np.asarray(z)
        down = time.perf_counter() - t1
        ok = bool(np.array_equal(back, host * np.float32(2)))
        print(json.dumps({"per_s": int(n) / up, "down_mib_s": int(n) / down, "calls": 1, "value": float(ok)}),
              flush=True)
        continue
    if mode == "smallread":  # n steps, each reading its 1 KiB result back (a loop's float(loss))
        s, last = small0, np.zeros((256,), np.float32)
        t0 = time.perf_counter()
        for _ in range(int(n)):
            s = step(s)
            last = np.asarray(s)
        dt = time.perf_counter() - t0
        print(json.dumps({"per_s": int(n) / dt, "calls": int(n), "value": float(last[-1])}), flush=True)
        continue
    x = x0
    t0 = time.perf_counter()
    for _ in range(int(n)):
        x = step(x)
        if mode == "opbyop":
            x.block_until_ready()
    x.block_until_ready()
    dt = time.perf_counter() - t0
    print(json.dumps({"per_s": int(n) / dt, "calls": int(n), "value": float(np.asarray(x)[0])}), flush=True)
"""
XLA_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=60"


def processes() -> Iterator[tuple[int, dict[str, str], str]]:
    """Every process this user can read: (pid, its environment, its command line)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        yield int(pid), dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e), cmd


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) each process (role -> pid) used so far, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for role, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[role] = (int(fields[11]) + int(fields[12])) / tick
    return out


class Side:
    """One tree's cluster and client."""

    def __init__(self, label: str, tree: Path, port: int, home: Path, tls: bool = False) -> None:
        self.label, self.tree, self.port, self.home, self.tls = label, tree, port, home, tls
        self.address = f"127.0.0.1:{port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PWCTL_", "PATHWAYS_", "JAX_"))}
        self.env = {**base, "PYTHONPATH": str(tree), "PATHWAYS_HOME": str(home), "PWCTL_SERVER": self.address,
                    "XLA_FLAGS": XLA_FLAGS, "PYTHONUNBUFFERED": "1"}
        self.client: subprocess.Popen[str] | None = None
        self.pids: dict[str, int] = {}  # controller, worker, client (check_code)

    def pwctl(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "pwctl", *args], env=self.env, cwd=self.tree,
                             capture_output=True, text=True, timeout=180)
        if out.returncode:
            raise RuntimeError(f"{self.label}: pwctl {' '.join(args)}: {out.stderr.strip()[-800:]}")
        return out.stdout

    def up(self) -> None:
        flags: list[str] = []
        if self.tls:  # the CA lands in this side's data directory, where its client finds it
            from bench.tlscerts import make_ca, make_cert

            ca = make_ca(self.home / "certs")
            host = make_cert(ca, self.home / "certs", "host", ["127.0.0.1"])
            flags = ["--tls-cert", str(host.cert), "--tls-key", str(host.key), "--tls-ca", str(ca.cert)]
        self.pwctl("up", "--islands", "1", "--devices", "4", "--listen", self.address, "--no-token", *flags)
        self.pwctl("slice", "create", SLICE, "--devices", "4")
        env = {**self.env, "JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": f"grpc://{self.address}",
               "PATHWAYS_SLICE": SLICE}
        self.client = subprocess.Popen([sys.executable, "-c", CLIENT],
                                       env=env, cwd=self.tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=open(self.home / "client.log", "ab"), text=True)  # noqa: SIM115
        first = self._reply()
        if "pathways" not in str(first.get("backend", "")):
            raise RuntimeError(f"{self.label}: the client did not run on the cluster: {first}")

    def check_code(self) -> list[str]:
        """Each of this side's Python processes with its cwd and PYTHONPATH (they must be this tree)."""
        found = []
        for pid, env, cmd in processes():
            if env.get("PATHWAYS_HOME") == str(self.home) and "python" in cmd:
                try:
                    cwd = os.readlink(f"/proc/{pid}/cwd")
                except OSError:
                    continue
                words = cmd.split()
                role = words[2].split(".")[-1] if len(words) > 2 and words[1] == "-m" else "client"
                self.pids[role] = pid
                found.append(f"{pid} {role} cwd={cwd} PYTHONPATH={env.get('PYTHONPATH')}")
        return found

    def _reply(self) -> dict[str, Any]:
        assert self.client is not None and self.client.stdout is not None
        line = self.client.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label}: the client exited {self.client.wait()}")
        out: dict[str, Any] = json.loads(line)
        return out

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) each of this side's processes used so far."""
        return cpu_seconds(self.pids)

    def ask(self, mode: str, calls: int) -> dict[str, Any]:
        return self.timed(f"{mode} {calls}", calls, f"{mode}: x + 1")

    def timed(self, request: str, calls: int, what: str) -> dict[str, Any]:
        """Sends the client one window's `request` line; its reply, with each process's CPU per
        call over the window. The client counts its `calls` steps (`value`): they must all have run."""
        assert self.client is not None and self.client.stdin is not None
        before = self.cpu()
        self.client.stdin.write(request + "\n")
        self.client.stdin.flush()
        out = self._reply()
        after = self.cpu()
        out["cpu_us_per_call"] = {r: round((after[r] - before[r]) / calls * 1e6, 1) for r in before}
        if out["value"] != out["calls"]:
            raise RuntimeError(f"{self.label} {what} {out['calls']} times gave {out['value']}")
        return out

    def down(self) -> None:
        if self.client is not None:
            with contextlib.suppress(OSError):
                assert self.client.stdin is not None
                self.client.stdin.close()
            try:
                self.client.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.client.kill()
        with contextlib.suppress(Exception):
            self.pwctl("down", "-y")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="tree A (the base)")
    ap.add_argument("b", type=Path, help="tree B")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--calls", default="1500,6000,500", help="calls per window: op-by-op, pipelined, smallread")
    ap.add_argument("--ports", default="7391,7392")
    ap.add_argument("--modes", default="opbyop,pipelined", help="of opbyop, pipelined, smallread, updown, "
                    "transformer")
    ap.add_argument("--steps", type=int, default=8, help="the transformer mode's timed steps per window")
    ap.add_argument("--mib", type=int, default=64, help="the updown mode's array (MiB)")
    ap.add_argument("--tls", default="", choices=["", "A", "B", "AB"],
                    help="this side's cluster serves TLS (AB: both: two trees' TLS bridges compared)")
    args = ap.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    modes = args.modes.split(",")
    calls = dict(zip(("opbyop", "pipelined", "smallread"), (int(c) for c in args.calls.split(",")), strict=False))
    calls.setdefault("smallread", 500)
    calls["updown"] = args.mib
    calls["transformer"] = args.steps
    tmp = Path(tempfile.mkdtemp(prefix="proxy-ab-"))
    sides = [Side("A", args.a.resolve(), ports[0], tmp / "a", tls="A" in args.tls),
             Side("B", args.b.resolve(), ports[1], tmp / "b", tls="B" in args.tls)]
    down: dict[str, list[float]] = {"A": [], "B": []}  # updown: download MiB/s
    rates: dict[str, dict[str, list[float]]] = {m: {"A": [], "B": []} for m in modes}
    loads: list[float] = []
    cpu: dict[str, dict[str, dict[str, list[float]]]] = {m: {"A": {}, "B": {}} for m in modes}
    try:
        for s in sides:
            s.up()
            for line in s.check_code():
                print(f"# {s.label}: {line}", flush=True)
        for mode in modes:  # one untimed window each: the first windows after start read low
            for s in sides:
                s.ask(mode, max(1, calls[mode] // 3))
        for i in range(args.pairs):
            order = sides if i % 2 == 0 else sides[::-1]
            for mode in modes:
                for s in order:
                    out = s.ask(mode, calls[mode])
                    rates[mode][s.label].append(float(out["per_s"]))
                    if "down_mib_s" in out:
                        down[s.label].append(float(out["down_mib_s"]))
                    for role, us in out["cpu_us_per_call"].items():
                        cpu[mode][s.label].setdefault(role, []).append(us)
                    load = os.getloadavg()[0]
                    loads.append(load)
                    extra = {"down_mib_s": round(out["down_mib_s"], 1)} if "down_mib_s" in out else {}
                    print(json.dumps({"pair": i, "mode": mode, "side": s.label, "per_s": round(out["per_s"], 1),
                                      **extra, "cpu_us_per_call": out["cpu_us_per_call"], "load1": load,
                                      "t": time.strftime("%H:%M:%S")}),
                          flush=True)
    finally:
        for s in sides:
            s.down()
    for mode in modes:
        a, b = rates[mode]["A"], rates[mode]["B"]
        ratios = [y / x for x, y in zip(a, b, strict=False) if x > 0]
        print(json.dumps({"mode": mode, "A_median": round(statistics.median(a), 1),
                          "B_median": round(statistics.median(b), 1),
                          "B_over_A_pair_median": round(statistics.median(ratios), 4),
                          "B_faster_pairs": sum(r > 1 for r in ratios), "pairs": len(ratios),
                          "A": [round(v) for v in a], "B": [round(v) for v in b]}), flush=True)
        if mode == "updown":  # per_s above: upload MiB/s
            da, db = down["A"], down["B"]
            down_ratios = [y / x for x, y in zip(da, db, strict=False) if x > 0]
            print(json.dumps({"mode": "updown (download MiB/s)", "A_median": round(statistics.median(da), 1),
                              "B_median": round(statistics.median(db), 1),
                              "B_over_A_pair_median": round(statistics.median(down_ratios), 4),
                              "B_faster_pairs": sum(r > 1 for r in down_ratios), "pairs": len(down_ratios),
                              "A": [round(v) for v in da], "B": [round(v) for v in db]}), flush=True)
        print(json.dumps({"mode": mode, "cpu_us_per_call_medians": {
            side: {r: statistics.median(v) for r, v in cpu[mode][side].items()} for side in ("A", "B")}}), flush=True)
    print(json.dumps({"load1_min": min(loads), "load1_max": max(loads),
                      "load1_median": round(statistics.median(loads), 2)}), flush=True)


if __name__ == "__main__":
    main()
