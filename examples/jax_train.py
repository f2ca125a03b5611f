"""An ordinary JAX training loop, with nothing of Pathways in it. On this machine:

    python examples/jax_train.py

On the cluster, unchanged, through the IFRT proxy (README, "Unmodified JAX programs"):

    JAX_PLATFORMS=proxy PATHWAYS_DEVICES=4 python examples/jax_train.py --steps 100
    pwctl submit examples/jax_train.py --proxy --devices 4 -- --steps 100

It fits a linear model to data sharded over every device JAX sees (there: the slice's) and
prints the loss every 10 steps: the same numbers on the cluster as on as many local CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4).
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def loss(w: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ w - y) ** 2)


@jax.jit
def step(w: jax.Array, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    value, grad = jax.value_and_grad(loss)(w, x, y)
    return w - 0.05 * grad, value


def main() -> None:
    parser = argparse.ArgumentParser(description="An ordinary JAX training loop.")
    parser.add_argument("--steps", type=int, default=50)
    steps = parser.parse_args().steps
    devices = jax.devices()
    rows = NamedSharding(Mesh(np.array(devices), ("data",)), P("data"))  # the batch split over devices
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8 * len(devices), 16)).astype(np.float32)
    y = x @ np.arange(16, dtype=np.float32)
    x, y = jax.device_put(x, rows), jax.device_put(y, rows)
    w = jnp.zeros(16, jnp.float32)
    print(f"{len(devices)} device(s)")
    for i in range(steps):
        w, value = step(w, x, y)
        if i % 10 == 0 or i == steps - 1:
            print(f"step {i}: loss {float(value):.4f}")


if __name__ == "__main__":
    main()
