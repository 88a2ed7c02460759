"""Reliability of the numerics on every path: masked data never reaches a result, bad
visible data is never hidden, huge logits stay exact, empty shapes give empty results, and
tree decoding is differentiable.

Every path sees the same problem: `attention`, `local_state`, the xla kernel in both
layouts, the energy, tree (both layouts, both meshes), ring, energy-tree, and the model's
sharded cache. Shapes are fixed per test so that each compiled program is built once.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand_qkv
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tree_attention_edu as tae
from tree_attention_edu.core import kernels
from tree_attention_edu.llama import model
from tree_attention_edu.llama.forward import attend_fn

B, TQ, HQ, HKV, D, TK = 2, 2, 4, 2, 8, 16


def _bhtd(x):
    return jnp.swapaxes(x, 1, 2)


def _paths(mesh8, mesh2x4):
    """name -> f(q, k, v, lengths) for every path that computes attention from a cache."""

    def state_out(fn, layout="bthd"):
        def f(q, k, v, lengths):
            if layout == "bhtd":
                k, v = _bhtd(k), _bhtd(v)
            return fn(q, k, v, kv_lengths=lengths, layout=layout).out

        return f

    def dec(fn, mesh, layout="bthd"):
        def f(q, k, v, lengths):
            if layout == "bhtd":
                k, v = _bhtd(k), _bhtd(v)
            return fn(q, k, v, mesh=mesh, kv_lengths=lengths, layout=layout)

        return f

    return {
        "attention": lambda q, k, v, n: tae.attention(q, k, v, kv_lengths=n),
        "local_state": lambda q, k, v, n: tae.local_state(q, k, v, kv_lengths=n).out,
        "xla_bthd": state_out(kernels.xla_state),
        "xla_bhtd": state_out(kernels.xla_state, "bhtd"),
        "energy_grad": lambda q, k, v, n: tae.attention_from_energy(q, k, v, kv_lengths=n),
        "tree_mesh8": dec(tae.tree_decode, mesh8),
        "tree_mesh2x4_bhtd": dec(tae.tree_decode, mesh2x4, "bhtd"),
        "ring_mesh8": dec(tae.ring_decode, mesh8),
        "ring_mesh2x4_bhtd": dec(tae.ring_decode, mesh2x4, "bhtd"),
        "energy_tree_mesh8": dec(tae.tree_decode_from_energy, mesh8),
    }


@pytest.fixture(scope="module")
def paths(mesh8, mesh2x4):
    return _paths(mesh8, mesh2x4)


@pytest.fixture(scope="module")
def problem():
    return rand_qkv(11, B=B, Tq=TQ, Hq=HQ, Hkv=HKV, D=D, Dv=D, Tk=TK)


GARBAGE = st.sampled_from([np.nan, np.inf, -np.inf, 1e300, -1e300, 3e38])


# ------------------------------------------------------------------ 1. masked data


@settings(max_examples=6)
@given(lengths=st.tuples(st.integers(0, TK - 1), st.integers(0, TK)), k_bad=GARBAGE, v_bad=GARBAGE)
def test_garbage_beyond_lengths_never_reaches_the_output(paths, problem, lengths, k_bad, v_bad):
    q, k, v = problem
    n = jnp.asarray(lengths, jnp.int32)
    pad = (jnp.arange(TK)[None, :] >= n[:, None])[:, :, None, None]  # [B, Tk, 1, 1]
    k_dirty, v_dirty = jnp.where(pad, k_bad, k), jnp.where(pad, v_bad, v)
    want = tae.attention(q, k, v, kv_lengths=n)
    assert np.isfinite(np.asarray(want)).all()
    for name, f in paths.items():
        clean, dirty = f(q, k, v, n), f(q, k_dirty, v_dirty, n)
        np.testing.assert_array_equal(dirty, clean, err_msg=name)
        np.testing.assert_allclose(clean, want, rtol=1e-12, atol=1e-12, err_msg=name)


def test_garbage_beyond_lengths_keeps_the_energy_and_its_gradients_finite(problem):
    q, k, v = problem
    n = jnp.array([4, 9])
    pad = (jnp.arange(TK)[None, :] >= n[:, None])[:, :, None, None]
    zeta = jnp.zeros((B, TQ, HQ, D))
    value_and_grads = jax.value_and_grad(
        lambda q, k, v, z: tae.energy(q, k, v, z, kv_lengths=n), argnums=(0, 1, 2, 3)
    )
    e_clean, g_clean = value_and_grads(q, k, v, zeta)
    e, grads = value_and_grads(q, jnp.where(pad, jnp.nan, k), jnp.where(pad, jnp.inf, v), zeta)
    assert np.isfinite(float(e))
    np.testing.assert_array_equal(e, e_clean)
    for name, g, g0 in zip("qkvz", grads, g_clean, strict=True):
        g, g0 = np.asarray(g), np.asarray(g0)
        if name in "kv":  # gradients of masked slots are exactly zero; of the rest, unchanged
            keep = ~np.broadcast_to(np.asarray(pad), g.shape)
            g, g0 = g[keep], g0[keep]
            assert np.all(np.asarray(grads["qkvz".index(name)])[~keep] == 0), name
        np.testing.assert_array_equal(g, g0, err_msg=name)


def test_garbage_in_the_models_cache_is_never_read(mesh8):
    """Slots past each sequence's length (prefill padding, an earlier sequence) may hold NaN.

    One prefill fills the cache for every method: the one-device generator's, re-sharded
    over the 8 devices for the sharded methods (the partitioning rule is a placement: the
    values are the same). Each method's forward is compiled once, for the clean cache and
    the dirty one alike (the model runs jitted; the kernels' eager paths are the `paths`
    tests' above)."""
    cfg = model.Config(vocab=64, dim=32, layers=1, q_heads=4, kv_heads=2, head_dim=8, hidden=64)
    params = model.init_params(cfg, jax.random.key(0))
    single = model.Generator(params, cfg, mesh8, method="single", prefill_chunk=8)
    _, cache1 = single.prefill([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]], capacity=16)
    sharded, replicated = model.cache_sharding(mesh8), NamedSharding(mesh8, P())
    cache = model.KVCache(
        tuple((jax.device_put(k, sharded), jax.device_put(v, sharded)) for k, v in cache1.layers),
        jax.device_put(cache1.lengths, replicated),
    )
    cap = cache.layers[0][0].shape[2]
    pad = (jnp.arange(cap)[None, :] >= cache.lengths[:, None])[:, None, :, None]
    poison = jax.jit(lambda c: jnp.where(pad, jnp.nan, c), out_shardings=sharded)
    dirty = cache._replace(layers=tuple((poison(k), poison(v)) for k, v in cache.layers))
    tokens = jnp.array([[11], [12]], jnp.int32)
    forward = jax.jit(model.forward, static_argnums=(1, 4, 5))
    placed = jax.device_put(params, replicated)
    for method in model.METHODS:
        attend = attend_fn(method, mesh8)
        clean_logits, _ = forward(placed, cfg, tokens, cache, attend, mesh8)
        dirty_logits, _ = forward(placed, cfg, tokens, dirty, attend, mesh8)
        assert np.isfinite(np.asarray(clean_logits)).all(), method
        np.testing.assert_array_equal(dirty_logits, clean_logits, err_msg=method)
    # One device's decode step reads the cache in one pass first (`forward.read_only_step`).
    cache = cache1
    pad = (jnp.arange(cache.layers[0][0].shape[2])[None, :] >= cache.lengths[:, None])[
        :, None, :, None
    ]
    dirty = model.KVCache(
        tuple((jnp.where(pad, jnp.nan, k), jnp.where(pad, jnp.inf, v)) for k, v in cache.layers),
        cache.lengths + 0,
    )  # step donates
    first = pad & (jnp.arange(2) == 0)[:, None, None, None]  # garbage in sequence 0 only
    mixed = model.KVCache(
        tuple(
            (jnp.where(first, jnp.nan, k), jnp.where(first, jnp.inf, v)) for k, v in cache.layers
        ),
        cache.lengths + 0,
    )
    _, clean_logits, _ = single.step(cache, tokens[:, 0])
    _, dirty_logits, _ = single.step(dirty, tokens[:, 0])
    _, mixed_logits, _ = single.step(mixed, tokens[:, 0])
    assert np.isfinite(np.asarray(clean_logits)).all()
    np.testing.assert_allclose(dirty_logits, clean_logits, rtol=1e-6, atol=1e-6)
    # Only the broken sequence is read again: the other keeps its one-pass result, bit for bit.
    np.testing.assert_array_equal(mixed_logits[1], clean_logits[1])
    np.testing.assert_allclose(mixed_logits[0], clean_logits[0], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ 2. the range of lengths


WIDE_LENGTHS = (np.array([-(2**40), 2**32 + 3], np.int64), np.array([0, 2**32 - 1], np.uint32))


@pytest.mark.codegen
def test_lengths_outside_the_cache_are_clamped_the_same_way_on_every_path(paths, problem):
    """Lengths are values, never inspected (a check would raise eagerly and be skipped under
    `jit`): below 0 acts as 0, above the cache as the cache's length, on every path, and the
    same bits eagerly and under `jit`."""
    q, k, v = problem
    want = tae.attention(q, k, v, kv_lengths=jnp.array([0, TK]))
    for name, f in paths.items():
        bad = jnp.array([-3, TK + 2], jnp.int32)
        eager = f(q, k, v, bad)
        np.testing.assert_allclose(eager, want, rtol=1e-12, atol=1e-12, err_msg=name)
        np.testing.assert_array_equal(jax.jit(f)(q, k, v, bad), eager, err_msg=name)
        # Wide integers saturate before they are narrowed to int32: 2**32 + 3 wrapped to 3
        # once, and uint32 2**32 - 1 to -1. Compiled only on every path (eager shard_map
        # dispatches op by op to 8 device threads, the slow half of this test on a busy
        # machine); eagerly, where numpy lengths take their own branch, on `attention` below.
        for wide in WIDE_LENGTHS:
            np.testing.assert_allclose(
                jax.jit(f)(q, k, v, wide),
                want,
                rtol=1e-12,
                atol=1e-12,
                err_msg=f"{name} {wide.dtype}",
            )
    for wide in WIDE_LENGTHS:  # eagerly: numpy lengths, not a tracer
        np.testing.assert_allclose(
            tae.attention(q, k, v, kv_lengths=wide), want, rtol=1e-12, atol=1e-12
        )
    _, _, n = tae.pad_cache(k[:, :13], v[:, :13], 8, kv_lengths=np.array([2**32 + 1, 5]))
    np.testing.assert_array_equal(n, [13, 5])


# ------------------------------------------------------------------ 3. visible NaN


def test_nan_in_visible_inputs_gives_nan_on_every_path(paths, problem):
    q, k, v = problem
    n = jnp.array([TK, TK - 2])
    for label, (qq, kk, vv) in {
        "q": (q.at[0, :, 1].set(jnp.nan), k, v),
        "k": (q, k.at[0, 3].set(jnp.nan), v),
        "v": (q, k, v.at[0, 5].set(jnp.nan)),
    }.items():
        for name, f in paths.items():
            out = np.asarray(f(qq, kk, vv, n))
            assert np.isnan(out[0]).any(), (label, name)  # batch 0 is poisoned...
            assert np.isfinite(out[1]).all(), (label, name)  # ...and batch 1 is not
        e = tae.energy(qq, kk, vv, jnp.zeros((B, TQ, HQ, D)), kv_lengths=n)
        assert np.isnan(float(e)), label


# ------------------------------------------------------------------ 4. huge logits


@pytest.mark.codegen
@pytest.mark.parametrize("logit", [1e6, 1e7, 1e8])
def test_nine_equal_huge_logits_on_eight_devices_are_exact(mesh8, logit):
    """All weights equal 1/9, so the answer is the mean of 0..8, 4.0. The state once stored
    lse = m + log l in float32, where log l rounded away: tree gave 4.4, ring 3.72 at 1e8."""
    q = jnp.ones((1, 1, 1, 1), jnp.float32)
    k = jnp.full((1, 9, 1, 1), logit, jnp.float32)
    v = jnp.arange(9, dtype=jnp.float32).reshape(1, 9, 1, 1)
    kp, vp, n = tae.pad_cache(k, v, mesh8)  # 16 slots: shard 0 holds 2 keys, 1-3 one each
    kw = dict(mesh=mesh8, scale=1.0, kv_lengths=n)
    got = {
        "attention": tae.attention(q, k, v, scale=1.0),
        "tree": tae.tree_decode(q, kp, vp, **kw),
        "ring": tae.ring_decode(q, kp, vp, **kw),
        "energy": tae.tree_decode_from_energy(q, kp, vp, **kw),
    }
    for name, out in got.items():
        # one float32 rounding of 4.0 at most (sums of nine ones are exact)
        np.testing.assert_allclose(
            np.asarray(out).ravel(), [4.0], rtol=2**-22, atol=0, err_msg=name
        )


@pytest.mark.codegen
def test_merging_huge_lse_states_keeps_the_low_order_part():
    """Two float32 chunk states at lse ~ 1e8: without `lse_lo` the chunk of 2 keys and the
    chunk of 1 key would weigh the same."""
    q = jnp.ones((1, 1, 1, 1), jnp.float32)
    k = jnp.full((1, 3, 1, 1), 1e8, jnp.float32)
    v = jnp.array([0.0, 0.0, 3.0], jnp.float32).reshape(1, 3, 1, 1)
    a, b = tae.chunk_states(q, k, v, [2, 1], scale=1.0)
    assert float(a.lse.ravel()[0]) == float(b.lse.ravel()[0]) == 1e8  # log 2 rounded away...
    assert float(a.lse_lo.ravel()[0]) == pytest.approx(np.log(2), rel=1e-6)  # ...kept here
    np.testing.assert_allclose(tae.combine(a, b).out.ravel(), [1.0], rtol=2**-22)


def test_a_scale_that_overflows_the_dtype_is_refused(paths, problem, mesh8):
    q, k, v = (x.astype(jnp.float32) for x in problem)
    for f in (
        lambda: tae.attention(q, k, v, scale=1e39),
        lambda: tae.tree_decode(q, k, v, mesh=mesh8, scale=1e39),
        lambda: tae.ring_decode(q, k, v, mesh=mesh8, scale=1e39),
        lambda: tae.energy(q, k, v, jnp.zeros((B, TQ, HQ, D), jnp.float32), scale=1e39),
        lambda: kernels.xla_state(q, k, v, scale=1e39),
    ):
        with pytest.raises(ValueError, match=r"`scale`.*overflows float32"):
            f()


def test_logits_that_overflow_give_nan_on_every_path(mesh8):
    q = jnp.full((1, 1, 1, 2), 1e20, jnp.float32)
    k = jnp.full((1, 8, 1, 2), 1e20, jnp.float32)  # q·k = 2e40: inf in float32
    v = jnp.ones((1, 8, 1, 2), jnp.float32)
    outs = [
        tae.attention(q, k, v, scale=1.0),
        tae.tree_decode(q, k, v, mesh=mesh8, scale=1.0),
        tae.ring_decode(q, k, v, mesh=mesh8, scale=1.0),
        tae.tree_decode_from_energy(q, k, v, mesh=mesh8, scale=1.0),
    ]
    for out in outs:
        assert np.isnan(np.asarray(out)).all()


# ------------------------------------------------------------------ 5. empty shapes


@pytest.mark.parametrize("shape", [dict(B=0), dict(Tq=0), dict(Hq=0)])
def test_no_queries_give_an_empty_result(paths, shape, mesh8):
    q, k, v = rand_qkv(12, **{**dict(B=B, Tq=TQ, Hq=HQ, Hkv=HKV, D=D, Dv=D, Tk=TK), **shape})
    n = jnp.full((q.shape[0],), 5, jnp.int32)
    want = (q.shape[0], q.shape[1], q.shape[2], D)
    for name, f in {
        **paths,
        "pass_q": lambda q, k, v, n: tae.ring_decode_pass_q(q, k, v, mesh=mesh8, kv_lengths=n),
    }.items():
        assert f(q, k, v, n).shape == want, name
    # "auto" asks no policy about an empty problem (the cost model refuses a batch of 0)
    assert tae.tree_decode(q, k, v, mesh=mesh8, merge="auto").shape == want


def test_head_dim_zero_is_refused(mesh8):
    q, k, v = rand_qkv(13, D=0)
    for f in (tae.attention, kernels.xla_state, functools.partial(tae.tree_decode, mesh=mesh8)):
        with pytest.raises(ValueError, match="head_dim 0"):
            f(q, k, v)


# ------------------------------------------------------------------ 6. gradients


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
def test_tree_decode_is_differentiable_like_attention(mesh_name, layout, request):
    """float64 gradients in q, k and v equal single-device attention's, with whole shards
    masked (batch 0 has 4 of 16 keys on 8 devices) and a causal block of queries."""
    mesh = request.getfixturevalue(mesh_name)
    q, k, v = rand_qkv(14, B=B, Tq=TQ, Hq=HQ, Hkv=HKV, D=D, Dv=D, Tk=TK)
    n = jnp.array([4, TK])
    c = jnp.asarray(np.random.default_rng(15).standard_normal((B, TQ, HQ, D)))

    def loss(decode, q, k, v):
        if layout == "bhtd" and decode is not tae.attention:
            k, v = _bhtd(k), _bhtd(v)
            return jnp.sum(decode(q, k, v, mesh=mesh, causal=True, kv_lengths=n, layout=layout) * c)
        if decode is tae.attention:
            return jnp.sum(decode(q, k, v, causal=True, kv_lengths=n) * c)
        return jnp.sum(decode(q, k, v, mesh=mesh, causal=True, kv_lengths=n) * c)

    want = jax.grad(functools.partial(loss, tae.attention), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(functools.partial(loss, tae.tree_decode), argnums=(0, 1, 2))(q, k, v)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.codegen
def test_flashinfer_4450_two_keys_at_a_huge_negative_score(mesh8):
    """FlashInfer #4450's case: two valid keys, both scoring -46,341 and holding the same
    value, and 7 of 8 shards empty. Every weight is 1/2, so the output must be that value
    exactly, on every path (the energy path once lost it: its backward re-derived the
    weights from the rounded global lse)."""
    q = jnp.ones((1, 1, 1, 1), jnp.float32)
    k = jnp.full((1, 16, 1, 1), -46341.0, jnp.float32)
    value = jnp.array([0.3, -1.7, 5.0, 1e-3], jnp.float32)
    v = jnp.zeros((1, 16, 1, 4), jnp.float32).at[:, :2].set(value)
    kw = dict(mesh=mesh8, scale=1.0, kv_lengths=jnp.array([2]))
    paths = {
        **{m: functools.partial(tae.tree_decode, merge=m) for m in tae.MERGES},
        "ring": tae.ring_decode,
        "ring_pass_q": tae.ring_decode_pass_q,
        "energy": tae.tree_decode_from_energy,
    }
    for name, f in paths.items():
        np.testing.assert_array_equal(np.asarray(f(q, k, v, **kw))[0, 0, 0], value, err_msg=name)
