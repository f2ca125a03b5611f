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


# ---- the two pipeline stages ----
#
# Every function below is the code of ONE device, pmap style: `pw.pmap` maps it over a stage's
# slice, with parameters and optimizer state kept as one copy per device, stacked along a leading
# axis (as a replicated array is). With more than one device per stage, the stage is data
# parallel; the per-micro-batch computations still never communicate (each device returns its own
# partial gradients) and only the once-per-step update sums them over the devices. Workers launch
# a computation without collectives as soon as its inputs land, so stage 1 works on micro-batch
# k+1 while stage 2 works on micro-batch k; one with collectives first waits for everything
# before it on its devices. (`pw.jit` would not do here: it marks every partitioned function as
# possibly communicating, so workers would serialize the stages again.)
#
# Stage 1's backward does not recompute its forward: the forward also returns the residuals of
# its VJP (the activations the backward needs), which stay on stage 1's island, and the backward
# rebuilds the VJP from them (`StageVJP`).

DATA = "data"


class StageVJP:
    """`jax.vjp` of `fwd(params, *args)` with respect to `params`, split into two computations.

    `forward` returns the output and the VJP's residuals as a flat list of arrays, leaving out
    those that are just the parameters (the backward gets the parameters as an input anyway, so
    they are not copied); `backward` rebuilds the VJP (a pytree: the residuals are its leaves)
    from the parameters and the residuals and applies it to a cotangent. The VJP's structure is
    kept from the forward's trace, per residual signature: trace the forward first.
    """

    def __init__(self, fwd: Any) -> None:
        self.fwd = fwd
        self._plans: dict[Any, tuple[Any, list[int]]] = {}

    def _vjp_leaves(self, params: Any, args: tuple[Any, ...]) -> tuple[Any, list[Any], Any]:
        out, vjp = jax.vjp(lambda p: self.fwd(p, *args), params)
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        return out, leaves, tree

    def _param_positions(self, params: Any, args: tuple[Any, ...]) -> list[int]:
        """Per VJP leaf: the index of the parameter leaf it is, or -1 (a computed residual)."""
        # traced from the same values (tracers included), so in the same context (sharding, dtypes)
        closed = jax.make_jaxpr(lambda p, a: self._vjp_leaves(p, a)[1])(params, args)
        n = len(jax.tree_util.tree_leaves(params))
        invars = {id(v): i for i, v in enumerate(closed.jaxpr.invars[:n])}
        return [invars.get(id(v), -1) for v in closed.jaxpr.outvars]

    @staticmethod
    def _key(residuals: list[Any]) -> tuple[Any, ...]:
        return tuple((tuple(r.shape), str(r.dtype)) for r in residuals)

    def forward(self, params: Any, *args: Any) -> tuple[Any, list[Any]]:
        out, leaves, tree = self._vjp_leaves(params, args)
        positions = self._param_positions(params, args)
        if len(positions) != len(leaves):
            raise RuntimeError("the VJP's structure differs between two traces of the same function")
        residuals = [x for x, k in zip(leaves, positions, strict=True) if k < 0]
        self._plans[self._key(residuals)] = (tree, positions)
        return out, residuals

    def backward(self, params: Any, residuals: list[Any], cotangent: Any) -> Any:
        plan = self._plans.get(self._key(residuals))
        if plan is None:
            raise RuntimeError("StageVJP.backward before a forward with these shapes was traced")
        tree, positions = plan
        p = jax.tree_util.tree_leaves(params)
        it = iter(residuals)
        vjp = jax.tree_util.tree_unflatten(tree, [p[k] if k >= 0 else next(it) for k in positions])
        return vjp(cotangent)[0]


def make_pipeline_fns(c: Config, opt: optax.GradientTransformation, devices: int) -> dict[str, Any]:
    """Per-device code of a 2-stage pipeline step over `devices` devices per stage (map each with
    axis name "data"):

    - s1_fwd(p1, tokens) -> (h, residuals)                      stage 1, per micro-batch
    - s2_step(p2, h, tokens) -> (loss, g2, dh)                  stage 2, per micro-batch
    - s1_bwd(p1, residuals, dh) -> g1                           stage 1, per micro-batch
    - update(params, state, [g, ...]) -> (params, state)        stage 1, once per step
    - update_loss(params, state, [g, ...], [loss, ...]) -> (params, state, mean loss)   stage 2

    A device's loss is the mean over its tokens of the micro-batch; the updates average the
    gradients over devices and micro-batches (equal shares): the gradient of the batch's mean loss."""
    s1 = StageVJP(lambda p1, tokens: stage1_forward(c, p1, tokens))

    def s1_fwd(p1: Any, tokens: Any) -> Any:
        return s1.forward(p1, tokens)

    def s2_step(p2: Any, h: Any, tokens: Any) -> Any:
        loss, (g2, dh) = jax.value_and_grad(lambda p, x: stage2_loss(c, p, x, tokens), argnums=(0, 1))(p2, h)
        return loss, g2, dh

    def s1_bwd(p1: Any, residuals: list[Any], dh: Any) -> Any:
        return s1.backward(p1, residuals, dh)

    def mean_grads(grads: list[Any]) -> Any:
        # add this device's micro-batches first: one all-reduce per parameter
        scale = F32(devices * len(grads))
        return jax.tree_util.tree_map(lambda *gs: jax.lax.psum(sum(gs[1:], gs[0]), DATA) / scale, *grads)

    def update(params: Any, state: Any, grads: list[Any]) -> Any:
        updates, state = opt.update(mean_grads(grads), state, params)
        return optax.apply_updates(params, updates), state

    def update_loss(params: Any, state: Any, grads: list[Any], losses: list[Any]) -> Any:
        params, state = update(params, state, grads)
        return params, state, jax.lax.psum(sum(losses[1:], losses[0]), DATA) / F32(devices * len(losses))

    return {"s1_fwd": s1_fwd, "s2_step": s2_step, "s1_bwd": s1_bwd, "update": update, "update_loss": update_loss}


def per_device(tree: Any, devices: int) -> Any:
    """One copy per device, stacked along a new leading axis (what pmap-style code maps over)."""
    return jax.tree_util.tree_map(lambda x: np.broadcast_to(np.asarray(x), (devices, *np.shape(x))), tree)
