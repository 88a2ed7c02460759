import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand_qkv, tol
from reference import np_attention_state

import tree_attention_edu as tae
from tree_attention_edu.theory.energy import value_covariance_formula

CASES = [dict(), dict(causal=True), dict(causal=True, kv_lengths=np.array([0, 11]))]


@pytest.mark.parametrize("kw", CASES)
def test_gradient_of_energy_is_attention(kw):
    q, k, v = rand_qkv(0)
    out, _, _ = np_attention_state(q, k, v, **kw)
    np.testing.assert_allclose(tae.attention_from_energy(q, k, v, **kw), out, **tol(q.dtype))


@pytest.mark.parametrize("kw", CASES)
def test_hessian_is_covariance(kw):
    q, k, v = rand_qkv(1)
    _, _, cov = np_attention_state(q, k, v, **kw)
    np.testing.assert_allclose(tae.value_covariance(q, k, v, **kw), cov, **tol(q.dtype))
    np.testing.assert_allclose(value_covariance_formula(q, k, v, **kw), cov, **tol(q.dtype))


def test_hessian_matches_full_jax_hessian():
    """The block-extraction trick equals the diagonal blocks of `jax.hessian`."""
    q, k, v = rand_qkv(2, B=1, Tq=2, Hq=2, Hkv=1, Dv=3, Tk=5)
    zeta = jnp.zeros((1, 2, 2, 3))
    full = jax.hessian(tae.energy, argnums=3)(q, k, v, zeta)  # [1,2,2,3, 1,2,2,3]
    blocks = np.stack([[full[0, i, h, :, 0, i, h, :] for h in range(2)] for i in range(2)])
    np.testing.assert_allclose(tae.value_covariance(q, k, v)[0], blocks, **tol(q.dtype))


def test_energy_value_matches_lse_sum():
    q, k, v = rand_qkv(3)
    _, lse, _ = np_attention_state(q, k, v, causal=True)
    f = tae.energy(q, k, v, jnp.zeros((2, 3, 4, 6)), causal=True)
    np.testing.assert_allclose(f, lse.sum(), **tol(q.dtype))


def test_energy_with_source_shifts_scores():
    """F(ζ) equals the energy with values folded into the scores: log Σ exp(s_a + ζ·v_a)."""
    q, k, v = rand_qkv(4, B=1, Tq=1, Hq=1, Hkv=1, D=3, Dv=2, Tk=4)
    zeta = jnp.array([0.3, -0.7]).reshape(1, 1, 1, 2)
    s = (k[0, :, 0] @ q[0, 0, 0]) / np.sqrt(3) + v[0, :, 0] @ zeta[0, 0, 0]
    np.testing.assert_allclose(tae.energy(q, k, v, zeta), np.log(np.exp(s).sum()), rtol=1e-13)


def test_energy_stable_for_huge_logits():
    q, k, v = rand_qkv(5)
    f = tae.energy(q * 1e4, k * 1e4, v, jnp.zeros((2, 3, 4, 6)))
    assert np.isfinite(f)
    g = tae.attention_from_energy(q * 1e4, k * 1e4, v)
    assert np.isfinite(np.asarray(g)).all()


def test_low_precision_energy_gradient():
    for dtype in (jnp.float32, jnp.bfloat16):
        q, k, v = rand_qkv(6, dtype=dtype)
        out, _, _ = np_attention_state(q, k, v)
        got = tae.attention_from_energy(q, k, v)
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), out, **tol(dtype))
