"""The Bayesian reading of attention, corrected, against independent references.

References used: sympy for the 2×2 saddle block; a float64 numpy/scipy re-implementation of
the per-row log-partition F (explicit loops, `reference.visible_keys`) with scipy's generic
optimisers for the conjugate, its minimiser and the KL projection; finite differences for
gradients; and Monte Carlo for Cramér's theorem.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy as sp
from conftest import rand_qkv, tol
from reference import np_attention, np_attention_state, visible_keys
from scipy import optimize
from scipy.special import logsumexp

import tree_attention_edu as tae
from tree_attention_edu.theory import bayes

# --- an independent per-row reference --------------------------------------------------------


def np_rows(q, k, v, *, scale=None, causal=False, kv_lengths=None):
    """`{(b, i, h): (scores [n], values [n, Dv])}` over the visible keys, float64 loops."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    lengths = np.full(B, Tk) if kv_lengths is None else np.asarray(kv_lengths)
    rows = {}
    for b in range(B):
        for i in range(Tq):
            for h in range(Hq):
                idx = visible_keys(b, i, Tq, Tk, lengths, causal)
                kv = h // (Hq // Hkv)
                rows[b, i, h] = (scale * (k[b, idx, kv] @ q[b, i, h]), v[b, idx, kv])
    return rows


def np_conjugate(s, vals, z):
    """max_ζ z·ζ − logsumexp(s + vals ζ) by scipy's BFGS from ζ = 0: `(value, ζ)`."""

    def neg(zeta):
        logits = s + vals @ zeta
        p = np.exp(logits - logsumexp(logits))
        return logsumexp(logits) - z @ zeta, p @ vals - z

    res = optimize.minimize(
        neg,
        np.zeros(vals.shape[1]),
        jac=True,
        method="BFGS",
        options=dict(gtol=1e-12, maxiter=1000),
    )
    return -res.fun, res.x


def inside_hull(key, q, k, v, **kw):
    """A random z strictly inside each row's convex hull of visible values (Dirichlet mix)."""
    p = np.asarray(jax.random.dirichlet(key, jnp.ones(k.shape[1]), q.shape[:3]))  # [B,Tq,Hq,Tk]
    w = np.asarray(tae.posterior(q, k, **kw)).transpose(0, 2, 1, 3) > 0  # visible keys
    p = np.where(w, p, 0)
    p /= np.where(p.sum(-1, keepdims=True) > 0, p.sum(-1, keepdims=True), 1)
    vh = np.repeat(np.asarray(v), q.shape[2] // v.shape[2], axis=2)  # [B, Tk, Hq, Dv]
    return jnp.asarray(np.einsum("bqhk,bkhv->bqhv", p, vh))


def one_row(seed, Dv=2, Tk=9, D=4):
    return rand_qkv(seed, B=1, Tq=1, Hq=1, Hkv=1, D=D, Dv=Dv, Tk=Tk)


def jax_row(seed, Dv, Tk, D=4):
    """One row drawn by `jax.random` (as `rand_qkv` drew before it moved to NumPy): the
    Monte Carlo test below was sized on these values. Its histogram needs the means of 12
    draws not to bunch on a lattice coarser than a bin (Daniels' density is a continuous
    approximation), which a generic draw gives and some draws do not."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (1, 1, 1, D), jnp.float64)
    k = jax.random.normal(kk, (1, Tk, 1, D), jnp.float64)
    v = jax.random.normal(kv, (1, Tk, 1, Dv), jnp.float64)
    return q, k, v


# --- the paper's stationary point ------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, kv_lengths=np.array([0, 12]))])
def test_stationary_point_is_attention(kw):
    q, k, v = rand_qkv(0)
    z, zeta = tae.stationary_point(q, k, v, **kw)
    np.testing.assert_allclose(z, np_attention(q, k, v, **kw), rtol=0, atol=1e-6)
    np.testing.assert_allclose(zeta, 0.0, atol=1e-9)


def test_stationary_point_does_not_depend_on_start():
    q, k, v = rand_qkv(1)
    a, _ = tae.stationary_point(q, k, v, seed=0)
    b, _ = tae.stationary_point(q, k, v, seed=7)
    np.testing.assert_allclose(a, b, atol=1e-10)


def test_stationary_point_reports_non_convergence_as_nan():
    """A jitted solve cannot raise on a value: unconverged, both results are NaN."""
    q, k, v = rand_qkv(2)
    z, zeta = tae.stationary_point(q, k, v, max_newton=1, tol=1e-300)
    assert np.isnan(np.asarray(z)).all() and np.isnan(np.asarray(zeta)).all()


def test_map_estimate_is_a_deprecated_alias(monkeypatch):
    """It warns, says why in its docstring, and hands every argument to stationary_point."""
    seen = {}
    monkeypatch.setattr(bayes, "stationary_point", lambda *a, **kw: seen.update(a=a, kw=kw))
    q, k, v = rand_qkv(1, B=1, Tq=1)
    with pytest.warns(DeprecationWarning, match="not a MAP estimate"):
        tae.map_estimate(q, k, v, scale=0.5, tol=1e-9, max_newton=3, seed=2)
    assert seen["a"] == (q, k, v)
    assert seen["kw"] == dict(
        scale=0.5, causal=False, kv_lengths=None, tol=1e-9, max_newton=3, seed=2
    )
    assert "not correct" in tae.map_estimate.__doc__


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


# --- it is a saddle, not a maximum of e^{-Γ} --------------------------------------------------


def test_saddle_block_eigenvalues_in_sympy():
    """[[−c, 1], [1, 0]] has eigenvalues (−c ± √(c² + 4))/2, and their product is −1."""
    c, lam = sp.Symbol("c", nonnegative=True), sp.Symbol("lambda")
    block = sp.Matrix([[-c, 1], [1, 0]])
    want = [(-c + sp.sqrt(c**2 + 4)) / 2, (-c - sp.sqrt(c**2 + 4)) / 2]
    got = list(block.eigenvals())
    assert len(got) == 2
    for w in want:  # each claimed eigenvalue is a root of the characteristic polynomial
        assert sp.simplify(block.charpoly(lam).as_expr().subs(lam, w)) == 0
        assert any(sp.simplify(g - w) == 0 for g in got)
    assert sp.simplify(want[0] * want[1] - (-1)) == 0  # det = −1 < 0: one of each sign


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, kv_lengths=np.array([0, 12]))])
def test_gamma_hessian_is_indefinite_for_any_data(kw):
    q, k, v = rand_qkv(4, Dv=3)
    hess = np.asarray(tae.gamma_hessian(q, k, v, **kw))  # [B, Tq, Hq, 6, 6]
    np.testing.assert_allclose(hess, np.swapaxes(hess, -1, -2), atol=1e-14)
    eig = np.linalg.eigvalsh(hess)
    assert (eig.min(-1) < 0).all() and (eig.max(-1) > 0).all()  # every row: a saddle
    # The block formula [[−Σ, I], [I, 0]], with Σ from the independent reference.
    _, _, cov = np_attention_state(q, k, v, **kw)
    eye = np.broadcast_to(np.eye(3), cov.shape)
    want = np.block([[-cov, eye], [eye, np.zeros_like(cov)]])
    np.testing.assert_allclose(hess, want, atol=1e-12)
    c = np.linalg.eigvalsh(cov)
    closed = np.sort(
        np.concatenate([(-c + np.sqrt(c**2 + 4)) / 2, (-c - np.sqrt(c**2 + 4)) / 2], -1), -1
    )
    np.testing.assert_allclose(eig, closed, atol=1e-12)


def test_gamma_is_unbounded_in_both_directions():
    """Γ is linear in z: along z = z* + tζ it grows like t|ζ|², along z* − tζ it falls."""
    q, k, v = rand_qkv(5, B=1, Tq=1)
    att = tae.attention(q, k, v)
    zeta = 0.1 * jnp.ones_like(att)
    g = [float(tae.log_likelihood(att + t * zeta, zeta, q, k, v)) for t in (0, 1e3, 1e6)]
    np.testing.assert_allclose(
        np.diff(g) / np.array([1e3, 1e6 - 1e3]), float(jnp.sum(zeta * zeta)), rtol=1e-9
    )
    assert tae.log_likelihood(att - 1e6 * zeta, zeta, q, k, v) < -1e4


# --- Legendre: F* = max_ζ Γ ------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, kv_lengths=np.array([3, 12]))])
def test_conjugate_energy_matches_a_generic_optimiser(kw):
    q, k, v = rand_qkv(6, Dv=2)
    z = inside_hull(jax.random.key(1), q, k, v, **kw)
    value, zeta = bayes.conjugate_energy(z, q, k, v, **kw)
    for (b, i, h), (s, vals) in np_rows(q, k, v, **kw).items():
        ref, ref_zeta = np_conjugate(s, vals, np.asarray(z[b, i, h]))
        np.testing.assert_allclose(value[b, i, h], ref, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(zeta[b, i, h], ref_zeta, rtol=1e-5, atol=1e-6)


def test_attention_minimises_the_conjugate():
    """argmin_z F*(z) = attention (found by scipy over z), and min F* = −F(0)."""
    q, k, v = one_row(7, Dv=2)
    att = np.asarray(tae.attention(q, k, v))

    def f_star(z):
        value, zeta = bayes.conjugate_energy(jnp.asarray(z).reshape(att.shape), q, k, v)
        return float(value[0, 0, 0]), np.asarray(zeta).ravel()

    start = att.ravel() + np.array([0.2, -0.1])
    res = optimize.minimize(f_star, start, jac=True, method="BFGS", options=dict(gtol=1e-11))
    np.testing.assert_allclose(res.x, att.ravel(), atol=1e-8)
    _, lse, _ = np_attention_state(q, k, v)
    np.testing.assert_allclose(res.fun, -lse[0, 0, 0], rtol=1e-12)
    np.testing.assert_allclose(f_star(att)[0], -lse[0, 0, 0], rtol=1e-13)


def test_gradient_of_the_conjugate_is_the_maximising_zeta():
    """∇F*(z) by central differences equals the ζ that attains the max."""
    q, k, v = rand_qkv(8, Dv=2)
    z = inside_hull(jax.random.key(2), q, k, v)
    _, zeta = bayes.conjugate_energy(z, q, k, v)
    h = 1e-5
    for j in range(2):
        e = jnp.zeros_like(z).at[..., j].set(h)
        up, _ = bayes.conjugate_energy(z + e, q, k, v)
        down, _ = bayes.conjugate_energy(z - e, q, k, v)
        np.testing.assert_allclose((up - down) / (2 * h), zeta[..., j], atol=1e-7)


def test_conjugate_outside_the_hull_is_nan():
    """F* is +inf outside the values' convex hull: the maximisation cannot converge there,
    and the row is NaN rather than a finite number."""
    q, k, v = one_row(9, Dv=1)
    far = jnp.full((1, 1, 1, 1), float(jnp.abs(v).max()) + 1.0)
    value, zeta = bayes.conjugate_energy(far, q, k, v, max_newton=30)
    assert np.isnan(np.asarray(value)).all() and np.isnan(np.asarray(zeta)).all()


# --- Cramér: the rate function ---------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, kv_lengths=np.array([0, 12]))])
def test_rate_function_is_zero_only_at_attention(kw):
    q, k, v = rand_qkv(10, Dv=2)
    att = tae.attention(q, k, v, **kw)
    np.testing.assert_allclose(bayes.rate_function(att, q, k, v, **kw), 0.0, atol=1e-13)
    z = inside_hull(jax.random.key(3), q, k, v, **kw)
    rate = np.asarray(bayes.rate_function(z, q, k, v, **kw))
    _, lse, _ = np_attention_state(q, k, v, **kw)
    visible = np.isfinite(lse)
    assert (rate[visible] > 0).all()
    conj, _ = bayes.conjugate_energy(z, q, k, v, **kw)  # I = F* + F(0)
    np.testing.assert_allclose(rate[visible], (np.asarray(conj) + lse)[visible], atol=1e-12)
    # A row that sees no key: F ≡ 0, so I(0) = 0 and I(z) = +inf elsewhere.
    assert (rate[~visible] == 0).all()  # inside_hull gives z = 0 there
    moved = jnp.where(jnp.asarray(visible)[..., None], z, 1.0)
    assert (np.asarray(bayes.rate_function(moved, q, k, v, **kw))[~visible] == np.inf).all()


def test_rate_function_is_quadratic_near_attention():
    """I(μ + εu) = ½ ε² uᵀΣ⁻¹u (1 + O(ε)): the relative error halves with ε."""
    q, k, v = rand_qkv(11, Dv=2)
    att = tae.attention(q, k, v)
    cov = np.asarray(tae.value_covariance(q, k, v))
    u = np.random.default_rng(4).standard_normal(att.shape)
    quad = 0.5 * np.einsum("...i,...ij,...j->...", u, np.linalg.inv(cov), u)
    errors = []
    for eps in (1e-3, 5e-4):
        rate = np.asarray(bayes.rate_function(att + eps * u, q, k, v))
        errors.append(np.abs(rate / (eps**2 * quad) - 1))
    assert errors[0].max() < 1e-2
    np.testing.assert_allclose(errors[0] / errors[1], 2.0, rtol=0.05)


def test_rate_function_is_the_minimum_kl():
    """I(z) = min{KL(Q‖P): E_Q[v] = z}: by tilting, and by scipy over the simplex."""
    q, k, v = rand_qkv(12, Dv=2)
    z = inside_hull(jax.random.key(5), q, k, v)
    rate = bayes.rate_function(z, q, k, v)
    np.testing.assert_allclose(bayes.min_kl_with_mean(z, q, k, v), rate, rtol=1e-10, atol=1e-13)
    s, vals = np_rows(q, k, v)[0, 0, 0]
    p = np.exp(s - logsumexp(s))
    target = np.asarray(z[0, 0, 0])
    cons = [
        dict(type="eq", fun=lambda x: x.sum() - 1),
        dict(type="eq", fun=lambda x: x @ vals - target),
    ]
    kl = lambda x: float(np.sum(x * (np.log(np.maximum(x, 1e-300)) - np.log(p))))  # noqa: E731
    res = optimize.minimize(
        kl,
        p,
        method="SLSQP",
        bounds=[(0, 1)] * len(p),
        constraints=cons,
        options=dict(ftol=1e-14, maxiter=500),
    )
    assert res.success
    np.testing.assert_allclose(res.fun, rate[0, 0, 0], rtol=1e-5)


def test_tilted_posterior_has_mean_z():
    q, k, v = rand_qkv(13, Dv=2)
    z = inside_hull(jax.random.key(6), q, k, v)
    _, zeta = bayes.conjugate_energy(z, q, k, v)
    tilted = bayes.tilted_posterior(zeta, q, k, v)
    np.testing.assert_allclose(tilted.sum(-1), 1.0, rtol=1e-13)
    mean = jnp.einsum("bhqk,bkhv->bqhv", tilted, jnp.repeat(v, 2, axis=2))
    np.testing.assert_allclose(mean, z, atol=1e-10)
    np.testing.assert_allclose(
        bayes.tilted_posterior(jnp.zeros_like(z), q, k, v),
        tae.posterior(q, k),
        rtol=1e-13,
        atol=1e-15,
    )


def test_sample_means_follow_the_rate_function():
    """Cramér, by Monte Carlo: the histogram of means of n draws matches Daniels' density,
    whose exponent is −n·I(z); fitted against −n·I its log has slope 1."""
    q, k, v = jax_row(14, Dv=1, Tk=12)
    n, num = 12, 400_000
    means = np.asarray(bayes.sample_means(jax.random.key(7), n, num, q, k, v)).ravel()
    counts, edges = np.histogram(means, bins=60)
    mid, width = (edges[1:] + edges[:-1]) / 2, edges[1] - edges[0]
    keep = counts >= 400  # the statistical error of log(count) is about 1/√count
    zs = jnp.asarray(mid[keep]).reshape(1, -1, 1, 1)
    qq = jnp.broadcast_to(q, (1, zs.shape[1], 1, q.shape[3]))  # one query per grid point
    density = np.asarray(bayes.saddlepoint_density(zs, n, qq, k, v)).ravel()
    expected = num * width * density
    # 5σ of the counting noise, plus a few % for the O(1/n) saddle-point and binning error
    assert (np.abs(np.log(counts[keep] / expected)) < 5 / np.sqrt(counts[keep]) + 0.05).all()
    rate = np.asarray(bayes.rate_function(zs, qq, k, v)).ravel()
    prefactor = np.log(density) + n * rate  # the slowly varying part of Daniels' formula
    slope = np.polyfit(-n * rate, np.log(counts[keep] / (num * width)) - prefactor, 1)[0]
    assert abs(slope - 1) < 0.03
    assert keep.sum() >= 20 and (n * rate).max() > 3  # the fit spans e^3 in density


def test_sample_means_draw_only_visible_keys_with_posterior_frequencies():
    """n = 1: each "mean" is one drawn value; its frequencies are the posterior's (4σ), a
    masked key is never drawn, and a row that sees no key gives 0."""
    q, k, v = rand_qkv(19, B=2, Tq=1, Hq=2, Hkv=1, Dv=1, Tk=6)
    v = v + 10 * jnp.arange(6)[None, :, None, None]  # tell the keys apart by their values
    kw = dict(kv_lengths=np.array([0, 4]))
    num = 100_000
    draws = np.asarray(bayes.sample_means(jax.random.key(10), 1, num, q, k, v, **kw))
    np.testing.assert_array_equal(draws[:, 0], 0.0)  # sequence 0 sees no key
    post = np.asarray(tae.posterior(q, k, **kw))  # [B, Hq, Tq, Tk]
    for h in range(2):
        got = draws[:, 1, 0, h, 0]
        freq = np.array([np.mean(got == np.asarray(v)[1, a, 0, 0]) for a in range(6)])
        p = post[1, h, 0]
        assert freq[4:].sum() == 0 and np.isclose(freq.sum(), 1.0, rtol=0, atol=1e-12)
        assert (np.abs(freq - p) <= 4 * np.sqrt(p * (1 - p) / num) + 1e-12).all()


# --- the honest Bayesian statement -----------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, kv_lengths=np.array([0, 12]))])
def test_attention_is_the_bayes_estimate_under_squared_loss(kw):
    q, k, v = rand_qkv(15, Dv=3)
    att, _, cov = np_attention_state(q, k, v, **kw)
    z = jnp.asarray(np.random.default_rng(8).standard_normal(att.shape))
    risk = bayes.posterior_risk(z, q, k, v, **kw)
    bias = np.sum((np.asarray(z) - att) ** 2, -1)
    visible = np.isfinite(np_attention_state(q, k, v, **kw)[1])
    np.testing.assert_allclose(
        np.asarray(risk)[visible], (np.trace(cov, axis1=-2, axis2=-1) + bias)[visible], rtol=1e-12
    )
    at_mean = bayes.posterior_risk(jnp.asarray(att), q, k, v, **kw)
    at_map = bayes.posterior_risk(bayes.hard_attention(q, k, v, **kw), q, k, v, **kw)
    assert (np.asarray(at_mean) <= np.asarray(at_map) + 1e-12).all()
    assert (np.asarray(at_mean)[visible] < np.asarray(at_map)[visible]).all()


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, kv_lengths=np.array([0, 12]))])
def test_hard_attention_is_the_value_of_the_map_memory(kw):
    q, k, v = rand_qkv(16)
    hard = np.asarray(bayes.hard_attention(q, k, v, **kw))
    want = np.zeros_like(hard)
    for (b, i, h), (s, vals) in np_rows(q, k, v, **kw).items():
        if len(s):
            want[b, i, h] = vals[np.argmax(s)]
    np.testing.assert_array_equal(hard, want)


def test_attention_converges_to_hard_attention_as_beta_grows():
    """With scale β/D, |attention − hard| ≤ (n−1)·e^{−βΔ/D}·max|v_a − v*|, Δ the score gap."""
    q, k, v = rand_qkv(17, B=1, Tq=2, Hq=2, Hkv=1)
    D = q.shape[-1]
    hard = bayes.hard_attention(q, k, v)
    rows = np_rows(q, k, v, scale=1.0)
    errors = []
    for beta in (1.0, 10.0, 100.0, 1000.0):
        err = np.abs(np.asarray(tae.attention(q, k, v, scale=beta / D) - hard)).max(-1)
        for (b, i, h), (s, vals) in rows.items():
            top = np.sort(s)[::-1]
            spread = np.abs(vals - vals[np.argmax(s)]).max()
            bound = (len(s) - 1) * np.exp(-beta * (top[0] - top[1]) / D) * spread
            assert err[b, i, h] <= bound + 1e-15
        errors.append(err.max())
    # Converging: the error falls at every step, by over 1e3 from β = 1 to 1000. How fast
    # depends on each row's score gap Δ; the rate is the bound asserted row by row above.
    assert all(np.diff(errors) < 0) and errors[-1] < 1e-3 * errors[0]
    # The MAP memory does not depend on the temperature: the argmax of the scores.
    np.testing.assert_array_equal(bayes.hard_attention(q, k, v, scale=5.0), hard)


def test_posterior_is_normalised_and_its_mean_is_attention():
    q, k, v = rand_qkv(4)
    lengths = jnp.array([0, 9])
    w = tae.posterior(q, k, kv_lengths=lengths, causal=True)  # [B, Hq, Tq, Tk]
    np.testing.assert_allclose(w[1].sum(-1), 1.0, **tol(q.dtype))
    np.testing.assert_array_equal(w[0], 0.0)  # no memory visible: an empty posterior
    mean = jnp.einsum("bhqk,bkhv->bqhv", w, jnp.repeat(v, 2, axis=2))
    np.testing.assert_allclose(
        mean, np_attention(q, k, v, kv_lengths=lengths, causal=True), **tol(q.dtype)
    )


def test_log_evidence_is_energy_minus_log_n():
    """With a uniform prior 1/n, log p(q) = log (1/n) Σ_a e^{s_a} = F(0) − log n."""
    q, k, v = one_row(18, Tk=12)
    s, _ = np_rows(q, k, v)[0, 0, 0]
    f0 = tae.energy(q, k, v, jnp.zeros((1, 1, 1, v.shape[-1])))
    np.testing.assert_allclose(np.log(np.mean(np.exp(s))), f0 - np.log(len(s)), rtol=1e-14)


def test_temperature_sharpens_posterior():
    q, k, _ = rand_qkv(5)
    entropy = []
    for scale in (0.1, 1.0, 10.0):
        w = np.asarray(tae.posterior(q, k, scale=scale))
        entropy.append(-(w * np.log(np.where(w > 0, w, 1))).sum(-1).mean())
    assert entropy[0] > entropy[1] > entropy[2]


# --- arguments -------------------------------------------------------------------------------


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
        tae.stationary_point(q, k, v, tol=0.0)
    with pytest.raises(ValueError, match="`max_newton` must be a positive int"):
        tae.stationary_point(q, k, v, max_newton=0)
    with pytest.raises(TypeError, match="`seed` must be an int"):
        tae.stationary_point(q, k, v, seed=1.5)
    with pytest.raises(TypeError, match="`scale` must be a real number"):
        tae.stationary_point(q, k, v, scale="0.5")
    with pytest.raises(ValueError, match="`z` must have shape"):
        tae.conjugate_energy(att[..., :2], q, k, v)
    with pytest.raises(ValueError, match="`tol` must be > 0"):
        tae.rate_function(att, q, k, v, tol=-1.0)
    with pytest.raises(ValueError, match="`n` must be a positive int"):
        bayes.sample_means(jax.random.key(0), 0, 10, q, k, v)
    with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
        bayes.sample_means(0, 4, 10, q, k, v)
    with pytest.raises(ValueError, match="`zeta` must have shape"):
        tae.gamma_hessian(q, k, v, zeta=att[:1])
