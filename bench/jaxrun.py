"""Plain in-process JAX baselines, run as `python -m bench.jaxrun TASK JSON` in a subprocess with
4 virtual CPU devices (the same count a Pathways slice has; BENCH_JAX_DEVICES overrides it: the
pipeline baseline uses the 8 devices of the two islands). Each task stays alive: it prints one
JSON line when ready, then one per request line it reads from stdin, so that its windows can
alternate with Pathways' (bench/jaxproc.py `JaxServer`).

The same tasks run unmodified through the IFRT proxy (`JAX_PLATFORMS=proxy`, bench/proxy.py):
`jax.devices()` are then the slice's devices, and `jax_num_cpu_devices` is inert.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("BENCH_JAX_DEVICES", "4")))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import defs  # noqa: E402


def dispatch_serve(variant: str, count: int) -> None:
    """For windows interleaved with Pathways' (bench_dispatch): prepares the variant's step and
    fused functions, prints {"ready": true}; then for each line "MODE BUDGET_S" read from stdin
    (opbyop, chained or fused), computations/s over one window, as {"per_s": ...}. Chained in
    plain JAX is the same loop of dependent calls from Python as OpByOp."""
    devs = jax.devices()
    if variant == "allreduce4":
        step = jax.pmap(defs.allreduce_step, axis_name=defs.AXIS, devices=devs[:4])
        fused = jax.pmap(defs.allreduce_fused, axis_name=defs.AXIS, devices=devs[:4])
        x0 = jax.pmap(lambda v: v, devices=devs[:4])(np.zeros((4,), np.float32))
        block_each = True  # collectives must not be pipelined on CPU (docs/facts.md, "JAX on CPU"): block every call
    else:
        step = jax.jit(defs.inc_step)
        fused = jax.jit(defs.inc_fused)
        x0 = jax.device_put(np.zeros((1,), np.float32), devs[0])
        block_each = False
    step(x0).block_until_ready()
    fused(x0).block_until_ready()

    def loop(fn: Any, k: int) -> None:
        x = x0
        for _ in range(k):
            x = fn(x)
            if block_each:
                x.block_until_ready()
        x.block_until_ready()

    modes = {"opbyop": (step, 1), "chained": (step, 1), "fused": (fused, defs.CHAIN)}
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        mode, budget = line.split()
        fn, per_call = modes[mode]

        def run(k: int, fn: Any = fn) -> None:
            loop(fn, k)

        rate = defs.throughput(run, max(1, count // per_call), float(budget) * 3) * per_call
        sys.stdout.write(json.dumps({"per_s": rate}) + "\n")
        sys.stdout.flush()


def _per_call_ms(fn: Any, x: Any, w: Any, budget_s: float) -> float:
    fn(x, w).block_until_ready()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        t0 = time.perf_counter()
        fn(x, w).block_until_ready()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline and len(times) >= 3:
            break
    return defs.median(times) * 1e3


def sweep_serve(targets_ms: list[float], count: int) -> None:
    """For windows interleaved with Pathways' (bench_sweep): calibrates loop counts so that one
    computation takes about each target and prints {"sizes": [{"loops", "target_ms", "ms"}]};
    then for each line "INDEX BUDGET_S" read from stdin, the pipelined throughput of a loop of
    dependent calls of size INDEX over one window, as {"per_s": ...}."""
    dev = jax.devices()[0]
    xn, wn = defs.sweep_inputs()
    x, w = jax.device_put(xn, dev), jax.device_put(wn, dev)
    t1 = _per_call_ms(jax.jit(defs.matmul_loop(1)), x, w, 0.3)
    t64 = _per_call_ms(jax.jit(defs.matmul_loop(64)), x, w, 0.5)
    per_loop = max((t64 - t1) / 63, 1e-6)
    base = max(t1 - per_loop, 0.0)
    sizes: list[dict[str, Any]] = []
    runs: list[Callable[[int], None]] = []
    for target in targets_ms:
        loops = max(1, round((target - base) / per_loop))
        if any(s["loops"] == loops for s in sizes):
            continue
        fn = jax.jit(defs.matmul_loop(loops))
        sizes.append({"loops": loops, "target_ms": target, "ms": _per_call_ms(fn, x, w, 0.5)})

        def run(k: int, fn: Any = fn) -> None:
            y = x
            for _ in range(k):
                y = fn(y, w)
            y.block_until_ready()

        runs.append(run)
    sys.stdout.write(json.dumps({"sizes": sizes, "per_loop_ms": per_loop, "base_ms": base}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        index, budget = line.split()
        i, budget_s = int(index), float(budget)
        n = max(3, min(count, int(budget_s * 1e3 / max(sizes[i]["ms"], 1e-3))))
        sys.stdout.write(json.dumps({"per_s": defs.throughput(runs[i], n, budget_s * 3)}) + "\n")
        sys.stdout.flush()


def pipeline_pass(stages: int, micro_batches: int, layout: str = "blocks") -> Callable[[], None]:
    """One pass of the pipeline: the same stages back to back in one process, each on the device
    it has in Pathways (`defs.stage_device`; run with BENCH_JAX_DEVICES=8), all micro-batches
    dispatched before blocking."""
    devs = jax.devices()
    fn = jax.jit(defs.stage)
    xs, ws = defs.pipeline_inputs(stages, micro_batches)
    place = [devs[defs.stage_device(s, stages, layout) % len(devs)] for s in range(stages)]
    wd = [jax.device_put(w, place[s]) for s, w in enumerate(ws)]
    xd = [jax.device_put(x, place[0]) for x in xs]

    def once() -> None:
        outs = []
        for x in xd:
            h = x
            for s in range(stages):
                h = fn(jax.device_put(h, place[s]), wd[s])
            outs.append(h)
        for o in outs:
            o.block_until_ready()

    once()  # compile, warm up
    return once


def pipeline_serve(variants: list[list[Any]], micro_batches: int) -> None:
    """For windows interleaved with Pathways' (bench_pipeline): prepares every [stages, layout]
    variant, prints {"ready": true}; then for each line "INDEX BUDGET_S" read from stdin, the
    micro-batches/s of variant INDEX over one window (`defs.window_rate`), as {"per_s": ...}."""
    passes = [pipeline_pass(int(stages), micro_batches, str(layout)) for stages, layout in variants]
    for once in passes:
        once()
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        index, budget = line.split()
        rate = defs.window_rate(passes[int(index)], float(budget)) * micro_batches
        sys.stdout.write(json.dumps({"per_s": rate}) + "\n")
        sys.stdout.flush()


class Trainer:
    """The transformer's training step as one jit over the first BENCH_JAX_DEVICES devices (4 by
    default; params and optimizer state replicated, the batch split: data parallel); `run(i)` runs
    step i on batch i."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from bench import model

        self.model = model
        self.c = c = model.Config(**cfg)
        mesh = Mesh(np.array(jax.devices()[:int(os.environ.get("BENCH_JAX_DEVICES", "4"))]), ("data",))
        rep = NamedSharding(mesh, P())
        self.dat = NamedSharding(mesh, P("data"))
        opt = model.optimizer(c)
        params = model.init_params(c)
        self.params_count = model.param_count(params)
        self.step = jax.jit(model.make_train_step(c, opt), in_shardings=(rep, rep, self.dat),
                            out_shardings=(rep, rep, rep))
        self.state = (jax.device_put(params, rep), jax.device_put(opt.init(params), rep))

    def run(self, i: int) -> Any:
        params, state, loss = self.step(*self.state, jax.device_put(self.model.batch(self.c, i), self.dat))
        self.state = (params, state)
        return loss

    def window(self, first: int, steps: int) -> float:
        """Step `first` (a warm-up, untimed), then tokens/s of the next `steps` steps dispatched
        back to back, waiting for the last loss."""
        self.run(first).block_until_ready()
        t0 = time.perf_counter()
        loss = jnp.zeros(())
        for i in range(first + 1, first + 1 + steps):
            loss = self.run(i)
        loss.block_until_ready()
        return steps * self.c.batch * self.c.seq / (time.perf_counter() - t0)


def transformer_serve(cfg: dict[str, Any], steps: int) -> None:
    """For measurements interleaved with another process's: `steps` steps reading every loss,
    printed as one JSON line ({"losses", "params"}); then for each line N read from stdin, a
    window (a warm-up step, then N timed steps), printed as {"tokens_per_s": ...}; ends at end of
    input."""
    t = Trainer(cfg)
    losses = [float(t.run(i)) for i in range(steps)]
    sys.stdout.write(json.dumps({"losses": losses, "params": t.params_count, "backend": backend()}) + "\n")
    sys.stdout.flush()
    first = steps
    for line in sys.stdin:
        n = int(line)
        rate = t.window(first, n)
        first += n + 1
        sys.stdout.write(json.dumps({"tokens_per_s": rate}) + "\n")
        sys.stdout.flush()


def backend() -> str:
    """Which backend runs this process's computations: "cpu x4" here, "pathways slice NAME x4"
    through the IFRT proxy (the slice's platform version)."""
    dev = jax.devices()[0]
    version = str(getattr(dev.client, "platform_version", ""))
    name = version if "pathways" in version else dev.platform
    return f"{name} x{len(jax.devices())}"


def calls_serve(count: int) -> None:
    """The tiny-call rate (bench/proxy.py): a jitted x + 1 on the first device, prints
    {"ready": true}; then for each line "MODE BUDGET_S" (pipelined: no block between calls, one at
    the end of the window; opbyop: block each call), calls/s over one window from x = 0, as
    {"per_s", "calls", "value"}: `value` is the result, which must equal `calls`."""
    step = jax.jit(defs.inc_step)
    x0 = jax.device_put(np.zeros((1,), np.float32), jax.devices()[0])
    step(x0).block_until_ready()
    sys.stdout.write(json.dumps({"ready": True, "backend": backend()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        mode, budget = line.split()
        last: dict[str, Any] = {}

        def run(k: int, block_each: bool = mode == "opbyop", last: dict[str, Any] = last) -> None:
            x = x0
            for _ in range(k):
                x = step(x)
                if block_each:
                    x.block_until_ready()
            x.block_until_ready()
            last.update(calls=k, x=x)

        rate = defs.throughput(run, count, float(budget) * 3)
        sys.stdout.write(json.dumps({"per_s": rate, "calls": last["calls"],
                                     "value": float(np.asarray(last["x"])[0])}) + "\n")
        sys.stdout.flush()


def transfer_serve(mib: int) -> None:
    """Upload and download rates (bench/proxy.py) of a float32 array of `mib` MiB on the first
    device, prints {"ready": true} after one untimed round; then for each line I: host data
    `arange + I` (made untimed), timed `jax.device_put` + `block_until_ready` (upload), an
    untimed `x * 2` on the device, timed `np.asarray` of that result (download), printed as
    {"up_s", "down_s", "ok"}: `ok` says the downloaded array equals the host data times 2."""
    dev = jax.devices()[0]
    base = np.arange(mib * 2**20 // 4, dtype=np.float32)
    double = jax.jit(lambda v: v * 2.0)

    def once(i: int) -> dict[str, Any]:
        host = base + np.float32(i)
        t0 = time.perf_counter()
        x = jax.device_put(host, dev)
        x.block_until_ready()
        t1 = time.perf_counter()
        y = double(x)
        y.block_until_ready()
        t2 = time.perf_counter()
        out = np.asarray(y)
        t3 = time.perf_counter()
        return {"up_s": t1 - t0, "down_s": t3 - t2, "ok": bool(np.array_equal(out, host * np.float32(2)))}

    once(0)
    sys.stdout.write(json.dumps({"ready": True, "bytes": int(base.nbytes), "backend": backend()}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        sys.stdout.write(json.dumps(once(int(line))) + "\n")
        sys.stdout.flush()


TASKS: dict[str, Any] = {"dispatch_serve": dispatch_serve, "sweep_serve": sweep_serve, "pipeline_serve": pipeline_serve,
                         "transformer_serve": transformer_serve, "calls_serve": calls_serve,
                         "transfer_serve": transfer_serve}


def main() -> None:
    task, args = sys.argv[1], json.loads(sys.argv[2])
    TASKS[task](**args)


if __name__ == "__main__":
    main()
