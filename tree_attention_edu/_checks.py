"""Argument validation. Every error message the package raises is written here.

Each check names the argument that is wrong and says how to fix it, so a user
never has to read a traceback into JAX internals to learn that `Hq` must be a
multiple of `Hkv`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclass(frozen=True)
class Dims:
    """Sizes read off validated `q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`."""

    batch: int
    q_len: int
    q_heads: int
    head_dim: int
    kv_len: int
    kv_heads: int
    v_dim: int

    @property
    def group(self) -> int:
        """Query heads per kv head (1: multi-head, Hq: multi-query)."""
        return self.q_heads // self.kv_heads


def _shape(x: Any, name: str) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"`{name}` must be an array (jax or numpy), got {type(x).__name__}.")
    return tuple(int(s) for s in x.shape)


def check_float(x: Any, name: str) -> None:
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
        raise TypeError(
            f"`{name}` has dtype {x.dtype}; attention needs a floating dtype "
            f"(float16, bfloat16, float32 or float64). Cast it, e.g. `{name}.astype(jnp.float32)`."
        )


def check_qk(q: Any, k: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate q and k alone (for functions that take no values, like `posterior`)."""
    qs, ks = _shape(q, "q"), _shape(k, "k")
    for name, s, layout in (("q", qs, "[batch, q_len, q_heads, head_dim]"),
                            ("k", ks, "[batch, kv_len, kv_heads, head_dim]")):
        if len(s) != 4:
            raise ValueError(
                f"`{name}` must have rank 4, {layout}, got shape {s}. "
                f"For a single sequence or head add the axis, e.g. `{name}[None]` or "
                f"`{name}[:, :, None, :]`."
            )
    check_float(q, "q")
    check_float(k, "k")
    if qs[0] != ks[0]:
        raise ValueError(f"batch sizes differ: q has {qs[0]}, k has {ks[0]}; they must match.")
    if qs[3] != ks[3]:
        raise ValueError(
            f"head_dim differs: q has D={qs[3]}, k has D={ks[3]}; q·k needs the same last axis."
        )
    hq, hkv = qs[2], ks[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"q has {hq} heads and k has {hkv}; q_heads must be a multiple of kv_heads "
            f"(grouped-query attention: query head h reads kv head h // (q_heads // kv_heads)). "
            f"Use a kv_heads that divides {hq}."
        )
    if ks[1] == 0:
        raise ValueError("`k` has kv_len 0; attention needs at least one key position.")
    return qs, ks


def check_qkv(q: Any, k: Any, v: Any, kv_lengths: Any = None) -> Dims:
    """Validate the attention inputs and return their sizes."""
    qs, ks = check_qk(q, k)
    vs = _shape(v, "v")
    if len(vs) != 4:
        raise ValueError(
            f"`v` must have rank 4, [batch, kv_len, kv_heads, v_dim], got shape {vs}."
        )
    check_float(v, "v")
    if vs[:3] != ks[:3]:
        raise ValueError(
            f"`k` {ks} and `v` {vs} must agree on [batch, kv_len, kv_heads]; "
            f"they differ at axis {next(i for i in range(3) if ks[i] != vs[i])}."
        )
    dims = Dims(qs[0], qs[1], qs[2], qs[3], ks[1], ks[2], vs[3])
    check_kv_lengths(kv_lengths, dims.batch)
    return dims


def check_kv_lengths(kv_lengths: Any, batch: int) -> None:
    if kv_lengths is None:
        return
    s = _shape(kv_lengths, "kv_lengths")
    if s != (batch,):
        raise ValueError(
            f"`kv_lengths` must have shape [batch] = ({batch},), got {s}: one valid length "
            f"per sequence."
        )
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
        raise TypeError(
            f"`kv_lengths` must be integers, got dtype {kv_lengths.dtype}; "
            f"use e.g. `jnp.asarray(lengths, jnp.int32)`."
        )


def check_zeta(zeta: Any, dims: Dims) -> None:
    want = (dims.batch, dims.q_len, dims.q_heads, dims.v_dim)
    if _shape(zeta, "zeta") != want:
        raise ValueError(
            f"`zeta` must be shaped like the attention output [batch, q_len, q_heads, v_dim] "
            f"= {want}, got {tuple(zeta.shape)}."
        )


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """`None` means 1/sqrt(D). (The paper writes no scale: pass `scale=1.0` for its convention.)"""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not np.isfinite(scale):
        raise ValueError(f"`scale` must be a finite number, got {scale}.")
    return float(scale)


def check_branching(branching: int) -> None:
    if not isinstance(branching, int) or branching < 2:
        raise ValueError(f"`branching` must be an integer >= 2, got {branching!r}.")


def check_nonempty(states: Any, name: str = "states") -> None:
    if len(states) == 0:
        raise ValueError(f"`{name}` is empty; a reduction needs at least one state.")


# ---------------------------------------------------------------- devices and meshes


def check_mesh_shape(shape: tuple[int, ...], axis_names: tuple[str, ...], available: int) -> None:
    if len(shape) != len(axis_names):
        raise ValueError(
            f"mesh shape {shape} has {len(shape)} axes but axis_names {axis_names} has "
            f"{len(axis_names)}; give one name per axis."
        )
    if len(set(axis_names)) != len(axis_names):
        raise ValueError(f"mesh axis_names {axis_names} repeat a name; names must be unique.")
    if any(int(s) < 1 for s in shape):
        raise ValueError(f"mesh shape {shape} has an axis of size < 1.")
    need = math.prod(shape)
    if need > available:
        raise ValueError(
            f"mesh shape {shape} needs {need} devices but JAX sees {available}. "
            f"On CPU call `tree_attention_edu.simulate_devices({need})` before any JAX "
            f"computation (or start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need})."
        )


def check_seq_axes(seq_axes: Any, mesh_axes: tuple[str, ...]) -> tuple[str, ...]:
    """Normalise `seq_axes` (None, a name, or names) and check each is a mesh axis."""
    if seq_axes is None:
        return tuple(mesh_axes)
    axes = (seq_axes,) if isinstance(seq_axes, str) else tuple(seq_axes)
    if not axes:
        raise ValueError("`seq_axes` is empty; name at least one mesh axis to shard keys over.")
    unknown = [a for a in axes if a not in mesh_axes]
    if unknown:
        raise ValueError(
            f"`seq_axes` names {unknown}, which are not axes of the mesh {tuple(mesh_axes)}. "
            f"Pass a subset of the mesh's axis names, outermost first."
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"`seq_axes` {axes} repeats an axis.")
    return axes


def simulate_too_late(requested: int, have: int, platform: str) -> RuntimeError:
    return RuntimeError(
        f"JAX is already initialised with {have} {platform} device(s), fewer than the "
        f"{requested} requested; the device count cannot change once JAX has started. "
        f"Restart the Python process (in Jupyter: Kernel > Restart) and call "
        f"`tree_attention_edu.simulate_devices({requested})` before any JAX computation, "
        f"or start Python with XLA_FLAGS=--xla_force_host_platform_device_count={requested}."
    )


def check_kernel_name(name: str, known: tuple[str, ...]) -> None:
    if name not in known:
        raise ValueError(f"`local_kernel` must be one of {known}, got {name!r}.")


def shape_of(x: Any, name: str) -> tuple[int, ...]:
    """The shape of an array argument, or a TypeError naming it."""
    return _shape(x, name)


def check_layout(layout: Any, known: tuple[str, ...]) -> None:
    if layout not in known:
        raise ValueError(
            f"`layout` must be one of {known}, got {layout!r}: 'bthd' is k [batch, kv_len, "
            f"kv_heads, head_dim] (jax.nn.dot_product_attention's), 'bhtd' is head-major "
            f"k [batch, kv_heads, kv_len, head_dim]."
        )


def check_positive(value: Any, name: str) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")


def check_choice(value: Any, known: tuple[str, ...], name: str) -> None:
    if value not in known:
        raise ValueError(f"`{name}` must be one of {known}, got {value!r}.")
