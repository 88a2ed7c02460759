"""Measure this machine, then check the cost model against it.

Three measurements, each a median of timed calls after a warm-up:

* the machine's read bandwidth (`benchmark.DeviceReader`: XLA summing a 512 MB float32
  array), the streaming read that bounds a decode step (one read of K and V, ~0.5 flop per
  byte);
* `bandwidth`: each local kernel's effective bandwidth, `(K + V bytes) / time`, and its
  fraction of the machine's, with its compiled temp memory;
* `calibrate`: latency α (small messages) and bandwidth β (messages of the sizes the ring
  will send) of the simulated devices' `ppermute` with its measured curve, the per-device
  decode bandwidth with all devices busy, a fixed per-call overhead, and one fold inside a
  compiled loop at other lengths (the micro-benchmarks of `microbench` and `ringlink`,
  put together by `measure_topology`); then `costmodel.predict_tree` / `predict_ring` with
  those parameters, against `benchmark.run` at several sequence lengths.

`validate_patterns` (and `patternbench.bench_patterns`) do the same for every merge pattern of
`tree_decode` and both rings. Nothing is fitted to the decode timings being predicted: the
parameters come from micro-benchmarks at other sizes.

The micro-benchmarks' names (`fit_link`, `message_sizes`, `SMALL_MESSAGE`, `local_calls`,
`local_rates`, `COLLECTIVE_FNS`, `COLLECTIVE_KIND`, ...) are re-exported here, where a
calibration's reader looks for them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import kernels, validate
from ..core.decode import kv_spec, tree_decode
from ..core.names import LAYOUTS, MERGE_NAMES, Layout, MergeName
from ..core.numerics import accum_dtype
from ..core.states import local_state
from . import benchmark
from .introspect import memory_stats
from .links import CollectiveKind, Link, Topology
from .localfit import FOLD_TINY_KEYS as FOLD_TINY_KEYS  # re-exported, with the two below
from .localfit import fold_problems as fold_problems
from .localfit import kernel_problems as kernel_problems
from .localfit import local_round_calls, refit_local
from .microbench import (
    CHAIN,
    COLLECTIVE_FNS,
    COLLECTIVE_KIND,
    chain_latency,
    check_fold_problems,
    collective_chain_times,
    collective_times,
    fit_link,
    fold_loop_times,
    measure_local,
    measure_local_affine,
    message_sizes,
)
from .microbench import SMALL_MESSAGE as SMALL_MESSAGE  # re-exported, with the three below
from .microbench import local_calls as local_calls
from .microbench import local_rates as local_rates
from .microbench import work_time as work_time
from .patterns import RINGS, RingName, merge_collectives, pass_q_collectives, ring_collectives
from .predict import Prediction, predict_merge, predict_pass_q_ring, predict_ring
from .ringlink import refit_ring_link, ring_link, ring_pass_calls, ring_pass_points, ring_pass_times

Progress = Callable[[str], None] | None
PredictMethod = Literal["tree"] | MergeName | RingName
"""What `predict` prices: "tree" (the paper's, `predict_tree`), a merge pattern or a ring."""


@dataclass
class KernelBandwidth:
    """One kernel's effective bandwidth. Field names are the bench JSON's."""

    gbs: float
    fraction: float
    temp_bytes: int
    kv_bytes: int
    median_s: float
    devices: int


def kernel_fns(mesh: Mesh) -> dict[str, tuple[Callable, Layout, int]]:
    """Kernels to measure: `name -> (fn(q, k, v), layout of k and v, devices)`.

    `einsum_reference` is `states.local_state`, the plain einsum → softmax → einsum that the
    "xla" kernel replaced; `dot_product_attention` is `jax.nn`'s (cuDNN where available).
    """
    fns: dict[str, tuple[Callable, Layout, int]] = {
        "einsum_reference": (lambda q, k, v: local_state(q, k, v).out, "bthd", 1),
        "dot_product_attention": (jax.nn.dot_product_attention, "bthd", 1),
        "xla_bthd": (lambda q, k, v: kernels.xla_state(q, k, v).out, "bthd", 1),
        "xla_bhtd": (lambda q, k, v: kernels.xla_state(q, k, v, layout="bhtd").out, "bhtd", 1),
    }
    if jax.default_backend() == "gpu":
        fns["dot_product_attention_cudnn"] = (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"),
            "bthd",
            1,
        )
        fns["cudnn"] = (lambda q, k, v: kernels.cudnn_state(q, k, v).out, "bthd", 1)
        if kernels.flash.available():
            fns["flash"] = (lambda q, k, v: kernels.flash_state(q, k, v).out, "bthd", 1)
    for layout in LAYOUTS:
        fns[f"tree_{layout}"] = (
            lambda q, k, v, layout=layout: tree_decode(
                q, k, v, mesh=mesh, layout=layout, local_kernel="xla"
            ),
            layout,
            mesh.size,
        )
    return fns


def bandwidth(
    mesh: Mesh,
    problem: benchmark.Problem,
    *,
    names: Iterable[str] | None = None,
    repeats: int = 5,
    seed: int = 0,
    progress: Progress = None,
) -> dict:
    """The bench JSON's `"bandwidth"` section: machine read bandwidth and each kernel's.

    Single-device kernels run on the mesh's first device; `tree_*` on the whole mesh, whose
    simulated devices share this machine's memory bus (so their fraction is comparable).
    Each timed kernel call is paired with one timed read of 512 MB on the first device
    (`benchmark.DeviceReader`: a jitted `jnp.sum` of a float32 array), so that the machine
    figure and the kernels' are sampled side by side over the same minutes (neighbours on
    a shared host change both); `machine_read_gbs` is the median of all those reads.
    """
    reader = benchmark.DeviceReader(512 * 2**20)
    reads: list[float] = []
    q, k, v = benchmark.make_inputs(problem, seed)
    one = NamedSharding(Mesh(np.array(mesh.devices).ravel()[:1], ("one",)), P())
    out: dict[str, dict] = {}
    fns = kernel_fns(mesh)
    for name in names or fns:
        fn, layout, ndev = fns[name]
        if progress:
            progress(name)
        kk, vv = (
            np.ascontiguousarray(np.swapaxes(x, 1, 2)) if layout == "bhtd" else x for x in (k, v)
        )
        if ndev == 1:
            sh = (one, one, one)
        else:
            kvs = NamedSharding(mesh, kv_spec(mesh.axis_names, layout))
            sh = (NamedSharding(mesh, P()), kvs, kvs)
        args = [jax.device_put(x, s) for x, s in zip((q, kk, vv), sh, strict=True)]
        jfn = jax.jit(fn)
        jax.block_until_ready(jfn(*args))
        times = []
        for _ in range(repeats):
            reads.append(reader.gbs())
            t0 = time.perf_counter()
            jax.block_until_ready(jfn(*args))
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        out[name] = asdict(
            KernelBandwidth(
                problem.kv_bytes / t / 1e9,
                0.0,
                memory_stats(jfn, *args).temp_bytes,
                problem.kv_bytes,
                t,
                ndev,
            )
        )
        del args
    machine = statistics.median(reads)
    for r in out.values():
        r["fraction"] = r["gbs"] / machine
    return {"machine_read_gbs": machine, "kernels": out}


def bandwidth_table(section: dict) -> str:
    head = (
        f"{'kernel':<30}{'devices':>8}{'median ms':>11}{'GB/s':>8}{'of machine':>12}"
        f"{'temp MB':>10}{'temp/KV':>9}"
    )
    rows = [
        f"machine read bandwidth (XLA sum of 512 MB): {section['machine_read_gbs']:.1f} GB/s",
        head,
        "-" * len(head),
    ]
    for name, r in section["kernels"].items():
        rows.append(
            f"{name:<30}{r['devices']:>8}{r['median_s'] * 1e3:>11.1f}{r['gbs']:>8.2f}"
            f"{r['fraction']:>11.0%} {r['temp_bytes'] / 1e6:>10.1f}"
            f"{r['temp_bytes'] / r['kv_bytes']:>8.1%}"
        )
    return "\n".join(rows)


@dataclass
class Calibration:
    """Parameters measured on this machine, and the topology they make."""

    overhead_s: float
    ppermute: Link
    psum: Link
    mem_Bps: float
    topology: Topology
    collective_points: dict
    links: dict = field(default_factory=dict)  # every measured kind: its Link


BAND = 0.30
"""The model's target: a prediction within ±30% of the measured median (issue 30; the same
band `tree-attention-edu calibrate --check` gates on, `modelcheck.BAND`)."""

DEFAULT_SIZES = tuple(2**n for n in range(10, 27, 2))
"""Message sizes (bytes) `measure_topology` times by default: 1 KiB to 64 MiB."""


def measure_topology(
    mesh: Mesh,
    *,
    kernel_problem: benchmark.Problem | None = None,
    sizes: Iterable[int] = DEFAULT_SIZES,
    repeats: int = 7,
    progress: Progress = None,
    kinds: Iterable[str] = ("psum",),
    short_kernel_problem: benchmark.Problem | None = None,
    fold_problems: Iterable[benchmark.Problem] = (),
) -> Calibration:
    """Measure α, β, the per-call overhead and the per-device decode bandwidth of `mesh`.

    `sizes` are per-device message sizes in bytes; include some ≤ `SMALL_MESSAGE` (the
    ring's ppermute takes its α from them) and some above it (each link's curve and β),
    ideally spanning the transfers to be predicted (`message_sizes`). `kinds` are the
    collectives to time besides the ring's ppermute, each at the sizes above
    `SMALL_MESSAGE` (`collective_times`) and as a chain of dependent collectives, whose
    slope is its α (`collective_chain_times`; the chains' no-op call gives the overhead);
    each becomes one of the topology's `measured` kinds, so that the cost model prices it
    as measured on this mesh rather than by a GPU's algorithm formula. The topology prices
    each operand of an all-reduce apart (`Topology.operands_apart`), as XLA:CPU runs them.

    The decode bandwidth is measured with every device running the xla kernel on its shard
    at once (no collective), at `kernel_problem` (default: the bench problem at Tk = 49152;
    `calibrate` passes a size its validation does not use), because the simulated devices
    share one memory bus. With `short_kernel_problem` (a shorter cache) the kernel is timed at
    both sizes and the line through the two times gives the bandwidth (its slope) and the
    fixed part of a kernel call (its intercept, `Topology.kernel_fixed_s`); without it the
    kernel's whole time is charged to bandwidth.

    With `fold_problems` (`fold_problems`: checked first, `check_fold_problems`), a fold in
    a compiled loop is timed at each shard, whole and by head windows (`fold_loop_times`):
    the rings' curves (`Topology.fold_points`, `Topology.window_points`)."""
    validate.check_int(repeats, "repeats", example="`repeats=7`")
    if not (isinstance(fold_problems, tuple | list) and len(fold_problems) == 0):
        fold_problems = check_fold_problems(fold_problems, mesh.size)  # before any timing
    if progress:
        progress("collectives")
    sizes = tuple(sizes)
    prob = kernel_problem or benchmark.Problem(seq_len=49152)
    kinds = tuple(dict.fromkeys(("psum", *kinds)))
    overhead, links, link, pts = _links(mesh, prob, sizes, kinds, repeats)
    psum_link = links["all-reduce"]

    if progress:
        progress("local kernel")
    fixed = 0.0
    if short_kernel_problem is None:
        mem_Bps, copy_Bps = measure_local(mesh, prob, overhead_s=overhead, repeats=repeats)
    else:
        mem_Bps, fixed, copy_Bps = measure_local_affine(
            mesh, (short_kernel_problem, prob), overhead_s=overhead, repeats=repeats
        )

    if fold_problems and progress:
        progress("folds in a loop")
    folds, windows = _fold_curves(mesh, tuple(fold_problems), repeats)
    topo = Topology(
        nodes=1,
        devices_per_node=mesh.size,
        intra=link,
        inter=link,
        mem_Bps=mem_Bps,
        flops=float("inf"),
        overhead_s=overhead,
        overlap=False,
        operands_apart=True,
        name=f"{mesh.size} simulated CPU devices (this machine)",
        sources=("measured by tree_attention_edu.perf.calibrate.measure_topology",),
        measured=tuple(links.items()) if len(kinds) > 1 else (),
        copy_Bps=copy_Bps,
        kernel_fixed_s=fixed,
        fold_points=folds,
        window_points=windows,
    )
    return Calibration(
        overhead, link, psum_link, mem_Bps, topo, pts, {**links, "collective-permute": link}
    )


def _fold_curves(
    mesh: Mesh, problems: tuple[benchmark.Problem, ...], repeats: int
) -> tuple[tuple[tuple[float, float], ...], ...]:
    """`(fold_points, window_points)` at `problems` (`fold_loop_times`), or `((), ())`."""
    if not problems:
        return (), ()
    return tuple(
        tuple(sorted(fold_loop_times(mesh, problems, repeats=repeats, windows=w)))
        for w in (False, True)
    )


def _links(
    mesh: Mesh,
    prob: benchmark.Problem,
    sizes: tuple[int, ...],
    kinds: tuple[str, ...],
    repeats: int,
) -> tuple[float, dict[CollectiveKind, Link], Link, dict]:
    """`measure_topology`'s links: `(overhead, {kind: Link}, ring-pass Link, points)`, each
    link keeping its measured points (`Link.points`). Each kind's α (its point at
    `SMALL_MESSAGE`) is its `chain_latency`, and the overhead the chains' no-op call
    (`collective_chain_times`); `points` holds, besides each size's times, each kind's chain
    as `"<kind> chain": [(1, seconds), (CHAIN, seconds)]`."""
    # The call overhead and each kind's latency α come from programs of 1 and CHAIN
    # dependent collectives timed in the same rounds: α is what one more collective adds.
    # A lone collective minus a no-op timed apart gave α = 5 µs for the all-reduce in one
    # run (the no-op's median 276 µs) where the chain's slope is about 150 µs on the same
    # 2-core host; a merge of three all-reduces was then priced 0.3 ms short.
    overhead, chains = collective_chain_times(mesh, kinds=kinds, chain=CHAIN, repeats=3 * repeats)
    pts = collective_times(
        mesh, [n for n in sizes if n > SMALL_MESSAGE], repeats=repeats, kinds=kinds
    )
    pts.update({f"{k} chain": [(1, one), (CHAIN, many)] for k, (one, many) in chains.items()})
    links = {}
    for k in kinds:
        alpha = chain_latency(*chains[k], chain=CHAIN)
        # A larger message is timed alone, less the no-op; no larger message costs less
        # than α (a lone call's median can fall under the chain's slope by noise).
        big = [(n, max(t - overhead, alpha)) for n, t in pts[k]]
        links[COLLECTIVE_KIND[k]] = fit_link([(SMALL_MESSAGE, alpha), *big], keep_points=True)
    pts["ppermute"] = ring_pass_times(mesh, prob, sizes, repeats=repeats)
    link = ring_link(pts["ppermute"], overhead, mesh.size)
    return overhead, links, link, pts


def problem_sizes(problem: benchmark.Problem) -> dict[str, Any]:
    """A `benchmark.Problem`'s sizes as the cost model's keyword arguments (`batch`,
    `q_heads`, `kv_heads`, `head_dim`, `itemsize`, `q_len`)."""
    return dict(
        batch=problem.batch,
        q_heads=problem.q_heads,
        kv_heads=problem.kv_heads,
        head_dim=problem.head_dim,
        itemsize=jnp.dtype(problem.dtype).itemsize,
        q_len=problem.q_len,
    )


def predict(
    method: PredictMethod,
    seq_len: int,
    topo: Topology,
    problem: benchmark.Problem,
) -> Prediction:
    """The cost model's latency for a `benchmark.Problem` at `seq_len`: `method` is "tree",
    "ring", "ring_pass_q" or a merge pattern (`core.names.MERGE_NAMES`)."""
    validate.check_choice(method, ("tree", *MERGE_NAMES, *RINGS), "method")
    shape = problem_sizes(problem)
    stat = jnp.dtype(accum_dtype(problem.dtype)).itemsize
    if method == "ring":
        return predict_ring(seq_len, topo, **shape)
    if method == "ring_pass_q":
        return predict_pass_q_ring(seq_len, topo, **shape, stat_itemsize=stat)
    pattern = "allreduce" if method == "tree" else method
    return predict_merge(pattern, seq_len, topo, **shape, stat_itemsize=stat)


def calibrate(
    mesh: Mesh,
    seq_lens: Iterable[int] = (16384, 32768, 65536, 131072),
    *,
    problem: benchmark.Problem | None = None,
    repeats: int = 5,
    progress: Progress = None,
) -> tuple[Calibration, list[dict]]:
    """Measure the topology, predict tree and ring latency at each `seq_len`, and measure them.

    Returns the calibration and the bench JSON's `"calibration"` rows:
    `{"method", "devices", "seq_len", "predicted_s", "measured_s", "error"}`.
    """
    base = problem or benchmark.Problem()
    seq_lens = list(seq_lens)
    # The kernel bandwidth is measured at 3/4 of the longest validated length: not one of them.
    cal_len = max(mesh.size, (3 * max(seq_lens) // 4) // mesh.size * mesh.size)
    # The ring sends K and V blocks of N/p keys: measure the links at those sizes.
    item = jnp.dtype(base.dtype).itemsize
    blocks = [
        base.batch * -(-n // mesh.size) * base.kv_heads * base.head_dim * item for n in seq_lens
    ]
    cal = measure_topology(
        mesh,
        kernel_problem=benchmark.Problem(**{**asdict(base), "seq_len": cal_len}),
        sizes=message_sizes(blocks),
        progress=progress,
        fold_problems=fold_problems(base, mesh.size, seq_lens),
    )
    rows = []
    for n in seq_lens:
        prob = benchmark.Problem(**{**asdict(base), "seq_len": n})
        if progress:
            progress(f"Tk={n}")
        methods: tuple[PredictMethod, ...] = ("tree", "ring")
        records = benchmark.run(mesh, prob, methods=methods, repeats=repeats)
        for method, rec in zip(methods, records, strict=True):  # one record per method
            pred = predict(method, n, cal.topology, prob).total_s
            rows.append(
                dict(
                    method=rec.method,
                    devices=rec.devices,
                    seq_len=n,
                    predicted_s=pred,
                    measured_s=rec.median_s,
                    error=pred / rec.median_s - 1,
                )
            )
    return cal, rows


def calibration_table(cal: Calibration, rows: list[dict]) -> str:
    lines = [
        f"measured: per-call overhead {cal.overhead_s * 1e6:.0f} us; ring-pass ppermute alpha "
        f"{cal.ppermute.alpha_s * 1e6:.0f} us, beta {cal.ppermute.beta_Bps / 1e9:.2f} GB/s; "
        f"psum alpha {cal.psum.alpha_s * 1e6:.0f} us, beta {cal.psum.beta_Bps / 1e9:.2f} GB/s; "
        f"decode {cal.mem_Bps / 1e9:.2f} GB/s per device with all {cal.topology.devices} busy",
        f"{'method':<8}{'devices':>8}{'seq_len':>9}{'predicted ms':>14}{'measured ms':>13}"
        f"{'error':>8}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        lines.append(
            f"{r['method']:<8}{r['devices']:>8}{r['seq_len']:>9}"
            f"{r['predicted_s'] * 1e3:>14.1f}{r['measured_s'] * 1e3:>13.1f}"
            f"{r['error']:>+8.0%}"
        )
    worst = max(abs(r["error"]) for r in rows)
    lines.append(f"worst |error| {worst:.0%} (target: within {BAND:.0%})")
    return "\n".join(lines)


# --- merge patterns and rings ------------------------------------------------------------


def pattern_payloads(problem: benchmark.Problem, p: int, seq_lens: Iterable[int]) -> list[int]:
    """Every per-device message (bytes) the patterns and rings send at these sizes: the
    micro-benchmarks are run where the predictions will use them."""
    validate.check_instance(problem, benchmark.Problem, "problem", "modelcheck.PROBLEM")
    seq_lens = validate.check_sizes_list(seq_lens, "seq_lens", "(4096, 16384, 65536)")
    item = jnp.dtype(problem.dtype).itemsize
    stat = jnp.dtype(accum_dtype(problem.dtype)).itemsize
    shape: dict[str, Any] = dict(
        batch=problem.batch,
        q_len=problem.q_len,
        q_heads=problem.q_heads,
        v_dim=problem.head_dim,
        p=p,
        stat_itemsize=stat,
    )
    sizes = [
        nbytes
        for m in MERGE_NAMES
        for _, nbytes, _ in merge_collectives(m, **shape, out_itemsize=item)
    ]
    sizes += [
        nbytes
        for _, nbytes, _ in pass_q_collectives(
            **shape, kv_heads=problem.kv_heads, head_dim=problem.head_dim, itemsize=item
        )
    ]
    for n in seq_lens:
        sizes += [
            nbytes
            for _, nbytes, _ in ring_collectives(
                batch=problem.batch,
                kv_len=n,
                kv_heads=problem.kv_heads,
                head_dim=problem.head_dim,
                v_dim=problem.head_dim,
                p=p,
                itemsize=item,
            )
        ]
    return sizes


def pattern_message_sizes(
    problem: benchmark.Problem, p: int, seq_lens: Iterable[int]
) -> tuple[int, ...]:
    """The message sizes the links are timed at for these patterns and rings:
    `message_sizes` spanning `pattern_payloads` (`pattern_calibration` and the ring-pass
    programs `validate_patterns` times in the cells' rounds)."""
    return message_sizes(pattern_payloads(problem, p, seq_lens))


def pattern_calibration(
    mesh: Mesh,
    seq_lens: Iterable[int],
    *,
    problem: benchmark.Problem | None = None,
    repeats: int = 5,
    progress: Progress = None,
) -> Calibration:
    """The topology `validate_patterns` predicts with (shared with `bench_patterns`):
    `measure_topology` over every collective the patterns and rings use, at message sizes
    spanning what they will send at `seq_lens`, and the decode bandwidth at 3/4 of the
    longest length and at 3/4 of the shortest (each rounded to a multiple of the device
    count: not validated lengths), the line through the two giving the bandwidth and the
    fixed part of a kernel call, and one fold inside a compiled loop, whole shard and head
    window, at a tiny block and at 3/4 of each length (`fold_problems`)."""
    base = problem or benchmark.Problem()
    p = mesh.size
    seq_lens = list(seq_lens)
    *short, long = kernel_problems(base, p, seq_lens)
    return measure_topology(
        mesh,
        fold_problems=fold_problems(base, p, seq_lens),
        kernel_problem=long,
        short_kernel_problem=short[0] if short else None,
        sizes=pattern_message_sizes(base, p, seq_lens),
        repeats=repeats,
        progress=progress,
        kinds=tuple(COLLECTIVE_FNS),
    )


def _check_calibration(calibration: Any, p: int) -> None:
    """A `Calibration` measured on `p` devices, else an error naming `calibration`."""
    validate.check_instance(
        calibration, Calibration, "calibration", "calibrate.pattern_calibration(mesh, ...)"
    )
    if calibration.topology.devices != p:
        raise ValueError(
            f"`calibration` was measured on {calibration.topology.devices} devices and "
            f"`mesh` has {p}; calibrate this mesh (`pattern_calibration(mesh, ...)`)."
        )


def validate_patterns(
    mesh: Mesh,
    seq_lens: Iterable[int] = (8192, 16384, 32768),
    *,
    problem: benchmark.Problem | None = None,
    methods: Iterable[MergeName | RingName] = benchmark.PATTERNS,
    calibration: Calibration | None = None,
    repeats: int = 5,
    progress: Progress = None,
    local: bool = False,
) -> tuple[Calibration, list[dict]]:
    """Predicted against measured latency of every merge pattern and both rings.

    First (unless a `calibration` is given) the mesh is measured: per-call overhead, the
    ring-shaped ppermute, the all-reduce, all-gather, reduce-scatter and all-to-all over
    sizes spanning the messages the methods will send, and the per-device decode bandwidth at
    a length that is not validated (`measure_topology`). Nothing is fitted to the timings
    being predicted. Then every method of `methods` runs at every `seq_len` (at each, on the
    same inputs), all of them in the same interleaved rounds (`benchmark.median_times`), and
    is predicted by `predict`.

    With `local=True`, the calibration's local and ring-pass programs run in the same
    rounds: the kernel at 3/4 of the shortest and of the longest length (`kernel_problems`),
    a copy of every device's K shard at once at the longer, where the calibration has fold
    curves the fold loops (`fold_problems`, whole shard and head window), and the ring's
    permutes at the message sizes `pattern_calibration` times (`ringlink.ring_pass_calls`).
    The decode bandwidth, the kernel's fixed part, the copy rate, both curves
    (`refit_local`) and the ring's permute link (`refit_ring_link`) are fitted from those
    rounds' medians, as `measure_topology` fits them, before predicting:
    on a host whose memory-bound work runs up to two-thirds slower for seconds at a time, a
    calibration timed in its own seconds can fall in another spell than the cells it
    predicts (`results/calibrate/README.md`). They are still other lengths than the cells',
    in programs of their own: nothing is fitted to the timings being predicted.

    Returns the calibration (with `local`, the one predicted with) and rows `{"name",
    "devices", "seq_len", "median_s", "predicted_s", "rel_err"}` (`rel_err = predicted /
    measured − 1`).
    """
    base = problem or benchmark.Problem()
    seq_lens, methods = benchmark.check_pattern_cells(mesh, base, seq_lens, methods, "problem")
    validate.check_bool(local, "local")
    validate.check_int(repeats, "repeats", example="`repeats=5`")
    p = mesh.size
    if calibration is not None:
        _check_calibration(calibration, p)
    if calibration is None:
        calibration = pattern_calibration(
            mesh, seq_lens, problem=base, repeats=repeats, progress=progress
        )
    rows = []
    # Every (method, length) in the same interleaved rounds: a slow spell of the shared
    # machine (on the 2-core machine, seconds long, seen as every cell of one length off
    # by the same factor) then falls on a few rounds of every cell, and the medians pass
    # over it, instead of on every round of the one length timed during it.
    calls = benchmark.pattern_calls(mesh, base, seq_lens, methods)
    kernel = kernel_problems(base, p, seq_lens)
    # Fold curves only where the calibration has them (not on one device).
    folds = tuple(fold_problems(base, p, seq_lens)) if calibration.topology.fold_points else ()
    if local:
        calls.update(local_round_calls(mesh, kernel, folds))
        calls.update(ring_pass_calls(mesh, base, pattern_message_sizes(base, p, seq_lens)))
    if progress:
        progress(f"{len(methods)} methods at {len(seq_lens)} lengths, {repeats} rounds interleaved")
    seconds = benchmark.median_times(calls, repeats=repeats)
    if local:
        calibration = _refit_in_rounds(calibration, kernel, folds, seconds)
    for n in seq_lens:
        prob = benchmark.Problem(**{**asdict(base), "seq_len": n})
        for name in methods:
            measured = seconds[f"{name}@{n}"]
            predicted = predict(name, n, calibration.topology, prob).total_s
            row = dict(name=name, devices=p, seq_len=n, median_s=measured, predicted_s=predicted)
            rows.append({**row, "rel_err": predicted / measured - 1})
    return calibration, rows


def _refit_in_rounds(
    cal: Calibration, kernel: tuple, folds: tuple, seconds: dict[str, float]
) -> Calibration:
    """`cal` with its local parts and its ring's link fitted again from the medians of their
    programs timed in other rounds (`refit_local`, `refit_ring_link`)."""
    topo = refit_ring_link(refit_local(cal.topology, kernel, folds, seconds), seconds)
    return replace(
        cal,
        mem_Bps=topo.mem_Bps,
        topology=topo,
        ppermute=topo.intra,
        links={**cal.links, "collective-permute": topo.intra},
        collective_points={
            **cal.collective_points,
            "ppermute": ring_pass_points(topo.devices, seconds),
        },
    )


def measured_line(cal: Calibration) -> str:
    """A calibration in one line: overhead, local rates, fixed kernel part and each link."""
    links = "; ".join(
        f"{kind} alpha {link.alpha_s * 1e6:.0f} us, beta {link.beta_Bps / 1e9:.2f} GB/s"
        for kind, link in cal.links.items()
    )
    copy = cal.topology.copy_Bps or cal.mem_Bps
    return (
        f"per-call overhead {cal.overhead_s * 1e6:.0f} us; decode {cal.mem_Bps / 1e9:.2f} GB/s, "
        f"{cal.topology.kernel_fixed_s * 1e6:.0f} us per kernel call and copy "
        f"{copy / 1e9:.2f} GB/s per device; {links}"
    )


def patterns_table(cal: Calibration, rows: list[dict]) -> str:
    """`validate_patterns`'s result as a fixed-width table, with the measured links and the
    worst relative error."""
    lines = [
        f"measured: {measured_line(cal)}",
        f"{'name':<16}{'devices':>8}{'seq_len':>9}{'predicted ms':>14}{'measured ms':>13}"
        f"{'rel err':>9}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in rows:
        lines.append(
            f"{r['name']:<16}{r['devices']:>8}{r['seq_len']:>9}"
            f"{r['predicted_s'] * 1e3:>14.1f}{r['median_s'] * 1e3:>13.1f}"
            f"{r['rel_err']:>+9.0%}"
        )
    worst = max(rows, key=lambda r: abs(r["rel_err"]))
    lines.append(
        f"worst |rel err| {abs(worst['rel_err']):.0%} ({worst['name']}, Tk="
        f"{worst['seq_len']}; target: within {BAND:.0%})"
    )
    return "\n".join(lines)
