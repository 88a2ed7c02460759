"""The alpha-beta model of a topology, and the latency of one collective over it.

A message of n bytes over a link costs `alpha + n / beta` seconds (Hockney's model).
Collective costs follow Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 19(1), 2005:

    ring allreduce (reduce-scatter + allgather, Patarasuk & Yuan, JPDC 69(2), 2009):
        2(p-1)·alpha + 2(p-1)/p · n/beta
    tree allreduce (recursive doubling / binomial tree):
        ceil(log2 p)·(alpha + n/beta)

`allreduce_time` prices both and takes the cheaper per message size, as an MPICH-style
selection does. NCCL's algorithms differ (ring and double binary trees for all-reduce, rings
for all-gather and reduce-scatter, NVLS/CollNet where the hardware has them; its tuner picks
among those, NCCL docs `NCCL_ALGO`): the model is MPICH's, not NCCL's.
The other collectives of the merge patterns, from the same paper (m bytes contributed per
rank, p ranks):

    all-gather, ring:                 (p-1)·(alpha + m/beta)
    all-gather, recursive doubling:   ceil(log2 p)·alpha + (p-1)·m/beta
    reduce-scatter (ring / pairwise): (p-1)·alpha + (p-1)/p · m/beta
    all-to-all (pairwise exchange):   (p-1)·(alpha + m/(p·beta))
    collective-permute (one send):    alpha + m/beta

`Topology.ring_only` prices XLA:CPU's collectives over gloo instead (its docstring).
`collective_time` prices one collective over a whole `Topology`, hierarchically across
nodes, or as measured on it (`Topology.measured`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from ..core import validate
from .checks import (
    check_collectives,
    check_kind_links,
    check_nbytes,
    check_no_symbols,
    check_real,
    check_size,
    check_whole_nodes,
)
from .formulas import butterfly_rounds

CollectiveKind = Literal[
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
]
"""A collective as `introspect.collective_stats` names it."""
COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = get_args(CollectiveKind)
"""The collectives as `introspect.collective_stats` names them."""
Collective = tuple[CollectiveKind, int, int]
"""`(kind, nbytes, count)`: `count` runs of one collective of `kind`, `nbytes` counted as
`collective_stats` counts them (sizes may be sympy expressions)."""


@dataclass(frozen=True)
class Link:
    """One level of interconnect: per-message latency `alpha_s` and bandwidth `beta_Bps`
    (bytes per second, one direction).

    `points`: where the link was measured, `(bytes, seconds)` of one message at each size
    (`calibrate.measure_topology` keeps them for the simulated devices). With them, `send`
    reads a message's time off the measured curve, linear between the two sizes around it,
    instead of off the line `alpha + n/beta`: on the 2-core machine the time per byte of a
    2 MB message and of a 34 MB one differ by more than the model's band (the host's
    caches are the likely reason, not measured), and one β cannot
    price both. Below the smallest size `send` takes the smallest's time; above the largest,
    the largest's plus the rest at `beta_Bps`. So whatever prices one message through `send`
    reads the curve (a measured collective, a collective-permute, a butterfly round, a hop of
    `tree_allreduce_time`), while the formulas written in α and β (`ring_allreduce_time`,
    `reduce_scatter_time`, `all_to_all_time`, ...) read those two. The points are stored as
    floats.

    `call_s`: for a gloo ring only (`Topology.ring_only`), the part of one all-reduce's
    fixed cost that a ring pays whole however few of its segments hold bytes; with it, the
    ring's 2(g−1)·α is priced by the share of its segments that do (`gloo_ring_time`).
    None: every step at α, whatever the operand's size (the published links, and cluster
    records from before it was measured). A topology that is not `ring_only` never reads
    it."""

    alpha_s: float
    beta_Bps: float
    points: tuple[tuple[float, float], ...] = ()
    call_s: float | None = None

    def __post_init__(self):
        check_real(
            self.alpha_s, "alpha_s", low=0.0, symbolic=True, hint="seconds per message, e.g. 3e-6"
        )
        check_real(
            self.beta_Bps,
            "beta_Bps",
            low=0.0,
            low_open=True,
            finite=False,
            symbolic=True,
            hint="bytes per second, e.g. 50e9 (float('inf'): no bandwidth limit)",
        )

        if not (isinstance(self.points, tuple) and self.points == ()):
            object.__setattr__(self, "points", _check_curve(self.points))
        if self.call_s is not None:
            check_real(self.call_s, "call_s", low=0.0, hint="seconds per all-reduce, or None")

    def send(self, nbytes: float) -> float:
        """Seconds to send one message of `nbytes`: `alpha_s + nbytes / beta_Bps`, or read
        off `points` where the link has them (numbers only, then)."""
        check_nbytes(nbytes)
        if not self.points:
            return self.alpha_s + nbytes / self.beta_Bps
        check_no_symbols("a measured link's curve is read at a number", nbytes=nbytes)
        return _on_curve(self.points, nbytes, self.beta_Bps)  # points checked at __init__


def read_curve(points: tuple[tuple[float, float], ...], nbytes: float, rate_after: float) -> float:
    """Seconds at `nbytes` on a measured curve of `(bytes, seconds)` points (at least two,
    sizes increasing): linear between the two points around `nbytes`; below the smallest
    size, that size's time; above the largest, its time plus the bytes beyond it at
    `rate_after` (bytes per second, > 0). `Link.send` and `predict.fold_time` read theirs
    so. Numbers only."""
    points = _check_curve(points)
    check_nbytes(nbytes)
    check_no_symbols("a measured curve is read at a number", nbytes=nbytes)
    check_real(rate_after, "rate_after", low=0.0, low_open=True, finite=False, hint="bytes/s")
    return _on_curve(points, nbytes, rate_after)


def _on_curve(points: tuple[tuple[float, float], ...], nbytes: float, rate_after: float) -> float:
    """`read_curve` without its checks, for a curve checked when it was stored."""
    sizes = [n for n, _ in points]
    i = bisect.bisect_left(sizes, nbytes)
    if i == 0:
        return points[0][1]
    if i == len(sizes):
        n_last, t_last = points[-1]
        return t_last + (nbytes - n_last) / rate_after
    (n0, t0), (n1, t1) = points[i - 1], points[i]
    return t0 + (t1 - t0) * (nbytes - n0) / (n1 - n0)


def _check_curve(points: object, name: str = "points") -> tuple[tuple[float, float], ...]:
    """A measured curve (`Link.points`, `Topology.fold_points`): a tuple of at least two
    `(bytes, seconds)` pairs (tuples) of numbers, the sizes increasing and the times >= 0,
    else an error naming the entry. Returns it with every number a float."""
    eg = "((1024, 1.2e-4), (2**20, 9e-4))"
    if not isinstance(points, tuple) or len(points) < 2:
        raise TypeError(
            f"`{name}` must be a tuple of at least two (bytes, seconds) pairs, e.g. {eg}, "
            f"or () for none, got {validate.describe(points)}."
        )
    for i, pair in enumerate(points):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise TypeError(
                f"`{name}[{i}]` must be a (bytes, seconds) pair, e.g. {eg}, got "
                f"{validate.describe(pair)}."
            )
        check_real(pair[0], f"{name}[{i}][0]", low=0.0, hint="bytes")
        check_real(pair[1], f"{name}[{i}][1]", low=0.0, hint="seconds, a measured time")
        if i and not pair[0] > points[i - 1][0]:
            raise ValueError(
                f"`{name}` sizes must increase, got {points[i - 1][0]} then {pair[0]} at "
                f"entries {i - 1} and {i}; sort them and keep one time per size."
            )
    return tuple((float(n), float(t)) for n, t in points)


def _link_fields(link: Link, name: str = "link") -> dict[str, float]:
    """A Link's fields by their names in a message (`link.alpha_s`, ...)."""
    return {f"{name}.alpha_s": link.alpha_s, f"{name}.beta_Bps": link.beta_Bps}


@dataclass(frozen=True)
class Topology:
    """`nodes` × `devices_per_node` devices; `intra` links inside a node, `inter` between nodes.

    `mem_Bps` is one device's memory (read) bandwidth and `flops` its peak flop rate;
    `overhead_s` is a fixed cost per decode call (launch and dispatch), and `overlap` says
    whether a device can compute while its links transfer (a GPU with NCCL streams can;
    XLA:CPU's simulated devices run one op at a time).

    `measured` holds collectives timed on exactly these `devices` (`calibrate`): pairs
    `(kind, Link)` where one call of that kind over all devices costs the link's `send(n)`
    (`alpha_s + n/beta_Bps`, or read off its measured points) for `n` bytes counted as
    `collective_stats` counts them. A measured kind replaces the
    alpha-beta algorithm formulas (`collective_time`): the simulated devices implement each
    collective their own way, with a cost no link model of a GPU describes.

    `copy_Bps` is the rate of a device-local copy (bytes read + written) where the ring's
    loop copies its block before each send, as XLA compiles `decode.ring_decode` on the
    simulated CPU devices (`calibrate` measures it); None means no such copy, as in a GPU
    ring that receives into its second buffer (the published topologies).

    `ring_only`: the collectives are XLA:CPU's over gloo (`tree_attention_edu.cluster`), as
    read in their source and timed per call at several link delays
    (`cluster.collectives`, `results/cluster/latency-collectives.json`):

    * an all-reduce or all-gather over all the devices is one gloo ring over all of them,
      in lockstep, so every step waits for the ring's slowest hop (`ring_step_link`): an
      all-reduce `2(p−1)` steps, an all-gather `p−1`. A merge's all-reduces over one mesh
      level at a time are rings over that level (`hierarchical_allreduce_time`);
    * an all-reduce with several operands runs one ring per operand, one after the other
      (XLA:CPU's `AllReduceThunk`): `patterns.merge_collectives(operands_apart=True)`;
    * a ring skips the segments of its buffer that hold no bytes (an operand of fewer
      elements than 2g or a few more, such as `one_pass`'s one-element flag): where its
      links carry `Link.call_s`, its steps are priced by the share of segments that hold
      bytes (`gloo_ring_time`, float32 elements);
    * an all-to-all is XLA's own, every send posted at once: one message time;
    * a reduce-scatter is still priced in two stages as below (gloo runs halving-doubling
      over all ranks; no merge the cluster times depends on it alone).

    False prices the cheaper of ring and tree (recursive doubling) per message size, as an
    MPICH-style selection does (NCCL's own algorithms differ: see the module docstring).

    `uplinks`: inter-node links per node, shared by its devices; None means one per device
    (DGX H100: eight NICs for eight GPUs). When fewer, a stage in which every device of a
    node sends across at once (the inter-node half of an all-reduce, all-gather,
    reduce-scatter or all-to-all) gives each device `β·uplinks/devices_per_node`
    (`shared_inter`); a ring's collective-permute crosses with one device per node and runs
    at `β`.

    `flat_ring`: with `ring_only`, one step of a gloo ring over all the devices, measured
    on that ring (`cluster.levels` times all-reduces over every device at other sizes than
    a decode's): all-reduces, all-gathers and all-to-alls over all the devices are priced
    at it (`ring_step_link`). None prices such a step at `slowest_link`, the rule from the
    levels' own rings, whose fitted α carries each call's fixed cost spread over their
    2(g−1) steps, more thickly than a ring of 2(p−1) steps spreads it. Measured on exactly
    these devices: `with_devices` drops it for another count, as it drops `measured`;
    only with `ring_only` (else a `ValueError`).

    `kernel_fixed_s`: the fixed part of one local kernel call, paid whatever the shard's
    length (the kernel's loop set-up and, on simulated devices, the device threads taking
    their turns on the host's shared cores); a tree decode pays it once, a ring once per
    block. `calibrate` measures it as the intercept of the kernel's time at two shard
    lengths; 0 for the published topologies, whose sources give no such figure.

    `fold_points`: the time of one fold of a block into a running state inside a compiled
    loop, `(block K+V bytes per device, seconds)`, measured on every device at once
    (`calibrate` times `microbench.fold_loop_times` at other lengths than it predicts).
    The rings fold their blocks one after another in one program (`predict.fold_time`):
    the smaller the block, the further a fold in that loop costs under the same kernel
    called on its own (`results/calibrate/README.md` has the figures; the host's cache is
    the likely reason, not measured), and neither the kernel's fixed part nor one rate for
    all sizes prices it.
    Empty: a fold costs `local_decode_time` (the published topologies, whose sources give
    no such curve).

    `window_points`: the same for a step that reads one head window of a shard the loop
    has not just touched, `(window K+V bytes per device, seconds)`, as the pass-Q ring's
    steps do (`microbench.fold_loop_times(windows=True)`): a strided read from memory,
    timed with the step's query-block permute. Only beside `fold_points` (else a
    `ValueError`). `with_devices` drops both curves for another device count, as it drops
    `measured`.

    `operands_apart`: an all-reduce of several operands (a merge's numerator and
    denominator) costs one collective per operand, one after the other, as XLA:CPU's
    `AllReduceThunk` runs them on the simulated devices too; `calibrate.measure_topology`
    sets it. `ring_only` implies it. False: one collective per all-reduce op, as
    `collective_stats` counts them (the published topologies).
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
    kernel_fixed_s: float = 0.0
    flat_ring: Link | None = None
    fold_points: tuple[tuple[float, float], ...] = ()
    window_points: tuple[tuple[float, float], ...] = ()
    operands_apart: bool = False

    def __post_init__(self):
        check_size(self.nodes, "nodes")
        check_size(self.devices_per_node, "devices_per_node")
        validate.check_instance(self.intra, Link, "intra", "pass Link(alpha_s, beta_Bps)")
        validate.check_instance(self.inter, Link, "inter", "pass Link(alpha_s, beta_Bps)")
        if self.flat_ring is not None:
            validate.check_instance(
                self.flat_ring, Link, "flat_ring", "pass Link(alpha_s, beta_Bps) or None"
            )
            if not self.ring_only:
                raise ValueError(
                    "`flat_ring` is a step of a gloo ring over all devices, which only a "
                    "`ring_only=True` topology prices: pass ring_only=True, or flat_ring=None"
                )
        for name, link in (
            ("intra", self.intra),
            ("inter", self.inter),
            *((("flat_ring", self.flat_ring),) if self.flat_ring is not None else ()),
            *(
                (f"measured[{i}][1]", pair[1])
                for i, pair in enumerate(self.measured)
                if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], Link)
            ),
        ):
            check_no_symbols(
                "a Topology picks each collective's algorithm by comparing times",
                **_link_fields(link, name),
            )
        check_real(
            self.mem_Bps,
            "mem_Bps",
            low=0.0,
            low_open=True,
            finite=False,
            hint="memory read bytes per second, e.g. 3.35e12",
        )
        check_real(
            self.flops,
            "flops",
            low=0.0,
            low_open=True,
            finite=False,
            hint="peak flop/s, e.g. 989e12 (inf: never compute-bound)",
        )
        check_real(self.overhead_s, "overhead_s", low=0.0)
        check_real(self.kernel_fixed_s, "kernel_fixed_s", low=0.0, hint="seconds per call")
        for name in ("fold_points", "window_points"):
            curve = getattr(self, name)
            if not (isinstance(curve, tuple) and curve == ()):
                object.__setattr__(self, name, _check_curve(curve, name))
        if self.window_points and not self.fold_points:
            raise ValueError(
                "`window_points` without `fold_points`: the pass-Q ring's steps would be "
                "priced as kernel calls on their own while its permutes, which the window "
                "curve holds, were left out; pass both curves (calibrate.measure_topology "
                "measures both), or neither."
            )
        validate.check_bool(self.overlap, "overlap")
        validate.check_bool(self.ring_only, "ring_only")
        validate.check_bool(self.operands_apart, "operands_apart")
        if self.uplinks is not None:
            check_size(self.uplinks, "uplinks")
        check_kind_links(self.measured, "measured", COLLECTIVE_KINDS, Link)
        if self.copy_Bps is not None:
            check_real(
                self.copy_Bps,
                "copy_Bps",
                low=0.0,
                low_open=True,
                finite=False,
                hint="bytes read + written per second by a local copy",
            )

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def shared_inter(self) -> Link:
        """The inter-node link as each device sees it when all of a node's devices send
        across at once (`uplinks`)."""
        if self.uplinks is None or self.uplinks >= self.devices_per_node:
            return self.inter
        shared = self.inter.beta_Bps * self.uplinks / self.devices_per_node
        return Link(self.inter.alpha_s, shared, call_s=self.inter.call_s)

    @property
    def ridge_point(self) -> float:
        """Flop per byte at which a device turns from memory-bound to compute-bound:
        `flops / mem_Bps` (the roofline's ridge point)."""
        return self.flops / self.mem_Bps

    def with_devices(self, p: int) -> Topology:
        """The same hardware with `p` devices: whole nodes once `p` exceeds a node. What was
        measured on this device count goes (`measured`, `flat_ring`, the fold curves), and a
        link's `call_s`, measured on a ring of its level's size, goes where that ring's
        size changes (`intra` once a node holds another count, `inter` once the nodes do)."""
        check_size(p, "p")
        check_whole_nodes(p, self.devices_per_node)
        # Collectives measured on this many devices say nothing about another count, nor do
        # folds timed with this many devices sharing the host (the window curve holds a
        # permute over all of them).
        same = p == self.devices
        nodes, per_node = (
            (1, p)
            if p <= self.devices_per_node
            else (p // self.devices_per_node, self.devices_per_node)
        )
        intra = self.intra if per_node == self.devices_per_node else _no_call(self.intra)
        inter = self.inter if nodes == self.nodes else _no_call(self.inter)
        kept = replace(
            self,
            intra=intra,
            inter=inter,
            measured=self.measured if same else (),
            flat_ring=self.flat_ring if same else None,
            fold_points=self.fold_points if same else (),
            window_points=self.window_points if same else (),
        )
        return replace(kept, nodes=nodes, devices_per_node=per_node)


def _no_call(link: Link) -> Link:
    return link if link.call_s is None else replace(link, call_s=None)


def _allreduce_args(nbytes: float, p: int, link: Link) -> None:
    check_nbytes(nbytes)
    check_size(p, "p")
    validate.check_instance(link, Link, "link", "pass Link(alpha_s, beta_Bps)")


def ring_allreduce_time(nbytes: float, p: int, link: Link) -> float:
    """Ring allreduce of `nbytes` over `p` ranks: 2(p−1)α + 2(p−1)/p·n/β (Thakur et al. 2005)."""
    _allreduce_args(nbytes, p, link)
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes / link.beta_Bps


GLOO_ITEMSIZE = 4
"""Bytes per element of the operands the cluster's merges all-reduce (float32): gloo cuts
a buffer into segments of whole elements."""


def gloo_segments(nbytes: float, p: int, itemsize: int = GLOO_ITEMSIZE) -> tuple[int, int]:
    """`(holding bytes, all)`: the segments of gloo's ring all-reduce of `nbytes` over `p`
    ranks, by the rule of `gloo/allreduce.cc` (`ring()`) for buffers up to `2p` times its
    maximum segment size (1 MiB): `2p` segments of `ceil(ceil(n/2p)/itemsize)` elements
    each, so that an operand of fewer elements than `2p`, or a few more, leaves some empty
    (9 elements over 8 segments: segments of 2, five holding bytes). Above that size gloo
    cuts more segments, every one holding bytes; this returns `(2p, 2p)` there, the same
    share. The ring sends or receives a segment only if it holds bytes."""
    check_nbytes(nbytes)
    check_no_symbols("gloo_segments counts segments", nbytes=nbytes)
    check_size(p, "p")
    check_size(itemsize, "itemsize")
    return _segments(nbytes, p, itemsize)


def _segments(nbytes: float, p: int, itemsize: int) -> tuple[int, int]:
    total = 2 * p
    elements = math.ceil(nbytes / itemsize)
    if elements == 0:
        return 0, total
    per = -(-elements // total)  # integer ceilings: exact at any size
    return -(-elements // per), total


def gloo_ring_time(nbytes: float, p: int, link: Link) -> float:
    """gloo's ring all-reduce of `nbytes` over `p` ranks (`Topology.ring_only`): with
    `link.call_s` = c, `c + (2(p−1)α − c)·h/2p + 2(p−1)/p·n/β`, h of its 2p segments
    holding bytes (`gloo_segments`, elements of `GLOO_ITEMSIZE` bytes: float32 operands),
    c capped at 2(p−1)α; an operand that fills every segment costs `ring_allreduce_time`,
    and an empty one nothing (gloo returns before its ring). On the cluster's machine,
    lone all-reduces of one or two elements cost a fraction of a full ring
    (`results/cluster/README.md`), which suggests that a step's α there is mostly work
    per message rather than the wire's latency (in gloo's pipelined ring one element
    still makes every hop), and that a ring skipping empty segments saves it. Without
    `call_s`: `ring_allreduce_time`."""
    _allreduce_args(nbytes, p, link)
    if link.call_s is None or p <= 1:
        return ring_allreduce_time(nbytes, p, link)
    check_no_symbols(
        "gloo_ring_time counts segments and caps call_s at the ring's steps",
        nbytes=nbytes,
        **_link_fields(link),
    )
    held, total = _segments(nbytes, p, GLOO_ITEMSIZE)  # arguments checked above
    if held == 0:
        return 0.0
    steps = 2 * (p - 1) * link.alpha_s
    call = min(link.call_s, steps)
    return call + (steps - call) * held / total + 2 * (p - 1) / p * nbytes / link.beta_Bps


def tree_allreduce_time(nbytes: float, p: int, link: Link) -> float:
    """Recursive-doubling allreduce: ⌈log2 p⌉(α + n/β) (Thakur et al. 2005)."""
    _allreduce_args(nbytes, p, link)
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * link.send(nbytes)


def allreduce_time(
    nbytes: float, p: int, link: Link
) -> tuple[float, Literal["ring", "recursive_doubling"]]:
    """The cheaper of ring and recursive-doubling allreduce (an MPICH-style selection):
    `(seconds, "ring"|"recursive_doubling")`. Numbers only: the choice compares the two
    times."""
    _allreduce_args(nbytes, p, link)
    check_no_symbols(
        "allreduce_time compares two algorithms' times", nbytes=nbytes, **_link_fields(link)
    )
    ring, tree = ring_allreduce_time(nbytes, p, link), tree_allreduce_time(nbytes, p, link)
    return (tree, "recursive_doubling") if tree <= ring else (ring, "ring")


def slowest_link(topo: Topology) -> Link:
    """The link a ring over all of `topo`'s devices (in node order) waits on at each step:
    `intra` on one node, `inter` between one-device nodes; otherwise the larger α and the
    smaller β of `intra` and `inter`, with `inter` not shared (one device per node sends
    across in each step). Where one link has the larger α and the other the smaller β,
    this prices a step at or above the slower of the two (within `min(α)` of it)."""
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    if topo.nodes == 1:
        return topo.intra
    if topo.devices_per_node == 1:
        return topo.inter
    intra, inter = topo.intra, topo.inter
    return Link(max(intra.alpha_s, inter.alpha_s), min(intra.beta_Bps, inter.beta_Bps))  # no call_s


def ring_step_link(topo: Topology) -> Link:
    """The link one step of a ring over all of `topo`'s devices is priced at: the step
    measured on that ring (`Topology.flat_ring`), else `slowest_link`'s rule."""
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    return slowest_link(topo) if topo.flat_ring is None else topo.flat_ring


def butterfly_time(nbytes: float, topo: Topology) -> float:
    """The butterfly merge's `butterfly_rounds(p)` exchange rounds of `nbytes` each over all
    of `topo`'s p devices. With p and the devices per node powers of two, the partners
    `i XOR 2^r` of the first `log2(devices_per_node)` rounds share a node (`intra`, as
    `core.merges` orders the rounds: innermost axis first) and the other `log2(nodes)`
    rounds cross, every device of a node at once (`shared_inter`). Otherwise every round
    is priced as crossing, an upper bound."""
    check_nbytes(nbytes)
    check_no_symbols("butterfly_time compares link times", nbytes=nbytes)
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    dpn, p = topo.devices_per_node, topo.devices
    rounds = butterfly_rounds(p)
    if topo.nodes == 1:
        return rounds * topo.intra.send(nbytes)
    power_of_two = p & (p - 1) == 0 and dpn & (dpn - 1) == 0
    inside = dpn.bit_length() - 1 if power_of_two else 0
    return inside * topo.intra.send(nbytes) + (rounds - inside) * topo.shared_inter.send(nbytes)


def hierarchical_allreduce_time(nbytes: float, topo: Topology) -> float:
    """Allreduce inside every node (over `intra`), then across nodes (over `inter`).

    The second stage carries the already-reduced message: one per node position.
    """
    check_nbytes(nbytes)
    check_no_symbols("hierarchical_allreduce_time compares algorithms' times", nbytes=nbytes)
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    inter = topo.shared_inter  # every device of a node takes part in the second stage
    if topo.ring_only:
        return gloo_ring_time(nbytes, topo.devices_per_node, topo.intra) + gloo_ring_time(
            nbytes, topo.nodes, inter
        )
    return (
        allreduce_time(nbytes, topo.devices_per_node, topo.intra)[0]
        + allreduce_time(nbytes, topo.nodes, inter)[0]
    )


# --- latency of one collective --------------------------------------------------------------


def allgather_time(nbytes: float, p: int, link: Link) -> tuple[float, str]:
    """All-gather that leaves `nbytes` on every rank (each contributes m = nbytes/p): the
    cheaper of ring `(p−1)(α + m/β)` and recursive doubling `⌈log2 p⌉α + (p−1)m/β`
    (Thakur et al. 2005), the cheaper of the two as an MPICH-style selection picks (NCCL
    runs all-gather as a ring): `(seconds, "ring"|"recursive_doubling")`. Numbers only."""
    _allreduce_args(nbytes, p, link)
    check_no_symbols(
        "allgather_time compares two algorithms' times", nbytes=nbytes, **_link_fields(link)
    )
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


def collective_time(kind: CollectiveKind, nbytes: float, topo: Topology) -> float:
    """Seconds of one collective of `kind` over all of `topo`'s devices, `nbytes` counted as
    `collective_stats` counts them (received for all-gather, contributed otherwise).

    A kind in `topo.measured` costs its measured link's `send(n)` (α + n/β, or read off its
    points). Otherwise, on one node
    the module docstring's formulas run over `intra`; across nodes (`nodes > 1`) in two
    stages, each carrying what it actually moves:

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

    With `topo.ring_only` (XLA:CPU over gloo, `Topology`), an all-reduce, all-gather or
    all-to-all over all the devices is instead one flat algorithm over `ring_step_link`: a ring
    of `2(p−1)` or `p−1` steps, or one round with every send posted at once.
    """
    validate.check_choice(kind, COLLECTIVE_KINDS, "kind")
    check_nbytes(nbytes)
    check_no_symbols("collective_time compares algorithms' times", nbytes=nbytes)
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    measured = dict(topo.measured)
    if kind in measured:
        return measured[kind].send(nbytes)
    dpn, nodes, p = topo.devices_per_node, topo.nodes, topo.devices
    intra, inter = topo.intra, topo.shared_inter  # all of a node's devices cross at once
    if topo.ring_only and kind in ("all-reduce", "all-gather", "all-to-all"):
        return _gloo_time(kind, nbytes, topo)
    if kind == "all-reduce":
        return hierarchical_allreduce_time(nbytes, topo)
    if kind == "all-gather":
        return (
            allgather_time(nbytes * dpn / p, dpn, intra)[0]
            + allgather_time(nbytes, nodes, inter)[0]
        )
    if kind == "reduce-scatter":
        return reduce_scatter_time(nbytes, dpn, intra) + reduce_scatter_time(
            nbytes / dpn, nodes, inter
        )
    if kind == "all-to-all":
        if p <= 1:
            return 0.0
        return (dpn - 1) * (intra.alpha_s + nbytes / (p * intra.beta_Bps)) + (p - dpn) * (
            inter.alpha_s + nbytes / (p * inter.beta_Bps)
        )
    if p <= 1:
        return 0.0
    return (topo.inter if nodes > 1 else intra).send(nbytes)  # one sender per node crosses


def _gloo_time(kind: CollectiveKind, nbytes: float, topo: Topology) -> float:
    """XLA:CPU's all-reduce, all-gather or all-to-all over all of `topo`'s p ranks in one
    flat algorithm (`collective_time`): the rings wait for their slowest hop at every step
    (`ring_step_link`: as measured on that ring, else `slowest_link`); the all-to-all is one
    round at that step's α, each rank's (dpn−1)/p·n bytes inside its
    node and (p−dpn)/p·n across going at once, the latter on the node's shared uplinks."""
    p, dpn = topo.devices, topo.devices_per_node
    if p <= 1:
        return 0.0
    link = ring_step_link(topo)
    if kind == "all-reduce":
        return gloo_ring_time(nbytes, p, link)
    if kind == "all-gather":  # nbytes received; each rank contributes nbytes/p
        return (p - 1) * link.send(nbytes / p)
    inside = (dpn - 1) / p * nbytes / topo.intra.beta_Bps
    across = (p - dpn) / p * nbytes / topo.shared_inter.beta_Bps
    return link.alpha_s + max(inside, across)


def collectives_time(collectives: Sequence[Collective], topo: Topology) -> float:
    """Seconds of a list of `(kind, nbytes, count)` run one after the other on `topo`
    (numbers only, as `collective_time`)."""
    collectives = check_collectives(collectives, COLLECTIVE_KINDS)
    for i, (_, nbytes, count) in enumerate(collectives):
        check_no_symbols(
            "collectives_time compares algorithms' times",
            **{f"collectives[{i}][1]": nbytes, f"collectives[{i}][2]": count},
        )
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(16)")
    return sum(count * collective_time(kind, nbytes, topo) for kind, nbytes, count in collectives)
