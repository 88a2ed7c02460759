"""The cost model's check: predicted against measured latency of every merge pattern and
both rings, over meshes and cache lengths, and the regret of `merge="auto"` with the
calibrated model. `tree-attention-edu calibrate --check` (and `make calibrate`) runs it.

Per mesh, `calibrate.pattern_calibration` measures the machine first (the per-call overhead
and each collective kind's latency from chains of dependent collectives, every kind at
message sizes around the ones the methods send, the local kernel at two lengths that are
not checked, and a fold inside a compiled loop at a tiny block and at 3/4 of each length),
then `calibrate.validate_patterns` times every method at every length in the same
interleaved rounds (11 by default), with the calibration's local programs in those rounds
too (`local=True`: the kernel at its two lengths, a copy and the fold loops, whose rates,
fixed part and curves are fitted from them, `perf.localfit`, and the ring-pass programs,
whose link is fitted from them, `perf.ringlink`), and predicts each cell with that
calibration. Nothing is fitted to the timings being predicted.

`auto`'s regret in a cell compares `picked`, what `best_merge` picks on the calibrated
topology among `core.merges.AUTO_MERGES` (the patterns "auto" chooses from), with each of
them side by side, in `AUTO_REPEATS` interleaved rounds of those patterns alone (after the
cells' rounds): against pattern `m`, the median over rounds of `picked`'s time over `m`'s
in the same round, less 1 (`regret`). The regret is the largest, and `best` the pattern
it is against.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

import jax.numpy as jnp
from jax.sharding import Mesh

from ..core import merges, validate
from ..core.devices import make_mesh
from ..core.names import MERGE_NAMES, MergeName
from ..core.numerics import accum_dtype
from . import benchmark, calibrate
from .crossover import best_merge
from .links import Topology

GRID_SEQ_LENS: tuple[int, ...] = (4096, 16384, 65536)
"""The cache lengths the check measures by default."""
GRID_MESHES: tuple[str, ...] = ("8", "2x4")
"""The meshes the check measures by default: 8 devices on one axis, and 2 x 4."""
PROBLEM = benchmark.Problem(seq_len=GRID_SEQ_LENS[0], q_heads=8, kv_heads=8, head_dim=64)
"""The decode problem of the checked cells (float32, batch 1, as notebook 8's)."""
AUTO_PROBLEMS: tuple[benchmark.Problem, ...] = (
    benchmark.Problem(seq_len=GRID_SEQ_LENS[0], batch=8, q_heads=32, kv_heads=8, head_dim=64),
)
"""More problems for `auto`'s regret, at the shortest length only: batch and heads that move
the tree's payload, and with it the winner, against the local work."""
BAND = calibrate.BAND
"""A cell passes when `|predicted / measured - 1| <= BAND` (`calibrate.BAND`, ±30%)."""
REGRET_BAND = 0.10
"""`auto` passes a cell when its pick is at most this much slower than the best."""
AUTO_REPEATS = 61
"""Interleaved rounds of the patterns `auto` picks among, timed again for its regret: the
model prices them within a few percent of each other at these sizes, less than the
run-to-run spread of a median of the cells' rounds on the 2-core machine
(`results/calibrate/README.md`). A round of them (each call twice: untimed, then timed)
takes about 0.32 to 0.37 s there at the three lengths with batch 1, 20 to 23 s per mesh for
all rounds (estimated from the recorded medians), where one round of the cells takes
several seconds (a ring at Tk = 65,536 alone 0.6 s per call)."""


@dataclass(frozen=True)
class Cell:
    """One method on one mesh at one length: predicted, measured (median) and their
    relative error `predicted / measured - 1`."""

    method: str
    mesh: str
    seq_len: int
    predicted_s: float
    measured_s: float
    rel_err: float


@dataclass(frozen=True)
class AutoRow:
    """`auto`'s pick in one cell against the patterns it could pick, in the same rounds:
    `best` is the one it is slowest against (`regret`), itself where none is faster."""

    mesh: str
    seq_len: int
    batch: int
    q_heads: int
    kv_heads: int
    picked: MergeName
    best: MergeName
    regret: float
    medians_s: dict[str, float] = field(default_factory=dict, compare=False)
    """Each pattern's median over the rounds: a record; the regret pairs the rounds."""


@dataclass
class Report:
    """What `run` measured: the cells, `auto`'s rows, and each mesh's calibration."""

    cells: list[Cell]
    auto: list[AutoRow]
    calibrations: dict[str, calibrate.Calibration]
    band: float = BAND
    regret_band: float = REGRET_BAND

    @property
    def failures(self) -> list[str]:
        """One line per cell outside the band and per `auto` row over the regret band."""
        out = [
            f"{c.method} on {c.mesh} at Tk={c.seq_len}: {c.rel_err:+.0%}"
            for c in self.cells
            if not abs(c.rel_err) <= self.band
        ]
        out += [
            f"auto on {a.mesh} at Tk={a.seq_len}, batch {a.batch}, heads {a.q_heads}/"
            f"{a.kv_heads}: picked {a.picked}, {a.regret:+.0%} slower than {a.best}"
            for a in self.auto
            if not a.regret <= self.regret_band
        ]
        return out

    def as_json(self) -> dict:
        return dict(
            band=self.band,
            regret_band=self.regret_band,
            cells=[asdict(c) for c in self.cells],
            auto=[asdict(a) for a in self.auto],
            calibrations={
                mesh: dict(
                    overhead_s=cal.overhead_s,
                    mem_Bps=cal.mem_Bps,
                    kernel_fixed_s=cal.topology.kernel_fixed_s,
                    copy_Bps=cal.topology.copy_Bps,
                    fold_points=cal.topology.fold_points,
                    window_points=cal.topology.window_points,
                    links={k: asdict(v) for k, v in cal.links.items()},
                    # Each kind's (1, seconds) and (CHAIN, seconds) programs, α's source.
                    chains={k: v for k, v in cal.collective_points.items() if k.endswith(" chain")},
                )
                for mesh, cal in self.calibrations.items()
            },
            failures=self.failures,
        )


def parse_mesh(name: str) -> tuple[int, ...]:
    """ "8" -> (8,), "2x4" -> (2, 4): a mesh's shape from its name."""
    validate.check_instance(name, str, "mesh", 'e.g. "8" or "2x4"')
    parts = name.split("x")
    if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f'`mesh` must be "P" or "NxG" with positive ints, e.g. "2x4", got {name!r}.'
        )
    return tuple(int(p) for p in parts)


def mesh_of(name: str) -> Mesh:
    """The mesh a name stands for: "8" one "x" axis, "2x4" ("node", "gpu")."""
    shape = parse_mesh(name)
    return make_mesh(shape[0], "x") if len(shape) == 1 else make_mesh(shape, ("node", "gpu"))


def pick(topology: Topology, problem: benchmark.Problem, seq_len: int) -> MergeName:
    """What `merge="auto"` picks with the calibrated model: `best_merge` on `topology` among
    `merges.AUTO_MERGES`."""
    return best_merge(
        seq_len,
        topology,
        **calibrate.problem_sizes(problem),
        stat_itemsize=jnp.dtype(accum_dtype(problem.dtype)).itemsize,
        patterns=merges.AUTO_MERGES,
    )


def regret(
    rounds: dict[str, Sequence[float]],
    picked: MergeName,
    among: Sequence[str] = merges.AUTO_MERGES,
) -> tuple[MergeName, float]:
    """`(best, regret)` from interleaved rounds, `rounds[m][r]` the seconds of pattern `m`
    in round `r` (every pattern of `among` timed in every round): `picked`'s slowdown
    against `m` is the median over rounds of `rounds[picked][r] / rounds[m][r]` (with an
    even count, the geometric mean of the middle two), less 1;
    the regret is the largest over `among`, `best` the pattern it is against (`picked`
    itself, with 0.0, where it is not slower than any). Ratios in the same round: a slow
    spell of the host that falls on some rounds slows every pattern of those rounds and
    leaves their ratio, where it can move two medians apart by more than the patterns
    differ."""
    eg = '{"allgather": [1.1e-3, 1.2e-3], "all_to_all": [1.0e-3, 1.3e-3]}'
    if not isinstance(among, list | tuple):
        raise TypeError(f"`among` must be a list or tuple of pattern names, got {among!r}.")
    among = [validate.check_str_choice(m, MERGE_NAMES, f"among[{i}]") for i, m in enumerate(among)]
    if picked not in among:
        raise ValueError(f"`picked` must be one of `among` {among}, got {picked!r}.")
    if not isinstance(rounds, dict):
        raise TypeError(f"`rounds` must be a dict pattern -> seconds per round, e.g. {eg}.")
    missing = [m for m in among if m not in rounds]
    if missing:
        raise ValueError(f"`rounds` lacks {missing}: time every pattern of `among`.")
    for m in among:
        times = validate.check_sequence(rounds[m], f"rounds[{m!r}]", "seconds per round", eg)
        for r, t in enumerate(times):
            validate.check_real(t, f"rounds[{m!r}][{r}]", low=0.0, low_open=True, hint="seconds")
    counts = {m: len(rounds[m]) for m in among}
    if len(set(counts.values())) != 1:
        raise ValueError(
            f"`rounds` must hold the same number of rounds for every pattern of `among` (each "
            f"timed in every round), got {counts}."
        )
    best: MergeName = picked
    worst = 0.0
    for m in among:
        # The median of log-ratios: with an even count of rounds too, m against picked is
        # then exactly the inverse of picked against m.
        logs = [math.log(a / b) for a, b in zip(rounds[picked], rounds[m], strict=True)]
        slow = math.exp(statistics.median(logs))
        if slow - 1 > worst:
            best, worst = m, slow - 1  # type: ignore[assignment]  # checked: a MERGE_NAME
    return best, worst


def _auto_rows(
    mesh: str,
    problem: benchmark.Problem,
    times: dict[str, list[float]],
    seq_lens: Sequence[int],
    topology: Topology,
) -> list[AutoRow]:
    """`AutoRow`s at each of `seq_lens` from `times`, `benchmark.pattern_calls`' names in
    rounds."""
    out = []
    for n in sorted(set(seq_lens)):
        rounds: dict[str, Sequence[float]] = {m: times[f"{m}@{n}"] for m in merges.AUTO_MERGES}
        picked = pick(topology, problem, n)
        best, loss = regret(rounds, picked)
        medians: dict[str, float] = {m: statistics.median(r) for m, r in rounds.items()}
        shape = (problem.batch, problem.q_heads, problem.kv_heads)
        out.append(AutoRow(mesh, n, *shape, picked, best, loss, medians))
    return out


def run(
    meshes: Iterable[str] = GRID_MESHES,
    seq_lens: Iterable[int] = GRID_SEQ_LENS,
    *,
    problem: benchmark.Problem = PROBLEM,
    auto_problems: Iterable[benchmark.Problem] = AUTO_PROBLEMS,
    repeats: int = 11,
    auto_repeats: int = AUTO_REPEATS,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Calibrate each mesh, then measure and predict every method at each length (`Cell`s),
    and `auto`'s regret there and on `auto_problems` at the shortest length (`AutoRow`s),
    from `auto_repeats` interleaved rounds of the patterns it picks among."""
    validate.check_int(auto_repeats, "auto_repeats", example="`auto_repeats=61`")
    validate.check_instance(problem, benchmark.Problem, "problem", "modelcheck.PROBLEM")
    if isinstance(auto_problems, tuple | list) and not auto_problems:
        auto_problems = ()  # none is allowed; check_sequence refuses an empty one
    else:
        eg = "AUTO_PROBLEMS"
        auto_problems = tuple(
            validate.check_sequence(auto_problems, "auto_problems", "problems", eg)
        )
    for i, x in enumerate(auto_problems):
        validate.check_instance(x, benchmark.Problem, f"auto_problems[{i}]", "AUTO_PROBLEMS")
    if progress is not None:
        validate.check_callable(progress, "progress", "called with each step's name")
    seq_lens = validate.check_sizes_list(seq_lens, "seq_lens", "(4096, 16384, 65536)")
    meshes = [str(m) for m in validate.check_sequence(meshes, "meshes", "names", '("8", "2x4")')]
    for m in meshes:
        parse_mesh(m)
    cells: list[Cell] = []
    autos: list[AutoRow] = []
    cals = {}
    for name in meshes:
        mesh = mesh_of(name)
        if progress:
            progress(f"mesh {name}: calibrating")
        cal = calibrate.pattern_calibration(mesh, seq_lens, problem=problem, repeats=repeats)
        # The calibration's local programs run again in the cells' rounds (`local`), and
        # the calibration refitted from them prices the cells and `auto`'s picks.
        cal, rows = calibrate.validate_patterns(
            mesh,
            seq_lens,
            problem=problem,
            calibration=cal,
            repeats=repeats,
            progress=progress,
            local=True,
        )
        cals[name] = cal
        cells += [
            Cell(r["name"], name, r["seq_len"], r["predicted_s"], r["median_s"], r["rel_err"])
            for r in rows
        ]
        for extra, lens in ((problem, seq_lens), *((x, [min(seq_lens)]) for x in auto_problems)):
            extra = replace(extra, seq_len=min(lens))
            calls = benchmark.pattern_calls(mesh, extra, lens, merges.AUTO_MERGES)
            if progress:
                progress(f"auto: {len(calls)} programs, {auto_repeats} rounds interleaved")
            times = benchmark.interleaved_times(calls, repeats=auto_repeats)
            autos += _auto_rows(name, extra, times, lens, cal.topology)
    return Report(cells, autos, cals)


def table(report: Report) -> str:
    """The cells and `auto`'s rows as fixed-width tables, with the bands."""
    head = (
        f"{'method':<16}{'mesh':>5}{'seq_len':>9}{'predicted ms':>14}{'measured ms':>13}"
        f"{'rel err':>9}"
    )
    lines = [head, "-" * len(head)]
    for c in report.cells:
        flag = "" if abs(c.rel_err) <= report.band else "  outside"
        lines.append(
            f"{c.method:<16}{c.mesh:>5}{c.seq_len:>9}{c.predicted_s * 1e3:>14.2f}"
            f"{c.measured_s * 1e3:>13.2f}{c.rel_err:>+9.0%}{flag}"
        )
    inside = sum(abs(c.rel_err) <= report.band for c in report.cells)
    lines.append(f"{inside} of {len(report.cells)} cells within ±{report.band:.0%}")
    head = (
        f"{'mesh':<5}{'seq_len':>9}{'batch':>6}{'heads':>7}  {'picked':<15}{'best':<15}"
        f"{'regret':>7}"
    )
    lines += [
        "",
        "auto (calibrated model) against each pattern in the same rounds (the worst)",
        head,
    ]
    lines.append("-" * len(head))
    for a in report.auto:
        lines.append(
            f"{a.mesh:<5}{a.seq_len:>9}{a.batch:>6}{f'{a.q_heads}/{a.kv_heads}':>7}  "
            f"{a.picked:<15}{a.best:<15}{a.regret:>+7.0%}"
        )
    worst = max((a.regret for a in report.auto), default=0.0)
    lines.append(f"worst regret {worst:+.0%} (band {report.regret_band:.0%})")
    return "\n".join(lines)
