"""Devices and meshes: simulated CPU devices for laptops, 1-D and 2-level meshes for clusters,
and the few facts about a mesh that the sharded decoders need.

On a laptop, `simulate_devices(8)` splits the CPU into 8 XLA devices; it must run before
JAX initialises its backends (the first computation or `jax.devices()` call). On a GPU
cluster the devices are real and come from `jax.distributed.initialize()` (see
`tree_attention_edu.cluster.launch`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.sharding import AbstractMesh, AxisType, Mesh

from . import inputs, masks, validate
from .names import Layout


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
    validate.check_int(n, "n", example="`simulate_devices(8)`")
    try:
        # Public API only: JAX accepts this option until its backends exist, and afterwards
        # raises RuntimeError for any value other than the one it started with.
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        have = jax.device_count()  # JAX has started; its device count is fixed
        if have < n:
            raise _simulate_too_late(n, have, jax.default_backend()) from None


def mesh_devices(n: int, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The first `n` devices, ordered by (process, id): process i's devices are contiguous,
    so in a ("node", "gpu") mesh each node is one process (one machine)."""
    devs = sorted(
        jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id)
    )
    return devs[:n]


def make_mesh(
    shape: Sequence[int] | int,
    axis_names: Sequence[str] | str,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh for `shard_map`, with Auto axis types.

    `jax.make_mesh` defaults to Explicit axes in current JAX; the decoders take either kind
    (an Explicit mesh's inputs are resharded with `jax.reshard`), and this helper makes the
    Auto kind, whose shardings `jit` propagates.

    Args:
      shape: devices along each axis, e.g. `8` or `(2, 4)`.
      axis_names: one name per axis, outermost first, e.g. `("node", "gpu")`: "gpu" varies
        fastest, so the devices of one node are neighbours.
      devices: devices to use (default: all of them, in process order).
    """
    shape = _mesh_shape(shape)
    names = _mesh_axis_names(axis_names)
    devices = _mesh_device_list(devices)
    available = len(jax.devices() if devices is None else devices)
    _check_mesh_shape(shape, names, available, devices_given=devices is not None)
    devs = np.array(mesh_devices(math.prod(shape), devices), dtype=object).reshape(shape)
    return Mesh(devs, names, axis_types=(AxisType.Auto,) * len(shape))


def resolve_mesh(mesh: Any) -> Mesh | AbstractMesh:
    """The mesh a decoder runs on: `mesh`, or with `mesh=None` the one `jax.set_mesh` set
    (its abstract mesh, which is what a traced call may read)."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                "`mesh` is None and no mesh is set; pass `mesh=` (see "
                "tree_attention_edu.make_mesh) or call inside `with "
                "jax.set_mesh(mesh):`."
            )
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
            f"build one with tree_attention_edu.make_mesh(...)."
        )
    types = set(mesh.axis_types)
    if AxisType.Manual in types or len(types) > 1:
        raise ValueError(
            f"`mesh` has axis types {mesh.axis_types}; the decoders take a mesh "
            f"whose axes are all Auto (tree_attention_edu.make_mesh) or all "
            f"Explicit (jax.make_mesh's default)."
        )
    return mesh


def is_explicit(mesh: Mesh) -> bool:
    """All of the mesh's axes are Explicit (`jax.make_mesh`'s default)."""
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def check_seq_axes(seq_axes: Any, mesh: Mesh) -> tuple[str, ...]:
    """`seq_axes` normalised to a tuple of the mesh's axis names (None: all of them)."""
    return _check_seq_axes(seq_axes, tuple(mesh.axis_names))


def axis_size(mesh: Mesh, axes: Sequence[str]) -> int:
    """Number of devices spanned by `axes` of `mesh`."""
    return math.prod(mesh.shape[a] for a in axes)


def shard_index(mesh: Mesh, axes: Sequence[str]) -> Array:
    """Inside `shard_map`: this device's linear index along mesh `axes` (first axis outermost).

    The sequence shards of `core.decode` and of `llama.model`'s KV cache are laid out in this
    order, which is also the order of `lax.axis_index(axes)`, `lax.all_gather` and
    `lax.all_to_all` over the tuple `axes`.
    """
    idx = jnp.zeros((), jnp.int32)
    for ax in axes:
        idx = idx * mesh.shape[ax] + lax.axis_index(ax)
    return idx


def ring_permutation(mesh: Mesh, axes: Sequence[str], shift: int = 1) -> list[tuple[int, int]]:
    """`lax.ppermute` pairs that send shard `s` to shard `s + shift (mod p)`, shards numbered
    in the order of `axes` (as `shard_index`).

    `ppermute` over a tuple of axes numbers the devices in the *mesh's* axis order, whatever
    the tuple's order, while the shards follow the tuple: with `axes = ("gpu", "node")` on a
    `("node", "gpu")` mesh the two numberings differ, and a ring built on shard numbers
    would send blocks to the wrong neighbours. This translates one into the other.
    """
    axes = tuple(axes)
    sizes = [mesh.shape[a] for a in axes]
    in_mesh_order = sorted(axes, key=tuple(mesh.axis_names).index)
    p = math.prod(sizes)

    def device_number(coords: dict[str, int]) -> int:  # ppermute's numbering
        n = 0
        for a in in_mesh_order:
            n = n * mesh.shape[a] + coords[a]
        return n

    number = [0] * p
    for s, c in enumerate(itertools.product(*(range(n) for n in sizes))):
        number[s] = device_number(dict(zip(axes, c, strict=True)))
    return [(number[s], number[(s + shift) % p]) for s in range(p)]


def _varying_axes(x: Any) -> set[str]:
    """The mesh axes `x` varies over inside `shard_map` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; `.vma` before
    return set(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying_like(tree: Any, *refs: Any) -> Any:
    """Inside `shard_map`, give each leaf of `tree` the varying mesh axes of `refs` that it
    lacks (a scan carry a block produces varies wherever the shard does; the operands of a
    `custom_vjp` must vary alike, or its cotangents' types differ); outside, a no-op."""
    axes: set[str] = set().union(*(_varying_axes(r) for r in refs))
    if not axes:
        return tree

    def cast(x: Any) -> Any:
        missing = tuple(sorted(axes - _varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def pad_cache(
    k: Array,
    v: Array,
    multiple: int | Mesh,
    *,
    kv_lengths: Array | None = None,
    layout: Layout = "bthd",
) -> tuple[Array, Array, Array]:
    """Pad a K/V cache along its sequence axis to a multiple of the device count, once.

    The sharded decoders split the cache into equal shards and never pad it themselves (a
    pad inside a jitted step would copy the whole cache onto every device on every call).
    Allocate the cache at a multiple of the device count, or call this once, outside the
    decode step, and pass the lengths it returns.

    Args:
      k: `[B, Tk, Hkv, D]` (or `[B, Hkv, Tk, D]` with `layout="bhtd"`).
      v: `[B, Tk, Hkv, Dv]`, like `k`.
      multiple: the device count to pad to a multiple of, or a mesh (all of its devices).
      kv_lengths: `[B]` valid lengths, or None (all `Tk` keys are valid).
      layout: "bthd" or "bhtd".

    Returns:
      `(k, v, kv_lengths)`: zero-padded K and V of length `ceil(Tk / p) · p`, and `[B]` int32
      lengths that mask the padding.
    """
    inputs.check_layout(layout)
    p = (
        multiple.size
        if isinstance(multiple, Mesh)
        else validate.check_int(
            multiple, "multiple", example="`pad_cache(k, v, 8)` or `pad_cache(k, v, mesh)`"
        )
    )
    ks, vs = validate.shape_of(k, "k"), validate.shape_of(v, "v")
    ax = inputs.SEQ_AXIS[layout]
    if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3]:
        raise ValueError(
            f"`k` {ks} and `v` {vs} must agree on all but their last axis, as "
            f"rank-4 caches of layout {layout!r}."
        )
    inputs.check_kv_lengths(kv_lengths, ks[0])
    tk = ks[ax]
    lengths = masks.clamp_lengths(kv_lengths, ks[0], tk)
    pad = (-tk) % p
    if pad:
        widths = [(0, 0)] * 4
        widths[ax] = (0, pad)
        k, v = jnp.pad(k, widths), jnp.pad(v, widths)
    return k, v, lengths


def check_divisible(kv_len: int, p: int, axes: Sequence[str]) -> None:
    """The sharded decoders split the cache into p equal shards: `kv_len` must divide."""
    if kv_len % p:
        raise ValueError(
            f"the cache (`k`, `v`) holds `kv_len` = {kv_len} keys, which the {p} devices of "
            f"`seq_axes` "
            f"{tuple(axes)} do not divide; the decoders never pad (it would copy the cache on "
            f"every call). Pad it once with `k, v, kv_lengths = tae.pad_cache(k, v, {p}, "
            f"kv_lengths=kv_lengths)` (or allocate it at a multiple of {p})."
        )


def _check_mesh_shape(
    shape: tuple[int, ...],
    axis_names: tuple[str, ...],
    available: int,
    *,
    devices_given: bool = False,
) -> None:
    """`make_mesh`'s normalised `shape` and `axis_names` against the devices available."""
    if not axis_names:
        raise ValueError("`axis_names` is empty; give one name per mesh axis, e.g. 'x'.")
    if len(shape) != len(axis_names):
        raise ValueError(
            f"`shape` {shape} has {len(shape)} axes but `axis_names` {axis_names} has "
            f"{len(axis_names)}; give one name per axis, e.g. make_mesh((2, 4), "
            f"('node', 'gpu'))."
        )
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"`axis_names` {axis_names} repeats a name; name each mesh axis once.")
    if any(int(s) < 1 for s in shape):
        raise ValueError(
            f"`shape` {shape} has an axis of size < 1; every axis needs at least one device."
        )
    need = math.prod(shape)
    if need > available:
        if devices_given:
            raise ValueError(
                f"`shape` {shape} needs {need} devices but `devices` holds {available}; pass "
                f"more devices or a smaller shape."
            )
        raise ValueError(
            f"`shape` {shape} needs {need} devices but JAX sees {available}. "
            f"On CPU call `tree_attention_edu.simulate_devices({need})` before any JAX "
            f"computation (or start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need})."
        )


def _check_seq_axes(seq_axes: Any, mesh_axes: tuple[str, ...]) -> tuple[str, ...]:
    """Normalise `seq_axes` (None, a name, or names) and check each is a mesh axis."""
    if seq_axes is None:
        return tuple(mesh_axes)
    if isinstance(seq_axes, str):
        axes: tuple = (seq_axes,)
    elif isinstance(seq_axes, list | tuple) and all(isinstance(a, str) for a in seq_axes):
        axes = tuple(seq_axes)
    else:
        raise TypeError(
            f"`seq_axes` must be a mesh axis name or a sequence of names, e.g. 'x' or "
            f"('node', 'gpu'), got {seq_axes!r}; the mesh's axes are {tuple(mesh_axes)}."
        )
    if not axes:
        raise ValueError("`seq_axes` is empty; name at least one mesh axis to shard keys over.")
    if len(set(axes)) != len(axes):
        raise ValueError(f"`seq_axes` {axes} repeats an axis; name each mesh axis once.")
    unknown = [a for a in axes if a not in mesh_axes]
    if unknown:
        raise ValueError(
            f"`seq_axes` names {unknown}, which are not axes of the mesh {tuple(mesh_axes)}. "
            f"Pass a subset of the mesh's axis names, outermost first."
        )
    return axes


def _simulate_too_late(requested: int, have: int, platform: str) -> RuntimeError:
    return RuntimeError(
        f"JAX is already initialised with {have} {platform} device(s), fewer than the "
        f"{requested} requested; the device count cannot change once JAX has started. "
        f"Restart the Python process (in Jupyter: Kernel > Restart) and call "
        f"`tree_attention_edu.simulate_devices({requested})` before any JAX computation, "
        f"or start Python with XLA_FLAGS=--xla_force_host_platform_device_count={requested}."
    )


def _mesh_shape(shape: Any) -> tuple[int, ...]:
    """`make_mesh`'s `shape`: an int or a sequence of ints, as a tuple."""
    example = "8 or (2, 4)"
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool | np.bool_):
        return (int(shape),)
    if not isinstance(shape, list | tuple | np.ndarray):
        raise TypeError(
            f"`shape` must be an int or a sequence of ints, e.g. {example}, got "
            f"{validate.describe(shape)}."
        )
    for s in shape:
        if isinstance(s, bool | np.bool_) or not isinstance(s, (int, np.integer)):
            raise TypeError(
                f"`shape` must hold ints (devices per axis), e.g. {example}, got "
                f"{validate.describe(s)} in {tuple(shape)}."
            )
    if len(shape) == 0:
        raise ValueError(f"`shape` is empty; give at least one axis, e.g. {example}.")
    return tuple(int(s) for s in shape)


def _mesh_axis_names(axis_names: Any) -> tuple[str, ...]:
    """`make_mesh`'s `axis_names`: a name or a sequence of names, as a tuple."""
    if isinstance(axis_names, str):
        return (axis_names,)
    if not isinstance(axis_names, list | tuple) or not all(isinstance(a, str) for a in axis_names):
        raise TypeError(
            f"`axis_names` must be a name or a sequence of names, e.g. 'x' or "
            f"('node', 'gpu'), got {validate.describe(axis_names)}."
        )
    return tuple(axis_names)


def _mesh_device_list(devices: Any) -> list | None:
    """`make_mesh`'s `devices`: None, or a non-empty sequence of `jax.Device`s."""
    if devices is None:
        return None
    if isinstance(devices, jax.Device) or not isinstance(devices, list | tuple | np.ndarray):
        raise TypeError(
            f"`devices` must be a sequence of jax devices, e.g. jax.devices()[:4], "
            f"got {validate.describe(devices)}."
        )
    devs = list(np.asarray(devices, dtype=object).ravel())
    bad = [d for d in devs if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(
            f"`devices` must hold jax devices (from jax.devices()), got "
            f"{validate.describe(bad[0])}."
        )
    if not devs:
        raise ValueError("`devices` is empty; pass None for all devices, or some of jax.devices().")
    if len(set(devs)) != len(devs):
        raise ValueError(
            f"`devices` names a device more than once ({len(devs)} entries, "
            f"{len(set(devs))} distinct); a mesh places each device once."
        )
    return devs
