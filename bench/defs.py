"""The computations every benchmark runs, shared verbatim by the Pathways side and the plain-JAX
side (so both compile the same functions), plus small timing helpers.

Importing this module imports JAX but does not start a backend: callers choose the device count.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CHAIN = 128  # computations per Chained program / per Fused call
AXIS = "i"

# --------------------------------------------------------------------------------------- dispatch


def allreduce_step(x: Any) -> Any:
    """The paper's unit of work: a scalar all-reduce over every device, then a scalar add.
    (Scaled so that a long chain stays finite.)"""
    return jax.lax.psum(x, AXIS) * 0.25 + 1.0


def allreduce_fused(x: Any) -> Any:
    # `+ v * 0` keeps the carry "varying over the axis" as shard_map's type check wants
    return jax.lax.fori_loop(0, CHAIN, lambda _, v: allreduce_step(v) + v * 0.0, x)


def inc_step(x: Any) -> Any:
    return x + 1.0


def inc_fused(x: Any) -> Any:
    return jax.lax.fori_loop(0, CHAIN, lambda _, v: inc_step(v), x)


# ----------------------------------------------------------------------------- matmul-loop sweep

SWEEP_N = 64  # matrix side; the sweep varies the loop count


def matmul_loop(loops: int) -> Callable[[Any, Any], Any]:
    """A computation of `loops` dependent (n x n) @ (n x n) matmuls; returns (x', w)."""

    def f(x: Any, w: Any) -> Any:
        def body(_: Any, v: Any) -> Any:
            return jnp.tanh(v @ w)

        return jax.lax.fori_loop(0, loops, body, x)

    f.__name__ = f"matmul_loop_{loops}"
    return f


def sweep_inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SWEEP_N, SWEEP_N)).astype(np.float32)
    w = (rng.standard_normal((SWEEP_N, SWEEP_N)) / math.sqrt(SWEEP_N)).astype(np.float32)
    return x, w


# ------------------------------------------------------------------------------------ pipelines

PIPE_N = 256
MICRO_BATCHES = 32
PIPE_DEVICES = 8  # 2 islands x 4 devices


def stage_device(s: int, stages: int, layout: str) -> int:
    """The device (0-7; 0-3 island a, 4-7 island b) stage `s` of `stages` runs on.

    "blocks": contiguous blocks of stages per device, as a pipeline is partitioned (GPipe): one
    hop between islands per micro-batch. "alternate": stage s on device 0 of island a or b by
    parity, so every hop crosses islands (the transfer path's worst case)."""
    if layout == "alternate":
        return 0 if s % 2 == 0 else PIPE_DEVICES // 2
    return s * PIPE_DEVICES // stages


def stage(h: Any, w: Any) -> Any:
    return jnp.tanh(h @ w)


def pipeline_inputs(stages: int, micro_batches: int = MICRO_BATCHES) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(1)
    ws = [(rng.standard_normal((PIPE_N, PIPE_N)) / math.sqrt(PIPE_N)).astype(np.float32) for _ in range(stages)]
    xs = [rng.standard_normal((PIPE_N, PIPE_N)).astype(np.float32) for _ in range(micro_batches)]
    return xs, ws


# ---------------------------------------------------------------------------------------- timing


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def repeat(fn: Callable[[], float], repeats: int, budget_s: float) -> list[float]:
    """Calls `fn` (which returns one measurement) up to `repeats` times within `budget_s`
    (always at least once)."""
    out: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(out) < repeats:
        out.append(fn())
        if time.perf_counter() > deadline:
            break
    return out


def window_rate(one_pass: Callable[[], None], budget_s: float) -> float:
    """Passes/s over one window of as many whole passes as fill about `budget_s`."""
    def run(k: int) -> None:
        for _ in range(k):
            one_pass()

    return throughput(run, 10_000, budget_s * 3)


def throughput(run_batch: Callable[[int], None], count: int, budget_s: float) -> float:
    """Items/s of `run_batch(k)` (runs k items and blocks), doubling k from 1 until the batch
    takes at least a third of `budget_s` or reaches `count` items. Bounded by time and count."""
    k = 1
    while True:
        t0 = time.perf_counter()
        run_batch(k)
        dt = time.perf_counter() - t0
        if dt >= budget_s / 3 or k >= count:
            return k / dt if dt > 0 else float("inf")
        # aim the next batch at about a third of the budget
        k = min(count, max(k * 2, int(k * (budget_s / 3) / max(dt, 1e-6))))


def weights_work(x: Any) -> Any:
    """~1.5 ms of device time per call (one device's (96, 96) block): device time, not client
    overhead, must dominate for proportional share to be visible."""
    return jax.lax.fori_loop(0, 40, lambda _, y: jnp.tanh(y @ x), x)
