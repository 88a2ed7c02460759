"""Side-by-side measurements of the decode methods: latency, bytes on the wire, temp memory, error.

Every figure comes from one run on the same data: latency is the median of `repeats`
timed calls after a compile-and-warm-up call (`block_until_ready`), bytes and temp memory
come from the compiled program (`introspect`), and the error is against single-device
attention in float64 on the same inputs.

Methods:

* `single`: `jax.nn.dot_product_attention` on one device (what a user would pick);
* `single_kernel`: this package's own streaming kernel on one device (`tree_decode` on a
  one-device mesh: one local state, no collective). On XLA:CPU `single` materialises the
  scores, so this is the stronger one-device baseline at long Tk; any speedup of the
  sharded methods is stated against the better of the two (`best_single`);
* `tree`, `tree_energy`, `ring`, `ring_pass_q`: this package's sequence-parallel decoders
  (`ring` is the `lax.scan` ring with one K/V block in flight; `tree_energy` is the
  streaming energy path, `jax.grad` of the distributed energy; `ring_pass_q` passes the
  queries and leaves K/V in place);
* `xla_auto`: plain `jax.nn.dot_product_attention` under `jax.jit` with K/V carrying a
  sequence `NamedSharding` and no `shard_map`: what XLA's partitioner does on its own.

Patterns (`PATTERNS`): each merge pattern of `tree_decode` (`core.names.MERGE_NAMES`) and both
rings, by name; `patternbench.bench_patterns` measures them in one run, next to the cost
model's prediction. `method_fns` builds every method and pattern: the one registry.

`median_times` interleaves the repeats of several methods, so that noise hits them alike
(`interleaved_times` keeps every timed round's times, after its `warmup` untimed rounds;
each round's order is drawn from a fixed seed); `median_time` is the same helper for one
function. `pattern_calls` builds the model check's programs, every pattern at every length,
its arguments checked by `check_pattern_cells`.

The device (`device_info`): its platform and kind, the JAX version, the published HBM peak of
the kind where known (`nominal_hbm_gbs`) and the read bandwidth measured on it
(`device_read_gbs`); `device_fractions` puts each kernel's effective bandwidth against both.
"""

from __future__ import annotations

import functools
import os
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import inputs, validate
from ..core.decode import (
    kv_spec,
    ring_decode,
    ring_decode_pass_q,
    tree_decode,
    tree_decode_from_energy,
)
from ..core.devices import pad_cache
from ..core.names import MERGE_NAMES, MergeName, Method
from ..core.names import METHODS as DECODE_METHODS
from ..core.reference import attention
from .introspect import CollectiveStats, collective_stats, memory_stats
from .patterns import RINGS, RingName

BenchMethod = Method | Literal["single_kernel", "xla_auto"]
"""A row of `run`: a way to decode (`core.names.Method`), or one of the benchmark's own
baselines."""
METHODS: tuple[BenchMethod, ...] = (
    DECODE_METHODS[0],
    "single_kernel",
    *DECODE_METHODS[1:],
    "xla_auto",
)
"""What `run` (the demo and `bench`) measures, by name: every way to decode of
`core.names.METHODS` ("single" is `jax.nn.dot_product_attention` on one device), and two
rows of the benchmark's own: "single_kernel" (the package's streaming kernel on one device,
the strongest one-device baseline) and "xla_auto" (the same call as "single" with K/V
sequence-sharded and no `shard_map`: what XLA's partitioner does on its own)."""
ONE_DEVICE: tuple[BenchMethod, ...] = ("single", "single_kernel")
"""The one-device baselines: a speedup is stated against the faster of them (`best_single`)."""
PATTERNS: tuple[MergeName | RingName, ...] = (*MERGE_NAMES, *RINGS)
"""What `patternbench.bench_patterns` and `validate_patterns` measure: each
`tree_decode(merge=...)` (`core.names.MERGE_NAMES`), then both rings."""


@dataclass(frozen=True)
class Problem:
    """Decode problem sizes.

    q is `[batch, q_len, q_heads, head_dim]`; k and v are `[batch, seq_len, kv_heads, head_dim]`.
    Every size is a positive int, `kv_heads` divides `q_heads`, and `dtype` is a floating
    dtype (a name such as "bfloat16", or the dtype).
    """

    seq_len: int = 65536
    batch: int = 1
    q_len: int = 1
    q_heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("seq_len", "batch", "q_len", "q_heads", "kv_heads", "head_dim"):
            validate.check_int(getattr(self, name), name, example=f"`Problem({name}=8)`")
        inputs.check_head_groups(self.q_heads, self.kv_heads)
        validate.check_float_dtype(self.dtype)

    @property
    def kv_bytes(self) -> int:
        item = jnp.dtype(self.dtype).itemsize
        return 2 * self.batch * self.seq_len * self.kv_heads * self.head_dim * item


@dataclass
class Record:
    """One method at one size. Field names are the bench JSON's."""

    method: str
    devices: int
    seq_len: int
    median_s: float
    collective_bytes: int
    temp_bytes: int
    max_abs_err: float
    collectives: str = ""  # e.g. "all-reduce x2" (what XLA chose, for xla_auto)
    argument_bytes: int = 0  # per device: q and this device's K/V shard (total = this + temp)

    def as_json(self) -> dict:
        return asdict(self)


def make_inputs(problem: Problem, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random `(q, k, v)` as host numpy arrays, from an explicit seed (0 to 2**63 - 1)."""
    validate.check_instance(problem, Problem, "problem", "e.g. Problem(seq_len=4096)")
    _check_seed(seed)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    dt = jnp.dtype(problem.dtype)
    b, t, hkv, d = problem.batch, problem.seq_len, problem.kv_heads, problem.head_dim
    shapes = ((b, problem.q_len, problem.q_heads, d), (b, t, hkv, d), (b, t, hkv, d))
    q, k, v = (
        np.asarray(jax.random.normal(key, shape, jnp.float32).astype(dt))
        for key, shape in zip((kq, kk, kv), shapes, strict=True)
    )
    return q, k, v


def _check_seed(seed: int) -> None:
    validate.check_int(seed, "seed", minimum=0, example="`seed=0`")
    if seed > 2**63 - 1:  # jax.random.key takes a C long
        raise ValueError(
            f"`seed` = {seed} is more than the largest PRNG seed, 2**63 - 1; "
            f"pass a smaller one, e.g. `seed % 2**63`."
        )


def _check_repeats(repeats: int) -> None:
    validate.check_int(repeats, "repeats", example="`repeats=5` (a median needs one time)")


def median_time(fn: Callable, *args, repeats: int = 5) -> float:
    """Median wall time of `fn(*args)` over `repeats` timed calls, each after an untimed one
    (`median_times` of one function)."""
    validate.check_callable(fn, "fn", "the function to time")
    return median_times({"fn": (fn, args)}, repeats=repeats)["fn"]


# Published peak HBM bandwidth, GB/s, by substrings of `jax.Device.device_kind` (lower-case;
# every substring of a row must occur; the first matching row wins, so the specific rows come
# first). Sources, vendors' datasheets:
# - H100 SXM5 3.35 TB/s, H100 PCIe 2 TB/s, H100 NVL 3.9 TB/s: nvidia.com/en-us/data-center/h100/
# - H200 4.8 TB/s: nvidia.com/en-us/data-center/h200/
# - A100 40GB 1,555 GB/s, 80GB PCIe 1,935 GB/s, 80GB SXM 2,039 GB/s: the A100 datasheet,
#   nvidia.com/en-us/data-center/a100/ (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)
# - B200 8 TB/s per GPU: HGX B200 datasheet, nvidia.com/en-us/data-center/hgx/
# - MI300X 5.3 TB/s: amd.com/en/products/accelerators/instinct/mi300/mi300x.html
# GH200 ships with HBM3 (4 TB/s) or HBM3e (4.9 TB/s) under similar names: left unknown.
NOMINAL_HBM_GBS: tuple[tuple[tuple[str, ...], float | None], ...] = (
    (("gh200",), None),
    (("h200",), 4800.0),
    (("h100", "nvl"), 3900.0),
    (("h100", "pcie"), 2000.0),
    (("h100",), 3350.0),
    (("a100", "80gb", "pcie"), 1935.0),
    (("a100", "pcie", "80gb"), 1935.0),
    (("a100", "80gb"), 2039.0),
    (("a100",), 1555.0),
    (("b200",), 8000.0),
    (("mi300x",), 5300.0),
)
DEVICE_READ_BYTES = {"cpu": 256 * 2**20}
"""Array size of `device_read_gbs` per platform; others (GPUs) default to 2 GiB, far past
every cache."""


def nominal_hbm_gbs(kind: str) -> float | None:
    """Published peak HBM bandwidth in GB/s of a device kind (`jax.Device.device_kind`, such
    as "NVIDIA H100 80GB HBM3"), or None when the kind is not in `NOMINAL_HBM_GBS` (CPUs)."""
    low = str(kind).lower()
    for parts, gbs in NOMINAL_HBM_GBS:
        if all(p in low for p in parts):
            return gbs
    return None


def device_read_gbs(nbytes: int | None = None, *, repeats: int = 7, device=None) -> float:
    """Read bandwidth of `device` (default: the first) in GB/s: a jitted `jnp.sum` over a
    float32 array of `nbytes` that lives on it, median of `repeats` calls after a warm-up
    (`median_time`). A reduction reads each byte once and writes nothing, as a decode step
    does. The array is 256 MiB on CPU and 2 GiB elsewhere unless `nbytes` says otherwise.

    This measures the device through XLA, the figure a kernel on that device can be held
    to (on CPU, the simulated devices share this bus).
    """
    _check_repeats(repeats)
    reader = DeviceReader(nbytes, device)
    seconds = median_time(reader.fn, reader.x, repeats=repeats)
    return reader.x.nbytes / seconds / 1e9


class DeviceReader:
    """A float32 array of `nbytes` on `device` (default: the first; 256 MiB on CPU, 2 GiB
    elsewhere) and a jitted `jnp.sum` that reads it: `gbs()` times one read."""

    def __init__(self, nbytes: int | None = None, device=None):
        if nbytes is not None:
            validate.check_int(nbytes, "nbytes", example="`nbytes=2**28` (None: the default)")
        if device is not None:
            validate.check_instance(device, jax.Device, "device", "e.g. jax.devices()[0]")
        device = jax.devices()[0] if device is None else device
        if nbytes is None:
            nbytes = DEVICE_READ_BYTES.get(device.platform, 2 * 2**30)
        self.x = jax.device_put(jnp.ones((max(int(nbytes) // 4, 1),), jnp.float32), device)
        self.fn = jax.jit(jnp.sum)
        jax.block_until_ready(self.fn(self.x))

    def gbs(self) -> float:
        """One timed read, in GB/s."""
        t0 = time.perf_counter()
        jax.block_until_ready(self.fn(self.x))
        return self.x.nbytes / (time.perf_counter() - t0) / 1e9


def device_info(measure: bool = True, *, nbytes: int | None = None, repeats: int = 7) -> dict:
    """The bench JSON's `"device"` block for the first device:
    `{"platform", "kind", "jax_version", "nominal_gbs", "measured_gbs"}`.

    `nominal_gbs` is the published HBM peak of the kind (None where unknown, as on CPU);
    `measured_gbs` is `device_read_gbs` (None with `measure=False`).
    """
    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "kind": dev.device_kind,
        "jax_version": jax.__version__,
        "nominal_gbs": nominal_hbm_gbs(dev.device_kind),
        "measured_gbs": device_read_gbs(nbytes, repeats=repeats, device=dev) if measure else None,
    }


def device_fractions(kernels: dict, device: dict) -> dict:
    """Add to each kernel record (a dict with `"gbs"`) its fraction of the device's measured
    read bandwidth (`"frac_measured"`) and of its nominal HBM peak (`"frac_nominal"`, None
    where the peak is unknown). Changes and returns `kernels`."""
    measured, nominal = device.get("measured_gbs"), device.get("nominal_gbs")
    for rec in kernels.values():
        rec["frac_measured"] = rec["gbs"] / measured if measured else None
        rec["frac_nominal"] = rec["gbs"] / nominal if nominal else None
    return kernels


def describe(stats: CollectiveStats) -> str:
    counts: dict[str, int] = {}
    for c in stats.collectives:
        counts[c.kind] = counts.get(c.kind, 0) + c.count
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items())) or "none"


def method_fns(
    mesh: Mesh, kv_len: int | None = None, names: Iterable[str] | None = None
) -> dict[str, tuple[Callable, tuple]]:
    """Each method (`METHODS`) and pattern (`PATTERNS`) as a jitted `fn(q, k, v)` and the
    shardings of its `(q, k, v)`: the one registry of what is measured.

    `kv_len`: the sharded methods' K/V carry padding after this many keys (so that their
    length is a multiple of the device count, `pad_cache`) and mask it; `None`: no padding.
    `names`: a list of method names (default: all).
    """
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    if kv_len is not None:
        validate.check_int(kv_len, "kv_len", example="`kv_len=4096` (None: no padding)")
    if isinstance(names, str):
        raise TypeError(
            f"`names` must be a list of method names, got the str {names!r}; "
            f"pass a list, e.g. `[{names!r}]`."
        )
    rep = NamedSharding(mesh, P())
    kv = NamedSharding(mesh, kv_spec(tuple(mesh.axis_names)))
    one_mesh = Mesh(np.array(mesh.devices).ravel()[:1], ("one",))
    one = NamedSharding(one_mesh, P())
    dpa = jax.nn.dot_product_attention

    def lengths(q):  # a trace-time constant, or None when there is no padding
        return None if kv_len is None else jnp.full((q.shape[0],), kv_len, jnp.int32)

    def sharded(decode: Callable, **kw) -> tuple[Callable, tuple]:
        return (
            jax.jit(lambda q, k, v: decode(q, k, v, mesh=mesh, kv_lengths=lengths(q), **kw)),
            (rep, kv, kv),
        )

    builders: dict[str, Callable[[], tuple[Callable, tuple]]] = {
        "single": lambda: (jax.jit(dpa), (one, one, one)),
        # The unpadded cache on one device: nothing to mask, no collective.
        "single_kernel": lambda: (
            jax.jit(lambda q, k, v: tree_decode(q, k, v, mesh=one_mesh)),
            (one, one, one),
        ),
        "tree": lambda: sharded(tree_decode),
        "tree_energy": lambda: sharded(tree_decode_from_energy),
        "ring": lambda: sharded(ring_decode),
        "ring_pass_q": lambda: sharded(ring_decode_pass_q),
        "xla_auto": lambda: (
            jax.jit(
                lambda q, k, v: dpa(q, k, v, key_value_seq_lengths=lengths(q)),
                in_shardings=(rep, kv, kv),
                out_shardings=rep,
            ),
            (rep, kv, kv),
        ),
        **{m: functools.partial(sharded, tree_decode, merge=m) for m in MERGE_NAMES},
    }
    names = (
        list(builders)
        if names is None
        else validate.check_sequence(names, "names", "method names", '["tree", "ring"]')
    )
    for i, n in enumerate(names):
        validate.check_str_choice(n, tuple(builders), f"names[{i}]")
    return {n: builders[n]() for n in names}


def sharded_inputs(
    mesh: Mesh, problem: Problem, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int | None]:
    """`(q, k, v, k_padded, v_padded, kv_len)`: the problem's inputs, and K/V padded once to
    a multiple of the device count (`pad_cache`) for the sharded methods, with the valid
    length to mask (None when no padding was needed)."""
    q, k, v = make_inputs(problem, seed)
    kp, vp, _ = pad_cache(jnp.asarray(k), jnp.asarray(v), mesh)
    padded = kp.shape[1] != problem.seq_len
    return q, k, v, np.asarray(kp), np.asarray(vp), problem.seq_len if padded else None


def run(
    mesh: Mesh,
    problem: Problem,
    *,
    methods: Iterable[str] = METHODS,
    repeats: int = 5,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[Record]:
    """Measure each method on the same inputs; see the module docstring for what is measured."""
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    validate.check_instance(problem, Problem, "problem", "e.g. Problem(seq_len=4096)")
    _check_repeats(repeats)
    if progress is not None:
        validate.check_callable(progress, "progress", "called with each method's name")
    if isinstance(methods, str):
        raise TypeError(
            f"`methods` must be a list of method names, got the str {methods!r}; "
            f"pass a list, e.g. `[{methods!r}]`."
        )
    q, k, v, kp, vp, kv_len = sharded_inputs(mesh, problem, seed)
    want = np.asarray(attention(*(jnp.asarray(x, jnp.float64) for x in (q, k, v))))
    sharded_qkv = (q, kp, vp)
    methods = list(methods)
    fns = method_fns(mesh, kv_len, methods)
    records = []
    for name in methods:
        if progress:
            progress(name)
        fn, shardings = fns[name]
        qkv = (q, k, v) if name in ONE_DEVICE else sharded_qkv
        args = [jax.device_put(x, s) for x, s in zip(qkv, shardings, strict=True)]
        structs = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(qkv, shardings, strict=True)
        ]
        stats = collective_stats(fn, *structs)
        mem = memory_stats(fn, *structs)
        got = np.asarray(fn(*args), np.float64)
        records.append(
            Record(
                method=name,
                devices=1 if name in ONE_DEVICE else mesh.size,
                seq_len=problem.seq_len,
                median_s=median_time(fn, *args, repeats=repeats),
                collective_bytes=stats.total_bytes,
                temp_bytes=mem.temp_bytes,
                max_abs_err=float(np.abs(got - want).max()),
                collectives=describe(stats),
                argument_bytes=mem.argument_bytes,
            )
        )
        del args
    return records


def best_single(records: list[Record], seq_len: int) -> Record | None:
    """The faster one-device baseline (`ONE_DEVICE`) measured at `seq_len`, or None."""
    ones = [r for r in records if r.method in ONE_DEVICE and r.seq_len == seq_len]
    return min(ones, key=lambda r: r.median_s, default=None)


def speedup_line(records: list[Record], method: str = "tree") -> str:
    """One line per length: `method` against the better one-device baseline, with what a
    ratio measured on simulated devices can and cannot mean. Empty when either is missing."""
    lines = []
    for r in records:
        best = best_single(records, r.seq_len)
        if r.method != method or best is None:
            continue
        cores = os.cpu_count() or 1
        lines.append(
            f"   Tk={r.seq_len}: {method} on {r.devices} devices vs the better one-device "
            f"baseline ({best.method}, {best.median_s * 1e3:.1f} ms): "
            f"{best.median_s / r.median_s:.2f}x"
            + (
                f". The {r.devices} devices are simulated on {cores} CPU cores that they "
                "share: this is not a parallel speedup (bytes, memory and the compiled "
                "collectives are what simulated devices show)"
                if jax.devices()[0].platform == "cpu"
                else ""
            )
        )
    return "\n".join(lines)


def table(records: list[Record]) -> str:
    """A fixed-width table of records, with latency ratios to `tree` at the same size."""
    tree_at = {r.seq_len: r for r in records if r.method == "tree"}
    head = (
        f"{'method':<12}{'devices':>8}{'seq_len':>9}{'median ms':>11}{'vs tree':>9}"
        f"{'bytes/dev':>14}{'temp MB/dev':>13}{'max |err|':>11}  collectives"
    )
    rows = [head, "-" * len(head)]
    for r in records:
        ref = tree_at.get(r.seq_len)
        ratio = f"{r.median_s / ref.median_s:.2f}x" if ref else ""
        rows.append(
            f"{r.method:<12}{r.devices:>8}{r.seq_len:>9}{r.median_s * 1e3:>11.1f}"
            f"{ratio:>9}{r.collective_bytes:>14,}{r.temp_bytes / 1e6:>13.1f}"
            f"{r.max_abs_err:>11.1e}  {r.collectives}"
        )
    return "\n".join(rows)


# --- timing ---------------------------------------------------------------------------------


def check_pattern_cells(
    mesh: Mesh, problem: Problem, seq_lens: Iterable[int], methods: Iterable[str], name: str
) -> tuple[list[int], list[MergeName | RingName]]:
    """`(seq_lens, methods)` of a run of patterns and rings (`pattern_calls`), checked by
    name (`name`: the problem argument's): a mesh, a `Problem`, positive lengths and names
    of `PATTERNS`."""
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    validate.check_instance(problem, Problem, name, "modelcheck.PROBLEM")
    seq_lens = validate.check_sizes_list(seq_lens, "seq_lens", "(4096, 16384, 65536)")
    methods = validate.check_sequence(
        methods, "methods", "pattern or ring names", '("allreduce", "ring")'
    )
    for i, m in enumerate(methods):
        validate.check_str_choice(m, PATTERNS, f"methods[{i}]")
    return seq_lens, methods


def pattern_calls(
    mesh: Mesh,
    base: Problem,
    seq_lens: Iterable[int],
    methods: Iterable[MergeName | RingName],
) -> dict[str, tuple[Callable, tuple]]:
    """Every pattern or ring of `methods` (`PATTERNS`) at every length of `seq_lens` on
    `base`'s other sizes, as `"method@length" -> (fn, args)` for `median_times`: each
    length's inputs made once and shared by its methods (the same shardings for all)."""
    seq_lens, methods = check_pattern_cells(mesh, base, seq_lens, methods, "base")
    calls = {}
    for n in dict.fromkeys(seq_lens):
        prob = Problem(**{**asdict(base), "seq_len": n})
        q, _, _, k, v, kv_len = sharded_inputs(mesh, prob)
        fns = method_fns(mesh, kv_len, methods)
        shardings = next(iter(fns.values()))[1]
        args = tuple(jax.device_put(x, s) for x, s in zip((q, k, v), shardings, strict=True))
        calls.update({f"{m}@{n}": (fns[m][0], args) for m in methods})
    return calls


def median_times(calls: dict[str, tuple[Callable, tuple]], repeats: int = 5) -> dict[str, float]:
    """Median wall time of each `fn(*args)` of `calls` (`name -> (fn, args)`), the repeats
    interleaved: `repeats` rounds that time every call once, so that noise from the rest of
    the machine hits every method alike, each round in an order drawn afresh (from a fixed
    seed: the same orders in every run), so that no method follows the same neighbour in
    every round, as a rotation by one would leave it in all but one round of each cycle of
    `len(calls)` rounds. Each timed
    call follows an untimed call of the same method: right after another method (a ring that
    freed hundreds of MB, say) the first call can be twice as slow on the simulated devices,
    which would charge one method for its neighbour."""
    return {n: statistics.median(t) for n, t in interleaved_times(calls, repeats).items()}


def interleaved_times(
    calls: dict[str, tuple[Callable, tuple]], repeats: int = 5, *, warmup: int = 0
) -> dict[str, list[float]]:
    """Every timed call of `median_times`, in rounds: `name -> [seconds per round]`.

    `warmup` rounds, each exactly like a timed one (its own drawn order), run first and are
    not kept: on the cluster the first round right after the programs were compiled was
    slower than the later ones (notebook 9, §9.4, measures it), a cost of starting that a
    mean carries whole. With `warmup=0` the timed rounds' orders are those of every earlier
    run."""
    _check_calls(calls)
    _check_repeats(repeats)
    validate.check_int(warmup, "warmup", minimum=0, example="`warmup=1` (untimed rounds)")
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    orders = random.Random(0)
    for i in range(warmup + repeats):
        for name in orders.sample(names, len(names)):
            fn, args = calls[name]
            jax.block_until_ready(fn(*args))
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _check_calls(calls: dict) -> None:
    """A non-empty dict `name -> (fn, args)`, each `fn` callable and `args` a tuple."""
    eg = '{"tree": (fn, (q, k, v))}'
    if not isinstance(calls, dict):
        raise TypeError(
            f"`calls` must be a dict name -> (fn, args), e.g. {eg}, got {validate.describe(calls)}."
        )
    if not calls:
        raise ValueError(f"`calls` is empty; give at least one, e.g. {eg}.")
    for name, call in calls.items():
        if not (isinstance(call, tuple) and len(call) == 2 and isinstance(call[1], tuple | list)):
            raise TypeError(
                f"`calls[{name!r}]` must be a pair (fn, args) with args a tuple, "
                f"e.g. {eg}, got {validate.describe(call)}."
            )
        validate.check_callable(call[0], f"calls[{name!r}][0]", "the function to time")
