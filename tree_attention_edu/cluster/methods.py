"""Every decode method on one cache across a cluster on one machine: compiled once, its bytes
on each level read from the compiled program, its answer checked against a float64 numpy
reference, and its latency predicted by the cost model from what `levels` measured.

The plain helpers (`reference_attention`, `level_bytes`, `crossover`, `crossover_words`) use
no JAX.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.names import MERGE_NAMES

if TYPE_CHECKING:
    from jax import Array
    from jax.sharding import Mesh
    from jax.stages import Compiled

    from ..perf.calibrate import PredictMethod
    from ..perf.costmodel import Topology
    from ..perf.introspect import Collective
    from .context import Context
    from .levels import Calls, Times

PACKAGE_METHOD: dict[str, PredictMethod] = {
    "tree": "tree",
    "tree_2level": "tree",
    **{m: m for m in MERGE_NAMES if m != "allreduce"},
    "ring": "ring",
    "ring_pass_q": "ring_pass_q",
}
"""What a cluster run measures, and the package's method each runs: `tree` on the flat
mesh; on the 2-level mesh `tree_2level` (the paper's Allreduce merge), every other merge
pattern (`core.names.MERGE_NAMES`) and both rings."""
CLUSTER_METHODS = tuple(PACKAGE_METHOD)
CROSSOVER_METHODS = ("tree", "tree_2level", "ring")
POISON = (
    "gloo under XLA:CPU: after one reduce-scatter over a set of devices, transfers "
    "between two devices of the same process in later collectives over that set run at "
    "~2 MB/s (a 4-device pass-KV ring at Tk=4096 went from 0.14 s to 8.5 s)"
)
"""Why a reduce-scatter is measured last."""

Topologies = tuple["Topology", "Topology"]
"""The cost model's view of the cluster: `(two_level, flat)`."""


# ---------------------------------------------------------------------------------------
# Plain helpers (no JAX): the reference, bytes per level, the crossover


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Softmax attention in float64 numpy, independent of the package's JAX code.

    q `[B, Tq, Hq, D]`, k `[B, Tk, Hkv, D]`, v `[B, Tk, Hkv, Dv]` (Hkv divides Hq, grouped
    query heads share a kv head); scale `1/sqrt(D)`, no mask. Returns `[B, Tq, Hq, Dv]`.
    """
    B, Tq, Hq, D = q.shape
    hkv = k.shape[2]
    qg = q.astype(np.float64).reshape(B, Tq, hkv, Hq // hkv, D)
    s = np.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(np.float64)) / math.sqrt(D)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    out = np.einsum("bhgqk,bkhd->bqhgd", w, v.astype(np.float64))
    return out.reshape(B, Tq, Hq, -1)


def level_bytes(
    collectives: Iterable[Collective], node_of: Callable[[int], int], p: int
) -> dict[str, float]:
    """Bytes each device sends inside its node and to other nodes, per call of the program.

    `collectives`: `introspect.Collective`s of the compiled program (replica groups or
    source→target pairs of partition ids 0..p−1); `node_of(i)`: the node of device i. Each
    collective is counted as gloo runs it under XLA:CPU, `n` its payload as
    `collective_stats` counts it:

    * all-reduce: a ring over the group: each member sends `2(g−1)/g·n` to the next;
    * all-gather (`n` received): a ring: each member sends `(g−1)/g·n` to the next;
    * reduce-scatter and all-to-all: each member sends `n/g` to every other member;
    * collective-permute: each source sends `n` to its target.

    Returns `{"bytes_inter", "bytes_intra"}` averaged over the p devices, and `"link_bytes"`:
    the bytes that leave the busiest node per call (what its uplink carries).
    """
    inter, intra = np.zeros(p), np.zeros(p)

    def send(a: int, b: int, nbytes: float) -> None:
        (inter if node_of(a) != node_of(b) else intra)[a] += nbytes

    for c in collectives:
        n = c.bytes * c.count
        if c.kind == "collective-permute":
            for a, b in c.groups:
                if a != b:
                    send(a, b, n)
            continue
        for group in c.groups or (tuple(range(p)),):
            g = len(group)
            if g < 2:
                continue
            for j, a in enumerate(group):
                if c.kind == "all-reduce":
                    send(a, group[(j + 1) % g], 2 * (g - 1) / g * n)
                elif c.kind == "all-gather":
                    send(a, group[(j + 1) % g], (g - 1) / g * n)
                else:  # reduce-scatter, all-to-all
                    for b in group:
                        if b != a:
                            send(a, b, n / g)
    nodes = sorted({node_of(i) for i in range(p)})
    link = max(sum(inter[i] for i in range(p) if node_of(i) == nd) for nd in nodes)
    return {
        "bytes_inter": float(inter.mean()),
        "bytes_intra": float(intra.mean()),
        "link_bytes": float(link),
    }


def crossover(seq_lens: list[int], tree_s: list[float], ring_s: list[float]) -> float | None:
    """The sequence length where tree becomes faster than ring: the first sign change of
    `ring − tree` from ≤ 0 to > 0, interpolated on log-log axes; None if there is none
    (tree faster everywhere, or ring faster everywhere)."""
    d = [r - t for t, r in zip(tree_s, ring_s, strict=True)]
    for i in range(1, len(d)):
        if d[i - 1] <= 0 < d[i]:
            x0, x1 = seq_lens[i - 1], seq_lens[i]
            # log(ring/tree) is linear in log(L) between the points: find its zero.
            f0 = math.log(ring_s[i - 1] / tree_s[i - 1])
            f1 = math.log(ring_s[i] / tree_s[i])
            w = f0 / (f0 - f1) if f0 != f1 else 0.0
            return float(math.exp(math.log(x0) + w * (math.log(x1) - math.log(x0))))
    return None


def crossover_words(seq_lens: list[int], tree_s: list[float], ring_s: list[float]) -> str:
    """What a tree-against-ring series shows, in words: "tree overtakes ring at Tk ~ L"
    where ring is faster up to one point and tree from the next on (`crossover`), "tree
    faster at every length" or "ring faster at every length" where there is no sign change,
    and otherwise the lengths where ring was faster ("no single crossover"): a series that
    changes sign more than once locates no crossover."""
    ring_wins = [r <= t for t, r in zip(tree_s, ring_s, strict=True)]
    if not any(ring_wins):
        return "tree faster at every length"
    if all(ring_wins):
        return "ring faster at every length"
    changes = sum(a != b for a, b in itertools.pairwise(ring_wins))
    x = crossover(seq_lens, tree_s, ring_s)
    if changes == 1 and x is not None:
        return f"tree overtakes ring at Tk ~ {x:,.0f}"
    at = ", ".join(f"{n:,}" for n, w in zip(seq_lens, ring_wins, strict=True) if w)
    return f"no single crossover: ring faster only at Tk = {at}"


def count_kinds(collectives: Iterable[Collective]) -> dict[str, int]:
    """How many times each kind of collective runs per call."""
    counts: dict[str, int] = {}
    for c in collectives:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
    return dict(sorted(counts.items()))


def allgather(x: np.ndarray) -> np.ndarray:
    """`x` from every process, stacked `[processes, ...]` (a collective: all must call it)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def rounds_by_process(times: Times) -> dict[str, list[list[float]]]:
    """Every process's round times of every call, `name -> [process][round]` (a
    collective: every process calls it, with the same calls and rounds)."""
    names = sorted(times)
    everyone = allgather(np.array([times[n] for n in names], dtype=np.float64))
    return {n: everyone[:, i, :].tolist() for i, n in enumerate(names)}


# ---------------------------------------------------------------------------------------
# The cost model's view


def topologies(ctx: Context, links: dict[str, Any], local: dict[str, Any]) -> Topologies:
    """The cost model's view of this cluster from `levels.fit_links` and `fit_local`:
    `(two_level, flat)` topologies."""
    from ..perf import costmodel

    s = ctx.s

    def link(fit: dict[str, Any]) -> costmodel.Link:
        # call_s: absent from records before it was measured, which price every step at α
        return costmodel.Link(fit["alpha_s"], fit["beta_Bps"], call_s=fit.get("call_s"))

    inter, intra = link(links["inter"]), link(links["intra"])
    # A step of the ring over all devices, measured on it (absent from records before it was)
    ring = links.get("flat")
    flat_ring = None if ring is None else link(ring)
    # All-gathers and all-to-alls over all devices, each measured on its own (ditto)
    measured = tuple((kind, link(fit)) for kind, fit in links.get("kinds", {}).items())
    two = costmodel.Topology(
        nodes=s.nodes,
        devices_per_node=s.processes_per_node * s.devices_per_process,
        intra=intra,
        inter=inter,
        mem_Bps=local["mem_Bps"],
        flops=float("inf"),
        overhead_s=links["overhead_s"] + local["sync_s"],
        overlap=False,
        copy_Bps=local["copy_Bps"],
        ring_only=True,
        uplinks=1,
        flat_ring=flat_ring,
        measured=measured,
        name="cluster of network namespaces (this machine)",
        sources=("measured by tree_attention_edu.cluster.levels",),
    )
    # The flat mesh's Allreduce is one gloo ring over all p devices (in node order): each
    # step waits for its slowest hop, inside a node or across (one flow per uplink), as
    # measured on that ring (`levels.fit_links`).
    flat = dataclasses.replace(
        two,
        nodes=1,
        devices_per_node=s.devices,
        intra=costmodel.ring_step_link(two),
        uplinks=None,
        flat_ring=None,
    )
    return two, flat


def predict(ctx: Context, name: str, seq_len: int, topo: Topologies) -> float:
    """The cost model's latency of method `name` at `seq_len`: "tree" on the flat topology,
    every other method on the 2-level one ("tree_2level" is the package's "tree")."""
    from ..perf import calibrate

    two, flat = topo
    prob = ctx.s.problem(seq_len)
    return calibrate.predict(
        PACKAGE_METHOD[name], seq_len, flat if name == "tree" else two, prob
    ).total_s


# ---------------------------------------------------------------------------------------
# The methods, compiled, checked and timed


def method_fns(ctx: Context, names: list[str]) -> dict[str, tuple[Mesh, Callable[..., Array]]]:
    """`name -> (mesh, fn(q, k, v))` from the package's one registry of methods
    (`perf.benchmark.method_fns`, by `PACKAGE_METHOD`): "tree" on the flat mesh, every
    other method on the `("node", "gpu")` mesh, whose sequence axes reduce over "gpu"
    first."""
    from ..perf import benchmark

    fns: dict[str, tuple[Mesh, Callable[..., Array]]] = {}
    for name in names:
        mesh = ctx.flat if name == "tree" else ctx.two
        method = PACKAGE_METHOD[name]
        fns[name] = (mesh, benchmark.method_fns(mesh, None, [method])[method][0])
    return fns


def method_calls(
    ctx: Context, names: list[str], seq_len: int
) -> tuple[Calls, dict[str, dict[str, Any]]]:
    """Every method in `names` on the same cache at `seq_len`, compiled once: the calls
    to time (`name -> (compiled, args)`) and what the program and its answer say: bytes
    per level (`level_bytes` on the compiled program's collectives), the collectives,
    and the max |error| on this process's devices against the float64 reference."""
    import jax

    from ..perf import benchmark

    q, k, v = benchmark.make_inputs(ctx.s.problem(seq_len), ctx.s.seed)
    want = reference_attention(q, k, v)
    placed = {id(mesh): _place(mesh, q, k, v) for mesh in (ctx.two, ctx.flat)}
    calls: Calls = {}
    static: dict[str, dict[str, Any]] = {}
    for name, (mesh, fn) in method_fns(ctx, names).items():
        args = placed[id(mesh)]
        compiled = jax.jit(fn).lower(*args).compile()
        static[name] = _what_it_does(ctx, name, compiled, compiled(*args), want)
        calls[name] = (compiled, args)
    return calls, static


def _place(mesh: Mesh, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[Array, ...]:
    """q replicated, K and V sharded along the sequence over all of `mesh`'s axes."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    kv = NamedSharding(mesh, P(None, tuple(mesh.axis_names)))
    return (
        jax.device_put(q, NamedSharding(mesh, P())),
        jax.device_put(k, kv),
        jax.device_put(v, kv),
    )


def _what_it_does(
    ctx: Context, name: str, compiled: Compiled, out: Array, want: np.ndarray
) -> dict[str, Any]:
    """A compiled method's bytes per level and collectives, and its answer's error here."""
    from ..perf.introspect import parse_hlo

    stats = parse_hlo(compiled.as_text() or "")
    if name == "one_pass":
        stats = stats.fast_path()  # its exact fallback runs only past its window
    err = max(
        float(np.abs(np.asarray(sh.data, np.float64) - want[sh.index]).max())
        for sh in out.addressable_shards
    )
    rec: dict[str, Any] = dict(
        level_bytes(stats.collectives, ctx.node_of, ctx.s.devices),
        max_abs_err=err,
        collectives=count_kinds(stats.collectives),
    )
    local = np.asarray(out.addressable_data(0), np.float64)
    if ctx.s.keep_outputs and local.shape == want.shape:  # a replicated output
        rec["output"] = local.tolist()
    return rec


def method_records(
    ctx: Context,
    names: list[str],
    seq_len: int,
    times: Times,
    static: dict[str, dict[str, Any]],
    topo: Topologies,
    label: str,
) -> dict[str, dict[str, Any]]:
    """Each method's record: every process's median (a call ends when the slowest
    process's does: `median_s` is the slowest's), the mean over every process's rounds
    (`mean_s`), the worst error over all processes, and the cost model's prediction with
    its error against that mean (`rel_err`). A collective: every process must call it.

    Why the error is taken against the mean: the model's α and its few-element, chain and
    kinds terms are means over every process's rounds of lone collectives
    (`levels.fit_level`, `fit_few`, `fit_chain`, `fit_kinds`, `fit_last`), timed in the
    same interleaved rounds as the methods, so it predicts a typical process's time per
    call, averaged over rounds, more than the time until the last process is done. (Its β
    are least-squares slopes, its per-call overhead and local terms medians: `fit_links`,
    `fit_local`; the match is partial.) The slowest process's median is the highest
    of one median per process, which differ with one program (notebook 9, §9.4, "Which
    time a prediction is checked against", compares the two on the same records)."""
    seconds = {n: statistics.median(times[n]) for n in names}
    means = {n: statistics.fmean(times[n]) for n in names}
    mine = np.array([[seconds[n], means[n], static[n]["max_abs_err"]] for n in names])
    everyone = allgather(mine)  # [processes, methods, 3]
    out = {}
    for i, name in enumerate(names):
        per_process = [float(x) for x in everyone[:, i, 0]]
        rec = dict(static[name])
        rec["median_s"] = max(per_process)
        rec["median_s_by_process"] = per_process
        # every process times `ctx.s.repeats` rounds of each call: the mean of their means
        # is the mean over all of them
        rec["mean_s"] = float(everyone[:, i, 1].mean())
        rec["round_s"] = list(times[name])  # this process's (process 0's in the report)
        rec["max_abs_err"] = float(everyone[:, i, 2].max())
        rec["predicted_s"] = predict(ctx, name, seq_len, topo)
        rec["rel_err"] = rec["predicted_s"] / rec["mean_s"] - 1
        out[name] = rec
        ctx.say(
            f"{label} Tk={seq_len} {name:<15} median {seconds[name] * 1e3:9.2f} ms here, "
            f"max |err| {static[name]['max_abs_err']:.1e} on my devices"
        )
    return out
