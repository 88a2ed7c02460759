"""The cost model's single-device part against the recorded H200 kernel times (issue 30's
third target): each streaming kernel's recorded median against
`perf.predict.local_decode_time` on a one-device `Topology` whose parameters come from the
same lease's micro-benchmarks, never from the kernel times themselves:

* `mem_Bps`: the lease's `jnp.sum` read over 2 GiB (`device.measured_gbs`);
* `kernel_fixed_s`: a trivial jitted call timed from Python (the second lease's
  `fixed_cost.trivial_call_s`; the first lease measured none, so 0 there);
* `flops`: NVIDIA's dense peak for the products' type (989 TFLOP/s bf16, 67 TFLOP/s
  float32; `H200_FLOPS`), so a decode step is priced by its bytes.

Only kernels that read the cache once are predicted: the model prices one read of K and V.
Left out, with the reason in the output: the `bthd` XLA forms and `dot_product_attention`
with grouped queries (the second lease measured each writing scratch of at least half the
cache) and float32 `tree_decode` (it runs the blockwise `bthd` walk).

    python scripts/h200_single_device.py --json results/gpu/single-device-check.json

Runs anywhere (it reads the records). Prints every cell's predicted and recorded time and
relative error, and how many are within +-30% at Tk >= 128k and below.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tree_attention_edu.perf import costmodel as cm  # noqa: E402
from tree_attention_edu.perf.predict import local_decode_time  # noqa: E402

H200_FLOPS = {"bfloat16": 989e12, "float32": 67e12}
"""Dense peaks, NVIDIA's H100/H200 datasheet (the H200 has the H100's compute)."""
BAND = 0.3
LONG = 2**17
ITEMSIZE = {"bfloat16": 2, "float32": 4}


def topology(mem_gbs: float, fixed_s: float, dtype: str) -> cm.Topology:
    """One device: no links are used by a local decode."""
    link = cm.Link(0.0, 1e12)
    return cm.Topology(
        nodes=1,
        devices_per_node=1,
        intra=link,
        inter=link,
        mem_Bps=mem_gbs * 1e9,
        flops=H200_FLOPS[dtype],
        kernel_fixed_s=fixed_s,
        name="one H200, from the lease's micro-benchmarks",
    )


def left_out(kernel: str, dtype: str, q_heads: int, kv_heads: int) -> str | None:
    if kernel in ("xla_bthd", "pkg_xla_bthd") or kernel.startswith(("einsum_bthd", "chunk")):
        return "writes scratch of at least half the cache on bthd (second lease)"
    if kernel in ("dot_product_attention", "dpa") and q_heads != kv_heads:
        return "GQA: writes scratch of half the cache (second lease)"
    if kernel == "tree_decode" and dtype == "float32":
        return "runs the blockwise bthd walk in float32"
    return None


def cell(lease, kernel, dtype, seq_len, batch, q_heads, kv_heads, head_dim, kv_bytes, t, topo):
    assert kv_bytes == 2 * batch * seq_len * kv_heads * head_dim * ITEMSIZE[dtype]
    why = left_out(kernel, dtype, q_heads, kv_heads)
    row = {"lease": lease, "kernel": kernel, "dtype": dtype, "seq_len": seq_len,
           "shape": [batch, q_heads, kv_heads, head_dim], "measured_s": t}  # fmt: skip
    if why:
        return row | {"left_out": why}
    pred = local_decode_time(
        batch, seq_len, kv_heads, head_dim, head_dim, q_heads, topo, itemsize=ITEMSIZE[dtype]
    )
    return row | {"predicted_s": pred, "rel_err": pred / t - 1}


def cells() -> list[dict]:
    out = []
    first = json.loads((ROOT / "results/gpu/nvidia_h200.json").read_text())
    gbs1 = first["device"]["measured_gbs"]
    for r in first["bandwidth"]["kernels"].values():
        if "median_s" not in r:
            continue
        topo = topology(gbs1, 0.0, r["dtype"])
        out.append(
            cell(
                1,
                r["kernel"],
                r["dtype"],
                r["seq_len"],
                r["batch"],
                r["q_heads"],
                r["kv_heads"],
                r["head_dim"],
                r["kv_bytes"],
                r["median_s"],
                topo,
            )
        )
    second = json.loads((ROOT / "results/gpu/lease2/forms_fixed_smollm2.json").read_text())
    gbs2, fixed2 = second["device"]["measured_gbs"], second["fixed_cost"]["trivial_call_s"]
    B, Hq, Hkv, D = second["config"]["shape"]
    for r in second["forms"].values():
        if not isinstance(r, dict) or "median_s" not in r:
            continue
        topo = topology(gbs2, fixed2, r["dtype"])
        out.append(
            cell(
                2,
                r["form"],
                r["dtype"],
                r["seq_len"],
                B,
                Hq,
                Hkv,
                D,
                r["kv_bytes"],
                r["median_s"],
                topo,
            )
        )
    return out


def summary(rows: list[dict]) -> dict:
    res = {}
    for name, keep in (("Tk >= 128k", lambda r: r["seq_len"] >= LONG),
                       ("Tk < 128k", lambda r: r["seq_len"] < LONG)):  # fmt: skip
        pred = [r for r in rows if "rel_err" in r and keep(r)]
        res[name] = {"cells": len(pred), "within": sum(abs(r["rel_err"]) <= BAND for r in pred)}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the cells and the summary here")
    args = p.parse_args(argv)
    rows = cells()
    print(f"{'lease':<6}{'kernel':<24}{'dtype':<10}{'Tk':>9}{'measured ms':>13}"
          f"{'predicted ms':>14}{'error':>8}")  # fmt: skip
    for r in rows:
        if "rel_err" in r:
            print(f"{r['lease']:<6}{r['kernel']:<24}{r['dtype']:<10}{r['seq_len']:>9,}"
                  f"{r['measured_s'] * 1e3:>13.3f}{r['predicted_s'] * 1e3:>14.3f}"
                  f"{r['rel_err']:>+8.0%}")  # fmt: skip
    out = summary(rows)
    for name, s in out.items():
        print(f"{name}: {s['within']} of {s['cells']} cells within +-{BAND:.0%}")
    print(f"left out: {sum('left_out' in r for r in rows)} cells (the reasons are in the JSON)")
    if args.json:
        args.json.write_text(json.dumps({"band": BAND, "summary": out, "cells": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
