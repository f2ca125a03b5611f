"""`python -m bench.threads`: where the CPU goes, per thread, in op-by-op calls of the sweep's
matmul loop through Pathways, window by window alternating with the same calls in plain JAX.

For every thread of the controller, the workers and this client process it reads the kernel's
scheduler statistics (`/proc/<pid>/task/<tid>/schedstat`: time on a CPU, time runnable but waiting
for one, and timeslices), before and after each window, and prints the medians per call. The wait
column is what the throughput rows cannot show: a computation thread that waits on the run queue
is a device standing still while some other thread holds its core. Linux only.

    python -m bench.threads                # ~0.9 ms computations (80 matmuls), 600 calls per window
    python -m bench.threads --loops 800    # ~9 ms
    python -m bench.threads --json         # one JSON object instead of the table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Key = tuple[str, int, str]  # (process, thread id, thread name)


@dataclass(frozen=True)
class ThreadStat:
    name: str  # its comm: "tf_XLAEigen" (XLA's pool), "pw-executor" etc. (server/threadnames.py), else "python"
    run_ns: int  # time on a CPU
    wait_ns: int  # time runnable, waiting on a run queue
    slices: int  # times it was switched in


def read_threads(pid: int | str = "self") -> dict[int, ThreadStat]:
    """Scheduler statistics of every thread of a process (threads that exit meanwhile are skipped)."""
    out: dict[int, ThreadStat] = {}
    base = Path(f"/proc/{pid}/task")
    for task in base.iterdir():
        try:
            run, wait, slices = (int(v) for v in (task / "schedstat").read_text().split()[:3])
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue
        out[int(task.name)] = ThreadStat(name, run, wait, slices)
    return out


def snapshot(pids: dict[str, int]) -> dict[Key, ThreadStat]:
    out: dict[Key, ThreadStat] = {}
    for proc, pid in pids.items():
        for tid, st in read_threads(pid).items():
            out[(proc, tid, st.name)] = st
    return out


PerCall = dict[Key, tuple[float, float, float]]  # (run µs, wait µs, slices) per call


def per_call(before: dict[Key, ThreadStat], after: dict[Key, ThreadStat], calls: int) -> PerCall:
    """(run µs, run-queue wait µs, slices) per call for every thread alive at both ends."""
    out = {}
    for key, b in after.items():
        a = before.get(key)
        if a is None:
            continue
        out[key] = ((b.run_ns - a.run_ns) / calls / 1e3, (b.wait_ns - a.wait_ns) / calls / 1e3,
                    (b.slices - a.slices) / calls)
    return out


def medians(windows: Iterable[PerCall]) -> PerCall:
    """Per thread, the median of each column over the windows the thread was seen in."""
    cols: dict[Key, list[tuple[float, float, float]]] = {}
    for w in windows:
        for key, v in w.items():
            cols.setdefault(key, []).append(v)
    return {k: (statistics.median(v[0] for v in vs), statistics.median(v[1] for v in vs),
                statistics.median(v[2] for v in vs)) for k, vs in cols.items()}


@dataclass
class _Side:
    """One side's timed window, the processes whose threads it reads, and what its windows gave."""

    window: Callable[[], None]
    pids: dict[str, int]
    walls_us: list[float] = field(default_factory=list)  # per call
    stats: list[PerCall] = field(default_factory=list)


def _measure(loops: int, calls: int, windows: int) -> dict[str, Any]:
    from bench.cluster import BenchCluster
    from bench.rows import paired_ratio

    with BenchCluster() as cluster:
        cluster.start()
        os.environ["PWCTL_SERVER"] = cluster.address
        os.environ["PWCTL_TOKEN"] = cluster.token or ""  # every call needs the cluster's token
        import jax

        jax.config.update("jax_num_cpu_devices", 4)  # the same devices as bench.jaxrun's side
        import pwctl as pw
        from bench import defs, pwside

        xn, wn = defs.sweep_inputs()
        f = jax.jit(defs.matmul_loop(loops))
        xj, wj = jax.device_put(xn), jax.device_put(wn)
        f(xj, wj).block_until_ready()
        mesh = pwside.slice_(1, "a").mesh(("d",))
        pf = pw.jit(defs.matmul_loop(loops), mesh=mesh)
        wp = pw.jit(lambda v: v * 1.0, mesh=mesh)(wn)
        x0 = pf(xn, wp)
        x0.result(timeout=120)

        def jax_window() -> None:
            y = xj
            for _ in range(calls):
                y = f(y, wj)
            y.block_until_ready()

        def pw_window() -> None:
            y = x0
            for _ in range(calls):
                y = pf(y, wp)
            y.block_until_ready(timeout=300)

        sides = {"jax": _Side(jax_window, {"client": os.getpid()}),
                 "pathways": _Side(pw_window, {**cluster.pids(), "client": os.getpid()})}
        for _ in range(windows):
            for side in sides.values():
                before = snapshot(side.pids)
                t0 = time.perf_counter()
                side.window()
                side.walls_us.append((time.perf_counter() - t0) / calls * 1e6)
                side.stats.append(per_call(before, snapshot(side.pids), calls))
        result: dict[str, Any] = {
            "loops": loops, "calls": calls, "windows": windows,
            # Pathways / JAX calls per second, each Pathways window against the JAX window before it
            "paired": paired_ratio([1 / w for w in sides["pathways"].walls_us],
                                   [1 / w for w in sides["jax"].walls_us]),
        }
        for name, side in sides.items():
            rows = sorted(medians(side.stats).items(), key=lambda kv: -kv[1][0])
            result[name] = {
                "wall_us_per_call": statistics.median(side.walls_us),
                "threads": [{"process": k[0], "tid": k[1], "name": k[2], "run_us": v[0],
                             "wait_us": v[1], "slices": v[2]} for k, v in rows if v[0] >= 1 or v[1] >= 1],
            }
        return result


def _print(result: dict[str, Any]) -> None:
    print(f"op-by-op calls of a {result['loops']}-matmul loop, {result['calls']} calls x {result['windows']} windows "
          f"per side; paired Pathways/JAX calls per second: {result['paired']:.3f}")
    for side in ("pathways", "jax"):
        s = result[side]
        total_run = sum(t["run_us"] for t in s["threads"])
        total_wait = sum(t["wait_us"] for t in s["threads"])
        print(f"\n{side}: {s['wall_us_per_call']:.0f} us per call (wall); all threads: {total_run:.0f} us on a CPU, "
              f"{total_wait:.0f} us waiting for one")
        print(f"  {'process':10s} {'tid':>7s} {'name':14s} {'on CPU us':>9s}  {'waiting us':>10s}  {'slices':>6s}")
        for t in s["threads"]:
            if t["run_us"] >= 3 or t["wait_us"] >= 10:
                print(f"  {t['process']:10s} {t['tid']:7d} {t['name'][:14]:14s} {t['run_us']:9.1f}  "
                      f"{t['wait_us']:10.1f}  {t['slices']:6.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__.split("\n\n")[0])
    p.add_argument("--loops", type=int, default=80, help="matmuls per computation (80: ~0.9 ms here)")
    p.add_argument("--calls", type=int, default=600, help="calls per window")
    p.add_argument("--windows", type=int, default=7, help="windows per side, alternating")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    ns = p.parse_args(argv)
    if not Path("/proc/self/task").is_dir():
        print("bench.threads reads /proc/<pid>/task/*/schedstat: Linux only", file=sys.stderr)
        return 2
    if min(ns.loops, ns.calls, ns.windows) < 1:
        p.error("--loops, --calls and --windows must be positive")
    result = _measure(ns.loops, ns.calls, ns.windows)
    if ns.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
