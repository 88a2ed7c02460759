"""`tree-attention-edu calibrate`: measure this machine's simulated devices for the cost
model; with `--check`, predict and measure every merge pattern and both rings over meshes and
cache lengths, print predicted, measured and relative error per cell and `auto`'s regret, and
exit 1 when a cell is outside the band or `auto`'s regret is over 10% (`perf.modelcheck`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from . import memory
from . import plumbing as cl

if TYPE_CHECKING:
    from ..perf.benchmark import Problem

NAME = "calibrate"
HELP = "measure the cost model's parameters; --check: predicted against measured, every cell"


def _meshes(text: str) -> list[str]:
    """`--meshes`: comma-separated "P" or "NxG" (e.g. 8,2x4), at most `MAX_DEVICES` each."""
    from ..perf.modelcheck import parse_mesh

    out = []
    for part in text.split(","):
        try:
            shape = parse_mesh(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a mesh: give P or NxG with positive ints, e.g. 8,2x4"
            ) from None
        if math.prod(shape) > cl.MAX_DEVICES:
            raise argparse.ArgumentTypeError(
                f"mesh {part} has {math.prod(shape)} devices; at most {cl.MAX_DEVICES}"
            )
        out.append(part.strip())
    return out


def _band(text: str) -> float:
    return cl.finite(text, "band", lambda x: 0 < x < 10, "a fraction above 0, e.g. 0.3")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--check",
        action="store_true",
        help="predict and measure every method on every mesh and length; exit 1 outside the band "
        "or when auto's regret is over 10%",
    )
    p.add_argument(
        "--seq-lens",
        type=cl.lengths,
        default="4096,16384,65536",
        help="KV lengths of the checked cells",
    )
    p.add_argument(
        "--meshes", type=_meshes, default="8,2x4", help="meshes of the checked cells, e.g. 8,2x4"
    )
    p.add_argument(
        "--repeats",
        type=cl.positive,
        default=11,
        help="timed calls per calibration micro-benchmark (3x for the latency chains) and, "
        "with --check, interleaved rounds of the cells (auto's regret takes 61 rounds of its "
        "four patterns)",
    )
    p.add_argument("--band", type=_band, default=None, help="relative error allowed (0.3)")
    p.add_argument("--json", default=None, help="write the cells and auto's rows here")


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from ..perf import modelcheck

    if args.json:
        cl.check_output(parser, "--json", args.json)
    if not args.check:
        for flag, given in (("--json", args.json), ("--band", args.band)):
            if given is not None:
                parser.error(f"{flag} is for --check; add --check or leave out {flag}")
    sizes = {mesh: math.prod(modelcheck.parse_mesh(mesh)) for mesh in args.meshes}
    for mesh, devices in sizes.items():
        if min(args.seq_lens) < devices:
            parser.error(
                f"--seq-lens {min(args.seq_lens)} leaves devices of mesh {mesh} without a key; "
                f"give at least {devices}"
            )
    # validate_patterns holds every length's cache at once, with its local programs': the
    # kernel at 3/4 of the shortest and of the longest, and the fold loops at 3/4 of each
    # length, once for whole shards and once for windows (`perf.localfit`), and the
    # ring-pass programs' K and V at each message size (`ringlink.ring_pass_calls`): all
    # must fit.
    quarters = [3 * n // 4 for n in args.seq_lens]
    held = sum(args.seq_lens) + min(quarters) + max(quarters) + 2 * sum(quarters)
    memory.check(parser, memory.decode(replace(modelcheck.PROBLEM, seq_len=held), "--seq-lens"))
    memory.check_positions(parser, "--seq-lens", max(args.seq_lens))  # before sizing a ring
    held += max(_ring_pass_keys(modelcheck.PROBLEM, d, args.seq_lens) for d in sizes.values())
    memory.check(parser, memory.decode(replace(modelcheck.PROBLEM, seq_len=held), "--seq-lens"))
    args.devices = max(sizes.values())  # `setup` simulates this many


def _ring_pass_keys(problem: Problem, p: int, seq_lens: list[int]) -> int:
    """Keys of a cache (K and V) as large as the ring-pass programs' on `p` devices."""
    from ..perf import calibrate

    key = problem.kv_bytes // (2 * problem.seq_len)  # one key's bytes, in K or V
    sizes = calibrate.pattern_message_sizes(problem, p, seq_lens)
    return sum(max(1, n // key) * p for n in dict.fromkeys(sizes))


def run(args: argparse.Namespace) -> int:
    from .common import setup

    setup(args)
    from ..perf import calibrate, modelcheck

    if not args.check:
        mesh = modelcheck.mesh_of(args.meshes[0])
        cal = calibrate.pattern_calibration(
            mesh, args.seq_lens, problem=modelcheck.PROBLEM, repeats=args.repeats
        )
        print(f"mesh {args.meshes[0]}: {calibrate.measured_line(cal)}")
        return 0
    # Per mesh: calibrating, the cells' rounds, auto's rounds at every length, and at the
    # shortest for each of AUTO_PROBLEMS.
    steps = len(args.meshes) * (3 + len(modelcheck.AUTO_PROBLEMS))
    bar = tqdm(total=steps, desc="calibrate --check", unit="step", file=sys.stderr, disable=None)

    def progress(name: str) -> None:
        bar.set_postfix_str(name)
        bar.update(1)

    try:
        report = modelcheck.run(args.meshes, args.seq_lens, repeats=args.repeats, progress=progress)
    finally:
        bar.close()
    if args.band is not None:
        report.band = args.band
    print(modelcheck.table(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.as_json(), indent=2))
        print(f"wrote {args.json}")
    if report.failures:
        more = len(report.failures) - 3
        print(
            f"{cl.PROG}: {len(report.failures)} outside the bands: "
            + "; ".join(report.failures[:3])
            + (f"; and {more} more (the table above)" if more > 0 else ""),
            file=sys.stderr,
        )
        return 1
    return 0
