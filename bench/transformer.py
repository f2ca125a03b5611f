"""The transformer training step (bench/model.py): plain JAX SPMD against `pw.jit` and a 2-stage
pipeline over two islands, on CPU (`bench_transformer`) and on one GPU (`bench_transformer_gpu`)."""

from __future__ import annotations

from collections.abc import Iterator

from bench import defs
from bench.jaxproc import JaxServer
from bench.rows import Ctx, Row, paired_ratio, row


def bench_transformer(ctx: Ctx) -> Iterator[Row]:
    """Plain-JAX SPMD vs the same step through `pw.jit` vs a 2-stage pipeline over the two islands.

    Every side runs the same steps on the same batches. Throughput is measured in windows (one
    untimed warm-up step, then timed steps submitted back to back, waiting until the last one is
    complete), the sides taking turns window by window, and each side's figure is the median of its
    windows: the same statistic over the same number of windows, interleaved in time, so that load
    from elsewhere on this shared machine penalizes no side in particular, and one lucky or
    unlucky window moves nothing."""
    from bench import model, pwside

    cfg = model.Config(layers=2, d=128, ff=512).to_dict() if ctx.quick else model.Config().to_dict()
    c = model.Config(**cfg)
    steps, timed, windows = 10, (3 if ctx.quick else 8), (2 if ctx.quick else 10)
    micro_batches = 2
    spmd_name = "pw.jit SPMD (4 devices)"
    pipe_name = "2-stage pipeline (2 islands x 1 device)"
    dp_name = "2-stage pipeline (2 islands x 4 devices)"
    # compiles while the Pathways side traces and registers; first(): {"losses", "params"}
    jx = JaxServer(ctx.env(), "transformer_serve", {"cfg": cfg, "steps": steps})
    try:
        trainers = {spmd_name: pwside.spmd_trainer(cfg),
                    pipe_name: pwside.pipeline_trainer(cfg, micro_batches, devices=1)}
        if not ctx.quick:  # the same pipeline, each stage data parallel over its island's 4 devices
            trainers[dp_name] = pwside.pipeline_trainer(cfg, micro_batches, devices=4)
        curves = {name: pwside.loss_curve(step, steps) for name, step in trainers.items()}
        rates: dict[str, list[float]] = {name: [] for name in ["jax", *trainers]}
        for w in range(windows):
            rates["jax"].append(float(jx.ask(str(timed))["tokens_per_s"]))
            for name, step in trainers.items():
                rates[name] += pwside.throughput(step, c, steps + w * (timed + 1), timed, 1)
        first = jx.first()
    finally:
        jx.close()
    med = {name: defs.median(v) for name, v in rates.items()}

    def spread(name: str) -> str:
        return (f"median of {len(rates[name])} windows of {timed} steps alternating with JAX's (best "
                f"{max(rates[name]):,.0f}/s vs JAX {max(rates['jax']):,.0f}/s): "
                + "/".join(f"{v:,.0f}" for v in rates[name]) + " vs JAX " + "/".join(f"{v:,.0f}" for v in rates["jax"]))

    desc = (f"decoder-only, {first['params'] / 1e6:.1f}M params, d={cfg['d']}, {cfg['layers']} layers, "
            f"batch {cfg['batch']}x{cfg['seq']} tokens, optax adamw; JAX: jit with NamedSharding over 4 devices, "
            f"data parallel (params and optimizer update replicated)")
    pipe_desc = (f"one program per step (registered once), {micro_batches} micro-batches GPipe-style; stage 1 "
                 f"(embedding, first half of the layers) on island a, stage 2 on island b")
    yield row("transformer", spmd_name, "tokens/s", "1/s", med[spmd_name], med["jax"], ">= 0.97x JAX",
              med[spmd_name] >= 0.97 * med["jax"], f"{desc}; {spread(spmd_name)}",
              paired=paired_ratio(rates[spmd_name], rates["jax"]))
    yield row("transformer", pipe_name, "tokens/s", "1/s", med[pipe_name], med["jax"], ">= 0.9x JAX SPMD",
              med[pipe_name] >= 0.9 * med["jax"], f"{pipe_desc}, 1 device each; {spread(pipe_name)}",
              paired=paired_ratio(rates[pipe_name], rates["jax"]))
    if dp_name in trainers:
        yield row("transformer", dp_name, "tokens/s", "1/s", med[dp_name], med["jax"], "", None,
                  f"{pipe_desc}, each data parallel over its island's 4 devices (parameters and optimizer "
                  f"update replicated per device, as in the JAX step); {spread(dp_name)}",
                  paired=paired_ratio(rates[dp_name], rates["jax"]))
    for name, losses in curves.items():
        yield loss_row(name, losses, first["losses"])


def loss_row(variant: str, losses: list[float], jax_losses: list[float]) -> Row:
    """How far a Pathways loss curve strays from plain JAX's over the same steps."""
    diff = max(abs(a - b) for a, b in zip(losses, jax_losses, strict=True))
    return row("transformer", variant, f"loss curve max |diff| ({len(losses)} steps)", "abs", diff, None, "<= 1e-3",
               diff <= 1e-3, "losses: " + ", ".join(f"{v:.4f}" for v in losses), ratio=None)


def bench_transformer_gpu(ctx: Ctx) -> Iterator[Row]:
    """`python -m bench --gpu`: the training step through `pw.jit` on a one-GPU slice against the
    same step as plain `jax.jit` on the same GPU (its own process), windows alternating as in
    bench_transformer; at the CPU table's size, and at a larger one whose step the GPU's compute
    dominates rather than dispatch."""
    from bench import model, pwside

    steps, timed, windows = 10, (3 if ctx.quick else 10), (2 if ctx.quick else 8)
    sizes = {"CPU table's model": model.Config(),
             "larger model": model.Config(d=1024, layers=8, heads=8, ff=4096, seq=256, batch=32)}
    for label, c in sizes.items():
        cfg = c.to_dict()
        jx = JaxServer(ctx.env(BENCH_JAX_DEVICES="1"), "transformer_serve", {"cfg": cfg, "steps": steps})
        try:
            step = pwside.spmd_trainer(cfg, devices=1)
            losses = pwside.loss_curve(step, steps)
            jrates: list[float] = []
            prates: list[float] = []
            for w in range(windows):
                jrates.append(float(jx.ask(str(timed))["tokens_per_s"]))
                prates += pwside.throughput(step, c, steps + w * (timed + 1), timed, 1)
            first = jx.first()
        finally:
            jx.close()
        name = f"pw.jit, 1 GPU, {label}"
        desc = (f"decoder-only, {first['params'] / 1e6:.1f}M params, d={c.d}, {c.layers} layers, batch "
                f"{c.batch}x{c.seq} tokens, optax adamw; JAX: jax.jit on the same GPU; median of {windows} "
                f"windows of {timed} steps alternating with JAX's: " + "/".join(f"{v:,.0f}" for v in prates)
                + " vs JAX " + "/".join(f"{v:,.0f}" for v in jrates))
        pw_val, jx_val = defs.median(prates), defs.median(jrates)
        yield row("transformer", name, "tokens/s", "1/s", pw_val, jx_val, ">= 0.97x JAX", pw_val >= 0.97 * jx_val,
                  desc, paired=paired_ratio(prates, jrates))
        yield loss_row(name, losses, first["losses"])
