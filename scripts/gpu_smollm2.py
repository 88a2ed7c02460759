"""SmolLM2-135M-Instruct on one accelerator: the same greedy tokens as on the CPU (issue 24,
item 4).

The reference is `tests/data/smollm2_reference.json`: transformers' float32 greedy tokens
and top-5 logits, which the package reproduces on the CPU for every method
(`tests/test_smollm2.py`, in `make test`). Here the package decodes the same prompts on the
default device (a GPU) with tree attention and with one device's attention, on a one-device
mesh: the three short prompts as one ragged batch, then the 3,259-token one. It prints, per
method and prompt, the tokens that agree and the largest logit difference at the
reference's top-5 ids, under JAX's default float32 matmul precision and under "highest".

    PYTHONPATH=. python scripts/gpu_smollm2.py \
        --model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/smollm2_tokens.json

Decode speed at 4k and 8k against the roofline is `tree-attention-edu speed` (the command
is in results/gpu/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="the GGUF file (make model)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--methods", default="tree,single", help="comma-separated methods")
    p.add_argument(
        "--precisions",
        default="default,highest",
        help="jax_default_matmul_precision values to run under",
    )
    args = p.parse_args(argv)

    import jax
    import numpy as np

    from tree_attention_edu.core.devices import make_mesh
    from tree_attention_edu.llama import gguf_checkpoint as gc
    from tree_attention_edu.llama import model
    from tree_attention_edu.perf import benchmark

    reference = json.loads((ROOT / "tests" / "data" / "smollm2_reference.json").read_text())
    short = [r for r in reference["prompts"] if r["name"] != "long"]
    long = [r for r in reference["prompts"] if r["name"] == "long"]
    mesh = make_mesh(1, "x")
    t0 = time.perf_counter()
    params, cfg = gc.load_gguf(args.model, mesh=mesh)
    load_s = time.perf_counter() - t0
    tok = gc.load_gguf_tokenizer(args.model)
    report: dict = {
        "device": benchmark.device_info(measure=False),
        "load_s": load_s,
        "reference": reference["engine"],
        "runs": [],
    }
    print(f"{report['device']['kind']}: loaded in {load_s:.1f} s")
    all_equal = True
    for precision in args.precisions.split(","):
        with jax.default_matmul_precision(None if precision == "default" else precision):
            for method in args.methods.split(","):
                gen = model.Generator(params, cfg, mesh, method, prefill_chunk=512)
                for batch in (short, long):
                    t0 = time.perf_counter()
                    out = gen.generate(
                        [r["ids"] for r in batch], reference["new_tokens"], key=jax.random.key(0)
                    )
                    seconds = time.perf_counter() - t0
                    for b, r in enumerate(batch):
                        ours = np.take_along_axis(
                            np.asarray(out.logits[b]), np.array(r["top_ids"]), 1
                        )
                        err = float(np.abs(ours - np.array(r["top_logits"])).max())
                        tokens = np.asarray(out.tokens[b]).tolist()
                        same = sum(x == y for x, y in zip(tokens, r["tokens"], strict=True))
                        all_equal &= same == len(tokens)
                        row = dict(
                            precision=precision,
                            method=method,
                            prompt=r["name"],
                            prompt_tokens=len(r["ids"]),
                            equal=same,
                            compared=len(tokens),
                            max_logit_diff=err,
                            seconds_with_compile=seconds,
                            text=tok.decode(tokens),
                        )
                        report["runs"].append(row)
                        print(
                            f"{precision:>8} {method:>6} {r['name']:>5}: {same}/{len(tokens)} "
                            f"tokens equal, max |logit - reference| {err:.1e}  "
                            f"{row['text']!r:.60}"
                        )
    report["all_tokens_equal"] = bool(all_equal)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
