"""Closed-form counts of tree and ring decoding: steps, bytes on the wire, flops and memory.

Plain Python arithmetic (no JAX arrays). Notation follows the paper: b batch, t = N/p keys
per device, n_h heads, d_h head dim, d = n_h·d_h, p devices. Every size is a positive int
(at most `checks.MAX_SIZE`) or a sympy symbol, so that each formula can be checked
symbolically (`tests/test_costmodel.py`); the byte formulas are checked against what
`introspect.collective_stats` measures in the compiled program.

The roofline of a decode step is `kv_read_bytes`, `decode_flops` and their ratio
`decode_intensity`.
"""

from __future__ import annotations

import math

from .checks import check_branching, check_size, check_sizes


def reduction_steps(n: int, p: int, branching: int = 2) -> int:
    """Sequential steps to reduce `n` elements with an associative op on `p` workers.

    Each worker first reduces its `ceil(n/p)` elements (`ceil(n/p) - 1` steps), then the
    `p` partial results meet in a `branching`-ary tree of `ceil(log_branching p)` levels:
    O(N/p + log p) (paper, Theorem 1). With `p = 1` this is the serial `n - 1`.
    """
    check_size(n, "n")
    check_size(p, "p")
    check_branching(branching)
    p = min(p, n)
    return math.ceil(n / p) - 1 + tree_depth(p, branching)


def tree_depth(p: int, branching: int = 2) -> int:
    """Levels of a `branching`-ary reduction tree over `p` leaves."""
    check_size(p, "p")
    check_branching(branching)
    depth, width = 0, p
    while width > 1:
        width = math.ceil(width / branching)
        depth += 1
    return depth


def butterfly_rounds(p: int) -> int:
    """Exchange rounds of the butterfly merge (`core.merges.butterfly_combine`) over `p`
    devices, each one collective-permute: `log2 p` for a power of two; otherwise
    `floor(log2 p)` rounds among the first `2^k` devices, plus one that folds the other
    `p - 2^k` into them and one that sends the result back. Its latency is this many
    message latencies, against `2(p - 1)` for a ring all-reduce."""
    check_size(p, "p")
    k = p.bit_length() - 1
    return k if p == 1 << k else k + 2


def tree_payload_bytes(
    batch: int, q_len: int, q_heads: int, v_dim: int, itemsize: int = 4, levels: int = 1
) -> int:
    """Bytes each device contributes to tree decoding's Allreduces.

    Allreduce(max) of lse `[B, Tq, Hq]` plus Allreduce(sum) of the numerator `[B, Tq, Hq, Dv]`
    and denominator `[B, Tq, Hq]`, once per mesh level reduced over.
    """
    check_sizes(
        batch=batch, q_len=q_len, q_heads=q_heads, v_dim=v_dim, itemsize=itemsize, levels=levels
    )
    return levels * batch * q_len * q_heads * (v_dim + 2) * itemsize


def ring_payload_bytes(
    batch: int, kv_len: int, kv_heads: int, head_dim: int, v_dim: int, p: int, itemsize: int = 4
) -> int:
    """Bytes each device sends in Ring Attention decoding: p−1 K and V blocks of `kv_len/p` keys."""
    check_sizes(
        batch=batch,
        kv_len=kv_len,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        p=p,
        itemsize=itemsize,
    )
    t = -(-kv_len // p)  # ceil, exact for ints and for sympy symbols
    return (p - 1) * batch * t * kv_heads * (head_dim + v_dim) * itemsize


def paper_volume_tree(b: int, n_h: int, d_h: int, p: int) -> float:
    """Paper's communication volume of tree decoding, in elements: 2(p−1)/p·(b·d + 2·b·n_h).

    This is the ring-allreduce wire volume (each element is sent 2(p−1)/p times) of the
    numerator `b·d` and the max and denominator `2·b·n_h`.
    """
    check_sizes(b=b, n_h=n_h, d_h=d_h, p=p)
    return 2 * (p - 1) / p * (b * n_h * d_h + 2 * b * n_h)


def paper_volume_ring(b: int, t: int, n_h: int, d_h: int, p: int) -> float:
    """Paper's communication volume of Ring Attention, in elements: 2·b·t·d·p (K and V, p steps)."""
    check_sizes(b=b, t=t, n_h=n_h, d_h=d_h, p=p)
    return 2 * b * t * n_h * d_h * p


def paper_memory_tree(b: int, t: int, n_h: int, d_h: int) -> int:
    """Paper's peak memory of tree decoding, in elements (eq. 9): 2btd + 2bd + 2bn_h."""
    check_sizes(b=b, t=t, n_h=n_h, d_h=d_h)
    d = n_h * d_h
    return 2 * b * t * d + 2 * b * d + 2 * b * n_h


def paper_memory_ring(b: int, t: int, n_h: int, d_h: int) -> int:
    """Paper's peak memory of Ring Attention, in elements (eq. 8): 4btd + 2bd."""
    check_sizes(b=b, t=t, n_h=n_h, d_h=d_h)
    d = n_h * d_h
    return 4 * b * t * d + 2 * b * d


def kv_read_bytes(
    batch: int, kv_len: int, kv_heads: int, head_dim: int, v_dim: int, itemsize: int = 2
) -> int:
    """Bytes one decode step reads: K `[B, kv_len, Hkv, D]` and V `[B, kv_len, Hkv, Dv]`, once.

    `B·kv_len·Hkv·(D + Dv)·itemsize`. The query, the output and the statistics are smaller by
    a factor of `kv_len` and are left out.
    """
    check_sizes(
        batch=batch,
        kv_len=kv_len,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        itemsize=itemsize,
    )
    return batch * kv_len * kv_heads * (head_dim + v_dim) * itemsize


def decode_flops(
    batch: int, kv_len: int, q_heads: int, head_dim: int, v_dim: int, q_len: int = 1
) -> int:
    """Flops of attention for `q_len` queries per sequence over `kv_len` keys.

    Per query head and key: the score `q·k` (`D` multiply-adds, `2D` flops) and the update of
    the numerator by `p·v` (`2·Dv` flops), so `2·B·Tq·Hq·kv_len·(D + Dv)`. The softmax's
    exponentials and sums are `O(B·Tq·Hq·kv_len)` and are left out.
    """
    check_sizes(
        batch=batch, kv_len=kv_len, q_heads=q_heads, head_dim=head_dim, v_dim=v_dim, q_len=q_len
    )
    return 2 * batch * q_len * q_heads * kv_len * (head_dim + v_dim)


def decode_intensity(group: int, itemsize: int = 2, q_len: int = 1) -> float:
    """Arithmetic intensity of a decode step, in flop per byte of K and V read.

    `decode_flops / kv_read_bytes` with `Hq = group·Hkv`: every size cancels but the
    query heads per kv head `group` (1 for multi-head attention, `Hq/Hkv` for grouped-query
    attention), the queries per sequence `q_len` and the bytes per element `itemsize`:

        I = 2·group·q_len / itemsize.

    Sizes may be sympy symbols (`tests/test_costmodel.py` checks the closed form).
    """
    check_sizes(group=group, itemsize=itemsize, q_len=q_len)
    return decode_flops(1, 1, group, 1, 1, q_len) / kv_read_bytes(1, 1, 1, 1, 1, itemsize)


def peak_memory_tree(batch: int, t: int, n_h: int, d_h: int, itemsize: int = 1) -> int:
    """Bytes per device of tree decoding, part by part (`t` keys per device, `d = n_h·d_h`).

    The K and V shards, the query and the numerator it becomes, and the two per-head
    statistics that cross the wire (max and denominator). No output buffer: the result is
    the Allreduced numerator over the Allreduced denominator. At `itemsize=1` this is the
    paper's eq. 9 in elements (`tests/test_costmodel.py` checks it symbolically).
    """
    check_sizes(batch=batch, t=t, n_h=n_h, d_h=d_h, itemsize=itemsize)
    d = n_h * d_h
    kv_shard, query, numerator, stats = 2 * batch * t * d, batch * d, batch * d, 2 * batch * n_h
    return (kv_shard + query + numerator + stats) * itemsize


def peak_memory_ring(batch: int, t: int, n_h: int, d_h: int, itemsize: int = 1) -> int:
    """Bytes per device of Ring Attention, part by part: its own K and V shards, the
    neighbour's K and V block arriving while it computes, the query and the output.
    At `itemsize=1` this is the paper's eq. 8 in elements."""
    check_sizes(batch=batch, t=t, n_h=n_h, d_h=d_h, itemsize=itemsize)
    d = n_h * d_h
    kv_shard, kv_in_flight, query, output = (
        2 * batch * t * d,
        2 * batch * t * d,
        batch * d,
        batch * d,
    )
    return (kv_shard + kv_in_flight + query + output) * itemsize
