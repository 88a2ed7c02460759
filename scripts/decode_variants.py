"""What each change to the one-device decode step of SmolLM2 buys, measured side by side.

Three versions of the same float32 decode step at one context, in one process with one CPU
device, each step after one read of the bandwidth probe (`perf.benchmark.DeviceReader`),
the versions interleaved step by step so that a shared machine slows them alike:

* `write-then-attend`: round 2's step. One program writes the step's keys and values into
  the donated cache, then attends over it with the blockwise kernel, which selects the
  padding away in K and V block by block (`xla_state(padding="any")`).
* `read-then-append`: one program reads the cache in one pass, selecting only the scores
  (`padding="finite"`) and merging the step's own key in closed form
  (`forward._attend_then_append`), and a second program appends the keys and values in
  place (`model.append`). One program cannot do both without a copy: XLA copies a buffer
  that one operation updates in place while another reads it whole.
* `+ packed projections`: the same, with each layer's q/k/v and gate/up projections packed
  into one matrix each (`model.pack_projections`), what a one-device `Generator` runs.

It also times the attention alone: the 30 layers' one-pass read of a 4k cache against the
blockwise read (`xla_state` with `padding="finite"` and `"any"`). All versions must give the
same greedy tokens, and the script checks that they do.

Run (about a minute; `make model` first):

    python scripts/decode_variants.py [--context 4096] [--steps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import tree_attention_edu as tae
    from tree_attention_edu.core.kernels import xla_state
    from tree_attention_edu.llama import model, speed
    from tree_attention_edu.llama.gguf_checkpoint import load_gguf
    from tree_attention_edu.perf.benchmark import DeviceReader

    mesh = tae.make_mesh(1, "x")
    params, cfg = load_gguf(MODEL, mesh=mesh)
    gen = model.Generator(params, cfg, mesh, "single")  # packs its own copy
    params = jax.device_put(params, gen._rep)  # on the generator's mesh, not packed
    progs = gen._programs
    key, temp = jax.device_put(jax.random.key(0), gen._rep), jnp.float32(0.0)
    capacity = args.context + args.steps + 2

    def write_then_attend(cache, tok):
        return progs.step(params, cache, tok, key, temp, True)

    def read_then_append(p):
        def run(cache, tok):
            tok, logits, new = progs.read_step(p, cache, tok, key, temp, True)
            return tok, logits, progs.append(cache, new)

        return run

    variants = {
        "write-then-attend": write_then_attend,
        "read-then-append": read_then_append(params),
        "+ packed projections": read_then_append(gen.params),
    }
    state = {}
    for name, run in variants.items():
        cache = speed.synthetic_cache(cfg, 1, capacity, args.context, gen.mesh, jax.random.key(1))
        tok = jax.device_put(jnp.zeros((1,), jnp.int32), gen._rep)
        tok, _, cache = run(cache, tok)  # compiles
        state[name] = [tok, cache, [], []]
    reader = DeviceReader()
    gbs = []
    for _ in range(args.steps):
        for name, run in variants.items():
            tok, cache, times, toks = state[name]
            gbs.append(reader.gbs())
            t0 = time.perf_counter()
            tok, _, cache = run(cache, tok)
            jax.block_until_ready(tok)
            times.append(time.perf_counter() - t0)
            toks.append(int(tok[0]))
            state[name][:2] = tok, cache
    nb = speed.step_bytes(params, cfg, capacity)
    read = statistics.median(gbs)
    roof = nb.machine / (read * 1e9)
    print(
        f"SmolLM2-135M, float32, one CPU device, context {args.context}: "
        f"{nb.machine / 1e6:.0f} MB per step, probe {read:.1f} GB/s, roofline {roof * 1e3:.1f} ms"
        f"\n{'version':<22}{'median ms':>10}{'of roofline':>12}{'tokens/s':>9}"
    )
    base = None
    for name, (_, _, times, _) in state.items():
        med = statistics.median(times)
        base = base or med
        print(
            f"{name:<22}{med * 1e3:>10.1f}{roof / med:>12.0%}{1 / med:>9.2f}"
            f"   ({base / med:.2f}x the first)"
        )
    tokens = [s[3] for s in state.values()]
    assert all(t == tokens[0] for t in tokens), tokens
    print(f"same greedy tokens from all three: {tokens[0][:8]}...")

    # The attention alone: 30 layers over the synthetic cache, one pass against blockwise.
    cache = speed.synthetic_cache(cfg, 1, capacity, args.context, gen.mesh, jax.random.key(2))
    q = jax.random.normal(jax.random.key(3), (1, 1, cfg.q_heads, cfg.head_dim))
    lengths = cache.lengths + 1

    def attention(padding):
        return jax.jit(
            lambda q, layers, n: [
                xla_state(q, k, v, causal=True, kv_lengths=n, layout="bhtd", padding=padding).out
                for k, v in layers
            ]
        )

    fns = {p: attention(p) for p in ("any", "finite")}
    times = {p: [] for p in fns}
    for f in fns.values():
        jax.block_until_ready(f(q, cache.layers, lengths))
    for _ in range(args.steps):
        for p, f in fns.items():
            reader.gbs()
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, cache.layers, lengths))
            times[p].append(time.perf_counter() - t0)
    blockwise, one_pass = (statistics.median(times[p]) for p in ("any", "finite"))
    print(
        f"attention over the cache ({nb.cache / 1e6:.0f} MB, {cfg.layers} layers): blockwise "
        f"{blockwise * 1e3:.1f} ms, one pass {one_pass * 1e3:.1f} ms "
        f"({blockwise / one_pass:.1f}x)"
    )


if __name__ == "__main__":
    main()
