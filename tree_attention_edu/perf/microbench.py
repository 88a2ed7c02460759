"""Micro-benchmarks of this machine, the pieces the cost model is calibrated from.

* `collective_times`: each collective over the mesh (`COLLECTIVE_FNS`: all-reduce,
  all-gather, reduce-scatter, all-to-all) at a range of message sizes;
* `collective_chain_times`: programs of one and of `CHAIN` dependent collectives of each
  kind, and the fixed cost of calling a program on the mesh, in the same rounds: each
  collective's latency (`chain_latency`) and the call overhead;
* `local_calls`, `measure_local`: the xla kernel and a copy of a K shard on every device at
  once (the simulated devices share one memory bus), as per-device rates (`local_rates`);
* `fold_loop_times`: one fold inside a compiled loop, over a whole shard or a head window
  with its query-block permute (the rings' curves, `Topology.fold_points` and
  `window_points`), its problems checked by `check_fold_problems`;
* `fit_link`: the Hockney parameters α and β of a link from `(bytes, seconds)` points, at
  the sizes `message_sizes` picks (small messages for α, the transfers to be predicted
  for β), and with `keep_points` the measured curve `Link.send` reads.

Each time is a median of timed calls after a warm-up (`benchmark.median_time`).
`calibrate.measure_topology` puts them together into a `Topology`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import kernels, validate
from ..core.decode import kv_spec, pass_q_blocks
from ..core.devices import ring_permutation
from ..core.numerics import accum_dtype
from ..core.states import combine_core, identity_core
from . import benchmark
from .links import CollectiveKind, Link


def sharded_ones(mesh: Mesh, nbytes: int) -> jax.Array:
    """`nbytes` of float32 ones per device, sharded along axis 0 over all mesh axes."""
    n = max(nbytes // 4, 1)
    spec = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return jax.device_put(jnp.ones((mesh.size * n,), jnp.float32), spec)


def collective_words(nbytes: int, p: int, kind: str) -> tuple[int, int]:
    """`(words, sent)`: float32 words of a collective of `kind` (among `COLLECTIVE_FNS`)
    measured at `nbytes` over `p` devices, counted as `collective_stats` counts them
    (rounded down to a multiple of `p`, at least `p`), and the words each device sends
    (`words / p` for "all_gather", whose count is what each device receives)."""
    words = max(nbytes // 4 // p, 1) * p
    return words, words // p if kind == "all_gather" else words


def collective_program(mesh: Mesh, kind: str) -> Callable:
    """One collective of `kind` (among `COLLECTIVE_FNS`) over all of `mesh`'s axes, on each
    device's flat buffer sharded along axis 0 (`sharded_ones`)."""
    return _smap(mesh, COLLECTIVE_FNS[kind](tuple(mesh.axis_names), mesh.size))


def _smap(mesh: Mesh, body: Callable) -> Callable:
    spec = P(tuple(mesh.axis_names))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def collective_times(
    mesh: Mesh, sizes: Iterable[int], *, repeats: int = 7, kinds: Iterable[str] = ("psum",)
) -> dict[str, list[tuple[int, float]]]:
    """Median seconds of one collective for each message size in bytes, plus `"noop"`: the
    same call doing `x + 1` (at the smallest size, the fixed cost of calling a program on the
    mesh).

    `kinds` among `COLLECTIVE_FNS`: "psum" (all-reduce), "all_gather", "psum_scatter"
    (reduce-scatter) and "all_to_all". Sizes are counted as `collective_stats` counts them:
    the buffer each device receives for "all_gather" (each contributes `n/p`), the buffer it
    contributes otherwise; they are rounded down to a multiple of `4·p` bytes.
    """
    p = mesh.size
    kinds = tuple(kinds)
    for kind in kinds:
        validate.check_choice(kind, tuple(COLLECTIVE_FNS), "kinds")
    fns = {"noop": _smap(mesh, lambda x: x + 1)}
    fns.update({k: collective_program(mesh, k) for k in kinds})
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in fns}
    for n in sizes:
        for name, fn in fns.items():
            words, sent = collective_words(n, p, name)
            x = sharded_ones(mesh, 4 * sent)
            out[name].append((4 * words, benchmark.median_time(fn, x, repeats=repeats)))
    return out


COLLECTIVE_FNS: dict[str, Callable] = {
    "psum": lambda axes, p: lambda x: lax.psum(x, axes),
    "all_gather": lambda axes, p: lambda x: lax.all_gather(x, axes, tiled=True),
    "psum_scatter": lambda axes, p: lambda x: lax.psum_scatter(x, axes, tiled=True),
    "all_to_all": lambda axes, p: (
        lambda x: lax.all_to_all(x.reshape(p, -1), axes, 0, 0, tiled=True).reshape(-1)
    ),
}
"""Each micro-benchmarked collective, as `(axes, p) -> body(x)` on one device's flat buffer."""

COLLECTIVE_KIND: dict[str, CollectiveKind] = {
    "psum": "all-reduce",
    "all_gather": "all-gather",
    "psum_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
}
"""The `collective_stats` name of each micro-benchmarked collective."""


CHAIN = 4
"""Dependent collectives in `collective_chain_times`' longer program."""

CHAIN_BYTES = 4096
"""Bytes of each collective in `collective_chain_times`, counted as `collective_times`
counts them (received for an all-gather, contributed otherwise): a merge's size (a few KiB
at batch 1), under `SMALL_MESSAGE`."""

MAX_CHAIN = 64
"""The longest chain `collective_chain_times` builds: its program is unrolled, one
collective per step, so its compile time grows with it."""


def _chain_program(mesh: Mesh, kind: str, count: int) -> Callable:
    """A program of `count` collectives `CHAIN_STEPS[kind]` over all of `mesh`, each on the
    last one's result, scaled, so that XLA can neither fold two into one nor reuse one."""
    step = CHAIN_STEPS[kind](tuple(mesh.axis_names), mesh.size)

    def body(x):
        for _ in range(count):
            x = step(x) * 1.0001
        return x

    return _smap(mesh, body)


CHAIN_STEPS: dict[str, Callable] = {
    "psum": lambda axes, p: lambda x: lax.psum(x, axes),
    "all_gather": lambda axes, p: lambda x: lax.all_gather(x.reshape(p, -1)[0], axes, tiled=True),
    "psum_scatter": lambda axes, p: lambda x: jnp.tile(lax.psum_scatter(x, axes, tiled=True), p),
    "all_to_all": COLLECTIVE_FNS["all_to_all"],
}
"""Each `COLLECTIVE_FNS` kind as a step whose result has its argument's shape: the
all-gather of a 1/p slice (each device receives the whole buffer, as `collective_times`
counts an all-gather by what it receives), the reduce-scatter's share tiled back."""


def collective_chain_times(
    mesh: Mesh,
    *,
    kinds: Iterable[str] = ("psum",),
    nbytes: int = CHAIN_BYTES,
    chain: int = CHAIN,
    repeats: int = 21,
) -> tuple[float, dict[str, tuple[float, float]]]:
    """Median seconds of a no-op call on the mesh (`x + 1`), and of one program of 1 and one
    of `chain` dependent collectives of each kind (`CHAIN_STEPS`), each device contributing
    `nbytes` (rounded down to whole float32 words, a multiple of p of them, at least p), all
    timed in the same interleaved rounds (`benchmark.median_times`):
    `(noop_s, {kind: (one_s, chain_s)})`.

    `chain_latency(one_s, chain_s, chain=chain)` reads a collective's latency off them: what
    one more collective adds to a program, its dispatch and the wake-up of every device
    thread. A lone collective's time minus a no-op's, each timed on its own, does not give
    it on simulated devices sharing a few cores: in three runs the no-op timed apart on 8
    devices took about as long as a lone all-reduce, which put α at 0 to 5 µs where the
    chain gives about 150 µs (`results/calibrate/README.md`). `chain` is at most
    `MAX_CHAIN`.
    """
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    kinds = tuple(validate.check_sequence(kinds, "kinds", "collective names", '("psum",)'))
    for i, kind in enumerate(kinds):
        validate.check_str_choice(kind, tuple(CHAIN_STEPS), f"kinds[{i}]")
    nbytes = validate.check_int(nbytes, "nbytes", example="`nbytes=4096`")
    chain = validate.check_int(chain, "chain", minimum=2, example="`chain=4`")
    if chain > MAX_CHAIN:
        raise ValueError(
            f"`chain` = {chain} would unroll {chain} collectives into one program; give at "
            f"most {MAX_CHAIN} (the slope needs only 2, e.g. `chain=4`)."
        )
    validate.check_int(repeats, "repeats", example="`repeats=21`")
    p = mesh.size
    x = sharded_ones(mesh, max(nbytes // 4 // p, 1) * p * 4)  # whole float32 words, p | words
    calls: dict[str, tuple[Callable, tuple]] = {"noop": (_smap(mesh, lambda x: x + 1), (x,))}
    for kind in kinds:
        for count in (1, chain):
            calls[f"{kind}x{count}"] = (_chain_program(mesh, kind, count), (x,))
    t = benchmark.median_times(calls, repeats=repeats)
    return t["noop"], {k: (t[f"{k}x1"], t[f"{k}x{chain}"]) for k in kinds}


def chain_latency(one_s: float, chain_s: float, *, chain: int) -> float:
    """One collective's latency from `collective_chain_times`: `(chain_s − one_s)/(chain − 1)`,
    the slope of a program's time in its number of dependent collectives, each with the
    small elementwise step that keeps XLA from merging them (0 if the longer program was
    not slower). `chain` is the one those times were measured with (>= 2); the
    times are positive seconds."""
    for name, value in (("one_s", one_s), ("chain_s", chain_s)):
        validate.check_real(value, name, low=0.0, low_open=True, hint="a measured time")
    chain = validate.check_int(chain, "chain", minimum=2, example="`chain=4`")
    return max((chain_s - one_s) / (chain - 1), 0.0)


SMALL_MESSAGE = 16 * 1024
"""Messages up to this size measure latency (α); larger ones measure bandwidth (β)."""


def fit_link(points: Iterable[tuple[float, float]], *, keep_points: bool = False) -> Link:
    """Hockney parameters from `(bytes, seconds)` points, the way ping-pong benchmarks
    read them: α is the median time of the small messages (≤ `SMALL_MESSAGE`), β the median
    of `n / (t − α)` over the larger ones that took longer than α (inf if none did). A
    least-squares line through all points would let
    the largest messages set α (often to a negative value) and misprice everything else.

    Each point is a pair of numbers, bytes and seconds, both finite and >= 0. With
    `keep_points`, the link also keeps a curve (`Link.points`), so that `Link.send` reads a
    message's time off it: α at `SMALL_MESSAGE` (every smaller message costs α, the median
    of the small ones, not one size's few noisy calls), then each larger size at the median
    of its times."""
    validate.check_bool(keep_points, "keep_points")
    pts = check_points(points)
    small = [t for n, t in pts if n <= SMALL_MESSAGE]
    big = [(n, t) for n, t in pts if n > SMALL_MESSAGE]
    if not small or not big:
        raise ValueError(
            f"`points` needs messages both <= and > {SMALL_MESSAGE} bytes (α from "
            f"the small ones, β from the large), got sizes "
            f"{sorted({n for n, _ in pts})}; measure both, e.g. at "
            f"`message_sizes(...)`."
        )
    alpha = max(statistics.median(small), 0.0)
    # A large message no slower than α says nothing about β (noise, or a transfer too fast
    # to see at this size); if none is slower, the transfer is unresolved: β = inf.
    rates = [n / (t - alpha) for n, t in big if t > alpha]
    beta = statistics.median(rates) if rates else float("inf")
    if not keep_points:
        return Link(alpha_s=alpha, beta_Bps=beta)
    by_size: dict[float, list[float]] = {}
    for n, t in big:
        by_size.setdefault(n, []).append(t)
    larger = [(n, statistics.median(ts)) for n, ts in sorted(by_size.items())]
    curve = ((SMALL_MESSAGE, alpha), *larger)
    return Link(alpha_s=alpha, beta_Bps=beta, points=curve)


def check_points(points: Any) -> list[tuple[float, float]]:
    """`fit_link`'s points as a list of `(bytes, seconds)`, each checked by name."""
    eg = "[(1024, 2e-5), (2**20, 1e-4)]"
    if isinstance(points, str | bytes) or not isinstance(points, Iterable):
        raise TypeError(
            f"`points` must be an iterable of (bytes, seconds) pairs, e.g. {eg}, "
            f"got {validate.describe(points)}."
        )
    out = []
    for i, point in enumerate(points):
        if not isinstance(point, tuple | list) or len(point) != 2:
            raise TypeError(
                f"`points[{i}]` must be a (bytes, seconds) pair, e.g. {eg}, got "
                f"{validate.describe(point)}."
            )
        n = validate.check_real(point[0], f"points[{i}][0]", low=0.0, hint="message bytes")
        t = validate.check_real(
            point[1], f"points[{i}][1]", low=0.0, hint="seconds, a measured time"
        )
        out.append((n, t))
    return out


def message_sizes(block_bytes: Iterable[int], points: int = 6) -> tuple[int, ...]:
    """Small messages for α, then `points` sizes spanning the given transfer sizes (from half
    the smallest to twice the largest) for β: the links are measured where they will be used.
    `block_bytes`: a non-empty sequence of positive ints; `points >= 1`."""
    blocks = validate.check_sizes_list(block_bytes, "block_bytes", "[2**20, 2**23]")
    validate.check_int(points, "points", example="`points=6`")
    lo, hi = max(min(blocks) // 2, 2 * SMALL_MESSAGE), 2 * max(blocks)
    big = np.geomspace(lo, hi, points).astype(int) // 4 * 4
    return (1024, 4096, SMALL_MESSAGE, *sorted(set(big.tolist())))


def local_calls(
    mesh: Mesh, problem: benchmark.Problem, seed: int = 0
) -> dict[str, tuple[Callable, tuple]]:
    """The two programs `measure_local` times, as `name -> (fn, args)` for `median_time` or
    `benchmark.median_times`: "kernel", the xla kernel on every device's shard of the
    problem's K/V (sharded along the sequence over all the mesh's axes; no collective), and
    "copy", a fresh copy of every device's K shard (`at[].set` on an argument writes a new
    buffer, read and written in full: the copy the scan ring makes of its block each step).
    """
    q, k, v = benchmark.make_inputs(problem, seed)
    axes = tuple(mesh.axis_names)
    spec = kv_spec(axes)
    kvs = NamedSharding(mesh, spec)
    local = jax.jit(
        jax.shard_map(
            lambda q, k, v: kernels.xla_state(q, k, v).out,
            mesh=mesh,
            in_specs=(P(), spec, spec),
            out_specs=P(axes),
            check_vma=False,
        )
    )
    args = (
        jax.device_put(q, NamedSharding(mesh, P())),
        jax.device_put(k, kvs),
        jax.device_put(v, kvs),
    )
    copy = jax.jit(
        jax.shard_map(lambda k: k.at[:, :1].set(0), mesh=mesh, in_specs=(spec,), out_specs=spec)
    )
    return {"kernel": (local, args), "copy": (copy, args[1:2])}


def _fold_loop(mesh: Mesh, steps: int, kv_heads: int, windows: bool) -> Callable:
    """`fold_loop_times`' program: `steps` folds in one `lax.scan` on every device."""
    axes = tuple(mesh.axis_names)
    spec = kv_spec(axes)
    perm = ring_permutation(mesh, axes)
    hs, start, _, _ = pass_q_blocks(kv_heads, mesh.size)
    starts = jnp.asarray(start, jnp.int32)

    def body(q, k, v):
        B, Tq, Hq, _ = q.shape
        heads = hs * (Hq // kv_heads) if windows else Hq
        q = q[:, :, :heads]

        def step(carry, i):
            state, q_blk = carry
            scaled = q_blk * (1 + i).astype(q.dtype)
            if windows:
                q_next = lax.ppermute(q_blk, axes, perm)
                block = kernels.xla_state(scaled, k, v, kv_head_window=(starts[i], hs))
            else:
                q_next = q_blk
                block = kernels.xla_state(scaled, k, v)
            return (combine_core(state, block), q_next), None

        state = identity_core(B, Tq, heads, v.shape[-1], accum_dtype(q.dtype))
        (state, q_last), _ = lax.scan(step, (state, q), jnp.arange(steps))
        # The last block received is an output too: else, in the one-step program, the
        # permute's result would be dead and XLA free to drop the permute.
        return state.out, q_last

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), spec, spec),
            out_specs=(P(axes), P(axes)),
            check_vma=False,
        )
    )


def check_sharded_problems(problems: tuple, name: str, p: int, eg: str) -> None:
    """Each of `problems` a `benchmark.Problem` whose `seq_len` shards evenly over `p`
    devices; else an error naming `name[i]` and quoting `eg`."""
    for i, prob in enumerate(problems):
        validate.check_instance(prob, benchmark.Problem, f"{name}[{i}]", eg)
        if prob.seq_len % p:
            raise ValueError(
                f"`{name}[{i}].seq_len` = {prob.seq_len} is not a multiple of the {p} "
                f"devices; give lengths that shard evenly, e.g. {eg}."
            )


def check_fold_problems(problems: Any, p: int) -> tuple[benchmark.Problem, ...]:
    """`problems` for a fold curve on `p` devices, as a tuple: at least two
    `benchmark.Problem`s, each `seq_len` a multiple of `p`, their shards of different sizes
    (a curve needs two points with increasing sizes); else an error naming the entry."""
    eg = "calibrate.fold_problems(problem, p, seq_lens)"
    if isinstance(problems, benchmark.Problem) or not isinstance(problems, Iterable):
        raise TypeError(
            f"`problems` must be a sequence of benchmark.Problem, e.g. {eg}, got "
            f"{validate.describe(problems)}."
        )
    problems = tuple(problems)
    check_sharded_problems(problems, "problems", p, eg)
    shards = [prob.kv_bytes // p for prob in problems]
    if len(set(shards)) < 2 or len(set(shards)) < len(shards):
        raise ValueError(
            f"`problems` must hold at least two shards of different sizes (a curve of "
            f"points), got shards of {shards} bytes; e.g. {eg}."
        )
    return problems


def fold_loop_times(
    mesh: Mesh,
    problems: Iterable[benchmark.Problem],
    *,
    repeats: int = 5,
    windows: bool = False,
) -> list[tuple[int, float]]:
    """`(bytes read per device, seconds)` of one fold inside a compiled loop, for each
    problem's shard (sharded along the sequence over all of `mesh`'s axes), every device
    folding at once: the rings' local work (`predict.fold_time`).

    Each device runs a `lax.scan` that folds into a running state (the xla kernel and
    `combine_core`), p = `mesh.size` times in one program and once in another; a fold costs
    `(t_p − t_1)/(p − 1)`, which leaves out the call's dispatch and the loop's set-up. Each
    step scales the queries by its index, so that no step is the same computation as
    another and XLA cannot hoist the fold out of the loop. No K/V transfer: those are
    `ringlink.ring_pass_times`' (with `windows=True` each step permutes its query block, below).

    * `windows=False` (`Topology.fold_points`): every step folds the whole shard, a block
      the loop touched the step before, as the pass-KV ring folds the block it has just
      received; the bytes are the shard's K and V.
    * `windows=True` (`Topology.window_points`): the pass-Q ring's step without its
      all-to-all and all-gather: step i reads the i-th head window of the shard with a
      query block (`decode.pass_q_blocks`: `ceil(Hkv/p)` kv heads, the kernel reading the
      window in place) and sends that block on to the ring's next device (`ppermute`), the
      block received being the next step's; the bytes are a window's K and V. The permute
      is part of the step because it makes every device wait for the slowest at each step,
      which a loop of folds alone does not (in exploratory runs, not kept, window folds
      timed without it priced the pass-Q ring below its measured time at every length).
    """
    validate.check_int(repeats, "repeats", example="`repeats=5`")
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    problems = _check_fold_args(mesh.size, problems, windows)
    times = benchmark.median_times(fold_loop_calls(mesh, problems, windows=windows), repeats)
    return fold_loop_points(problems, mesh.size, times, windows=windows)


def _check_fold_args(p: Any, problems: Any, windows: Any) -> tuple[benchmark.Problem, ...]:
    """`fold_loop_calls`' and `fold_loop_points`' common checks; the problems as a tuple."""
    validate.check_bool(windows, "windows")
    p = validate.check_int(p, "p", example="`p=mesh.size`")
    if p < 2:
        raise ValueError(
            f"a fold loop over {p} device is timed as the difference of p folds and one, so "
            f"it needs at least 2 devices (a ring of one device has no steps)."
        )
    return check_fold_problems(problems, p)


def fold_loop_calls(
    mesh: Mesh, problems: Iterable[benchmark.Problem], *, windows: bool = False
) -> dict[str, tuple[Callable, tuple]]:
    """`fold_loop_times`' programs, as `name -> (fn, args)` for `benchmark.median_times`:
    for the i-th problem (`check_fold_problems`), "fold i x1" and "fold i xp" (with
    `windows`, "window i x1" and "window i xp"): one fold and p folds. The mesh needs at
    least 2 devices."""
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    problems = _check_fold_args(mesh.size, problems, windows)
    tag, p = ("window" if windows else "fold"), mesh.size
    calls = {}
    for i, problem in enumerate(problems):
        _, args = local_calls(mesh, problem)["kernel"]
        for n, name in ((1, "x1"), (p, "xp")):
            calls[f"{tag} {i} {name}"] = (_fold_loop(mesh, n, problem.kv_heads, windows), args)
    return calls


def fold_loop_points(
    problems: Iterable[benchmark.Problem],
    p: int,
    times: dict[str, float],
    *,
    windows: bool = False,
) -> list[tuple[int, float]]:
    """`fold_loop_times`' points from the medians of `fold_loop_calls`' programs (`times`,
    by their names; others are ignored) on `p` devices: `(bytes per device,
    (t_p − t_1)/(p − 1))` for each problem."""
    problems = _check_fold_args(p, problems, windows)
    tag = "window" if windows else "fold"
    names = [f"{tag} {i} {n}" for i in range(len(problems)) for n in ("x1", "xp")]
    times = check_times(times, names, "fold_loop_calls")
    out = []
    for i, problem in enumerate(problems):
        nbytes = problem.kv_bytes // p
        if windows:
            nbytes = nbytes * pass_q_blocks(problem.kv_heads, p)[0] // problem.kv_heads
        t_1, t_p = times[f"{tag} {i} x1"], times[f"{tag} {i} xp"]
        out.append((nbytes, max(t_p - t_1, 0.0) / (p - 1)))
    return out


def check_times(times: Any, names: Iterable[str], made_by: str) -> dict[str, float]:
    """`times` (medians by program name, as `benchmark.median_times` returns them) holding
    a positive, finite time for each of `names`, the programs `made_by` makes; else an
    error listing the missing names or naming the bad time."""
    if not isinstance(times, dict):
        raise TypeError(
            f"`times` must be a dict of medians by program name (`benchmark.median_times` "
            f"of `{made_by}`'s programs), got {validate.describe(times)}."
        )
    names = list(names)
    missing = [n for n in names if n not in times]
    if missing:
        raise ValueError(
            f"`times` lacks {missing}: time every program of `{made_by}` (by its name), "
            f"e.g. `benchmark.median_times({made_by}(...))`."
        )
    for n in names:
        validate.check_real(times[n], f"times[{n!r}]", low=0.0, low_open=True, hint="seconds")
    return {n: float(times[n]) for n in names}


RESOLVED_SHARE = 0.1
"""A time less the per-call overhead counts as the program's work only where it exceeds
this share of the overhead (`work_time`): medians of a few calls on a shared machine vary
between runs by more than that, so a smaller difference is noise, not work."""


def work_time(time_s: float, overhead_s: float = 0.0) -> tuple[float, bool]:
    """`(seconds, resolved)`: the program's work in a measured `time_s`, `time_s − overhead_s`,
    and whether that difference is resolved, at least `RESOLVED_SHARE` of the overhead and
    the clock's resolution. Where it is not (the program took no longer than a bare call,
    within noise), the whole `time_s` is returned with `resolved=False`: an upper bound on
    the work, so a rate from it is a lower bound, never a near-zero time's absurd rate."""
    validate.check_real(time_s, "time_s", low=0.0, low_open=True, hint="a measured time")
    validate.check_real(overhead_s, "overhead_s", low=0.0, hint="seconds per call")
    floor = max(RESOLVED_SHARE * overhead_s, time.get_clock_info("perf_counter").resolution)
    if time_s - overhead_s >= floor:
        return time_s - overhead_s, True
    return time_s, False


def local_rates(
    problem: benchmark.Problem,
    devices: int,
    kernel_s: float,
    copy_s: float,
    overhead_s: float = 0.0,
) -> tuple[float, float]:
    """`(mem_Bps, copy_Bps)` per device from the times of `local_calls`' two programs: a
    shard's K and V bytes over the kernel's time, and the same bytes (a K shard read and
    written once) over the copy's, each less the per-call `overhead_s` (`work_time`). The
    times are positive seconds, `overhead_s >= 0`; where a time is not resolved above the
    overhead, the rate is over the whole time, a lower bound (`work_time(copy_s,
    overhead_s)[1]` says which)."""
    validate.check_instance(
        problem, benchmark.Problem, "problem", "e.g. benchmark.Problem(seq_len=4096)"
    )
    validate.check_int(devices, "devices", example="`devices=mesh.size`")
    for name, value in (("kernel_s", kernel_s), ("copy_s", copy_s)):
        validate.check_real(value, name, low=0.0, low_open=True, hint="a measured time")
    validate.check_real(overhead_s, "overhead_s", low=0.0, hint="seconds per call")
    shard = problem.kv_bytes / devices
    return (shard / work_time(kernel_s, overhead_s)[0], shard / work_time(copy_s, overhead_s)[0])


def measure_local(
    mesh: Mesh, problem: benchmark.Problem, *, overhead_s: float = 0.0, repeats: int = 7
) -> tuple[float, float]:
    """`(mem_Bps, copy_Bps)` of one device of `mesh` while all of them work at once
    (`local_calls`, each timed by `median_time`, `local_rates`).

    All devices run at once because simulated devices (and the processes of
    `tree_attention_edu.cluster`) share one memory bus.
    """
    calls = local_calls(mesh, problem)
    kernel_s, copy_s = (
        benchmark.median_time(fn, *args, repeats=repeats)
        for fn, args in (calls["kernel"], calls["copy"])
    )
    return local_rates(problem, mesh.size, kernel_s, copy_s, overhead_s)


def fit_local(
    shard_bytes: tuple[float, float], kernel_s: tuple[float, float], overhead_s: float = 0.0
) -> tuple[float, float]:
    """`(mem_Bps, kernel_fixed_s)` of one device from the kernel's times at two shard sizes:
    the slope of time against a shard's K/V bytes is `1/mem_Bps`, its intercept (less the
    per-call `overhead_s`) the fixed part of a kernel call.

    `shard_bytes`: two increasing positive sizes; `kernel_s`: their measured times. Where
    noise makes the slope non-positive, the two sizes say nothing about a fixed part: the
    larger size's rate is returned, with no fixed part."""
    eg = "(2**20, 2**24)"
    for i in (0, 1):
        validate.check_real(shard_bytes[i], f"shard_bytes[{i}]", low=0.0, low_open=True, hint=eg)
        validate.check_real(kernel_s[i], f"kernel_s[{i}]", low=0.0, low_open=True, hint="seconds")
    validate.check_real(overhead_s, "overhead_s", low=0.0, hint="seconds per call")
    (b0, b1), (t0, t1) = shard_bytes, kernel_s
    if not b1 > b0:
        raise ValueError(f"`shard_bytes` must increase, e.g. {eg}, got {shard_bytes}.")
    slope = (t1 - t0) / (b1 - b0)
    if slope <= 0:
        return b1 / work_time(t1, overhead_s)[0], 0.0
    return 1 / slope, max(t0 - overhead_s - b0 * slope, 0.0)


def measure_local_affine(
    mesh: Mesh,
    problems: tuple[benchmark.Problem, benchmark.Problem],
    *,
    overhead_s: float = 0.0,
    repeats: int = 7,
) -> tuple[float, float, float]:
    """`(mem_Bps, kernel_fixed_s, copy_Bps)` of one device of `mesh` while all of them work
    at once: the xla kernel timed at the two problems' shards (shorter first), the two times
    fitted by `fit_local`, and the copy rate at the longer one (`local_rates`)."""
    times = benchmark.median_times(local_affine_calls(mesh, problems), repeats=repeats)
    return fit_local_affine(problems, mesh.size, times, overhead_s)


def check_affine_problems(problems: Any) -> tuple[benchmark.Problem, benchmark.Problem]:
    """Two `benchmark.Problem`s whose caches grow, shorter first (`measure_local_affine`'s
    line runs through them); else an error naming `problems`."""
    eg = "(Problem(seq_len=3072), Problem(seq_len=49152))"
    if not (isinstance(problems, tuple | list) and len(problems) == 2):
        raise TypeError(
            f"`problems` must be a pair of benchmark.Problem, shorter first, e.g. {eg}, got "
            f"{validate.describe(problems)}."
        )
    for i, prob in enumerate(problems):
        validate.check_instance(prob, benchmark.Problem, f"problems[{i}]", eg)
    if not problems[0].kv_bytes < problems[1].kv_bytes:
        raise ValueError(
            f"`problems` must hold a shorter cache first, got {problems[0].kv_bytes} then "
            f"{problems[1].kv_bytes} bytes of K and V; e.g. {eg}."
        )
    return problems[0], problems[1]


def local_affine_calls(
    mesh: Mesh, problems: tuple[benchmark.Problem, benchmark.Problem]
) -> dict[str, tuple[Callable, tuple]]:
    """`measure_local_affine`'s programs, as `name -> (fn, args)` for
    `benchmark.median_times`: the kernel at both problems ("kernel0", "kernel1") and the
    copy at the longer one ("copy1"), from `local_calls`. `problems`: shorter first."""
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    short, long = (local_calls(mesh, prob) for prob in check_affine_problems(problems))
    return {"kernel0": short["kernel"], "kernel1": long["kernel"], "copy1": long["copy"]}


def fit_local_affine(
    problems: tuple[benchmark.Problem, benchmark.Problem],
    devices: int,
    times: dict[str, float],
    overhead_s: float = 0.0,
) -> tuple[float, float, float]:
    """`(mem_Bps, kernel_fixed_s, copy_Bps)` from the medians of `local_affine_calls`'
    programs (`times`, by their names) on `devices` devices: `fit_local` on the kernel's two
    times, `local_rates` for the copy at the longer problem."""
    lo, hi = check_affine_problems(problems)
    devices = validate.check_int(devices, "devices", example="`devices=mesh.size`")
    times = check_times(times, ("kernel0", "kernel1", "copy1"), "local_affine_calls")
    shard = (lo.kv_bytes / devices, hi.kv_bytes / devices)
    mem_Bps, fixed = fit_local(shard, (times["kernel0"], times["kernel1"]), overhead_s)
    _, copy_Bps = local_rates(hi, devices, times["kernel1"], times["copy1"], overhead_s)
    return mem_Bps, fixed, copy_Bps
