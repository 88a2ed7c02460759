"""The cost model's argument checks: sizes, rates and byte counts, some of which may be sympy
expressions.

The byte, flop, step and memory formulas also take sympy symbols, so that they can be
checked symbolically (`tests/test_costmodel.py`); a function that compares times (a max, a
min, the cheaper algorithm) needs numbers and names the symbol it was given
(`check_no_symbols`). Everything sympy-aware lives here: `core.validate` checks plain values
only. Each check names the argument that is wrong and says how to fix it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core import validate
from ..core.names import MERGE_NAMES, MergeName

MAX_SIZE = 2**50
"""Largest size the model takes: products of six such sizes stay inside float64's range."""

_REAL = (int, float, np.integer, np.floating)  # a real number, never a sympy expression


def is_symbolic(value: Any) -> bool:
    """A sympy expression: the cost model's formulas are also evaluated on symbols."""
    return hasattr(value, "free_symbols") and hasattr(value, "subs")


def _passes_as_symbol(value: Any, symbolic: bool) -> bool:
    return symbolic and not isinstance(value, _REAL) and is_symbolic(value)


def check_size(
    value: Any, name: str, *, minimum: int = 1, symbolic: bool = False, example: str = ""
) -> Any:
    """`validate.check_int`, and at most `MAX_SIZE`: the formulas multiply and divide sizes
    in floating point, where a larger one would leave float64's range. With `symbolic=True`
    a sympy expression is returned unchecked."""
    if not _passes_as_symbol(value, symbolic):
        value = validate.check_int(value, name, minimum=minimum, example=example)
    if isinstance(value, int) and value > MAX_SIZE:
        shown = value if value < 10**30 else f"an int of {len(str(value))} digits"
        raise ValueError(
            f"`{name}` = {shown} exceeds the model's largest size, 2**50 "
            f"({MAX_SIZE:.3g}): the formulas multiply sizes in floating point, "
            f"and such products would leave its range."
        )
    return value


def check_sizes(**sizes: Any) -> None:
    """Each size a positive int at most `MAX_SIZE` (or a sympy expression)."""
    for name, value in sizes.items():
        check_size(value, name, symbolic=True)


def check_real(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    low_open: bool = False,
    finite: bool = True,
    symbolic: bool = False,
    hint: str = "",
) -> Any:
    """`validate.check_real`, with a Python int too large for a float (10**400) refused by
    name instead of overflowing inside the conversion. With `symbolic=True` a sympy
    expression is returned unchecked."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:
            raise ValueError(
                f"`{name}` = an int of {len(str(abs(value)))} digits does not fit in a float "
                f"(largest {np.finfo(np.float64).max:.3g}), in which the model computes; pass "
                f"a smaller number{'; ' + hint if hint else ''}."
            ) from None
    if _passes_as_symbol(value, symbolic):
        return value
    return validate.check_real(value, name, low=low, low_open=low_open, finite=finite, hint=hint)


def check_no_symbols(what: str, **values: Any) -> None:
    """`what` compares times (a max, a min, the cheaper algorithm), which needs numbers: a
    sympy expression among `values` is a TypeError naming it. `what` is a clause such as
    "allreduce_time compares times"."""
    for name, value in values.items():
        if is_symbolic(value):
            raise TypeError(
                f"`{name}` is a sympy expression ({value}); {what}, which needs numbers. "
                f"Substitute values first (`expr.subs(...)`), or use the "
                f"formulas that take symbols (kv_read_bytes, decode_flops, merge_collectives, "
                f"ring_collectives, the paper_* volumes and memories, ...)."
            )


def check_concrete_sizes(what: str, **sizes: Any) -> None:
    """Each size a positive int at most `MAX_SIZE`, and not a sympy expression."""
    check_no_symbols(what, **sizes)
    check_sizes(**sizes)


def check_branching(branching: int) -> None:
    check_size(
        branching,
        "branching",
        minimum=2,
        symbolic=True,
        example="`branching=2` for a binary tree",
    )


def check_nbytes(nbytes: float, name: str = "nbytes") -> None:
    check_real(nbytes, name, low=0.0, symbolic=True)


def check_whole_nodes(p: int, devices_per_node: int) -> None:
    if p > devices_per_node and p % devices_per_node:
        raise ValueError(
            f"`p`={p} is not a whole number of {devices_per_node}-device nodes; pass at most "
            f"{devices_per_node} or a multiple of {devices_per_node}."
        )


def check_kind_links(pairs: Any, name: str, kinds: tuple[str, ...], link_cls: type) -> None:
    """A tuple of `(kind, Link)` pairs, each kind one of `kinds` and given once."""
    eg = '(("all-gather", Link(alpha_s=1e-4, beta_Bps=1e9)),)'
    if not isinstance(pairs, tuple):
        raise TypeError(
            f"`{name}` must be a tuple of (kind, Link) pairs, e.g. {eg}, got "
            f"{validate.describe(pairs)}."
        )
    seen = set()
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], link_cls)):
            raise TypeError(
                f"`{name}[{i}]` must be a (kind, Link) pair, e.g. {eg}, got "
                f"{validate.describe(pair)}."
            )
        validate.check_choice(pair[0], kinds, f"{name}[{i}][0]")
        if pair[0] in seen:
            raise ValueError(f"`{name}` gives {pair[0]!r} twice; give each kind once.")
        seen.add(pair[0])


def check_collectives(collectives: Any, kinds: tuple[str, ...]) -> list[tuple[Any, Any, Any]]:
    """A list or tuple of `(kind, nbytes, count)`: kind one of `kinds`, `nbytes >= 0` bytes,
    `count >= 0` runs (sympy expressions allowed for both). It may be empty: one device runs
    no collective."""
    eg = '[("all-gather", 8192, 1)]'
    if isinstance(collectives, list | tuple) and not collectives:
        return []
    items = validate.check_sequence(collectives, "collectives", "(kind, nbytes, count) triples", eg)
    out = []
    for i, entry in enumerate(items):
        name = f"collectives[{i}]"
        if not isinstance(entry, tuple | list) or len(entry) != 3:
            raise TypeError(
                f"`{name}` must be a (kind, nbytes, count) triple, e.g. {eg}, got "
                f"{validate.describe(entry)}."
            )
        kind, nbytes, count = entry
        validate.check_str_choice(kind, kinds, f"{name}[0]")
        check_nbytes(nbytes, f"{name}[1]")
        check_size(count, f"{name}[2]", minimum=0, symbolic=True)
        out.append((kind, nbytes, count))
    return out


def check_pattern(pattern: Any, name: str = "pattern") -> MergeName:
    """One merge pattern's name (`core.names.MERGE_NAMES`)."""
    validate.check_str_choice(pattern, MERGE_NAMES, name)
    return pattern


def check_patterns(patterns: Any) -> list[MergeName]:
    """A non-empty sequence of merge pattern names, returned as a list."""
    names = validate.check_sequence(
        patterns, "patterns", "merge pattern names", '("allreduce", "allgather")'
    )
    return [check_pattern(p, f"patterns[{i}]") for i, p in enumerate(names)]
