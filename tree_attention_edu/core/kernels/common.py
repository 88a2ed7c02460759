"""What every local kernel shares: the backend it runs on, and moving a cache between the
"bthd" and "bhtd" layouts (`core.inputs.LAYOUTS`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from .. import inputs, validate
from ..names import Layout


def default_backend() -> str:
    """JAX's default backend ("cpu", "gpu", "tpu"); one place for tests to stand in a GPU."""
    return jax.default_backend()


def to_layout(x: Array, src: Layout, dst: Layout) -> Array:
    """Move a K or V array between the "bthd" and "bhtd" layouts (a copy if they differ)."""
    validate.check_choice(src, inputs.LAYOUTS, "src")
    validate.check_choice(dst, inputs.LAYOUTS, "dst")
    if len(validate.shape_of(x, "x")) != 4:
        raise ValueError(
            f"`x` must have rank 4, [batch, kv_len, kv_heads, dim] or [batch, "
            f"kv_heads, kv_len, dim], got shape {tuple(x.shape)}."
        )
    return swap_layout(x, src, dst)


def swap_layout(x: Array, src: Layout, dst: Layout) -> Array:
    """`to_layout` without its checks, for a rank-4 cache of a checked layout."""
    return x if src == dst else jnp.swapaxes(x, 1, 2)
