"""The collectives each merge pattern and ring runs, and the bytes they move.

Every merge pattern (`core.names.MERGE_NAMES`, the `merge=` options of
`core.decode.tree_decode`) merges the same per-device states (out, lse) exactly; they differ
only in the collectives that move them:

* "allreduce": Allreduce(max) + Allreduce(sum), the paper's Algorithm 3;
* "allgather": one all-gather of the packed states, then a local merge;
* "reduce_scatter": all-gather of the lse pairs, reduce-scatter of the rescaled outputs over
  heads (vLLM and SGLang decode context parallelism);
* "all_to_all": one all-to-all of the packed states over heads, then a local merge
  (TensorRT-LLM Helix, arXiv 2507.07120);
* "one_pass": one Allreduce(sum) with a shared shift in place of the max (FlashDecoding++'s
  unified max), with the exact "allreduce" merge as a fallback;
* "butterfly": recursive doubling, `formulas.butterfly_rounds(p)` collective-permutes of the
  packed states (a tree by construction, whatever a transport's all-reduce algorithm).

The two rings (`RINGS`) move the cache (pass-KV) or the queries (pass-Q) instead.

Bytes are counted the way `introspect.collective_stats` counts them: for all-reduce,
reduce-scatter, all-to-all and collective-permute the buffer one device contributes, for
all-gather the buffer it receives (p times its contribution). Sizes may be sympy symbols.
Payloads of different kinds do not add up to traffic: `wire_bytes` prices each kind's payload
as the bytes one device sends (`sent_bytes` for a list), and `pass_q_crossover` compares the
two rings in those bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeVar, get_args

from ..core import inputs, validate
from ..core.names import MergeName
from .checks import (
    check_collectives,
    check_concrete_sizes,
    check_nbytes,
    check_pattern,
    check_sizes,
)
from .formulas import butterfly_rounds
from .links import COLLECTIVE_KINDS, Collective, CollectiveKind

RingName = Literal["ring", "ring_pass_q"]
"""A ring: pass-KV (`decode.ring_decode`) or pass-Q (`decode.ring_decode_pass_q`)."""
RINGS: tuple[RingName, ...] = get_args(RingName)
"""The two rings: pass-KV (`decode.ring_decode`) and pass-Q (`decode.ring_decode_pass_q`)."""


def padded_heads(q_heads: int, p: int) -> int:
    """Query heads after padding to a multiple of `p`: `ceil(Hq/p)·p` (`Hq_pad`). The
    head-scattered patterns ("reduce_scatter", "all_to_all") give each device `Hq_pad/p`."""
    check_sizes(q_heads=q_heads, p=p)
    return -(-q_heads // p) * p


def merge_collectives(
    pattern: MergeName,
    *,
    batch: int,
    q_len: int,
    q_heads: int,
    v_dim: int,
    p: int,
    stat_itemsize: int = 4,
    levels: int = 1,
    fallback: bool = False,
    out_itemsize: int = 2,
    operands_apart: bool = False,
) -> list[Collective]:
    """The collectives one merge pattern runs on each device: `[(kind, nbytes, count)]`.

    `nbytes` as `collective_stats` counts it (module docstring), `count` how many such ops run.
    With `n = B·Tq·Hq` rows, `s = stat_itemsize`, `n_pad = B·Tq·Hq_pad` (`padded_heads`):

    ==================  ===========================================================
    "allreduce"         all-reduce n·s (max) and all-reduce n·(Dv+1)·s (sum), per level
    "allgather"         all-gather p·n·(Dv+2)·s (out, lse, lse_lo packed)
    "reduce_scatter"    all-gather p·n_pad·2·s (lse pairs), reduce-scatter n_pad·Dv·s
    "all_to_all"        all-to-all n_pad·(Dv+2)·s
    "one_pass"          all-reduce n·(Dv+1)·s + s (numerator, denominator, a flag), per level
    "butterfly"         `butterfly_rounds(p)` collective-permutes of n·(Dv+2)·s
    ==================  ===========================================================

    `levels`: mesh levels reduced over one after the other (2 on a `("node", "gpu")` mesh):
    the all-reduce patterns run once per level; the others move their buffer over all the
    sequence axes at once. `fallback=True` adds, to "one_pass", the exact "allreduce" merge
    that runs when a device's lse leaves the shared window (the program holds it in a
    conditional; it runs only then).

    When p does not divide Hq, the head-scattered patterns ("reduce_scatter", "all_to_all")
    cannot leave an even split of the heads; `tree_decode` then replicates the output with
    one more all-gather of p·B·Tq·ceil(Hq/p)·Dv elements of `out_itemsize` bytes (the
    output's dtype).

    `operands_apart=True` lists each operand of an all-reduce apart (numerator n·Dv·s,
    denominator n·s, one_pass's flag s), as XLA:CPU runs them, one collective each (over
    gloo one ring each: `Topology.ring_only`; on simulated devices
    `Topology.operands_apart`); by default, one all-reduce per XLA op, as
    `collective_stats`.
    """
    check_pattern(pattern)
    sizes = dict(batch=batch, q_len=q_len, q_heads=q_heads, v_dim=v_dim, p=p)
    check_sizes(**sizes, stat_itemsize=stat_itemsize, levels=levels, out_itemsize=out_itemsize)
    validate.check_bool(fallback, "fallback")
    validate.check_bool(operands_apart, "operands_apart")
    s, n = stat_itemsize, batch * q_len * q_heads
    n_pad = batch * q_len * padded_heads(q_heads, p)
    exact: list[Collective] = [
        ("all-reduce", n * s, levels),  # the max
        *_sums((n * v_dim * s, n * s), levels, operands_apart),  # numerator, denominator
    ]
    if pattern == "allreduce":
        return exact
    if pattern == "allgather":
        return [("all-gather", p * n * (v_dim + 2) * s, 1)]
    if pattern == "butterfly":
        rounds = butterfly_rounds(p)
        return [("collective-permute", n * (v_dim + 2) * s, rounds)] if rounds else []
    gather: list[Collective] = (
        [("all-gather", n_pad * v_dim * out_itemsize, 1)] if n_pad != n else []
    )
    if pattern == "reduce_scatter":
        return [
            ("all-gather", p * n_pad * 2 * s, 1),
            ("reduce-scatter", n_pad * v_dim * s, 1),
            *gather,
        ]
    if pattern == "all_to_all":
        return [("all-to-all", n_pad * (v_dim + 2) * s, 1), *gather]
    fast = _sums((n * v_dim * s, n * s, s), levels, operands_apart)  # and the flag
    return fast + exact if fallback else fast  # one_pass, with its exact fallback or not


def _sums(sizes: tuple[int, ...], levels: int, apart: bool) -> list[Collective]:
    """One all-reduce of these operands per level, or one per operand and level."""
    if apart:
        return [("all-reduce", size, levels) for size in sizes]
    return [("all-reduce", sum(sizes), levels)]


def merge_read_bytes(
    pattern: MergeName,
    *,
    batch: int,
    q_len: int,
    q_heads: int,
    v_dim: int,
    p: int,
    stat_itemsize: int = 4,
) -> int:
    """Bytes of statistics the local half of a merge reads on each device.

    "allreduce" and "one_pass" divide the summed numerator by the denominator,
    n·(Dv+1)·s; "allgather" merges the p gathered states, p·n·(Dv+2)·s; "all_to_all" the p
    slices of `n_pad/p` rows it received, n_pad·(Dv+2)·s; "reduce_scatter" weighs its own
    output by the gathered lse pairs, n_pad·Dv·s + p·n_pad·2·s; "butterfly" combines its
    state with the one it received in each round, 2·n·(Dv+2)·s per round.
    """
    check_pattern(pattern)
    check_sizes(
        batch=batch, q_len=q_len, q_heads=q_heads, v_dim=v_dim, p=p, stat_itemsize=stat_itemsize
    )
    s, n = stat_itemsize, batch * q_len * q_heads
    n_pad = batch * q_len * padded_heads(q_heads, p)
    return {
        "allreduce": n * (v_dim + 1) * s,
        "one_pass": n * (v_dim + 1) * s,
        "allgather": p * n * (v_dim + 2) * s,
        "all_to_all": n_pad * (v_dim + 2) * s,
        "reduce_scatter": n_pad * v_dim * s + p * n_pad * 2 * s,
        "butterfly": butterfly_rounds(p) * 2 * n * (v_dim + 2) * s,
    }[pattern]


def ring_collectives(
    *,
    batch: int,
    kv_len: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int,
    p: int,
    itemsize: int = 4,
    q_len: int = 1,
    q_heads: int | None = None,
) -> list[Collective]:
    """Pass-KV ring (`core.decode.ring_decode`): p−1 steps, each two collective-permutes, the
    K block `B·t·Hkv·D·itemsize` and the V block `B·t·Hkv·Dv·itemsize` (t = ceil(N/p)), whose
    sum is `ring_payload_bytes`; then one all-reduce of the output `B·Tq·Hq·Dv·itemsize`
    (`q_heads` defaults to `kv_heads`) that broadcasts shard 0's result, so that the
    replicated output is the same on every device (none when p = 1)."""
    q_heads = kv_heads if q_heads is None else q_heads
    check_sizes(
        batch=batch,
        kv_len=kv_len,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        p=p,
        itemsize=itemsize,
        q_len=q_len,
        q_heads=q_heads,
    )
    t = -(-kv_len // p)
    block = batch * t * kv_heads * itemsize
    out: list[Collective] = (
        [("all-reduce", batch * q_len * q_heads * v_dim * itemsize, 1)] if p > 1 else []
    )
    return [
        ("collective-permute", block * head_dim, p - 1),
        ("collective-permute", block * v_dim, p - 1),
        *out,
    ]


def pass_q_heads(q_heads: int, kv_heads: int, p: int) -> int:
    """Query heads in one travelling block of the pass-Q ring: `Gs = ceil(Hkv/p)·Hq/Hkv`."""
    check_sizes(q_heads=q_heads, kv_heads=kv_heads, p=p)
    inputs.check_head_groups(q_heads, kv_heads)
    return -(-kv_heads // p) * (q_heads // kv_heads)


def pass_q_collectives(
    *,
    batch: int,
    q_len: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int,
    p: int,
    itemsize: int = 4,
    stat_itemsize: int = 4,
) -> list[Collective]:
    """Pass-Q ring (`decode.ring_decode_pass_q`, Meta's context-parallel inference, arXiv
    2411.01783): the query blocks of `Gs = pass_q_heads(...)` heads travel, K/V stay.

    As `decode` builds it: p−1 steps, each a collective-permute of the visiting query block
    `B·Tq·Gs·D·itemsize`, every device keeping the partial state it made for each block;
    then one all-to-all sends the p partial states `[p, B, Tq, Gs, Dv+2]` home (contributes
    `p·B·Tq·Gs·(Dv+2)·s`), and one all-gather shares the finished outputs (receives
    `p·B·Tq·Gs·Dv·s`).
    """
    check_sizes(
        batch=batch,
        q_len=q_len,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        p=p,
        itemsize=itemsize,
        stat_itemsize=stat_itemsize,
    )
    rows = batch * q_len * pass_q_heads(q_heads, kv_heads, p)
    return [
        ("collective-permute", rows * head_dim * itemsize, p - 1),
        ("all-to-all", p * rows * (v_dim + 2) * stat_itemsize, 1),
        ("all-gather", p * rows * v_dim * stat_itemsize, 1),
    ]


def collective_bytes(collectives: Sequence[Collective]) -> int:
    """Total bytes per device of a list of `(kind, nbytes, count)`, as `collective_stats`'s
    `total_bytes` counts them."""
    collectives = check_collectives(collectives, COLLECTIVE_KINDS)
    return sum(nbytes * count for _, nbytes, count in collectives)


_Bytes = TypeVar("_Bytes", int, float)


def _sent_times_p(kind: str, nbytes: _Bytes, p: int) -> _Bytes:
    """`p` times the bytes `wire_bytes` gives: an integer for integer sizes."""
    if kind == "all-reduce":
        return 2 * (p - 1) * nbytes
    if kind == "collective-permute":
        return p * nbytes
    return (p - 1) * nbytes  # all-gather, reduce-scatter, all-to-all


def wire_bytes(kind: CollectiveKind, nbytes: float, p: int) -> float:
    """Bytes one device sends in one collective of `kind` whose payload is `nbytes` (as
    `collective_stats` counts it: received for "all-gather", contributed otherwise), on `p`
    devices, with the ring algorithms (pairwise for the all-to-all):

    ======================  =====================================================
    "all-reduce"            2(p−1)/p · n (a reduce-scatter, then an all-gather;
                            the paper's eq. 12)
    "all-gather"            (p−1)/p · n (every block but the device's own, once)
    "reduce-scatter"        (p−1)/p · n
    "all-to-all"            (p−1)/p · n (n/p to each of the p−1 others)
    "collective-permute"    n
    ======================  =====================================================

    Sizes may be sympy symbols. Notebook 8's Exercise 1 derives it, and checks it against the
    ring algorithms run on numbers."""
    validate.check_str_choice(kind, COLLECTIVE_KINDS, "kind")
    check_nbytes(nbytes)
    check_sizes(p=p)
    return _sent_times_p(kind, nbytes, p) / p


def sent_bytes(collectives: Sequence[Collective], p: int) -> float:
    """Bytes one device sends in a list of `(kind, nbytes, count)` on `p` devices: the sum of
    `count · wire_bytes(kind, nbytes, p)`. Unlike `collective_bytes` (payloads, which mix
    what a device receives with what it contributes), this adds like with like."""
    collectives = check_collectives(collectives, COLLECTIVE_KINDS)
    check_sizes(p=p)
    return _sent_all_times_p(collectives, p) / p


def _sent_all_times_p(collectives: Sequence[Collective], p: int) -> int:
    """`p` times `sent_bytes`, unchecked: an integer for integer sizes."""
    return sum(count * _sent_times_p(kind, nbytes, p) for kind, nbytes, count in collectives)


def pass_q_crossover(
    kv_len: int,
    *,
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int,
    p: int,
    itemsize: int = 4,
    stat_itemsize: int = 4,
) -> int | None:
    """The smallest number of query tokens `Tq` at which the pass-Q ring
    (`pass_q_collectives`) sends at least as many bytes per device (`sent_bytes`) as the
    pass-KV ring (`ring_collectives`) over `kv_len` keys; None if it never does (one device,
    or a head shape where the pass-Q ring's bytes per query grow no faster).

    Both are linear in `Tq`: the pass-KV ring sends `F + b·Tq` (its K/V blocks, then the
    broadcast of its output), the pass-Q ring `a·Tq`, so `Tq* = ceil(F / (a − b))`. When p
    divides `kv_len` and `kv_heads` and both itemsizes are equal, that is
    `ceil(Tk·Hkv·(D + Dv) / (Hq·(D + 2)))`: per query row and head, the pass-Q ring's
    query, partial state and output (D + 2·Dv + 2 numbers) less the pass-KV ring's output
    broadcast (2·Dv), against D + Dv numbers per key and kv head."""
    check_concrete_sizes(
        "the crossover compares two byte counts",
        kv_len=kv_len,
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        p=p,
        itemsize=itemsize,
        stat_itemsize=stat_itemsize,
    )
    shape = dict(batch=batch, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim, p=p)

    def kv(tq: int) -> int:
        return _sent_all_times_p(
            ring_collectives(**shape, kv_len=kv_len, q_len=tq, q_heads=q_heads, itemsize=itemsize),
            p,
        )

    def q(tq: int) -> int:
        return _sent_all_times_p(
            pass_q_collectives(
                **shape, q_len=tq, q_heads=q_heads, itemsize=itemsize, stat_itemsize=stat_itemsize
            ),
            p,
        )

    per_q, per_kv = q(2) - q(1), kv(2) - kv(1)  # per query token
    fixed = kv(1) - per_kv  # the K/V blocks
    if per_q <= per_kv:
        return None
    return max(1, -(-fixed // (per_q - per_kv)))
