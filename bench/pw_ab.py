"""A/B of a `pw` client's tiny-call rate between two source trees (two commits' `git archive`s),
as bench/proxy_ab.py does for the IFRT proxy: each tree gets its own local cluster (`pwctl up
--islands 1 --devices 4`, its own data directory and port, processes started with `PYTHONPATH` =
that tree) and its own `pw` client, both up side by side; then windows alternate between the two,
a fixed number of calls per window, the order within a pair flipping every pair. Each window is
one (variant, mode): `inc1` (x + 1 on a 1-device slice) or `allreduce4` (a psum over a 4-device
slice, bench/defs.py `allreduce_step`), op-by-op (`block_until_ready` after each call) or
pipelined (one block at the end). Prints one JSON line per window (calls/s, and the CPU per call
of the side's controller, worker and client, from /proc) and a summary per (variant, mode): each
side's medians, and the median of the per-pair ratios B / A.

    python -m bench.pw_ab /tmp/base /tmp/new --pairs 8 --calls 1500,6000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.proxy_ab import Side

# The client: per line "VARIANT MODE N", N calls of the variant's step from x = 0 (each adds 1 to
# every element), blocking after each (opbyop) or once at the end (pipelined).
CLIENT = """
import json, sys, time
import numpy as np
import pwctl as pw
from bench import defs
vds = pw.make_virtual_device_set()
one, four = vds.add_slice(devices=1), vds.add_slice(devices=4)
steps = {"inc1": (pw.pmap(defs.inc_step, devices=one.devices), np.zeros((1,), np.float32)),
         "allreduce4": (pw.pmap(defs.allreduce_step, devices=four.devices, axis_name=defs.AXIS),
                        np.zeros((4,), np.float32))}
for step, x0 in steps.values():
    step(x0).block_until_ready(timeout=120)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    variant, mode, n = line.split()
    step, x0 = steps[variant]
    x = x0
    t0 = time.perf_counter()
    for _ in range(int(n)):
        x = step(x)
        if mode == "opbyop":
            x.block_until_ready(timeout=120)
    x.block_until_ready(timeout=120)
    dt = time.perf_counter() - t0
    print(json.dumps({"per_s": int(n) / dt, "calls": int(n), "value": float(np.asarray(x)[0])}), flush=True)
"""


class PwSide(Side):
    """One tree's cluster and `pw` client."""

    def up(self) -> None:
        self.pwctl("up", "--islands", "1", "--devices", "4", "--listen", self.address, "--no-token")
        self.client = subprocess.Popen([sys.executable, "-c", CLIENT], env=self.env, cwd=self.tree,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=open(self.home / "client.log", "ab"), text=True)  # noqa: SIM115
        self._reply()

    def run(self, variant: str, mode: str, calls: int) -> dict[str, Any]:
        return self.timed(f"{variant} {mode} {calls}", calls, f"{variant} {mode}: steps,")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="tree A (the base)")
    ap.add_argument("b", type=Path, help="tree B")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--calls", default="1500,6000", help="calls per window, op-by-op and pipelined")
    ap.add_argument("--ports", default="7393,7394")
    ap.add_argument("--variants", default="inc1,allreduce4")
    ap.add_argument("--modes", default="opbyop,pipelined")
    args = ap.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    cases = [(v, m) for v in args.variants.split(",") for m in args.modes.split(",")]
    calls = dict(zip(("opbyop", "pipelined"), (int(c) for c in args.calls.split(",")), strict=True))
    tmp = Path(tempfile.mkdtemp(prefix="pw-ab-"))
    sides = [PwSide("A", args.a.resolve(), ports[0], tmp / "a"), PwSide("B", args.b.resolve(), ports[1], tmp / "b")]
    rates: dict[tuple[str, str], dict[str, list[float]]] = {c: {"A": [], "B": []} for c in cases}
    cpu: dict[tuple[str, str], dict[str, dict[str, list[float]]]] = {c: {"A": {}, "B": {}} for c in cases}
    loads: list[float] = []
    try:
        for s in sides:
            s.up()
            for line in s.check_code():
                print(f"# {s.label}: {line}", flush=True)
        for v, m in cases:  # one untimed window each: the first windows after start read low
            for s in sides:
                s.run(v, m, calls[m] // 3)
        for i in range(args.pairs):
            order = sides if i % 2 == 0 else sides[::-1]
            for v, m in cases:
                for s in order:
                    out = s.run(v, m, calls[m])
                    rates[v, m][s.label].append(float(out["per_s"]))
                    for role, us in out["cpu_us_per_call"].items():
                        cpu[v, m][s.label].setdefault(role, []).append(us)
                    load = os.getloadavg()[0]
                    loads.append(load)
                    print(json.dumps({"pair": i, "variant": v, "mode": m, "side": s.label,
                                      "per_s": round(out["per_s"], 1), "cpu_us_per_call": out["cpu_us_per_call"],
                                      "load1": load, "t": time.strftime("%H:%M:%S")}), flush=True)
    finally:
        for s in sides:
            s.down()
    for v, m in cases:
        a, b = rates[v, m]["A"], rates[v, m]["B"]
        ratios = [y / x for x, y in zip(a, b, strict=False) if x > 0]
        print(json.dumps({"variant": v, "mode": m, "A_median": round(statistics.median(a), 1),
                          "B_median": round(statistics.median(b), 1),
                          "B_over_A_pair_median": round(statistics.median(ratios), 4),
                          "B_faster_pairs": sum(r > 1 for r in ratios), "pairs": len(ratios),
                          "cpu_us_per_call_medians": {side: {r: statistics.median(vals)
                                                             for r, vals in cpu[v, m][side].items()}
                                                      for side in ("A", "B")}}), flush=True)
    print(json.dumps({"load1_min": min(loads), "load1_max": max(loads),
                      "load1_median": round(statistics.median(loads), 2)}), flush=True)


if __name__ == "__main__":
    main()
