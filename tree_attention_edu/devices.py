"""Devices and meshes: simulated CPU devices for laptops, 1-D and 2-level meshes for clusters.

On a laptop, `simulate_devices(8)` splits the CPU into 8 XLA devices; it must run before
JAX initialises its backends (the first computation or `jax.devices()` call). On a GPU
cluster the devices are real and come from `jax.distributed.initialize()` (see
`tree_attention_edu.launch`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from . import _checks


def simulate_devices(n: int) -> None:
    """Arrange for JAX to see `n` CPU devices. Call before any JAX computation.

    If JAX has already started with at least `n` devices, this does nothing. If it started
    with fewer, it raises a `RuntimeError` that says how to restart with `n`.

    Example:
        ```python
        import tree_attention_edu as tae
        tae.simulate_devices(8)   # first thing, before any JAX computation

        import jax
        assert jax.device_count() == 8
        ```
    """
    _checks.check_int(n, "n", example="`simulate_devices(8)`")
    try:
        # Public API only: JAX accepts this option until its backends exist, and afterwards
        # raises RuntimeError for any value other than the one it started with.
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        have = jax.device_count()  # JAX has started; its device count is fixed
        if have < n:
            raise _checks.simulate_too_late(n, have, jax.default_backend()) from None


def mesh_devices(n: int, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The first `n` devices, ordered by (process, id): process i's devices are contiguous,
    so in a ("node", "gpu") mesh each node is one process (one machine)."""
    devs = sorted(jax.devices() if devices is None else devices,
                  key=lambda d: (d.process_index, d.id))
    return devs[:n]


def make_mesh(
    shape: Sequence[int] | int,
    axis_names: Sequence[str] | str,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh for `shard_map`, with Auto axis types (what `shard_map` code expects).

    `jax.make_mesh` defaults to Explicit axes in current JAX; this helper does not.

    Args:
      shape: devices along each axis, e.g. `8` or `(2, 4)`.
      axis_names: one name per axis, outermost first, e.g. `("node", "gpu")`: "gpu" varies
        fastest, so the devices of one node are neighbours.
      devices: devices to use (default: all of them, in process order).
    """
    shape = _checks.mesh_shape(shape)
    names = _checks.mesh_axis_names(axis_names)
    devices = _checks.mesh_device_list(devices)
    available = len(jax.devices() if devices is None else devices)
    _checks.check_mesh_shape(shape, names, available, devices_given=devices is not None)
    devs = np.array(mesh_devices(math.prod(shape), devices), dtype=object).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Auto,) * len(shape))


def axis_size(mesh: Mesh, axes: Sequence[str]) -> int:
    """Number of devices spanned by `axes` of `mesh`."""
    return math.prod(mesh.shape[a] for a in axes)


def shard_index(mesh: Mesh, axes: Sequence[str]) -> jax.Array:
    """Inside `shard_map`: this device's linear index along mesh `axes` (first axis outermost).

    The sequence shards of `decode` and of `model`'s KV cache are laid out in this order.
    """
    idx = 0
    for ax in axes:
        idx = idx * mesh.shape[ax] + jax.lax.axis_index(ax)
    return idx
