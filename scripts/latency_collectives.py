"""One-way link delays per call of each XLA:CPU collective, measured: tiny all-reduce,
all-gather, all-to-all, collective-permute and reduce-scatter across real `jax.distributed`
processes in network namespaces, at several link delays (`cluster.collectives.measure`).

Needs root. Appends one layout's record to the JSON file (or starts it):

    sudo nice -n 10 .venv/bin/python scripts/latency_collectives.py --layout 2x2x1 \
        --delays 0,5,10 --json results/cluster/latency-collectives.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from tree_attention_edu.cli import plumbing
from tree_attention_edu.cluster import collectives


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", type=plumbing.layout(min_nodes=2), required=True, help="e.g. 2x2x1")
    ap.add_argument("--delays", default="0,5,10", help="one-way delays in ms")
    ap.add_argument("--rate-gbit", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    delays = [float(d) for d in args.delays.split(",")]
    nodes, ppn, dpp = args.layout
    rec = collectives.measure(
        nodes, ppn, dpp, delays, rate_gbit=args.rate_gbit, repeats=args.repeats
    )
    rec["command"] = " ".join(
        shlex.quote(a) for a in ["scripts/latency_collectives.py", *sys.argv[1:]]
    )
    rec["load_average"] = os.getloadavg()
    doc: dict[str, Any] = {"layouts": []}
    if os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
    doc["algorithms"] = collectives.ALGORITHMS
    doc["sources"] = collectives.SOURCES
    doc["layouts"] = [r for r in doc["layouts"] if r["layout"] != rec["layout"]] + [rec]
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{rec['layout']} (p = {rec['p']}): one-way delays per call")
    for kind, fit in rec["fits"].items():
        print(
            f"  {kind:<20} measured {fit['delays_per_call']:5.2f}   source predicts "
            f"{fit['predicted_delays']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
