"""The IFRT proxy suite (issue 28, `python -m bench --only proxy`): unmodified JAX programs
(`bench/jaxrun.py`'s tasks) run twice in the same run, once through the proxy
(`JAX_PLATFORMS=proxy`, `JAX_BACKEND_TARGET=grpc://<controller>`, `PATHWAYS_SLICE` = a 4-device
slice of island a) and once on plain local JAX (`JAX_PLATFORMS=cpu`, 4 CPU devices), their
timed windows taking turns. Each program is the same file with the same arguments: only the
environment differs. Every row's output is checked (against the exact answer, and the loss curve
against plain JAX's); a wrong answer is an error row."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from bench import defs
from bench.jaxproc import JaxServer
from bench.rows import Ctx, Row, paired_ratio, row
from pwctl.client import Client
from schemas.pathways.v1 import controller_pb2 as cpb

SLICE = "bench-proxy"
TRANSFER_MIB = 64


def _spread(pw: list[float], jx: list[float], fmt: str = ",.0f") -> str:
    return (f"median of {len(pw)} windows alternating with plain JAX's: " + "/".join(f"{v:{fmt}}" for v in pw)
            + " vs JAX " + "/".join(f"{v:{fmt}}" for v in jx))


class Sides:
    """The same `bench.jaxrun` task in two processes: through the proxy and on plain JAX."""

    def __init__(self, ctx: Ctx, task: str, args: dict[str, Any]) -> None:
        target = f"grpc://{ctx.cluster.address}"
        self.proxy = JaxServer(ctx.env(JAX_PLATFORMS="proxy", JAX_BACKEND_TARGET=target, PATHWAYS_SLICE=SLICE),
                               task, args)
        self.jax = JaxServer(ctx.env(JAX_PLATFORMS="cpu"), task, args)

    def first(self) -> tuple[dict[str, Any], dict[str, Any]]:
        p, j = self.proxy.first(), self.jax.first()
        if "pathways" not in str(p.get("backend", "")):
            raise RuntimeError(f"the proxy side did not run on the cluster: backend {p.get('backend')!r}")
        return p, j

    def close(self) -> None:
        self.proxy.close()
        self.jax.close()


def _calls(ctx: Ctx) -> Iterator[Row]:
    count = 20000 if ctx.quick else 200000
    windows = 2 if ctx.quick else 9
    window_s = ctx.budget / 3
    modes = ("pipelined", "opbyop")
    rates: dict[str, dict[str, list[float]]] = {m: {"proxy": [], "jax": []} for m in modes}
    wrong: list[str] = []
    sides = Sides(ctx, "calls_serve", {"count": count})
    try:
        p_first, _ = sides.first()
        for _ in range(windows):
            for mode in modes:
                for side, server in (("jax", sides.jax), ("proxy", sides.proxy)):
                    out = server.ask(f"{mode} {window_s}")
                    rates[mode][side].append(float(out["per_s"]))
                    if out["value"] != out["calls"]:
                        wrong.append(f"{side} {mode}: x + 1 from 0 {out['calls']} times gave {out['value']}")
    finally:
        sides.close()
    for mode in modes:
        pw, jx = rates[mode]["proxy"], rates[mode]["jax"]
        pv, jv = defs.median(pw), defs.median(jx)
        target = ">= 5,000/s" if mode == "pipelined" else ""
        how = ("no block between calls, one at the end of the window" if mode == "pipelined"
               else "blocking each call")
        r = row("proxy", f"x+1 {'pipelined' if mode == 'pipelined' else 'op-by-op'}", "calls/s", "1/s", pv, jv,
                target, pv >= 5000 if target else None,
                f"jitted x + 1 on device 0, {how}; proxy: {p_first['backend']}; results checked "
                f"(x = number of calls); {_spread(pw, jx)}", paired=paired_ratio(pw, jx))
        yield {**r, "error": "wrong result: " + "; ".join(wrong)} if wrong else r


def _transformer(ctx: Ctx, cfg: dict[str, Any] | None) -> Iterator[Row]:
    from bench import model
    from bench.transformer import loss_row

    if cfg is None:
        cfg = model.Config(layers=2, d=128, ff=512).to_dict() if ctx.quick else model.Config().to_dict()
    c = model.Config(**cfg)
    steps, timed, windows = 10, (3 if ctx.quick else 8), (2 if ctx.quick else 10)
    rates: dict[str, list[float]] = {"proxy": [], "jax": []}
    sides = Sides(ctx, "transformer_serve", {"cfg": cfg, "steps": steps})
    try:
        p_first, j_first = sides.first()
        for _ in range(windows):
            for side, server in (("jax", sides.jax), ("proxy", sides.proxy)):
                rates[side].append(float(server.ask(str(timed))["tokens_per_s"]))
    finally:
        sides.close()
    pw, jx = rates["proxy"], rates["jax"]
    pv, jv = defs.median(pw), defs.median(jx)
    tokens = c.batch * c.seq
    yield row("proxy", "transformer step", "tokens/s", "1/s", pv, jv, ">= 0.9x JAX", pv >= 0.9 * jv,
              f"bench/model.py, {p_first['params'] / 1e6:.1f}M params, d={c.d}, {c.layers} layers, batch "
              f"{c.batch}x{c.seq}, optax adamw, jit with NamedSharding over the 4 devices (data parallel); "
              f"step time {tokens / pv * 1e3:.1f} ms through the proxy ({p_first['backend']}) vs "
              f"{tokens / jv * 1e3:.1f} ms plain; windows of {timed} steps after an untimed one; {_spread(pw, jx)}",
              paired=paired_ratio(pw, jx))
    yield {**loss_row("proxy transformer step", p_first["losses"], j_first["losses"]), "bench": "proxy"}


def _transfers(ctx: Ctx, mib: int) -> Iterator[Row]:
    rounds = 2 if ctx.quick else 7
    times: dict[str, dict[str, list[float]]] = {d: {"proxy": [], "jax": []} for d in ("up_s", "down_s")}
    wrong: list[str] = []
    sides = Sides(ctx, "transfer_serve", {"mib": mib})
    try:
        p_first, _ = sides.first()
        nbytes = int(p_first["bytes"])
        for i in range(1, rounds + 1):
            for side, server in (("jax", sides.jax), ("proxy", sides.proxy)):
                out = server.ask(str(i))
                for d in times:
                    times[d][side].append(float(out[d]))
                if not out["ok"]:
                    wrong.append(f"{side} round {i}: the downloaded array differs from the host data x 2")
    finally:
        sides.close()
    for d, name, how in (("up_s", "upload", "jax.device_put + block_until_ready"),
                         ("down_s", "download", "np.asarray of a device array")):
        pw = [nbytes / t / 1e9 for t in times[d]["proxy"]]
        jx = [nbytes / t / 1e9 for t in times[d]["jax"]]
        pv, jv = defs.median(pw), defs.median(jx)
        r = row("proxy", f"{name} {mib} MiB", "GB/s", "GB/s", pv, jv, ">= 0.5 GB/s", pv >= 0.5,
                f"float32, device 0, {how}; every round's data differs and the round trip is checked "
                f"(x 2 on the device); {_spread(pw, jx, '.3g')}", paired=paired_ratio(pw, jx))
        yield {**r, "error": "wrong result: " + "; ".join(wrong)} if wrong else r


def bench_proxy(ctx: Ctx, transfer_mib: int = TRANSFER_MIB, cfg: dict[str, Any] | None = None) -> Iterator[Row]:
    """The proxy rows: tiny-call rate, the transformer step, upload and download (the module's
    docstring). `transfer_mib` and `cfg` (the model's size) let the smoke test shrink them."""
    with Client(server=ctx.cluster.address, token=ctx.cluster.token, timeout=30.0) as c:
        c.create_slice(cpb.SliceSpec(name=SLICE, devices=4, island="a"))
    load = "load average {:.1f} {:.1f} {:.1f} as the suite began; ".format(*os.getloadavg())
    parts: list[tuple[str, Callable[[], Iterator[Row]]]] = [
        ("x+1", lambda: _calls(ctx)), ("transformer step", lambda: _transformer(ctx, cfg)),
        (f"upload/download {transfer_mib} MiB", lambda: _transfers(ctx, transfer_mib))]
    try:
        for name, part in parts:  # one part failing records its error, and the others still run
            try:
                for r in part():
                    yield {**r, "notes": load + r["notes"]} if load else r  # the machine is shared
                    load = ""
            except Exception as e:
                yield {**row("proxy", name, "", "", None), "notes": load.rstrip("; "),
                       "error": f"{type(e).__name__}: {e}"}
                load = ""
    finally:
        with contextlib.suppress(Exception), \
                Client(server=ctx.cluster.address, token=ctx.cluster.token, timeout=30.0) as c:
            c.delete_slice(SLICE, force=True)
