"""Exactness at huge logits: 9 equal logits on 8 simulated devices (exact answer 4.0).

Prints, for logits 1e6, 1e7 and 1e8 in float32, the output of every path, and of the
8-shard reduction under three ways of carrying a state's log-sum-exp:

* single word: lse = m + log l rounded to float32 (the state before the double word);
* double word: (lse, lse_lo), the rounded lse and its rounding error (the package's state);
* wide: lse = m + log l computed and merged in float64.

Run: `.venv/bin/python scripts/extreme_logits.py`
"""

import tree_attention_edu as tae

tae.simulate_devices(8)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # for the "wide" column only; inputs are float32

import jax.numpy as jnp  # noqa: E402

SIZES = [2, 1, 1, 1, 1, 1, 1, 1]  # 9 keys on 8 devices: the first holds two


def reduce_as(states, how):
    if how == "single word":
        states = [tae.AttentionState(s.out, s.lse) for s in states]
    elif how == "wide":
        states = [
            tae.AttentionState(
                s.out.astype(jnp.float64), s.lse.astype(jnp.float64) + s.lse_lo.astype(jnp.float64)
            )
            for s in states
        ]
    return float(tae.tree_reduce(states).out.ravel()[0])


def main():
    mesh = tae.make_mesh(8, "x")
    cols = ["attention", "tree", "ring", "energy", "single word", "double word", "wide"]
    print(f"{'logit':>6} " + " ".join(f"{c:>12}" for c in cols))
    for logit in (1e6, 1e7, 1e8):
        q = jnp.ones((1, 1, 1, 1), jnp.float32)
        k = jnp.full((1, 9, 1, 1), logit, jnp.float32)
        v = jnp.arange(9, dtype=jnp.float32).reshape(1, 9, 1, 1)
        row = [
            tae.attention(q, k, v, scale=1.0),
            tae.tree_decode(q, k, v, mesh=mesh, scale=1.0),
            tae.ring_decode(q, k, v, mesh=mesh, scale=1.0),
            tae.tree_decode_from_energy(q, k, v, mesh=mesh, scale=1.0),
        ]
        row = [float(x.ravel()[0]) for x in row]
        states = tae.chunk_states(q, k, v, SIZES, scale=1.0)
        row += [reduce_as(states, how) for how in cols[4:]]
        print(f"{logit:>6.0e} " + " ".join(f"{x:>12.9g}" for x in row))


if __name__ == "__main__":
    main()
