"""`tree-attention-edu bench`: every method at one or more sizes, then the optional sections
(bandwidth, calibration of the cost model, every merge pattern); JSON records."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..perf.benchmark import METHODS
from . import common
from . import plumbing as cl

NAME = "bench"
HELP = "measure every method; write JSON records"
SECTIONS = ("bandwidth", "calibration", "patterns")
DEFAULT_SECTIONS = ("bandwidth", "calibration")  # "patterns" is opt-in: a second calibration


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.problem_args(p, seq_len=None)
    p.add_argument(
        "--seq-lens",
        type=cl.lengths,
        default=None,
        help="comma-separated KV lengths (default: --seq-len, else 65536)",
    )
    p.add_argument(
        "--methods",
        type=cl.names(METHODS),
        default=None,
        help=f"comma-separated subset of {','.join(METHODS)} (default: all)",
    )
    p.add_argument("--json", default=None, help="write records to this path")
    p.add_argument(
        "--sections",
        type=cl.names(SECTIONS, allow_empty=True),
        default=",".join(DEFAULT_SECTIONS),
        help="extra sections after the method table, comma-separated ('' for "
        "none), among bandwidth, calibration and patterns (every merge "
        "pattern and both rings, measured and predicted)",
    )
    p.add_argument(
        "--calibration-seq-lens",
        type=cl.lengths,
        default="16384,32768,65536,131072",
        help="KV lengths at which the cost model is checked",
    )


def _progress(bar: tqdm) -> Callable[[str], None]:
    """A progress callback that names the step and advances `bar` by one."""

    def step(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    return step


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    common.check_mesh(parser, args)
    flag = "--seq-lens" if args.seq_lens is not None else "--seq-len"  # --seq-len N is N
    if args.seq_lens is None:
        args.seq_lens = [args.seq_len or 65536]
    elif args.seq_len is not None and args.seq_lens != [args.seq_len]:
        parser.error(
            f"--seq-len {args.seq_len} and --seq-lens "
            f"{','.join(map(str, args.seq_lens))} disagree; give one of them"
        )
    args.seq_len = max(args.seq_lens)
    common.check_problem(parser, args, flag, args.seq_len)
    if "calibration" in args.sections:
        common.check_problem(parser, args, "--calibration-seq-lens", max(args.calibration_seq_lens))
    if args.json:
        cl.check_output(parser, "--json", args.json)


def run(args: argparse.Namespace) -> int:
    common.setup(args)
    from ..perf.benchmark import speedup_line, table

    out = []
    for seq_len in args.seq_lens:
        records = common.measure(args, seq_len, list(args.methods or METHODS))
        print(table(records))
        if line := speedup_line(records):
            print(line)
        by = {r.method: r for r in records}
        if {"tree", "ring"} <= set(by):
            t, r = by["tree"], by["ring"]
            total = (r.argument_bytes + r.temp_bytes) / max(t.argument_bytes + t.temp_bytes, 1)
            print(
                f"   ring/tree latency {r.median_s / t.median_s:.2f}x, ring/tree bytes "
                f"{r.collective_bytes / max(t.collective_bytes, 1):.3g}x, ring/tree memory "
                f"per device (arguments + temp) {total:.2f}x (paper eqs. 8-9: 2x)"
            )
        out += [r.as_json() for r in records]
    report: dict[str, Any] = {"device": _device(), "records": out}
    if "bandwidth" in args.sections:
        report["bandwidth"] = _bandwidth(args, report["device"])
    if "calibration" in args.sections:
        report["calibration"] = _calibration(args)
    if "patterns" in args.sections:
        report["patterns"] = _patterns(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


def _device() -> dict[str, Any]:
    from ..perf import benchmark

    dev = benchmark.device_info(measure=True)
    nominal = f"{dev['nominal_gbs']:.0f} GB/s" if dev["nominal_gbs"] else "unknown"
    print(
        f"\ndevice: {dev['platform']} ({dev['kind']}), jax {dev['jax_version']}; read "
        f"bandwidth measured {dev['measured_gbs']:.1f} GB/s (jnp.sum on the device), nominal "
        f"HBM peak {nominal}"
    )
    return dev


def _bandwidth(args: argparse.Namespace, device: dict[str, Any]) -> dict[str, Any]:
    from ..perf import benchmark, calibrate

    # The kernels' K/V are placed on the mesh along the sequence: a multiple of --devices.
    seq_len = -(-max(args.seq_lens) // args.devices) * args.devices
    print(
        f"\nBandwidth: one decode step at Tk={seq_len}, {args.heads} heads x {args.head_dim}, "
        f"{args.dtype}; effective GB/s = (K + V bytes) / median time"
    )
    with tqdm(desc="bandwidth", unit="kernel", file=sys.stderr, disable=None) as bar:
        section = calibrate.bandwidth(
            common.mesh(args),
            common.problem(args, seq_len),
            repeats=args.repeats,
            progress=_progress(bar),
        )
    print(calibrate.bandwidth_table(section))
    benchmark.device_fractions(section["kernels"], device)
    print(
        "of the device: "
        + ", ".join(
            f"{name} {r['frac_measured']:.0%} of measured"
            + (f", {r['frac_nominal']:.0%} of nominal" if r["frac_nominal"] is not None else "")
            for name, r in section["kernels"].items()
        )
    )
    return section


def _calibration(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ..perf import calibrate

    print(
        f"\nCalibration: alpha-beta model with parameters measured here, against measured "
        f"tree and ring latency on {args.devices} devices"
    )
    with tqdm(desc="calibration", unit="step", file=sys.stderr, disable=None) as bar:
        # The problem's own seq_len is replaced by each of the calibration's lengths.
        cal, rows = calibrate.calibrate(
            common.mesh(args),
            args.calibration_seq_lens,
            problem=common.problem(args, args.calibration_seq_lens[0]),
            repeats=args.repeats,
            progress=_progress(bar),
        )
    print(calibrate.calibration_table(cal, rows))
    return rows


def _patterns(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ..perf import benchmark, calibrate, patternbench

    print(
        f"\nPatterns: every merge pattern of tree_decode and both rings on {args.devices} "
        f"devices, timed in one run (repeats interleaved), against the cost model with a "
        f"topology measured here; one_pass counts its fast path (its exact fallback is a "
        f"conditional branch)"
    )
    mesh = common.mesh(args)
    # pattern_calibration's three steps (collectives, local kernel, folds in a loop), then
    # bench_patterns' compile per method and one timing per length.
    steps = 3 + len(args.seq_lens) * (len(benchmark.PATTERNS) + 1)
    with tqdm(total=steps, desc="patterns", unit="step", file=sys.stderr, disable=None) as bar:
        progress = _progress(bar)
        cal = calibrate.pattern_calibration(
            mesh,
            args.seq_lens,
            problem=common.problem(args, args.seq_lens[0]),
            repeats=args.repeats,
            progress=progress,
        )
        records = []
        for seq_len in args.seq_lens:
            records += patternbench.bench_patterns(
                mesh,
                common.problem(args, seq_len),
                calibration=cal,
                repeats=args.repeats,
                progress=progress,
            )
    print(patternbench.pattern_records_table(records))
    return [r.as_json() for r in records]
