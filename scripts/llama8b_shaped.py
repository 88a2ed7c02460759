"""Decode a Llama-3.1-8B-shaped model from a checkpoint on disk, with tree attention on 8
simulated devices: tokens/s and memory, as far as a small CPU machine allows.

The model has Llama-3.1-8B's shapes (dim 4096, 32 query / 8 kv heads of 128, SwiGLU 14336,
vocabulary 128256, untied embeddings, rope theta 500000 with the "llama3" scaling) but only
`--layers` of its 32 layers, and random weights. They are written as a Hugging Face
checkpoint in bfloat16 (sharded, with an index) by a child process, then loaded by
`checkpoint.load_checkpoint` like any other checkpoint, replicated on the mesh, and decoded
with `model.Generator` (tree prefill, tree decoding).

    python scripts/llama8b_shaped.py --context 8192 --new-tokens 10 --json out/llama8b.json

Reported: load time; weights in memory (float32, as the loader converts bf16 by default);
the KV cache; prefill time and tokens/s; decode tokens/s (median step after the first);
resident memory after loading and at the peak (`resource.getrusage`).

On 8 simulated devices every device computes the replicated projections and MLP of each
decode step, as every GPU does in the paper's setting; here the 8 share 2 cores, so a
decode step reads the weights 8 times over one memory bus. Prefill splits each chunk's
tokens across the devices, so it does each token's work once.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(
    vocab=128256,
    dim=4096,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    hidden=14336,
    rope_theta=500000.0,
    norm_eps=1e-5,
    tie_embeddings=False,
)


def _rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e9


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux


def write(folder: Path, layers: int, seed: int) -> None:
    """Random bf16 weights of the 8B shape: Linear ~ N(0, 1/fan_in), embeddings ~ N(0, 1),
    norm gains 1, written shard by shard (2 GB files)."""
    import ml_dtypes
    import numpy as np

    from tree_attention_edu.llama import checkpoint, model

    cfg = model.Config(layers=layers, rope_scaling=model.RopeScaling(), **SHAPE)
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16

    def dense(shape, fan_in):
        return (rng.standard_normal(shape, np.float32) / math.sqrt(fan_in)).astype(bf16)

    qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    ones = np.ones(cfg.dim, bf16)
    params = dict(
        embed=rng.standard_normal((cfg.vocab, cfg.dim), np.float32).astype(bf16),
        layers=[
            dict(
                attn_norm=ones,
                wq=dense((cfg.dim, qd), cfg.dim),
                wk=dense((cfg.dim, kd), cfg.dim),
                wv=dense((cfg.dim, kd), cfg.dim),
                wo=dense((qd, cfg.dim), qd),
                mlp_norm=ones,
                w_gate=dense((cfg.dim, cfg.hidden), cfg.dim),
                w_up=dense((cfg.dim, cfg.hidden), cfg.dim),
                w_down=dense((cfg.hidden, cfg.dim), cfg.hidden),
            )
            for _ in range(layers)
        ],
        final_norm=ones,
        unembed=dense((cfg.dim, cfg.vocab), cfg.dim),
    )
    checkpoint.save_checkpoint(folder, params, cfg, max_shard_bytes=2_000_000_000)


def run(args) -> dict:
    import tree_attention_edu as tae

    tae.simulate_devices(args.devices)
    import jax
    import numpy as np

    from tree_attention_edu.llama import checkpoint, model

    mesh = tae.make_mesh(args.devices, "x")
    info = checkpoint.inspect_checkpoint(args.dir)
    t0 = time.perf_counter()
    params, cfg = checkpoint.load_checkpoint(args.dir, mesh=mesh)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    rss_loaded = _rss_gb()
    print(
        f"loaded {info.num_params:,} weights ({info.stored_bytes / 1e9:.2f} GB of bf16 in "
        f"{len({t.file for t in info.tensors.values()})} files) in {load_s:.1f} s as float32: "
        f"{weights / 1e9:.2f} GB, replicated on {mesh.size} devices; RSS {rss_loaded:.2f} GB",
        flush=True,
    )

    prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab, args.context).tolist()
    gen = model.Generator(
        params, cfg, mesh, args.method, prefill_chunk=args.prefill_chunk, prefill_method=args.method
    )
    out = gen.generate([prompt], args.new_tokens, key=jax.random.key(0), progress=True)
    capacity = gen._padded(args.context) + args.new_tokens
    capacity = -(-capacity // mesh.size) * mesh.size
    cache = 2 * cfg.layers * capacity * cfg.kv_heads * cfg.head_dim * 4
    steady = out.step_s[1:] or out.step_s
    per_token = statistics.median(steady)
    report = dict(
        method=args.method,
        layers=cfg.layers,
        context=args.context,
        new_tokens=args.new_tokens,
        devices=mesh.size,
        prefill_chunk=args.prefill_chunk,
        params=info.num_params,
        checkpoint_bytes_bf16=info.stored_bytes,
        weights_bytes_f32=weights,
        kv_cache_bytes=cache,
        kv_cache_capacity=capacity,
        load_s=load_s,
        prefill_s=out.prefill_s,
        prefill_tokens_per_s=args.context / out.prefill_s,
        decode_step_s=per_token,
        decode_tokens_per_s=1 / per_token,
        prefill_plus_tokens_s=out.prefill_s + sum(out.step_s),
        rss_after_load_gb=rss_loaded,
        peak_rss_gb=_peak_rss_gb(),
        tokens=out.tokens[0].tolist(),
        step_s=out.step_s,
    )
    print(
        f"context {args.context}: prefill ({args.method}, chunks of {args.prefill_chunk}) "
        f"{out.prefill_s:.1f} s = {report['prefill_tokens_per_s']:.0f} tokens/s; decode "
        f"{per_token:.2f} s per token = {1 / per_token:.2f} tokens/s (median of "
        f"{len(steady)} steps); prefill + {args.new_tokens} tokens "
        f"{report['prefill_plus_tokens_s']:.1f} s"
    )
    print(
        f"memory: weights {weights / 1e9:.2f} GB (float32), KV cache {cache / 1e6:.0f} MB "
        f"({capacity} positions), RSS after load {rss_loaded:.2f} GB, peak RSS "
        f"{report['peak_rss_gb']:.2f} GB"
    )
    print("tokens:", report["tokens"])
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("/tmp/llama8b_shaped"),
        help="the checkpoint folder (written first if it holds no config.json)",
    )
    p.add_argument("--layers", type=int, default=2, help="decoder layers (Llama-3.1-8B: 32)")
    p.add_argument("--context", type=int, default=8192, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=10, help="tokens decoded")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--prefill-chunk", type=int, default=1024, help="prompt tokens per step")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt")
    p.add_argument(
        "--method",
        choices=("tree", "single", "ring"),
        default="tree",
        help="attention of prefill and decoding (single: one device)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.write_only:
        write(args.dir, args.layers, args.seed)
        return 0
    if not (args.dir / "config.json").is_file():
        t0 = time.perf_counter()
        print(
            f"writing a {args.layers}-layer 8B-shaped bf16 checkpoint to {args.dir} "
            "(in a child process, so that this one's peak memory is the decoder's)",
            flush=True,
        )
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--write-only",
                "--dir",
                str(args.dir),
                "--layers",
                str(args.layers),
                "--seed",
                str(args.seed),
            ],
            check=True,
        )
        print(f"written in {time.perf_counter() - t0:.0f} s", flush=True)
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
