"""Predicted latency of one decode call: every merge pattern of tree decoding and both rings.

Each `Prediction` splits a call into the local kernel's roofline time (`local_decode_time`:
reading K and V at `mem_Bps`, or computing at `flops`), the collectives not hidden behind
it (`links.collective_time`, hierarchically across nodes; a merge's all-reduces one mesh
level at a time and its butterfly rounds by level, `predict_merge`), the local merge and a fixed
per-call overhead. Numbers only: a prediction compares times, so every size is a concrete
int and a sympy symbol is refused by name. `calibrate.calibrate` measures the parameters of
a `Topology` on the simulated devices before the model is used to extrapolate to
`paper.DGX_H100`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core import inputs, validate
from ..core.names import MERGE_NAMES, MergeName
from .checks import check_concrete_sizes, check_no_symbols, check_pattern, check_sizes
from .formulas import decode_flops, kv_read_bytes
from .links import (
    GLOO_ITEMSIZE,
    Collective,
    Topology,
    butterfly_time,
    collective_time,
    collectives_time,
    hierarchical_allreduce_time,
    read_curve,
)
from .patterns import (
    RingName,
    merge_collectives,
    merge_read_bytes,
    pass_q_collectives,
    pass_q_heads,
    ring_collectives,
)


def local_decode_time(
    batch: int,
    kv_len: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int,
    q_heads: int,
    topo: Topology,
    itemsize: int = 2,
    q_len: int = 1,
) -> float:
    """Time of one device's local decode over `kv_len` keys: `topo.kernel_fixed_s` plus the
    roofline, the larger of reading K and V once at `mem_Bps` (`kv_read_bytes`) and doing
    `decode_flops` at `flops`. Numbers only (the larger of two times)."""
    check_no_symbols(
        "local_decode_time takes the larger of two times",
        batch=batch,
        kv_len=kv_len,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        q_heads=q_heads,
        itemsize=itemsize,
        q_len=q_len,
    )
    check_sizes(
        batch=batch,
        kv_len=kv_len,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        q_heads=q_heads,
        itemsize=itemsize,
        q_len=q_len,
    )
    inputs.check_head_groups(q_heads, kv_heads)
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    nbytes = kv_read_bytes(batch, kv_len, kv_heads, head_dim, v_dim, itemsize)
    flops = decode_flops(batch, kv_len, q_heads, head_dim, v_dim, q_len)
    return topo.kernel_fixed_s + max(nbytes / topo.mem_Bps, flops / topo.flops)


def fold_time(
    batch: int,
    kv_len: int,
    kv_heads: int,
    head_dim: int,
    v_dim: int,
    q_heads: int,
    topo: Topology,
    itemsize: int = 2,
    q_len: int = 1,
    *,
    resident: bool = True,
) -> float:
    """Time of one ring step's fold: the local kernel over a block of `kv_len` keys (and
    `kv_heads` of the cache's heads) and its merge into the running state, inside the
    ring's compiled loop. Without `topo.fold_points`, a kernel call on its own
    (`local_decode_time`). With them:

    * `resident=True`, a block the loop has just written (the pass-KV ring's, received by
      the step before): read off the curve at the block's K+V bytes (`links.read_curve`;
      beyond the largest measured block at `mem_Bps`), measured on a block the loop reads
      again at every step (which it does not write: the nearest stand-in);
    * `resident=False`, a window of a shard the loop has not touched (the pass-Q ring's
      heads of its own cache): read off `topo.window_points` at the window's K+V bytes,
      measured on such windows with the step's query-block permute (which
      `predict_pass_q_ring` then does not add again); without them, the fold curve at no
      bytes (a loop step's own cost, its smallest block) plus the window's bytes at
      `mem_Bps`.

    Never less than the block's flops at `flops`."""
    validate.check_bool(resident, "resident")
    # local_decode_time checks the sizes for both paths.
    alone = local_decode_time(
        batch, kv_len, kv_heads, head_dim, v_dim, q_heads, topo, itemsize, q_len
    )
    if not topo.fold_points:
        return alone
    nbytes = kv_read_bytes(batch, kv_len, kv_heads, head_dim, v_dim, itemsize)
    flops = decode_flops(batch, kv_len, q_heads, head_dim, v_dim, q_len) / topo.flops
    if resident:
        return max(read_curve(topo.fold_points, nbytes, topo.mem_Bps), flops)
    if topo.window_points:
        return max(read_curve(topo.window_points, nbytes, topo.mem_Bps), flops)
    return read_curve(topo.fold_points, 0, topo.mem_Bps) + max(nbytes / topo.mem_Bps, flops)


@dataclass(frozen=True)
class Prediction:
    """Predicted latency of one decode call, split into its parts (seconds)."""

    method: MergeName | RingName
    devices: int
    seq_len: int
    compute_s: float
    comm_s: float
    overhead_s: float
    merge_s: float = 0.0  # the local merge after (or around) the collectives

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.overhead_s + self.merge_s


def _predict_args(
    seq_len: int,
    topo: Topology,
    batch: int,
    q_heads: int,
    kv_heads: int | None,
    head_dim: int,
    itemsize: int,
    q_len: int,
    **more: int | None,
) -> int:
    """Check a prediction's sizes (concrete ints: a prediction compares times) and that
    every device holds a key; return `kv_heads` (default: `q_heads`). `more`: further
    sizes, e.g. `v_dim` (None: not given)."""
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    kv_heads = q_heads if kv_heads is None else kv_heads
    check_concrete_sizes(
        "a latency prediction compares times",
        seq_len=seq_len,
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        itemsize=itemsize,
        q_len=q_len,
        **{k: v for k, v in more.items() if v is not None},
    )
    inputs.check_head_groups(q_heads, kv_heads)
    if seq_len < topo.devices:
        raise ValueError(
            f"`seq_len` = {seq_len} keys over `topo`'s {topo.devices} devices leaves some "
            f"without a key; give at least one key per device, or fewer devices "
            f"(`topo.with_devices(p)`)."
        )
    return kv_heads


def predict_tree(
    seq_len: int,
    topo: Topology,
    *,
    batch: int = 1,
    q_heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    itemsize: int = 2,
    q_len: int = 1,
    stat_itemsize: int = 4,
) -> Prediction:
    """Tree decoding as the paper does it (Algorithm 3): `predict_merge("allreduce", ...)`.

    The local state over the whole shard, then Allreduce(max) of the lse `[B, Tq, Hq]` and
    Allreduce(sum) of numerator and denominator `[B, Tq, Hq, Dv + 1]`, each inside nodes
    first, then across nodes. Statistics travel in `stat_itemsize` bytes (float32)."""
    return predict_merge(
        "allreduce",
        seq_len,
        topo,
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        itemsize=itemsize,
        q_len=q_len,
        stat_itemsize=stat_itemsize,
    )


def predict_ring(
    seq_len: int,
    topo: Topology,
    *,
    batch: int = 1,
    q_heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    itemsize: int = 2,
    q_len: int = 1,
    overlap: bool | None = None,
    v_dim: int | None = None,
) -> Prediction:
    """Ring decoding (pass-KV): p blocks of `N/p` keys computed, p−1 K/V block transfers.

    `decode.ring_decode` is a `lax.scan` of p−1 steps with double buffering: each step sends
    the block it holds onwards (`ring_collectives`: two collective-permutes, K and V) and folds
    it into the running state while the transfer is in flight, then the last block is folded.
    Every transfer of a step waits for the slowest link in the ring (inter-node once the ring
    spans nodes). With overlap a step costs `max(compute, transfer)`, else their sum; the last
    block's compute is never hidden. Then one all-reduce of the output makes the replicated
    result the same on every device. `comm_s` is the part not hidden behind compute.

    Each fold is priced by `fold_time`: off the topology's measured in-loop curve where it
    has one (`Topology.fold_points`), else as a kernel call on its own.

    Where `topo.copy_Bps` is set, each of the p−1 steps also reads and writes one K/V block
    at that rate (part of `compute_s`): XLA:CPU copies the loop-carried block before sending
    it, the permute's result taking the same loop slot (the compiled loop body shows the two
    copies).
    """
    kv_heads = _predict_args(
        seq_len, topo, batch, q_heads, kv_heads, head_dim, itemsize, q_len, v_dim=v_dim
    )
    v_dim = head_dim if v_dim is None else v_dim
    validate.check_bool(overlap, "overlap", optional=True)
    overlap = topo.overlap if overlap is None else overlap
    p = topo.devices
    t = -(-seq_len // p)
    block = fold_time(batch, t, kv_heads, head_dim, v_dim, q_heads, topo, itemsize, q_len)
    k_send, v_send, *broadcast = ring_collectives(
        batch=batch,
        kv_len=seq_len,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        p=p,
        itemsize=itemsize,
        q_len=q_len,
        q_heads=q_heads,
    )
    send = sum(collective_time(kind, nbytes, topo) for kind, nbytes, _ in (k_send, v_send))
    send = send if p > 1 else 0.0  # per step
    hidden = min(block, send) if overlap else 0.0
    copy = (
        0.0
        if topo.copy_Bps is None
        else 2 * batch * t * kv_heads * (head_dim + v_dim) * itemsize / topo.copy_Bps
    )
    comm = (p - 1) * (send - hidden) + collectives_time(broadcast, topo)
    return Prediction("ring", p, seq_len, p * block + (p - 1) * copy, comm, topo.overhead_s)


def predict_merge(
    pattern: MergeName,
    seq_len: int,
    topo: Topology,
    *,
    batch: int = 1,
    q_heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    v_dim: int | None = None,
    itemsize: int = 2,
    q_len: int = 1,
    stat_itemsize: int = 4,
    fallback: bool = False,
) -> Prediction:
    """Tree decoding with merge `pattern` (one of `MERGE_NAMES`) on all of `topo`'s devices.

    `compute_s`: the local kernel over the shard of `ceil(N/p)` keys (roofline,
    `local_decode_time`); `comm_s`: `merge_collectives` (each operand of an all-reduce
    apart where `topo.ring_only` or `topo.operands_apart`), one after the other:
    all-reduces one mesh level at a time (`hierarchical_allreduce_time`), butterfly rounds
    by level (`butterfly_time`), the rest by `collective_time`, a kind in `topo.measured` as
    measured; `merge_s`: `merge_read_bytes` at `mem_Bps`; `overhead_s`: `topo.overhead_s`.
    For "one_pass" the fast path is predicted; `fallback=True` adds the exact merge that
    runs when the shared shift does not fit.
    """
    check_pattern(pattern)
    kv_heads = _predict_args(
        seq_len,
        topo,
        batch,
        q_heads,
        kv_heads,
        head_dim,
        itemsize,
        q_len,
        v_dim=v_dim,
        stat_itemsize=stat_itemsize,
    )
    _check_gloo_elements(topo, stat_itemsize)
    v_dim = head_dim if v_dim is None else v_dim
    p = topo.devices
    t = -(-seq_len // p)
    compute = local_decode_time(batch, t, kv_heads, head_dim, v_dim, q_heads, topo, itemsize, q_len)
    shape: dict[str, Any] = dict(
        batch=batch, q_len=q_len, q_heads=q_heads, v_dim=v_dim, p=p, stat_itemsize=stat_itemsize
    )
    collectives = merge_collectives(
        pattern,
        **shape,
        fallback=fallback,
        out_itemsize=itemsize,
        operands_apart=topo.ring_only or topo.operands_apart,
    )
    comm = _merge_comm_time(collectives, topo)
    merge = merge_read_bytes(pattern, **shape) / topo.mem_Bps
    return Prediction(pattern, p, seq_len, compute, comm, topo.overhead_s, merge)


def _check_gloo_elements(topo: Topology, stat_itemsize: int) -> None:
    """`gloo_ring_time` counts a ring's segments in float32 elements (`GLOO_ITEMSIZE`): a
    merge whose statistics travel in another size would be priced by the wrong count."""
    links = (topo.intra, topo.inter, topo.flat_ring)
    if topo.ring_only and any(k is not None and k.call_s is not None for k in links):
        if stat_itemsize != GLOO_ITEMSIZE:
            raise ValueError(
                f"`stat_itemsize` is {stat_itemsize}, but this gloo topology prices rings of "
                f"few elements by segments of {GLOO_ITEMSIZE}-byte elements (`Link.call_s`): "
                f"pass stat_itemsize={GLOO_ITEMSIZE}, or links without call_s"
            )


def _merge_comm_time(collectives: list[Collective], topo: Topology) -> float:
    """Seconds of a merge pattern's collectives (`merge_collectives`) on `topo`, one after
    the other. Unless measured (`Topology.measured`), the merges' all-reduces run one mesh
    level at a time (`core.merges.psum_inner_first`: inside nodes, then across), and the
    butterfly's permutes pair devices inside a node before across (`butterfly_time`);
    everything else as `collective_time`."""
    measured = dict(topo.measured)
    total = 0.0
    for kind, nbytes, count in collectives:
        if kind in measured or kind not in ("all-reduce", "collective-permute"):
            total += count * collective_time(kind, nbytes, topo)
        elif kind == "all-reduce":
            total += count * hierarchical_allreduce_time(nbytes, topo)
        else:  # only the butterfly permutes in a merge: count == butterfly_rounds(p)
            total += butterfly_time(nbytes, topo)
    return total


def predict_pass_q_ring(
    seq_len: int,
    topo: Topology,
    *,
    batch: int = 1,
    q_heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    v_dim: int | None = None,
    itemsize: int = 2,
    q_len: int = 1,
    stat_itemsize: int = 4,
    overlap: bool | None = None,
) -> Prediction:
    """Pass-Q ring (`pass_q_collectives`): p steps, each the shard against one travelling
    query block of `Gs` heads, so a step reads the `ceil(Hkv/p)` kv heads of the shard
    (≈ 1/p of it, priced by `fold_time` as a window read from memory); p−1 query-block
    permutes, each overlapping a step's compute when the topology overlaps (with
    `topo.window_points` they are not priced on their own but inside each of the p steps'
    measured time: p, one more than the ring runs); then the
    all-to-all of the partial states, their local merge (`p·B·Tq·Gs·(Dv+2)·s` bytes read)
    and the all-gather of the outputs.

    Cheaper than pass-KV when `Tq·Hq ≪ Tk·Hkv`: what travels is the queries, not the cache.
    """
    kv_heads = _predict_args(
        seq_len,
        topo,
        batch,
        q_heads,
        kv_heads,
        head_dim,
        itemsize,
        q_len,
        v_dim=v_dim,
        stat_itemsize=stat_itemsize,
    )
    v_dim = head_dim if v_dim is None else v_dim
    validate.check_bool(overlap, "overlap", optional=True)
    overlap = topo.overlap if overlap is None else overlap
    p = topo.devices
    t = math.ceil(seq_len / p)
    gs = pass_q_heads(q_heads, kv_heads, p)
    hs = gs // (q_heads // kv_heads)
    step = fold_time(batch, t, hs, head_dim, v_dim, gs, topo, itemsize, q_len, resident=False)
    permute, *after = pass_q_collectives(
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
    send = collective_time(permute[0], permute[1], topo) if p > 1 else 0.0
    if topo.window_points:  # measured with its permute (`fold_loop_times(windows=True)`)
        send = 0.0  # (so p steps carry p permutes where the ring runs p - 1: one too many)
    hidden = min(step, send) if overlap else 0.0
    comm = (p - 1) * (send - hidden) + collectives_time(after, topo)
    merge = p * batch * q_len * gs * (v_dim + 2) * stat_itemsize / topo.mem_Bps
    return Prediction("ring_pass_q", p, seq_len, p * step, comm, topo.overhead_s, merge)


def predict_all(
    seq_len: int,
    topo: Topology,
    *,
    batch: int = 1,
    q_heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    v_dim: int | None = None,
    itemsize: int = 2,
    q_len: int = 1,
    stat_itemsize: int = 4,
) -> dict[MergeName | RingName, Prediction]:
    """Every merge pattern (`MERGE_NAMES`) and both rings (`RINGS`) on the same problem."""
    shape: dict[str, Any] = dict(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        itemsize=itemsize,
        q_len=q_len,
    )
    out: dict[MergeName | RingName, Prediction] = {
        m: predict_merge(m, seq_len, topo, **shape, stat_itemsize=stat_itemsize)
        for m in MERGE_NAMES
    }
    out["ring"] = predict_ring(seq_len, topo, **shape)
    out["ring_pass_q"] = predict_pass_q_ring(seq_len, topo, **shape, stat_itemsize=stat_itemsize)
    return out
