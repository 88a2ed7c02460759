import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand_qkv, tol
from reference import np_attention

import tree_attention_edu as tae


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, kv_lengths=np.array([0, 12]))])
def test_map_estimate_is_attention(kw):
    q, k, v = rand_qkv(0)
    z, zeta = tae.map_estimate(q, k, v, **kw)
    np.testing.assert_allclose(z, np_attention(q, k, v, **kw), rtol=0, atol=1e-6)
    np.testing.assert_allclose(zeta, 0.0, atol=1e-9)


def test_map_estimate_does_not_depend_on_start():
    q, k, v = rand_qkv(1)
    a, _ = tae.map_estimate(q, k, v, seed=0)
    b, _ = tae.map_estimate(q, k, v, seed=7)
    np.testing.assert_allclose(a, b, atol=1e-10)


def test_map_estimate_reports_non_convergence():
    q, k, v = rand_qkv(2)
    with pytest.raises(RuntimeError, match="did not converge"):
        tae.map_estimate(q, k, v, max_newton=1, tol=1e-300)


def test_stationarity_conditions_at_attention():
    """∇Γ vanishes at (z, ζ) = (attention, 0) and not at a perturbed point."""
    q, k, v = rand_qkv(3)
    att = tae.attention(q, k, v)
    grad = jax.grad(tae.log_likelihood, argnums=(0, 1))
    gz, gzeta = grad(att, jnp.zeros_like(att), q, k, v)
    np.testing.assert_allclose(gz, 0.0, atol=1e-14)
    np.testing.assert_allclose(gzeta, 0.0, atol=1e-14)
    _, gzeta = grad(att + 0.1, jnp.zeros_like(att), q, k, v)
    assert np.abs(np.asarray(gzeta)).max() > 0.05


def test_posterior_is_normalised_and_its_mean_is_attention():
    q, k, v = rand_qkv(4)
    lengths = jnp.array([0, 9])
    w = tae.posterior(q, k, kv_lengths=lengths, causal=True)  # [B, Hq, Tq, Tk]
    np.testing.assert_allclose(w[1].sum(-1), 1.0, **tol(q.dtype))
    np.testing.assert_array_equal(w[0], 0.0)  # no memory visible: an empty posterior
    mean = jnp.einsum("bhqk,bkhv->bqhv", w, jnp.repeat(v, 2, axis=2))
    np.testing.assert_allclose(mean, np_attention(q, k, v, kv_lengths=lengths, causal=True),
                               **tol(q.dtype))


def test_temperature_sharpens_posterior():
    q, k, _ = rand_qkv(5)
    entropy = []
    for scale in (0.1, 1.0, 10.0):
        w = np.asarray(tae.posterior(q, k, scale=scale))
        entropy.append(-(w * np.log(np.where(w > 0, w, 1))).sum(-1).mean())
    assert entropy[0] > entropy[1] > entropy[2]


def test_bad_arguments_name_the_argument():
    q, k, v = rand_qkv(6)
    att = tae.attention(q, k, v)
    with pytest.raises(ValueError, match=r"`z` must have shape \[batch, q_len, q_heads, v_dim\]"):
        tae.log_likelihood(att[..., :2], jnp.zeros_like(att), q, k, v)  # was reported as `zeta`
    with pytest.raises(TypeError, match="`z` has dtype int32"):
        tae.log_likelihood(att.astype(jnp.int32), jnp.zeros_like(att), q, k, v)
    with pytest.raises(ValueError, match="`zeta` must have shape"):
        tae.log_likelihood(att, jnp.zeros_like(att)[:1], q, k, v)
    with pytest.raises(ValueError, match="`tol` must be > 0"):
        tae.map_estimate(q, k, v, tol=0.0)
    with pytest.raises(ValueError, match="`max_newton` must be a positive int"):
        tae.map_estimate(q, k, v, max_newton=0)
    with pytest.raises(TypeError, match="`seed` must be an int"):
        tae.map_estimate(q, k, v, seed=1.5)
    with pytest.raises(TypeError, match="`scale` must be a real number"):
        tae.map_estimate(q, k, v, scale="0.5")
