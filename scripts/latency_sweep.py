"""Every cluster method's decode step against the inter-node link's one-way delay D: one
`tree-attention-edu cluster ... --link-delay-ms D` run per delay (each its own network of
namespaces, its own processes), then `cluster.collectives.delay_sweep` over their reports
(time against D, the slope in units of D, the cost model's prediction at each point).

Needs root. Writes the sweep, with every run's report and command, to `--json`:

    sudo nice -n 10 .venv/bin/python scripts/latency_sweep.py --layout 2x2x1 \
        --delays 0,2,5,10,20 --repeats 9 --json results/cluster/latency-2x2x1.json

Run it on an otherwise idle machine: the load average before and after each run is stored
with it, because the processes share the machine's cores and a busy machine adds its own
waits to every collective.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tree_attention_edu.cli import plumbing
from tree_attention_edu.cluster import collectives

METHODS = "tree,tree_2level,butterfly,ring,ring_pass_q"


MEASURED_AS: dict[collectives.MeasuredAs, str] = {
    "mean_s": "the mean over every process's rounds",
    "median_s": "the slowest process's median",
}
"""What each point's time is (`collectives.delay_sweep`'s `measured_as`)."""


def _delays(text: str) -> list[float]:
    """Comma-separated one-way delays in ms, each >= 0 and distinct at 0.1 ms (the
    reports are keyed by the delay to 0.1 ms)."""
    try:
        delays = [float(x) for x in text.split(",")]
    except ValueError:
        msg = f"expected delays in ms such as 0,2,5, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    keys = [f"{d:.1f}" for d in delays]
    if min(delays) < 0 or len(set(keys)) != len(keys) or len(delays) < 2:
        raise argparse.ArgumentTypeError(
            f"expected 2 or more delays >= 0 ms, distinct at 0.1 ms, got {text!r}"
        )
    return delays


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", type=plumbing.layout(), default=(2, 2, 1))
    ap.add_argument("--delays", type=_delays, default="0,2,5,10,20", help="one-way delays in ms")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--link-gbit", type=float, default=1.0)
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--json", required=True)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    nodes, ppn, dpp = map(str, args.layout)
    cli = str(Path(sys.executable).with_name("tree-attention-edu"))
    reports, loads = [], []
    with tempfile.TemporaryDirectory(prefix="tae-sweep-") as tmp:
        for d in args.delays:
            out = os.path.join(tmp, f"D{d:g}.json")
            cmd = [
                cli, "cluster", "--nodes", nodes, "--processes-per-node", ppn,
                "--devices-per-process", dpp, "--link-gbit", f"{args.link_gbit:g}",
                "--link-delay-ms", f"{d:g}", "--seq-len", str(args.seq_len),
                "--repeats", str(args.repeats), "--sweep", "", "--methods", args.methods,
                "--json", out,
            ]  # fmt: skip
            before = os.getloadavg()[0]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
                return done.returncode
            loads.append([before, os.getloadavg()[0]])
            with open(out) as f:
                reports.append(json.load(f))
            print(f"D = {d:g} ms done (load average {loads[-1][0]:.1f} -> {loads[-1][1]:.1f})")
    doc: dict[str, Any] = collectives.delay_sweep(reports)
    worst = max(max(pair) for pair in loads)
    doc |= {
        "layout": "x".join(map(str, args.layout)),
        "command": " ".join(shlex.quote(a) for a in ["scripts/latency_sweep.py", *argv]),
        "load_average_1min_before_after": loads,
        "note": f"each point {MEASURED_AS[doc['measured_as']]} "
        f"of {args.repeats} interleaved rounds, one run per D on a "
        f"{os.cpu_count()}-core machine (1-minute load average at most {worst:.1f} before or "
        f"after a run; the cluster's own processes raise it)",
        "reports": {f"{r['config']['link_delay_ms']:.1f}": r for r in reports},
    }
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'method':<13} slope (D per step)  model's slope   ms at each D")
    for name, m in doc["methods"].items():
        times = " ".join(f"{t * 1e3:7.1f}" for t in m[doc["measured_as"]])
        print(
            f"{name:<13} {m['delays_per_step']:18.1f} {m['predicted_delays_per_step']:14.1f}"
            f"   {times}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
