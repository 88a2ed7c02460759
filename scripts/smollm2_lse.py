"""Per-shard lse statistics of SmolLM2-135M-Instruct over a long prompt, for the one-pass merge.

The long prompt of `tests/data/smollm2_reference.json` (3,259 tokens: a document with one
sentence hidden in it, in the chat template) is run through the model with its cache
sharded over 8 simulated devices, teacher-forced in chunks of 512 tokens with tree
attention (`Generator.teacher_force`). At every layer, for every query position and
head, each device's local state of its own shard is summarised (`model.ShardStats`): its lse
and the largest and smallest nonzero `|out_i|`. `llama.shards.lse_profile` reduces them,
per layer and head, to the ranges notebook 07 needs; this script writes them to
`results/smollm2/lse_stats.json`:

* `shard_lse_min`, `shard_lse_max` `[layers][heads]`: the range of the finite per-shard lse;
* `lse_min`, `lse_max`: the range of the full lse (`log Σ_i exp(lse_i)`);
* `high`, `low` `[layers][heads]`: the largest `lse_i + ln max(|out_i|, 1)` and the smallest
  `lse_i + ln min(|out_i| nonzero, 1)`: what `merges.one_pass_combine` compares with its
  window (`merges.one_pass_window`) with shift 0.

Run (about two minutes on 2 cores; `make model` first):

    python scripts/smollm2_lse.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "results" / "smollm2" / "lse_stats.json"
CHUNK = 512


def main() -> None:
    import tree_attention_edu as tae

    tae.simulate_devices(8)
    import numpy as np

    from tree_attention_edu.llama import gguf_checkpoint as gc
    from tree_attention_edu.llama import model, shards

    reference = json.loads((ROOT / "tests" / "data" / "smollm2_reference.json").read_text())
    ids = np.array(next(p for p in reference["prompts"] if p["name"] == "long")["ids"])
    mesh = tae.make_mesh(8, "x")
    params, cfg = gc.load_gguf(MODEL, mesh=mesh)
    gen = model.Generator(params, cfg, mesh, "tree", prefill_chunk=CHUNK)
    capacity = -(-len(ids) // CHUNK) * CHUNK
    acc = shards.lse_profile(
        gen, ids, CHUNK, progress=lambda a, b: print(f"positions {a}..{b} done", flush=True)
    )
    report = {
        "command": "python scripts/smollm2_lse.py",
        "model": MODEL.name,
        "prompt": "long (tests/data/smollm2_reference.json)",
        "positions": len(ids),
        "devices": mesh.size,
        "chunk": CHUNK,
        "capacity": capacity,
        "layers": cfg.layers,
        "heads": cfg.q_heads,
        **{k: np.round(v, 4).tolist() for k, v in acc.items()},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
