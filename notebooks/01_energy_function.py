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
# # 1. From logsumexp to the energy function
#
# Tree Attention starts from one observation: softmax attention is the **gradient of a scalar
# energy**. Once attention is a gradient, computing it in parallel reduces to computing a
# log-sum-exp in parallel, and log-sum-exp is associative.
#
# **What you will learn**
#
# * the energy $F(\zeta) = \log \sum_a \exp(q\cdot k_a + \zeta\cdot v_a)$ and why
#   $\partial F/\partial\zeta|_{0}$ is attention (derived in sympy, checked with `jax.grad`);
# * why the Hessian $\partial^2 F/\partial\zeta^2|_0$ is the covariance of the values under the
#   attention weights: $F$ is a cumulant-generating function;
# * the energy of many queries, heads and a causal mask, $F_{\text{tot}}$;
# * what the energy landscape looks like around $\zeta = 0$.
#
# Every claim below is an assertion that would fail if it were false.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # must run before JAX initialises; later notebooks shard over these

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import sympy as sp

from tree_attention_edu import masks, symbolic

jax.config.update("jax_enable_x64", True)  # identities are checked in float64
assert jax.device_count() == 8, jax.devices()
print(jax.device_count(), "devices,", jax.default_backend())

# %% [markdown]
# ## 1.1 The energy and its gradient, symbolically
#
# Take $n$ keys with scores $s_a = \text{scale}\cdot q\cdot k_a$ and values
# $v_a \in \mathbf{R}^d$, and add a *source* $\zeta \in \mathbf{R}^d$ coupled to the values:
#
# $$F(\zeta) = \log \sum_{a=1}^{n} \exp\Big(s_a + \sum_j \zeta_j v_{a,j}\Big).$$
#
# Differentiating the log of a sum of exponentials gives a softmax-weighted average:
#
# $$\frac{\partial F}{\partial \zeta_j}\Big|_{\zeta=0} = \sum_a \underbrace{\frac{e^{s_a}}{\sum_b e^{s_b}}}_{p_a} v_{a,j},$$
#
# which is exactly softmax attention. `tree_attention_edu.symbolic` builds both sides with
# sympy for a small $n$ and $d$; the identity is structural, so small sizes prove the pattern.

# %%
s, v, zeta = symbolic.symbols(3, 2)
F = symbolic.energy_expr(s, v, zeta)
display(sp.Eq(sp.Symbol("F"), F))
for ident in symbolic.gradient_is_attention(3, 2):
    assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
    print(f"{ident.name} at zeta=0  ==  softmax-weighted v   ✓")
ident.rhs

# %% [markdown]
# ## 1.2 The Hessian is a covariance
#
# $F$ is the log of a moment-generating function: $e^{F(\zeta)} / e^{F(0)} = \mathrm{E}_p[e^{\zeta \cdot v}]$.
# Its derivatives at 0 are the **cumulants** of $v$ under $p$: the first is the mean
# (attention), the second the covariance
#
# $$\frac{\partial^2 F}{\partial\zeta_i\partial\zeta_j}\Big|_0 = \mathrm{E}_p[v_i v_j] - \mathrm{E}_p[v_i]\,\mathrm{E}_p[v_j].$$
#
# A covariance is positive semi-definite, so $F$ is **convex** in $\zeta$; we use that in
# notebook 2.

# %%
for ident in symbolic.hessian_is_covariance(3, 2):
    assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
    print(f"{ident.name} at zeta=0  ==  Cov_p(v_i, v_j)   ✓")

# %% [markdown]
# ## 1.3 The same identities, numerically, against autodiff
#
# The package's `energy` is $F_{\text{tot}}$ over a batch, several queries and grouped heads
# (layout `q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`). We check, in float64:
#
# * `attention_from_energy` (which is `jax.grad` of `energy` at $\zeta=0$) against `attention`;
# * `value_covariance` (Hessian-vector products of `energy`) against the hand-derived formula
#   `value_covariance_formula` and against the diagonal blocks of a full `jax.hessian`.

# %%
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 2, 3, 4, 2, 16, 3, 40
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))

att = tae.attention(q, k, v)
grad_att = tae.attention_from_energy(q, k, v)
np.testing.assert_allclose(grad_att, att, rtol=1e-12, atol=1e-14)

cov_autodiff = tae.value_covariance(q, k, v)
cov_formula = tae.value_covariance_formula(q, k, v)
np.testing.assert_allclose(cov_autodiff, cov_formula, rtol=1e-12, atol=1e-14)

zeta0 = jnp.zeros((B, Tq, Hq, Dv))
full = jax.hessian(tae.energy, argnums=3)(q, k, v, zeta0)  # [B,Tq,Hq,Dv, B,Tq,Hq,Dv]
blocks = jnp.stack([jnp.stack([jnp.stack([full[b, i, h, :, b, i, h, :] for h in range(Hq)])
                               for i in range(Tq)]) for b in range(B)])
np.testing.assert_allclose(cov_autodiff, blocks, rtol=1e-12, atol=1e-14)
print("grad F(0) == attention, Hessian == covariance == blocks of jax.hessian   ✓")
print("output shape", att.shape, " covariance shape", cov_autodiff.shape)

# %% [markdown]
# The full Hessian has $(B\,T_q\,H_q\,D_v)^2 = 576$ entries here, but it is block diagonal:
# each $(b, i, h)$ term of $F_{\text{tot}}$ depends only on its own $\zeta_{bih}$. So
# `value_covariance` needs only $D_v$ Hessian-vector products, one per unit vector placed in
# every row at once. The off-diagonal blocks really are zero:

# %%
off_diag = np.asarray(full).reshape(B * Tq * Hq, Dv, B * Tq * Hq, Dv).copy()
for r in range(B * Tq * Hq):
    off_diag[r, :, r, :] = 0
assert np.abs(off_diag).max() == 0.0
eigs = np.linalg.eigvalsh(np.asarray(cov_autodiff))
assert eigs.min() > -1e-12  # a covariance: F is convex in zeta
print(f"off-diagonal blocks are exactly 0; smallest covariance eigenvalue {eigs.min():.3f} >= 0")

# %% [markdown]
# ## 1.4 Many queries, heads and a causal mask
#
# With queries $i$, heads $h$ and a causal mask the energy is
#
# $$F_{\text{tot}}(\zeta) = \sum_b \sum_i \sum_h \log \sum_{a \le \text{pos}(i)} \exp(\text{scale}\, q_{bih}\cdot k_{b,a,h'} + \zeta_{bih}\cdot v_{b,a,h'}),\qquad h' = \lfloor h / (H_q/H_{kv}) \rfloor.$$
#
# The package uses the **decode convention**: the $T_q$ queries are the newest tokens, so
# query $i$ sits at position $L_b - T_q + i$ where $L_b$ is the sequence's length
# (`kv_lengths`). A sequence of length 0 sees nothing: its term is left out of $F$, so its
# gradient, like `attention`'s output, is zero.

# %%
lengths = jnp.array([40, 7])
kw = dict(causal=True, kv_lengths=lengths)
np.testing.assert_allclose(tae.attention_from_energy(q, k, v, **kw), tae.attention(q, k, v, **kw),
                           rtol=1e-12, atol=1e-14)
visible = masks.visible(Tq, Tk, lengths, causal=True)  # [B, Tq, Tk]
print("keys visible to each query of sequence 1 (length 7):", np.asarray(visible[1]).sum(-1))
assert np.asarray(visible[1]).sum(-1).tolist() == [5, 6, 7]

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 1.8))
for b, ax in enumerate(axes):
    ax.imshow(np.asarray(visible[b]), aspect="auto", cmap="Blues", interpolation="nearest")
    ax.set_title(f"sequence {b}: kv_length {int(lengths[b])}, causal, Tq = {Tq}")
    ax.set_xlabel("key position")
    ax.set_ylabel("query")
fig.tight_layout()

# %% [markdown]
# *Figure: which keys each query sees. Queries are the newest tokens, so the last query of a
# sequence sees every valid key and earlier ones see one fewer each.*
#
# ## 1.5 Stable for huge logits
#
# `energy` shifts each log-sum-exp by its row maximum ($\log\sum e^{s_a} = m + \log\sum e^{s_a - m}$,
# proved in notebook 3). Logits of order $10^6$ would overflow `exp` in any dtype; here they
# are harmless:

# %%
f_huge = tae.energy(q * 1e3, k * 1e3, v, zeta0)
g_huge = tae.attention_from_energy(q * 1e3, k * 1e3, v)
assert np.isfinite(f_huge) and np.isfinite(np.asarray(g_huge)).all()
np.testing.assert_allclose(g_huge, tae.attention(q * 1e3, k * 1e3, v), rtol=1e-12, atol=1e-14)
print(f"F with logits ~1e6: {float(f_huge):.6e} (finite), gradient == attention   ✓")

# %% [markdown]
# ## 1.6 The energy landscape
#
# For one query with $D_v = 2$ we can draw $F$ over the $\zeta$ plane. $F$ is convex, and its
# gradient at the origin, the arrow, **is** the attention output.

# %%
q1, k1, v1 = q[:1, :1, :1], k[:1, :, :1], v[:1, :, :1, :2]
grid = jnp.linspace(-2.0, 2.0, 81)
Z1, Z2 = jnp.meshgrid(grid, grid)
zetas = jnp.stack([Z1, Z2], -1).reshape(-1, 1, 1, 1, 2)
F_grid = jax.vmap(lambda z: tae.energy(q1, k1, v1, z))(zetas).reshape(Z1.shape)
out1 = np.asarray(tae.attention(q1, k1, v1)).ravel()
g0 = np.asarray(tae.attention_from_energy(q1, k1, v1)).ravel()
np.testing.assert_allclose(g0, out1, rtol=1e-12)

fig, ax = plt.subplots(figsize=(5.2, 4.4))
cs = ax.contourf(np.asarray(Z1), np.asarray(Z2), np.asarray(F_grid), levels=25, cmap="viridis")
fig.colorbar(cs, label=r"$F(\zeta)$")
ax.quiver(0, 0, g0[0], g0[1], angles="xy", scale_units="xy", scale=1, color="white", width=0.012)
ax.plot(0, 0, "wo")
ax.set_xlabel(r"$\zeta_1$")
ax.set_ylabel(r"$\zeta_2$")
ax.set_title(r"Energy landscape; arrow: $\nabla F(0)$ = attention output")
print("attention output (= gradient at 0):", np.round(out1, 4))

# %% [markdown]
# *Figure: the energy over a 2-D source. The contours are those of a convex function; the
# white arrow is $\nabla_\zeta F(0)$, which equals the attention output printed above.*
#
# ## Summary
#
# * Attention is $\nabla_\zeta F(0)$ for the energy $F(\zeta)=\log\sum_a e^{s_a+\zeta\cdot v_a}$;
#   the Hessian is the value covariance, because $F$ generates cumulants.
# * Both identities are proved in sympy and confirmed against `jax.grad`/`jax.hessian` in float64.
# * $F_{\text{tot}}$ sums one log-sum-exp per batch, query and head; causal masks and
#   per-sequence lengths only change which keys enter each sum.
# * Next: the same energy read as Bayesian retrieval (notebook 2), then why a log-sum-exp
#   can be split across devices (notebook 3).
#
# ## Exercises
#
# 1. As `scale` → 0 every visible key gets the same weight. What does attention become? Check
#    your answer in the cell below.
# 2. The third derivative of $F$ at 0 is the third *central* moment of $v$ (for $d=1$). Prove it
#    with sympy.
# 3. Adding a constant $c$ to every value shifts the source term by $c\,\zeta$. How does
#    $\nabla F(0)$ change? Check numerically.

# %%
# Answer 1: the plain mean of the visible values.
uniform = tae.attention(q, k, v, scale=1e-12)
mean_v = jnp.repeat(v, Hq // Hkv, axis=2).mean(axis=1, keepdims=True)
np.testing.assert_allclose(uniform, jnp.broadcast_to(mean_v, uniform.shape), atol=1e-10)

# Answer 2: d^3F/dzeta^3 at 0 equals E[(v - E v)^3].
s3, v3, z3 = symbolic.symbols(3, 1)
F3 = symbolic.energy_expr(s3, v3, z3)
p3 = [sp.exp(x) / sum(sp.exp(y) for y in s3) for x in s3]
mean3 = sum(pa * va[0] for pa, va in zip(p3, v3))
third = sum(pa * (va[0] - mean3) ** 3 for pa, va in zip(p3, v3))
assert sp.simplify(sp.diff(F3, z3[0], 3).subs(z3[0], 0) - third) == 0

# Answer 3: attention shifts by exactly c (the weights sum to 1).
np.testing.assert_allclose(tae.attention_from_energy(q, k, v + 0.5), att + 0.5, atol=1e-12)
print("exercise answers check out   ✓")
