"""Closed-form costs of tree and ring decoding: steps, bytes on the wire, memory, latency.

Plain Python arithmetic (no JAX arrays), so it can be read and used without a device. The
byte formulas are checked against what `introspect.collective_stats` measures in the compiled
program, and the latency model (`Topology`, `predict_tree`, `predict_ring`) is calibrated on the
simulated devices by `calibrate.calibrate` before it is used to extrapolate to `DGX_H100`.

The roofline of a decode step is `kv_read_bytes`, `decode_flops` and their ratio
`decode_intensity`. The paper's experiments are here too, so that notebooks and tests share
them: its cluster (`DGX_H100`, published figures with their `sources`), its microbenchmark
(`paper_microbenchmark`), its model (`LLAMA_3_1_8B`, `generation_time`) and its Llama
timings (`PAPER_LLAMA`, Table 1).

Notation follows the paper: b batch, t = N/p keys per device, n_h heads, d_h head dim,
d = n_h·d_h, p devices.

Every size is a positive int and every rate a positive number; anything else raises a
ValueError or TypeError that names the argument. Sizes may also be sympy symbols in the
byte, flop, step and memory formulas and in the single-algorithm collective times, so that
they can be checked symbolically (`tests/test_costmodel.py`); the functions that compare
times (the cheaper algorithm, a roofline's max, every latency prediction) need numbers, and
name the symbol they were given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..core import inputs, merges, validate

MAX_SIZE = 2**50
"""Largest size the model takes: products of six such sizes stay inside float64's range."""


def _int(value: Any, name: str, **kw: Any) -> Any:
    """`validate.check_int`, and at most `MAX_SIZE`: the formulas multiply and divide sizes
    in floating point, where a larger one would leave float64's range."""
    value = validate.check_int(value, name, **kw)
    if isinstance(value, int) and value > MAX_SIZE:
        shown = value if value < 10**30 else f"an int of {len(str(value))} digits"
        raise ValueError(f"`{name}` = {shown} exceeds the model's largest size, 2**50 "
                         f"({MAX_SIZE:.3g}): the formulas multiply sizes in floating point, "
                         f"and such products would leave its range.")
    return value


def _sizes(**sizes) -> None:
    """Each size a positive int at most `MAX_SIZE` (or a sympy expression)."""
    for name, value in sizes.items():
        _int(value, name, symbolic=True)


def _is_symbolic(value: Any) -> bool:
    return hasattr(value, "free_symbols") and hasattr(value, "subs")


def _no_symbols(what: str, **values: Any) -> None:
    """`what` compares times (a max, a min, the cheaper algorithm), which needs numbers: a
    sympy expression among `values` is a TypeError naming it. `what` is a clause such as
    "allreduce_time compares times"."""
    for name, value in values.items():
        if _is_symbolic(value):
            raise TypeError(
                f"`{name}` is a sympy expression ({value}); {what}, which needs numbers. "
                f"Substitute values first (`expr.subs(...)`), or use the "
                f"formulas that take symbols (kv_read_bytes, decode_flops, merge_collectives, "
                f"ring_collectives, the paper_* volumes and memories, ...)."
            )


def _link_fields(link: Any, name: str = "link") -> dict[str, Any]:
    """A Link's fields by their names in a message (`link.alpha_s`, ...)."""
    return {f"{name}.alpha_s": link.alpha_s, f"{name}.beta_Bps": link.beta_Bps}


def _concrete_sizes(what: str, **sizes: Any) -> None:
    """Each size a positive int at most `MAX_SIZE`, and not a sympy expression."""
    _no_symbols(what, **sizes)
    _sizes(**sizes)


def _real(value: Any, name: str, **kw: Any) -> Any:
    """`validate.check_real`, with a Python int too large for a float (10**400) refused by
    name instead of overflowing inside the conversion."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:
            raise ValueError(
                f"`{name}` = an int of {len(str(abs(value)))} digits does not fit in a float "
                f"(largest {np.finfo(np.float64).max:.3g}), in which the model computes; pass "
                f"a smaller number{'; ' + kw['hint'] if kw.get('hint') else ''}."
            ) from None
    return validate.check_real(value, name, **kw)


def _branching(branching: int) -> None:
    _int(branching, "branching", minimum=2, symbolic=True,
         example="`branching=2` for a binary tree")


def _nbytes(nbytes: float, name: str = "nbytes") -> None:
    _real(nbytes, name, low=0.0, symbolic=True)


def _check_whole_nodes(p: int, devices_per_node: int) -> None:
    if p > devices_per_node and p % devices_per_node:
        raise ValueError(
            f"`p`={p} is not a whole number of {devices_per_node}-device nodes; pass at most "
            f"{devices_per_node} or a multiple of {devices_per_node}."
        )


def _check_kind_links(pairs: Any, name: str, kinds: tuple[str, ...], link_cls: type) -> None:
    """A tuple of `(kind, Link)` pairs, each kind one of `kinds` and given once."""
    eg = '(("all-gather", Link(alpha_s=1e-4, beta_Bps=1e9)),)'
    if not isinstance(pairs, tuple):
        raise TypeError(f"`{name}` must be a tuple of (kind, Link) pairs, e.g. {eg}, got "
                        f"{validate.describe(pairs)}.")
    seen = set()
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], link_cls)):
            raise TypeError(f"`{name}[{i}]` must be a (kind, Link) pair, e.g. {eg}, got "
                            f"{validate.describe(pair)}.")
        validate.check_choice(pair[0], kinds, f"{name}[{i}][0]")
        if pair[0] in seen:
            raise ValueError(f"`{name}` gives {pair[0]!r} twice; give each kind once.")
        seen.add(pair[0])





def reduction_steps(n: int, p: int, branching: int = 2) -> int:
    """Sequential steps to reduce `n` elements with an associative op on `p` workers.

    Each worker first reduces its `ceil(n/p)` elements (`ceil(n/p) - 1` steps), then the
    `p` partial results meet in a `branching`-ary tree of `ceil(log_branching p)` levels:
    O(N/p + log p) (paper, Theorem 1). With `p = 1` this is the serial `n - 1`.
    """
    _int(n, "n")
    _int(p, "p")
    _branching(branching)
    p = min(p, n)
    return math.ceil(n / p) - 1 + tree_depth(p, branching)


def tree_depth(p: int, branching: int = 2) -> int:
    """Levels of a `branching`-ary reduction tree over `p` leaves."""
    _int(p, "p")
    _branching(branching)
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
    _sizes(batch=batch, q_len=q_len, q_heads=q_heads, v_dim=v_dim, itemsize=itemsize,
           levels=levels)
    return levels * batch * q_len * q_heads * (v_dim + 2) * itemsize


def ring_payload_bytes(batch: int, kv_len: int, kv_heads: int, head_dim: int, v_dim: int,
                       p: int, itemsize: int = 4) -> int:
    """Bytes each device sends in Ring Attention decoding: p−1 K and V blocks of `kv_len/p` keys."""
    _sizes(batch=batch, kv_len=kv_len, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim, p=p,
           itemsize=itemsize)
    t = -(-kv_len // p)  # ceil, exact for ints and for sympy symbols
    return (p - 1) * batch * t * kv_heads * (head_dim + v_dim) * itemsize


def paper_volume_tree(b: int, n_h: int, d_h: int, p: int) -> float:
    """Paper's communication volume of tree decoding, in elements: 2(p−1)/p·(b·d + 2·b·n_h).

    This is the ring-allreduce wire volume (each element is sent 2(p−1)/p times) of the
    numerator `b·d` and the max and denominator `2·b·n_h`.
    """
    _sizes(b=b, n_h=n_h, d_h=d_h, p=p)
    return 2 * (p - 1) / p * (b * n_h * d_h + 2 * b * n_h)


def paper_volume_ring(b: int, t: int, n_h: int, d_h: int, p: int) -> float:
    """Paper's communication volume of Ring Attention, in elements: 2·b·t·d·p (K and V, p steps)."""
    _sizes(b=b, t=t, n_h=n_h, d_h=d_h, p=p)
    return 2 * b * t * n_h * d_h * p


def paper_memory_tree(b: int, t: int, n_h: int, d_h: int) -> int:
    """Paper's peak memory of tree decoding, in elements (eq. 9): 2btd + 2bd + 2bn_h."""
    _sizes(b=b, t=t, n_h=n_h, d_h=d_h)
    d = n_h * d_h
    return 2 * b * t * d + 2 * b * d + 2 * b * n_h


def paper_memory_ring(b: int, t: int, n_h: int, d_h: int) -> int:
    """Paper's peak memory of Ring Attention, in elements (eq. 8): 4btd + 2bd."""
    _sizes(b=b, t=t, n_h=n_h, d_h=d_h)
    d = n_h * d_h
    return 4 * b * t * d + 2 * b * d


# --- alpha-beta model of a topology -------------------------------------------------------
#
# A message of n bytes over a link costs `alpha + n / beta` seconds (Hockney's model).
# Collective costs follow Thakur, Rabenseifner & Gropp, "Optimization of Collective
# Communication Operations in MPICH", IJHPCA 19(1), 2005:
#   ring allreduce (reduce-scatter + allgather, Patarasuk & Yuan, JPDC 69(2), 2009):
#       2(p-1)·alpha + 2(p-1)/p · n/beta
#   tree allreduce (recursive doubling / binomial tree):
#       ceil(log2 p)·(alpha + n/beta)
# `allreduce_time` prices both and takes the cheaper per message size, as an MPICH-style
# selection does. NCCL's algorithms differ (ring and double binary trees for all-reduce, rings
# for all-gather and reduce-scatter, NVLS/CollNet where the hardware has them; its tuner picks
# among those, NCCL docs `NCCL_ALGO`): the model is MPICH's, not NCCL's.
# The other collectives of the merge patterns, from the same paper (m bytes contributed per
# rank, p ranks):
#   all-gather, ring:                 (p-1)·(alpha + m/beta)
#   all-gather, recursive doubling:   ceil(log2 p)·alpha + (p-1)·m/beta
#   reduce-scatter (ring / pairwise): (p-1)·alpha + (p-1)/p · m/beta
#   all-to-all (pairwise exchange):   (p-1)·(alpha + m/(p·beta))
#   collective-permute (one send):    alpha + m/beta

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")
"""The collectives as `introspect.collective_stats` names them."""


@dataclass(frozen=True)
class Link:
    """One level of interconnect: per-message latency `alpha_s` and bandwidth `beta_Bps`
    (bytes per second, one direction)."""

    alpha_s: float
    beta_Bps: float

    def __post_init__(self):
        _real(self.alpha_s, "alpha_s", low=0.0, symbolic=True,
              hint="seconds per message, e.g. 3e-6")
        _real(self.beta_Bps, "beta_Bps", low=0.0, low_open=True, finite=False, symbolic=True,
              hint="bytes per second, e.g. 50e9 (float('inf'): no bandwidth limit)")

    def send(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes`."""
        _nbytes(nbytes)
        return self.alpha_s + nbytes / self.beta_Bps


@dataclass(frozen=True)
class Topology:
    """`nodes` × `devices_per_node` devices; `intra` links inside a node, `inter` between nodes.

    `mem_Bps` is one device's memory (read) bandwidth and `flops` its peak flop rate;
    `overhead_s` is a fixed cost per decode call (launch and dispatch), and `overlap` says
    whether a device can compute while its links transfer (a GPU with NCCL streams can;
    XLA:CPU's simulated devices run one op at a time).

    `measured` holds collectives timed on exactly these `devices` (`calibrate`): pairs
    `(kind, Link)` where one call of that kind over all devices costs `alpha_s + n/beta_Bps`
    for `n` bytes counted as `collective_stats` counts them. A measured kind replaces the
    alpha-beta algorithm formulas (`collective_time`): the simulated devices implement each
    collective their own way, with a cost no link model of a GPU describes.

    `copy_Bps` is the rate of a device-local copy (bytes read + written) where the ring's
    loop copies its block before each send, as XLA compiles `decode.ring_decode` on the
    simulated CPU devices (`calibrate` measures it); None means no such copy, as in a GPU
    ring that receives into its second buffer (the published topologies).

    `ring_only`: the collective library runs every all-reduce and all-gather as a ring, as
    XLA:CPU asks gloo to (`tree_attention_edu.cluster`); False prices the cheaper of ring and
    tree (recursive doubling) per message size, as an MPICH-style selection does (NCCL's
    own algorithms differ: see the comment above `ring_allreduce_time`).

    `uplinks`: inter-node links per node, shared by its devices; None means one per device
    (DGX H100: eight NICs for eight GPUs). When fewer, a stage in which every device of a
    node sends across at once (the inter-node half of an all-reduce, all-gather,
    reduce-scatter or all-to-all) gives each device `β·uplinks/devices_per_node`
    (`shared_inter`); a ring's collective-permute crosses with one device per node and runs
    at `β`.
    """

    nodes: int
    devices_per_node: int
    intra: Link
    inter: Link
    mem_Bps: float
    flops: float
    overhead_s: float = 0.0
    overlap: bool = True
    name: str = ""
    sources: tuple[str, ...] = ()
    measured: tuple[tuple[str, Link], ...] = ()
    copy_Bps: float | None = None
    ring_only: bool = False
    uplinks: int | None = None

    def __post_init__(self):
        _int(self.nodes, "nodes")
        _int(self.devices_per_node, "devices_per_node")
        validate.check_instance(self.intra, Link, "intra", "pass Link(alpha_s, beta_Bps)")
        validate.check_instance(self.inter, Link, "inter", "pass Link(alpha_s, beta_Bps)")
        for name, link in (("intra", self.intra), ("inter", self.inter), *(
                (f"measured[{i}][1]", pair[1]) for i, pair in enumerate(self.measured)
                if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], Link))):
            _no_symbols("a Topology picks each collective's algorithm by comparing times",
                        **_link_fields(link, name))
        _real(self.mem_Bps, "mem_Bps", low=0.0, low_open=True, finite=False,
              hint="memory read bytes per second, e.g. 3.35e12")
        _real(self.flops, "flops", low=0.0, low_open=True, finite=False,
              hint="peak flop/s, e.g. 989e12 (inf: never compute-bound)")
        _real(self.overhead_s, "overhead_s", low=0.0)
        validate.check_bool(self.overlap, "overlap")
        validate.check_bool(self.ring_only, "ring_only")
        if self.uplinks is not None:
            _int(self.uplinks, "uplinks")
        _check_kind_links(self.measured, "measured", COLLECTIVE_KINDS, Link)
        if self.copy_Bps is not None:
            _real(self.copy_Bps, "copy_Bps", low=0.0, low_open=True, finite=False,
                  hint="bytes read + written per second by a local copy")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def shared_inter(self) -> Link:
        """The inter-node link as each device sees it when all of a node's devices send
        across at once (`uplinks`)."""
        if self.uplinks is None or self.uplinks >= self.devices_per_node:
            return self.inter
        return Link(self.inter.alpha_s,
                    self.inter.beta_Bps * self.uplinks / self.devices_per_node)

    @property
    def ridge_point(self) -> float:
        """Flop per byte at which a device turns from memory-bound to compute-bound:
        `flops / mem_Bps` (the roofline's ridge point)."""
        return self.flops / self.mem_Bps

    def with_devices(self, p: int) -> Topology:
        """The same hardware with `p` devices: whole nodes once `p` exceeds a node."""
        _int(p, "p")
        _check_whole_nodes(p, self.devices_per_node)
        # Collectives measured on this many devices say nothing about another count.
        measured = self.measured if p == self.devices else ()
        if p <= self.devices_per_node:
            return replace(self, nodes=1, devices_per_node=p, measured=measured)
        return replace(self, nodes=p // self.devices_per_node, measured=measured)


def _allreduce_args(nbytes: float, p: int, link: Link) -> None:
    _nbytes(nbytes)
    _int(p, "p")
    validate.check_instance(link, Link, "link", "pass Link(alpha_s, beta_Bps)")


def ring_allreduce_time(nbytes: float, p: int, link: Link) -> float:
    """Ring allreduce of `nbytes` over `p` ranks: 2(p−1)α + 2(p−1)/p·n/β (Thakur et al. 2005)."""
    _allreduce_args(nbytes, p, link)
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes / link.beta_Bps


def tree_allreduce_time(nbytes: float, p: int, link: Link) -> float:
    """Recursive-doubling allreduce: ⌈log2 p⌉(α + n/β) (Thakur et al. 2005)."""
    _allreduce_args(nbytes, p, link)
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * link.send(nbytes)


def allreduce_time(nbytes: float, p: int, link: Link) -> tuple[float, str]:
    """The cheaper of ring and recursive-doubling allreduce (an MPICH-style selection):
    `(seconds, "ring"|"tree")`. Numbers only: the choice compares the two times."""
    _allreduce_args(nbytes, p, link)
    _no_symbols("allreduce_time compares two algorithms' times", nbytes=nbytes,
                **_link_fields(link))
    ring, tree = ring_allreduce_time(nbytes, p, link), tree_allreduce_time(nbytes, p, link)
    return (tree, "tree") if tree <= ring else (ring, "ring")


def hierarchical_allreduce_time(nbytes: float, topo: Topology) -> float:
    """Allreduce inside every node (over `intra`), then across nodes (over `inter`).

    The second stage carries the already-reduced message: one per node position.
    """
    _nbytes(nbytes)
    _no_symbols("hierarchical_allreduce_time compares algorithms' times", nbytes=nbytes)
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    inter = topo.shared_inter  # every device of a node takes part in the second stage
    if topo.ring_only:
        return (ring_allreduce_time(nbytes, topo.devices_per_node, topo.intra)
                + ring_allreduce_time(nbytes, topo.nodes, inter))
    return (allreduce_time(nbytes, topo.devices_per_node, topo.intra)[0]
            + allreduce_time(nbytes, topo.nodes, inter)[0])


def kv_read_bytes(batch: int, kv_len: int, kv_heads: int, head_dim: int, v_dim: int,
                  itemsize: int = 2) -> int:
    """Bytes one decode step reads: K `[B, kv_len, Hkv, D]` and V `[B, kv_len, Hkv, Dv]`, once.

    `B·kv_len·Hkv·(D + Dv)·itemsize`. The query, the output and the statistics are smaller by
    a factor of `kv_len` and are left out.
    """
    _sizes(batch=batch, kv_len=kv_len, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim,
           itemsize=itemsize)
    return batch * kv_len * kv_heads * (head_dim + v_dim) * itemsize


def decode_flops(batch: int, kv_len: int, q_heads: int, head_dim: int, v_dim: int,
                 q_len: int = 1) -> int:
    """Flops of attention for `q_len` queries per sequence over `kv_len` keys.

    Per query head and key: the score `q·k` (`D` multiply-adds, `2D` flops) and the update of
    the numerator by `p·v` (`2·Dv` flops), so `2·B·Tq·Hq·kv_len·(D + Dv)`. The softmax's
    exponentials and sums are `O(B·Tq·Hq·kv_len)` and are left out.
    """
    _sizes(batch=batch, kv_len=kv_len, q_heads=q_heads, head_dim=head_dim, v_dim=v_dim,
           q_len=q_len)
    return 2 * batch * q_len * q_heads * kv_len * (head_dim + v_dim)


def decode_intensity(group: int, itemsize: int = 2, q_len: int = 1) -> float:
    """Arithmetic intensity of a decode step, in flop per byte of K and V read.

    `decode_flops / kv_read_bytes` with `Hq = group·Hkv`: every size cancels but the
    query heads per kv head `group` (1 for multi-head attention, `Hq/Hkv` for grouped-query
    attention), the queries per sequence `q_len` and the bytes per element `itemsize`:

        I = 2·group·q_len / itemsize.

    Sizes may be sympy symbols (`tests/test_costmodel.py` checks the closed form).
    """
    _sizes(group=group, itemsize=itemsize, q_len=q_len)
    return (decode_flops(1, 1, group, 1, 1, q_len)
            / kv_read_bytes(1, 1, 1, 1, 1, itemsize))


def local_decode_time(batch: int, kv_len: int, kv_heads: int, head_dim: int, v_dim: int,
                      q_heads: int, topo: Topology, itemsize: int = 2, q_len: int = 1) -> float:
    """Roofline time of one device's local decode over `kv_len` keys: the larger of reading
    K and V once at `mem_Bps` (`kv_read_bytes`) and doing `decode_flops` at `flops`.
    Numbers only (the larger of two times)."""
    _no_symbols("local_decode_time takes the larger of two times", batch=batch,
                kv_len=kv_len, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim,
                q_heads=q_heads, itemsize=itemsize, q_len=q_len)
    _sizes(batch=batch, kv_len=kv_len, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim,
           q_heads=q_heads, itemsize=itemsize, q_len=q_len)
    inputs.check_head_groups(q_heads, kv_heads)
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    nbytes = kv_read_bytes(batch, kv_len, kv_heads, head_dim, v_dim, itemsize)
    flops = decode_flops(batch, kv_len, q_heads, head_dim, v_dim, q_len)
    return max(nbytes / topo.mem_Bps, flops / topo.flops)


@dataclass(frozen=True)
class Prediction:
    """Predicted latency of one decode call, split into its parts (seconds)."""

    method: str
    devices: int
    seq_len: int
    compute_s: float
    comm_s: float
    overhead_s: float
    merge_s: float = 0.0  # the local merge after (or around) the collectives

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.overhead_s + self.merge_s


def _predict_args(seq_len, topo, batch, q_heads, kv_heads, head_dim, itemsize, q_len,
                  **more) -> int:
    """Check a prediction's sizes (concrete ints: a prediction compares times) and that
    every device holds a key; return `kv_heads` (default: `q_heads`). `more`: further
    sizes, e.g. `v_dim` (None: not given)."""
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    kv_heads = q_heads if kv_heads is None else kv_heads
    _concrete_sizes("a latency prediction compares times", seq_len=seq_len, batch=batch,
                    q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize,
                    q_len=q_len, **{k: v for k, v in more.items() if v is not None})
    inputs.check_head_groups(q_heads, kv_heads)
    if seq_len < topo.devices:
        raise ValueError(
            f"`seq_len` = {seq_len} keys over `topo`'s {topo.devices} devices leaves some "
            f"without a key; give at least one key per device, or fewer devices "
            f"(`topo.with_devices(p)`)."
        )
    return kv_heads


def predict_tree(seq_len: int, topo: Topology, *, batch: int = 1, q_heads: int = 16,
                 kv_heads: int | None = None, head_dim: int = 128, itemsize: int = 2,
                 q_len: int = 1, stat_itemsize: int = 4) -> Prediction:
    """Tree decoding as the paper does it (Algorithm 3): `predict_merge("allreduce", ...)`.

    The local state over the whole shard, then Allreduce(max) of the lse `[B, Tq, Hq]` and
    Allreduce(sum) of numerator and denominator `[B, Tq, Hq, Dv + 1]`, each inside nodes
    first, then across nodes. Statistics travel in `stat_itemsize` bytes (float32)."""
    return predict_merge("allreduce", seq_len, topo, batch=batch, q_heads=q_heads,
                         kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize,
                         q_len=q_len, stat_itemsize=stat_itemsize)


def predict_ring(seq_len: int, topo: Topology, *, batch: int = 1, q_heads: int = 16,
                 kv_heads: int | None = None, head_dim: int = 128, itemsize: int = 2,
                 q_len: int = 1, overlap: bool | None = None,
                 v_dim: int | None = None) -> Prediction:
    """Ring decoding (pass-KV): p blocks of `N/p` keys computed, p−1 K/V block transfers.

    `decode.ring_decode` is a `lax.scan` of p−1 steps with double buffering: each step sends
    the block it holds onwards (`ring_collectives`: two collective-permutes, K and V) and folds
    it into the running state while the transfer is in flight, then the last block is folded.
    Every transfer of a step waits for the slowest link in the ring (inter-node once the ring
    spans nodes). With overlap a step costs `max(compute, transfer)`, else their sum; the last
    block's compute is never hidden. Then one all-reduce of the output makes the replicated
    result the same on every device. `comm_s` is the part not hidden behind compute.

    Where `topo.copy_Bps` is set, each of the p−1 steps also reads and writes one K/V block
    at that rate (part of `compute_s`): XLA:CPU copies the loop-carried block before sending
    it, the permute's result taking the same loop slot (the compiled loop body shows the two
    copies).
    """
    kv_heads = _predict_args(seq_len, topo, batch, q_heads, kv_heads, head_dim, itemsize, q_len,
                             v_dim=v_dim)
    v_dim = head_dim if v_dim is None else v_dim
    validate.check_bool(overlap, "overlap", optional=True)
    overlap = topo.overlap if overlap is None else overlap
    p = topo.devices
    t = -(-seq_len // p)
    block = local_decode_time(batch, t, kv_heads, head_dim, v_dim, q_heads, topo, itemsize,
                              q_len)
    k_send, v_send, *broadcast = ring_collectives(
        batch=batch, kv_len=seq_len, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim, p=p,
        itemsize=itemsize, q_len=q_len, q_heads=q_heads)
    send = sum(collective_time(kind, nbytes, topo) for kind, nbytes, _ in (k_send, v_send))
    send = send if p > 1 else 0.0  # per step
    hidden = min(block, send) if overlap else 0.0
    copy = (0.0 if topo.copy_Bps is None else
            2 * batch * t * kv_heads * (head_dim + v_dim) * itemsize / topo.copy_Bps)
    comm = (p - 1) * (send - hidden) + collectives_time(broadcast, topo)
    return Prediction("ring", p, seq_len, p * block + (p - 1) * copy, comm, topo.overhead_s)


# --- merge patterns of serving systems -----------------------------------------
#
# Every pattern merges the same per-device states (out, lse) exactly; they differ only in
# the collectives that move them. Bytes are counted the way `introspect.collective_stats`
# counts them: for all-reduce, reduce-scatter, all-to-all and collective-permute the buffer
# one device contributes, for all-gather the buffer it receives (p times its contribution).

MERGES = tuple(merges.MERGES)
"""The merge patterns of `core.decode.tree_decode(merge=...)` (`core.merges.MERGES`):

* "allreduce": Allreduce(max) + Allreduce(sum), the paper's Algorithm 3;
* "allgather": one all-gather of the packed states, then a local merge;
* "reduce_scatter": all-gather of the lse pairs, reduce-scatter of the rescaled outputs over
  heads (vLLM and SGLang decode context parallelism);
* "all_to_all": one all-to-all of the packed states over heads, then a local merge
  (TensorRT-LLM Helix, arXiv 2507.07120);
* "one_pass": one Allreduce(sum) with a shared shift in place of the max (FlashDecoding++'s
  unified max), with the exact "allreduce" merge as a fallback.
"""

RINGS = ("ring", "ring_pass_q")
"""The two rings: pass-KV (`decode.ring_decode`) and pass-Q (`decode.ring_decode_pass_q`)."""


def _pattern(pattern: str) -> str:
    return validate.check_str_choice(pattern, MERGES, "pattern")


def padded_heads(q_heads: int, p: int) -> int:
    """Query heads after padding to a multiple of `p`: `ceil(Hq/p)·p` (`Hq_pad`). The
    head-scattered patterns ("reduce_scatter", "all_to_all") give each device `Hq_pad/p`."""
    _sizes(q_heads=q_heads, p=p)
    return -(-q_heads // p) * p


def merge_collectives(pattern: str, *, batch: int, q_len: int, q_heads: int, v_dim: int,
                      p: int, stat_itemsize: int = 4, levels: int = 1,
                      fallback: bool = False, out_itemsize: int = 2
                      ) -> list[tuple[str, int, int]]:
    """The collectives one merge pattern runs on each device: `[(kind, nbytes, count)]`.

    `nbytes` as `collective_stats` counts it (see above), `count` how many such ops run.
    With `n = B·Tq·Hq` rows, `s = stat_itemsize`, `n_pad = B·Tq·Hq_pad` (`padded_heads`):

    ==================  ===========================================================
    "allreduce"         all-reduce n·s (max) and all-reduce n·(Dv+1)·s (sum), per level
    "allgather"         all-gather p·n·(Dv+2)·s (out, lse, lse_lo packed)
    "reduce_scatter"    all-gather p·n_pad·2·s (lse pairs), reduce-scatter n_pad·Dv·s
    "all_to_all"        all-to-all n_pad·(Dv+2)·s
    "one_pass"          all-reduce n·(Dv+1)·s + s (numerator, denominator, a flag), per level
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
    """
    _pattern(pattern)
    _sizes(batch=batch, q_len=q_len, q_heads=q_heads, v_dim=v_dim, p=p,
           stat_itemsize=stat_itemsize, levels=levels, out_itemsize=out_itemsize)
    validate.check_bool(fallback, "fallback")
    s, n = stat_itemsize, batch * q_len * q_heads
    n_pad = batch * q_len * padded_heads(q_heads, p)
    if pattern == "allreduce":
        return [("all-reduce", n * s, levels), ("all-reduce", n * (v_dim + 1) * s, levels)]
    if pattern == "allgather":
        return [("all-gather", p * n * (v_dim + 2) * s, 1)]
    gather = ([("all-gather", n_pad * v_dim * out_itemsize, 1)] if n_pad != n else [])
    if pattern == "reduce_scatter":
        return [("all-gather", p * n_pad * 2 * s, 1), ("reduce-scatter", n_pad * v_dim * s, 1),
                *gather]
    if pattern == "all_to_all":
        return [("all-to-all", n_pad * (v_dim + 2) * s, 1), *gather]
    fast = [("all-reduce", n * (v_dim + 1) * s + s, levels)]
    if fallback:
        fast += merge_collectives("allreduce", batch=batch, q_len=q_len, q_heads=q_heads,
                                  v_dim=v_dim, p=p, stat_itemsize=stat_itemsize, levels=levels)
    return fast


def merge_read_bytes(pattern: str, *, batch: int, q_len: int, q_heads: int, v_dim: int,
                     p: int, stat_itemsize: int = 4) -> int:
    """Bytes of statistics the local half of a merge reads on each device.

    "allreduce" and "one_pass" divide the summed numerator by the denominator,
    n·(Dv+1)·s; "allgather" merges the p gathered states, p·n·(Dv+2)·s; "all_to_all" the p
    slices of `n_pad/p` rows it received, n_pad·(Dv+2)·s; "reduce_scatter" weighs its own
    output by the gathered lse pairs, n_pad·Dv·s + p·n_pad·2·s.
    """
    _pattern(pattern)
    _sizes(batch=batch, q_len=q_len, q_heads=q_heads, v_dim=v_dim, p=p,
           stat_itemsize=stat_itemsize)
    s, n = stat_itemsize, batch * q_len * q_heads
    n_pad = batch * q_len * padded_heads(q_heads, p)
    return {"allreduce": n * (v_dim + 1) * s, "one_pass": n * (v_dim + 1) * s,
            "allgather": p * n * (v_dim + 2) * s, "all_to_all": n_pad * (v_dim + 2) * s,
            "reduce_scatter": n_pad * v_dim * s + p * n_pad * 2 * s}[pattern]


def ring_collectives(*, batch: int, kv_len: int, kv_heads: int, head_dim: int, v_dim: int,
                     p: int, itemsize: int = 4, q_len: int = 1,
                     q_heads: int | None = None) -> list[tuple[str, int, int]]:
    """Pass-KV ring (`core.decode.ring_decode`): p−1 steps, each two collective-permutes, the
    K block `B·t·Hkv·D·itemsize` and the V block `B·t·Hkv·Dv·itemsize` (t = ceil(N/p)), whose
    sum is `ring_payload_bytes`; then one all-reduce of the output `B·Tq·Hq·Dv·itemsize`
    (`q_heads` defaults to `kv_heads`) that broadcasts shard 0's result, so that the
    replicated output is the same on every device (none when p = 1)."""
    q_heads = kv_heads if q_heads is None else q_heads
    _sizes(batch=batch, kv_len=kv_len, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim, p=p,
           itemsize=itemsize, q_len=q_len, q_heads=q_heads)
    t = -(-kv_len // p)
    block = batch * t * kv_heads * itemsize
    out = [("all-reduce", batch * q_len * q_heads * v_dim * itemsize, 1)] if p > 1 else []
    return [("collective-permute", block * head_dim, p - 1),
            ("collective-permute", block * v_dim, p - 1), *out]


def pass_q_heads(q_heads: int, kv_heads: int, p: int) -> int:
    """Query heads in one travelling block of the pass-Q ring: `Gs = ceil(Hkv/p)·Hq/Hkv`."""
    _sizes(q_heads=q_heads, kv_heads=kv_heads, p=p)
    inputs.check_head_groups(q_heads, kv_heads)
    return -(-kv_heads // p) * (q_heads // kv_heads)


def pass_q_collectives(*, batch: int, q_len: int, q_heads: int, kv_heads: int, head_dim: int,
                       v_dim: int, p: int, itemsize: int = 4,
                       stat_itemsize: int = 4) -> list[tuple[str, int, int]]:
    """Pass-Q ring (`decode.ring_decode_pass_q`, Meta's context-parallel inference, arXiv
    2411.01783): the query blocks of `Gs = pass_q_heads(...)` heads travel, K/V stay.

    As `decode` builds it: p−1 steps, each a collective-permute of the visiting query block
    `B·Tq·Gs·D·itemsize`, every device keeping the partial state it made for each block;
    then one all-to-all sends the p partial states `[p, B, Tq, Gs, Dv+2]` home (contributes
    `p·B·Tq·Gs·(Dv+2)·s`), and one all-gather shares the finished outputs (receives
    `p·B·Tq·Gs·Dv·s`).
    """
    _sizes(batch=batch, q_len=q_len, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
           v_dim=v_dim, p=p, itemsize=itemsize, stat_itemsize=stat_itemsize)
    rows = batch * q_len * pass_q_heads(q_heads, kv_heads, p)
    return [("collective-permute", rows * head_dim * itemsize, p - 1),
            ("all-to-all", p * rows * (v_dim + 2) * stat_itemsize, 1),
            ("all-gather", p * rows * v_dim * stat_itemsize, 1)]


def collective_bytes(collectives: list[tuple[str, int, int]]) -> int:
    """Total bytes per device of a list of `(kind, nbytes, count)`, as `collective_stats`'s
    `total_bytes` counts them."""
    collectives = _collective_list(collectives)
    return sum(nbytes * count for _, nbytes, count in collectives)


def _collective_list(collectives) -> list[tuple[str, Any, Any]]:
    """A non-empty sequence of `(kind, nbytes, count)`: kind one of `COLLECTIVE_KINDS`,
    `nbytes >= 0` bytes, `count >= 0` runs (sympy expressions allowed for both)."""
    eg = '[("all-gather", 8192, 1)]'
    items = validate.check_sequence(collectives, "collectives", "(kind, nbytes, count) triples",
                                    eg)
    out = []
    for i, entry in enumerate(items):
        name = f"collectives[{i}]"
        if not isinstance(entry, tuple | list) or len(entry) != 3:
            raise TypeError(f"`{name}` must be a (kind, nbytes, count) triple, e.g. {eg}, got "
                            f"{validate.describe(entry)}.")
        kind, nbytes, count = entry
        validate.check_str_choice(kind, COLLECTIVE_KINDS, f"{name}[0]")
        _nbytes(nbytes, f"{name}[1]")
        _int(count, f"{name}[2]", minimum=0, symbolic=True)
        out.append((kind, nbytes, count))
    return out


# --- latency of one collective --------------------------------------------------------------

def allgather_time(nbytes: float, p: int, link: Link) -> tuple[float, str]:
    """All-gather that leaves `nbytes` on every rank (each contributes m = nbytes/p): the
    cheaper of ring `(p−1)(α + m/β)` and recursive doubling `⌈log2 p⌉α + (p−1)m/β`
    (Thakur et al. 2005), the cheaper of the two as an MPICH-style selection picks (NCCL
    runs all-gather as a ring): `(seconds, "ring"|"recursive_doubling")`. Numbers only."""
    _allreduce_args(nbytes, p, link)
    _no_symbols("allgather_time compares two algorithms' times", nbytes=nbytes,
                **_link_fields(link))
    if p <= 1:
        return 0.0, "ring"
    m = nbytes / p
    ring = (p - 1) * (link.alpha_s + m / link.beta_Bps)
    doubling = math.ceil(math.log2(p)) * link.alpha_s + (p - 1) * m / link.beta_Bps
    return (doubling, "recursive_doubling") if doubling < ring else (ring, "ring")


def reduce_scatter_time(nbytes: float, p: int, link: Link) -> float:
    """Ring (pairwise) reduce-scatter of `nbytes` per rank: `(p−1)α + (p−1)/p·n/β` (Thakur
    et al. 2005)."""
    _allreduce_args(nbytes, p, link)
    if p <= 1:
        return 0.0
    return (p - 1) * link.alpha_s + (p - 1) / p * nbytes / link.beta_Bps


def all_to_all_time(nbytes: float, p: int, link: Link) -> float:
    """Pairwise-exchange all-to-all, `nbytes` per rank (n/p to each peer): `(p−1)(α +
    n/(p·β))` (Thakur et al. 2005)."""
    _allreduce_args(nbytes, p, link)
    if p <= 1:
        return 0.0
    return (p - 1) * (link.alpha_s + nbytes / (p * link.beta_Bps))


def collective_time(kind: str, nbytes: float, topo: Topology) -> float:
    """Seconds of one collective of `kind` over all of `topo`'s devices, `nbytes` counted as
    `collective_stats` counts them (received for all-gather, contributed otherwise).

    A kind in `topo.measured` costs `α + n/β` of its measured link. Otherwise, on one node
    the formulas above run over `intra`; across nodes (`nodes > 1`) in two stages, each
    carrying what it actually moves:

    * all-reduce: inside nodes, then across nodes with the reduced message
      (`hierarchical_allreduce_time`);
    * all-gather: inside nodes (each rank ends with `nbytes·dpn/p`), then across nodes,
      each rank contributing its node's block;
    * reduce-scatter: inside nodes (`nbytes` per rank, each ends with `nbytes/dpn`), then
      across nodes on that share;
    * all-to-all: no aggregation (one message per peer, the pairwise exchange of Thakur et
      al.; NCCL posts them all at once, so its α terms overlap): the `dpn−1` peers in the
      node cost `(dpn−1)(α_intra + n/(p·β_intra))` and the `p−dpn` outside it cross the slow
      links, `(p−dpn)(α_inter + n/(p·β_inter))`;
    * collective-permute (a ring's step): one send over the slowest link of the ring.
    """
    validate.check_choice(kind, COLLECTIVE_KINDS, "kind")
    _nbytes(nbytes)
    _no_symbols("collective_time compares algorithms' times", nbytes=nbytes)
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    measured = dict(topo.measured)
    if kind in measured:
        return measured[kind].send(nbytes)
    dpn, nodes, p = topo.devices_per_node, topo.nodes, topo.devices
    intra, inter = topo.intra, topo.shared_inter  # all of a node's devices cross at once
    if kind == "all-reduce":
        return hierarchical_allreduce_time(nbytes, topo)
    if kind == "all-gather":
        if topo.ring_only:  # (p−1)(α + m/β) per stage, m contributed per rank
            return ((dpn - 1) * intra.send(nbytes / p) if dpn > 1 else 0.0) + \
                ((nodes - 1) * inter.send(nbytes / nodes) if nodes > 1 else 0.0)
        return (allgather_time(nbytes * dpn / p, dpn, intra)[0]
                + allgather_time(nbytes, nodes, inter)[0])
    if kind == "reduce-scatter":
        return reduce_scatter_time(nbytes, dpn, intra) + reduce_scatter_time(nbytes / dpn,
                                                                              nodes, inter)
    if kind == "all-to-all":
        if p <= 1:
            return 0.0
        return ((dpn - 1) * (intra.alpha_s + nbytes / (p * intra.beta_Bps))
                + (p - dpn) * (inter.alpha_s + nbytes / (p * inter.beta_Bps)))
    if p <= 1:
        return 0.0
    return (topo.inter if nodes > 1 else intra).send(nbytes)  # one sender per node crosses


def collectives_time(collectives: list[tuple[str, int, int]], topo: Topology) -> float:
    """Seconds of a list of `(kind, nbytes, count)` run one after the other on `topo`
    (numbers only, as `collective_time`)."""
    collectives = _collective_list(collectives)
    for i, (_, nbytes, count) in enumerate(collectives):
        _no_symbols("collectives_time compares algorithms' times",
                    **{f"collectives[{i}][1]": nbytes, f"collectives[{i}][2]": count})
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    return sum(count * collective_time(kind, nbytes, topo) for kind, nbytes, count in collectives)


# --- predicted latency of each pattern ------------------------------------------------------

def predict_merge(pattern: str, seq_len: int, topo: Topology, *, batch: int = 1,
                  q_heads: int = 16, kv_heads: int | None = None, head_dim: int = 128,
                  v_dim: int | None = None, itemsize: int = 2, q_len: int = 1,
                  stat_itemsize: int = 4, fallback: bool = False) -> Prediction:
    """Tree decoding with merge `pattern` (one of `MERGES`) on all of `topo`'s devices.

    `compute_s`: the local kernel over the shard of `ceil(N/p)` keys (roofline,
    `local_decode_time`); `comm_s`: `merge_collectives`, one after the other
    (`collective_time`, hierarchical across nodes); `merge_s`: `merge_read_bytes` at
    `mem_Bps`; `overhead_s`: `topo.overhead_s`. For "one_pass" the fast path is predicted;
    `fallback=True` adds the exact merge that runs when the shared shift does not fit.
    """
    _pattern(pattern)
    kv_heads = _predict_args(seq_len, topo, batch, q_heads, kv_heads, head_dim, itemsize, q_len,
                             v_dim=v_dim, stat_itemsize=stat_itemsize)
    v_dim = head_dim if v_dim is None else v_dim
    p = topo.devices
    t = -(-seq_len // p)
    compute = local_decode_time(batch, t, kv_heads, head_dim, v_dim, q_heads, topo, itemsize,
                                q_len)
    shape: dict[str, Any] = dict(batch=batch, q_len=q_len, q_heads=q_heads, v_dim=v_dim, p=p,
                 stat_itemsize=stat_itemsize)
    # Across nodes, `collective_time` runs each all-reduce in its two stages.
    comm = collectives_time(merge_collectives(pattern, **shape, fallback=fallback,
                                              out_itemsize=itemsize), topo)
    merge = merge_read_bytes(pattern, **shape) / topo.mem_Bps
    return Prediction(pattern, p, seq_len, compute, comm, topo.overhead_s, merge)


def predict_pass_q_ring(seq_len: int, topo: Topology, *, batch: int = 1, q_heads: int = 16,
                        kv_heads: int | None = None, head_dim: int = 128,
                        v_dim: int | None = None, itemsize: int = 2, q_len: int = 1,
                        stat_itemsize: int = 4, overlap: bool | None = None) -> Prediction:
    """Pass-Q ring (`pass_q_collectives`): p steps, each the shard against one travelling
    query block of `Gs` heads, so a step reads the `ceil(Hkv/p)` kv heads of the shard
    (≈ 1/p of it); p−1 query-block permutes, each overlapping a step's compute when the
    topology overlaps; then the all-to-all of the partial states, their local merge
    (`p·B·Tq·Gs·(Dv+2)·s` bytes read) and the all-gather of the outputs.

    Cheaper than pass-KV when `Tq·Hq ≪ Tk·Hkv`: what travels is the queries, not the cache.
    """
    kv_heads = _predict_args(seq_len, topo, batch, q_heads, kv_heads, head_dim, itemsize, q_len,
                             v_dim=v_dim, stat_itemsize=stat_itemsize)
    v_dim = head_dim if v_dim is None else v_dim
    validate.check_bool(overlap, "overlap", optional=True)
    overlap = topo.overlap if overlap is None else overlap
    p = topo.devices
    t = math.ceil(seq_len / p)
    gs = pass_q_heads(q_heads, kv_heads, p)
    hs = gs // (q_heads // kv_heads)
    step = local_decode_time(batch, t, hs, head_dim, v_dim, gs, topo, itemsize, q_len)
    permute, *after = pass_q_collectives(batch=batch, q_len=q_len, q_heads=q_heads,
                                         kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim,
                                         p=p, itemsize=itemsize, stat_itemsize=stat_itemsize)
    send = collective_time(permute[0], permute[1], topo) if p > 1 else 0.0
    hidden = min(step, send) if overlap else 0.0
    comm = (p - 1) * (send - hidden) + collectives_time(after, topo)
    merge = p * batch * q_len * gs * (v_dim + 2) * stat_itemsize / topo.mem_Bps
    return Prediction("ring_pass_q", p, seq_len, p * step, comm, topo.overhead_s, merge)


def predict_all(seq_len: int, topo: Topology, *, batch: int = 1, q_heads: int = 16,
                kv_heads: int | None = None, head_dim: int = 128, v_dim: int | None = None,
                itemsize: int = 2, q_len: int = 1, stat_itemsize: int = 4
                ) -> dict[str, Prediction]:
    """Every merge pattern (`MERGES`) and both rings (`RINGS`) on the same problem."""
    shape: dict[str, Any] = dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 v_dim=v_dim, itemsize=itemsize, q_len=q_len)
    out = {m: predict_merge(m, seq_len, topo, **shape, stat_itemsize=stat_itemsize)
           for m in MERGES}
    out["ring"] = predict_ring(seq_len, topo, **shape)
    out["ring_pass_q"] = predict_pass_q_ring(seq_len, topo, **shape,
                                             stat_itemsize=stat_itemsize)
    return out


def best_merge(seq_len: int, topo: Topology, *, batch: int = 1, q_heads: int = 16,
               kv_heads: int | None = None, head_dim: int = 128, v_dim: int | None = None,
               itemsize: int = 2, q_len: int = 1, stat_itemsize: int = 4,
               patterns: tuple[str, ...] = MERGES) -> str:
    """The merge pattern `predict_merge` finds fastest (`total_s`) among `patterns`; a tie
    goes to "allreduce" (the paper's), then to the earlier pattern in `MERGES`.

    "one_pass" is priced by its fast path: it never loses to "allreduce" (one all-reduce
    fewer), so leave it out of `patterns` where the fallback would run often.
    """
    names = validate.check_sequence(patterns, "patterns", "merge pattern names",
                                   '("allreduce", "allgather")')
    for i, name in enumerate(names):
        validate.check_str_choice(name, MERGES, f"patterns[{i}]")
    shape: dict[str, Any] = dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 v_dim=v_dim, itemsize=itemsize, q_len=q_len, stat_itemsize=stat_itemsize)
    order = sorted(set(names), key=lambda m: (m != "allreduce", MERGES.index(m)))
    times = {m: predict_merge(m, seq_len, topo, **shape).total_s for m in order}
    best = order[0]
    for m in order[1:]:
        if times[m] < times[best] * (1 - 1e-12):
            best = m
    return best


def auto_merge(problem: merges.MergeProblem) -> str:
    """The policy behind `tree_decode(merge="auto")` (registered with
    `core.merges.set_auto_policy` when the package is imported): the pattern `best_merge`
    predicts fastest among `core.merges.AUTO_MERGES`, on DGX H100 links shaped like the
    mesh: the innermost sequence axis inside a node, the others across nodes.

    An empty problem (`batch`, `q_len` or `q_heads` 0) has nothing to merge; it gets
    "allreduce"."""
    validate.check_instance(problem, merges.MergeProblem, "problem",
                            "tree_decode(merge='auto') builds one; pass a "
                            "core.merges.MergeProblem")
    for name in ("batch", "q_len", "q_heads"):
        validate.check_int(getattr(problem, name), f"problem.{name}", minimum=0)
    for name in ("kv_heads", "head_dim", "v_dim", "kv_len"):
        _int(getattr(problem, name), f"problem.{name}")
    sizes = validate.check_sizes_list(problem.axis_sizes, "problem.axis_sizes", "(2, 4)")
    validate.check_float_dtype(problem.dtype, "problem.dtype")
    if 0 in (problem.batch, problem.q_len, problem.q_heads):
        return "allreduce"
    per_node = sizes[-1]
    topo = replace(DGX_H100, nodes=math.prod(sizes) // per_node, devices_per_node=per_node)
    itemsize = int(np.dtype(problem.dtype).itemsize)
    return best_merge(
        problem.kv_len, topo, batch=problem.batch, q_heads=problem.q_heads,
        kv_heads=problem.kv_heads, head_dim=problem.head_dim, v_dim=problem.v_dim,
        itemsize=itemsize, q_len=problem.q_len, stat_itemsize=8 if itemsize == 8 else 4,
        patterns=merges.AUTO_MERGES)


def crossover_map(topo: Topology | None = None, *, ps: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128),
                  batch_heads: tuple[int, ...] = (16, 64, 256, 1024, 4096, 16384, 65536),
                  seq_len: int = 1_048_576, q_heads: int = 16, kv_heads: int | None = None,
                  head_dim: int = 128, itemsize: int = 2, q_len: int = 1,
                  stat_itemsize: int = 4, patterns: tuple[str, ...] = MERGES) -> dict:
    """Which merge pattern wins as a function of the device count p and of batch × heads.

    For each `p` in `ps` (whole nodes of `topo` beyond one, `Topology.with_devices`) and each
    `B·Hq` in `batch_heads` (multiples of `q_heads`: the batch is `B·Hq / q_heads`), the
    predicted latency of every pattern. Defaults: `DGX_H100` (published figures, see its
    `sources`) and the paper's microbenchmark (16 heads × 128, bf16) at 1M keys.

    The sequence length changes only the local kernel, which every pattern shares, so it
    moves no boundary between merge patterns.

    Returns plain data: `{"ps": [...], "batch_heads": [...], "patterns": [...],
    "winner": [[name per p] per batch_heads], "seconds": {pattern: [[...]]},
    "speedup": [[allreduce / winner]], "topology": name}`.
    """
    topo = DGX_H100 if topo is None else topo
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100")
    ps_list = validate.check_sizes_list(ps, "ps", "(8, 16, 32)")
    bhs = validate.check_sizes_list(batch_heads, "batch_heads", "(16, 256, 4096)")
    _sizes(q_heads=q_heads)
    for i, bh in enumerate(bhs):
        validate.check_multiple_of(bh, f"batch_heads[{i}]", q_heads, "q_heads")
    names = validate.check_sequence(patterns, "patterns", "merge pattern names",
                                   '("allreduce", "allgather")')
    for i, name in enumerate(names):
        validate.check_str_choice(name, MERGES, f"patterns[{i}]")
    seconds = {m: [[0.0] * len(ps_list) for _ in bhs] for m in names}
    winner = [[""] * len(ps_list) for _ in bhs]
    speedup = [[1.0] * len(ps_list) for _ in bhs]
    shape: dict[str, Any] = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                 itemsize=itemsize, q_len=q_len, stat_itemsize=stat_itemsize)
    for j, p in enumerate(ps_list):
        t = topo.with_devices(p)
        for i, bh in enumerate(bhs):
            for m in names:
                seconds[m][i][j] = predict_merge(m, seq_len, t, batch=bh // q_heads,
                                                 **shape).total_s
            best = best_merge(seq_len, t, batch=bh // q_heads, patterns=tuple(names), **shape)
            winner[i][j] = best
            ref = seconds["allreduce"][i][j] if "allreduce" in seconds else seconds[best][i][j]
            speedup[i][j] = ref / seconds[best][i][j]
    return {"ps": ps_list, "batch_heads": bhs, "patterns": list(names), "winner": winner,
            "seconds": seconds, "speedup": speedup, "seq_len": seq_len,
            "topology": topo.name}


def peak_memory_tree(batch: int, t: int, n_h: int, d_h: int, itemsize: int = 1) -> int:
    """Bytes per device of tree decoding, part by part (`t` keys per device, `d = n_h·d_h`).

    The K and V shards, the query and the numerator it becomes, and the two per-head
    statistics that cross the wire (max and denominator). No output buffer: the result is
    the Allreduced numerator over the Allreduced denominator. At `itemsize=1` this is the
    paper's eq. 9 in elements (`tests/test_costmodel.py` checks it symbolically).
    """
    _sizes(batch=batch, t=t, n_h=n_h, d_h=d_h, itemsize=itemsize)
    d = n_h * d_h
    kv_shard, query, numerator, stats = 2 * batch * t * d, batch * d, batch * d, 2 * batch * n_h
    return (kv_shard + query + numerator + stats) * itemsize


def peak_memory_ring(batch: int, t: int, n_h: int, d_h: int, itemsize: int = 1) -> int:
    """Bytes per device of Ring Attention, part by part: its own K and V shards, the
    neighbour's K and V block arriving while it computes, the query and the output.
    At `itemsize=1` this is the paper's eq. 8 in elements."""
    _sizes(batch=batch, t=t, n_h=n_h, d_h=d_h, itemsize=itemsize)
    d = n_h * d_h
    kv_shard, kv_in_flight, query, output = 2 * batch * t * d, 2 * batch * t * d, batch * d, \
        batch * d
    return (kv_shard + kv_in_flight + query + output) * itemsize


# --- the paper's cluster ------------------------------------------------------------------

DGX_H100 = Topology(
    nodes=16,
    devices_per_node=8,
    intra=Link(alpha_s=6e-6, beta_Bps=450e9),
    inter=Link(alpha_s=46e-6, beta_Bps=50e9),
    mem_Bps=3.35e12,
    flops=989e12,
    overhead_s=0.0,
    overlap=True,
    name="DGX H100 (8 GPUs/node, NVLink 4, 400 Gb/s NDR per GPU)",
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM5 HBM3 3.35 TB/s; 1,979 TFLOP/s bf16 "
        "with sparsity, so 989 TFLOP/s dense.",
        "NVIDIA DGX H100 user guide: 8 GPUs per node on NVLink 4, 900 GB/s bidirectional per "
        "GPU (450 GB/s per direction); 8 ConnectX-7 ports, 400 Gb/s NDR InfiniBand each "
        "(50 GB/s per GPU).",
        "alpha inside a node: a small-message allreduce on 2 H100s with NVLS and CUDA graphs "
        "takes 5.5-6 us (github.com/NVIDIA/nccl/issues/1259); on 2 ranks the model's "
        "allreduce is one alpha, so alpha = 6 us.",
        "alpha across nodes: a small-message allreduce across 2 nodes takes about 46 us "
        "(github.com/NVIDIA/nccl/issues/1244), so alpha = 46 us.",
    ),
)
"""The paper's cluster (Section 6): DGX H100 nodes. Published figures only (`sources`);
nothing here was tuned to the paper's timings."""


PAPER_MICROBENCHMARK: dict[str, Any] = dict(batch=1, q_heads=16, head_dim=128, itemsize=2)
"""The paper's microbenchmark (Section 6.1, Fig. 3): one attention block of 16 heads of
dimension 128 in bf16 (Section 5.3: "All computations are performed in BF16"). The batch is
not stated; 1 here."""


def paper_microbenchmark(seq_len: int, p: int, topo: Topology = DGX_H100
                         ) -> dict[str, Prediction]:
    """Predicted latency of one decode step of the paper's microbenchmark on `p` devices of
    `topo` (whole nodes beyond one): `{"tree": Prediction, "ring": Prediction}`."""
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100")
    _int(p, "p")
    _concrete_sizes("a latency prediction compares times", seq_len=seq_len)
    if p > seq_len:
        raise ValueError(f"`p` = {p} devices for `seq_len` = {seq_len} keys leaves some "
                         f"devices without a key; use p <= seq_len.")
    topo = topo.with_devices(p)
    return {"tree": predict_tree(seq_len, topo, **PAPER_MICROBENCHMARK),
            "ring": predict_ring(seq_len, topo, **PAPER_MICROBENCHMARK)}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that the latency model needs.

    `layers` × [attention: `wq [dim, Hq·D]`, `wk, wv [dim, Hkv·D]`, `wo [Hq·D, dim]`; SwiGLU
    MLP: three `[dim, hidden]` matrices; two RMSNorm gains `[dim]`], a final RMSNorm, and an
    embedding `[vocab, dim]` plus an output projection of the same size unless tied (the
    layout of `tree_attention_edu.model`). `itemsize` is the bytes per weight.
    """

    layers: int
    dim: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    tie_embeddings: bool = False
    itemsize: int = 2
    name: str = ""
    sources: tuple[str, ...] = ()

    def __post_init__(self):
        _sizes(layers=self.layers, dim=self.dim, q_heads=self.q_heads, kv_heads=self.kv_heads,
               head_dim=self.head_dim, hidden=self.hidden, vocab=self.vocab,
               itemsize=self.itemsize)
        inputs.check_head_groups(self.q_heads, self.kv_heads)
        validate.check_bool(self.tie_embeddings, "tie_embeddings")

    @property
    def params(self) -> int:
        """Number of weights."""
        attn = self.dim * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        layer = attn + 3 * self.dim * self.hidden + 2 * self.dim
        embed = self.vocab * self.dim * (1 if self.tie_embeddings else 2)
        return self.layers * layer + self.dim + embed

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights, all read once per decoded token."""
        return self.params * self.itemsize


LLAMA_3_1_8B = ModelShape(
    layers=32, dim=4096, q_heads=32, kv_heads=8, head_dim=128, hidden=14336, vocab=128256,
    tie_embeddings=False, itemsize=2, name="Llama 3.1-8B (bf16)",
    sources=("Grattafiori et al., The Llama 3 Herd of Models (arXiv 2407.21783), Table 3: "
             "8B: 32 layers, model dim 4096, FFN dim 14336, 32 attention heads, 8 key/value "
             "heads, vocabulary 128,256.",),
)
"""The model of the paper's Section 6.4: 8,030,261,248 weights (`params`), 16.06 GB in bf16."""


def generation_time(seq_len: int, topo: Topology, *, model: ModelShape = LLAMA_3_1_8B,
                    tokens: int = 10) -> dict[str, float]:
    """Predicted seconds to decode `tokens` tokens after a context of `seq_len`, with the KV
    cache sharded over `topo`'s devices: `{"tree": seconds, "ring": seconds}`.

    Each token runs one attention decode step per layer over the whole context
    (`predict_tree` / `predict_ring`), and the rest of the model, whose weights every
    device reads once per token when only the sequence is sharded: `weight_bytes / mem_Bps`,
    the same for both methods. The prefill is not included.
    """
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(8)")
    validate.check_instance(model, ModelShape, "model", "e.g. LLAMA_3_1_8B")
    _int(tokens, "tokens")
    shape: dict[str, Any] = dict(q_heads=model.q_heads, kv_heads=model.kv_heads,
                                 head_dim=model.head_dim, itemsize=model.itemsize)
    weights_s = model.weight_bytes / topo.mem_Bps
    return {method: tokens * (model.layers * predict(seq_len, topo, **shape).total_s
                              + weights_s)
            for method, predict in (("tree", predict_tree), ("ring", predict_ring))}


PAPER_LLAMA: dict[str, dict[int, tuple[float, float]]] = {
    "8x H100": {32768: (0.60, 2.57), 65536: (1.08, 4.42), 131072: (2.68, 6.38),
                262144: (2.89, 8.19)},
    "4x MI300X": {32768: (1.05, 3.57), 65536: (2.36, 7.33), 131072: (6.43, 16.40),
                  262144: (15.30, 35.12)},
}
"""The paper's Table 1 (Section 6.4): Llama 3.1-8B, seconds for a prefill plus 10 decoded
tokens, `(tree, ring)`, mean of 10 runs, per hardware and context length. The paper writes
32k ... 256k; read here as 32·1024 ... 256·1024 tokens."""

PAPER_LLAMA_STDERR: dict[str, dict[int, tuple[float, float]]] = {
    "8x H100": {32768: (0.15, 0.35), 65536: (0.10, 0.38), 131072: (0.28, 0.58),
                262144: (0.62, 1.07)},
    "4x MI300X": {32768: (0.01, 0.25), 65536: (0.01, 0.25), 131072: (0.25, 0.40),
                  262144: (4.93, 5.02)},
}
"""The standard errors (±) of `PAPER_LLAMA`, `(tree, ring)`, from the same table."""

PAPER_LLAMA_SPEEDUP: dict[str, dict[int, int]] = {
    "8x H100": {32768: 4, 65536: 4, 131072: 2, 262144: 3},
    "4x MI300X": {32768: 3, 65536: 3, 131072: 3, 262144: 2},
}
"""The table's "Speedup" column (×): ring over tree, rounded to a whole number."""
