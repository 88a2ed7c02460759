"""What the cost model needs to know about a cluster on one machine, measured in the same
interleaved rounds as the methods, with every device busy:

* each level's link (α and β, from all-reduces over the 2-level mesh's "node" and "gpu"
  axes) and the ring over all devices (from all-reduces over all of them, alone and in a
  chain of `CHAIN`: `fit_chain`), and each ring's `call_s` from an all-reduce of
  `FEW_BYTES`, which leaves most of its segments empty (`fit_few`);
* the all-gather and all-to-all over all devices, each measured on its own (`KINDS`), and
  the reduce-scatter with the all-gather again in the reduce-scatter's own rounds, last
  (`LAST_KINDS`);
* each device's local work: the decode bandwidth as the collective after the kernel waits
  for it (`waited_kernel_s`), and the copy rate.

`level_calls` (with `kind_calls`) and `local_calls` are the programs to time
(`name -> (fn, args)`); `fit_links` and `fit_local` read their times, every process's
rounds pooled (`pooled`): each is one collective, seen from every process.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from jax import Array
    from jax.sharding import Mesh

    from .context import Context

Calls = dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]
"""Programs to time: `name -> (fn, args)` (`benchmark.interleaved_times`)."""
Times = dict[str, list[float]]
"""Seconds per round, by name."""
Level = Literal["node", "gpu", "flat"]
"""What an all-reduce that measures a link spans: an axis of the 2-level mesh (across
nodes, or inside one), or every device (`ctx.flat`'s one axis, the flat tree's ring)."""

LEVEL_SIZES = (256, 1024, 4096, 1 << 20, 2 << 20, 4 << 20)
"""Bytes per device of the all-reduces that measure each level: small ones for α (a few kB
on the link per step, <= `calibrate.SMALL_MESSAGE`), large ones for β (MBs per step, far
above the tbf bucket of 128 kB, which lets its first bytes through unshaped)."""


# ---------------------------------------------------------------------------------------
# The links


def sizes(ctx: Context, axis: Level) -> list[int]:
    """Bytes per device of the all-reduces that measure `axis`: `LEVEL_SIZES`, except that
    over "flat" the large ones are ⌊p/2⌋ times larger (at least 1), so that a step of its
    ring carries about what a 2-device ring's does: n/2 bytes at even p, n/3 at p = 3
    (from about 350 kB, above the tbf bucket of 128 kB)."""
    from ..perf import calibrate

    scale = max(1, ctx.flat.size // 2) if axis == "flat" else 1
    return [n if n <= calibrate.SMALL_MESSAGE else n * scale for n in LEVEL_SIZES]


def level_calls(ctx: Context) -> Calls:
    """The programs that measure the links, every device taking part (as the tree's own
    all-reduces do): on the 2-level mesh an all-reduce over "node" and one over "gpu", on
    the flat mesh one over all devices (one ring of 2(p−1) steps, over which each call's
    fixed cost spreads more thinly than over a level's ring of 2(g−1)), each of `sizes`
    bytes per device and of `FEW_BYTES` ("few NAME 8", `fit_few`), and the 2-level program
    with no collective (the per-call overhead)."""
    import jax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..perf import calibrate

    two, flat = (ctx.two, P(("node", "gpu"))), (ctx.flat, P(ctx.flat.axis_names))

    def program(on: tuple[Mesh, P], body: Callable[[Array], Array]) -> Callable[[Array], Array]:
        mesh, spec = on
        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        )

    def chain(x: Array) -> Array:
        # CHAIN dependent all-reduces; adding the device's index keeps each input
        # unreplicated, so that XLA cannot fold an all-reduce of an all-reduce.
        axes = ctx.flat.axis_names
        for _ in range(CHAIN):
            x = lax.psum(x, axes) + lax.axis_index(axes).astype(x.dtype)
        return x

    fns = {
        "node": (two, program(two, lambda x: lax.psum(x, "node"))),
        "gpu": (two, program(two, lambda x: lax.psum(x, "gpu"))),
        "flat": (flat, program(flat, lambda x: lax.psum(x, ctx.flat.axis_names))),
        "chain": (flat, program(flat, chain)),
        "noop": (two, program(two, lambda x: x + 1)),
    }
    calls: Calls = {}
    for name, ((mesh, spec), fn) in fns.items():
        named = [
            (f"{name} {n}", n) for n in sizes(ctx, "flat" if name in ("flat", "chain") else "node")
        ]
        if name in LEVELS:
            named.append((f"few {name} {FEW_BYTES}", FEW_BYTES))
        for key, n in named:
            if name == "chain" and n > calibrate.SMALL_MESSAGE:
                continue
            ones = np.ones(ctx.two.size * (n // 4), np.float32)
            calls[key] = (fn, (jax.device_put(ones, NamedSharding(mesh, spec)),))
    return {**calls, **kind_calls(ctx)}


LEVELS: tuple[Level, ...] = ("node", "gpu", "flat")
"""The rings the cost model prices: each axis of the 2-level mesh, and all devices."""
FEW_BYTES = 8
"""Bytes per device of the all-reduce that measures each ring's `call_s` (`fit_few`): two
float32 elements, which leave all but two of a ring's 2g segments empty (two of four on
the 2-device ring over "node"). At the default problem no merge all-reduces an operand of
this size (its flag is one element; its maxima and denominators one per head, 8)."""


def fit_few(
    ctx: Context, axis: Level, times: Times, overhead: float, alpha_s: float
) -> float | None:
    """`Link.call_s` of the ring over `axis`: the part of one all-reduce's fixed cost that it
    pays whole however few of its segments hold bytes. gloo's ring skips empty segments
    (`costmodel.gloo_segments`), and the cost model prices a ring of few elements at
    `c + (2(g−1)α − c)·h/2g` (`costmodel.gloo_ring_time`); the "few" call (`FEW_BYTES`,
    h = 2) solves that for c, with α the ring's lone call's (`alpha_s`, from calls that
    fill every segment): c = (t − 2(g−1)α·h/2g) / (1 − h/2g), t the mean over the rounds
    of the call's time less the per-call overhead (the mean, as for α: `fit_level`), at
    least 0 and at most 2(g−1)α (its 8 bytes' time on the wire, under a microsecond, left
    out). The flat ring's c is fitted at its lone α and priced with the chain's step
    (`fit_chain`), as back-to-back all-reduces pay it. None where the call fills every
    segment (one device per ring), and where `times` has no such call or no finite mean
    (records made before it was timed, which price every step at α)."""
    from ..perf import costmodel

    g = ctx.flat.size if axis == "flat" else ctx.two.shape[axis]
    held, total = costmodel.gloo_segments(FEW_BYTES, g)
    name = f"few {axis} {FEW_BYTES}"
    if held >= total or not times.get(name):  # one device per ring: every segment held
        return None
    t = float(np.mean([max(x - overhead, 0.0) for x in times[name]]))
    steps = 2 * (g - 1) * alpha_s
    share = held / total
    return min(max((t - steps * share) / (1 - share), 0.0), steps)


def pooled(everyone: dict[str, list[list[float]]]) -> Times:
    """Every process's rounds of each call in one list (process by process, each in its
    rounds' order, so that two calls' k-th entries are the same process and round, as
    `fit_chain` and `fit_last` pair them: every call has the same number of rounds on
    every process, as `methods.rounds_by_process` gathers them)."""
    return {name: [t for rounds in procs for t in rounds] for name, procs in everyone.items()}


CHAIN = 3
"""All-reduces over all devices in a "chain" program (`level_calls`), each on the last's
result: a step of their ring as back-to-back all-reduces pay it (`fit_chain`)."""


def fit_chain(ctx: Context, times: Times) -> dict[str, Any]:
    """A step of the ring over all devices as back-to-back all-reduces pay it: the mean over
    the small sizes and the rounds of `(chain − flat) / ((CHAIN − 1) · 2(p − 1))`, the
    "chain" call's time less the lone all-reduce's of the same size and round
    (`level_calls`), at least 0; `resolved` is False where that mean is not above 0 (a
    chain no slower than one call: noise), and `fit_links` then keeps the lone α. The flat
    tree's all-reduces over all devices follow each other that way (XLA:CPU runs each
    operand of a combined one as its own gloo all-reduce), the first after the kernel,
    whose wait `waited_kernel_s` prices. The hypothesis behind it, not measured: each of
    a lone call's steps carries a share of waking peers that a chain's later all-reduces
    find awake (in some runs the chain's step came out dearer, `results/cluster/README.md`).
    (The other methods
    issue at most one all-reduce over all devices: the pass-KV ring's last. `one_pass` and
    the 2-level tree reduce level by level, at the levels' α.)"""
    from ..perf import calibrate

    steps = 2 * (ctx.flat.size - 1)
    small = [n for n in sizes(ctx, "flat") if n <= calibrate.SMALL_MESSAGE]
    points = [
        (n, (c - f) / ((CHAIN - 1) * steps))
        for n in small
        for c, f in zip(times[f"chain {n}"], times[f"flat {n}"], strict=True)
    ]
    mean = float(np.mean([t for _, t in points]))
    return {
        "alpha_s": max(mean, 0.0) if math.isfinite(mean) else 0.0,
        "resolved": math.isfinite(mean) and mean > 0,
        "points": [[n, t] for n, t in points],
    }


KINDS = {"all_gather": "all-gather", "all_to_all": "all-to-all"}
"""Collectives over all devices that merges issue, each measured on its own
(`kind_calls`): `calibrate.COLLECTIVE_FNS` name -> `collective_stats` kind. Not the
reduce-scatter: it slows later transfers (`methods.POISON`), so it is measured in the
reduce-scatter's own rounds, last (`LAST_KINDS`)."""
LAST_KINDS = {"psum_scatter": "reduce-scatter", "all_gather": "all-gather"}
"""The collectives of the "reduce_scatter" merge, each measured on its own in that
method's rounds, after everything else (`worker`): the reduce-scatter, which cannot be
timed earlier (`methods.POISON`), and the all-gather as it runs once a reduce-scatter has
run. That method is priced with these in place of the first rounds' all-gather (a `KINDS`
fit) and the reduce-scatter's formula from the levels' fits."""
KIND_SIZES = (1024, 4096, 1 << 20, 4 << 20)
"""Nominal bytes per device of the calls that measure each of `KINDS`: two small ones (α,
<= `calibrate.SMALL_MESSAGE`) and two large (β). The calls use `kind_sizes`, these rounded
to a multiple of `4·p`, counted as `collective_stats` counts them (what each device
receives for an all-gather, what it sends otherwise)."""


def kind_sizes(p: int) -> list[int]:
    """`KIND_SIZES` as the calls measure them on `p` devices (`microbench.collective_words`,
    the rule of `calibrate.collective_times`): rounded down to a multiple of `4·p` bytes (at
    least `4·p`), so that each all-to-all splits its buffer into `p` equal parts and each
    all-gather receives `p` equal ones."""
    from ..perf import microbench

    return [4 * microbench.collective_words(n, p, "psum")[0] for n in KIND_SIZES]


def kind_calls(ctx: Context, kinds: dict[str, str] = KINDS) -> Calls:
    """Each of `kinds` (`KINDS` or `LAST_KINDS`) over every device of the 2-level mesh, as
    the merges issue them, at `kind_sizes`: `"NAME BYTES" -> (fn, args)`."""
    from ..perf import microbench

    mesh, p = ctx.two, ctx.two.size
    calls: Calls = {}
    for name in kinds:
        fn = microbench.collective_program(mesh, name)
        for n in KIND_SIZES:
            words, sent = microbench.collective_words(n, p, name)
            calls[f"{name} {4 * words}"] = (fn, (microbench.sharded_ones(mesh, 4 * sent),))
    return calls


def fit_kinds(
    times: Times, overhead: float, p: int, kinds: dict[str, str] = KINDS
) -> dict[str, dict[str, Any]]:
    """Each of `kinds` (`KINDS` or `LAST_KINDS`) as a link from its calls on `p` devices
    (`kind_calls`): the points `(bytes, time − overhead)`, read by `alpha_beta` (α the mean
    of the small calls' times, per call, by the rule of the levels' fits; β the inverse
    least-squares slope over the large ones): `{kind: {"alpha_s", "beta_Bps", "points"}}`,
    by `collective_stats` kind. Priced as measured (`Topology.measured`): on this machine
    a small one takes milliseconds, more than the formulas price it at (why is not
    measured)."""
    out = {}
    for name, kind in kinds.items():
        points = [(n, max(t - overhead, 0.0)) for n in kind_sizes(p) for t in times[f"{name} {n}"]]
        alpha, beta = alpha_beta(points)
        out[kind] = {"alpha_s": alpha, "beta_Bps": beta, "points": [list(pt) for pt in points]}
    return out


AFTER = ("all_gather", "psum_scatter")
"""The "reduce_scatter" merge's collectives as it issues them, the second on the first's
result (`last_calls`): on this machine a reduce-scatter after another collective added
more to a program's time than it took alone, an all-gather less
(`results/cluster/README.md`, "The reduce-scatter after another collective")."""


def last_calls(ctx: Context) -> Calls:
    """What is timed in the reduce-scatter's own rounds, last (`methods.POISON`): each of
    `LAST_KINDS` alone (`kind_calls`), and at the small `kind_sizes` the two of `AFTER` in
    one program ("after BYTES": an all-gather whose result each device receives as
    BYTES, then the reduce-scatter of that result, as "psum_scatter BYTES" is alone)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from ..perf import calibrate, microbench

    mesh, p = ctx.two, ctx.two.size
    spec = P(tuple(mesh.axis_names))
    first, then = (microbench.CHAIN_STEPS[k](tuple(mesh.axis_names), p) for k in AFTER)
    # scaled between the two, as `microbench._chain_program` scales its steps (a guard:
    # XLA:CPU has no rule today that would fold the pair)
    fn = jax.jit(
        jax.shard_map(
            lambda x: then(first(x) * 1.0001),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )
    )
    calls = kind_calls(ctx, LAST_KINDS)
    for n in kind_sizes(p):
        if n <= calibrate.SMALL_MESSAGE:
            calls[f"after {n}"] = (fn, (microbench.sharded_ones(mesh, n),))
    return calls


def fit_last(
    everyone: dict[str, list[list[float]]], overhead: float, p: int
) -> dict[str, dict[str, Any]]:
    """`LAST_KINDS` from `last_calls`' times, every process's rounds (`everyone`, `name ->
    [process][round]`) pooled (`pooled`, `fit_kinds`), and the reduce-scatter's α as it
    runs after another collective: the mean over the small sizes and over those rounds of
    "after" less the all-gather alone of the same size, process and round (the mean:
    `fit_chain`'s rule, where the kernel's wait takes the median). The merge is then
    priced at the lone all-gather (as every kind is) plus that excess. Its lone α is kept
    as `alpha_alone_s`, and used where the mean is not above 0 (`after.resolved` False: a
    pair no slower than its all-gather, noise; `fit_chain`'s test). β stays the lone
    calls'."""
    from ..perf import calibrate

    kinds = fit_kinds(pooled(everyone), overhead, p, LAST_KINDS)
    rs = kinds[LAST_KINDS[AFTER[1]]]
    points = [
        (n, a - b)
        for n in kind_sizes(p)
        if n <= calibrate.SMALL_MESSAGE
        for pair, first in zip(everyone[f"after {n}"], everyone[f"{AFTER[0]} {n}"], strict=True)
        for a, b in zip(pair, first, strict=True)
    ]
    mean = float(np.mean([t for _, t in points]))
    resolved = math.isfinite(mean) and mean > 0
    rs["after"] = {"resolved": resolved, "points": [[n, t] for n, t in points]}
    rs["alpha_alone_s"] = rs["alpha_s"]
    if resolved:
        rs["alpha_s"] = mean
    return kinds


def alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """`(α, β)` from `(bytes, seconds)` points, the rule of this module's fits: α the mean
    of the small messages' times (up to `calibrate.SMALL_MESSAGE` bytes; at least one is
    needed), β the inverse slope of a least-squares line through the large ones' (inf
    without two large sizes or a positive slope). Why the mean and the slope: `fit_level`."""
    from ..perf import calibrate

    alpha = float(np.mean([t for n, t in points if n <= calibrate.SMALL_MESSAGE]))
    big = [(n, t) for n, t in points if n > calibrate.SMALL_MESSAGE]
    sizes_, times_ = [n for n, _ in big], [t for _, t in big]
    slope = np.polyfit(sizes_, times_, 1)[0] if len(set(sizes_)) > 1 else 0.0
    return alpha, float(1 / slope) if slope > 0 else math.inf


def fit_level(ctx: Context, axis: Level, times: Times, overhead: float) -> dict[str, Any]:
    """α and β of one level from its all-reduces (`level_calls`, timed in `times`).

    gloo runs an all-reduce over g ranks as a ring: 2(g−1) steps, each sending n/g of a
    device's n bytes to the next rank. Over "node", the k devices of a node are counted
    as sending at once through its one uplink, so a step puts k·n/g bytes on the link (true
    only if their rings overlap in time, which with several processes per node they need
    not: `results/cluster/README.md`, "Re-runs of the inter-node fit"); over "flat" (all
    p devices in node order) one hop per node crosses, so n/p. Every timed call is a
    point `(bytes on the link per step, (time − overhead) / 2(g−1))`.

    α is the mean over the small messages' points (up to `calibrate.SMALL_MESSAGE` on
    the link per step), not their median as `calibrate.fit_link` takes: on this loaded
    machine a step's time spreads widely (from tenths of a millisecond to about 2 ms;
    probably a peer awake or one to be woken by the scheduler, not measured), and a
    decode's latency adds
    many steps, whose sum follows their mean. β is the inverse slope of a least-squares
    line through the large messages' points: the rate of the link itself, untouched by
    α and by the tbf bucket that lets a message's first 128 kB through unshaped, so
    comparable with the rate the tbf sets where the k·n/g count holds."""

    g = ctx.flat.size if axis == "flat" else ctx.two.shape[axis]
    share = ctx.two.shape["gpu"] if axis == "node" else 1  # devices per uplink at once
    steps = 2 * (g - 1)
    points = [
        (share * n / g, max(t - overhead, 0.0) / steps)
        for n in sizes(ctx, axis)
        for t in times[f"{axis} {n}"]
    ]
    alpha, beta = alpha_beta(points)
    return {
        "alpha_s": alpha,
        "beta_Bps": beta,
        "steps": steps,
        "link_bytes_per_step_per_device_byte": share / g,
        "points": [[n, t] for n, t in points],
        "allreduce_median_s": [
            [n, statistics.median(times[f"{axis} {n}"])] for n in sizes(ctx, axis)
        ],
    }


def fit_links(ctx: Context, times: Times, rate_bps: float) -> dict[str, Any]:
    """Both levels' fits and the flat ring's (`fit_level`, with `fit_few`'s `call_s`) at the
    set rate, each of `KINDS` (`fit_kinds`), and the per-call overhead, from `times`
    (every process's rounds: `pooled`)."""
    overhead = statistics.median(t for n in LEVEL_SIZES for t in times[f"noop {n}"])
    inter = fit_level(ctx, "node", times, overhead)
    intra = fit_level(ctx, "gpu", times, overhead)
    flat = fit_level(ctx, "flat", times, overhead)
    # The flat tree's all-reduces follow one another or the kernel (whose wait
    # `fit_local` prices): a step as a chain pays it; the lone call's α is kept.
    flat["alpha_alone_s"] = flat["alpha_s"]
    rings: tuple[tuple[Level, str, dict[str, Any]], ...] = (
        ("node", "inter", inter),
        ("gpu", "intra", intra),
        ("flat", "flat", flat),
    )
    for axis, _, fit in rings:  # each at its lone calls' α (the flat ring's, before the chain's)
        fit["call_s"] = fit_few(ctx, axis, times, overhead, fit["alpha_s"])
    flat["chain"] = fit_chain(ctx, times)
    if flat["chain"]["resolved"]:
        flat["alpha_s"] = flat["chain"]["alpha_s"]
    else:
        ctx.say("the chain of all-reduces was no slower than one: the lone step's alpha kept")
    kinds = fit_kinds(times, overhead, ctx.two.size)
    inter["set_Bps"] = rate_bps / 8
    ctx.say(
        f"link fit at {rate_bps / 1e9:g} Gbit/s: inter alpha {inter['alpha_s'] * 1e6:.0f} "
        f"us, beta {inter['beta_Bps'] / 1e6:.1f} MB/s ({inter['beta_Bps'] / inter['set_Bps']:.0%} "
        f"of the set {inter['set_Bps'] / 1e6:.1f} MB/s); intra alpha "
        f"{intra['alpha_s'] * 1e6:.0f} us, beta {intra['beta_Bps'] / 1e6:.0f} MB/s; a step "
        f"of the ring over all {ctx.flat.size} devices: alpha "
        f"{flat['alpha_s'] * 1e6:.0f} us in a chain, "
        f"{flat['alpha_alone_s'] * 1e6:.0f} us alone, beta {flat['beta_Bps'] / 1e6:.1f} MB/s; "
        + "; ".join(
            f"{kind} alpha {fit['alpha_s'] * 1e6:.0f} us, beta {fit['beta_Bps'] / 1e6:.1f} MB/s"
            for kind, fit in kinds.items()
        )
        + "; the part of a call a ring of few elements pays whole (call_s): "
        + ", ".join(
            f"{name} " + ("-" if fit["call_s"] is None else f"{fit['call_s'] * 1e6:.0f} us")
            for _, name, fit in rings
        )
    )
    return {"inter": inter, "intra": intra, "flat": flat, "kinds": kinds, "overhead_s": overhead}


# ---------------------------------------------------------------------------------------
# The local work


def cal_len(ctx: Context) -> int:
    """The length the local kernel is measured at: 3/4 of the decoded one (no method is
    measured there), at least 1024 keys per device (a kernel time well above the
    per-call overhead), a multiple of the device count."""
    p = ctx.s.devices
    return max(1024 * p, (3 * ctx.s.seq_len // 4) // p * p)


def local_calls(ctx: Context) -> Calls:
    """Programs that measure one device's local work with every device busy, timed in
    the same rounds as everything else: `calibrate.local_calls` ("kernel", "copy") at
    `cal_len`, and for `waited_kernel_s`, "tiny" (an all-reduce of 4 bytes over every
    device) and "both" (the kernel, then that all-reduce on its result)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from ..core import kernels
    from ..core.decode import kv_spec
    from ..perf import calibrate

    mesh, axes = ctx.two, ("node", "gpu")
    base = calibrate.local_calls(mesh, ctx.s.problem(cal_len(ctx)), ctx.s.seed)
    kv = kv_spec(axes)

    def program(body: Callable[[Array, Array, Array], Array]) -> Callable[..., Array]:
        return jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P(), kv, kv), out_specs=P(axes), check_vma=False
            )
        )

    def kernel(q: Array, k: Array, v: Array) -> Array:
        return kernels.xla_state(q, k, v).out[:, 0, 0, :1]

    def tiny(x: Array) -> Array:
        return lax.psum(jnp.sum(x, dtype=jnp.float32), axes)[None, None]

    args = base["kernel"][1]
    return {
        "local kernel": base["kernel"],
        "local copy": base["copy"],
        "local tiny": (program(lambda q, k, v: tiny(q[:1, :1, :1, :1])), args),
        "local both": (program(lambda q, k, v: kernel(q, k, v) + tiny(kernel(q, k, v))), args),
    }


def waited_kernel_s(everyone: dict[str, list[list[float]]]) -> float:
    """The local kernel as a collective after it waits for it: the median, over every
    process's rounds (`rounds_by_process`), of "both" less "tiny" (`local_calls`), in
    seconds. Both calls pay the per-call overhead and the same 4-byte all-reduce, so their
    difference is what the kernel costs a collective issued after it: the kernel, the
    wait for the last device of every process, and whatever the all-reduce costs more
    after the kernel than alone. One word over p devices is much faster than 64 B to 2 kB
    (`results/cluster/check/waits-by-length.json`: 1.4 ms against 11 to 13 ms; gloo's
    ring skips empty segments, and one word fills one of 2p, `results/cluster/README.md`),
    so how that cost divides between
    the kernel and the first collective after it is not measured: the model charges it
    all here, and prices that collective like the others."""
    names = ("local both", "local tiny")
    both, tiny = (everyone[n] for n in names)
    return statistics.median(
        b - t for bp, tp in zip(both, tiny, strict=True) for b, t in zip(bp, tp, strict=True)
    )


def fit_local(
    ctx: Context, times: Times, overhead_s: float, everyone: dict[str, list[list[float]]]
) -> dict[str, Any]:
    """Per-device decode bandwidth with all devices busy, as the collective after the
    kernel sees it, and the copy rate (`calibrate.local_rates`).

    On this machine the workers' threads outnumber the cores. A process's kernel, timed
    on its own, ends when its own devices finish ("kernel": `kernel_alone_Bps`, from the
    median over every process's rounds, less the per-call overhead); the
    collective that follows ends only after the last device of every process has
    finished (and, probably, its peers have been woken: not measured). That wait never
    shrank with the kernel's length from 2,048 to 16,384 keys, and was over three times
    longer at the longest
    (`results/cluster/check/waits-by-length.json`), and it is priced as a rate (a choice
    for that range, not measured below it; at one length a constant did as well,
    `results/cluster/README.md`, "The model check"): `mem_Bps` is a shard's K and V bytes
    over
    `waited_kernel_s(everyone)`, at
    `cal_len` (never above `kernel_alone_Bps`). `sync_s`, before this a constant added to
    the per-call overhead (once per decode), is 0: records made before keep theirs, and
    `methods.topologies` prices each record by its own fields. `times` is this process's
    rounds (the copy's median), `everyone` every process's (`rounds_by_process`)."""
    from ..perf import calibrate

    prob = ctx.s.problem(cal_len(ctx))
    med = {n: statistics.median(times[f"local {n}"]) for n in ("kernel", "copy", "tiny", "both")}
    kernel = statistics.median(t for proc in everyone["local kernel"] for t in proc)
    alone, copy = calibrate.local_rates(prob, ctx.s.devices, kernel, med["copy"], overhead_s)
    waited = waited_kernel_s(everyone)
    shard = prob.kv_bytes / ctx.s.devices
    mem = min(alone, shard / waited) if waited > 0 else alone
    # A copy no slower than a bare call has no measurable rate: say it is a lower bound.
    copy_text = (
        f"copy {copy / 1e9:.2f} GB/s"
        if calibrate.work_time(med["copy"], overhead_s)[1]
        else f"copy at least {copy / 1e9:.2f} GB/s (not resolved above the per-call overhead)"
    )
    ctx.say(
        f"local decode {mem / 1e9:.2f} GB/s per device as a collective after it waits "
        f"for it ({alone / 1e9:.2f} GB/s timed alone) and {copy_text}, all "
        f"{ctx.s.devices} busy (Tk={prob.seq_len})"
    )
    return {
        "mem_Bps": mem,
        "kernel_alone_Bps": alone,
        "waited_kernel_s": waited,
        "copy_Bps": copy,
        "overhead_s": overhead_s,
        "sync_s": 0.0,
        "seq_len": prob.seq_len,
        "median_s": med,
    }
