import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand_qkv, tol
from reference import np_attention, np_attention_state

import tree_attention_edu as tae

CASES = [
    dict(),
    dict(causal=True),
    dict(kv_lengths=np.array([5, 17])),
    dict(causal=True, kv_lengths=np.array([0, 9])),
    dict(scale=0.3),
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32, jnp.bfloat16])
def test_attention_matches_numpy(kw, dtype):
    q, k, v = rand_qkv(0, dtype=dtype)
    out = tae.attention(q, k, v, **kw)
    assert out.dtype == dtype
    ref = np_attention(q, k, v, **kw)  # float64 reference on the same rounded inputs
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, **tol(dtype))


@pytest.mark.parametrize("ratio", [1, 2, 4])  # MHA, GQA, MQA (Hkv = 1)
def test_gqa_head_mapping(ratio):
    q, k, v = rand_qkv(1, Hq=4, Hkv=4 // ratio)
    np.testing.assert_allclose(tae.attention(q, k, v), np_attention(q, k, v), **tol(q.dtype))
    # Query head h reads kv head h // ratio: repeating kv heads gives the MHA answer.
    rep = tae.attention(q, jnp.repeat(k, ratio, axis=2), jnp.repeat(v, ratio, axis=2))
    np.testing.assert_allclose(tae.attention(q, k, v), rep, **tol(q.dtype))


def test_matches_jax_dot_product_attention():
    q, k, v = rand_qkv(2, Dv=8, dtype=jnp.float32)
    with jax.default_matmul_precision("highest"):  # JAX's own default is TF32 on GPUs
        want = jax.nn.dot_product_attention(q, k, v)
    np.testing.assert_allclose(tae.attention(q, k, v), want, **tol(jnp.float32))


def test_single_key():
    q, k, v = rand_qkv(3, Tk=1)
    np.testing.assert_allclose(
        tae.attention(q, k, v), jnp.repeat(v, 2, axis=2)[:, :1].repeat(3, 1), **tol(q.dtype)
    )


def test_zero_length_sequence_gives_zeros_and_no_nan():
    q, k, v = rand_qkv(4)
    lengths = jnp.array([0, 17])
    out = tae.attention(q, k, v, kv_lengths=lengths, causal=True)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(out[0], 0.0)  # documented: an empty sum
    state = tae.local_state(q, k, v, kv_lengths=lengths)
    assert np.all(np.isneginf(state.lse[0]))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_huge_logits_are_stable(dtype):
    q, k, v = rand_qkv(5, dtype=dtype)
    out = tae.attention(q * 1e3, k * 1e3, v)  # logits ~ 1e6: naive exp overflows
    ref = np_attention(q * 1e3, k * 1e3, v)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, **tol(dtype))


def test_local_state_lse_matches_reference():
    q, k, v = rand_qkv(6)
    state = tae.local_state(q, k, v, causal=True)
    _, lse, _ = np_attention_state(q, k, v, causal=True)
    np.testing.assert_allclose(state.lse, lse, **tol(q.dtype))


def test_lse_matches_jax_residual():
    """`jax.nn.dot_product_attention(return_residual=True)` returns the same lse."""
    q, k, v = rand_qkv(7, Dv=8, dtype=jnp.float32)
    with jax.default_matmul_precision("highest"):  # JAX's own default is TF32 on GPUs
        _, res = jax.nn.dot_product_attention(q, k, v, return_residual=True)
    state = tae.local_state(q, k, v)
    np.testing.assert_allclose(state.lse, res, **tol(jnp.float32))
