# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 2. Attention as Bayesian retrieval
#
# The energy of notebook 1 has a second reading. The softmax weights are a **posterior over
# which memory a query retrieves**, and attention is the **posterior mean** of the value.
# The paper's appendix C.2 turns this into a likelihood $\Gamma(\zeta, z)$ whose stationary
# point is attention.
#
# **What you will learn**
#
# * attention weights as a posterior $p(a \mid q) \propto \exp(\text{scale}\; q\cdot k_a)$, and
#   attention as $\mathrm{E}[v_a \mid q]$;
# * $\Gamma(\zeta, z) = z\cdot\zeta - F(\zeta)$, its stationary point $\zeta^* = 0$,
#   $z^* = \nabla F(0)$, derived in sympy and solved numerically;
# * how the scale (an inverse temperature) sharpens the posterior;
# * the link to Hopfield networks: retrieval from an associative memory is one attention step.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import sympy as sp

from tree_attention_edu import symbolic

jax.config.update("jax_enable_x64", True)
assert jax.device_count() == 8, jax.devices()

# %% [markdown]
# ## 2.1 The posterior over memories
#
# Treat the keys $k_a$ as memories and the query as noisy evidence. With a uniform prior over
# memories and a likelihood $p(q \mid a) \propto \exp(\text{scale}\; q\cdot k_a)$, Bayes' rule gives
#
# $$p(a \mid q) = \frac{\exp(\text{scale}\; q\cdot k_a)}{\sum_b \exp(\text{scale}\; q\cdot k_b)},$$
#
# the attention weights (`tae.posterior`, shaped `[B, Hq, Tq, Tk]`). Reading out the value of
# the retrieved memory, *on average over the posterior*, is attention:
#
# $$\text{attention}(q) = \sum_a p(a\mid q)\, v_a = \mathrm{E}_{p(a\mid q)}[v_a].$$
#
# The normaliser $\sum_b \exp(\cdot)$ is the evidence, and its log is the energy $F(0)$.

# %%
kq, kk, kv = jax.random.split(jax.random.key(2), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 1, 2, 2, 1, 8, 4, 12
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))

post = tae.posterior(q, k)  # [B, Hq, Tq, Tk]
np.testing.assert_allclose(post.sum(-1), 1.0, rtol=1e-14)
mean = jnp.einsum("bhqk,bkv->bqhv", post, v[:, :, 0])  # posterior mean of the value
np.testing.assert_allclose(mean, tae.attention(q, k, v), rtol=1e-12, atol=1e-14)
print("posterior rows sum to 1; posterior mean of v == attention   ✓")

fig, ax = plt.subplots(figsize=(7, 2.5))
ax.bar(np.arange(Tk), np.asarray(post[0, 0, 0]), color="#1f77b4")
ax.set_xlabel("memory (key) a")
ax.set_ylabel(r"$p(a \mid q)$")
ax.set_title("Posterior over memories for one query")
plt.show()

# %% [markdown]
# *Figure: for one query, the posterior spreads over several memories; attention averages
# their values with these weights instead of committing to the most probable one.*
#
# ## 2.2 The likelihood Γ and its stationary point
#
# Appendix C.2 of the paper writes
#
# $$\Gamma(\zeta, z) = z\cdot\zeta - F(\zeta).$$
#
# Setting both partial derivatives to zero:
#
# * $\partial\Gamma/\partial z = \zeta = 0$, so $\zeta^* = 0$;
# * $\partial\Gamma/\partial\zeta = z - \nabla F(\zeta) = 0$, so $z^* = \nabla F(0)$, which is attention.
#
# (For fixed $z$, $\max_\zeta \Gamma$ is the convex conjugate $F^*(z)$; the stationary point
# pairs the source $\zeta = 0$ with its dual variable, the mean.) sympy solves the two
# conditions in turn:

# %%
for ident in symbolic.stationary_point(3, 2):
    assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
    print(f"{ident.name:>8} = {sp.simplify(ident.lhs)}")

# %% [markdown]
# Numerically, `map_estimate` solves $\nabla\Gamma(z, \zeta) = 0$ by Newton's method from a
# random start. Each Newton step solves $J\,\delta = -\nabla\Gamma$ with GMRES, applying the
# Hessian $J$ of $\Gamma$ only through Jacobian-vector products. It never calls `attention`,
# so agreement with it is evidence, not a tautology.

# %%
lengths = jnp.array([9])
z_star, zeta_star = tae.map_estimate(q, k, v, causal=True, kv_lengths=lengths)
att = tae.attention(q, k, v, causal=True, kv_lengths=lengths)
np.testing.assert_allclose(z_star, att, rtol=0, atol=1e-6)
np.testing.assert_allclose(zeta_star, 0.0, atol=1e-9)
grad_gamma = jax.grad(tae.log_likelihood, argnums=(0, 1))(z_star, zeta_star, q, k, v,
                                                          causal=True, kv_lengths=lengths)
assert max(float(jnp.abs(g).max()) for g in grad_gamma) < 1e-10
print("Newton-GMRES stationary point: z* == attention (to 1e-6), zeta* == 0, grad Gamma == 0   ✓")

# %% [markdown]
# ## 2.3 Temperature sharpens the posterior
#
# The scale is an inverse temperature $\beta$. As $\beta$ grows the posterior concentrates
# on the best-matching memory (MAP retrieval); as $\beta \to 0$ it flattens to the prior.
# We measure the posterior's entropy over a range of $\beta$.

# %%
betas = np.geomspace(0.01, 100, 25)
entropy = []
for beta in betas:
    w = np.asarray(tae.posterior(q, k, scale=float(beta)))
    entropy.append(float(-(w * np.log(np.where(w > 0, w, 1))).sum(-1).mean()))
entropy = np.array(entropy)
assert np.all(np.diff(entropy) < 0)  # strictly sharper as beta grows
assert abs(entropy[0] - np.log(Tk)) < 0.01 and entropy[-1] < 0.05

fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
axes[0].semilogx(betas, entropy, "o-")
axes[0].axhline(np.log(Tk), ls="--", c="0.5", label=r"uniform: $\log T_k$")
axes[0].set_xlabel(r"scale $\beta$ (inverse temperature)")
axes[0].set_ylabel("posterior entropy (nats)")
axes[0].set_title("Entropy falls as the scale grows")
axes[0].legend()
for beta in (0.1, 1.0, 10.0):
    axes[1].plot(np.asarray(tae.posterior(q, k, scale=beta)[0, 0, 0]), "o-", label=fr"$\beta$={beta}")
axes[1].set_xlabel("memory a")
axes[1].set_ylabel(r"$p(a\mid q)$")
axes[1].set_title("The same query at three temperatures")
axes[1].legend()
fig.tight_layout()

# %% [markdown]
# *Figure: left, the posterior's entropy decreases monotonically from $\log T_k$ (uniform) to
# nearly 0 (one memory); right, the posterior of one query at three scales.*
#
# ## 2.4 The link to Hopfield retrieval
#
# A modern Hopfield network (Ramsauer et al., 2020) stores patterns $\xi_1,\dots,\xi_M$ and has
# energy $E(x) = -\beta^{-1}\log\sum_\mu \exp(\beta\, \xi_\mu\cdot x) + \tfrac12 x\cdot x + \text{const}$.
# Its update rule, one step of the concave-convex procedure, is
#
# $$x^{\text{new}} = \sum_\mu \text{softmax}(\beta\, \xi\cdot x)_\mu\; \xi_\mu,$$
#
# which is attention with query $x$, keys = values = the stored patterns and scale $\beta$.
# The log-sum-exp in $E$ is our $F$: retrieval is one gradient step on the energy.
#
# We store $M = 64$ random $\pm1$ patterns of dimension 64, corrupt each by flipping 15% of its signs,
# and retrieve with one attention step. A pattern is retrieved if the nearest stored pattern to
# the output is the original.

# %%
M, dim = 64, 64
patterns = jnp.sign(jax.random.normal(jax.random.key(3), (M, dim)))
flip = jax.random.bernoulli(jax.random.key(4), 0.15, (M, dim))
noisy = jnp.where(flip, -patterns, patterns)


def retrieval_accuracy(beta):
    out = tae.attention(noisy[None, :, None, :], patterns[None, :, None, :],
                        patterns[None, :, None, :], scale=beta)[0, :, 0]  # [M, dim]
    nearest = jnp.argmax(out @ patterns.T, axis=-1)
    return float(jnp.mean(nearest == jnp.arange(M)))


betas_h = [0.001, 0.01, 0.03, 0.1, 0.3, 1.0]
acc = [retrieval_accuracy(b) for b in betas_h]
for b, a in zip(betas_h, acc):
    print(f"beta = {b:<6} retrieval accuracy = {a:.3f}")
assert acc[-1] == 1.0 and acc[0] < acc[-1]

fig, ax = plt.subplots(figsize=(5.5, 3))
ax.semilogx(betas_h, acc, "o-")
ax.set_xlabel(r"scale $\beta$")
ax.set_ylabel("fraction retrieved")
ax.set_title(f"One attention step retrieves {M} stored patterns")
ax.set_ylim(-0.05, 1.05)
plt.show()

# %% [markdown]
# *Figure: at small β the output is a blur of all patterns; above β ≈ 0.1 one attention step
# recovers every corrupted pattern. Notebook 7 shards a much larger memory over devices.*
#
# ## Summary
#
# * The attention weights are a posterior over memories; attention is its mean, and the log
#   evidence is the energy $F$.
# * $\Gamma(\zeta, z) = z\cdot\zeta - F(\zeta)$ is stationary exactly at $\zeta^*=0$,
#   $z^* = \nabla F(0) =$ attention: shown in sympy and found by Newton–GMRES.
# * The scale is an inverse temperature; large scales approach MAP (argmax) retrieval.
# * A modern Hopfield update is one attention step on the stored patterns.
#
# ## Exercises
#
# 1. What is the posterior when every key is identical? Predict, then check.
# 2. Show that $\Gamma$ is concave in $\zeta$ for fixed $z$ (hint: notebook 1's Hessian).
#    Check that the Hessian of $\Gamma$ in $\zeta$ at $\zeta^*$ is negative semi-definite.
# 3. With β = 1, how many flipped signs (out of 64) can a pattern take before retrieval starts
#    failing? Find the first failing level.

# %%
# Answer 1: uniform over the visible keys, whatever the query.
same = jnp.broadcast_to(k[:, :1], k.shape)
np.testing.assert_allclose(tae.posterior(q, same), 1.0 / Tk, rtol=1e-12)

# Answer 2: Hess_zeta Gamma = -Cov <= 0.
hess = -tae.value_covariance(q, k, v)
assert np.linalg.eigvalsh(np.asarray(hess)).max() <= 1e-12


# Answer 3: flip the first n signs of every pattern and find where retrieval first fails.
def accuracy_with_flips(n, beta=1.0):
    corrupted = patterns.at[:, :n].multiply(-1)
    out = tae.attention(corrupted[None, :, None], patterns[None, :, None], patterns[None, :, None],
                        scale=beta)[0, :, 0]
    return float(jnp.mean(jnp.argmax(out @ patterns.T, -1) == jnp.arange(M)))


first_fail = next(n for n in range(dim + 1) if accuracy_with_flips(n) < 1.0)
print("retrieval first fails at", first_fail, "flipped signs of", dim)
assert 0 < first_fail <= dim // 2 + 1
