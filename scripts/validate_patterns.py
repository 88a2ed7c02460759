"""Predicted against measured latency of every merge pattern and both rings, on 8 simulated
CPU devices: `calibrate.validate_patterns`, printed as a table with the worst error.

The mesh is measured first (per-call overhead, the ring's ppermute, all-reduce, all-gather,
reduce-scatter and all-to-all, and the per-device decode bandwidth at a length that is not
validated); nothing is fitted to the timings being predicted. Target: within ±35% on a
quiet machine.

    .venv/bin/python scripts/validate_patterns.py --seq-lens 8192 16384 32768 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backends

from tqdm import tqdm  # noqa: E402

from tree_attention_edu import make_mesh  # noqa: E402
from tree_attention_edu.perf import benchmark, calibrate  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the rows and the measured links here")
    args = ap.parse_args(argv)
    mesh = make_mesh(8, "x")
    problem = benchmark.Problem(
        batch=args.batch, q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim
    )
    steps = 2 + len(args.seq_lens) * len(benchmark.PATTERNS)
    with tqdm(
        total=steps, desc="validate patterns", unit="step", file=sys.stderr, disable=None
    ) as bar:

        def progress(what):
            bar.set_postfix_str(what)
            bar.update()

        cal, rows = calibrate.validate_patterns(
            mesh, args.seq_lens, problem=problem, repeats=args.repeats, progress=progress
        )
    print(calibrate.patterns_table(cal, rows))
    if args.json:
        links = {k: {"alpha_s": v.alpha_s, "beta_Bps": v.beta_Bps} for k, v in cal.links.items()}
        with open(args.json, "w") as f:
            json.dump(
                {
                    "overhead_s": cal.overhead_s,
                    "mem_Bps": cal.mem_Bps,
                    "links": links,
                    "patterns": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
