"""The Pathways side of every benchmark: code that runs in a `pw` client process (the bench driver
itself, or a client subprocess started as `python -m bench.pwside TASK JSON`, which prints one JSON
object). PWCTL_SERVER must name the cluster; PWCTL_DISPATCH / PWCTL_WEIGHT apply per process.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import pwctl as pw
from bench import defs

_slices: dict[tuple[int, str, str], Any] = {}
_fns: dict[str, Any] = {}


def slice_(devices: int, island: str = "a", name: str = "") -> Any:
    key = (devices, island, name)
    if key not in _slices:
        _slices[key] = pw.make_virtual_device_set().add_slice(devices=devices, island=island, name=name or None)
    return _slices[key]


def dispatch_fns(variant: str) -> tuple[Any, Any, Any, np.ndarray]:
    """(step, fused, chained, x0) for a dispatch variant, compiled once per process."""
    if variant not in _fns:
        if variant == "allreduce4":
            s = slice_(4, "a")
            step = pw.pmap(defs.allreduce_step, devices=s.devices, axis_name=defs.AXIS)
            fused = pw.pmap(defs.allreduce_fused, devices=s.devices, axis_name=defs.AXIS)
            x0 = np.zeros((4,), np.float32)
        else:
            s = slice_(1, "a")
            step = pw.pmap(defs.inc_step, devices=s.devices)
            fused = pw.pmap(defs.inc_fused, devices=s.devices)
            x0 = np.zeros((1,), np.float32)

        @pw.program
        def chained(x: Any) -> Any:
            for _ in range(defs.CHAIN):
                x = step(x)
            return x

        _fns[variant] = (step, fused, chained, x0)
    step, fused, chained, x0 = _fns[variant]
    return step, fused, chained, x0


def dispatch(variant: str, mode: str, budget_s: float, count: int, repeats: int) -> float:
    """Computations/s for one (variant, mode): OpByOp, Chained or Fused."""
    step, fused, chained, x0 = dispatch_fns(variant)
    fn, per_call = {"opbyop": (step, 1), "chained": (chained, defs.CHAIN), "fused": (fused, defs.CHAIN)}[mode]
    start = fn(x0)  # warm up: trace, register, compile on the worker
    start.result(timeout=120)
    fn(start).result(timeout=120)

    def run(k: int) -> None:
        x = start
        for _ in range(k):
            x = fn(x)
        x.result(timeout=300)

    calls = max(1, count // per_call)
    return defs.median(defs.repeat(lambda: defs.throughput(run, calls, budget_s) * per_call, repeats, budget_s * 3))


# --------------------------------------------------------------------------------------- sweep

def sweep_point(loops: int, chain: int, budget_s: float, count: int, ms: float) -> dict[str, float]:
    """OpByOp and Chained (a program of `chain` dependent calls) computations/s at one size."""
    s = slice_(1, "a")
    f = pw.jit(defs.matmul_loop(loops), mesh=s.mesh(("d",)))

    @pw.program
    def prog(x: Any, w: Any) -> Any:
        for _ in range(chain):
            x = f(x, w)
        return x

    xn, wn = defs.sweep_inputs()
    w = pw.jit(lambda v: v * 1.0, mesh=s.mesh(("d",)))(wn)  # resident on the worker
    x0 = f(xn, w)
    x0.result(timeout=120)
    prog(x0, w).result(timeout=120)
    out = {}
    for mode, fn, per in (("opbyop", f, 1), ("chained", prog, chain)):
        def run(k: int, fn: Any = fn) -> None:
            x = x0
            for _ in range(k):
                x = fn(x, w)
            x.result(timeout=300)

        n = max(1, min(count, int(budget_s * 1e3 / max(ms, 1e-3))) // per)
        def measure(run: Any = run, n: int = n, per: int = per) -> float:
            return defs.throughput(run, n, budget_s) * per

        out[mode] = defs.median(defs.repeat(measure, 3, budget_s * 3))
    return out


# ------------------------------------------------------------------------------------ pipelines

def pipeline(stages_list: list[int], micro_batches: int, repeats: int) -> dict[str, Any]:
    """Micro-batches/s of an S-stage pipeline alternating over islands a and b (1 device each):
    one program per micro-batch, all micro-batches submitted before blocking."""
    sa, sb = slice_(1, "a"), slice_(1, "b")
    fa = pw.jit(defs.stage, mesh=sa.mesh(("d",)))
    fb = pw.jit(defs.stage, mesh=sb.mesh(("d",)))
    put_a = pw.jit(lambda v: v * 1.0, mesh=sa.mesh(("d",)))
    put_b = pw.jit(lambda v: v * 1.0, mesh=sb.mesh(("d",)))
    out: dict[str, Any] = {}
    for stages in stages_list:
        xs_np, ws_np = defs.pipeline_inputs(stages, micro_batches)
        ws = [(put_a if s % 2 == 0 else put_b)(w) for s, w in enumerate(ws_np)]
        xs = [put_a(x) for x in xs_np]

        @pw.program
        def micro_batch(x: Any, ws: list[Any], stages: int = stages) -> Any:
            h = x
            for s in range(stages):
                h = (fa if s % 2 == 0 else fb)(h, ws[s])
            return h

        def once(xs: list[Any] = xs, ws: list[Any] = ws, micro_batch: Any = micro_batch) -> float:
            t0 = time.perf_counter()
            outs = [micro_batch(x, ws) for x in xs]
            for o in outs:
                o.result(timeout=300)
            return len(xs) / (time.perf_counter() - t0)

        once()  # trace, register, compile
        out[str(stages)] = defs.median(defs.repeat(once, repeats, 10.0))
    return out


# ---------------------------------------------------------------------------------- tenancy

def tenant(variant: str, seconds: float, chunk: int, ready_file: str, go_file: str) -> dict[str, Any]:
    """One of N concurrent clients: op-by-op on the shared named slice for `seconds`, counting
    completed computations; starts when `go_file` appears (after writing `ready_file`)."""
    s = slice_(1, "a", name="bench-tenancy")
    f = pw.pmap(defs.inc_step, devices=s.devices)
    x = f(np.zeros((1,), np.float32))
    x.result(timeout=120)
    Path(ready_file).write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not Path(go_file).exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    done = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(chunk):
            x = f(x)
        x.result(timeout=120)
        done += chunk
    dt = time.perf_counter() - t0
    return {"done": done, "seconds": dt, "per_s": done / dt, "weight": float(os.environ.get("PWCTL_WEIGHT", "1"))}


def weighted_tenant(seconds: float, ready_file: str, go_file: str) -> dict[str, Any]:
    """A backlogged client for the proportional-share measurement: keeps up to 64 runs of ~1.5 ms
    in flight on the shared slice and logs (time, completed) as they finish (a client's runs on one
    device complete in order)."""
    s = slice_(1, "a", name="bench-weights")
    f = pw.pmap(defs.weights_work, devices=s.devices)
    x = pw.pmap(lambda v: v + 0.0, devices=s.devices)(np.full((1, 96, 96), 0.01, np.float32))  # on the worker
    f(x).result(timeout=120)
    Path(ready_file).write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not Path(go_file).exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    go = time.time()
    inflight: deque[Any] = deque()
    done, log = 0, [(go, 0)]
    while time.time() - go < seconds:
        inflight.append(f(x))
        if len(inflight) >= 64:
            for _ in range(7):
                inflight.popleft()
            inflight.popleft().block_until_ready()  # runs of one client on one device finish in order
            done += 8
            log.append((time.time(), done))
    stop = time.time()
    return {"go": go, "stop": stop, "log": log, "weight": float(os.environ.get("PWCTL_WEIGHT", "1"))}


# ---------------------------------------------------------------------------------- transformer

def transformer_spmd(cfg: dict[str, Any], steps: int, timed_steps: int) -> dict[str, Any]:
    from bench import model

    c = model.Config(**cfg)
    s = slice_(4, "a")
    opt = model.optimizer(c)
    params = model.init_params(c)
    state = opt.init(params)
    treedef = jax.tree_util.tree_structure(state)
    state = jax.tree_util.tree_leaves(state)
    step = pw.jit(model.flat_state(model.make_train_step(c, opt), treedef, 1, 1), mesh=s.mesh(("data",)),
                  in_shardings=(P(), P(), P("data")), out_shardings=(P(), P(), P()))
    losses = []
    for i in range(steps):
        params, state, loss = step(params, state, model.batch(c, i))
        losses.append(float(loss.result(timeout=300)))
    t0 = time.perf_counter()
    for i in range(timed_steps):
        params, state, loss = step(params, state, model.batch(c, steps + i))
    loss.result(timeout=300)
    dt = time.perf_counter() - t0
    return {"losses": losses, "tokens_per_s": timed_steps * c.batch * c.seq / dt, "step_ms": dt / timed_steps * 1e3}


def transformer_pipeline(cfg: dict[str, Any], steps: int, timed_steps: int, micro_batches: int) -> dict[str, Any]:
    """Stage 1 (embedding + first half of the layers) on island a, stage 2 on island b, each a
    4-device data-parallel slice; one program per training step over `micro_batches`."""
    from bench import model

    c = model.Config(**cfg)
    sa, sb = slice_(4, "a"), slice_(4, "b")
    ma, mb = sa.mesh(("data",)), sb.mesh(("data",))
    opt = model.optimizer(c)
    fns = model.make_stage_fns(c, opt)
    s1_fwd = pw.jit(fns["s1_fwd"], mesh=ma, in_shardings=(P(), P("data")), out_shardings=P("data"))
    s2_step = pw.jit(fns["s2_step"], mesh=mb, in_shardings=(P(), P("data"), P("data")),
                     out_shardings=(P(), P(), P("data")))
    s1_bwd = pw.jit(fns["s1_bwd"], mesh=ma, in_shardings=(P(), P("data"), P("data")), out_shardings=P())
    p1, p2 = model.split(c, model.init_params(c))
    o1, o2 = opt.init(p1), opt.init(p2)
    t1, t2 = jax.tree_util.tree_structure(o1), jax.tree_util.tree_structure(o2)
    o1, o2 = jax.tree_util.tree_leaves(o1), jax.tree_util.tree_leaves(o2)
    upd1 = pw.jit(model.flat_state(fns["update"], t1, 1, 1), mesh=ma, in_shardings=P(), out_shardings=P())
    upd2 = pw.jit(model.flat_state(fns["update"], t2, 1, 1), mesh=mb, in_shardings=P(), out_shardings=P())
    mean_loss = pw.jit(fns["mean_loss"], mesh=mb, in_shardings=P(), out_shardings=P())
    # tokens go to both islands: stage 2 needs the targets
    put_a = pw.jit(lambda v: v, mesh=ma, in_shardings=P("data"), out_shardings=P("data"))
    put_b = pw.jit(lambda v: v, mesh=mb, in_shardings=P("data"), out_shardings=P("data"))

    @pw.program
    def train_step(p1: Any, o1: Any, p2: Any, o2: Any, toks_a: list[Any], toks_b: list[Any]) -> Any:
        losses, g1s, g2s = [], [], []
        for ta, tb in zip(toks_a, toks_b, strict=True):
            h = s1_fwd(p1, ta)
            loss, g2, dh = s2_step(p2, h, tb)
            g1s.append(s1_bwd(p1, ta, dh))
            g2s.append(g2)
            losses.append(loss)
        p1, o1 = upd1(p1, o1, g1s)
        p2, o2 = upd2(p2, o2, g2s)
        return p1, o1, p2, o2, mean_loss(losses)

    m = c.batch // micro_batches

    def tokens(i: int) -> tuple[list[Any], list[Any]]:
        b = model.batch(c, i)
        parts = [b[j * m:(j + 1) * m] for j in range(micro_batches)]
        return [put_a(t) for t in parts], [put_b(t) for t in parts]

    losses = []
    for i in range(steps):
        p1, o1, p2, o2, loss = train_step(p1, o1, p2, o2, *tokens(i))
        losses.append(float(loss.result(timeout=300)))
    t0 = time.perf_counter()
    for i in range(timed_steps):
        p1, o1, p2, o2, loss = train_step(p1, o1, p2, o2, *tokens(steps + i))
    loss.result(timeout=300)
    dt = time.perf_counter() - t0
    return {"losses": losses, "tokens_per_s": timed_steps * c.batch * c.seq / dt, "step_ms": dt / timed_steps * 1e3}


TASKS: dict[str, Any] = {"pipeline": pipeline, "tenant": tenant, "dispatch": dispatch,
                         "weighted_tenant": weighted_tenant}


def main() -> None:
    task, args = sys.argv[1], json.loads(sys.argv[2])
    result = TASKS[task](**args)
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
