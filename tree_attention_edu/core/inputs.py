"""The attention inputs' contract, shared by every function that takes q, k and v.

Layout follows `jax.nn.dot_product_attention`: `q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`,
`v [B, Tk, Hkv, Dv]`, with grouped-query attention when `Hq` is a multiple of `Hkv`, and
`kv_lengths [B]` integer valid lengths. These checks read shapes, dtypes and static
arguments only: the values of `kv_lengths` are never inspected, so a call behaves the same
eagerly and under `jax.jit`. A length outside `[0, Tk]` is clamped into it on every path
(`masks.clamp_lengths`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .names import LAYOUTS, Layout
from .validate import check_float, check_shape, is_number, is_traced, shape_of

# Cache layouts (`names.Layout`): "bthd" is `k [B, Tk, Hkv, D]`
# (`jax.nn.dot_product_attention`'s), "bhtd" the head-major `k [B, Hkv, Tk, D]` that a decode
# kernel streams fastest.
SEQ_AXIS: dict[Layout, int] = {"bthd": 1, "bhtd": 2}
"""Axis of `k` and `v` that holds the keys, per layout."""


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


def check_qk(q: Any, k: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate q and k alone (for functions that take no values, like `posterior`)."""
    qs, ks = shape_of(q, "q"), shape_of(k, "k")
    for name, s, layout in (
        ("q", qs, "[batch, q_len, q_heads, head_dim]"),
        ("k", ks, "[batch, kv_len, kv_heads, head_dim]"),
    ):
        if len(s) != 4:
            raise ValueError(
                f"`{name}` must have rank 4, {layout}, got shape {s}. "
                f"For a single sequence or head add the axis, e.g. `{name}[None]` or "
                f"`{name}[:, :, None, :]`."
            )
    check_float(q, "q")
    check_float(k, "k")
    if qs[0] != ks[0]:
        raise ValueError(f"batch sizes differ: `q` has {qs[0]}, `k` has {ks[0]}; they must match.")
    if qs[3] != ks[3]:
        raise ValueError(
            f"head_dim differs: `q` has D={qs[3]}, `k` has D={ks[3]}; q·k needs the same last axis."
        )
    hq, hkv = qs[2], ks[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"`q` has {hq} heads and `k` has {hkv}; q_heads must be a multiple of kv_heads "
            f"(grouped-query attention: query head h reads kv head h // (q_heads // kv_heads)). "
            f"Use a kv_heads that divides {hq}."
        )
    if ks[1] == 0:
        raise ValueError("`k` has kv_len 0; attention needs at least one key position.")
    if qs[3] == 0:
        raise ValueError(
            "`q` and `k` have head_dim 0: there is no query-key product to score. Give them "
            "a last axis of size >= 1."
        )
    return qs, ks


def check_qkv(q: Any, k: Any, v: Any, kv_lengths: Any = None, *, layout: Layout = "bthd") -> Dims:
    """Validate the attention inputs and return their sizes (in "bthd" terms whatever the
    cache's `layout`)."""
    k, v = bthd_view(k, layout, "k"), bthd_view(v, layout, "v")
    qs, ks = check_qk(q, k)
    vs = shape_of(v, "v")
    if len(vs) != 4:
        raise ValueError(f"`v` must have rank 4, [batch, kv_len, kv_heads, v_dim], got shape {vs}.")
    check_float(v, "v")
    if vs[:3] != ks[:3]:
        raise ValueError(
            f"`k` {ks} and `v` {vs} must agree on [batch, kv_len, kv_heads]; "
            f"they differ at axis {next(i for i in range(3) if ks[i] != vs[i])}."
        )
    if vs[3] == 0:  # refused here, by the argument's name, on every path (as head_dim 0 is)
        raise ValueError(
            "`v` has 0 value dims (its last axis): there is no value to average. Give `v` a "
            "last axis of size >= 1."
        )
    dims = Dims(qs[0], qs[1], qs[2], qs[3], ks[1], ks[2], vs[3])
    check_kv_lengths(kv_lengths, dims.batch)
    return dims


def check_kv_lengths(kv_lengths: Any, batch: int) -> None:
    """`kv_lengths` is a `[batch]` integer array (or None: every key is valid).

    Its values are not inspected (that would make a call behave differently under
    `jax.jit`): a length below 0 acts as 0 and one above the cache's length as that length,
    on every path and eagerly as under `jit` (`masks.clamp_lengths`).
    """
    if kv_lengths is None:
        return
    s = shape_of(kv_lengths, "kv_lengths")
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


def check_kv_offset(kv_offset: Any) -> Any:
    """`kv_offset`, a chunk's global position: one integer (a Python or numpy int, or a 0-d
    integer array, which may be traced: a device index times the shard length). Its value
    is not inspected; it may be negative (the chunk starts before position 0)."""
    if isinstance(kv_offset, int | np.integer) and not isinstance(kv_offset, bool | np.bool_):
        if not np.iinfo(np.int32).min <= int(kv_offset) <= np.iinfo(np.int32).max:
            raise ValueError(f"`kv_offset` must fit in int32, got {int(kv_offset)}.")
        return int(kv_offset)
    shape, dtype = getattr(kv_offset, "shape", None), getattr(kv_offset, "dtype", None)
    if shape == () and dtype is not None and jnp.issubdtype(dtype, jnp.integer):
        return kv_offset
    raise TypeError(
        f"`kv_offset` must be one integer (the global position of the chunk's first key), got "
        f"{type(kv_offset).__name__}"
        f"{' of shape ' + str(tuple(shape)) if shape is not None else ''}"
        f"{' and dtype ' + str(dtype) if dtype is not None else ''}; e.g. `kv_offset=1024`."
    )


def bthd_view(x: Any, layout: Layout, name: str = "k or v") -> Any:
    """Shape-and-dtype stand-in of a K or V array in "bthd" order, for validation."""
    check_layout(layout)
    if layout == "bthd":
        return x
    s = shape_of(x, name)
    if len(s) != 4:
        return x  # let check_qkv report the rank
    return jax.ShapeDtypeStruct((s[0], s[2], s[1], s[3]), x.dtype)


def check_zeta(zeta: Any, dims: Dims) -> None:
    want = (dims.batch, dims.q_len, dims.q_heads, dims.v_dim)
    got = shape_of(zeta, "zeta")
    check_float(zeta, "zeta")
    if got != want:
        raise ValueError(
            f"`zeta` must be shaped like the attention output [batch, q_len, q_heads, v_dim] "
            f"= {want}, got {tuple(zeta.shape)}."
        )


def resolve_scale(scale: Any, head_dim: int, dtype: Any = None) -> float:
    """`None` means 1/sqrt(D). (The paper writes no scale: pass `scale=1.0` for its convention.)

    The scale is static: it fixes the compiled program, so it must be a concrete Python or
    numpy number, not a traced value. If `dtype` is given, the scale must be finite in the
    dtype the scores are accumulated in (float32 unless the inputs are float64).
    """
    if scale is None:
        if head_dim < 1:
            raise ValueError(
                f"head_dim is {head_dim}; the default scale 1/sqrt(head_dim) needs head_dim >= 1."
            )
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool | str) or not is_number(scale):
        raise TypeError(
            f"`scale` must be a real number (or None for 1/sqrt(head_dim)), got "
            f"{type(scale).__name__} {scale!r}; pass e.g. `scale=0.125`."
        )
    if is_traced(scale):
        raise TypeError(
            "`scale` is a traced value (it was an argument of a jitted function); the scale is "
            "static. Mark it static (`jax.jit(f, static_argnames='scale')`), or fold a traced "
            "scale into the queries: `q * scale` with `scale=1.0`."
        )
    value = float(np.asarray(scale))
    if not np.isfinite(value):
        raise ValueError(f"`scale` must be a finite number, got {scale}.")
    if dtype is not None:
        acc = np.float64 if jnp.dtype(dtype) == jnp.float64 else np.float32
        if abs(value) > float(np.finfo(acc).max):
            raise ValueError(
                f"`scale` = {value:g} overflows {np.dtype(acc).name} (largest "
                f"{np.finfo(acc).max:.3g}), the dtype scores are accumulated in; use a smaller "
                f"scale or float64 inputs."
            )
    return value


def check_layout(layout: Any, known: tuple[str, ...] = LAYOUTS) -> None:
    if layout not in known:
        raise ValueError(
            f"`layout` must be one of {known}, got {layout!r}: 'bthd' is k [batch, kv_len, "
            f"kv_heads, head_dim] (jax.nn.dot_product_attention's), 'bhtd' is head-major "
            f"k [batch, kv_heads, kv_len, head_dim]."
        )


def check_like_output(x: Any, name: str, dims: Dims) -> None:
    """`x` (a source ζ or an estimate z) is a float array shaped like attention's output."""
    want = (dims.batch, dims.q_len, dims.q_heads, dims.v_dim)
    check_shape(
        shape_of(x, name), want, name, "[batch, q_len, q_heads, v_dim] (attention's output)"
    )
    check_float(x, name)


def check_head_groups(q_heads: Any, kv_heads: Any) -> None:
    if (
        isinstance(q_heads, int | np.integer)
        and isinstance(kv_heads, int | np.integer)
        and q_heads % kv_heads
    ):
        raise ValueError(
            f"`q_heads` ({q_heads}) must be a multiple of `kv_heads` ({kv_heads}) "
            f"(grouped-query attention); use a kv_heads that divides {q_heads}."
        )
