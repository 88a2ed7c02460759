"""The decoders behave like JAX functions: the same program eagerly and under `jax.jit`,
no value inspection, no silent padding, Explicit meshes and `jax.set_mesh`, and states that
`vmap` and `scan` take."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from reference import np_attention

import tree_attention_edu as tae
from tree_attention_edu.core import kernels
from tree_attention_edu.perf import introspect

DECODERS = {
    "tree": tae.tree_decode,
    "tree[allgather]": lambda *a, **kw: tae.tree_decode(*a, merge="allgather", **kw),
    "tree[reduce_scatter]": lambda *a, **kw: tae.tree_decode(*a, merge="reduce_scatter", **kw),
    "ring": tae.ring_decode,
    "ring_pass_q": tae.ring_decode_pass_q,
    "energy": tae.tree_decode_from_energy,
}


def inputs(tk=24, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), dtype)
        for s in ((2, 2, 6, 8), (2, tk, 3, 8), (2, tk, 3, 8))
    )
    return q, k, v


@pytest.mark.codegen
@pytest.mark.parametrize("name", list(DECODERS))
def test_eager_equals_jit_bit_for_bit(name, mesh2x4):
    """Concrete or traced lengths, eagerly or inside the caller's `jit`: one program, the
    same bits."""
    q, k, v = inputs()
    lengths = jnp.array([24, 9])
    fn = DECODERS[name]
    eager = fn(q, k, v, mesh=mesh2x4, causal=True, kv_lengths=lengths)
    jitted = jax.jit(lambda q, k, v, n: fn(q, k, v, mesh=mesh2x4, causal=True, kv_lengths=n))(
        q, k, v, lengths
    )
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    # Lengths that are all full are not detected (that would be value inspection): the
    # masked program runs, and gives the unmasked answer.
    full = fn(q, k, v, mesh=mesh2x4, kv_lengths=jnp.array([24, 24]))
    np.testing.assert_allclose(full, np_attention(q, k, v), rtol=2e-5, atol=2e-5)


@pytest.mark.codegen
def test_lengths_are_clamped_not_checked(mesh8):
    """A length outside [0, Tk] is a value, never inspected: clamped on every path, the
    same eagerly and under `jit`, as `attention` reads it."""
    q, k, v = inputs()
    bad, clamped = jnp.array([-5, 99]), np.array([0, 24])
    want = np_attention(q, k, v, causal=True, kv_lengths=clamped)
    for name, fn in DECODERS.items():
        eager = fn(q, k, v, mesh=mesh8, causal=True, kv_lengths=bad)
        jitted = jax.jit(
            lambda q, k, v, n, fn=fn: fn(q, k, v, mesh=mesh8, causal=True, kv_lengths=n)
        )(q, k, v, bad)
        np.testing.assert_allclose(eager, want, rtol=2e-5, atol=2e-5, err_msg=name)
        np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted), err_msg=name)
    np.testing.assert_allclose(
        tae.attention(q, k, v, causal=True, kv_lengths=bad), want, rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("name", list(DECODERS))
def test_indivisible_length_is_a_clear_error_under_jit_too(name, mesh8):
    q, k, v = inputs(tk=23)
    fn = DECODERS[name]
    msg = r"`kv_len` = 23 keys, which the 8 devices.*tae\.pad_cache\(k, v, 8"
    with pytest.raises(ValueError, match=msg):
        fn(q, k, v, mesh=mesh8)
    with pytest.raises(ValueError, match=msg):
        jax.jit(lambda q, k, v: fn(q, k, v, mesh=mesh8))(q, k, v)


def test_pad_cache_pads_once_and_masks_the_padding(mesh8):
    q, k, v = inputs(tk=23)
    kp, vp, lengths = tae.pad_cache(k, v, mesh8, kv_lengths=jnp.array([23, 5]))
    assert kp.shape[1] == vp.shape[1] == 24 and lengths.tolist() == [23, 5]
    assert not np.any(np.asarray(kp[:, 23:]))  # zeros, masked by the lengths
    out = tae.tree_decode(q, kp, vp, mesh=mesh8, causal=True, kv_lengths=lengths)
    want = np_attention(q, k, v, causal=True, kv_lengths=np.array([23, 5]))
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    kh, _, lh = tae.pad_cache(jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), 8, layout="bhtd")
    assert kh.shape[2] == 24 and lh.tolist() == [23, 23]


def test_padded_cache_under_jit_keeps_one_shard_per_device(mesh8):
    """The cache a step is given stays sharded: each device's compiled arguments are one K/V
    shard (and the small replicated q and lengths), not the whole cache. At Tk = 65,535 the
    cache is padded once to 65,536 by `pad_cache`, outside the step."""
    b, tk, h, d = 1, 65535, 16, 128
    padded = -(-tk // 8) * 8
    kv = NamedSharding(mesh8, P(None, "x"))
    structs = (
        jax.ShapeDtypeStruct((b, 1, h, d), jnp.float32),
        jax.ShapeDtypeStruct((b, padded, h, d), jnp.float32, sharding=kv),
        jax.ShapeDtypeStruct((b, padded, h, d), jnp.float32, sharding=kv),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )
    step = jax.jit(lambda q, k, v, n: tae.tree_decode(q, k, v, mesh=mesh8, kv_lengths=n))
    args = introspect.memory_stats(step, *structs).argument_bytes
    shard = 2 * b * padded // 8 * h * d * 4
    assert shard <= args < 1.01 * shard, (args, shard)


@pytest.mark.cpu_only
def test_explicit_mesh_and_set_mesh():
    """`jax.make_mesh`'s default (Explicit axes) and the ambient `jax.set_mesh` mesh work: the
    inputs are resharded, not refused."""
    q, k, v = inputs()
    want = np_attention(q, k, v, causal=True, kv_lengths=np.array([24, 9]))
    mesh = jax.make_mesh((2, 4), ("node", "gpu"))
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    kw = dict(causal=True, kv_lengths=jnp.array([24, 9]))
    for name, fn in DECODERS.items():
        np.testing.assert_allclose(
            fn(q, k, v, mesh=mesh, **kw), want, rtol=2e-5, atol=2e-5, err_msg=name
        )
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: tae.ring_decode_pass_q(q, k, v, **kw))(q, k, v)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match=r"`mesh` is None and no mesh is set"):
        tae.tree_decode(q, k, v)


@pytest.mark.codegen
def test_ring_output_is_replicated_bit_for_bit(mesh2x4):
    """Every copy of a replicated output is the same bits (the ring's devices fold their
    blocks in different orders; shard 0's result is broadcast)."""
    q, k, v = inputs(tk=64)
    for name, fn in DECODERS.items():
        out = fn(q, k, v, mesh=mesh2x4, causal=True, kv_lengths=jnp.array([64, 29]))
        copies = [np.asarray(s.data) for s in out.addressable_shards]
        if out.sharding.is_fully_replicated:
            assert len(copies) == 8
            assert all(np.array_equal(copies[0], c) for c in copies), name


def test_states_vmap_and_scan():
    """`AttentionState` always carries arrays: `vmap(combine)` and `lax.scan` over stacked
    states work, and give the one-pass answer."""
    q, k, v = inputs(tk=32)
    chunks = [
        tae.local_state(q, k[:, i : i + 8], v[:, i : i + 8], kv_offset=i) for i in range(0, 32, 8)
    ]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *chunks)
    pairs = jax.vmap(tae.combine)(
        jax.tree.map(lambda x: x[:2], stacked), jax.tree.map(lambda x: x[2:], stacked)
    )
    assert pairs.out.shape == (2, 2, 2, 6, 8)
    total, _ = jax.lax.scan(
        lambda c, s: (tae.combine(c, s), None), tae.identity_state(2, 2, 6, 8), stacked
    )
    np.testing.assert_allclose(total.out, np_attention(q, k, v), rtol=2e-5, atol=2e-5)
    assert isinstance(tae.AttentionState.from_lse(chunks[0].out, chunks[0].lse).lse_lo, jax.Array)


@pytest.mark.codegen
def test_empty_plus_empty_is_the_canonical_empty_state():
    """FlashInfer's merge_state (since PR #4401): two empty states merge to (0, -inf), whatever
    their `out` held."""
    garbage = tae.AttentionState(
        jnp.full((1, 1, 2, 3), jnp.nan), jnp.full((1, 1, 2), -jnp.inf), jnp.zeros((1, 1, 2))
    )
    merged = tae.combine(garbage, garbage)
    assert np.array_equal(np.asarray(merged.out), np.zeros((1, 1, 2, 3)))
    assert np.all(np.isneginf(np.asarray(merged.lse)))


def test_flash_refuses_masks_and_says_when_it_is_missing():
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs())
    with pytest.raises(ValueError, match="refuses `kv_lengths`"):
        kernels.flash_state(q, k, v, kv_lengths=jnp.array([3, 4]))
    with pytest.raises(ValueError, match="refuses `kv_lengths` and `causal=True`"):
        kernels.flash_state(q, k, v, causal=True)
    if not kernels.flash.installed():
        with pytest.raises(RuntimeError, match="needs flash-attn-jax, which is not installed"):
            kernels.flash_state(q, k, v)


def test_bayes_solvers_run_under_jit():
    """The Newton solvers are `lax.while_loop`s: the same answer eagerly and under `jit`, and
    NaN (not an exception that `jit` could not raise) where they do not converge."""
    rng = np.random.default_rng(3)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s)) for s in ((1, 1, 2, 4), (1, 12, 2, 4), (1, 12, 2, 3))
    )
    z = tae.attention(q, k, v) * 0.5
    eager = tae.conjugate_energy(z, q, k, v)[0]
    jitted = jax.jit(lambda z, q, k, v: tae.conjugate_energy(z, q, k, v)[0])(z, q, k, v)
    np.testing.assert_allclose(eager, jitted, rtol=1e-12)
    far = jnp.full_like(z, 100.0)  # outside the values' convex hull: F* is +inf there
    assert np.all(np.isnan(np.asarray(tae.conjugate_energy(far, q, k, v)[0])))
    zs, _ = jax.jit(lambda q, k, v: tae.stationary_point(q, k, v))(q, k, v)
    np.testing.assert_allclose(zs, tae.attention(q, k, v), atol=1e-10)
