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
# **Prerequisites.** Softmax attention (queries, keys, values); partial derivatives; mean and
# covariance of a discrete distribution; `jax.grad`. This is the first notebook of the
# course: nothing earlier is needed.
#
# **Time.** About 30 minutes to read and run.
#
# **Learning objectives.** After this notebook you can
#
# * write down the energy $F(\zeta) = \log \sum_a \exp(q\cdot k_a + \zeta\cdot v_a)$ and show
#   that $\partial F/\partial\zeta|_{0}$ is attention (derived in sympy, checked with `jax.grad`);
# * explain why the Hessian $\partial^2 F/\partial\zeta^2$ is a covariance of the values, so
#   that $F$ is convex: $F$ is a cumulant-generating function;
# * write the energy of many queries, heads and a causal mask, $F_{\text{tot}}$, and say why
#   its Hessian is block diagonal;
# * read the energy landscape around $\zeta = 0$.
#
# Every claim below is an assertion that would fail if it were false.
#
# **Where it runs.** The first cell asks JAX for 8 simulated CPU devices and pins JAX to the
# CPU, so the notebook runs on those CPU devices even on a GPU runtime; a GPU, if present, is
# not used. This notebook needs only one device; later notebooks shard over all 8.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises; later notebooks shard over these

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import sympy as sp
from IPython.display import Markdown
from tree_attention_edu.attention import weights

from tree_attention_edu.core import masks
from tree_attention_edu.theory import symbolic

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
# which is exactly softmax attention. `tree_attention_edu.theory.symbolic` builds both sides with
# sympy for a small $n$ and $d$. The derivation has the same form for every $n$ and $d$, so a
# small case shows the pattern; the numerical checks below use larger sizes.
# (The paper writes no scale, i.e. scale 1; this package's default is $1/\sqrt{D}$. The scale
# only multiplies the scores, so nothing below depends on it.)

# %%
s, v, zeta = symbolic.symbols(3, 2)
F = symbolic.energy_expr(s, v, zeta)
display(sp.Eq(sp.Symbol("F"), F))
for ident in symbolic.gradient_is_attention(3, 2):
    assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
    print(f"{ident.name} at zeta=0  ==  softmax-weighted v   ✓")
ident.rhs

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Attention is the gradient at $\zeta = 0$ of one scalar, the energy $F(\zeta)$: the
# source $\zeta$ pulls the values out of the log-sum-exp.</p></div>
#
# ## 1.2 The Hessian is a covariance
#
# $F$ is the log of a moment-generating function: $e^{F(\zeta)} / e^{F(0)} = \mathrm{E}_p[e^{\zeta \cdot v}]$.
# Its derivatives at 0 are the **cumulants** of $v$ under $p$: the first is the mean
# (attention), the second the covariance
#
# $$\frac{\partial^2 F}{\partial\zeta_i\partial\zeta_j}\Big|_0 = \mathrm{E}_p[v_i v_j] - \mathrm{E}_p[v_i]\,\mathrm{E}_p[v_j].$$
#
# The same computation at any other $\zeta$ gives the covariance under the *tilted* weights
# $p_a(\zeta) \propto e^{s_a + \zeta\cdot v_a}$. A covariance is positive semi-definite, so
# the Hessian is positive semi-definite everywhere and $F$ is **convex** in $\zeta$ (checked
# numerically at random points in the last section). Notebook 2 builds on this.

# %%
for ident in symbolic.hessian_is_covariance(3, 2):
    assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
    print(f"{ident.name} at zeta=0  ==  Cov_p(v_i, v_j)   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>$F$ generates cumulants: its gradient is the mean of the values under the attention
# weights, its Hessian their covariance. So $F$ is convex.</p></div>
#
# ## 1.3 The same identities, numerically, against autodiff
#
# The package's `energy` is $F_{\text{tot}}$ over a batch, several queries and grouped heads
# (layout `q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`, `v [B, Tk, Hkv, Dv]`). We check, in float64:
#
# * `attention_from_energy` (which is `jax.grad` of `energy` at $\zeta=0$) against `attention`;
# * `value_covariance` (Hessian-vector products of `energy`) against the hand-derived formula
#   `value_covariance_formula` and against the diagonal blocks of a full `jax.hessian`.
#
# We call the package's functions through `jax.jit`: compiling each once is several times
# faster than running it op by op, and the values are the same.

# %%
def compiled(f):
    """`f` compiled with `jax.jit`; `scale` and `causal` fix the program, so they are static."""
    return jax.jit(f, static_argnames=("scale", "causal"))


attention, attention_from_energy, energy, value_covariance = map(compiled, (
    tae.attention, tae.attention_from_energy, tae.energy, tae.value_covariance))

kq, kk, kv = jax.random.split(jax.random.key(0), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 2, 3, 4, 2, 16, 3, 40
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))

att = attention(q, k, v)
grad_att = attention_from_energy(q, k, v)
np.testing.assert_allclose(grad_att, att, rtol=1e-12, atol=1e-14)

cov_autodiff = value_covariance(q, k, v)
cov_formula = compiled(tae.value_covariance_formula)(q, k, v)
np.testing.assert_allclose(cov_autodiff, cov_formula, rtol=1e-12, atol=1e-14)

zeta0 = jnp.zeros((B, Tq, Hq, Dv))
# Compiled once: op-by-op autodiff of the whole Hessian is several times slower.
full = np.asarray(jax.jit(jax.hessian(tae.energy, argnums=3))(q, k, v, zeta0))
rows = B * Tq * Hq  # one log-sum-exp term of F_tot per (b, i, h)
flat = full.reshape(rows, Dv, rows, Dv)  # [row, Dv, row', Dv]
blocks = np.stack([flat[r, :, r, :] for r in range(rows)]).reshape(B, Tq, Hq, Dv, Dv)
np.testing.assert_allclose(cov_autodiff, blocks, rtol=1e-12, atol=1e-14)
print("grad F(0) == attention, Hessian == covariance == blocks of jax.hessian   ✓")
print("output shape", att.shape, " covariance shape", cov_autodiff.shape)

# %% [markdown]
# How big is the full Hessian, and how much of it can be non-zero? Each $(b, i, h)$ term of
# $F_{\text{tot}}$ depends only on its own source row $\zeta_{bih}$, so the Hessian is block
# diagonal: only the $D_v \times D_v$ blocks on the diagonal can be non-zero. The cell counts
# both and checks that the off-diagonal blocks really are zero.

# %%
off_diag = flat.copy()
for r in range(rows):
    off_diag[r, :, r, :] = 0
assert np.abs(off_diag).max() == 0.0
assert full.size == (B * Tq * Hq * Dv) ** 2 == 5184 and rows**2 == 576
nonzero_max = rows * Dv**2  # entries in the diagonal blocks
assert np.count_nonzero(full) == nonzero_max  # covariances of random values: no zero entry
eigs = np.linalg.eigvalsh(np.asarray(cov_autodiff))
assert eigs.min() > -1e-12  # a covariance: F is convex in zeta
display(Markdown(
    f"The full Hessian has $(B\\,T_q\\,H_q\\,D_v)^2 = ({B}\\cdot{Tq}\\cdot{Hq}\\cdot{Dv})^2 = "
    f"{full.size}$ entries, in $(B\\,T_q\\,H_q)^2 = {rows}^2 = {rows**2}$ blocks of "
    f"${Dv}\\times{Dv}$. Only the ${rows}$ diagonal blocks are non-zero: "
    f"${nonzero_max}$ entries, a fraction $1/{rows}$. The off-diagonal blocks are exactly 0, "
    f"and the smallest covariance eigenvalue is ${eigs.min():.3f} \\ge 0$."))

# %% [markdown]
# So `value_covariance` never builds the full matrix: it takes $D_v$ Hessian-vector products,
# each with one unit vector placed in *every* row at once, which returns one column of every
# diagonal block.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Autodiff agrees with the hand-derived gradient and covariance to float64 rounding. The
# Hessian of $F_{\text{tot}}$ is block diagonal, one block per (batch, query, head), so only
# $D_v$ Hessian-vector products are needed.</p></div>
#
# ## 1.4 Many queries, heads and a causal mask
#
# With queries $i$, heads $h$ and a causal mask the energy is
#
# $$F_{\text{tot}}(\zeta) = \sum_b \sum_i \sum_h \log \sum_{a \le \text{pos}(i)} \exp(\text{scale}\, q_{bih}\cdot k_{b,a,h'} + \zeta_{bih}\cdot v_{b,a,h'}),\qquad h' = \lfloor h / (H_q/H_{kv}) \rfloor.$$
#
# The package uses the **decode convention**: the $T_q$ queries are the newest tokens, so
# query $i$ sits at position $L_b - T_q + i$ where $L_b$ is the sequence's length
# (`kv_lengths`). A sequence of length 0 sees nothing: its term is left out of $F$, so its
# gradient, like `attention`'s output, is zero. The cell checks both masks.

# %%
lengths = jnp.array([40, 7])
kw = dict(causal=True, kv_lengths=lengths)
np.testing.assert_allclose(attention_from_energy(q, k, v, **kw), attention(q, k, v, **kw),
                           rtol=1e-12, atol=1e-14)
visible = masks.visible(Tq, Tk, lengths, causal=True)  # [B, Tq, Tk]
print("keys visible to each query of sequence 1 (length 7):", np.asarray(visible[1]).sum(-1))
assert np.asarray(visible[1]).sum(-1).tolist() == [5, 6, 7]

# A sequence of length 0: no term in F, zero gradient.
empty = jnp.array([40, 0])
grad_empty = attention_from_energy(q, k, v, causal=True, kv_lengths=empty)
assert np.all(np.asarray(grad_empty[1]) == 0)
np.testing.assert_allclose(energy(q, k, v, zeta0, causal=True, kv_lengths=empty),
                           energy(q[:1], k[:1], v[:1], zeta0[:1], causal=True,
                                  kv_lengths=empty[:1]), rtol=1e-14)
print("length 0: gradient exactly 0, and F equals F of the other sequence alone   ✓")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 2.2))
for b, ax in enumerate(axes):
    ax.imshow(np.asarray(visible[b]), aspect="auto", cmap="Greys", interpolation="nearest")
    ax.set_title(f"sequence {b}: kv_length {int(lengths[b])}, causal, Tq = {Tq}", fontsize=11)
    ax.set_xlabel("key position", fontsize=10)
    ax.set_ylabel("query", fontsize=10)
    ax.set_yticks(range(Tq))
fig.tight_layout()

# %% [markdown]
# *Figure: which keys each query sees (dark: visible). Look at the right edge of each dark
# band: queries are the newest tokens, so the last query of a sequence sees every valid key
# and each earlier one sees one fewer.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>$F_{\text{tot}}$ is a sum of one log-sum-exp per batch, query and head; masks and
# lengths only decide which keys enter each sum, and an empty sum is left out.</p></div>
#
# ## 1.5 Stable for huge logits
#
# `energy` shifts each log-sum-exp by its row maximum,
# $\log\sum e^{s_a} = m + \log\sum e^{s_a - m}$ (the paper's "safe softmax", proved in
# notebook 3). Multiplying $q$ and $k$ by a thousand makes the logits so large that `exp` of
# them overflows even in float64; the shifted energy and its gradient stay finite and exact:

# %%
q_big, k_big = q * 1e3, k * 1e3
scores = jnp.einsum("bihd,bahd->bhia", q_big, jnp.repeat(k_big, Hq // Hkv, axis=2)) / np.sqrt(D)
exp_limit = float(np.log(np.finfo(np.float64).max))  # exp overflows above this
assert float(jnp.abs(scores).max()) > 1000 * exp_limit
f_huge = energy(q_big, k_big, v, zeta0)
g_huge = attention_from_energy(q_big, k_big, v)
assert np.isfinite(f_huge) and np.isfinite(np.asarray(g_huge)).all()
np.testing.assert_allclose(g_huge, attention(q_big, k_big, v), rtol=1e-12, atol=1e-14)
display(Markdown(
    f"The largest logit is ${float(jnp.abs(scores).max()):.3g}$, while float64's `exp` "
    f"overflows above ${exp_limit:.2f}$. Yet $F = {float(f_huge):.6e}$ is finite and its "
    f"gradient equals `attention` to float64 rounding."))

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Computing $F$ as $m + \log\sum_a e^{s_a + \zeta\cdot v_a - m}$, with $m$ the row max,
# gives the same value and gradient, and every exponent is at most 0: nothing overflows.</p></div>
#
# ## 1.6 The energy landscape
#
# For one query with $D_v = 2$ we can draw $F$ over the $\zeta$ plane. $F$ is convex, and its
# gradient at the origin, the arrow, **is** the attention output.

# %%
q1, k1, v1 = q[:1, :1, :1], k[:1, :, :1], v[:1, :, :1, :2]
grid = jnp.linspace(-2.0, 2.0, 81)
Z1, Z2 = jnp.meshgrid(grid, grid)
zetas = jnp.stack([Z1, Z2], -1).reshape(-1, 1, 1, 1, 2)
F_grid = jax.jit(jax.vmap(lambda z: tae.energy(q1, k1, v1, z)))(zetas).reshape(Z1.shape)
out1 = np.asarray(attention(q1, k1, v1)).ravel()
g0 = np.asarray(attention_from_energy(q1, k1, v1)).ravel()
np.testing.assert_allclose(g0, out1, rtol=1e-12)

fig, ax = plt.subplots(figsize=(5.2, 4.4))
cs = ax.contourf(np.asarray(Z1), np.asarray(Z2), np.asarray(F_grid), levels=25, cmap="Greens")
fig.colorbar(cs, label=r"$F(\zeta)$")
ax.quiver(0, 0, g0[0], g0[1], angles="xy", scale_units="xy", scale=1, color="black", width=0.012)
ax.plot(0, 0, "ko")
ax.set_xlabel(r"$\zeta_1$")
ax.set_ylabel(r"$\zeta_2$")
ax.set_title(r"Energy landscape; arrow: $\nabla F(0)$ = attention output", fontsize=11)
print("attention output (= gradient at 0):", np.round(out1, 4))

# %% [markdown]
# *Figure: the energy over a 2-D source. Look at the contours: they bound convex regions, as
# for any convex function. The black arrow is $\nabla_\zeta F(0)$, which equals the attention
# output printed above.*
#
# The convexity claimed in the second section, checked here: at random points $\zeta$, the
# Hessian from `jax.hessian` equals the covariance of the values under the tilted weights
# $p_a(\zeta) \propto e^{s_a + \zeta\cdot v_a}$, and its eigenvalues are $\ge 0$.

# %%
hess_at = jax.jit(jax.vmap(jax.hessian(lambda z: tae.energy(q1, k1, v1, z))))
points = 2 * jax.random.normal(jax.random.key(1), (5, 1, 1, 1, 2))
H_points = np.asarray(hess_at(points)).reshape(5, 2, 2)
s1 = np.asarray(q1[0, 0, 0] @ k1[0, :, 0].T) / np.sqrt(D)  # scores [Tk]
vals = np.asarray(v1[0, :, 0])  # values [Tk, 2]
for z, H in zip(np.asarray(points).reshape(5, 2), H_points, strict=True):
    p = np.exp(s1 + vals @ z - (s1 + vals @ z).max())
    p /= p.sum()
    mean = p @ vals
    np.testing.assert_allclose(H, (vals * p[:, None]).T @ vals - np.outer(mean, mean),
                               rtol=1e-10, atol=1e-13)
    assert np.linalg.eigvalsh(H).min() >= 0
print("Hessian at 5 random zeta == tilted covariance, eigenvalues >= 0   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>$F$ is a smooth convex bowl over the source space; attention is the slope of the bowl at
# the origin.</p></div>
#
# ## 1.7 Summary
#
# * Attention is $\nabla_\zeta F(0)$ for the energy $F(\zeta)=\log\sum_a e^{s_a+\zeta\cdot v_a}$;
#   the Hessian is the value covariance, because $F$ generates cumulants, so $F$ is convex.
# * Both identities are proved in sympy and confirmed against `jax.grad`/`jax.hessian` in float64.
# * $F_{\text{tot}}$ sums one log-sum-exp per batch, query and head; causal masks and
#   per-sequence lengths only change which keys enter each sum, and its Hessian is block
#   diagonal.
# * Shifting each log-sum-exp by its max keeps $F$ finite for any logits.
# * Next: the same energy read as a probability model (notebook 2), then why a log-sum-exp
#   can be split across devices (notebook 3).
#
# ## 1.8 Exercises
#
# Each answer is hidden: open "Answer" to read it, and the collapsed cell below it checks it.
#
# 1. As `scale` → 0 every visible key gets the same weight. What does attention become?
# 2. The third derivative of $F$ at 0 is the third *central* moment of $v$ (for $d=1$). Prove it
#    with sympy.
# 3. Add a constant $c$ to every component of every value. The source term
#    $\zeta\cdot v_a$ then changes by $c\sum_j \zeta_j$, the same amount for every key. How do
#    $F$ and $\nabla F(0)$ change? Check with sympy and numerically.
# 4. **Predict, then measure.** A query sees exactly two keys, with weights $p$ and $1-p$ and
#    values $v_1 \ne v_2 \in \mathbf{R}^{3}$. Before running anything, predict how many
#    eigenvalues of its $3\times 3$ value covariance are non-zero, and what the non-zero ones
#    are. Then measure with `value_covariance` (hint: `kv_lengths` with a length of 2).
#
# <details><summary>Answer 1</summary>
#
# The plain mean of the visible values: with scale 0 every score is 0 and every weight is
# $1/n$. The cell uses a tiny scale and no mask.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
uniform = attention(q, k, v, scale=1e-12)
mean_v = jnp.repeat(v, Hq // Hkv, axis=2).mean(axis=1, keepdims=True)  # each head's kv head
np.testing.assert_allclose(uniform, jnp.broadcast_to(mean_v, uniform.shape), atol=1e-10)
print("scale -> 0: attention == mean of the values   ✓")

# %% [markdown]
# <details><summary>Answer 2</summary>
#
# Differentiate $F$ three times and set $\zeta = 0$; the result equals
# $\mathrm{E}_p[(v - \mathrm{E}_p v)^3]$ (`symbolic.third_cumulant`). This is the third
# cumulant. The pattern "derivative = central moment" stops there: the fourth derivative, the
# fourth cumulant, is the fourth central moment minus three times the squared variance (the
# cell checks both numerically with nested `jax.grad`).
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
(third,) = symbolic.third_cumulant(3)
assert sp.simplify(third.lhs - third.rhs) == 0
print(f"{third.name} at zeta=0  ==  E[(v - E v)^3]   ✓")

# Numerically, for one query and one value dimension: derivatives 3 and 4 of F at 0.
s_n, v_n = np.asarray(q[0, 0, 0] @ k[0, :, 0].T) / np.sqrt(D), np.asarray(v[0, :, 0, 0])


def F_n(z):
    return jax.nn.logsumexp(s_n + z * v_n)


d3, d4 = jax.grad(jax.grad(jax.grad(F_n)))(0.0), jax.grad(jax.grad(jax.grad(jax.grad(F_n))))(0.0)
p_n = np.exp(s_n - s_n.max()) / np.exp(s_n - s_n.max()).sum()
centred = v_n - p_n @ v_n
m2, m3, m4 = (p_n @ centred**2, p_n @ centred**3, p_n @ centred**4)
np.testing.assert_allclose(d3, m3, rtol=1e-10)
np.testing.assert_allclose(d4, m4 - 3 * m2**2, rtol=1e-10)
assert abs(d4 - m4) > 1e-3  # the fourth derivative is not the fourth central moment
print(f"F''' = {float(d3):.4f} = E[(v-Ev)^3];  F'''' = {float(d4):.4f} = "
      f"E[(v-Ev)^4] - 3 Var^2 ({m4:.4f} - {3 * m2**2:.4f})   ✓")

# %% [markdown]
# <details><summary>Answer 3</summary>
#
# Since $\sum_j \zeta_j (v_{a,j} + c) = \zeta\cdot v_a + c\sum_j\zeta_j$ is the same shift for
# every key $a$, it comes out of the log: $F_{v+c}(\zeta) = F_v(\zeta) + c\sum_j \zeta_j$.
# Its gradient at 0 gains $c$ in every component, so attention shifts by exactly $c$ (the
# weights sum to 1). Note the shift of the source term is $c\sum_j\zeta_j$, not $c\,\zeta$:
# it is a scalar, and it involves every component of $\zeta$. The cell proves this with sympy
# (`symbolic.value_shift`), then checks it on $F_{\text{tot}}$ in float64 at a random $\zeta$,
# where the shift is $c$ times the sum of all entries of $\zeta$.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
for ident in symbolic.value_shift(3, 2):
    assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
    print(f"{ident.name}   ✓")
c = 0.5
zeta_r = jax.random.normal(jax.random.key(2), zeta0.shape)
np.testing.assert_allclose(energy(q, k, v + c, zeta_r),
                           energy(q, k, v, zeta_r) + c * zeta_r.sum(), rtol=1e-12)
np.testing.assert_allclose(attention_from_energy(q, k, v + c), att + c, atol=1e-12)
print("numerically: F shifts by c * sum(zeta), attention by c   ✓")

# %% [markdown]
# <details><summary>Answer 4</summary>
#
# One. With two keys the mean is $\mu = p v_1 + (1-p) v_2$ and
# $\mathrm{Cov} = p\,v_1v_1^\top + (1-p)\,v_2v_2^\top - \mu\mu^\top = p(1-p)\,(v_1-v_2)(v_1-v_2)^\top$,
# a rank-one matrix: one eigenvalue $p(1-p)\,\lVert v_1 - v_2\rVert^2$ and two zeros (the
# values vary only along $v_1 - v_2$). A query that sees a single key has covariance 0. The
# cell gives sequence 0 two keys and sequence 1 one key.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
two = jnp.array([2, 1])
cov2 = np.asarray(value_covariance(q[:, :1], k, v, kv_lengths=two))  # [B, 1, Hq, Dv, Dv]
w2 = np.asarray(compiled(weights)(q[:, :1], k, kv_lengths=two))  # [B, Hq, 1, Tk]
for h in range(Hq):
    p = w2[0, h, 0, 0]
    v_1, v_2 = np.asarray(v[0, 0, h // (Hq // Hkv)]), np.asarray(v[0, 1, h // (Hq // Hkv)])
    eig = np.linalg.eigvalsh(cov2[0, 0, h])
    np.testing.assert_allclose(eig[:2], 0, atol=1e-14)
    np.testing.assert_allclose(eig[2], p * (1 - p) * np.sum((v_1 - v_2) ** 2), rtol=1e-12)
    print(f"head {h}: p = {p:.3f}, non-zero eigenvalue {eig[2]:.4f}, "
          f"p(1-p)|v1-v2|^2 = {p * (1 - p) * np.sum((v_1 - v_2) ** 2):.4f}")
np.testing.assert_allclose(cov2[1], 0, atol=1e-15)  # one key: no spread
print("two keys: one non-zero eigenvalue p(1-p)|v1 - v2|^2; one key: covariance 0   ✓")

# %% [markdown]
# ## 1.9 References
#
# Shyam et al., *Tree Attention: Topology-aware Decoding for Long-Context Attention on GPU
# clusters*, [arXiv 2408.04093](https://arxiv.org/abs/2408.04093):
#
# * section 4, Observation 1, eqs. (5)–(6): attention as the gradient of the energy $F(\zeta)$;
# * Appendix C.1, eqs. (15)–(24): the proof, with $F$ as the cumulant-generating function
#   ("free energy") and the moments as derivatives of the partition function (eq. 20);
# * Appendix C.1, eq. (25): $F_{\text{tot}}$ with a causal mask, and eqs. (27)–(28): many heads;
# * Appendix F, eqs. (35)–(38): the max shift ("safe softmax") leaves the gradient unchanged;
# * section 5: why the energy's log-sum-exp can be reduced in parallel (notebook 3).
#
# This notebook quotes no hardware figures.
