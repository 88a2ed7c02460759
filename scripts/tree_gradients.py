"""float64 gradients of tree (and ring) decoding against single-device attention.

Prints the largest absolute difference of d(loss)/dq, dk, dv on both meshes and both
layouts, with whole shards masked (a sequence of 4 keys out of 13 on 8 devices) and a causal
block of 2 queries.

Run: `.venv/bin/python scripts/tree_gradients.py`
"""

import tree_attention_edu as tae

tae.simulate_devices(8)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402


def main():
    keys = jax.random.split(jax.random.key(14), 4)
    q = jax.random.normal(keys[0], (2, 2, 4, 8), jnp.float64)
    k = jax.random.normal(keys[1], (2, 13, 2, 8), jnp.float64)
    v = jax.random.normal(keys[2], (2, 13, 2, 8), jnp.float64)
    c = jax.random.normal(keys[3], (2, 2, 4, 8), jnp.float64)
    n = jnp.array([4, 13])
    want = jax.grad(
        lambda q, k, v: jnp.sum(tae.attention(q, k, v, causal=True, kv_lengths=n) * c),
        argnums=(0, 1, 2),
    )(q, k, v)
    meshes = {"8": tae.make_mesh(8, "x"), "2x4": tae.make_mesh((2, 4), ("node", "gpu"))}
    print(
        f"{'method':<6} {'mesh':<5} {'layout':<6} {'max|dq diff|':>13} {'max|dk diff|':>13} "
        f"{'max|dv diff|':>13}"
    )
    for name, decode in (("tree", tae.tree_decode), ("ring", tae.ring_decode)):
        for mesh_name, mesh in meshes.items():
            for layout in ("bthd", "bhtd"):

                def loss(q, k, v, decode=decode, mesh=mesh, layout=layout):
                    if layout == "bhtd":
                        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
                    out = decode(q, k, v, mesh=mesh, causal=True, kv_lengths=n, layout=layout)
                    return jnp.sum(out * c)

                got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
                diffs = [float(jnp.abs(g - w).max()) for g, w in zip(got, want, strict=True)]
                print(
                    f"{name:<6} {mesh_name:<5} {layout:<6} "
                    + " ".join(f"{d:>13.2e}" for d in diffs)
                )


if __name__ == "__main__":
    main()
