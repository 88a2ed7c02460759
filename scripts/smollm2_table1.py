"""The paper's Table 1 in shape, with SmolLM2-135M-Instruct on 8 simulated CPU devices.

The paper (Section 6.4, Table 1) times "decoding (with prefill) 10 tokens" of Llama 3.1-8B
at 32k-256k tokens on 8 H100s, tree against ring. This script times the same protocol at 1k,
2k, 4k and 8k tokens: a prefill of the prompt, then 10 greedy tokens (the first from the
prefill's logits, 9 decode steps), with tree, ring and single-device attention, and writes
`results/smollm2/table1.json`, which notebook 07 reads.

* tree: tree prefill, tree decoding, on 8 simulated devices;
* ring: tree prefill, then ring decoding (a ring prefill folds every block of K/V on every
  device for each chunk's replicated queries: 8x the attention work here, tens of minutes
  at 8k on 2 cores);
* single: everything on one device.

Each (method, context) is warmed up first (a one-chunk prompt with the same cache capacity
compiles the prefill and the decode step), then timed `--repeats` times, the methods
interleaved in each round so that other work on the machine slows them alike; the JSON
keeps every run and the notebook quotes medians. The prompt is the long reference prompt of
`tests/data/smollm2_reference.json` (a document with a sentence hidden in it), repeated and
cut to the context length.

Run (about an hour on 2 shared cores; `make model` first):

    python scripts/smollm2_table1.py --contexts 1024,2048,4096,8192 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "results" / "smollm2" / "table1.json"
METHODS = ("tree", "ring", "single")
NEW_TOKENS = 10
CHUNK = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="1024,2048,4096,8192")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]

    import tree_attention_edu as tae

    tae.simulate_devices(8)
    import jax

    from tree_attention_edu.llama import gguf_checkpoint as gc
    from tree_attention_edu.llama import model

    reference = json.loads((ROOT / "tests" / "data" / "smollm2_reference.json").read_text())
    long_ids = next(p for p in reference["prompts"] if p["name"] == "long")["ids"]
    mesh = tae.make_mesh(8, "x")
    params, cfg = gc.load_gguf(MODEL, mesh=mesh)
    out_path = Path(args.out)
    report = json.loads(out_path.read_text()) if out_path.is_file() else {"runs": []}
    report |= {
        "command": "python scripts/smollm2_table1.py --contexts "
        f"{args.contexts} --repeats {args.repeats}",
        "model": MODEL.name,
        "devices": 8,
        "new_tokens": NEW_TOKENS,
        "prefill_chunk": CHUNK,
        "prefill": {"tree": "tree", "ring": "tree", "single": "single"},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "processor": platform.processor(),
        },
    }
    report["runs"] = [r for r in report["runs"] if r["context"] not in contexts]
    key = jax.random.key(0)
    for context in contexts:
        prompt = (long_ids * (context // len(long_ids) + 1))[:context]
        capacity = -(-context // CHUNK) * CHUNK + NEW_TOKENS
        gens = {
            m: model.Generator(
                params,
                cfg,
                mesh,
                m,
                prefill_chunk=CHUNK,
                prefill_method="tree" if m == "ring" else None,
            )
            for m in METHODS
        }
        for gen in gens.values():  # compile prefill and step for this capacity
            gen.generate([prompt[:CHUNK]], 2, key=key, capacity=capacity, progress=False)
        runs = {
            m: {
                "context": context,
                "method": m,
                "command": report["command"],
                "total_s": [],
                "prefill_s": [],
                "decode_s": [],
            }
            for m in METHODS
        }
        tokens = {}
        for r in range(args.repeats):
            order = METHODS[r % 3 :] + METHODS[: r % 3]
            for m in order:
                t0 = time.perf_counter()
                out = gens[m].generate(
                    [prompt], NEW_TOKENS, key=key, capacity=capacity, progress=False
                )
                total = time.perf_counter() - t0
                runs[m]["total_s"].append(total)
                runs[m]["prefill_s"].append(out.prefill_s)
                runs[m]["decode_s"].append(float(sum(out.step_s)))
                tokens[m] = out.tokens[0].tolist()
                print(
                    f"{context:>5} {m:>6} round {r}: total {total:6.1f} s (prefill "
                    f"{out.prefill_s:6.1f} s, {len(out.step_s)} decode steps "
                    f"{sum(out.step_s):5.2f} s)",
                    flush=True,
                )
        for m in METHODS:
            runs[m]["tokens"] = tokens[m]
            runs[m]["same_tokens_as_single"] = tokens[m] == tokens["single"]
            runs[m]["median_total_s"] = statistics.median(runs[m]["total_s"])
            runs[m]["median_decode_s"] = statistics.median(runs[m]["decode_s"])
            report["runs"].append(runs[m])
        assert all(runs[m]["same_tokens_as_single"] for m in METHODS), tokens
        del gens
        report["runs"].sort(key=lambda r: (r["context"], METHODS.index(r["method"])))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out_path}", flush=True)


if __name__ == "__main__":
    main()
