"""Where the cost model's ring prediction goes wrong on simulated devices: the model's terms
for each ring and the allreduce merge beside their measured times, and the micro-benchmarks
the terms come from (the ring-shaped ppermute per message size, the standalone xla kernel
and the block copy at each length's shard).

A diagnostic for issue 30, not a check: it prints what the calibration measured and how the
prediction splits into compute (the p local folds and, for pass-KV, the p - 1 block copies)
and unhidden transfers, so that a change of the model can be argued from the pieces rather
than fitted to the totals.

    .venv/bin/python scripts/ring_terms.py --mesh 8 --seq-lens 4096 16384 65536 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backends

from tree_attention_edu.perf import benchmark, calibrate, modelcheck  # noqa: E402
from tree_attention_edu.perf.microbench import local_calls  # noqa: E402

METHODS = ("ring", "ring_pass_q", "allreduce")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="8", help="'8' or '2x4' (default 8)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=list(modelcheck.GRID_SEQ_LENS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    try:
        mesh = modelcheck.mesh_of(args.mesh)
    except ValueError as e:
        print(f"ring_terms: {e}", file=sys.stderr)
        return 2
    prob = modelcheck.PROBLEM
    cal = calibrate.pattern_calibration(mesh, args.seq_lens, problem=prob, repeats=args.repeats)
    topo = cal.topology
    print(
        f"mesh {args.mesh}: call overhead {cal.overhead_s * 1e3:.3f} ms; kernel "
        f"{topo.mem_Bps / 1e6:.0f} MB/s + {topo.kernel_fixed_s * 1e3:.2f} ms per call; copy "
        f"{topo.copy_Bps / 1e6:.0f} MB/s; ppermute alpha {topo.intra.alpha_s * 1e6:.0f} us, "
        f"beta {topo.intra.beta_Bps / 1e6:.0f} MB/s"
    )
    print("ppermute, ring-shaped, per message:")
    permute = [(int(n), t) for n, t in cal.collective_points["ppermute"]]
    for n, t in permute:
        print(f"  {n:>12,} B {t * 1e3:9.3f} ms {n / t / 1e6 if t > 0 else 0.0:9.1f} MB/s")
    local = []
    for n in args.seq_lens:
        calls = local_calls(mesh, replace(prob, seq_len=n))
        times = benchmark.median_times(
            {k: calls[k] for k in ("kernel", "copy")}, repeats=args.repeats
        )
        shard = replace(prob, seq_len=n).kv_bytes / mesh.size  # K + V per device
        local.append(
            {"seq_len": n, "shard_bytes": shard, **{f"{k}_s": v for k, v in times.items()}}
        )
        print(
            f"Tk={n:,}: shard {shard / 1e6:.2f} MB, standalone kernel "
            f"{times['kernel'] * 1e3:.2f} ms, copy of the K shard {times['copy'] * 1e3:.2f} ms"
        )
    _, rows = calibrate.validate_patterns(
        mesh, args.seq_lens, problem=prob, methods=METHODS, calibration=cal, repeats=args.repeats
    )
    print(
        f"{'method':<13}{'Tk':>7}{'measured':>10}{'predicted':>11}{'error':>8}"
        f"{'compute':>9}{'transfers':>11}"
    )
    for r in rows:
        part = calibrate.predict(r["name"], r["seq_len"], topo, replace(prob, seq_len=r["seq_len"]))
        r.update(compute_s=part.compute_s, comm_s=part.comm_s, overhead_s=part.overhead_s)
        print(
            f"{r['name']:<13}{r['seq_len']:>7}{r['median_s'] * 1e3:>10.2f}"
            f"{r['predicted_s'] * 1e3:>11.2f}{r['rel_err']:>+8.0%}{part.compute_s * 1e3:>9.2f}"
            f"{part.comm_s * 1e3:>11.2f}"
        )
    if args.json:
        record = {
            "command": "python scripts/ring_terms.py " + " ".join(argv or sys.argv[1:]),
            "mesh": args.mesh,
            "overhead_s": cal.overhead_s,
            "mem_Bps": topo.mem_Bps,
            "kernel_fixed_s": topo.kernel_fixed_s,
            "copy_Bps": topo.copy_Bps,
            "ppermute_points": permute,
            "local": local,
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
