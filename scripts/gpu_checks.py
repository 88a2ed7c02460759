"""Gradients through the cuDNN kernel against the xla kernel's, on a GPU (issue 24, item 3).

The loss is `sum(out * c)` of attention over a bfloat16 cache split into `--chunks` chunks
whose states are merged with `combine` (so the lse cotangent flows into the merge weights,
the path that was wrong before round 3), with GQA, `kv_lengths` that leave one chunk empty
for the first sequence, and a causal block of queries. Each kernel's (dq, dk, dv) is
compared with the other's and with a float32 reference: `core.states.local_state` on the
same bf16 inputs cast to float32, differentiated by JAX (no chunks, no merge). Differences
are relative to the largest |gradient| of the reference.

    PYTHONPATH=. python scripts/gpu_checks.py --out /tmp/gpu_checks.json

On a machine without a CUDA GPU the cudnn kernel runs through `implementation="xla"`,
which checks the script, not cuDNN.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# bf16 inputs, float32 accumulation: a gradient element sums Tk products rounded to bf16
# once each, so relative errors near 2^-8 are expected, and a wrong merge weight is O(1).
BF16_REL_TOL = 2e-2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument(
        "--chunks",
        type=int,
        default=4,
        help="chunks merged with `combine`: at least 2, dividing the keys",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes (GQA 4/2 x 32, 256 keys), to check the script anywhere",
    )
    args = p.parse_args(argv)
    B, Tq, Hq, Hkv, D, Tk = (2, 2, 4, 2, 32, 256) if args.quick else (2, 4, 32, 8, 128, 4096)
    if not 2 <= args.chunks <= Tk // 2 or Tk % args.chunks:
        p.error(
            f"--chunks must be at least 2 and divide {Tk} into chunks of 2 keys or more, "
            f"got {args.chunks}"
        )

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tree_attention_edu.core import kernels, states
    from tree_attention_edu.perf import benchmark

    on_gpu = kernels.cudnn.unsupported_reason(jnp.bfloat16, 128, 128) is None
    impl = "cudnn" if on_gpu else "xla"
    chunk = Tk // args.chunks
    keys = jax.random.split(jax.random.key(24), 4)
    q = jax.random.normal(keys[0], (B, Tq, Hq, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, Tk, Hkv, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, Tk, Hkv, D), jnp.bfloat16)
    c = jax.random.normal(keys[3], (B, Tq, Hq, D), jnp.float32)
    lengths = jnp.array([Tk - chunk - 37, Tk])  # the first sequence's last chunk is empty

    def chunked(kernel):
        def loss(q, k, v):
            state = None
            for i in range(args.chunks):
                sl = slice(i * chunk, (i + 1) * chunk)
                s = kernel(
                    q, k[:, sl], v[:, sl], kv_offset=i * chunk, causal=True, kv_lengths=lengths
                )
                state = s if state is None else states.combine(state, s)
            return jnp.sum(state.out.astype(jnp.float32) * c)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def reference(q, k, v):
        out = states.local_state(q, k, v, causal=True, kv_lengths=lengths).out
        return jnp.sum(out * c)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = jax.jit(jax.grad(reference, argnums=(0, 1, 2)))(*f32)
    grads = {
        "cudnn": chunked(lambda *a, **kw: kernels.cudnn_state(*a, implementation=impl, **kw))(
            q, k, v
        ),
        "xla": chunked(kernels.xla_state)(q, k, v),
    }
    report: dict = {
        "device": benchmark.device_info(measure=False),
        "implementation": impl,
        "shape": dict(
            B=B,
            Tq=Tq,
            Hq=Hq,
            Hkv=Hkv,
            D=D,
            Tk=Tk,
            chunks=args.chunks,
            kv_lengths=np.asarray(lengths).tolist(),
        ),
        "tolerance": BF16_REL_TOL,
        "relative_max_abs_difference": {},
    }
    ok = True
    for a, b in (("cudnn", "xla"), ("cudnn", "float32 reference"), ("xla", "float32 reference")):
        ga, gb = grads[a], (ref if b == "float32 reference" else grads[b])
        row = {}
        for name, x, y, r in zip(("dq", "dk", "dv"), ga, gb, ref, strict=True):
            x, y, r = (np.asarray(t, np.float64) for t in (x, y, r))
            row[name] = float(np.abs(x - y).max() / np.abs(r).max())
        report["relative_max_abs_difference"][f"{a} vs {b}"] = row
        ok &= all(np.isfinite(list(row.values()))) and max(row.values()) < BF16_REL_TOL
        print(f"{a:>5} vs {b:<17} " + "  ".join(f"{n} {e:.2e}" for n, e in row.items()))
    report["within_tolerance"] = bool(ok)
    print(f"implementation {impl}; within {BF16_REL_TOL} of the largest gradient: {ok}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
