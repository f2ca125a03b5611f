"""A small decoder-only transformer (a few million parameters) and its optax training step, in
one piece (plain JAX SPMD, `pw.jit`) and split in two pipeline stages (two islands)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

F32 = jnp.float32


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d: int = 256
    layers: int = 4
    heads: int = 4
    ff: int = 1024
    seq: int = 64
    batch: int = 8
    lr: float = 1e-3

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def init_params(c: Config, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)

    def dense(i: int, o: int) -> np.ndarray:
        return (rng.standard_normal((i, o)) / math.sqrt(i)).astype(np.float32)

    layers = []
    for _ in range(c.layers):
        layers.append({
            "ln1": np.ones((c.d,), np.float32), "ln2": np.ones((c.d,), np.float32),
            "qkv": dense(c.d, 3 * c.d), "proj": dense(c.d, c.d),
            "up": dense(c.d, c.ff), "down": dense(c.ff, c.d),
        })
    return {
        "embed": (rng.standard_normal((c.vocab, c.d)) * 0.02).astype(np.float32),
        "pos": (rng.standard_normal((c.seq, c.d)) * 0.02).astype(np.float32),
        "layers": layers,
        "ln_f": np.ones((c.d,), np.float32),
        "head": dense(c.d, c.vocab),
    }


def param_count(params: Any) -> int:
    return int(sum(np.prod(np.shape(p)) for p in jax.tree_util.tree_leaves(params)))


def batch(c: Config, i: int) -> np.ndarray:
    """Deterministic token batches with structure to learn: noisy arithmetic sequences."""
    rng = np.random.default_rng(1000 + i)
    start = rng.integers(0, c.vocab, (c.batch, 1))
    stride = rng.integers(1, 4, (c.batch, 1))
    toks = (start + stride * np.arange(c.seq + 1)[None, :]) % c.vocab
    noise = rng.random((c.batch, c.seq + 1)) < 0.1
    toks = np.where(noise, rng.integers(0, c.vocab, toks.shape), toks)
    return toks.astype(np.int32)


def _norm(x: Any, g: Any) -> Any:
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + F32(1e-5)) * g


def _block(c: Config, p: dict[str, Any], x: Any) -> Any:
    b, t, d = x.shape
    hd = d // c.heads
    qkv = _norm(x, p["ln1"]) @ p["qkv"]
    q, k, v = jnp.split(qkv.reshape(b, t, 3, c.heads, hd), 3, axis=2)
    q, k, v = (a[:, :, 0].transpose(0, 2, 1, 3) for a in (q, k, v))
    att = (q @ k.transpose(0, 1, 3, 2)) * F32(1.0 / math.sqrt(hd))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    att = jax.nn.softmax(jnp.where(mask, att, F32(-1e9)), axis=-1)
    y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + y @ p["proj"]
    return x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def stage1_forward(c: Config, p1: dict[str, Any], tokens: Any) -> Any:
    x = p1["embed"][tokens[:, :-1]] + p1["pos"][None]
    for lp in p1["layers"]:
        x = _block(c, lp, x)
    return x


def stage2_loss(c: Config, p2: dict[str, Any], h: Any, tokens: Any) -> Any:
    x = h
    for lp in p2["layers"]:
        x = _block(c, lp, x)
    logits = _norm(x, p2["ln_f"]) @ p2["head"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    tgt = tokens[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], axis=-1))


def split(c: Config, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    k = c.layers // 2
    p1 = {"embed": params["embed"], "pos": params["pos"], "layers": params["layers"][:k]}
    p2 = {"layers": params["layers"][k:], "ln_f": params["ln_f"], "head": params["head"]}
    return p1, p2


def loss_fn(c: Config, params: dict[str, Any], tokens: Any) -> Any:
    p1, p2 = split(c, params)
    return stage2_loss(c, p2, stage1_forward(c, p1, tokens), tokens)


def optimizer(c: Config) -> optax.GradientTransformation:
    return optax.adamw(c.lr, weight_decay=0.01)


def make_train_step(c: Config, opt: optax.GradientTransformation) -> Any:
    def train_step(params: Any, state: Any, tokens: Any) -> Any:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(c, p, tokens))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return train_step


def flat_state(fn: Any, treedef: Any, state_arg: int, state_out: int) -> Any:
    """`fn` with its optimizer state argument and result as a flat list of arrays: jax.export
    cannot serialize optax's namedtuple states, and a flat list crosses the wire as is."""

    def wrapped(*args: Any) -> Any:
        call = list(args)
        call[state_arg] = jax.tree_util.tree_unflatten(treedef, call[state_arg])
        out = list(fn(*call))
        out[state_out] = jax.tree_util.tree_leaves(out[state_out])
        return tuple(out)

    wrapped.__name__ = getattr(fn, "__name__", "fn")
    return wrapped


# ---- the two pipeline stages (GPipe-style micro-batches, gradients averaged) ----

def make_stage_fns(c: Config, opt: optax.GradientTransformation) -> dict[str, Any]:
    def s1_fwd(p1: Any, tokens: Any) -> Any:
        return stage1_forward(c, p1, tokens)

    def s2_step(p2: Any, h: Any, tokens: Any) -> Any:
        loss, (g2, dh) = jax.value_and_grad(lambda p, x: stage2_loss(c, p, x, tokens), argnums=(0, 1))(p2, h)
        return loss, g2, dh

    def s1_bwd(p1: Any, tokens: Any, dh: Any) -> Any:
        _, vjp = jax.vjp(lambda p: stage1_forward(c, p, tokens), p1)
        return vjp(dh)[0]

    def update(params: Any, state: Any, grads: Any) -> Any:
        g = jax.tree_util.tree_map(lambda *gs: sum(gs[1:], gs[0]) / F32(len(gs)), *grads)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    def mean_loss(losses: Any) -> Any:
        return sum(losses[1:], losses[0]) / F32(len(losses))

    return {"s1_fwd": s1_fwd, "s2_step": s2_step, "s1_bwd": s1_bwd, "update": update, "mean_loss": mean_loss}
