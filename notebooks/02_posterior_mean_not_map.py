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
# # 2. Attention is a posterior mean, not a MAP estimate
#
# The energy of notebook 1 has a probabilistic reading. The paper's appendix C.2 states it as
# a *maximum a posteriori* (MAP) estimate: attention is $\operatorname{argmax} e^{-\Gamma}$.
# That claim is false as written: the maximum does not exist, and the point the paper finds is
# a saddle. This notebook shows why, then proves the three statements that are true, each with
# checks that would fail if it were false:
#
# * **Legendre:** the saddle is a min–max. Maximising $\Gamma$ over the source gives the convex
#   conjugate $F^*$, and attention minimises $F^*$.
# * **Cramér:** the *mean of $n$ memories drawn from the attention weights* has density
#   $\approx e^{-n I(z)}$, and attention is its most probable value. This is the sense in which
#   "most probable" is true.
# * **Bayes:** the weights are a posterior over memories and attention is the posterior *mean*.
#   The MAP memory gives *hard* attention, the limit of a large inverse temperature.
#
# **Prerequisites.** Notebook 1: the energy $F(\zeta)$, $\nabla F(0)$ = attention and
# $\nabla^2 F(0)$ = value covariance. Basic probability: Bayes' rule, expectations, the KL
# divergence. Gradients and Hessians. Convex conjugates and large deviations are introduced
# here.
#
# **Time.** About 45 minutes to read and run.
#
# **Learning objectives.** After this notebook you can
#
# * read the attention weights as a posterior over memories, and show that attention is the
#   posterior mean, the Bayes estimate under squared loss;
# * explain why the paper's $\operatorname{argmax}_{\zeta, z} e^{-\Gamma(\zeta, z)}$ does not
#   exist, and prove with sympy and autodiff that the stationary point of $\Gamma$ is a saddle
#   for every input;
# * compute the convex conjugate $F^*(z) = \max_\zeta \Gamma(\zeta, z)$ and show that attention
#   minimises it, with minimum $-F(0)$;
# * compute Cramér's rate function $I(z)$, write it as a minimum KL divergence, and check by
#   Monte Carlo that the mean of $n$ draws has density $\approx e^{-n I(z)}$;
# * show that the MAP memory gives hard attention, the $\beta\to\infty$ limit of attention,
#   with the inverse temperature entering as $\text{scale} = \beta/D$ (the convention of
#   `hopfield` and notebook 7).
#
# **Where it runs.** The first cell asks JAX for 8 simulated CPU devices and pins JAX to the
# CPU, so the notebook runs on those CPU devices even on a GPU runtime; a GPU, if present, is
# not used. All the maths here runs on one device, in float64.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises; later notebooks shard over these

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import jax.numpy as jnp
import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import numpy as np
import sympy as sp
from IPython.display import Markdown
from scipy import optimize
from scipy.special import logsumexp

from tree_attention_edu.theory import bayes, symbolic
from tree_attention_edu.theory import hopfield as hf

jax.config.update("jax_enable_x64", True)  # identities are checked in float64
assert jax.device_count() == 8, jax.devices()

# %% [markdown]
# ## 2.1 The posterior over memories
#
# Treat the keys $k_a$ as memories and the query as evidence about which one is meant. With a
# uniform prior $1/n$ over the $n$ visible memories and a likelihood
# $p(q \mid a) = e^{s_a}/c$, where $s_a = \text{scale}\; q\cdot k_a$ is the score and $c$ does
# not depend on $a$, Bayes' rule gives
#
# $$p(a \mid q) = \frac{e^{s_a}}{\sum_b e^{s_b}},$$
#
# the attention weights (`tae.posterior`, shaped `[B, Hq, Tq, Tk]`). Attention reads out the
# value of the retrieved memory *averaged over the posterior*: it is the posterior mean,
#
# $$\text{attention}(q) = \sum_a p(a\mid q)\, v_a = \mathrm{E}_{p(a\mid q)}[v_a].$$
#
# The normaliser is the evidence,
# $p(q) = \frac{1}{n}\sum_b e^{s_b}/c$, so
# $\log p(q) = F(0) - \log n - \log c$: the log-partition $F(0)$ of notebook 1 is the log
# evidence only up to $-\log n$ (and the likelihood's constant).

# %%
kq, kk, kv = jax.random.split(jax.random.key(2), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 1, 2, 2, 1, 8, 3, 12
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))
rows = B * Tq * Hq  # independent (batch, query, head) rows

post = tae.posterior(q, k)  # [B, Hq, Tq, Tk]
np.testing.assert_allclose(post.sum(-1), 1.0, rtol=1e-14)
att = tae.attention(q, k, v)  # [B, Tq, Hq, Dv]
mean = jnp.einsum("bhqk,bkv->bqhv", post, v[:, :, 0])  # posterior mean of the value
np.testing.assert_allclose(mean, att, rtol=1e-12, atol=1e-14)
print("posterior rows sum to 1; posterior mean of v == attention   ✓")

# The evidence with a uniform prior: log (1/n) Σ_a e^{s_a}, per row, from the raw scores.
s = np.asarray(jnp.einsum("bqhd,bkd->bhqk", q, k[:, :, 0])) / np.sqrt(D)  # default scale
log_evidence = np.log(np.mean(np.exp(s), axis=-1))  # [B, Hq, Tq]
F0 = float(tae.energy(q, k, v, jnp.zeros_like(att)))  # Σ over rows of F(0)
np.testing.assert_allclose(log_evidence.sum(), F0 - rows * np.log(Tk), rtol=1e-13)
assert abs(log_evidence.sum() - F0) > 1.0  # leaving out −log n is not a rounding error
Markdown(f"Summed over the {rows} rows, $F(0) = {F0:.4f}$ while the log evidence is "
         f"${log_evidence.sum():.4f}$; the difference is ${rows}\\log {Tk} = "
         f"{rows * np.log(Tk):.4f}$, to float64 rounding.")

# %% [markdown]
# Why the mean and not some other summary of the posterior? Because the posterior mean is the
# **Bayes estimate under squared loss**: the expected loss of an estimate $z$ is
#
# $$\mathrm{E}_{p}\,\lVert v_a - z\rVert^2 = \operatorname{tr}\Sigma + \lVert z - \mu\rVert^2,$$
#
# with $\mu$ = attention and $\Sigma$ the value covariance, so it is smallest at $z = \mu$.
# `bayes.posterior_risk` computes the left side directly; we check the identity at attention
# and at random estimates.

# %%
cov = jax.jit(tae.value_covariance)(q, k, v)  # [B, Tq, Hq, Dv, Dv], the Hessian of F at 0
risk_att = bayes.posterior_risk(att, q, k, v)  # [B, Tq, Hq]
np.testing.assert_allclose(risk_att, jnp.trace(cov, axis1=-2, axis2=-1), rtol=1e-12)
for key in jax.random.split(jax.random.key(3), 5):
    z = att + 0.3 * jax.random.normal(key, att.shape)
    risk = bayes.posterior_risk(z, q, k, v)
    np.testing.assert_allclose(risk, risk_att + jnp.sum((z - att) ** 2, -1), rtol=1e-12)
    assert (risk > risk_att).all()
print("risk(z) == tr Σ + |z − attention|², so attention has the smallest risk   ✓")

fig, ax = plt.subplots(figsize=(7, 2.6))
p0 = np.asarray(post[0, 0, 0])
ax.bar(np.arange(Tk), p0, color="0.55")
ax.bar(np.argmax(p0), p0.max(), color="black", label="the MAP memory")
ax.set_xlabel("memory (key) a", fontsize=10)
ax.set_ylabel(r"$p(a \mid q)$", fontsize=10)
ax.set_title("Posterior over memories for one query", fontsize=11)
ax.legend(fontsize=10)
plt.show()

# %% [markdown]
# *Figure: the posterior of one query. Look at how the mass is spread: the most probable
# memory (black) holds only part of it, and attention averages all the values with these
# weights instead of committing to that one.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The attention weights are a posterior over memories; attention is its mean, the estimate
# with the smallest expected squared error. The log evidence is $F(0) - \log n$ (plus a
# constant), not $F(0)$.</p></div>
#
# ## 2.2 The paper's claim: Γ and its stationary point
#
# Appendix C.2 of the paper proposes a "log-likelihood" (its eq. 30),
#
# $$\Gamma(\zeta, z) = \sum z\cdot\zeta - F(\zeta),$$
#
# summed over queries, heads and value components, with $F$ counted once, as the paper's own
# stationary conditions (eq. 32) require. It then writes:
#
# > Let us minimize the above with respect to $\zeta$ and $z$ simultaneously […] In all, this
# > means we can obtain the gradient w.r.t. from MAP estimation of the following likelihood:
# > $z_{i*,A}, \zeta_{i*,A} = \operatorname{argmax}_{\zeta,z} e^{-\Gamma(\zeta,z)}$ (eq. 34).
#
# The stationary conditions (eqs. 31–33) are right:
#
# * $\partial\Gamma/\partial z = \zeta = 0$, so $\zeta^* = 0$;
# * $\partial\Gamma/\partial\zeta = z - \nabla F(\zeta) = 0$, so $z^* = \nabla F(0)$, which is
#   attention.
#
# sympy solves the two conditions in turn:

# %%
for ident in symbolic.stationary_point(3, 2):
    assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
    print(f"{ident.name:>8} = {sp.simplify(ident.lhs)}")

# %% [markdown]
# Numerically, `tae.stationary_point` solves $\nabla\Gamma(\zeta, z) = 0$ by Newton's method
# from a random start; each Newton step solves $J\,\delta = -\nabla\Gamma$ with GMRES, applying
# the Hessian $J$ of $\Gamma$ only through Jacobian-vector products. Newton's method looks for
# a zero of the gradient, whatever the curvature there, which is what we need: as the next
# section shows, no maximiser or minimiser would find this point. It never calls `attention`,
# so agreement with it is evidence, not a tautology.

# %%
lengths = jnp.array([9])
z_star, zeta_star = tae.stationary_point(q, k, v, causal=True, kv_lengths=lengths)
att_masked = tae.attention(q, k, v, causal=True, kv_lengths=lengths)
np.testing.assert_allclose(z_star, att_masked, rtol=0, atol=1e-6)
np.testing.assert_allclose(zeta_star, 0.0, atol=1e-9)
grad_gamma = jax.grad(tae.log_likelihood, argnums=(0, 1))(
    z_star, zeta_star, q, k, v, causal=True, kv_lengths=lengths)
assert max(float(jnp.abs(g).max()) for g in grad_gamma) < 1e-10
print("Newton-GMRES stationary point: z* == attention (to 1e-6), zeta* == 0, grad Gamma == 0   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The paper's stationary point is right: $\nabla\Gamma = 0$ exactly at $\zeta^* = 0$,
# $z^* = \nabla F(0)$ = attention. What it calls that point is the question.</p></div>
#
# ## 2.3 Not a maximum: a saddle
#
# **$\Gamma$ is unbounded.** It is linear in $z$: for any $\zeta \ne 0$,
# $\Gamma(\zeta, z - t\zeta) = \Gamma(\zeta, z) - t\lVert\zeta\rVert^2$, which goes to
# $-\infty$ as $t\to\infty$, so $e^{-\Gamma}$ grows without bound. It has no argmax, and it
# cannot be normalised into a density, so it is not a likelihood or a posterior either (nor
# does "minimising" help: $t\to-\infty$ sends $\Gamma$ to $+\infty$). We fix a random
# $\zeta \ne 0$, follow $z = z^* - t\zeta$ and print $-\Gamma = \log e^{-\Gamma}$ (the
# exponential itself overflows float64 at the end of the line):

# %%
zeta_dir = 0.5 * jax.random.normal(jax.random.key(4), att.shape)
ts = np.array([0.0, 1.0, 10.0, 100.0, 1000.0])
neg_gamma = np.array([-float(tae.log_likelihood(att - t * zeta_dir, zeta_dir, q, k, v))
                      for t in ts])
np.testing.assert_allclose(np.diff(neg_gamma) / np.diff(ts), float(jnp.sum(zeta_dir**2)),
                           rtol=1e-9)  # exactly linear in t, slope |ζ|²
at_stationary = -float(tae.log_likelihood(att, jnp.zeros_like(att), q, k, v))  # = F(0)
np.testing.assert_allclose(at_stationary, F0, rtol=1e-14)
assert neg_gamma[-1] > np.log(np.finfo(np.float64).max) > at_stationary
for t, g in zip(ts, neg_gamma, strict=True):
    print(f"t = {t:>6g}:  log e^(-Gamma) = {g:12.4f}")
print(f"at the stationary point: log e^(-Gamma) = F(0) = {at_stationary:.4f}")

# %% [markdown]
# **The Hessian is indefinite.** At $(\zeta, z) = (0, z^*)$ the Hessian of $\Gamma$ is
#
# $$\nabla^2\Gamma = \begin{pmatrix} -\Sigma & I \\ I & 0 \end{pmatrix},$$
#
# with $\Sigma = \nabla^2F(0)$ the value covariance. Rotating both blocks into the eigenbasis
# of $\Sigma$ splits it into $2\times 2$ blocks $\begin{pmatrix} -c & 1 \\ 1 & 0\end{pmatrix}$,
# one per eigenvalue $c \ge 0$ of $\Sigma$. sympy gives their eigenvalues; their product, the
# determinant, is $-1$, so each block has one positive and one negative eigenvalue **whatever
# $c$ is**: the stationary point is a saddle for every input.

# %%
c, lam = sp.Symbol("c", nonnegative=True), sp.Symbol("lambda")
block = sp.Matrix([[-c, 1], [1, 0]])
claimed = [(-c + sp.sqrt(c**2 + 4)) / 2, (-c - sp.sqrt(c**2 + 4)) / 2]
for root in claimed:
    assert sp.simplify(block.charpoly(lam).as_expr().subs(lam, root)) == 0
    assert any(sp.simplify(e - root) == 0 for e in block.eigenvals())
assert sp.simplify(claimed[0] * claimed[1] - block.det()) == 0 and block.det() == -1
print("eigenvalues of [[-c, 1], [1, 0]]:", *claimed, sep="\n  ")
print("their product (the determinant):", block.det())

# %% [markdown]
# `tae.gamma_hessian` computes the same Hessian by autodiff (Jacobian-vector products of
# `jax.grad(log_likelihood)`), one $2D_v\times 2D_v$ block per row. We check that every row
# has eigenvalues of both signs, and that they are exactly $(-c\pm\sqrt{c^2+4})/2$ for the
# eigenvalues $c$ of the value covariance. The same batch carries random inputs from nearly
# uniform posteriors (scale $\beta/D$ with $\beta$ small) to nearly one-hot ones ($\beta$
# large, where $\Sigma\to 0$ and the eigenvalues tend to $\pm 1$), and the sign check runs
# on all of them.

# %%
# The example, and 63 random inputs from nearly uniform to nearly one-hot posteriors, in one
# batch (the β factor multiplies the queries: scale·q·k = (β/D) q·k with the default scale).
kr = jax.random.split(jax.random.key(13), 3)
many = 64
beta_r = jnp.geomspace(0.01, 100, many - 1)[:, None, None, None] * np.sqrt(D)
q_all = jnp.concatenate([q, jax.random.normal(kr[0], (many - 1, Tq, Hq, D)) * beta_r])
k_all = jnp.concatenate([k, jax.random.normal(kr[1], (many - 1, Tk, Hkv, D))])
v_all = jnp.concatenate([v, jax.random.normal(kr[2], (many - 1, Tk, Hkv, Dv))])
H_all = np.asarray(tae.gamma_hessian(q_all, k_all, v_all))  # [64, Tq, Hq, 2Dv, 2Dv]
eig_all = np.linalg.eigvalsh(H_all)
assert (eig_all.min(-1) < 0).all() and (eig_all.max(-1) > 0).all()

H, eig = H_all[:1], eig_all[:1]  # the example
c_vals = np.linalg.eigvalsh(np.asarray(cov))  # eigenvalues of Σ, per row
closed = np.sort(np.concatenate([(-c_vals + np.sqrt(c_vals**2 + 4)) / 2,
                                 (-c_vals - np.sqrt(c_vals**2 + 4)) / 2], -1), -1)
np.testing.assert_allclose(eig, closed, atol=1e-12)
print("eigenvalues of the Hessian of Gamma, one row per (query, head):")
print(np.round(eig.reshape(rows, -1), 3))
print(f"{many * Tq * Hq} rows of {many} inputs: every Hessian has eigenvalues of both signs; "
      f"the smallest |eigenvalue| is {np.abs(eig_all).min():.3f}")

# %% [markdown]
# To see the saddle, take one query with one-dimensional values ($D_v = 1$), so that
# $\Gamma(\zeta, z)$ is a surface over the plane. The left panel draws it; the right panel
# follows it through the stationary point along the two eigenvectors of its Hessian.

# %%
k1 = jax.random.split(jax.random.key(5), 3)
q1 = jax.random.normal(k1[0], (1, 1, 1, D))
kk1 = jax.random.normal(k1[1], (1, Tk, 1, D))
v1 = jax.random.normal(k1[2], (1, Tk, 1, 1))
mu1 = float(tae.attention(q1, kk1, v1).ravel()[0])
var1 = float(jax.jit(tae.value_covariance)(q1, kk1, v1).ravel()[0])
F0_1 = float(tae.energy(q1, kk1, v1, jnp.zeros((1, 1, 1, 1))))
vmin, vmax = float(v1.min()), float(v1.max())


@jax.jit
@jax.vmap
def gamma_1d(zeta, z):
    """Γ of the one-row example at points (ζ, z) (vectors of scalars), with the package's
    log_likelihood."""
    return tae.log_likelihood(jnp.reshape(z, (1, 1, 1, 1)), jnp.reshape(zeta, (1, 1, 1, 1)),
                              q1, kk1, v1)


zeta_g = jnp.linspace(-2.5, 2.5, 101)
z_g = jnp.linspace(vmin - 0.3, vmax + 0.3, 101)
ZETA, ZZ = jnp.meshgrid(zeta_g, z_g, indexing="ij")
gamma_grid = gamma_1d(ZETA.ravel(), ZZ.ravel()).reshape(ZETA.shape)  # [ζ, z]
h1 = np.asarray(tae.gamma_hessian(q1, kk1, v1))[0, 0, 0]  # 2×2, order (ζ, z)
np.testing.assert_allclose(h1, [[-var1, 1], [1, 0]], atol=1e-13)
lam1, vec1 = np.linalg.eigh(h1)
line = np.linspace(-1.5, 1.5, 61)

fig, axes = plt.subplots(1, 2, figsize=(10, 4))
cs = axes[0].contourf(np.asarray(z_g), np.asarray(zeta_g), np.asarray(gamma_grid), levels=30,
                      cmap="viridis")
fig.colorbar(cs, ax=axes[0], label=r"$\Gamma(\zeta, z)$")
axes[0].contour(np.asarray(z_g), np.asarray(zeta_g), np.asarray(gamma_grid), levels=[-F0_1],
                colors="white", linestyles="--")
axes[0].plot(mu1, 0, "kx", ms=12, mew=3)
axes[0].set_xlabel(r"$z$", fontsize=10)
axes[0].set_ylabel(r"$\zeta$", fontsize=10)
axes[0].set_title(r"$\Gamma$ over the plane; $\times$: the stationary point", fontsize=11)
for j, (style, name) in enumerate((("k-", "negative"), ("k--", "positive"))):
    d_zeta, d_z = vec1[:, j]
    g = gamma_1d(jnp.asarray(line * d_zeta), jnp.asarray(mu1 + line * d_z))
    axes[1].plot(line, np.asarray(g) + F0_1, style,
                 label=f"{name} curvature ({lam1[j]:+.2f})")
    # Γ(t·u) − Γ(0) = ½ λ t² + O(t³) along an eigenvector u
    np.testing.assert_allclose(float(g[31] + F0_1), 0.5 * lam1[j] * line[31] ** 2,
                               rtol=0.05)
axes[1].axhline(0, color="0.6", lw=0.8)
axes[1].set_xlabel("step t along the eigenvector", fontsize=10)
axes[1].set_ylabel(r"$\Gamma - \Gamma(0, z^*)$", fontsize=10)
axes[1].set_title("Through the stationary point", fontsize=11)
axes[1].legend(fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: left, $\Gamma$ for one query with scalar values. Look at the white dashed level
# set $\Gamma = -F(0)$: it is two curves that cross at the stationary point (the line
# $\zeta = 0$ and a curve through it), the signature of a saddle, not the closed loops around
# a maximum. Right: along one eigenvector of the Hessian $\Gamma$ falls away from the
# stationary point, along the other it rises.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>$\Gamma$ is linear in $z$, so $e^{-\Gamma}$ has no maximum and no normalisation, and
# its Hessian $\begin{pmatrix}-\Sigma & I\\ I & 0\end{pmatrix}$ always has eigenvalues of both
# signs. The paper's eq. 34 names a point that does not exist; its stationary point is a
# saddle.</p></div>
#
# ## 2.4 The min–max (Legendre) reading
#
# A saddle of $\Gamma$ is the solution of a **min–max** problem. For fixed $z$, $\Gamma$ is
# concave in $\zeta$ (its Hessian there is $-\nabla^2F \preceq 0$), so it has a maximum over
# $\zeta$. That maximum is the **convex conjugate** (Legendre–Fenchel transform) of $F$:
#
# $$F^*(z) = \max_\zeta \big(z\cdot\zeta - F(\zeta)\big), \qquad
#   \nabla F^*(z) = \hat\zeta(z), \text{ the maximiser}.$$
#
# $F^*$ is convex, and its minimum is where $\hat\zeta = 0$, that is where $z = \nabla F(0)$:
#
# $$\operatorname{argmin}_z F^*(z) = \text{attention}, \qquad \min_z F^*(z) = -F(0).$$
#
# So the paper's stationary point is $\min_z\max_\zeta\Gamma(\zeta, z)$. `bayes.conjugate_energy`
# computes $F^*(z)$ and $\hat\zeta(z)$ by damped Newton ascent on $\zeta$, never calling
# `attention`. We test it where we know the answer: a point $z$ built as the mean of a *tilted*
# posterior $Q_\zeta(a) \propto p(a\mid q)\,e^{\zeta\cdot v_a}$ has $\hat\zeta(z) = \zeta$, since
# the maximiser solves $\nabla F(\hat\zeta) = z$. (Such a $z$ lies strictly inside the convex
# hull of the values, where $F^*$ is finite; outside it $F^* = +\infty$.)

# %%
zeta_true = 0.7 * jax.random.normal(jax.random.key(6), att.shape)
tilted = bayes.tilted_posterior(zeta_true, q, k, v)  # [B, Hq, Tq, Tk]
z_in = jnp.einsum("bhqk,bkv->bqhv", tilted, v[:, :, 0])  # E_Q[v]: inside the hull
fstar, zeta_hat = bayes.conjugate_energy(z_in, q, k, v)  # [B, Tq, Hq], [B, Tq, Hq, Dv]
np.testing.assert_allclose(zeta_hat, zeta_true, atol=1e-9)
print("the inner maximiser recovers the tilt: zeta_hat(E_Q[v]) == zeta   ✓")

F0_rows = np.swapaxes(logsumexp(s, axis=-1), 1, 2)  # per-row F(0) from the raw scores
fstar_att, zeta_att = bayes.conjugate_energy(att, q, k, v)
np.testing.assert_allclose(zeta_att, 0.0, atol=1e-12)  # ∇F*(attention) = 0
np.testing.assert_allclose(fstar_att, -F0_rows, rtol=1e-13)  # min F* = −F(0), row by row
assert (np.asarray(fstar) > np.asarray(fstar_att)).all()
print("F*(attention) == -F(0) in every row, zeta_hat == 0 there, F*(z_in) is larger   ✓")

# %% [markdown]
# Two more checks, each against something independent of the solver: the gradient of $F^*$
# by central differences equals the maximiser $\hat\zeta$, and scipy's BFGS, minimising the
# sum of $F^*$ over the rows from the tilted point, lands on attention.

# %%
h = 1e-5
fd = np.zeros(att.shape)
for j in range(Dv):
    e = jnp.zeros_like(att).at[..., j].set(h)
    fd[..., j] = (bayes.conjugate_energy(z_in + e, q, k, v)[0]
                  - bayes.conjugate_energy(z_in - e, q, k, v)[0]) / (2 * h)
np.testing.assert_allclose(fd, zeta_hat, atol=1e-7)
print("central differences of F* == zeta_hat (to 1e-7)   ✓")


def total_fstar(zf):
    value, zh = bayes.conjugate_energy(jnp.reshape(zf, att.shape), q, k, v)
    return float(value.sum()), np.asarray(zh).ravel()


res = optimize.minimize(total_fstar, np.asarray(z_in).ravel(), jac=True, method="BFGS",
                        options=dict(gtol=1e-12))
np.testing.assert_allclose(res.x.reshape(att.shape), att, atol=1e-7)
np.testing.assert_allclose(res.fun, -F0, rtol=1e-12)
print(f"BFGS on F*: argmin == attention (max |diff| {np.abs(res.x - np.ravel(att)).max():.0e}),"
      f" min == -F(0)   ✓")

# %%
z_curve = vmin + (vmax - vmin) * np.linspace(0.01, 0.99, 50)  # inside the hull [vmin, vmax]
q_curve = jnp.broadcast_to(q1, (1, z_curve.size, 1, D))  # one query per point of the curve
z_curve_j = jnp.asarray(z_curve).reshape(1, -1, 1, 1)
fstar_curve = np.asarray(bayes.conjugate_energy(z_curve_j, q_curve, kk1, v1)[0]).ravel()
assert fstar_curve.min() >= -F0_1 - 1e-12
assert np.all(np.diff(fstar_curve, 2) > 0)  # convex on the grid

fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(z_curve, fstar_curve, "k-", label=r"$F^*(z)$")
ax.axhline(-F0_1, color="0.5", ls="--", label=r"$-F(0)$")
ax.axvline(mu1, color="tab:green", ls=":", label="attention")
ax.set_xlabel(r"$z$ (inside the hull of the values)", fontsize=10)
ax.set_ylabel(r"$F^*(z)$", fontsize=10)
ax.set_title("The convex conjugate of the energy", fontsize=11)
ax.legend(fontsize=10)
plt.show()

# %% [markdown]
# *Figure: $F^*$ for the one-dimensional example. Look at the bottom of the curve: it touches
# the dashed line $-F(0)$ exactly at attention (dotted), and the curve is convex, rising
# steeply towards the edges of the hull of the values.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The stationary point of $\Gamma$ is a min–max: maximise over $\zeta$ to get the convex
# conjugate $F^*(z)$, then minimise over $z$. Attention is $\operatorname{argmin} F^*$,
# $\min F^* = -F(0)$, and $\nabla F^*(z)$ is the maximising $\zeta$.</p></div>
#
# ## 2.5 The large-deviation (Cramér) reading
#
# Subtract the constant: $K(\zeta) = F(\zeta) - F(0) = \log \mathrm{E}_p\big[e^{\zeta\cdot v}\big]$
# is the cumulant-generating function of the value $v_a$ when the memory $a$ is drawn from the
# posterior $p$. Its conjugate is **Cramér's rate function**,
#
# $$I(z) = K^*(z) = F^*(z) + F(0) = \min\big\{ \mathrm{KL}(Q\,\Vert\,p) : \mathrm{E}_Q[v] = z \big\}.$$
#
# It has the three properties that make "most probable" true:
#
# * $I(z) \ge 0$, and $I(z) = 0$ only at $z$ = attention;
# * **Cramér's theorem:** the mean $\bar v_n$ of $n$ memories drawn independently from $p$ has
#   density $\approx e^{-n I(z)}$, so attention is its most probable value, and every other
#   value is exponentially unlikely in $n$;
# * near attention, $I(z) \approx \tfrac12 (z - \mu)^\top \Sigma^{-1} (z - \mu)$: the Gaussian of
#   the central limit theorem. Far from it, $I$ is not quadratic.
#
# The minimum KL is attained by exponential tilting: among all distributions $Q$ over the
# memories with mean $z$, the closest to $p$ is $Q_{\hat\zeta} \propto p\,e^{\hat\zeta\cdot v}$,
# with the $\hat\zeta$ of the previous section.

# %%
rate_in = bayes.rate_function(z_in, q, k, v)  # [B, Tq, Hq]
np.testing.assert_allclose(rate_in, fstar + F0_rows, rtol=1e-12)  # I = F* + F(0)
assert (np.asarray(rate_in) > 0).all()
np.testing.assert_allclose(bayes.rate_function(att, q, k, v), 0.0, atol=1e-14)
np.testing.assert_allclose(bayes.min_kl_with_mean(z_in, q, k, v), rate_in, rtol=1e-10)

# The KL of the tilted posterior, summed here by hand: Σ_a Q_a log(Q_a / p_a).
Qw, Pw = np.asarray(tilted), np.asarray(post)
kl_hand = np.swapaxes((Qw * np.log(Qw / Pw)).sum(-1), 1, 2)
np.testing.assert_allclose(kl_hand, rate_in, rtol=1e-10)

# Any other Q with the same mean (and total mass) is farther from p: move Q within the null
# space of the constraints [1; v^T] and the KL grows.
vals0, Q0, P0 = np.asarray(v[0, :, 0]), Qw[0, 0, 0], Pw[0, 0, 0]
null = np.linalg.svd(np.vstack([np.ones(Tk), vals0.T]))[2][1 + Dv:]  # [Tk - 1 - Dv, Tk]
for d in np.asarray(jax.random.normal(jax.random.key(7), (20, null.shape[0]))) @ null:
    other = Q0 + 0.5 * Q0.min() * d / np.abs(d).max()
    np.testing.assert_allclose([other.sum(), *(other @ vals0)], [1.0, *np.asarray(z_in[0, 0, 0])],
                               atol=1e-12)
    assert np.sum(other * np.log(other / P0)) > kl_hand[0, 0, 0]
print("I(z) = F*(z) + F(0) = KL(Q_zeta_hat || p) = min KL over Q with mean z; "
      "I(attention) = 0, I > 0 elsewhere   ✓")

# %% [markdown]
# Near attention the rate function is the quadratic form of the inverse covariance. The
# relative error is $O(\varepsilon)$ (the next term is cubic), so it should shrink tenfold when
# the step $\varepsilon$ does:

# %%
u = jax.random.normal(jax.random.key(8), att.shape)
quad = 0.5 * np.einsum("...i,...ij,...j->...", u, np.linalg.inv(np.asarray(cov)), u)
rel = {eps: np.asarray(bayes.rate_function(att + eps * u, q, k, v)) / (eps**2 * quad) - 1
       for eps in (1e-3, 1e-4)}
assert np.abs(rel[1e-3]).max() < 3e-3
np.testing.assert_allclose(rel[1e-3] / rel[1e-4], 10.0, rtol=0.1)
Markdown(f"Relative error of the quadratic approximation: at most "
         f"${np.abs(rel[1e-3]).max():.1e}$ at $\\varepsilon = 10^{{-3}}$ and "
         f"${np.abs(rel[1e-4]).max():.1e}$ at $\\varepsilon = 10^{{-4}}$, a ratio between "
         f"${(rel[1e-3] / rel[1e-4]).min():.1f}$ and ${(rel[1e-3] / rel[1e-4]).max():.1f}$.")

# %% [markdown]
# **Monte Carlo.** Now the claim that gives the rate function its meaning. `bayes.sample_means`
# draws $n$ memories from the posterior of the one-query example and averages their values,
# many times over. We histogram the means and compare with Daniels' saddle-point density
# (`bayes.saddlepoint_density`), $\sqrt{n/(2\pi\sigma_{\hat\zeta}^2)}\;e^{-nI(z)}$, whose
# exponent is $-n I(z)$ and whose prefactor ($\sigma_{\hat\zeta}^2$ is the variance under the
# tilted posterior) varies slowly; and with the Gaussian of the central limit theorem. The
# tolerance is honest: the count in a bin has a standard deviation of about
# $\sqrt{\text{count}}$, so its log is off by about $1/\sqrt{\text{count}}$; we allow five
# of those, plus 5% for the saddle-point approximation's own error, which is of order $1/n$.

# %%
n, num = 16, 400_000
means = np.asarray(bayes.sample_means(jax.random.key(9), n, num, q1, kk1, v1)).ravel()
assert abs(means.mean() - mu1) < 5 * np.sqrt(var1 / n / num)  # law of large numbers
np.testing.assert_allclose(means.var(), var1 / n, rtol=0.02)  # central limit: Var = σ²/n
counts, edges = np.histogram(means, bins=z_curve.size)
mids, width = (edges[1:] + edges[:-1]) / 2, edges[1] - edges[0]
zs = jnp.asarray(mids).reshape(1, -1, 1, 1)
density = np.asarray(bayes.saddlepoint_density(zs, n, q_curve, kk1, v1)).ravel()
rate_mids = np.asarray(bayes.rate_function(zs, q_curve, kk1, v1)).ravel()
gauss = np.sqrt(n / (2 * np.pi * var1)) * np.exp(-n * (mids - mu1) ** 2 / (2 * var1))
keep = counts >= 100
tolerance = 5 / np.sqrt(counts[keep]) + 0.05
miss_rate = np.abs(np.log(counts[keep] / (num * width * density[keep]))) / tolerance
miss_gauss = np.abs(np.log(counts[keep] / (num * width * gauss[keep]))) / tolerance
assert miss_rate.max() < 1  # e^{-nI} (with Daniels' prefactor) passes in every bin
assert miss_gauss.max() > 1  # the Gaussian does not, in the tails
# χ² per bin: about 1 if only counting noise separates the histogram from the curve.
chi2_rate = np.mean((counts[keep] - num * width * density[keep]) ** 2
                    / (num * width * density[keep]))
chi2_gauss = np.mean((counts[keep] - num * width * gauss[keep]) ** 2
                     / (num * width * gauss[keep]))
assert chi2_rate < 3 and chi2_gauss > 3 * chi2_rate
prefactor = np.log(density) + n * rate_mids  # the slowly varying part
slope = np.polyfit(-n * rate_mids[keep], np.log(counts[keep] / (num * width))
                   - prefactor[keep], 1)[0]
assert abs(slope - 1) < 0.03
Markdown(f"{num:,} means of $n = {n}$ draws; {keep.sum()} bins hold at least 100 means, and "
         f"in the farthest of them $nI(z) = {(n * rate_mids[keep]).max():.1f}$. The worst bin "
         f"misses $e^{{-nI}}$ by {miss_rate.max():.2f} of the tolerance and the Gaussian by "
         f"{miss_gauss.max():.2f}; $\\chi^2$ per bin is {chi2_rate:.2f} for $e^{{-nI}}$ "
         f"(what is left above 1 is the saddle-point approximation's own error) and "
         f"{chi2_gauss:.2f} for the Gaussian. Fitting the log density against $-nI(z)$ gives "
         f"a slope of ${slope:.3f}$.")

# %%
rate_curve = np.asarray(bayes.rate_function(z_curve_j, q_curve, kk1, v1)).ravel()
np.testing.assert_allclose(rate_curve, fstar_curve + F0_1, rtol=1e-10, atol=1e-13)

fig, axes = plt.subplots(1, 2, figsize=(10, 4))
axes[0].plot(z_curve, rate_curve, "k-", label=r"$I(z)$")
axes[0].plot(z_curve, (z_curve - mu1) ** 2 / (2 * var1), color="0.5", ls="--",
             label=r"$\frac{(z-\mu)^2}{2\sigma^2}$")
axes[0].axvline(mu1, color="tab:green", ls=":", label="attention")
axes[0].set_xlabel(r"$z$", fontsize=10)
axes[0].set_ylabel("rate", fontsize=10)
axes[0].set_title("Rate function and its quadratic", fontsize=11)
axes[0].legend(fontsize=10)
axes[1].semilogy(mids[keep], counts[keep] / (num * width), "ko", ms=4, label="Monte Carlo")
axes[1].semilogy(mids, density, "k-", label=r"$\propto e^{-nI(z)}$ (Daniels)")
axes[1].semilogy(mids, gauss, color="0.5", ls="--", label="Gaussian (CLT)")
axes[1].set_ylim(0.3 * (counts[keep] / (num * width)).min(), 3 * density.max())
axes[1].set_xlabel(r"mean of $n$ draws", fontsize=10)
axes[1].set_ylabel("density", fontsize=10)
axes[1].set_title(f"Means of n = {n} memories' values", fontsize=11)
axes[1].legend(fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: left, the rate function $I$ (black) is zero only at attention and matches the
# quadratic (dashed) near it, but not towards the edges of the hull. Right, the histogram of
# sample means on a log scale: look at the tails, where the points follow $e^{-nI}$ and leave
# the Gaussian, which is symmetric while the posterior of the values is not.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>With $K(\zeta) = F(\zeta) - F(0)$, the rate function $I = K^* = F^* + F(0)$ is a minimum
# KL divergence, zero only at attention. The mean of $n$ draws from the attention weights has
# density $\approx e^{-nI}$: attention is its most probable value, and that is the honest
# sense of "most probable".</p></div>
#
# ## 2.6 The honest Bayesian statement
#
# So what is the MAP estimate here? The posterior lives on the **memories**, and its mode,
# $a^* = \operatorname{argmax}_a p(a\mid q) = \operatorname{argmax}_a q\cdot k_a$, is the MAP
# memory. Reading its value gives **hard attention**, $v_{a^*}$ (`bayes.hard_attention`).
# Attention is the posterior *mean* instead, and it has the smaller expected squared loss.
#
# The scale is an inverse temperature. Following `hopfield` and notebook 7 we write it as
# $\text{scale} = \beta/D$, so the package's default $1/\sqrt D$ is $\beta = \sqrt D$. As
# $\beta\to\infty$ the posterior concentrates on $a^*$ and attention converges to hard
# attention. If $\Delta$ is the gap between the two largest $q\cdot k_a$, every other weight
# is at most $e^{-\beta\Delta/D}$, so
#
# $$\lVert \text{attention} - v_{a^*}\rVert_\infty \le (n-1)\, e^{-\beta\Delta/D}
#   \max_a \lVert v_a - v_{a^*}\rVert_\infty .$$

# %%
hard = bayes.hard_attention(q, k, v)
risk_hard = bayes.posterior_risk(hard, q, k, v)
assert (np.asarray(risk_att) < np.asarray(risk_hard)).all()
print("expected squared loss per row: attention", np.round(np.asarray(risk_att).ravel(), 3),
      " hard attention", np.round(np.asarray(risk_hard).ravel(), 3))

raw = s * np.sqrt(D)  # q·k without the scale, [B, Hq, Tq, Tk]
top2 = np.sort(raw, -1)[..., ::-1][..., :2]
gap = np.swapaxes(top2[..., 0] - top2[..., 1], 1, 2)  # Δ per row, [B, Tq, Hq]
spread = np.abs(np.asarray(v[:, :, 0])[:, None, None] - np.asarray(hard)[:, :, :, None]).max(
    (-2, -1))  # max_a |v_a − v_a*|, [B, Tq, Hq]
betas = np.geomspace(0.1, 1000, 41)
error, entropy = [], []
for beta in betas:
    err = np.abs(np.asarray(tae.attention(q, k, v, scale=beta / D) - hard)).max(-1)
    assert (err <= (Tk - 1) * np.exp(-beta * gap / D) * spread + 1e-15).all()
    error.append(err.max())
    w = np.asarray(tae.posterior(q, k, scale=beta / D))
    entropy.append(float(-(w * np.log(np.where(w > 0, w, 1))).sum(-1).mean()))
error, entropy = np.array(error), np.array(entropy)
assert error[-1] < 1e-12 and np.all(np.diff(entropy) < 0)
assert abs(entropy[0] - np.log(Tk)) < 0.01
# The MAP memory does not depend on β: hard attention is the same at every scale.
np.testing.assert_array_equal(bayes.hard_attention(q, k, v, scale=1000.0 / D), hard)
Markdown(f"At $\\beta = {betas[-1]:g}$ attention differs from hard attention by "
         f"${error[-1]:.1e}$; the bound held at all {betas.size} values of $\\beta$.")

# %%
plain = ticker.FuncFormatter(lambda x, _: f"{x:g}")  # 0.1, 1, 10, ... rather than 10^x
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
axes[0].semilogx(betas, entropy, "ko-", ms=3)
axes[0].axhline(np.log(Tk), ls="--", c="0.5", label=r"uniform: $\log T_k$")
axes[0].axvline(np.sqrt(D), ls=":", c="tab:green", label=r"default scale, $\beta=\sqrt{D}$")
axes[0].xaxis.set_major_formatter(plain)
axes[0].set_xlabel(r"$\beta$ (scale $= \beta/D$)", fontsize=10)
axes[0].set_ylabel("posterior entropy (nats)", fontsize=10)
axes[0].set_title("The posterior sharpens as β grows", fontsize=11)
axes[0].legend(fontsize=10)
positive = error > 0
axes[1].loglog(betas[positive], error[positive], "ko-", ms=3,
               label=r"$\max|$attention $-$ hard$|$")
bound = ((Tk - 1) * np.exp(-betas[:, None] * gap.ravel() / D) * spread.ravel()).max(-1)
axes[1].loglog(betas, bound, color="0.5", ls="--", label="bound")
axes[1].set_ylim(1e-17, 10)
axes[1].xaxis.set_major_formatter(plain)
axes[1].yaxis.set_major_locator(ticker.LogLocator(numticks=6))
axes[1].set_xlabel(r"$\beta$", fontsize=10)
axes[1].set_ylabel("max difference", fontsize=10)
axes[1].set_title("Attention → hard attention (MAP)", fontsize=11)
axes[1].legend(fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: left, the posterior's entropy falls from $\log T_k$ (uniform) towards 0 (one
# memory) as $\beta$ grows. Right, the distance from attention to hard attention: look at how
# it stays under the dashed bound and then collapses once $\beta\Delta/D$ is large (points at
# exactly 0 are not drawn).*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The honest Bayesian statement: the weights are a posterior over memories, attention is
# its mean (the Bayes estimate under squared loss), and the MAP memory gives hard attention,
# which attention approaches as $\beta\to\infty$.</p></div>
#
# ## 2.7 The link to Hopfield retrieval
#
# A modern Hopfield network (Ramsauer et al.) stores patterns and retrieves from a noisy
# cue $\xi$ with one step of `softmax(β · X ξ / D)ᵀ Y`: attention, with the same
# $\text{scale} = \beta/D$. Its energy is
# $E(\xi) = -\tfrac{1}{s}\log\sum_a e^{s\,x_a\cdot\xi} + \tfrac12\xi\cdot\xi$ with
# $s = \beta/D$, whose log-sum-exp is our $F(0)$; retrieval with values = keys is one gradient
# step on $E$ (`hopfield.hopfield_step`, checked against `jax.grad` in notebook 7). In the
# language of this notebook, the readout is the posterior mean of the stored values, and as
# $\beta\to\infty$ it becomes the value of the MAP pattern, hard attention. We read the memory
# with the package's `hopfield.retrieve`: a query is retrieved when the sign of the readout is
# exactly its stored value.

# %%
M, dim, flip = 64, 64, 0.15
mem = hf.make_memory(jax.random.key(10), M, dim)
idx = jnp.arange(M)
noisy = hf.noisy_queries(jax.random.key(11), mem, idx, flip)
betas_h = (1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
acc = [float(jnp.mean(hf.retrieved(hf.retrieve(noisy, mem, b), mem, idx))) for b in betas_h]
for b, a in zip(betas_h, acc, strict=True):
    print(f"beta = {b:>5g}   fraction retrieved = {a:.3f}")
assert acc[0] == 0.0 and acc[-1] == 1.0 and np.all(np.diff(acc) >= 0)

hard_h = bayes.hard_attention(noisy[None, :, None], mem.keys[None, :, None],
                              mem.values[None, :, None])[0, :, 0]
np.testing.assert_allclose(hf.retrieve(noisy, mem, 1e4), hard_h, rtol=0, atol=1e-6)
print(f"{M} patterns of dimension {dim}, {flip:.0%} of each query's signs flipped")
print("at beta = 1e4 the readout == hard attention, the value of the MAP pattern   ✓")

fig, ax = plt.subplots(figsize=(5.5, 3))
ax.semilogx(betas_h, acc, "ko-")
ax.xaxis.set_major_formatter(plain)
ax.set_xlabel(r"$\beta$ (scale $= \beta/D$)", fontsize=10)
ax.set_ylabel("fraction retrieved", fontsize=10)
ax.set_title(f"One attention step reads {M} stored patterns", fontsize=11)
ax.set_ylim(-0.05, 1.05)
plt.show()

# %% [markdown]
# *Figure: look at the jump. At small β the readout blurs all stored values and no query is
# read exactly; a few doublings of β later, one attention step recovers every pattern.
# Notebook 7 shards a much larger memory over devices.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Hopfield retrieval is one attention step with scale $\beta/D$: a posterior mean over
# stored patterns that becomes the MAP pattern as $\beta$ grows.</p></div>
#
# ## 2.8 Summary
#
# * The attention weights are a posterior over memories; attention is the posterior mean, the
#   Bayes estimate under squared loss. The log evidence is $F(0) - \log n$ plus a constant.
# * The paper's $\Gamma(\zeta, z) = \sum z\cdot\zeta - F(\zeta)$ is stationary exactly at
#   $\zeta^* = 0$, $z^* = \nabla F(0)$ = attention. But $\Gamma$ is linear in $z$, so
#   $\operatorname{argmax} e^{-\Gamma}$ does not exist, and the stationary point is a saddle
#   for every input (Hessian eigenvalues $(-c\pm\sqrt{c^2+4})/2$).
# * **Legendre:** $F^*(z) = \max_\zeta\Gamma$ is the convex conjugate; attention
#   $= \operatorname{argmin} F^*$, $\min F^* = -F(0)$, $\nabla F^* = \hat\zeta$.
# * **Cramér:** $I = F^* + F(0)$ is the minimum KL divergence to the posterior under a mean
#   constraint, zero only at attention, quadratic nearby; the mean of $n$ draws has density
#   $\approx e^{-nI}$, checked by Monte Carlo.
# * **MAP:** the MAP memory gives hard attention, the $\beta\to\infty$ limit of attention
#   (scale $\beta/D$); Hopfield retrieval is the same picture.
# * Next: why the log-sum-exp behind all of this can be split across devices (notebook 3).
#
# ## 2.9 Exercises
#
# Each answer is hidden: open "Answer" to read it, and the collapsed cell below it checks it.
#
# 1. **Predict, then measure.** In the one-query example with scalar values, $I(z)$ stays
#    finite as $z$ approaches the largest value $v_{\max}$, the edge of the hull. Before
#    running anything, predict its limit as a number you can read off the posterior. (Hint:
#    what is the probability that the mean of $n$ draws equals $v_{\max}$?) Then measure
#    `rate_function` ever closer to the edge.
# 2. Make every key identical. Predict the posterior, attention, the MAP memory and hard
#    attention. Is the MAP memory well defined?
# 3. Section 2.3 showed the Hessian of $\Gamma$ is indefinite at the stationary point. Is it
#    indefinite at every $(\zeta, z)$? Argue from the $2\times 2$ blocks, then check with
#    `gamma_hessian(..., zeta=...)` at random $\zeta$.
# 4. With $\beta = 16$ (scale $\beta/D$), flip the first $m$ signs of every stored key and
#    find the smallest $m$ at which `hopfield.retrieve` first fails to retrieve every pattern.
#
# <details><summary>Answer 1</summary>
#
# $-\log p(a_{\max})$, where $a_{\max}$ is the memory holding $v_{\max}$. The only way for
# the mean of $n$ draws to equal $v_{\max}$ is to draw $a_{\max}$ every time, which has
# probability $p(a_{\max})^n = e^{-n(-\log p(a_{\max}))}$, so Cramér's exponent there is
# $-\log p(a_{\max})$. In the limit the maximising $\hat\zeta$ runs off to $+\infty$ (the
# tilted posterior piles onto $a_{\max}$) while $I$ converges. The cell evaluates $I$ at
# distances from $10^{-2}$ down to $10^{-8}$ of the hull's width from the edge.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
p1 = np.asarray(tae.posterior(q1, kk1)).ravel()
predicted = -np.log(p1[np.argmax(np.asarray(v1).ravel())])
gaps_edge = np.geomspace(1e-2, 1e-8, z_curve.size)
near_edge = jnp.asarray(vmax - gaps_edge * (vmax - vmin)).reshape(1, -1, 1, 1)
rate_edge = np.asarray(bayes.rate_function(near_edge, q_curve, kk1, v1,
                                           max_newton=200)).ravel()
assert np.all(np.diff(rate_edge) > 0) and np.all(rate_edge < predicted)
assert predicted - rate_edge[-1] < 1e-5
print(f"-log p(a_max) = {predicted:.6f}")
for i in (0, gaps_edge.size // 2, -1):
    print(f"  I at {gaps_edge[i]:.1e} of the hull's width from the edge: {rate_edge[i]:.6f}")

# %% [markdown]
# <details><summary>Answer 2</summary>
#
# With identical keys every score is the same, so the posterior is uniform, $1/T_k$ for every
# memory, and attention is the plain mean of the values. The MAP memory is not well defined:
# every memory is a mode. `hard_attention` breaks the tie by taking the first key, which is an
# arbitrary choice, and its squared loss is worse than the mean's by
# $\lVert v_1 - \bar v\rVert^2$.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
same = jnp.broadcast_to(k[:, :1], k.shape)
np.testing.assert_allclose(tae.posterior(q, same), 1.0 / Tk, rtol=1e-12)
np.testing.assert_allclose(tae.attention(q, same, v),
                           jnp.broadcast_to(v.mean(1), att.shape), rtol=1e-12)
hard_same = bayes.hard_attention(q, same, v)
np.testing.assert_array_equal(hard_same, jnp.broadcast_to(v[:, 0], att.shape))  # the first
extra = (bayes.posterior_risk(hard_same, q, same, v)
         - bayes.posterior_risk(tae.attention(q, same, v), q, same, v))
np.testing.assert_allclose(extra, jnp.sum((v[:, 0, 0] - v[:, :, 0].mean(1)) ** 2), rtol=1e-12)
print("identical keys: uniform posterior, attention = mean of values, hard attention = "
      "first value (a tie broken arbitrarily)   ✓")

# %% [markdown]
# <details><summary>Answer 3</summary>
#
# Yes. At any $\zeta$ the Hessian is $\begin{pmatrix}-\nabla^2F(\zeta) & I\\ I & 0\end{pmatrix}$,
# and $\nabla^2 F(\zeta)$ is the covariance of the values under the tilted posterior, still
# positive semi-definite. The same rotation splits it into blocks
# $\begin{pmatrix}-c & 1\\ 1 & 0\end{pmatrix}$ with determinant $-1$, so $\Gamma$ has no local
# maximum or minimum anywhere: it is a saddle-shaped surface everywhere.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
for key in jax.random.split(jax.random.key(12), 3):
    zeta_r = 2.0 * jax.random.normal(key, att.shape)
    eig_r = np.linalg.eigvalsh(np.asarray(tae.gamma_hessian(q, k, v, zeta=zeta_r)))
    assert (eig_r.min(-1) < 0).all() and (eig_r.max(-1) > 0).all()
    np.testing.assert_allclose(np.prod(eig_r, -1), (-1.0) ** Dv, rtol=1e-10)
print("at random zeta: eigenvalues of both signs in every row, determinant (-1)^Dv   ✓")

# %% [markdown]
# <details><summary>Answer 4</summary>
#
# With values = a separate random pattern per key, the readout's sign is exactly right as
# long as the true key's weight dominates. Flipping $m$ signs lowers the true key's overlap
# from $D$ to $D - 2m$ while the other keys' overlaps stay near 0, so the margin
# $\beta (D - 2m)/D$ shrinks until another key's weight or the blur of many keys flips a sign
# of the readout. The cell scans $m$ upwards and prints where that first happens.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
# Every flip count m = 0..D/2 at once: M·(D/2 + 1) queries in one readout.
ms = np.arange(dim // 2 + 1)
flips = np.where(np.arange(dim)[None, :] < ms[:, None], -1.0, 1.0)  # [m, D]: flip the first m
corrupted = (flips[:, None, :] * np.asarray(mem.keys)[None]).reshape(-1, dim)
ok = hf.retrieved(hf.retrieve(jnp.asarray(corrupted, jnp.float32), mem, 16.0), mem,
                  jnp.tile(idx, ms.size))
all_ok = np.asarray(ok).reshape(ms.size, M).all(-1)
first_fail = int(ms[~all_ok][0])
assert 0 < first_fail and all_ok[:first_fail].all()
print(f"beta = 16: every pattern is retrieved up to {first_fail - 1} flipped signs of {dim}; "
      f"retrieval first fails at {first_fail}")

# %% [markdown]
# ## 2.10 References
#
# Shyam et al., *Tree Attention: Topology-aware Decoding for Long-Context Attention on GPU
# clusters*, [arXiv 2408.04093](https://arxiv.org/abs/2408.04093):
#
# * section 4, Observation 1, eqs. (5)–(6): the energy $F(\zeta)$ and attention as its
#   gradient;
# * Appendix C.1, eqs. (16)–(18): attention as the expectation of the values under the
#   weights $P_a$, and the partition function $Z$;
# * Appendix C.2, eqs. (30)–(34): the "log-likelihood" $\Gamma$ (eq. 30), its stationary
#   conditions (eqs. 31–33, correct) and the MAP claim (eq. 34, corrected here); Table I of
#   Appendix G names $\Gamma$ the "attention log-likelihood";
# * Appendix A: the related Bayesian reading of attention (Singh & Buckley) and Hopfield
#   networks.
#
# Background:
#
# * Ramsauer et al., *Hopfield Networks is All You Need*,
#   [arXiv 2008.02217](https://arxiv.org/abs/2008.02217): the modern Hopfield energy and
#   its one-step retrieval.
# * R. T. Rockafellar, *Convex Analysis*, section 12 (conjugate functions) and section 26
#   (the Legendre transformation).
# * A. Dembo and O. Zeitouni, *Large Deviations Techniques and Applications*, section 2.2
#   (Cramér's theorem).
# * T. M. Cover and J. A. Thomas, *Elements of Information Theory*, chapter 11 (Sanov's
#   theorem and the minimum-KL distribution under a mean constraint).
# * H. E. Daniels, *Saddlepoint approximations in statistics*, Annals of Mathematical
#   Statistics 25 (1954): the density of a sample mean from the cumulant-generating function.
#
# This notebook quotes no hardware figures.
