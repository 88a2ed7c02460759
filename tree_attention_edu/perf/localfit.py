"""The local parts of a calibration: the kernel's line (its decode bandwidth and fixed
part), a local copy's rate and the rings' in-loop fold curves. Which problems they are timed
at (`kernel_problems`, `fold_problems`), their programs for timing in the rounds of other
programs (`local_round_calls`), and the topology fitted from those times (`refit_local`).
The ring's permute link is refitted the same way (`ringlink.refit_ring_link`).

`calibrate.measure_topology` times them in rounds of their own; `calibrate.validate_patterns`
with `local=True` times them in the same rounds as the cells it predicts, so that a spell of
the shared host falls on both alike (`results/calibrate/README.md`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from jax.sharding import Mesh

from ..core import validate
from . import benchmark
from .links import Topology
from .microbench import (
    check_affine_problems,
    check_fold_problems,
    check_sharded_problems,
    check_times,
    fit_local_affine,
    fold_loop_calls,
    fold_loop_points,
    local_affine_calls,
    local_calls,
    local_rates,
)

FOLD_TINY_KEYS = 8
"""Keys per device of the smallest block `fold_problems` times: a fold's cost with next to
nothing to read (the loop step's own operations), for the pass-Q ring's small blocks."""


def fold_problems(
    problem: benchmark.Problem, p: int, seq_lens: Iterable[int]
) -> list[benchmark.Problem]:
    """The problems whose shards `calibrate.measure_topology` times one in-loop fold at: a block of
    `FOLD_TINY_KEYS` keys per device, and 3/4 of each of `seq_lens` (rounded down to a
    multiple of `p`), without repeats and without any of `seq_lens` themselves (the lengths
    that are predicted). Empty where that leaves fewer than two, or on one device (a ring
    of one device has no loop): the rings' folds are then priced as kernel calls."""
    validate.check_instance(problem, benchmark.Problem, "problem", "modelcheck.PROBLEM")
    p = validate.check_int(p, "p", example="`p=mesh.size`")
    seq_lens = validate.check_sizes_list(seq_lens, "seq_lens", "(4096, 16384, 65536)")
    lens = {FOLD_TINY_KEYS * p} | {max(p, (3 * n // 4) // p * p) for n in seq_lens}
    lens -= set(seq_lens)
    if p < 2 or len(lens) < 2:
        return []
    return [replace(problem, seq_len=n) for n in sorted(lens)]


def kernel_problems(
    problem: benchmark.Problem, p: int, seq_lens: Iterable[int]
) -> tuple[benchmark.Problem, ...]:
    """The problems `calibrate.pattern_calibration` times the local kernel at: 3/4 of the
    shortest and of the longest of `seq_lens`, each rounded down to a multiple of the
    device count `p` (at least `p`), shorter first, leaving out any of `seq_lens` (the
    lengths that are predicted); one problem where the two coincide or one is left out.
    3/4 of the shortest is below every predicted length, so one is left, unless it was
    raised to `p` and `p` is predicted: that one is then kept."""
    validate.check_instance(problem, benchmark.Problem, "problem", "modelcheck.PROBLEM")
    p = validate.check_int(p, "p", example="`p=mesh.size`")
    seq_lens = validate.check_sizes_list(seq_lens, "seq_lens", "(4096, 16384, 65536)")
    ends = (min(seq_lens), max(seq_lens))
    lens = dict.fromkeys(max(p, (3 * n // 4) // p * p) for n in ends)
    keep = [n for n in lens if n not in seq_lens] or [min(lens)]  # p itself may be predicted
    return tuple(replace(problem, seq_len=n) for n in keep)


def check_kernel_problems(kernel: Any, p: int) -> tuple[benchmark.Problem, ...]:
    """`kernel` as `kernel_problems` gives it: one or two `benchmark.Problem`s (two with the
    shorter cache first), each `seq_len` a multiple of `p`; else an error naming `kernel`."""
    eg = "localfit.kernel_problems(problem, p, seq_lens)"
    if not (isinstance(kernel, tuple | list) and len(kernel) in (1, 2)):
        raise TypeError(
            f"`kernel` must be one or two benchmark.Problem (shorter first), e.g. {eg}, got "
            f"{validate.describe(kernel)}."
        )
    check_sharded_problems(tuple(kernel), "kernel", p, eg)
    if len(kernel) == 2:
        check_affine_problems(tuple(kernel))
    return tuple(kernel)


def _names(kernel: tuple, folds: tuple) -> list[str]:
    """The names `local_round_calls` gives its programs (the `seconds` `refit_local` needs)."""
    names = ["kernel0", "kernel1", "copy1"] if len(kernel) == 2 else ["kernel1", "copy1"]
    for tag in ("fold", "window") if folds else ():
        names += [f"{tag} {i} {n}" for i in range(len(folds)) for n in ("x1", "xp")]
    return [f"local {n}" for n in names]


def local_round_calls(
    mesh: Mesh, kernel: tuple[benchmark.Problem, ...], folds: tuple[benchmark.Problem, ...]
) -> dict[str, tuple[Callable, tuple]]:
    """The local calibration programs as `name -> (fn, args)` for `benchmark.median_times`,
    each name starting with "local " so as not to collide with another's programs: the
    kernel at `kernel` (`kernel_problems`: one or two, shorter first) and the copy at the
    longest, and, unless `folds` is empty, the fold loops at `folds` (`fold_problems`),
    whole shard and head window."""
    validate.check_instance(mesh, Mesh, "mesh", "e.g. tree_attention_edu.make_mesh(8, 'x')")
    kernel = check_kernel_problems(kernel, mesh.size)
    folds = check_fold_problems(folds, mesh.size) if folds != () else ()
    if len(kernel) == 2:
        calls = local_affine_calls(mesh, (kernel[0], kernel[1]))
    else:
        one = local_calls(mesh, kernel[0])
        calls = {"kernel1": one["kernel"], "copy1": one["copy"]}
    for windows in (False, True) if folds else ():
        calls.update(fold_loop_calls(mesh, folds, windows=windows))
    return {f"local {name}": c for name, c in calls.items()}


def refit_local(
    topology: Topology,
    kernel: tuple[benchmark.Problem, ...],
    folds: tuple[benchmark.Problem, ...],
    seconds: dict[str, float],
) -> Topology:
    """`topology` with its decode bandwidth, kernel fixed part, copy rate and (with
    `folds`) both fold curves fitted again, as `measure_topology` fits them, from the
    medians of `local_round_calls`' programs (`seconds`, by name; other names are left
    alone). Its `overhead_s` is the per-call overhead subtracted from each time, and its
    device count the one the programs ran on (each length a multiple of it)."""
    validate.check_instance(topology, Topology, "topology", "calibrate.measure_topology(...)")
    p, overhead = topology.devices, topology.overhead_s
    kernel = check_kernel_problems(kernel, p)
    folds = check_fold_problems(folds, p) if folds != () else ()
    seconds = check_times(seconds, _names(kernel, folds), "localfit.local_round_calls")
    times = {k.removeprefix("local "): t for k, t in seconds.items()}
    if len(kernel) == 2:
        mem_Bps, fixed, copy_Bps = fit_local_affine((kernel[0], kernel[1]), p, times, overhead)
    else:
        fixed = 0.0
        mem_Bps, copy_Bps = local_rates(kernel[0], p, times["kernel1"], times["copy1"], overhead)
    out = replace(topology, mem_Bps=mem_Bps, kernel_fixed_s=fixed, copy_Bps=copy_Bps)
    if not folds:
        return out
    whole, window = (
        tuple(sorted((float(n), t) for n, t in fold_loop_points(folds, p, times, windows=w)))
        for w in (False, True)
    )
    return replace(out, fold_points=whole, window_points=window)
