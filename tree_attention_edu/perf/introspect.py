"""Read the compiled program: which collectives run, over which groups, moving how many bytes.

This is the honest measurement of communication volume: it reads what XLA will execute
(after SPMD partitioning and fusion), not what the Python code seems to ask for.

Bytes are per device, for one execution, and count each collective's payload: the
buffer a device contributes (all-reduce, collective-permute, all-to-all, reduce-scatter: its
output times the group size) or receives (all-gather). A collective inside a `while` loop
counts once per iteration, using the trip count XLA records in the loop's backend config.
A collective inside a branch of a `conditional` is marked `conditional`: it runs only when
that branch is taken (the exact fallback of the one-pass merge), and `fast_path()` leaves it
out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from ..core import devices, inputs, validate
from ..core.decode import kv_spec
from ..core.names import Layout

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_ELEMENT_BITS = {
    "pred": 8,
    "s1": 1,
    "s2": 2,
    "s4": 4,
    "s8": 8,
    "s16": 16,
    "s32": 32,
    "s64": 64,
    "u1": 1,
    "u2": 2,
    "u4": 4,
    "u8": 8,
    "u16": 16,
    "u32": 32,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "f4e2m1fn": 4,
    "f8e3m4": 8,
    "f8e4m3": 8,
    "f8e4m3fn": 8,
    "f8e4m3b11fnuz": 8,
    "f8e4m3fnuz": 8,
    "f8e5m2": 8,
    "f8e5m2fnuz": 8,
    "f8e8m0fnu": 8,
    "c64": 64,
    "c128": 128,
}
"""Bits per element of each XLA array type, as HLO text spells it (`PrimitiveType` in XLA's
`xla_data.proto`). XLA's default layouts pack sub-byte types, and say so: `s4[8]{0:E(4)}` is
4 bytes; a layout without `E(...)`, `s4[8]{0}`, stores a byte per element; a shape printed
without a layout (a computation's signature) is taken as packed."""
_NO_DATA = ("token", "opaque")
"""Types without a buffer of data (`token[]` orders side effects): 0 bytes."""
_ARRAY = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\[([^\[\]]*)\](\{[^{}]*\})?")
_DIM = re.compile(r"(?:<=)?(\d+)")  # a size, or a bounded dynamic one (<=N: N allocated)
_ELEMENT_SIZE = re.compile(r"E\((\d+)\)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\((.*)$"
)
_CALLEE = re.compile(
    r"\b(body|condition|to_apply|calls|branch_computations)=\{?([^,}\s]+(?:,\s*%[\w.\-]+)*)\}?"
)
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


@dataclass(frozen=True)
class Collective:
    """One collective op of the compiled program.

    Attributes:
      kind: "all-reduce", "collective-permute", ...
      groups: replica groups (device ids that communicate), or source→target pairs for
        collective-permute.
      bytes: payload bytes per device for one execution of the op.
      count: how many times it executes (loop trip counts multiplied in).
      conditional: inside a branch of a `conditional`, so it runs only when that branch is
        taken.
    """

    kind: str
    groups: tuple[tuple[int, ...], ...]
    bytes: int
    count: int = 1
    conditional: bool = False

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


@dataclass(frozen=True)
class CollectiveStats:
    collectives: tuple[Collective, ...] = field(default_factory=tuple)

    @property
    def total_bytes(self) -> int:
        """Bytes per device over all collectives, loops counted with their trip counts."""
        return sum(c.total_bytes for c in self.collectives)

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0) + c.total_bytes
        return out

    def fast_path(self) -> CollectiveStats:
        """The collectives that always run: those inside conditional branches left out."""
        return CollectiveStats(tuple(c for c in self.collectives if not c.conditional))

    def __str__(self) -> str:
        lines = [f"{'kind':<20} {'count':>5} {'bytes/device':>14}  groups"]
        for c in self.collectives:
            g = str([list(x) for x in c.groups])
            kind = c.kind + (" (if)" if c.conditional else "")
            lines.append(
                f"{kind:<20} {c.count:>5} {c.total_bytes:>14,}  "
                f"{g if len(g) < 60 else g[:57] + '...'}"
            )
        lines.append(f"{'total':<20} {'':>5} {self.total_bytes:>14,}")
        return "\n".join(lines)


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape such as `f32[1,16]{1,0}` or a tuple `(f32[4], bf16[2,3])`.

    Every XLA array type counts (`_ELEMENT_BITS`; sub-byte types packed as the layout
    says, `{0:E(4)}`); `token[]` counts 0. A type XLA does not
    have, a size that is not a number, or text that is not a shape is a ValueError naming
    `shape_text`: a byte count of 0 would pass for a real one."""
    validate.check_instance(
        shape_text, str, "shape_text", "pass HLO shape text such as 'f32[1,16]{1,0}'"
    )
    return _shape_bytes(shape_text, strict=True)


def _shape_bytes(text: str, *, strict: bool) -> int:
    """`shape_bytes`; `strict`: also refuse text around the arrays that is not tuple syntax
    (parse_hlo passes what its own pattern cut out of an instruction, so it is lenient)."""
    total = 0
    for m in _ARRAY.finditer(text):
        total += _array_bytes(m.group(1), m.group(2), m.group(3), text)
    if strict:
        rest = _ARRAY.sub("", re.sub(r"/\*.*?\*/", "", text))  # /*index=5*/ in long tuples
        if not text.strip() or rest.strip("(), \t\n"):
            raise ValueError(
                f"`shape_text` {text!r} is not an HLO shape; pass one such as "
                f"'f32[1,16]{{1,0}}' or a tuple '(f32[4], bf16[2,3])'."
            )
    return total


def _array_bytes(dtype: str, dims: str, layout: str | None, text: str) -> int:
    """Bytes of one array of an HLO shape, `dtype[dims]{layout}`; `text` for messages."""
    if dtype in _NO_DATA:
        return 0
    if dtype not in _ELEMENT_BITS:
        raise ValueError(
            f"`shape_text` {text!r}: {dtype!r} is not an XLA array type; known: "
            f"{', '.join(_ELEMENT_BITS)} (and {', '.join(_NO_DATA)}, no data). Pass the "
            f"type as XLA prints it (a new XLA type belongs in `introspect._ELEMENT_BITS`)."
        )
    sizes = [_DIM.fullmatch(d.strip()) for d in dims.split(",")] if dims.strip() else []
    if any(d is None for d in sizes):
        raise ValueError(
            f"`shape_text` {text!r}: {dtype}[{dims}] has a size that is not a number (or "
            f"<=N for a bounded dynamic one), so its bytes are unknown; pass the shape XLA "
            f"prints, e.g. 'f32[1,16]{{1,0}}'."
        )
    count = math.prod(int(d.group(1)) for d in sizes if d is not None)
    packed = _ELEMENT_SIZE.search(layout or "")
    if packed:  # {0:E(4)}: elements of that many bits, packed
        bits = int(packed.group(1))
    elif layout:  # a layout without an element size: whole bytes per element
        bits = -(-_ELEMENT_BITS[dtype] // 8) * 8
    else:  # no layout (a signature): XLA's default one packs sub-byte types
        bits = _ELEMENT_BITS[dtype]
    return -(-count * bits // 8)


def _parse_groups(attrs: str) -> tuple[tuple[int, ...], ...]:
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if m:
        return tuple(
            tuple(int(x) for x in pair.split(","))
            for pair in re.findall(r"\{(\d+,\d+)\}", m.group(1))
        )
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if m:
        return tuple(
            tuple(int(x) for x in g.split(",") if x)
            for g in re.findall(r"\{([\d,]*)\}", m.group(1))
        )
    # Iota form: replica_groups=[G,S]<=[d0,d1,...] optionally followed by T(perm).
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        group_shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return tuple(tuple(int(x) for x in row) for row in ids.reshape(group_shape))
    return ()


def parse_hlo(text: str) -> CollectiveStats:
    """Collectives of an HLO module's text (`compiled.as_text()`), with loop trip counts."""
    validate.check_instance(text, str, "text", "pass `compiled.as_text()`")
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise _hlo_without_entry()

    # How many times each computation runs: propagate from ENTRY through while bodies.
    # Which computations run only inside a conditional's branch.
    multiplier: dict[str, int] = {entry: 1}
    in_branch: dict[str, bool] = {entry: False}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in comps.get(name, []):
            trip = _TRIP.search(line)
            for role, callees in _CALLEE.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", callees):
                    factor = int(trip.group(1)) if role == "body" and trip else 1
                    if role == "body" and " while(" in line and not trip:
                        raise _uncountable_loop(callee)
                    new = multiplier[name] * factor
                    branch = in_branch[name] or role == "branch_computations"
                    if callee in comps and (
                        multiplier.get(callee, 0) < new
                        or (in_branch.get(callee, True) and not branch)
                    ):
                        multiplier[callee] = max(new, multiplier.get(callee, 0))
                        in_branch[callee] = branch and in_branch.get(callee, True)
                        stack.append(callee)

    found = []
    for name, lines in comps.items():
        if name not in multiplier:
            continue
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            shape_text, kind, is_start, rest = m.groups()
            nbytes = _shape_bytes(shape_text, strict=False)
            if is_start and kind in ("collective-permute", "all-gather"):
                # Async starts return (operand, output, contexts...): count one buffer.
                arrays = _ARRAY.findall(shape_text)
                dtype, dims, layout = arrays[0] if kind == "collective-permute" else arrays[1]
                nbytes = _array_bytes(dtype, dims, layout, shape_text)
            groups = _parse_groups(rest)
            if kind == "reduce-scatter":  # the printed shape is the output: 1/group of the input
                nbytes *= len(groups[0]) if groups else 1
            found.append(Collective(kind, groups, nbytes, multiplier[name], in_branch[name]))
    return CollectiveStats(tuple(found))


def _compile(fn: Callable, *args: Any):
    validate.check_callable(
        fn, "fn", "the function to compile, e.g. `lambda q, k, v: tree_decode(q, k, v, mesh=mesh)`"
    )
    _check_args(args)
    return jax.jit(fn).lower(*args).compile()


def _check_args(args: tuple) -> None:
    """Each leaf of `args` something `jax.jit` can trace: an array, a
    `jax.ShapeDtypeStruct` or a Python number (a str, say, would fail inside JAX)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(args)
    for path, leaf in leaves:
        if (
            (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))
            or hasattr(leaf, "__jax_array__")
            or isinstance(leaf, bool | int | float | complex)
        ):
            continue
        raise TypeError(
            f"`args{jax.tree_util.keystr(path)}` must be an array or a jax.ShapeDtypeStruct "
            f"(a pytree of them), got {validate.describe(leaf)}; pass non-array settings "
            f"inside `fn` instead, e.g. `lambda q, k, v: tree_decode(q, k, v, mesh=mesh)`."
        )


def collective_stats(fn: Callable, *args: Any) -> CollectiveStats:
    """Collectives in the compiled program of `fn(*args)`.

    `args` may be arrays or `jax.ShapeDtypeStruct`s (with or without a `sharding`), so
    nothing is allocated or run. Example::

        collective_stats(lambda q, k, v: tree_decode(q, k, v, mesh=m), q_s, k_s, v_s)
    """
    return parse_hlo(_compile(fn, *args).as_text())


@dataclass(frozen=True)
class MemoryStats:
    """Per-device memory of a compiled program (bytes)."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs + temporaries: an upper bound on live memory."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes


def memory_stats(fn: Callable, *args: Any) -> MemoryStats:
    """Argument, output and temp bytes per device from `compiled.memory_analysis()`.

    On CPU, XLA's own `peak_memory_in_bytes` is only arguments + outputs; the temp size is
    where copies of the cache and ring buffers show up.
    """
    ma = _compile(fn, *args).memory_analysis()
    return MemoryStats(
        int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes), int(ma.temp_size_in_bytes)
    )


def structs(
    mesh: Mesh,
    kv_len: int,
    *,
    batch: int = 1,
    q_len: int = 1,
    q_heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    v_dim: int | None = None,
    dtype: DTypeLike = jnp.float32,
    seq_axes: str | tuple[str, ...] | None = None,
    layout: Layout = "bthd",
) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """Abstract `(q, k, v)` placed on `mesh` as the decoders place them, for compile-only
    measurements: pass them to `collective_stats` or `memory_stats`, and nothing is allocated.

    The defaults are the paper's microbenchmark (one query, 16 heads of 128, float32).

    Args:
      mesh: the devices (see `make_mesh`).
      kv_len: keys in the cache; a multiple of the devices along `seq_axes`.
      kv_heads: defaults to `q_heads` (no grouping); must divide it.
      v_dim: defaults to `head_dim`.
      seq_axes: mesh axes the keys are split over, outermost first (default: all).
      layout: "bthd" or the head-major "bhtd" (see `core.kernels`).

    Returns:
      `jax.ShapeDtypeStruct`s with shardings: q `[batch, q_len, q_heads, head_dim]`
      replicated; k `[batch, kv_len, kv_heads, head_dim]` and v `[batch, kv_len, kv_heads,
      v_dim]` (or `[batch, kv_heads, kv_len, ·]` for "bhtd") split along the keys with
      `core.decode.kv_spec(seq_axes, layout)`.
    """
    validate.check_instance(mesh, Mesh, "mesh", "build one with tree_attention_edu.make_mesh")
    kv_heads = q_heads if kv_heads is None else kv_heads
    v_dim = head_dim if v_dim is None else v_dim
    for name, n in (
        ("kv_len", kv_len),
        ("batch", batch),
        ("q_len", q_len),
        ("q_heads", q_heads),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("v_dim", v_dim),
    ):
        validate.check_int(n, name)
    inputs.check_head_groups(q_heads, kv_heads)
    validate.check_float_dtype(dtype)
    inputs.check_layout(layout)
    axes = devices.check_seq_axes(seq_axes, mesh)
    devices.check_divisible(kv_len, devices.axis_size(mesh, axes), axes)
    kv_sharding = NamedSharding(mesh, kv_spec(axes, layout))

    def cache(last: int) -> jax.ShapeDtypeStruct:
        shape = (
            (batch, kv_len, kv_heads, last) if layout == "bthd" else (batch, kv_heads, kv_len, last)
        )
        return jax.ShapeDtypeStruct(shape, dtype, sharding=kv_sharding)

    q = jax.ShapeDtypeStruct(
        (batch, q_len, q_heads, head_dim), dtype, sharding=NamedSharding(mesh, P())
    )
    return q, cache(head_dim), cache(v_dim)


def _hlo_without_entry() -> ValueError:
    return ValueError(
        "`text` has no ENTRY computation, so it is not an HLO module; pass the text of a "
        "compiled program, `jax.jit(f).lower(*args).compile().as_text()`."
    )


def _uncountable_loop(callee: str) -> ValueError:
    return ValueError(
        f"a while loop without a known trip count calls {callee}; its collectives cannot be "
        f"counted statically. Give the loop static bounds (`lax.fori_loop` with Python ints "
        f"or `lax.scan`)."
    )
