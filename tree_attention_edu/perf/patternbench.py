"""Every merge pattern and both rings side by side, measured in one run, next to the cost
model's prediction (`tree-attention-edu bench --sections patterns`): their collectives and
bytes read from the compiled programs, temp memory, error against float64 attention, and
the median latency of interleaved rounds (`bench_patterns`, `pattern_records_table`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..core import validate
from ..core.names import MergeName
from ..core.reference import attention
from . import benchmark
from .calibrate import Calibration, pattern_calibration, predict
from .introspect import collective_stats, memory_stats
from .patterns import RingName


@dataclass
class PatternRecord:
    """One merge pattern or ring at one size. Field names are the bench JSON's `"patterns"`.

    `collectives`: kind -> how many times it runs, read from the compiled program (loops
    counted with their trip counts); `collective_bytes` their payload per device. For
    `one_pass` both count the fast path only (`CollectiveStats.fast_path`): its exact
    fallback sits in a `conditional` branch that runs only when a device's lse leaves the
    safe window, and `fast_path` is True to say so. `predicted_s` is the cost model's
    latency on the topology measured on this mesh.
    """

    name: str
    devices: int
    seq_len: int
    collectives: dict
    collective_bytes: int
    temp_bytes: int
    median_s: float
    predicted_s: float
    max_abs_err: float
    fast_path: bool = False

    def as_json(self) -> dict:
        return asdict(self)


def bench_patterns(
    mesh: Mesh,
    problem: benchmark.Problem,
    *,
    calibration: Calibration | None = None,
    methods: Iterable[MergeName | RingName] = benchmark.PATTERNS,
    repeats: int = 5,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[PatternRecord]:
    """Every merge pattern and both rings on the same inputs, measured in one run.

    Per method: the collectives and their bytes (`collective_stats`; the fast path for
    `one_pass`), temp memory (`memory_stats`), the error against float64 `attention`, and
    the median latency over `repeats` interleaved rounds (`median_times`). `calibration`
    is a `Calibration` (default: `pattern_calibration` at this size,
    which measures the mesh's links and decode bandwidth first); `predicted_s` is
    `predict` with its topology.
    """
    methods = list(methods)
    for i, m in enumerate(methods):
        validate.check_str_choice(m, benchmark.PATTERNS, f"methods[{i}]")
    if calibration is None:
        calibration = pattern_calibration(
            mesh, [problem.seq_len], problem=problem, repeats=repeats, progress=progress
        )
    q, k0, v0, k, v, kv_len = benchmark.sharded_inputs(mesh, problem, seed)
    want = np.asarray(attention(*(jnp.asarray(x, jnp.float64) for x in (q, k0, v0))))
    built = benchmark.method_fns(mesh, kv_len, methods)
    fns = {n: fn for n, (fn, _) in built.items()}
    shardings = next(iter(built.values()))[1]
    args = tuple(jax.device_put(x, s) for x, s in zip((q, k, v), shardings, strict=True))
    structs = [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        for x, s in zip((q, k, v), shardings, strict=True)
    ]
    static = {}
    for name in methods:
        if progress:
            progress(f"Tk={problem.seq_len} {name}: compile")
        stats = collective_stats(fns[name], *structs)
        if name == "one_pass":
            stats = stats.fast_path()
        counts: dict[str, int] = {}
        for c in stats.collectives:
            counts[c.kind] = counts.get(c.kind, 0) + c.count
        got = np.asarray(fns[name](*args), np.float64)
        static[name] = (
            dict(sorted(counts.items())),
            stats.total_bytes,
            memory_stats(fns[name], *structs).temp_bytes,
            float(np.abs(got - want).max()),
        )
    if progress:
        progress(f"Tk={problem.seq_len}: timing {len(methods)} methods interleaved")
    seconds = benchmark.median_times({n: (fns[n], args) for n in methods}, repeats=repeats)
    records = []
    for name in methods:
        counts, nbytes, temp, err = static[name]
        records.append(
            PatternRecord(
                name=name,
                devices=mesh.size,
                seq_len=problem.seq_len,
                collectives=counts,
                collective_bytes=nbytes,
                temp_bytes=temp,
                median_s=seconds[name],
                predicted_s=predict(name, problem.seq_len, calibration.topology, problem).total_s,
                max_abs_err=err,
                fast_path=name == "one_pass",
            )
        )
    return records


def pattern_records_table(records: list[PatternRecord]) -> str:
    """A fixed-width table of pattern records, with predicted/measured − 1 per row."""
    head = (
        f"{'name':<16}{'devices':>8}{'seq_len':>9}{'median ms':>11}{'predicted':>11}"
        f"{'rel err':>9}{'bytes/dev':>12}{'temp MB/dev':>13}{'max |err|':>11}  collectives"
    )
    rows = [head, "-" * len(head)]
    for r in records:
        kinds = ", ".join(f"{k} x{n}" for k, n in r.collectives.items()) or "none"
        rows.append(
            f"{r.name:<16}{r.devices:>8}{r.seq_len:>9}{r.median_s * 1e3:>11.2f}"
            f"{r.predicted_s * 1e3:>11.2f}{r.predicted_s / r.median_s - 1:>+9.0%}"
            f"{r.collective_bytes:>12,}{r.temp_bytes / 1e6:>13.2f}"
            f"{r.max_abs_err:>11.1e}  {kinds}" + (" (fast path)" if r.fast_path else "")
        )
    return "\n".join(rows)
