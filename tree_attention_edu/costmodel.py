"""Closed-form costs of tree and ring decoding: steps, bytes on the wire, memory.

Plain Python (no JAX), so it can be read and used without a device. The byte formulas
are checked against what `introspect.collective_stats` measures in the compiled program.

Notation follows the paper: b batch, t = N/p keys per device, n_h heads, d_h head dim,
d = n_h·d_h, p devices.
"""

from __future__ import annotations

import math


def reduction_steps(n: int, p: int, branching: int = 2) -> int:
    """Sequential steps to reduce `n` elements with an associative op on `p` workers.

    Each worker first reduces its `ceil(n/p)` elements (`ceil(n/p) - 1` steps), then the
    `p` partial results meet in a `branching`-ary tree of `ceil(log_branching p)` levels:
    O(N/p + log p) (paper, Theorem 1). With `p = 1` this is the serial `n - 1`.
    """
    if n < 1 or p < 1 or branching < 2:
        raise ValueError("need n >= 1, p >= 1 and branching >= 2")
    p = min(p, n)
    return math.ceil(n / p) - 1 + tree_depth(p, branching)


def tree_depth(p: int, branching: int = 2) -> int:
    """Levels of a `branching`-ary reduction tree over `p` leaves."""
    depth, width = 0, p
    while width > 1:
        width = math.ceil(width / branching)
        depth += 1
    return depth


def tree_payload_bytes(batch: int, q_len: int, q_heads: int, v_dim: int, itemsize: int = 4,
                       levels: int = 1) -> int:
    """Bytes each device contributes to tree decoding's Allreduces.

    Allreduce(max) of lse `[B, Tq, Hq]` plus Allreduce(sum) of the numerator `[B, Tq, Hq, Dv]`
    and denominator `[B, Tq, Hq]`, once per mesh level reduced over.
    """
    return levels * batch * q_len * q_heads * (v_dim + 2) * itemsize


def ring_payload_bytes(batch: int, kv_len: int, kv_heads: int, head_dim: int, v_dim: int,
                       p: int, itemsize: int = 4) -> int:
    """Bytes each device sends in Ring Attention decoding: p−1 K and V blocks of `kv_len/p` keys."""
    t = math.ceil(kv_len / p)
    return (p - 1) * batch * t * kv_heads * (head_dim + v_dim) * itemsize


def paper_volume_tree(b: int, n_h: int, d_h: int, p: int) -> float:
    """Paper's communication volume of tree decoding, in elements: 2(p−1)/p·(b·d + 2·b·n_h).

    This is the ring-allreduce wire volume (each element is sent 2(p−1)/p times) of the
    numerator `b·d` and the max and denominator `2·b·n_h`.
    """
    return 2 * (p - 1) / p * (b * n_h * d_h + 2 * b * n_h)


def paper_volume_ring(b: int, t: int, n_h: int, d_h: int, p: int) -> float:
    """Paper's communication volume of Ring Attention, in elements: 2·b·t·d·p (K and V, p steps)."""
    return 2 * b * t * n_h * d_h * p


def paper_memory_tree(b: int, t: int, n_h: int, d_h: int) -> int:
    """Paper's peak memory of tree decoding, in elements (eq. 9): 2btd + 2bd + 2bn_h."""
    d = n_h * d_h
    return 2 * b * t * d + 2 * b * d + 2 * b * n_h


def paper_memory_ring(b: int, t: int, n_h: int, d_h: int) -> int:
    """Paper's peak memory of Ring Attention, in elements (eq. 8): 4btd + 2bd."""
    d = n_h * d_h
    return 4 * b * t * d + 2 * b * d
