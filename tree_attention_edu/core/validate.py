"""Generic argument checks: types, ranges, shapes and dtypes of plain values and arrays.

Each check names the argument that is wrong and says how to fix it. Messages about one idea
(the attention inputs, meshes, kernels, checkpoints) live in the module that raises them;
only the checks every module shares are here. Everything here is static: it reads Python
values, shapes and dtypes, never the contents of a traced array, so a function behaves the
same eagerly and under `jax.jit`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_INTEGRAL = (int, np.integer)
_REAL = (int, float, np.integer, np.floating)


def shape_of(x: Any, name: str) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"`{name}` must be an array (jax or numpy), got {type(x).__name__}.")
    return tuple(int(s) for s in x.shape)


def check_float(x: Any, name: str) -> None:
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(
            f"`{name}` has dtype {x.dtype}; attention needs a floating dtype "
            f"(float16, bfloat16, float32 or float64). Cast it, e.g. `{name}.astype(jnp.float32)`."
        )


def is_number(x: Any) -> bool:
    if isinstance(x, int | float | np.number):
        return True
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    return (
        shape == ()
        and dtype is not None
        and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    )


def is_traced(x: Any) -> bool:
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


def check_size(value: Any, name: str) -> None:
    """A non-negative int (a dimension that may be empty)."""
    check_int(value, name, minimum=0)


def check_float_dtype(dtype: Any, name: str = "dtype") -> None:
    try:
        dt = jnp.dtype(dtype)
    except TypeError as err:
        raise TypeError(
            f"`{name}` must be a floating dtype such as jnp.float32, got {dtype!r}."
        ) from err
    if dt not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(
            f"`{name}` must be a floating dtype (float16, bfloat16, float32 or float64), got {dt}."
        )


def check_positive(value: Any, name: str) -> None:
    check_int(value, name, minimum=1)


def check_choice(value: Any, known: tuple[str, ...], name: str) -> None:
    if value not in known:
        raise ValueError(f"`{name}` must be one of {known}, got {value!r}.")


def describe(x: Any) -> str:
    """`x` in a few words for a message: its type and value (or shape and dtype)."""
    if hasattr(x, "shape") and hasattr(x, "dtype") and len(getattr(x, "shape", ())) > 0:
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, list | tuple) and len(repr(x)) > 60:
        return f"{type(x).__name__} of {len(x)} items"
    text = " ".join(repr(x).split())
    return f"{type(x).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def check_int(value: Any, name: str, *, minimum: int | None = 1, example: str = "") -> int:
    """An int (Python or numpy, not bool) of at least `minimum`: TypeError for another type,
    ValueError below the minimum. `example` (e.g. "`dim=64`") is quoted in the message."""
    eg = f", e.g. {example}" if example else ""
    if isinstance(value, bool | np.bool_) or not isinstance(value, _INTEGRAL):
        raise TypeError(f"`{name}` must be an int, got {describe(value)}; pass a whole number{eg}.")
    if minimum is not None and value < minimum:
        what = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"`{name}` must be {what}, got {value!r}{eg}.")
    return int(value)


def _interval(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    return f"{'<' if high_open else '<='} {high:g}"


def check_real(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    finite: bool = True,
    traced: bool = False,
    hint: str = "",
) -> Any:
    """A real number (Python, numpy, or a 0-d numeric array), not NaN, finite unless
    `finite=False`, inside the given bounds. Returns it as a float.

    A traced scalar (under `jit`/`grad`) is a TypeError unless `traced=True`, where it is
    returned unchecked."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    is_scalar_array = (
        shape == ()
        and dtype is not None
        and not jnp.issubdtype(dtype, jnp.bool_)
        and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
    )
    if isinstance(value, bool | np.bool_) or not (isinstance(value, _REAL) or is_scalar_array):
        raise TypeError(
            f"`{name}` must be a real number, got {describe(value)}{'; ' + hint if hint else ''}."
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
    try:
        x = float(number)
    except OverflowError:  # an int past float's range, e.g. 10**400
        x = math.inf if number > 0 else -math.inf
    bounds = _interval(low, high, low_open, high_open) if (low, high) != (None, None) else ""
    if math.isnan(x) or (finite and math.isinf(x)):
        raise ValueError(
            f"`{name}` must be a finite number{' ' + bounds if bounds else ''}, got {x}"
            f"{'; ' + hint if hint else ''}."
        )
    if (low is not None and (x < low or (low_open and x == low))) or (
        high is not None and (x > high or (high_open and x == high))
    ):
        raise ValueError(f"`{name}` must be {bounds}, got {x:g}{'; ' + hint if hint else ''}.")
    return x


def check_bool(value: Any, name: str, *, optional: bool = False) -> None:
    if (optional and value is None) or isinstance(value, bool | np.bool_):
        return
    raise TypeError(
        f"`{name}` must be True or False{' (or None)' if optional else ''}, got {describe(value)}."
    )


def check_callable(value: Any, name: str, what: str = "") -> None:
    if not callable(value):
        raise TypeError(
            f"`{name}` must be a callable{f' ({what})' if what else ''}, got {describe(value)}."
        )


def check_instance(value: Any, cls: type | tuple[type, ...], name: str, hint: str = "") -> None:
    if not isinstance(value, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(
            f"`{name}` must be a {names}, got {describe(value)}{'; ' + hint if hint else ''}."
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
    if (
        dtype is not None
        and not isinstance(dtype, type)
        and np.dtype(dtype) == np.uint32
        and tuple(getattr(key, "shape", ())) == (2,)
    ):
        return
    raise TypeError(
        f"`{name}` must be a JAX PRNG key such as `jax.random.key(0)`, got {describe(key)}."
    )


def check_array(
    x: Any,
    name: str,
    *,
    rank: int | None = None,
    layout: str = "",
    kind: str | None = None,
    min_rank: int = 0,
) -> tuple[int, ...]:
    """An array of the given rank (`layout` describes its axes), or at least `min_rank`, and
    dtype kind ("float" or "int"); returns its shape."""
    s = shape_of(x, name)
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


def check_shape(
    got: tuple[int, ...], want: tuple[int, ...], name: str, layout: str, hint: str = ""
) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(
            f"`{name}` must have shape {layout} = {tuple(want)}, got {tuple(got)}"
            f"{'; ' + hint if hint else ''}."
        )


def check_no_empty_axis(shape: tuple[int, ...], name: str, layout: str) -> None:
    if 0 in tuple(shape):
        raise ValueError(
            f"`{name}` has shape {tuple(shape)}; every axis of {layout} needs size >= 1."
        )


def check_sequence(value: Any, name: str, what: str, example: str) -> list:
    """A non-empty list, tuple or 1-d array, returned as a list."""
    if isinstance(value, np.ndarray | jax.Array):
        if value.ndim != 1:
            raise ValueError(
                f"`{name}` must be a 1-d sequence of {what}, e.g. {example}, got "
                f"shape {tuple(value.shape)}."
            )
        items = list(value)
    elif isinstance(value, list | tuple | range):
        items = list(value)
    else:
        raise TypeError(
            f"`{name}` must be a sequence of {what}, e.g. {example}, got {describe(value)}."
        )
    if not items:
        raise ValueError(f"`{name}` is empty; give at least one, e.g. {example}.")
    return items


def check_sizes_list(values: Any, name: str, example: str) -> list[int]:
    """A non-empty sequence of positive ints (an axis of a map)."""
    items = check_sequence(values, name, "positive ints", example)
    for i, x in enumerate(items):
        check_int(x, f"{name}[{i}]")
    return [int(x) for x in items]


def check_multiple_of(value: int, name: str, divisor: int, divisor_name: str) -> None:
    if value % divisor:
        raise ValueError(
            f"`{name}` holds {value}, not a multiple of `{divisor_name}` "
            f"({divisor}); give multiples of it."
        )


def check_str_choice(value: Any, known: tuple[str, ...], name: str) -> str:
    """One of the names `known`: TypeError for a non-string, ValueError for an unknown one."""
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a str, one of {known}, got {describe(value)}.")
    check_choice(value, known, name)
    return value
