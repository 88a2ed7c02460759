"""One process of a cluster run: `jax.distributed` with gloo, inside a node's namespace.

`run.py` starts `nodes × processes_per_node` of these, each with `ip netns exec NODE python
-m tree_attention_edu.cli.worker SPEC.json` (`processes.WorkerSpec`); process `I` lives on
node `I // processes_per_node`, simulates `devices_per_process` CPU devices and builds the
run's two meshes (`context.start`).

Then, at each link rate (the launcher changes the rate when process 0 asks, `request_rate`):

1. each level's link: α and β from all-reduces of growing size over the 2-level mesh's
   "node" and "gpu" axes and over all devices (alone, and in a chain of three), and the
   all-gather and all-to-all over all devices, each alone (`levels.fit_links`);
2. the local decode bandwidth (as the collective after the kernel waits for it) and copy
   rate with every device busy (`levels.fit_local`);
3. every method on the same cache: its times (repeats interleaved with the above, after
   `warmup_rounds` untimed rounds of the same calls),
   bytes sent per device on each level (from the compiled program's collectives and their
   replica groups), max |error| against a float64 numpy reference computed here, and the
   cost model's prediction (`methods.method_records`);
4. at the first rate, tree and ring over a range of sequence lengths (the crossover,
   `crossover_sweep`).

Every process prints what it does and holds, one line at a time; process 0 gathers every
process's timings and errors (`process_allgather`) and writes the result JSON
(`run_process`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

import numpy as np

from . import context, levels, methods
from .context import Context, Settings

RATE_WAIT_S = 60.0  # process 0 waits this long for the launcher to change the rate


def run_process(s: Settings, pid: int) -> int:
    """Process `pid` of the run: `measure`, then `lines-{pid}.json` (what it said, even on
    failure) and, from process 0, `result.json` in the launcher's control folder.

    Its lines go to the launcher's stdout; gloo's C++ prints ("Rank N is connected ...") go
    to fd 1 too, so fd 1 becomes this worker's log (stderr). Returns 0; raises on failure.
    """
    import jax

    out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    lines: list[str] = []
    try:
        result = measure(s, pid, out, lines)
    finally:
        _write_json(os.path.join(s.control, f"lines-{pid}.json"), lines)
    if pid == 0:
        _write_json(os.path.join(s.control, "result.json"), result)
    jax.distributed.shutdown()
    return 0


def measure(s: Settings, pid: int, out: TextIO, lines: list[str]) -> dict[str, Any]:
    """Every rate in turn: the levels' all-reduces, the local work and the methods, timed in
    the same interleaved rounds (so that the load of a shared machine hits calibration and
    measurement alike), then the fits and the predictions; the crossover sweep at the
    first rate; a reduce-scatter, if asked for, last (`methods.POISON`)."""
    ctx = context.start(s, pid, out, lines)
    names = [m for m in s.methods if m != "reduce_scatter"]
    calls, static = methods.method_calls(ctx, names, s.seq_len)
    calls = {**levels.level_calls(ctx), **levels.local_calls(ctx), **calls}
    phases: list[dict[str, Any]] = []
    for i, rate in enumerate(s.rates_bps):
        if i:
            request_rate(ctx, i, rate)
        phases.append(_phase(ctx, rate, names, calls, static, first=i == 0))
    if "reduce_scatter" in s.methods:
        _reduce_scatter_last(ctx, phases)
    return {"phases": phases, "local": phases[0]["local"]}


def _interleaved(ctx: Context, calls: levels.Calls) -> dict[str, list[float]]:
    """`calls` timed in the run's interleaved rounds, after its untimed warm-up rounds."""
    from ..perf import benchmark

    return benchmark.interleaved_times(calls, repeats=ctx.s.repeats, warmup=ctx.s.warmup_rounds)


def _rounds(s: Settings) -> str:
    """How the calls are timed, as the workers say it."""
    return f"{s.repeats} interleaved rounds after {s.warmup_rounds} untimed"


def _phase(
    ctx: Context,
    rate: float,
    names: list[str],
    calls: levels.Calls,
    static: dict[str, dict[str, Any]],
    *,
    first: bool,
) -> dict[str, Any]:
    """One link rate: every call timed in interleaved rounds, the links and the local work
    fitted, the cost model's topologies, each method's record; at the `first` rate, the
    crossover sweep."""
    s = ctx.s
    label = f"[{rate / 1e9:g} Gbit/s]"
    ctx.say(
        f"{label} timing {len(names)} methods and {len(calls) - len(names)} programs that "
        f"measure the links and the local work, {_rounds(s)}"
    )
    times = _interleaved(ctx, calls)
    everyone = methods.rounds_by_process(times)
    links = levels.fit_links(ctx, levels.pooled(everyone), rate)
    local = levels.fit_local(ctx, times, links["overhead_s"], everyone)
    topo = methods.topologies(ctx, links, local)
    records = methods.method_records(ctx, names, s.seq_len, times, static, topo, label)
    phase: dict[str, Any] = {"set_Bps": rate / 8, "links": links, "local": local}
    phase["round_s_by_process"] = everyone
    phase["methods"] = records
    if first and s.sweep:
        phase["crossover"] = crossover_sweep(ctx, topo, records, label)
    return phase


def _reduce_scatter_last(ctx: Context, phases: list[dict[str, Any]]) -> None:
    """The reduce-scatter, back at the first rate, after everything else (`POISON`), in
    interleaved rounds with its collectives, each alone and one after the other
    (`levels.last_calls`); it is priced by the first rate's fits with those
    (`levels.fit_last`, recorded as its `kinds_last`, with every process's rounds as
    `last_round_s_by_process`) in place of the first rounds' all-gather and the
    reduce-scatter's formula. Its record joins the first rate's, in the order of
    `methods`."""
    s = ctx.s
    if len(s.rates_bps) > 1:
        request_rate(ctx, len(s.rates_bps), s.rates_bps[0])
    first = phases[0]
    calls, static = methods.method_calls(ctx, ["reduce_scatter"], s.seq_len)
    calls |= levels.last_calls(ctx)
    label = f"[{s.rates_bps[0] / 1e9:g} Gbit/s, last]"
    ctx.say(
        f"{label} timing reduce_scatter and {len(calls) - 1} programs that measure its "
        f"collectives, {_rounds(s)}"
    )
    times = _interleaved(ctx, calls)
    everyone = methods.rounds_by_process(times)
    kinds = levels.fit_last(everyone, first["links"]["overhead_s"], ctx.two.size)
    links = {**first["links"], "kinds": {**first["links"]["kinds"], **kinds}}
    topo = methods.topologies(ctx, links, first["local"])
    rec = methods.method_records(ctx, ["reduce_scatter"], s.seq_len, times, static, topo, label)
    rec["reduce_scatter"]["note"] = "measured last: " + methods.POISON
    rec["reduce_scatter"]["kinds_last"] = kinds
    rec["reduce_scatter"]["last_round_s_by_process"] = everyone
    first["round_s_by_process"]["reduce_scatter"] = everyone["reduce_scatter"]
    merged = {**first["methods"], **rec}
    first["methods"] = {m: merged[m] for m in s.methods if m in merged}


def crossover_sweep(
    ctx: Context, topo: methods.Topologies, at_len: dict[str, Any], label: str
) -> dict[str, Any]:
    """Tree (flat and 2-level) and ring over the `sweep` lengths, measured (the slowest
    process's medians) and predicted, and where tree overtakes ring."""
    s = ctx.s
    names = [m for m in methods.CROSSOVER_METHODS if m in s.methods]
    measured: dict[str, list[float]] = {m: [] for m in names}
    predicted: dict[str, list[float]] = {m: [] for m in names}
    lens = sorted(set(s.sweep))
    for n in lens:
        if n == s.seq_len:
            recs = {m: at_len[m] for m in names}
        else:
            calls, static = methods.method_calls(ctx, names, n)
            times = _interleaved(ctx, calls)
            recs = methods.method_records(ctx, names, n, times, static, topo, label)
            del calls
        for m in names:
            measured[m].append(recs[m]["median_s"])
            predicted[m].append(recs[m]["predicted_s"])
    top = 16 * max(lens)
    grid = sorted(
        {int(x) // s.devices * s.devices for x in np.geomspace(s.devices, top, 400)} - {0}
    )
    model = {m: [methods.predict(ctx, m, n, topo) for n in grid] for m in names}
    out: dict[str, Any] = {
        "seq_lens": lens,
        "measured_s": measured,
        "predicted_s": predicted,
        "model_grid": grid,
        "model_s": model,
    }
    for tree in ("tree_2level", "tree"):
        if tree in names and "ring" in names:
            faster = zip(measured[tree], measured["ring"], strict=True)
            out[f"{tree}_vs_ring"] = {
                "measured": methods.crossover(lens, measured[tree], measured["ring"]),
                "predicted": methods.crossover(grid, model[tree], model["ring"]),
                "tree_faster_everywhere_measured": all(t < r for t, r in faster),
            }
    return out


def request_rate(ctx: Context, i: int, rate_bps: float) -> None:
    """Ask the launcher for a new link rate and wait until every process knows it is set."""
    from jax.experimental import multihost_utils

    if ctx.pid == 0:
        req = os.path.join(ctx.s.control, f"rate-{i}.request")
        _write_json(req, {"rate_bps": rate_bps})
        done = os.path.join(ctx.s.control, f"rate-{i}.done")
        end = time.monotonic() + RATE_WAIT_S
        while not os.path.exists(done):
            if time.monotonic() > end:
                raise RuntimeError(
                    f"the launcher did not set the link rate within {RATE_WAIT_S:g} s"
                )
            time.sleep(0.02)
    multihost_utils.sync_global_devices(f"tae-cluster-rate-{i}")
    ctx.say(f"link rate is now {rate_bps / 1e9:g} Gbit/s")


def _write_json(path: str, value: Any) -> None:
    """`value` as JSON at `path`, whole or not at all (written aside, then renamed)."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)
