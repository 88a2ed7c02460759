"""flash-attn-jax, once (issue 33, item 5): does `kernels.flash_state` run beside the
machine's JAX and CUDA, and what does it give against `xla_state`?

    PYTHONPATH=.:/tmp/fa_site python scripts/gpu_flash_once.py --out flash.json

The JSON holds the import's outcome (the exact error if it fails), and for each Tk the
largest |out difference| over max|v| and |lse difference| against `xla_state` on the same
bf16 inputs, with both kernels' median times and `(K + V bytes) / time`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seq-lens", default="16384,131072")
    args = p.parse_args(argv)
    rec: dict = {}

    def save():
        args.out.write_text(json.dumps(rec, indent=1, default=str))

    try:
        from importlib import metadata

        import flash_attn_jax  # noqa: F401

        rec["import"] = {"ok": True, "version": metadata.version("flash-attn-jax")}
    except BaseException:
        rec["import"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
    save()
    import jax
    import jax.numpy as jnp

    from tree_attention_edu.core.kernels import flash, flash_state, xla_state

    rec["jax"] = jax.__version__
    rec["version_reason"] = flash.version_reason()
    rec["available"] = flash.available()
    B, Hq, Hkv, D = 8, 32, 8, 128
    for Tk in (int(x) for x in args.seq_lens.split(",")):
        row: dict = {"seq_len": Tk}
        rec[f"Tk={Tk}"] = row
        try:
            kq, kk, kv = jax.random.split(jax.random.key(0), 3)
            q = jax.random.normal(kq, (B, 1, Hq, D), jnp.bfloat16)
            k = jax.random.normal(kk, (B, Tk, Hkv, D), jnp.bfloat16)
            v = jax.random.normal(kv, (B, Tk, Hkv, D), jnp.bfloat16)
            fns = {"flash": jax.jit(flash_state), "xla": jax.jit(xla_state)}
            outs = {}
            for name, fn in fns.items():
                try:
                    st = jax.block_until_ready(fn(q, k, v))
                    times = []
                    for _ in range(7):
                        t0 = time.perf_counter()
                        jax.block_until_ready(fn(q, k, v))
                        times.append(time.perf_counter() - t0)
                    t = statistics.median(times)
                    outs[name] = st
                    row[name] = {"median_s": t, "gbs": 2 * k.nbytes / t / 1e9}
                except BaseException:
                    row[name] = {"error": traceback.format_exc()[-3000:]}
            if len(outs) == 2:
                f, x = outs["flash"], outs["xla"]
                vmax = float(jnp.abs(v.astype(jnp.float32)).max())
                row["out_diff_over_max_v"] = float(
                    jnp.abs(f.out.astype(jnp.float32) - x.out).max() / vmax
                )
                row["lse_diff"] = float(jnp.abs(f.lse - x.lse).max())
        except BaseException:
            row["error"] = traceback.format_exc()[-3000:]
        print(Tk, {k: v for k, v in row.items() if k != "error"}, flush=True)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
