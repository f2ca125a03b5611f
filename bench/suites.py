"""The benchmarks (issue 6). Each `bench_*` function takes a `Ctx` and yields result rows; the
driver records an error row when one raises and goes on with the next."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench import defs
from bench.cluster import REPO, BenchCluster, free_port, run_json
from bench.jaxproc import JaxServer
from bench.rows import Ctx, Row, paired_ratio, row
from bench.scale import bench_scale
from bench.transformer import bench_transformer, bench_transformer_gpu
from schemas.pathways.v1 import worker_pb2 as wpb
from schemas.pathways.v1 import worker_pb2_grpc as wgrpc
from server.worker.process import IDLE_POLL_S, TRIM_IDLE_S

__all__ = ["BENCHES", "GPU_BENCHES", "STANDALONE", "Ctx", "JaxServer", "Row", "idle_pss_gib", "paired_ratio",
           "row"]


# ------------------------------------------------------------------------------------ 1. dispatch

DISPATCH_TARGETS: dict[tuple[str, str], tuple[str, Callable[[float, float], bool]]] = {
    ("inc1", "opbyop"): (">= 5,000/s", lambda pw, jx: pw >= 5000),
    ("inc1", "chained"): (">= 50,000/s", lambda pw, jx: pw >= 50000),
    ("allreduce4", "chained"): (">= 0.9x JAX", lambda pw, jx: pw >= 0.9 * jx),
    ("inc1", "fused"): (">= 0.97x JAX", lambda pw, jx: pw >= 0.97 * jx),
    ("allreduce4", "fused"): (">= 0.97x JAX", lambda pw, jx: pw >= 0.97 * jx),
}


def bench_dispatch(ctx: Ctx) -> Iterator[Row]:
    """Per variant, JAX and the three Pathways modes take turns window by window (a JAX process
    kept alive, as in bench_pipeline); each figure is its median window."""
    from bench import pwside

    count = 20000 if ctx.quick else 200000
    windows = 2 if ctx.quick else 9
    window_s = ctx.budget / 3
    modes = ("opbyop", "chained", "fused")
    for variant in ("inc1",) if ctx.gpu else ("allreduce4", "inc1"):
        jx = JaxServer(ctx.env(), "dispatch_serve", {"variant": variant, "count": count})
        jrates: dict[str, list[float]] = {m: [] for m in modes}
        prates: dict[str, list[float]] = {m: [] for m in modes}
        errors: dict[str, str] = {}
        try:
            jx.first()
            for _ in range(windows):
                for mode in modes:
                    jrates[mode].append(float(jx.ask(f"{mode} {window_s}")["per_s"]))
                    if mode in errors:
                        continue
                    try:
                        prates[mode].append(pwside.dispatch(variant, mode, window_s, count))
                    except Exception as e:
                        errors[mode] = f"{type(e).__name__}: {e}"
        finally:
            jx.close()
        for mode in modes:
            jx_val = defs.median(jrates[mode])
            if mode in errors:
                yield {**row("dispatch", f"{variant}/{mode}", "computations/s", "1/s", None, jx_val),
                       "error": errors[mode]}
                continue
            pw_val = defs.median(prates[mode])
            target, ok = DISPATCH_TARGETS.get((variant, mode), ("", None))
            notes = ""
            if variant == "allreduce4":
                notes = "JAX blocks every collective call (pipelining collectives deadlocks on CPU)"
            if mode == "chained":
                notes += ("; " if notes else "") + f"program of {defs.CHAIN} calls; JAX: the same Python loop"
            notes += (f"; median of {windows} windows alternating with JAX's: "
                      + "/".join(f"{v:,.0f}" for v in prates[mode]) + " vs JAX "
                      + "/".join(f"{v:,.0f}" for v in jrates[mode]))
            yield row("dispatch", f"{variant}/{mode}", "computations/s", "1/s", pw_val, jx_val, target,
                      ok(pw_val, jx_val) if ok else None, notes.lstrip("; "),
                      paired=paired_ratio(prates[mode], jrates[mode]))


# ------------------------------------------------------------------------- 2. smallest computation

def bench_sweep(ctx: Ctx) -> Iterator[Row]:
    """OpByOp and Chained against plain JAX at computation sizes from 0.05 to 10 ms; at each size
    the three take turns window by window (as in bench_pipeline), each figure its median window."""
    from bench import pwside

    targets = [0.05, 0.1, 0.3, 1.0, 3.0] if ctx.quick else [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]
    window_s = 0.1 if ctx.quick else 0.25
    windows = 2 if ctx.quick else 9
    jx = JaxServer(ctx.env(), "sweep_serve", {"targets_ms": targets, "count": 100000})
    try:
        sizes = jx.first()["sizes"]
        smallest: dict[str, float | None] = {"opbyop": None, "chained": None}
        for i, size in enumerate(sizes):
            ms = float(size["ms"])
            chain = int(min(defs.CHAIN, max(4, 300 / max(ms, 1e-3))))
            pw_windows = pwside.sweep_point(int(size["loops"]), chain, 100000, ms)
            rates: dict[str, list[float]] = {"jax": [], "opbyop": [], "chained": []}
            for _ in range(windows):
                rates["jax"].append(float(jx.ask(f"{i} {window_s}")["per_s"]))
                for mode, window in pw_windows.items():
                    rates[mode].append(window(window_s))
            jax_rate = defs.median(rates["jax"])
            size_ms = 1e3 / jax_rate  # the computation's cost: plain JAX's time per call, pipelined
            for mode in ("opbyop", "chained"):
                rate = defs.median(rates[mode])
                if rate / jax_rate >= 0.95 and smallest[mode] is None:
                    smallest[mode] = size_ms
                yield row("sweep", f"{mode}/{size_ms:.3g}ms", "computations/s", "1/s", rate, jax_rate,
                          paired=paired_ratio(rates[mode], rates["jax"]),
                          notes=f"{defs.SWEEP_N}x{defs.SWEEP_N} matmul x{size['loops']} on 1 device"
                          + (f"; program of {chain} calls" if mode == "chained" else "")
                          + f"; median of {windows} windows alternating with JAX's")
    finally:
        jx.close()
    for mode, bound in (("opbyop", 1.0), ("chained", 0.1)):
        v = smallest[mode]
        yield row("sweep", f"{mode}/smallest", "smallest computation >= 0.95x JAX", "ms", v, None,
                  f"<= {bound:g} ms", v is not None and v <= bound,
                  "none of the sizes reached 0.95x" if v is None
                  else "plain-JAX time per computation, pipelined (1 / its throughput)",
                  ratio=None)


# ------------------------------------------------------------------------------------ 3. pipelines

def bench_pipeline(ctx: Ctx) -> Iterator[Row]:
    """S-stage pipelines through Pathways (this process is the client) vs the same stages back to
    back in one JAX process, their windows taking turns (as in bench_transformer); sequential
    dispatch in a client process of its own (PWCTL_DISPATCH applies per process)."""
    from bench import pwside

    stages = [4, 8] if ctx.quick else [4, 8, 16]
    mbs = 16 if ctx.quick else defs.MICRO_BATCHES
    windows = 2 if ctx.quick else 9
    window_s = ctx.budget / 3
    variants = [(s, "blocks") for s in stages] + [(stages[-1], "alternate")]
    jax_env = ctx.env(BENCH_JAX_DEVICES=str(defs.PIPE_DEVICES))
    jx = JaxServer(jax_env, "pipeline_serve", {"variants": variants, "micro_batches": mbs})
    try:
        passes = pwside.pipeline_passes(variants, mbs)
        jx.first()
        for once in passes:
            once()
        jrates: list[list[float]] = [[] for _ in variants]
        prates: list[list[float]] = [[] for _ in variants]
        for _ in range(windows):
            for i, once in enumerate(passes):
                jrates[i].append(float(jx.ask(f"{i} {window_s}")["per_s"]))
                prates[i].append(defs.window_rate(once, window_s) * mbs)
    finally:
        jx.close()
    par = [defs.median(r) for r in prates]
    jxr = [defs.median(r) for r in jrates]
    seq_args: dict[str, Any] = {"stages_list": stages, "micro_batches": mbs, "windows": 1 if ctx.quick else 3,
                                "budget_s": window_s}
    seq = run_json(["-m", "bench.pwside", "pipeline", json.dumps(seq_args)], ctx.env(PWCTL_DISPATCH="sequential"),
                   300)

    def spread(i: int) -> str:
        return (f"median of {windows} windows alternating with JAX's: "
                + "/".join(f"{v:,.0f}" for v in prates[i]) + " vs JAX " + "/".join(f"{v:,.0f}" for v in jrates[i]))

    note = (f"{mbs} micro-batches of 256x256 matmuls; stages in contiguous blocks over the 8 devices of islands "
            "a and b (one hop between islands per micro-batch)")
    for i, s in enumerate(stages):
        k = str(s)
        yield row("pipeline", f"{s} stages/parallel", "micro-batches/s", "1/s", par[i], jxr[i], ">= 0.8x one process",
                  par[i] >= 0.8 * jxr[i], f"{note}; JAX: same stages on the same devices back to back in one "
                  f"process; {spread(i)}", paired=paired_ratio(prates[i], jrates[i]))
        yield row("pipeline", f"{s} stages/sequential", "micro-batches/s", "1/s", seq[k], jxr[i],
                  notes="a client with PWCTL_DISPATCH=sequential (each computation sent when its inputs are done)")
        yield row("pipeline", f"{s} stages/parallel vs sequential", "speed-up", "x", par[i] / seq[k], None,
                  ">= 3x" if s == 16 else "", par[i] / seq[k] >= 3 if s == 16 else None, ratio=None)
    # every hop between islands: what one transfer costs
    s = stages[-1]
    yield row("pipeline", f"{s} stages alternating islands/parallel", "micro-batches/s", "1/s", par[-1], jxr[-1],
              notes=f"stage s on island a or b by parity: {s - 1} hops between islands per micro-batch; {spread(-1)}",
              paired=paired_ratio(prates[-1], jrates[-1]))


# ---------------------------------------------------------------------------------- 4. tenancy

def _tenants(ctx: Ctx, weights: list[float], seconds: float, task: str = "tenant",
             cluster: BenchCluster | None = None) -> list[dict[str, Any]]:
    cluster = cluster or ctx.cluster
    tmp = Path(tempfile.mkdtemp(prefix="pw-tenancy-", dir=cluster.home))
    go = tmp / "go"
    procs = []
    for i, w in enumerate(weights):
        args: dict[str, Any] = {"seconds": seconds, "ready_file": str(tmp / f"ready-{i}"), "go_file": str(go)}
        if task == "tenant":
            args.update(variant="inc1", chunk=32)
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.pwside", task, json.dumps(args)],
                                      env=cluster.env(PWCTL_WEIGHT=f"{w:g}"), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 180
        while not all((tmp / f"ready-{i}").exists() for i in range(len(weights))):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                errs = [p.stderr.read()[-800:] if p.poll() is not None and p.stderr else "" for p in procs]
                raise RuntimeError(f"tenant clients did not get ready: {' | '.join(e for e in errs if e)}")
            time.sleep(0.05)
        go.write_text("go")
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=seconds + 120)
            if p.returncode != 0:
                raise RuntimeError(f"a tenant client exited {p.returncode}: {stderr[-1500:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def bench_tenancy(ctx: Ctx) -> Iterator[Row]:
    from bench import pwside

    pwside.slice_(1, "a", name="bench-tenancy")  # the shared named slice, created once
    seconds = 1.5 if ctx.quick else 3.0
    counts = [1, 2, 4] if ctx.quick else [1, 2, 4, 8]
    base = None
    for n in counts:
        res = _tenants(ctx, [1.0] * n, seconds)
        agg = sum(r["per_s"] for r in res)
        base = base or agg
        yield row("tenancy", f"{n} clients", "aggregate computations/s", "1/s", agg, None,
                  ">= 0.95x one client" if n > 1 else "", agg >= 0.95 * base if n > 1 else None,
                  f"client processes, op-by-op x+1 on one shared 1-device slice, {seconds:g} s; "
                  f"ratio = vs 1 client", ratio=agg / base)
    weights = [1.0, 2.0, 4.0] if ctx.quick else [1.0, 2.0, 4.0, 8.0]
    # proportional share needs the fair policy and a window small enough for the queue to decide
    fair = BenchCluster(islands=("a",), devices=1, controller_args=("--policy", "fair", "--window", "16"))
    try:
        fair.start()
        res = _tenants(ctx, weights, 3.0 if ctx.quick else 5.0, task="weighted_tenant", cluster=fair)
    finally:
        fair.close()
    t0 = max(r["go"] for r in res) + 1.0  # everyone submitting, queues full
    t1 = min(r["stop"] for r in res)  # nobody stopped yet
    done = [_count_at(r["log"], t1) - _count_at(r["log"], t0) for r in res]
    total = sum(done) or 1
    for w, d in zip(weights, done, strict=True):
        share = d / total
        want = w / sum(weights)
        yield row("tenancy", f"weight {w:g} of {':'.join(f'{x:g}' for x in weights)}", "achieved share", "%",
                  100 * share, None, f"{100 * want:.1f}% +-10%", abs(share / want - 1) <= 0.10,
                  f"controller --policy fair --window 16; backlogged clients (64 runs in flight) of ~1.5 ms "
                  f"calls on one device, counted over the {t1 - t0:.1f} s they all ran", ratio=share / want)


def _count_at(log: list[list[float]], t: float) -> float:
    """Runs a client had completed at time t (its log holds (time, completed) points)."""
    n = 0.0
    for when, completed in log:
        if when > t:
            break
        n = completed
    return n


# ------------------------------------------------------------------------------------- 6. costs

def _pss(pids: dict[str, int]) -> dict[str, int]:
    out = {}
    for name, pid in pids.items():
        with contextlib.suppress(psutil.Error):
            out[name] = int(psutil.Process(pid).memory_full_info().pss)
    return out


def _worker_stats(addresses: dict[str, str], token: str | None) -> tuple[int, int]:
    buffers = nbytes = 0
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    for address in addresses.values():
        with grpc.insecure_channel(address) as ch:
            st = wgrpc.WorkerStub(ch).Stats(wpb.WorkerStatsRequest(), metadata=metadata, timeout=10)
        buffers += st.buffers
        nbytes += st.buffer_bytes
    return buffers, nbytes


def cold_start(ctx: Ctx) -> float:
    with tempfile.TemporaryDirectory(prefix="pw-coldstart-") as home:
        env = {k: v for k, v in ctx.env().items() if k not in ("PWCTL_SERVER",)}
        env["PATHWAYS_HOME"] = home
        t0 = time.perf_counter()
        up = subprocess.run([sys.executable, "-m", "pwctl.cli.main", "up", "--islands", "2", "--devices", "4",
                             "--listen", f"127.0.0.1:{free_port()}"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=120)
        dt = time.perf_counter() - t0
        down = subprocess.run([sys.executable, "-m", "pwctl.cli.main", "down"], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        if up.returncode != 0:
            raise RuntimeError(f"pwctl up exited {up.returncode}: {up.stderr[-1000:]}")
        if down.returncode != 0:
            raise RuntimeError(f"pwctl down exited {down.returncode}: {down.stderr[-1000:]}")
        return dt


def bench_costs(ctx: Ctx) -> Iterator[Row]:
    from bench import pwside

    starts = defs.repeat(lambda: cold_start(ctx), 1 if ctx.quick else 2, 60)
    yield row("costs", "pwctl up --islands 2 --devices 4", "cold start until ready", "s", defs.median(starts),
              None, "<= 3 s", defs.median(starts) <= 3.0, "fresh PATHWAYS_HOME; median of "
              f"{len(starts)}; Ray here ~3.5 s")

    pids = ctx.cluster.pids()
    # controller CPU per 1,000 dispatched computations
    ctl = psutil.Process(pids["controller"])
    for mode, per in (("opbyop", 1), ("chained", defs.CHAIN)):
        step, _fused, chained, x0 = pwside.dispatch_fns("inc1")
        fn = step if mode == "opbyop" else chained
        x = fn(x0)
        x.result(timeout=120)
        n = (2000 if ctx.quick else 5000) // per if mode == "opbyop" else (20 if ctx.quick else 80)
        c0 = ctl.cpu_times()
        t0 = time.perf_counter()
        done = 0
        while done < n and time.perf_counter() - t0 < 30:
            for _ in range(min(100, n - done)):
                x = fn(x)
                done += 1
            x.result(timeout=120)
        c1 = ctl.cpu_times()
        cpu = (c1.user - c0.user) + (c1.system - c0.system)
        yield row("costs", f"inc1/{mode}", "controller CPU per 1,000 computations", "ms",
                  cpu * 1e3 / (done * per) * 1000, None,
                  notes=f"{done * per} computations, {done} runs, user+system CPU of the controller")

    # buffers on the workers after many runs: must be flat
    addresses = ctx.cluster.worker_addresses()
    step, _fused, _chained, x0 = pwside.dispatch_fns("inc1")
    total = 2000 if ctx.quick else 10000
    samples: list[tuple[int, int, int]] = []
    x = step(x0)
    x.result(timeout=120)

    def settled() -> tuple[int, int]:
        last = _worker_stats(addresses, ctx.cluster.token)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = _worker_stats(addresses, ctx.cluster.token)
            if now == last:
                break
            last = now
        return last

    samples.append((0, *settled()))
    done = 0
    t0 = time.perf_counter()
    while done < total and time.perf_counter() - t0 < 120:
        for _ in range(total // 5):
            x = step(x)
        done += total // 5
        x.result(timeout=120)
        samples.append((done, *settled()))
    first, last = samples[0], samples[-1]
    flat = last[1] <= first[1] + 2 and last[2] <= first[2] + 4096
    yield row("costs", f"after {done:,} runs", "worker buffers (count)", "buffers", float(last[1]), None,
              "flat", flat, "samples (runs: buffers/bytes): "
              + ", ".join(f"{r}: {b}/{nb}" for r, b, nb in samples), ratio=None)
    yield row("costs", f"after {done:,} runs", "worker buffer bytes", "B", float(last[2]), None, "flat", flat)

    busy = _pss(pids)  # right after the last runs
    idle_s = TRIM_IDLE_S + IDLE_POLL_S + 1.0
    time.sleep(idle_s)  # idle workers hand freed heap memory back (server/worker/memory.py)
    pss = _pss(pids)
    gib = sum(pss.values()) / 2**30
    yield row("costs", "controller + 2 workers", "PSS memory", "GiB", gib, None, "<= 0.7 GiB", gib <= 0.7,
              f"at the end of the run, idle for {idle_s:g} s (idle workers return freed heap memory to "
              "the OS and unload programs not run for a minute): "
              + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in pss.items())
              + f"; right after the last runs {sum(busy.values()) / 2**30:.2f} GiB ("
              + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in busy.items()) + ")"
              + (f"; idle after start: {ctx.notes['pss_idle_gib']:.2f} GiB" if "pss_idle_gib" in ctx.notes else ""))


def bench_proxy(ctx: Ctx) -> Iterator[Row]:
    """Unmodified JAX programs through the IFRT proxy vs plain JAX (bench/proxy.py)."""
    from bench import proxy

    yield from proxy.bench_proxy(ctx)


BENCHES: dict[str, Callable[[Ctx], Iterator[Row]]] = {
    "dispatch": bench_dispatch,
    "sweep": bench_sweep,
    "pipeline": bench_pipeline,
    "tenancy": bench_tenancy,
    "transformer": bench_transformer,
    "costs": bench_costs,
    "proxy": bench_proxy,
}

# Opt-in (`--only NAME`), never in the default run, and without the driver's cluster: each starts
# what it measures. scale: a controller against thousands of simulated hosts (bench/scale.py).
STANDALONE: dict[str, Callable[[bool, dict[str, str]], Iterator[Row]]] = {
    "scale": bench_scale,
}

# `python -m bench --gpu`: island a is one worker owning the machine's GPUs
GPU_BENCHES: dict[str, Callable[[Ctx], Iterator[Row]]] = {
    "dispatch": bench_dispatch,
    "transformer": bench_transformer_gpu,
}


def idle_pss_gib(cluster: BenchCluster) -> float:
    return sum(_pss(cluster.pids()).values()) / 2**30


