"""Argument validation. Every error message the package raises is written here.

Each check names the argument that is wrong and says how to fix it, so a user
never has to read a traceback into JAX internals to learn that `Hq` must be a
multiple of `Hkv`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
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
        raise ValueError(
            f"batch sizes differ: `q` has {qs[0]}, `k` has {ks[0]}; they must match."
        )
    if qs[3] != ks[3]:
        raise ValueError(
            f"head_dim differs: `q` has D={qs[3]}, `k` has D={ks[3]}; q·k needs the same last "
            f"axis."
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


def check_qkv(q: Any, k: Any, v: Any, kv_lengths: Any = None, *, chunk: bool = False) -> Dims:
    """Validate the attention inputs and return their sizes.

    `chunk=True` means k and v are one chunk of a longer cache (`local_state`, the kernels):
    `kv_lengths` are then global and only their lower bound 0 is checked.
    """
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
    check_kv_lengths(kv_lengths, dims.batch, None if chunk else dims.kv_len)
    return dims


def check_kv_lengths(kv_lengths: Any, batch: int, kv_len: int | None = None) -> None:
    """`kv_lengths` is `[batch]` integers in `[0, kv_len]`.

    The range is checked where the value is concrete. Under `jax.jit` it cannot be; there
    a length below 0 acts as 0 and one above `kv_len` as `kv_len` on every path (the
    sharded decoders clip it, so their own padding is never visible).
    """
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
    values = concrete(kv_lengths)
    if values is None or not values.size:
        return
    if values.min() < 0 or (kv_len is not None and values.max() > kv_len):
        upper = "kv_len] = [0, " + str(kv_len) if kv_len is not None else "inf"
        raise ValueError(
            f"`kv_lengths` must lie in [0, {upper}], got {values.tolist()}; a length counts "
            f"the valid keys at the start of each sequence's cache."
        )


def check_zeta(zeta: Any, dims: Dims) -> None:
    want = (dims.batch, dims.q_len, dims.q_heads, dims.v_dim)
    got = _shape(zeta, "zeta")
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
            raise ValueError(f"head_dim is {head_dim}; the default scale 1/sqrt(head_dim) "
                             f"needs head_dim >= 1.")
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool | str) or not _is_number(scale):
        raise TypeError(
            f"`scale` must be a real number (or None for 1/sqrt(head_dim)), got "
            f"{type(scale).__name__} {scale!r}; pass e.g. `scale=0.125`."
        )
    if _is_traced(scale):
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


def _is_number(x: Any) -> bool:
    if isinstance(x, int | float | np.number):
        return True
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    return shape == () and dtype is not None and (
        jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))


def _is_traced(x: Any) -> bool:
    """True for an abstract value under `jit`/`grad`/`vmap` (no concrete number behind it)."""
    try:
        np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return True
    return False


def concrete(x: Any) -> np.ndarray | None:
    """`x` as a numpy array if it is concrete, or None if it is traced (under `jit`)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_branching(branching: int) -> None:
    check_int(branching, "branching", minimum=2, example="`branching=2` (a binary tree)")


def check_nonempty(states: Any, name: str = "states") -> None:
    if len(states) == 0:
        raise ValueError(f"`{name}` is empty; a reduction needs at least one state.")


def check_states_sequence(states: Any, name: str = "states") -> list:
    """A reduction's input: a non-empty list or tuple (a generator would be consumed)."""
    if not isinstance(states, list | tuple):
        raise TypeError(
            f"`{name}` must be a list or tuple of states, got {type(states).__name__}; "
            f"wrap an iterator in `list(...)`."
        )
    check_nonempty(states, name)
    return list(states)


def check_size(value: Any, name: str) -> None:
    """A non-negative int (a dimension that may be empty)."""
    check_int(value, name, minimum=0)


def check_float_dtype(dtype: Any, name: str = "dtype") -> None:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as err:
        raise TypeError(f"`{name}` must be a floating dtype such as jnp.float32, got "
                        f"{dtype!r}.") from err
    if dt not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
        raise TypeError(f"`{name}` must be a floating dtype (float16, bfloat16, float32 or "
                        f"float64), got {dt}.")


# ---------------------------------------------------------------- devices and meshes


def check_mesh_shape(shape: tuple[int, ...], axis_names: tuple[str, ...], available: int,
                     *, devices_given: bool = False) -> None:
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
        raise ValueError(
            f"`axis_names` {axis_names} repeats a name; name each mesh axis once."
        )
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


def check_seq_axes(seq_axes: Any, mesh_axes: tuple[str, ...]) -> tuple[str, ...]:
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


def cudnn_needs_gpu(backend: str) -> str:
    return (f"`local_kernel`='cudnn' needs an NVIDIA GPU with cuDNN (it calls "
            f"jax.nn.dot_product_attention(implementation='cudnn')), but JAX's default backend "
            f"is {backend!r}; use local_kernel='xla' (or 'auto', which picks xla here).")


def cudnn_dtype(dtype: Any) -> str:
    return (f"`local_kernel`='cudnn' takes float16 or bfloat16 inputs (cuDNN's flash "
            f"attention), got {dtype}; cast q, k, v or use local_kernel='xla'.")


def cudnn_head_dim(head_dim: int, v_dim: int, limit: int, capability: Any) -> str:
    cc = ".".join(str(c) for c in capability) if capability else "?"
    return (f"`local_kernel`='cudnn' needs head_dim a multiple of 8 and <= {limit} (compute "
            f"capability {cc}) and v_dim == head_dim, got head_dim={head_dim}, v_dim={v_dim}; "
            f"use local_kernel='xla'.")


def cudnn_v_dim(head_dim: int, v_dim: int) -> str:
    return (f"`v` must have v_dim == head_dim for the cudnn kernel "
            f"(jax.nn.dot_product_attention takes one head size), got head_dim={head_dim}, "
            f"v_dim={v_dim}; use local_kernel='xla' (kernels.xla_state).")


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
    check_int(value, name, minimum=1)


def check_choice(value: Any, known: tuple[str, ...], name: str) -> None:
    if value not in known:
        raise ValueError(f"`{name}` must be one of {known}, got {value!r}.")


# ---------------------------------------------------------------- plain values, keys, callables
# (bayes, hopfield, introspect, costmodel, model, make_mesh)

_INTEGRAL = (int, np.integer)
_REAL = (int, float, np.integer, np.floating)


def _describe(x: Any) -> str:
    """`x` in a few words for a message: its type and value (or shape and dtype)."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and getattr(x, "ndim", 0):
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, list | tuple) and len(repr(x)) > 60:
        return f"{type(x).__name__} of {len(x)} items"
    text = " ".join(repr(x).split())
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _is_symbolic(x: Any) -> bool:
    """A sympy expression: the cost model's formulas are also evaluated on symbols."""
    return hasattr(x, "free_symbols") and hasattr(x, "subs")


def check_int(value: Any, name: str, *, minimum: int | None = 1, symbolic: bool = False,
              example: str = "") -> Any:
    """An int (Python or numpy, not bool) of at least `minimum`: TypeError for another type,
    ValueError below the minimum. With `symbolic=True` a sympy expression passes unchecked.
    `example` (e.g. "`dim=64`") is quoted in the message."""
    if symbolic and not isinstance(value, _REAL) and _is_symbolic(value):
        return value
    eg = f", e.g. {example}" if example else ""
    if isinstance(value, bool | np.bool_) or not isinstance(value, _INTEGRAL):
        raise TypeError(f"`{name}` must be an int, got {_describe(value)}; pass a whole "
                        f"number{eg}.")
    if minimum is not None and value < minimum:
        what = {1: "a positive int", 0: "a non-negative int"}.get(minimum,
                                                                   f"an int >= {minimum}")
        raise ValueError(f"`{name}` must be {what}, got {value!r}{eg}.")
    return int(value)


def _interval(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"{'<' if high_open else '<='} {high:g}"


def check_real(value: Any, name: str, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False, finite: bool = True,
               symbolic: bool = False, traced: bool = False, hint: str = "") -> Any:
    """A real number (Python, numpy, or a 0-d numeric array), not NaN, finite unless
    `finite=False`, inside the given bounds. Returns it as a float.

    A traced scalar (under `jit`/`grad`) is a TypeError unless `traced=True`, where it is
    returned unchecked; with `symbolic=True` a sympy expression is returned unchecked."""
    if symbolic and not isinstance(value, _REAL) and _is_symbolic(value):
        return value
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    is_scalar_array = (shape == () and dtype is not None and not jnp.issubdtype(dtype, jnp.bool_)
                       and (jnp.issubdtype(dtype, jnp.floating)
                            or jnp.issubdtype(dtype, jnp.integer)))
    if isinstance(value, bool | np.bool_) or not (isinstance(value, _REAL)
                                                   or is_scalar_array):
        raise TypeError(
            f"`{name}` must be a real number, got {_describe(value)}"
            f"{'; ' + hint if hint else ''}."
        )
    number = concrete(value)
    if number is None:
        if traced:
            return value
        raise TypeError(
            f"`{name}` is a traced value (an argument of a jitted function), but it must be a "
            f"concrete number here; pass it as a static argument "
            f"(`jax.jit(f, static_argnames='{name}')`)."
        )
    x = float(number)
    bounds = _interval(low, high, low_open, high_open) if (low, high) != (None, None) else ""
    if math.isnan(x) or (finite and math.isinf(x)):
        raise ValueError(
            f"`{name}` must be a finite number{' ' + bounds if bounds else ''}, got {x}"
            f"{'; ' + hint if hint else ''}."
        )
    if ((low is not None and (x < low or (low_open and x == low)))
            or (high is not None and (x > high or (high_open and x == high)))):
        raise ValueError(f"`{name}` must be {bounds}, got {x:g}{'; ' + hint if hint else ''}.")
    return x


def check_bool(value: Any, name: str, *, optional: bool = False) -> None:
    if (optional and value is None) or isinstance(value, bool | np.bool_):
        return
    raise TypeError(
        f"`{name}` must be True or False{' (or None)' if optional else ''}, "
        f"got {_describe(value)}."
    )


def check_callable(value: Any, name: str, what: str = "") -> None:
    if not callable(value):
        raise TypeError(f"`{name}` must be a callable{f' ({what})' if what else ''}, got "
                        f"{_describe(value)}.")


def check_instance(value: Any, cls: type | tuple[type, ...], name: str, hint: str = "") -> None:
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(
            f"`{name}` must be a {names}, got {_describe(value)}{'; ' + hint if hint else ''}."
        )


def check_prng_key(key: Any, name: str = "key") -> None:
    """One JAX PRNG key: a typed key (`jax.random.key`) or a legacy uint32 `[2]` key."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if tuple(key.shape) != ():
            raise ValueError(
                f"`{name}` must be a single PRNG key, got a batch of keys of shape "
                f"{tuple(key.shape)}; pass one, e.g. `{name}[0]`."
            )
        return
    if (dtype is not None and not isinstance(dtype, type) and np.dtype(dtype) == np.uint32
            and tuple(getattr(key, "shape", ())) == (2,)):
        return
    raise TypeError(
        f"`{name}` must be a JAX PRNG key such as `jax.random.key(0)`, got {_describe(key)}."
    )


def check_array(x: Any, name: str, *, rank: int | None = None, layout: str = "",
                kind: str | None = None, min_rank: int = 0) -> tuple[int, ...]:
    """An array of the given rank (`layout` describes its axes), or at least `min_rank`, and
    dtype kind ("float" or "int"); returns its shape."""
    s = _shape(x, name)
    if rank is not None and len(s) != rank:
        raise ValueError(
            f"`{name}` must have rank {rank}{', ' + layout if layout else ''}, got shape {s}."
        )
    if len(s) < min_rank:
        raise ValueError(f"`{name}` must have rank >= {min_rank}, got shape {s}.")
    if kind == "float":
        check_float(x, name)
    elif kind == "int" and not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"`{name}` must hold integers, got dtype {x.dtype}; use e.g. "
            f"`jnp.asarray({name}, jnp.int32)`."
        )
    return s


def check_shape(got: tuple[int, ...], want: tuple[int, ...], name: str, layout: str,
                hint: str = "") -> None:
    if tuple(got) != tuple(want):
        raise ValueError(
            f"`{name}` must have shape {layout} = {tuple(want)}, got {tuple(got)}"
            f"{'; ' + hint if hint else ''}."
        )


def check_no_empty_axis(shape: tuple[int, ...], name: str, layout: str) -> None:
    if 0 in tuple(shape):
        raise ValueError(f"`{name}` has shape {tuple(shape)}; every axis of {layout} needs "
                         f"size >= 1.")


def check_index_range(indices: Any, name: str, size: int, what: str) -> None:
    """Integer indices into `size` items lie in [0, size) (checked where concrete)."""
    values = concrete(indices)
    if values is None or not values.size:
        return
    bad = (values < 0) | (values >= size)
    if bad.any():
        raise ValueError(
            f"`{name}` must lie in [0, {size}) ({what}), got {values[bad].ravel()[0]} at "
            f"position {tuple(int(i) for i in np.argwhere(bad)[0])}; values outside are an "
            f"error, never clamped or wrapped."
        )


def check_like_output(x: Any, name: str, dims: Dims) -> None:
    """`x` (a source ζ or an estimate z) is a float array shaped like attention's output."""
    want = (dims.batch, dims.q_len, dims.q_heads, dims.v_dim)
    check_shape(_shape(x, name), want, name, "[batch, q_len, q_heads, v_dim] (attention's "
                "output)")
    check_float(x, name)


def check_sequence(value: Any, name: str, what: str, example: str) -> list:
    """A non-empty list, tuple or 1-d array, returned as a list."""
    if isinstance(value, np.ndarray | jax.Array):
        if value.ndim != 1:
            raise ValueError(f"`{name}` must be a 1-d sequence of {what}, e.g. {example}, got "
                             f"shape {tuple(value.shape)}.")
        items = list(value)
    elif isinstance(value, list | tuple | range):
        items = list(value)
    else:
        raise TypeError(f"`{name}` must be a sequence of {what}, e.g. {example}, got "
                        f"{_describe(value)}.")
    if not items:
        raise ValueError(f"`{name}` is empty; give at least one, e.g. {example}.")
    return items


# mesh arguments (make_mesh)


def mesh_shape(shape: Any) -> tuple[int, ...]:
    """`make_mesh`'s `shape`: an int or a sequence of ints, as a tuple."""
    example = "8 or (2, 4)"
    if isinstance(shape, _INTEGRAL) and not isinstance(shape, bool | np.bool_):
        return (int(shape),)
    if not isinstance(shape, list | tuple | np.ndarray):
        raise TypeError(f"`shape` must be an int or a sequence of ints, e.g. {example}, got "
                        f"{_describe(shape)}.")
    for s in shape:
        if isinstance(s, bool | np.bool_) or not isinstance(s, _INTEGRAL):
            raise TypeError(f"`shape` must hold ints (devices per axis), e.g. {example}, got "
                            f"{_describe(s)} in {tuple(shape)}.")
    if len(shape) == 0:
        raise ValueError(f"`shape` is empty; give at least one axis, e.g. {example}.")
    return tuple(int(s) for s in shape)


def mesh_axis_names(axis_names: Any) -> tuple[str, ...]:
    """`make_mesh`'s `axis_names`: a name or a sequence of names, as a tuple."""
    if isinstance(axis_names, str):
        return (axis_names,)
    if (not isinstance(axis_names, list | tuple)
            or not all(isinstance(a, str) for a in axis_names)):
        raise TypeError(f"`axis_names` must be a name or a sequence of names, e.g. 'x' or "
                        f"('node', 'gpu'), got {_describe(axis_names)}.")
    return tuple(axis_names)


def mesh_device_list(devices: Any) -> list | None:
    """`make_mesh`'s `devices`: None, or a non-empty sequence of `jax.Device`s."""
    if devices is None:
        return None
    if isinstance(devices, jax.Device) or not isinstance(devices, list | tuple | np.ndarray):
        raise TypeError(f"`devices` must be a sequence of jax devices, e.g. jax.devices()[:4], "
                        f"got {_describe(devices)}.")
    devs = list(np.asarray(devices, dtype=object).ravel())
    bad = [d for d in devs if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(f"`devices` must hold jax devices (from jax.devices()), got "
                        f"{_describe(bad[0])}.")
    if not devs:
        raise ValueError("`devices` is empty; pass None for all devices, or some of "
                         "jax.devices().")
    return devs


# introspect


def hlo_without_entry() -> ValueError:
    return ValueError(
        "`text` has no ENTRY computation, so it is not an HLO module; pass the text of a "
        "compiled program, `jax.jit(f).lower(*args).compile().as_text()`."
    )


def uncountable_loop(callee: str) -> ValueError:
    return ValueError(
        f"a while loop without a known trip count calls {callee}; its collectives cannot be "
        f"counted statically. Give the loop static bounds (`lax.fori_loop` with Python ints "
        f"or `lax.scan`)."
    )


# costmodel


def check_whole_nodes(p: int, devices_per_node: int) -> None:
    if p > devices_per_node and p % devices_per_node:
        raise ValueError(
            f"`p`={p} is not a whole number of {devices_per_node}-device nodes; pass at most "
            f"{devices_per_node} or a multiple of {devices_per_node}."
        )


def check_head_groups(q_heads: Any, kv_heads: Any) -> None:
    if isinstance(q_heads, _INTEGRAL) and isinstance(kv_heads, _INTEGRAL) \
            and q_heads % kv_heads:
        raise ValueError(
            f"`q_heads` ({q_heads}) must be a multiple of `kv_heads` ({kv_heads}) "
            f"(grouped-query attention); use a kv_heads that divides {q_heads}."
        )


# model


def check_prompts(prompts: Any, vocab: int) -> list[np.ndarray]:
    """Prompts: a non-empty sequence of non-empty sequences of token ids in [0, vocab)."""
    example = "[[1, 2, 3], [4, 5]]"
    if isinstance(prompts, str | bytes) or not isinstance(prompts, list | tuple | np.ndarray):
        raise TypeError(f"`prompts` must be a list of prompts, each a sequence of token ids, "
                        f"e.g. {example}, got {_describe(prompts)}.")
    if len(prompts) == 0:
        raise ValueError(f"`prompts` is empty; pass at least one prompt, e.g. {example}.")
    out = []
    for i, p in enumerate(prompts):
        name = f"prompts[{i}]"
        if isinstance(p, str | bytes) or not (isinstance(p, list | tuple | range)
                                              or hasattr(p, "shape")):
            raise TypeError(f"`{name}` must be a sequence of token ids (ints), e.g. [1, 2, 3], "
                            f"got {_describe(p)}.")
        arr = np.asarray(p)
        if arr.ndim != 1:
            raise ValueError(f"`{name}` must be a flat sequence of token ids, got shape "
                             f"{arr.shape}.")
        if arr.size == 0:
            raise ValueError(f"`{name}` is empty; every prompt needs at least one token.")
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"`{name}` must hold int token ids, got dtype {arr.dtype}; "
                            f"convert with `[int(t) for t in {name}]`.")
        bad = (arr < 0) | (arr >= vocab)
        if bad.any():
            j = int(np.argmax(bad))
            raise ValueError(f"`{name}` has token id {arr[j]} at position {j}; token ids must "
                             f"lie in [0, vocab) = [0, {vocab}).")
        out.append(arr.astype(np.int32))
    return out


def check_capacity(capacity: int, longest: int, padded: int, new_tokens: int = 0) -> None:
    """The cache holds the prompts padded to whole prefill chunks, and the new tokens."""
    need = max(padded, longest + new_tokens)
    if capacity < need:
        plus = f" plus {new_tokens} new tokens" if new_tokens else ""
        raise ValueError(
            f"`capacity` {capacity} cannot hold the longest prompt ({longest} tokens, "
            f"{padded} once padded to whole prefill chunks){plus}; pass capacity >= {need} "
            f"(or None for the smallest that fits)."
        )


def check_even_head_dim(head_dim: int, name: str = "head_dim") -> None:
    if head_dim % 2 and name == "head_dim":
        raise ValueError(f"`head_dim` must be even for rotary embeddings (they rotate pairs of "
                         f"features), got {head_dim}; use e.g. {head_dim + 1}.")
    if head_dim % 2:
        raise ValueError(f"`{name}` must have an even last axis (head_dim) for rotary "
                         f"embeddings, which rotate pairs of features; got {head_dim}.")


def check_params(path: str, got: Any, want: Any) -> None:
    """A model's weights against the shapes its `Config` implies."""
    if got is None:
        raise ValueError(f"`params` lacks {path}; build params with `init_params(cfg, key)` "
                         f"for the same `cfg`.")
    if got != want:
        raise ValueError(f"`params` {path} has shape {got} but `cfg` implies {want}; params "
                         f"and cfg must come from the same Config (`init_params(cfg, key)`).")


# checkpoint (Hugging Face Llama checkpoints on disk)

_CHECKPOINT_HINT = ("a Hugging Face checkpoint folder holds config.json and the weights "
                    "(model.safetensors, or shards listed in model.safetensors.index.json)")


def check_path(path: Any, name: str = "path") -> Any:
    """A filesystem path (str or os.PathLike), returned as a `pathlib.Path`."""
    import os
    from pathlib import Path

    if isinstance(path, bool) or not isinstance(path, str | os.PathLike):
        raise TypeError(f"`{name}` must be a folder path (str or pathlib.Path), got "
                        f"{_describe(path)}.")
    return Path(path)


def check_checkpoint_dir(path: Any, name: str = "path") -> Any:
    """An existing folder with a config.json; returns it as a `pathlib.Path`."""
    p = check_path(path, name)
    if not p.is_dir():
        raise ValueError(f"`{name}` {str(p)!r} is not a folder; {_CHECKPOINT_HINT}.")
    if not (p / "config.json").is_file():
        raise ValueError(f"`{name}` {str(p)!r} has no config.json; {_CHECKPOINT_HINT}.")
    return p


def checkpoint_json(file: Any, err: Exception | None = None, what: str = "a JSON object"
                    ) -> ValueError:
    """`file` (config.json or the shard index) could not be read as `what`."""
    why = f" ({' '.join(str(err).split())})" if err is not None else ""
    return ValueError(f"`{file.name}` in {str(file.parent)!r} is not {what}{why}; it must be "
                      f"the file a Hugging Face checkpoint saves.")


def config_value(config: dict, key: str, where: str, kind: str, default: Any = None,
                 minimum: float | None = None) -> Any:
    """`config[key]` of a config.json as `kind` ("int", "real", "bool" or "str"); `default`
    when absent (None: the key is required). Ints must be >= `minimum` (default 1); reals
    > `minimum` when it is given."""
    if key not in config or config[key] is None:
        if default is None:
            raise ValueError(f"`config.json` in {where!r} lacks \"{key}\"; a Llama config "
                             f"names vocab_size, hidden_size, intermediate_size, "
                             f"num_hidden_layers and num_attention_heads.")
        return default
    value = config[key]
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "real": isinstance(value, int | float) and not isinstance(value, bool)
          and math.isfinite(value),
          "bool": isinstance(value, bool), "str": isinstance(value, str)}[kind]
    if kind == "int" and ok:
        ok = value >= (1 if minimum is None else minimum)
    elif kind == "real" and ok and minimum is not None:
        ok = value > minimum
    if not ok:
        want = {"int": f"an int >= {1 if minimum is None else int(minimum)}",
                "real": "a finite number" + (f" > {minimum:g}" if minimum is not None else ""),
                "bool": "true or false", "str": "a string"}[kind]
        raise ValueError(f"`config.json` in {where!r}: \"{key}\" must be {want}, got "
                         f"{value!r}.")
    return value


def config_invalid(where: str, err: Exception) -> ValueError:
    """A config.json value that `model.Config` or `model.RopeScaling` refused."""
    return ValueError(f"`config.json` in {where!r}: {err}")


def config_unsupported(where: str, key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"`config.json` in {where!r}: \"{key}\" is {value!r}, which this "
                      f"loader does not support; it reads {supported}.")


def check_config_heads(where: str, q_heads: int, kv_heads: int, hidden: int,
                       head_dim_given: bool) -> None:
    """Grouped-query attention needs kv heads dividing the query heads; without an explicit
    head_dim, the heads must divide hidden_size."""
    if q_heads % kv_heads:
        raise ValueError(f"`config.json` in {where!r}: num_attention_heads ({q_heads}) must be "
                         f"a multiple of num_key_value_heads ({kv_heads}) (grouped-query "
                         f"attention: each kv head serves a whole group of query heads).")
    if not head_dim_given and hidden % q_heads:
        raise ValueError(f"`config.json` in {where!r}: hidden_size ({hidden}) is not a "
                         f"multiple of num_attention_heads ({q_heads}), and no head_dim is "
                         f"given; add \"head_dim\" or fix the head count.")


def checkpoint_no_weights(path: Any) -> ValueError:
    return ValueError(f"`path` {str(path)!r} has no weights: no model.safetensors, no "
                      f"model.safetensors.index.json and no other *.safetensors file.")


def checkpoint_shard_missing(index: Any, shard: str) -> ValueError:
    return ValueError(f"`{index.name}` in {str(index.parent)!r} lists the shard {shard!r}, "
                      f"which is not there; copy the whole checkpoint folder.")


def checkpoint_unreadable(file: Any, err: Exception) -> ValueError:
    return ValueError(f"`{file.name}` in {str(file.parent)!r} is not a readable safetensors "
                      f"file ({' '.join(str(err).split())}).")


def checkpoint_tensor_missing(name: str, path: Any, shape: tuple[int, ...]) -> ValueError:
    return ValueError(f"`{name}` is missing from the checkpoint {str(path)!r}; config.json "
                      f"implies a tensor of shape {list(shape)} under that name.")


def checkpoint_tensor_misplaced(name: str, index: Any, shard: str) -> ValueError:
    return ValueError(f"`{name}` is listed in {index.name} under {shard!r} but that file does "
                      f"not hold it; the index and the shards disagree.")


def checkpoint_tensor_unexpected(name: str, file: Any) -> ValueError:
    return ValueError(f"`{name}` in {file.name} is not a weight of the Llama model that "
                      f"config.json describes (a bias, an extra layer, another architecture?); "
                      f"the loader will not guess what it is for.")


def check_checkpoint_tensor(name: str, file: Any, dtype: str, shape: list[int],
                            want: tuple[int, ...], readable: tuple[str, ...]) -> None:
    """A stored tensor's safetensors dtype and shape against what the loader reads."""
    if dtype not in readable:
        raise ValueError(f"`{name}` in {file.name} has dtype {dtype}, which the loader cannot "
                         f"read as weights; it reads {', '.join(readable)} (dequantise the "
                         f"checkpoint first).")
    if tuple(shape) != tuple(want):
        raise ValueError(f"`{name}` in {file.name} has shape {list(shape)}, but config.json "
                         f"implies {list(want)} (Hugging Face stores Linear weights as "
                         f"[out, in]).")


def checkpoint_no_tokenizer(path: Any) -> ValueError:
    return ValueError(f"`path` {str(path)!r} has no tokenizer.json, so text cannot be turned "
                      f"into token ids; pass token ids instead.")


def check_weight_dtype(dtype: Any, name: str = "dtype") -> Any:
    """None (keep the checkpoint's dtype) or a floating dtype, as a numpy dtype."""
    if dtype is None:
        return None
    check_float_dtype(dtype, name)
    return np.dtype(jnp.dtype(dtype))


def check_shard_bytes(value: Any, name: str = "max_shard_bytes") -> Any:
    if value is None:
        return None
    return check_int(value, name, example="`max_shard_bytes=2_000_000_000` (2 GB files)")


# cost model: merge patterns (issue 13)


def check_kind_links(pairs: Any, name: str, kinds: tuple[str, ...], link_cls: type) -> None:
    """A tuple of `(kind, Link)` pairs, each kind one of `kinds` and given once."""
    eg = '(("all-gather", Link(alpha_s=1e-4, beta_Bps=1e9)),)'
    if not isinstance(pairs, tuple):
        raise TypeError(f"`{name}` must be a tuple of (kind, Link) pairs, e.g. {eg}, got "
                        f"{_describe(pairs)}.")
    seen = set()
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], link_cls)):
            raise TypeError(f"`{name}[{i}]` must be a (kind, Link) pair, e.g. {eg}, got "
                            f"{_describe(pair)}.")
        check_choice(pair[0], kinds, f"{name}[{i}][0]")
        if pair[0] in seen:
            raise ValueError(f"`{name}` gives {pair[0]!r} twice; give each kind once.")
        seen.add(pair[0])


def check_pattern(value: Any, known: tuple[str, ...], name: str = "pattern") -> str:
    """A merge pattern's name: TypeError for a non-string, ValueError for an unknown one."""
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a str, one of {known}, got {_describe(value)}.")
    check_choice(value, known, name)
    return value


def check_sizes_list(values: Any, name: str, example: str) -> list[int]:
    """A non-empty sequence of positive ints (an axis of a map)."""
    items = check_sequence(values, name, "positive ints", example)
    for i, x in enumerate(items):
        check_int(x, f"{name}[{i}]")
    return [int(x) for x in items]


def check_multiple_of(value: int, name: str, divisor: int, divisor_name: str) -> None:
    if value % divisor:
        raise ValueError(f"`{name}` holds {value}, not a multiple of `{divisor_name}` "
                         f"({divisor}); give multiples of it.")
