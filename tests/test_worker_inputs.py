"""The worker's executables check each input's shape and dtype before the jitted call
(server/worker/executable.py, `Runnable.__call__`), also once their fast paths have accepted
arrays of the same sharding: a training step's state fed back is checked by the identity of its
sharding and aval objects alone, and an array that shares only the sharding is checked in full."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from server.worker.executable import Executable


def _plus_one() -> Executable:
    spec = jax.ShapeDtypeStruct((4,), np.float32)
    blob = jax.export.export(jax.jit(lambda x: x + 1))(spec).serialize()
    return Executable(bytes(blob), jax.devices()[:1])


def test_a_state_fed_back_runs_and_an_array_of_the_same_sharding_is_still_checked() -> None:
    ex = _plus_one()
    x = ex([np.zeros(4, np.float32)])[0]
    for _ in range(3):  # its own outputs, fed back: the fast paths
        x = ex([x])[0]
    assert np.asarray(x).tolist() == [4.0] * 4
    wrong_shape = jax.device_put(jnp.zeros(5, jnp.float32), x.sharding)
    with pytest.raises(ValueError, match=r"input 0 has shape \(5,\), expected \(4,\)"):
        ex([wrong_shape])
    wrong_dtype = jax.device_put(jnp.zeros(4, jnp.int32), x.sharding)
    with pytest.raises(ValueError, match="input 0 has dtype int32, expected float32"):
        ex([wrong_dtype])
    assert np.asarray(ex([x])[0]).tolist() == [5.0] * 4  # the accepted state still runs
