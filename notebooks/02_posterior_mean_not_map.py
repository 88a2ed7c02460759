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
# a saddle. This notebook shows why, then proves the statements that are true, each with
# checks that would fail if it were false:
#
# * **Bayes:** the weights are a posterior over memories and attention is the posterior
#   *mean*. The MAP memory gives *hard* attention, the limit of a large inverse temperature.
# * **Legendre** (optional): the saddle is a min–max. Maximising $\Gamma$ over the source
#   gives the convex conjugate $F^*$, and attention minimises $F^*$.
# * **Cramér** (optional): for the *mean of $n$ memories drawn from the attention weights*,
#   attention is the exact expected value for every $n$ and the unique zero of Cramér's rate
#   function $I$: the probability that the mean lands in a set away from attention falls like
#   $e^{-n \inf I}$. Attention is the most probable value of that mean only as
#   $n\to\infty$; at finite $n$ the peak sits about $-\kappa_3/(2\kappa_2 n)$ away, with
#   $\kappa_2$ and $\kappa_3$ the variance and third cumulant of $v$ under the weights (§2.6).
#
# **Prerequisites.** Notebook 1: the energy $F(\zeta)$, $\nabla F(0)$ = attention and
# $\nabla^2 F(0)$ = value covariance. Basic probability: Bayes' rule, expectations, the KL
# divergence. Gradients and Hessians. Convex conjugates and large deviations are introduced
# in the optional part.
#
# **Time.** About 30 minutes for sections 2.1 to 2.4; the optional deep dive (2.5 and 2.6)
# takes another 40. It runs in under a minute on an idle 2-core CPU.
#
# **Learning objectives.** After this notebook you can
#
# * read the attention weights as a posterior over memories, and show that attention is the
#   posterior mean, the Bayes estimate under squared loss;
# * explain why the paper's $\operatorname{argmax}_{\zeta, z} e^{-\Gamma(\zeta, z)}$ does not
#   exist ($\Gamma$ is unbounded in both directions), and prove with sympy and autodiff that
#   the stationary point of $\Gamma$ is a saddle for every input;
# * show that the MAP memory gives hard attention, the $\beta\to\infty$ limit of attention,
#   with the inverse temperature entering as $\text{scale} = \beta/D$;
# * (optional) compute the convex conjugate $F^*(z) = \sup_\zeta \Gamma(\zeta, z)$, say where
#   it is finite and where the supremum is attained, and show that attention minimises it;
# * (optional) compute Cramér's rate function $I(z)$, write it as a minimum KL divergence, and
#   measure by Monte Carlo both what is exact (the mean and variance of the sample mean)
#   and what is only asymptotic (the exponent $e^{-nI}$ of its tails, a limit as $n$ grows,
#   and the peak of its distribution).
#
# **Notation: two βs.** Here, and in notebook 7's optional section on associative memory,
# $\beta$ is an **inverse temperature**: the scores are scaled by $\beta/D$. That is this
# course's convention, and that of the package's `theory.hopfield`, whose functions take it
# as `beta`; Ramsauer et al.'s Hopfield update scales by $\beta$ itself (§2.4). From
# notebook 4 on, the cost model's $\beta$ (`beta_Bps`) is a link's **bandwidth** in bytes
# per second, the $\beta$ of Hockney's $\alpha$–$\beta$ model. The two
# are unrelated; each keeps the name its literature and the package give it.
#
# **Where it runs:** 8 simulated CPU devices in one process; notebook 1, "Where it runs",
# says what that means. All the maths here runs on one device, in float64.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises; later notebooks shard over these

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import contextlib
from math import comb
from unittest import mock

import jax.numpy as jnp
import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import numpy as np
import sympy as sp
from IPython.display import Markdown
from scipy import optimize, stats
from scipy.special import ive, logsumexp

from tree_attention_edu import plots
from tree_attention_edu.course.printing import sci
from tree_attention_edu.theory import bayes, symbolic

jax.config.update("jax_enable_x64", True)  # identities are checked in float64
assert jax.device_count() == 8, jax.devices()
REFERENCE, BASELINE = plots.color("reference"), plots.color("baseline")  # black, grey

# %% [markdown]
# ## 2.1 The posterior over memories
#
# Treat the keys $k_a$ as memories and the query as evidence about which one is meant. Take a
# uniform prior $1/T_k$ over the $T_k$ visible memories and an **unnormalised likelihood**
# $L(q \mid a) \propto e^{s_a}$, where $s_a = \text{scale}\; q\cdot k_a$ is the score. Bayes'
# rule only needs the likelihood up to a factor that does not depend on $a$, and gives
#
# $$p(a \mid q) = \frac{e^{s_a}}{\sum_b e^{s_b}},$$
#
# the attention weights (`tae.posterior`, shaped `[B, Hq, Tq, Tk]`). Attention reads out the
# value of the retrieved memory *averaged over the posterior*: it is the posterior mean,
#
# $$\text{attention}(q) = \sum_a p(a\mid q)\, v_a = \mathrm{E}_{p(a\mid q)}[v_a].$$
#
# Why "unnormalised"? As a density of $q \in \mathbf{R}^D$, $e^{s_a}/Z$ cannot be normalised
# for any constant $Z$: $\int e^{\text{scale}\, q\cdot k_a}\,dq$ diverges. On the unit sphere
# $\lVert q\rVert = 1$ it can: that is the von Mises–Fisher density
# $C_D(\kappa_a)\, e^{s_a}$ with $\kappa_a = \text{scale}\,\lVert k_a\rVert$, but its
# normaliser $C_D(\kappa_a)$ depends on $\lVert k_a\rVert$. So a normalised likelihood gives
# the softmax posterior only for **keys of equal norm**; the cell after the next one checks
# both halves of that sentence.
#
# The normaliser of the posterior is the evidence: with the likelihood's constant factor
# $1/Z$, $p(q) = \frac{1}{T_k}\sum_b e^{s_b}/Z$, so $\log p(q) = F(0) - \log T_k - \log Z$.
# The log-partition $F(0)$ of notebook 1 is the log evidence only up to $-\log T_k$ (and
# $Z$). ($Z$ here, because §2.3 uses $c$ for an eigenvalue. It is not the paper's $Z$: the
# paper's partition function, eq. 18, is $\sum_b e^{s_b} = e^{F(0)}$.)
#
# The cell computes the posterior from scratch, a numpy softmax of the raw scores, and
# compares the package's `posterior`, `attention` and `energy` with it.

# %%
kq, kk, kv = jax.random.split(jax.random.key(2), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 1, 2, 2, 1, 8, 3, 12
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))
rows = B * Tq * Hq  # independent (batch, query, head) rows

s = np.einsum("bqhd,bkd->bhqk", np.asarray(q), np.asarray(k[:, :, 0])) / np.sqrt(D)  # scores
post_np = np.exp(s - s.max(-1, keepdims=True))
post_np /= post_np.sum(-1, keepdims=True)  # [B, Hq, Tq, Tk]: softmax of the scores
vals_np = np.asarray(v[:, :, 0])  # [B, Tk, Dv]: one kv head
att_np = np.einsum("bhqk,bkv->bqhv", post_np, vals_np)  # the posterior mean
post = tae.posterior(q, k)  # [B, Hq, Tq, Tk]
att = tae.attention(q, k, v)  # [B, Tq, Hq, Dv]
np.testing.assert_allclose(post, post_np, rtol=1e-13)
np.testing.assert_allclose(att, att_np, rtol=0, atol=1e-14)

# The evidence with a uniform prior: log (1/Tk) Σ_a e^{s_a}, per row, from the raw scores.
log_evidence = np.log(np.mean(np.exp(s), axis=-1))  # [B, Hq, Tq]
F0 = float(tae.energy(q, k, v, jnp.zeros_like(att)))  # Σ over rows of F(0)
np.testing.assert_allclose(log_evidence.sum(), F0 - rows * np.log(Tk), rtol=1e-13)
Markdown(f"`posterior` and `attention` equal the numpy softmax and posterior mean. Summed over "
         f"the {rows} rows, $F(0) = {F0:.4f}$ while the log evidence with $Z = 1$, "
         f"$\\log\\frac{{1}}{{T_k}}\\sum_b e^{{s_b}}$, is "
         f"${log_evidence.sum():.4f}$; the difference is ${rows}\\log {Tk} = "
         f"{rows * np.log(Tk):.4f}$, to float64 rounding.")

# %% [markdown]
# The von Mises–Fisher check: for a unit query, the normalised likelihood of key $a$ is
# $C_D(\kappa_a)\,e^{s_a}$ with
# $\log C_D(\kappa) = (D/2-1)\log\kappa - (D/2)\log 2\pi - \log I_{D/2-1}(\kappa)$ ($I_\nu$ the
# modified Bessel function). Its posterior differs from the softmax when the keys' norms
# differ, and equals it once every key is rescaled to the same norm.

# %%
def log_vmf_normaliser(kappa, dim):
    """log C_D(κ) of the von Mises–Fisher density on the unit sphere of R^dim."""
    nu = dim / 2 - 1
    return nu * np.log(kappa) - dim / 2 * np.log(2 * np.pi) - (np.log(ive(nu, kappa)) + kappa)


def vmf_posterior(q_unit, keys, scale):
    """p(a | q) ∝ C_D(scale |k_a|) e^{scale q·k_a}: uniform prior, normalised likelihoods."""
    logits = scale * keys @ q_unit + log_vmf_normaliser(scale * np.linalg.norm(keys, axis=1),
                                                       keys.shape[1])
    return np.exp(logits - logsumexp(logits))


q_unit = np.asarray(q[0, 0, 0]) / np.linalg.norm(q[0, 0, 0])
keys = np.asarray(k[0, :, 0])
softmax_unit = np.exp(keys @ q_unit / np.sqrt(D) - logsumexp(keys @ q_unit / np.sqrt(D)))
gap_vmf = np.abs(vmf_posterior(q_unit, keys, 1 / np.sqrt(D)) - softmax_unit).max()
equal = keys / np.linalg.norm(keys, axis=1, keepdims=True)  # every key of norm 1
softmax_equal = np.exp(equal @ q_unit / np.sqrt(D) - logsumexp(equal @ q_unit / np.sqrt(D)))
np.testing.assert_allclose(vmf_posterior(q_unit, equal, 1 / np.sqrt(D)), softmax_equal,
                           rtol=1e-13)
assert gap_vmf > 1e-3  # ten orders of magnitude above the equal-norm agreement
print(f"keys of norms {np.linalg.norm(keys, axis=1).min():.2f} to "
      f"{np.linalg.norm(keys, axis=1).max():.2f}: the vMF posterior differs from the softmax by "
      f"up to {gap_vmf:.3f}; keys of equal norm: they agree to float64 rounding   ✓")

# %% [markdown]
# Why the mean and not some other summary of the posterior? Because the posterior mean is the
# **Bayes estimate under squared loss**: the expected loss of an estimate $z$ is
#
# $$\mathrm{E}_{p}\,\lVert v_a - z\rVert^2 = \operatorname{tr}\Sigma + \lVert z - \mu\rVert^2,$$
#
# with $\mu$ = attention and $\Sigma$ the value covariance, so it is smallest at $z = \mu$.
# `bayes.posterior_risk` computes the left side; we check it against $\operatorname{tr}\Sigma$
# computed in numpy from the posterior, at attention and at random estimates.

# %%
trace_np = np.einsum("bhqk,bkv->bqh", post_np, vals_np**2) - (att_np**2).sum(-1)  # tr Σ
risk_att = bayes.posterior_risk(att, q, k, v)  # [B, Tq, Hq]
np.testing.assert_allclose(risk_att, trace_np, rtol=1e-12)
for key in jax.random.split(jax.random.key(3), 5):
    z = att + 0.3 * jax.random.normal(key, att.shape)
    risk = bayes.posterior_risk(z, q, k, v)
    np.testing.assert_allclose(risk, trace_np + np.sum((np.asarray(z) - att_np) ** 2, -1),
                               rtol=1e-12)
    assert (risk > risk_att).all()
print("risk(z) == tr Σ + |z − attention|², so attention has the smallest risk   ✓")

fig, ax = plt.subplots(figsize=(7, 2.6))
p0 = post_np[0, 0, 0]
ax.bar(np.arange(Tk), p0, color="0.75")
ax.bar(np.argmax(p0), p0.max(), color="0.75", edgecolor=REFERENCE, hatch="//",
       label="the MAP memory")
ax.set_xlabel("memory (key) a", fontsize=10)
ax.set_ylabel(r"$p(a \mid q)$", fontsize=10)
ax.set_title("Posterior over memories for one query", fontsize=11)
ax.legend(fontsize=10)
plt.show()

# %% [markdown]
# *Figure: the posterior of one query. Look at how the mass is spread: the most probable
# memory (hatched) holds only part of it, and attention averages all the values with these
# weights instead of committing to that one.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The attention weights are a posterior over memories under an unnormalised likelihood
# $e^{s_a}$ (or a normalised one with keys of equal norm); attention is its mean, the
# estimate with the smallest expected squared error. The log evidence is $F(0) - \log T_k$
# (plus a constant), not $F(0)$.</p></div>
#
# ## 2.2 The paper's claim: Γ and its stationary point
#
# Appendix C.2 of the paper proposes a "log-likelihood":
#
# > $\Gamma(\zeta, z) = \sum_{i=1}^{N} \sum_{A=1}^{d} \left( z_{i,A} \zeta_{i,A} - F(\zeta, x) \right)$. (30)
# > [...] Let us minimize the above with respect to $\zeta$ and $z$ simultaneously:
# > $\frac{\partial \Gamma}{\partial \zeta_{i,A}} = 0, \frac{\partial \Gamma}{\partial z_{i,A}} = 0$. (31)
# > These conditions written explicitly read $\zeta_{i,A*} = 0, \quad z_{i,A*} = \frac{\partial F}{\partial \zeta_{i,A}}$. (32)
# > [...] In all, this means we can obtain the gradient w.r.t. from MAP estimation of the
# > following likelihood: $z_{i*,A}, \zeta_{i*,A} = \operatorname{argmax}_{\zeta,z} e^{-\Gamma(\zeta,z)}$. (34)
#
# Read eq. 30 literally: $F$ sits inside the double sum, so it is subtracted $N\cdot d$ times,
# and $\partial\Gamma/\partial\zeta_{i,A} = 0$ gives $z = N d\,\partial F/\partial\zeta$, not
# eq. 32. Eq. 32 holds when $F$ is counted **once**:
#
# $$\Gamma(\zeta, z) = \sum_{i, A} z_{i,A}\,\zeta_{i,A} - F(\zeta),$$
#
# which is what `tae.log_likelihood` computes (with $F = F_{\text{tot}}$ over queries and
# heads) and what the rest of this notebook means by $\Gamma$. The first cell checks the
# difference with autodiff. The stationary conditions then read:
#
# * $\partial\Gamma/\partial z = \zeta = 0$, so $\zeta^* = 0$;
# * $\partial\Gamma/\partial\zeta = z - \nabla F(\zeta) = 0$, so $z^* = \nabla F(0)$, which is
#   attention (notebook 1 proved it for any number of keys).

# %%
zeros = jnp.zeros_like(att)
nd = rows * Dv  # N·d terms in the double sum of eq. 30


def gamma_literal(zeta, z):
    """Eq. 30 as printed: F subtracted once per term of the double sum."""
    return jnp.sum(z * zeta) - nd * tae.energy(q, k, v, zeta)


grad_once = jax.grad(tae.log_likelihood, argnums=1)(att, zeros, q, k, v)  # ∂Γ/∂ζ at (0, μ)
np.testing.assert_allclose(grad_once, 0.0, atol=1e-14)  # F once: attention is stationary
grad_lit = jax.grad(gamma_literal)(zeros, att)
np.testing.assert_allclose(grad_lit, (1 - nd) * att_np, rtol=1e-12)  # not stationary ...
np.testing.assert_allclose(jax.grad(gamma_literal)(zeros, nd * att), 0.0, atol=1e-12)
print(f"F once: z* = attention;  F counted N·d = {nd} times (eq. 30 as printed): "
      f"z* = {nd} x attention   ✓")

# %% [markdown]
# sympy solves the two conditions in turn. It does so on an instance ($T_k = 3$ keys,
# $d = 2$), so this cell is a check, not a proof; the proof for any $T_k$ and $d$ is the two
# bullet points above plus notebook 1's $\nabla F(0) = $ attention.

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
# so agreement with the numpy posterior mean is evidence, not a tautology.

# %%
lengths = jnp.array([9])
z_star, zeta_star = tae.stationary_point(q, k, v, causal=True, kv_lengths=lengths)
att_masked = np.zeros((B, Tq, Hq, Dv))  # the numpy reference
for i, hh in np.ndindex(Tq, Hq):
    seen = np.arange(Tk) <= 9 - Tq + i  # decode convention: query i sits at 9 − Tq + i
    w_i = np.exp(s[0, hh, i, seen] - logsumexp(s[0, hh, i, seen]))
    att_masked[0, i, hh] = w_i @ vals_np[0, seen]
np.testing.assert_allclose(z_star, att_masked, rtol=0, atol=1e-14)  # float64 rounding
np.testing.assert_allclose(zeta_star, 0.0, atol=1e-14)
grad_gamma = jax.grad(tae.log_likelihood, argnums=(0, 1))(
    z_star, zeta_star, q, k, v, causal=True, kv_lengths=lengths)
assert max(float(jnp.abs(g).max()) for g in grad_gamma) < 1e-12
print("Newton-GMRES stationary point: |z* − attention| and |zeta*| below 10^-14 (float64 "
      "rounding), grad Gamma == 0   ✓")

# %% [markdown]
# One more property tells what kind of point this is. For fixed $z$, $\Gamma$ is **concave** in
# $\zeta$ (its Hessian there is $-\nabla^2F \preceq 0$); for fixed $\zeta$ it is **linear**,
# hence convex, in $z$. That alone does not make a stationary point a saddle ($-\lVert\zeta
# \rVert^2$, with no $z$ in it, is concave–convex, and its stationary points are maxima in
# the weak sense); here the coupling term $z\cdot\zeta$ does: it makes the stationary point a
# saddle, a min–max point, never a maximum or a minimum. The next section shows it directly.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>With $F$ counted once (eq. 30 as printed counts it $N d$ times), the paper's stationary
# point is right: $\nabla\Gamma = 0$ exactly at $\zeta^* = 0$, $z^* = \nabla F(0)$ =
# attention. What it calls that point is the question.</p></div>
#
# ## 2.3 Not a maximum, not a minimum: a saddle
#
# **$\Gamma$ is unbounded in both directions.** It is linear in $z$: for any $\zeta \ne 0$,
# $\Gamma(\zeta, z - t\zeta) = \Gamma(\zeta, z) - t\lVert\zeta\rVert^2$. As $t\to+\infty$,
# $\Gamma\to-\infty$, so $e^{-\Gamma}$ grows without bound: it has no argmax, and it cannot be
# normalised into a density, so it is not a likelihood or a posterior either. The paper's own
# words, "minimize the above" (and appendix C.2's opening, "derive the self-attention
# operation as the minimization of an energy function"), describe the same search:
# minimising $\Gamma$ *is* maximising $e^{-\Gamma}$, and it fails in the same direction,
# $t\to+\infty$. Maximising $\Gamma$ fails the other way: $t\to-\infty$ sends $\Gamma$ to
# $+\infty$.
#
# **Predict, then run.** Along the line $z = z^* - t\zeta$ with a fixed $\zeta \ne 0$, what
# does $\log e^{-\Gamma} = -\Gamma$ do as $t$ runs from $-1000$ to $+1000$?
#
# <details><summary>Answer</summary>
#
# It is a straight line in $t$ with slope $\lVert\zeta\rVert^2 > 0$: $-\Gamma\to+\infty$ as
# $t\to+\infty$ ($e^{-\Gamma}$ has no maximum, $\Gamma$ no minimum) and $-\Gamma\to-\infty$
# as $t\to-\infty$ ($\Gamma$ has no maximum). At $t = 0$ it is
# $F(\zeta) - z^*\cdot\zeta$, which is at least $F(0)$ because $F$ is convex
# ($F(\zeta) \ge F(0) + \nabla F(0)\cdot\zeta$ and $z^* = \nabla F(0)$): the cell prints
# 13.3602 at $t = 0$ against $F(0) = 13.1636$. Only at $\zeta = 0$, the stationary point,
# is it $F(0)$. The cell prints the line (the exponential itself overflows float64 at its
# top end) and asserts the slope.
#
# </details>

# %%
zeta_dir = 0.5 * jax.random.normal(jax.random.key(4), att.shape)
ts = np.array([-1000.0, -100.0, -10.0, 0.0, 10.0, 100.0, 1000.0])
neg_gamma = np.array([-float(tae.log_likelihood(att - t * zeta_dir, zeta_dir, q, k, v))
                      for t in ts])
np.testing.assert_allclose(np.diff(neg_gamma) / np.diff(ts), float(jnp.sum(zeta_dir**2)),
                           rtol=1e-9)  # exactly linear in t, slope |ζ|²
at_stationary = -float(tae.log_likelihood(att, zeros, q, k, v))  # = F(0)
np.testing.assert_allclose(at_stationary, F0, rtol=1e-14)
float_max = np.log(np.finfo(np.float64).max)
assert neg_gamma[-1] > float_max > at_stationary and neg_gamma[0] < -float_max
for t, g in zip(ts, neg_gamma, strict=True):
    print(f"t = {t:>6g}:  log e^(-Gamma) = {g:12.4f}")
print(f"at the stationary point: log e^(-Gamma) = F(0) = {at_stationary:.4f}")
at_t0 = float(tae.energy(q, k, v, zeta_dir)) - float(jnp.sum(att * zeta_dir))  # F(ζ) - z*·ζ
np.testing.assert_allclose(neg_gamma[ts == 0.0][0], at_t0, rtol=1e-12)
assert at_t0 > at_stationary  # F convex: F(ζ) - z*·ζ ≥ F(0), equal only at ζ = 0
print(f"at t = 0: F(zeta) - z*.zeta = {at_t0:.4f} > F(0) = {at_stationary:.4f}")

# %% [markdown]
# **The Hessian is indefinite.** At $(\zeta, z) = (0, z^*)$ the Hessian of $\Gamma$ is
#
# $$\nabla^2\Gamma = \begin{pmatrix} -\Sigma & I \\ I & 0 \end{pmatrix},$$
#
# with $\Sigma = \nabla^2F(0)$ the value covariance. Rotating both blocks into the eigenbasis
# of $\Sigma$ splits it into $2\times 2$ blocks $\begin{pmatrix} -c & 1 \\ 1 & 0\end{pmatrix}$,
# one per eigenvalue $c \ge 0$ of $\Sigma$. sympy gives their eigenvalues for a symbolic
# $c \ge 0$; their product, the determinant, is $-1$, so each block has one positive and one
# negative eigenvalue **whatever $c$ is**: the stationary point is a saddle for every input.

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
# eigenvalues $c$ of the numpy covariance. The same batch carries random inputs from nearly
# uniform posteriors (scale $\beta/D$ with $\beta$ small) to nearly one-hot ones ($\beta$
# large, where $\Sigma\to 0$ and the eigenvalues tend to $\pm 1$), and the sign check runs
# on all of them.

# %%
# The example, and 63 random inputs from nearly uniform to nearly one-hot posteriors, in one
# batch. The queries carry the factor β/√D: with the default scale 1/√D the scores are then
# (β/D) q·k, the convention of §2.4, for β from 0.1 to 1000.
kr = jax.random.split(jax.random.key(13), 3)
many = 64
beta_r = jnp.geomspace(0.1, 1000, many - 1)[:, None, None, None] / np.sqrt(D)
q_all = jnp.concatenate([q, jax.random.normal(kr[0], (many - 1, Tq, Hq, D)) * beta_r])
k_all = jnp.concatenate([k, jax.random.normal(kr[1], (many - 1, Tk, Hkv, D))])
v_all = jnp.concatenate([v, jax.random.normal(kr[2], (many - 1, Tk, Hkv, Dv))])
H_all = np.asarray(tae.gamma_hessian(q_all, k_all, v_all))  # [64, Tq, Hq, 2Dv, 2Dv]
eig_all = np.linalg.eigvalsh(H_all)
assert (eig_all.min(-1) < 0).all() and (eig_all.max(-1) > 0).all()

cov_np = (np.einsum("bhqk,bkv,bkw->bqhvw", post_np, vals_np, vals_np)
          - np.einsum("bqhv,bqhw->bqhvw", att_np, att_np))  # Σ per row, numpy
H, eig = H_all[:1], eig_all[:1]  # the example
c_vals = np.linalg.eigvalsh(cov_np)  # eigenvalues of Σ, per row
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
s1 = np.asarray(kk1[0, :, 0]) @ np.asarray(q1[0, 0, 0]) / np.sqrt(D)  # scores, numpy
p1 = np.exp(s1 - logsumexp(s1))  # the posterior of the one-query example
vals1 = np.asarray(v1).ravel()
mu1 = float(p1 @ vals1)  # attention
var1 = float(p1 @ (vals1 - mu1) ** 2)  # its variance
F0_1 = float(logsumexp(s1))  # F(0)
vmin, vmax = float(vals1.min()), float(vals1.max())


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
                      cmap="Greys")
fig.colorbar(cs, ax=axes[0], label=r"$\Gamma(\zeta, z)$")
axes[0].contour(np.asarray(z_g), np.asarray(zeta_g), np.asarray(gamma_grid), levels=[-F0_1],
                colors=REFERENCE, linestyles="--")
axes[0].plot(mu1, 0, "x", color=REFERENCE, ms=12, mew=3)
axes[0].set_xlabel(r"$z$", fontsize=10)
axes[0].set_ylabel(r"$\zeta$", fontsize=10)
axes[0].set_title(r"$\Gamma$ over the plane; $\times$: the stationary point", fontsize=11)
for j, (style, name) in enumerate((("-", "negative"), ("--", "positive"))):
    d_zeta, d_z = vec1[:, j]
    g = gamma_1d(jnp.asarray(line * d_zeta), jnp.asarray(mu1 + line * d_z))
    axes[1].plot(line, np.asarray(g) + F0_1, style, color=REFERENCE,
                 label=f"{name} curvature ({lam1[j]:+.2f})")
    # Γ(t·u) − Γ(0) = ½ λ t² + O(t³) along an eigenvector u
    np.testing.assert_allclose(float(g[31] + F0_1), 0.5 * lam1[j] * line[31] ** 2,
                               rtol=0.05)
axes[1].axhline(0, color=BASELINE, lw=0.8)
axes[1].set_xlabel("step t along the eigenvector", fontsize=10)
axes[1].set_ylabel(r"$\Gamma - \Gamma(0, z^*)$", fontsize=10)
axes[1].set_title("Through the stationary point", fontsize=11)
axes[1].legend(fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: left, $\Gamma$ for one query with scalar values (darker is higher). Look at the
# dashed level set $\Gamma = -F(0)$: it is two curves that cross at the stationary point (the
# line $\zeta = 0$ and a curve through it), the signature of a saddle, not the closed loops
# around a maximum. Right: along one eigenvector of the Hessian $\Gamma$ falls away from the
# stationary point, along the other it rises.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>$\Gamma$ is linear in $z$, so it is unbounded above and below: $e^{-\Gamma}$ has no
# maximum (and $\Gamma$ no minimum) and no normalisation. Its Hessian
# $\begin{pmatrix}-\Sigma & I\\ I & 0\end{pmatrix}$ always has eigenvalues of both signs. The
# paper's eq. 34 names a point that does not exist; its stationary point is a
# saddle.</p></div>
#
# ## 2.4 The honest Bayesian statement: the MAP memory is hard attention
#
# So what is the MAP estimate here? The posterior lives on the **memories**, and its mode,
# $a^* = \operatorname{argmax}_a p(a\mid q) = \operatorname{argmax}_a q\cdot k_a$, is the MAP
# memory. Reading its value gives **hard attention**, $v_{a^*}$ (`bayes.hard_attention`).
# Attention is the posterior *mean* instead, and it has the smaller expected squared loss.
#
# The scale is an inverse temperature. Following `hopfield` and notebook 7 we write it as
# $\text{scale} = \beta/D$, so the package's default $1/\sqrt D$ is $\beta = \sqrt D$. As
# $\beta\to\infty$ the posterior concentrates on $a^*$ and attention converges to hard
# attention, with a bound. Let $\Delta$ be the gap between the two largest $q\cdot k_a$.
# Every other weight is $p_a = e^{s_a}/\sum_b e^{s_b} \le e^{s_a - s_{a^*}} \le
# e^{-\beta\Delta/D}$, and attention $- v_{a^*} = \sum_{a\ne a^*} p_a (v_a - v_{a^*})$ has
# $T_k - 1$ terms, so
#
# $$\lVert \text{attention} - v_{a^*}\rVert_\infty \le (T_k-1)\, e^{-\beta\Delta/D}
#   \max_a \lVert v_a - v_{a^*}\rVert_\infty .$$

# %%
hard = bayes.hard_attention(q, k, v)
winner = s.argmax(-1)  # [B, Hq, Tq]: the MAP memory of each row, from the numpy scores
hard_np = np.stack([[vals_np[0, winner[0, h, i]] for h in range(Hq)] for i in range(Tq)])[None]
np.testing.assert_array_equal(hard, hard_np)
risk_hard = bayes.posterior_risk(hard, q, k, v)
assert (np.asarray(risk_att) < np.asarray(risk_hard)).all()
print("expected squared loss per row: attention", np.round(np.asarray(risk_att).ravel(), 3),
      " hard attention", np.round(np.asarray(risk_hard).ravel(), 3))

raw = s * np.sqrt(D)  # q·k without the scale, [B, Hq, Tq, Tk]
top2 = np.sort(raw, -1)[..., ::-1][..., :2]
gap = np.swapaxes(top2[..., 0] - top2[..., 1], 1, 2)  # Δ per row, [B, Tq, Hq]
spread = np.abs(vals_np[:, None, None] - hard_np[:, :, :, None]).max((-2, -1))  # [B, Tq, Hq]
betas = np.geomspace(0.1, 1000, 41)
error, entropy = [], []
for beta in betas:
    err = np.abs(np.asarray(tae.attention(q, k, v, scale=beta / D)) - hard_np).max(-1)
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
axes[0].semilogx(betas, entropy, "o-", color=REFERENCE, ms=3)
axes[0].axhline(np.log(Tk), ls="--", c=BASELINE, label=r"uniform: $\log T_k$")
axes[0].axvline(np.sqrt(D), ls=":", c=BASELINE, label=r"default scale, $\beta=\sqrt{D}$")
axes[0].xaxis.set_major_formatter(plain)
axes[0].set_xlabel(r"$\beta$ (scale $= \beta/D$)", fontsize=10)
axes[0].set_ylabel("posterior entropy (nats)", fontsize=10)
axes[0].set_title("The posterior sharpens as β grows", fontsize=11)
axes[0].legend(fontsize=10)
positive = error > 0
axes[1].loglog(betas[positive], error[positive], "o-", color=REFERENCE, ms=3,
               label=r"$\max|$attention $-$ hard$|$")
bound = ((Tk - 1) * np.exp(-betas[:, None] * gap.ravel() / D) * spread.ravel()).max(-1)
axes[1].loglog(betas, bound, color=BASELINE, ls="--", label="bound")
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
# **Predict, then run.** Give a query two memories with exactly the same, largest score, and
# different values $v_1 \ne v_2$. As $\beta\to\infty$, what does attention tend to? What is the
# MAP memory?
#
# <details><summary>Answer</summary>
#
# Attention tends to $(v_1 + v_2)/2$: the two tied memories share the posterior mass equally
# and every other weight vanishes. The MAP memory is not defined: the posterior has two modes.
# `hard_attention` breaks the tie by taking the first key, an arbitrary choice, so here
# attention does **not** converge to hard attention. The cell copies the best key of the
# one-query example of §2.3 into another slot.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_1", "locked": false, "schema_version": 3, "solution": true, "task": false}
best = int(np.argmax(s1))
other = int(np.argmax(np.abs(vals1 - vals1[best])))  # the value farthest from the best's
kk_tie = kk1.at[0, other].set(kk1[0, best])  # two keys with the same largest score
att_tie = np.asarray(tae.attention(q1, kk_tie, v1, scale=1e8 / D)).ravel()[0]
np.testing.assert_allclose(att_tie, (vals1[best] + vals1[other]) / 2, rtol=1e-12)
hard_tie = float(np.asarray(bayes.hard_attention(q1, kk_tie, v1)).ravel()[0])
assert hard_tie == vals1[min(best, other)]
assert abs(hard_tie - att_tie) == abs(vals1[best] - vals1[other]) / 2  # far from either
print(f"tied keys {min(best, other)} and {max(best, other)}: attention at beta = 1e8 is "
      f"{att_tie:.6f} = the mean of their values; hard attention picks key "
      f"{min(best, other)} ({hard_tie:.6f})")

# %% [markdown]
# **Hopfield networks, briefly.** A modern Hopfield network (Ramsauer et al. 2020) stores
# patterns as the rows of a matrix $X$ ($M \times D$, one pattern per row, as keys are
# stored) and retrieves from a cue $\xi$ with
# $\xi^{\text{new}} = X^\top\operatorname{softmax}(\beta X\xi)$: one attention step whose
# keys *and* values are the stored patterns, with scale $\beta$. (Ramsauer et al. store the
# patterns as columns, $D \times M$, and write $X\operatorname{softmax}(\beta X^\top\xi)$: the
# same update.) Here $\beta$ is the inverse temperature, not the bandwidth $\beta$ of
# the cost model in notebooks 4, 6, 8 and 9 (the notation note at the top).
# The paper's appendix A points out the restriction:
#
# > the update rule in Ramsauer et al. (2020) requires the tying of certain weights (K and V)
# > in the attention operation. This restricts the Hopfield derivation to modelling
# > auto-associative retrieval networks, while transformer attention is hetero-associative.
#
# This course's `hopfield` module writes the scale as $\beta/D$ (our convention, not
# Ramsauer's) and also reads separate values (hetero-associative retrieval, which is
# attention but no longer a Hopfield update). Notebook 7, section 7.8, reads a memory this
# way; in the language of this notebook, the readout is a posterior mean
# over stored patterns that becomes the MAP pattern as $\beta$ grows.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The honest Bayesian statement: the weights are a posterior over memories, attention is
# its mean (the Bayes estimate under squared loss), and the MAP memory gives hard attention,
# which attention approaches as $\beta\to\infty$ when the best key is unique.</p></div>
#
# <div class="admonition note"><p class="admonition-title">Optional deep dive: sections 2.5
# and 2.6</p>
# <p>The core of the course continues in notebook 3. The next two sections make the
# paper's stationary point precise with convex analysis (Legendre) and large deviations
# (Cramér). They are not needed later.</p></div>
#
# ## 2.5 Optional: the min–max (Legendre) reading
#
# A saddle of a concave–convex function is the solution of a **min–max** problem. For fixed
# $z$, $\Gamma$ is concave in $\zeta$, and its supremum over $\zeta$ is the **convex
# conjugate** (Legendre–Fenchel transform) of $F$:
#
# $$F^*(z) = \sup_\zeta \big(z\cdot\zeta - F(\zeta)\big).$$
#
# Concavity alone does not give a maximum. Where the supremum is finite and where it is
# attained depends on $z$ and the convex hull of the values:
#
# * $z$ **outside** the hull: $F^* = +\infty$. A direction $u$ with $u\cdot z > \max_a
#   u\cdot v_a$ exists, and $\Gamma(tu, z)$ grows linearly in $t$.
# * $z$ **on the boundary**: $F^*$ is finite, but no $\zeta$ attains it (the maximiser runs
#   off to infinity: the edge case of the exercise below, and §2.8's first exercise).
# * $z$ in the **relative interior**: the maximum is attained at $\hat\zeta(z)$, the solution
#   of $\nabla F(\hat\zeta) = z$. If moreover the covariance $\Sigma(\hat\zeta)$ is invertible,
#   $\hat\zeta$ is unique and $\nabla F^*(z) = \hat\zeta(z)$.
#
# $\Sigma$ is singular when the differences $v_a - v_b$ of the visible values span less
# than $\mathbf{R}^{D_v}$ (so $D_v$ values that are linearly independent still give a
# singular $\Sigma$), for example when $T_k \le D_v$ (a head of dimension 128 with a short context). Then the hull is flat:
# $F^* = +\infty$ off its affine hull, $\hat\zeta$ is unique only up to the null space of
# $\Sigma$, and the quadratic approximation of the next section needs the pseudo-inverse on
# that subspace. This example has $T_k = 12 > D_v = 3$ random values, so $\Sigma$ is
# invertible.
#
# $F^*$ is convex, and its minimum is where $\hat\zeta = 0$, that is where $z = \nabla F(0)$:
#
# $$\operatorname{argmin}_z F^*(z) = \text{attention}, \qquad \min_z F^*(z) = -F(0).$$
#
# So the paper's stationary point is $\min_z\sup_\zeta\Gamma(\zeta, z)$.
#
# **Exercise (code).** Before the package's solver, write one by hand for scalar values:
# `conjugate_1d(z, s, vals)` returns $(F^*(z), \hat\zeta)$ for one query with scores `s` and
# scalar values `vals`, by Newton's method on $F'(\zeta) = z$ (with $F' = $ the tilted mean
# and $F'' = $ the tilted variance). Outside $[\min v, \max v]$ return $(+\infty,
# \text{NaN})$. On the edge, say $z = \max v$, the supremum is finite but not attained: as
# $\zeta \to \infty$, $\zeta z - F(\zeta) \to -\log \sum_{a:\, v_a = z} e^{s_a}$ (the keys
# whose value is $z$ keep their weight, the others vanish), so return that and NaN. Cap each
# Newton step at 1: far from the solution $F''$ can be tiny.
# The package's solvers (`bayes.conjugate_energy`, `rate_function`, `min_kl_with_mean` and
# their private helpers) raise while your function runs.

# %%
def conjugate_1d(z, s, vals):
    """(F*(z), ζ̂) for one query: scores s [Tk], scalar values vals [Tk]."""
    # TODO: Newton on ζ until |z − E_ζ[v]| < 1e-13; F*(z) = z ζ̂ − F(ζ̂).
    return 0.0, 0.0  # placeholder: runs, and the test below rejects it


stub_conjugate_1d = conjugate_1d


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "conjugate_1d", "locked": false, "schema_version": 3, "solution": true, "task": false}
def conjugate_1d(z, s, vals):
    """(F*(z), ζ̂) for one query: scores s [Tk], scalar values vals [Tk]."""
    if not vals.min() <= z <= vals.max():
        return np.inf, np.nan  # sup = +inf outside the hull
    if z in (vals.min(), vals.max()):  # on the edge: the limit as zeta -> +-inf, not attained
        return -logsumexp(s[vals == z]), np.nan
    zeta = 0.0
    for _ in range(200):
        x = s + zeta * vals
        w = np.exp(x - logsumexp(x))  # tilted weights
        mean, var = w @ vals, w @ (vals - w @ vals) ** 2
        if abs(z - mean) < 1e-13:
            break
        zeta += np.clip((z - mean) / var, -1.0, 1.0)  # Newton step, capped
    return z * zeta - logsumexp(s + zeta * vals), zeta


# %% nbgrader={"grade": true, "grade_id": "test_conjugate_1d", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def check_conjugate_1d(fn_given):
    """Raises AssertionError unless fn solves the one-query conjugate correctly."""
    own = AssertionError("write the solver yourself: bayes.conjugate_energy is the answer")
    # every solver, public or private (_solve, _solve_rows, _maximise, _conjugate_step)
    solvers = {"rate_function", "min_kl_with_mean"} | {
        name for name in dir(bayes) if any(w in name for w in ("solve", "conjugate", "maximise"))}
    assert {"conjugate_energy", "_solve", "_solve_rows", "_maximise"} <= solvers, solvers

    def fn(z, s, vals):  # the student's function, with the package's solvers raising
        with contextlib.ExitStack() as stack:
            for module in (bayes, tae):
                for name in sorted(solvers):
                    if hasattr(module, name):
                        stack.enter_context(mock.patch.object(module, name, side_effect=own))
            return fn_given(z, s, vals)

    value, zeta_hat = fn(mu1, s1, vals1)  # at attention: ζ̂ = 0, F* = −F(0)
    np.testing.assert_allclose([value, zeta_hat], [-F0_1, 0.0], atol=1e-12)
    tilt = 0.8  # a point built as a tilted mean has ζ̂ = the tilt
    w = np.exp(s1 + tilt * vals1 - logsumexp(s1 + tilt * vals1))
    np.testing.assert_allclose(fn(w @ vals1, s1, vals1)[1], tilt, rtol=1e-10)
    z0, step = vmin + 0.3 * (vmax - vmin), 1e-5  # dF*/dz = ζ̂, by central differences
    slope = (fn(z0 + step, s1, vals1)[0] - fn(z0 - step, s1, vals1)[0]) / (2 * step)
    np.testing.assert_allclose(slope, fn(z0, s1, vals1)[1], rtol=1e-6)
    assert fn(vmax + 0.1, s1, vals1)[0] == np.inf  # outside the hull
    edge, zeta_edge = fn(vmax, s1, vals1)  # on the edge: the limit of zeta z - F(zeta)
    np.testing.assert_allclose(edge, -logsumexp(s1[vals1 == vmax]), rtol=1e-12)
    assert np.isnan(zeta_edge)  # not attained
    # ... approached from below: at zeta = 40 / (the gap to the next value) the other keys'
    # weights are below e^-40 times theirs.
    far = 40 / (vmax - vals1[vals1 < vmax].max())
    assert edge - 1e-6 < far * vmax - logsumexp(s1 + far * vals1) <= edge + 1e-9
    # scores and values built here, not the notebook's: at a tilted mean, ζ̂ = the tilt and
    # F* = z ζ̂ − F(ζ̂)
    rng = np.random.default_rng(5)
    s_new, vals_new, tilt_new = rng.normal(size=6), rng.normal(size=6), -1.3
    x_new = s_new + tilt_new * vals_new
    z_new = np.exp(x_new - logsumexp(x_new)) @ vals_new
    np.testing.assert_allclose(fn(z_new, s_new, vals_new),
                               [z_new * tilt_new - logsumexp(x_new), tilt_new], rtol=1e-9)


try:
    check_conjugate_1d(stub_conjugate_1d)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given fails the test")
check_conjugate_1d(conjugate_1d)
print("conjugate_1d: F*(attention) = -F(0), zeta_hat(tilted mean) = tilt, dF*/dz = zeta_hat, "
      "+inf outside the hull, the finite limit on its edge   ✓")

# %% [markdown]
# `bayes.conjugate_energy` does the same for any $D_v$, every row at once, by damped Newton
# ascent on $\zeta$ (one jitted `lax.while_loop`), never calling `attention`. We test it
# where we know the answer: a point $z$ built as the mean of a *tilted* posterior
# $Q_\zeta(a) \propto p(a\mid q)\,e^{\zeta\cdot v_a}$ has $\hat\zeta(z) = \zeta$, since the
# maximiser solves $\nabla F(\hat\zeta) = z$. Outside the hull the solver cannot converge
# (the supremum is $+\infty$), and it returns NaN.

# %% nbgrader={"grade": true, "grade_id": "test_conjugate_1d_2", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
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
fstar_1 = float(bayes.conjugate_energy(jnp.full((1, 1, 1, 1), vmin + 0.3 * (vmax - vmin)),
                                       q1, kk1, v1)[0].ravel()[0])
np.testing.assert_allclose(fstar_1, conjugate_1d(vmin + 0.3 * (vmax - vmin), s1, vals1)[0],
                           rtol=1e-12)  # the package agrees with the hand-written solver
outside = bayes.conjugate_energy(jnp.full((1, 1, 1, 1), vmax + 0.1), q1, kk1, v1)[0]
assert np.isnan(np.asarray(outside)).all()
print("F*(attention) == -F(0) in every row, zeta_hat == 0 there, F*(z_in) is larger; "
      "== conjugate_1d; NaN outside the hull   ✓")

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
np.testing.assert_allclose(res.x.reshape(att.shape), att_np, rtol=0, atol=1e-7)
np.testing.assert_allclose(res.fun, -F0, rtol=1e-12)
print("BFGS on F*: argmin == attention (max |diff| below 1e-7), min == -F(0)   ✓")

# %% [markdown]
# A flat hull, in numbers: give every row only two visible keys ($T_k = 2 \le D_v = 3$). The
# covariance has rank one, and $F^*$ is finite only on the line through the two values:
# a step off it makes the solver return NaN, a step along it does not.

# %%
two = jnp.array([2])
cov_two = np.asarray(jax.jit(tae.value_covariance)(q, k, v, kv_lengths=two))
rank = np.linalg.matrix_rank(cov_two[0, 0, 0], tol=1e-12)
att_two = tae.attention(q, k, v, kv_lengths=two)
along = jnp.asarray(vals_np[0, 1] - vals_np[0, 0])  # the line through the two values
off = jnp.asarray(np.linalg.svd(cov_two[0, 0, 0])[2][-1])  # a null direction of Σ
on_line = bayes.conjugate_energy(att_two + 0.01 * along, q, k, v, kv_lengths=two)[0]
off_line = bayes.conjugate_energy(att_two + 0.01 * off, q, k, v, kv_lengths=two)[0]
assert rank == 1 and np.isfinite(np.asarray(on_line)).all() and np.isnan(off_line).all()
print(f"two keys, Dv = {Dv}: rank of the covariance {rank}; F* finite along the line "
      f"through the values, NaN (sup = +inf) a step off it   ✓")

# %%
z_curve = vmin + (vmax - vmin) * np.linspace(0.01, 0.99, 50)  # inside the hull [vmin, vmax]
q_curve = jnp.broadcast_to(q1, (1, z_curve.size, 1, D))  # one query per point of the curve
z_curve_j = jnp.asarray(z_curve).reshape(1, -1, 1, 1)
fstar_curve = np.asarray(bayes.conjugate_energy(z_curve_j, q_curve, kk1, v1)[0]).ravel()
assert fstar_curve.min() >= -F0_1 - 1e-12
assert np.all(np.diff(fstar_curve, 2) > 0)  # convex on the grid

fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(z_curve, fstar_curve, "-", color="0.3", label=r"$F^*(z)$")
ax.axhline(-F0_1, color=BASELINE, ls="--", label=r"$-F(0)$")
ax.axvline(mu1, color=REFERENCE, ls=":", label="attention")
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
# <p>The stationary point of $\Gamma$ is a min–max: take the supremum over $\zeta$ (finite
# only on the hull of the values, attained only inside it) to get the convex conjugate
# $F^*(z)$, then minimise over $z$. Attention is $\operatorname{argmin} F^*$,
# $\min F^* = -F(0)$, and $\nabla F^*(z)$ is the maximising $\zeta$ where $\Sigma$ is
# invertible.</p></div>
#
# ## 2.6 Optional: the large-deviation (Cramér) reading
#
# Draw $n$ memories independently from the posterior $p$ and average their values: the sample
# mean $\bar v_n$. Subtract a constant from $F$: $K(\zeta) = F(\zeta) - F(0) =
# \log \mathrm{E}_p\big[e^{\zeta\cdot v}\big]$ is the cumulant-generating function of $v_a$,
# and its conjugate is **Cramér's rate function**,
#
# $$I(z) = K^*(z) = F^*(z) + F(0) = \min\big\{ \mathrm{KL}(Q\,\Vert\,p) : \mathrm{E}_Q[v] = z \big\}.$$
#
# What is exact, and what is only asymptotic:
#
# * **Exact, for every $n$:** $\mathrm{E}[\bar v_n] = $ attention (linearity of expectation),
#   and $\operatorname{Var}[\bar v_n] = \Sigma/n$ (independence).
# * **Exact:** $I(z) \ge 0$, and $I(z) = 0$ only at $z$ = attention: attention is the unique
#   zero of the rate function.
# * **Cramér's theorem** is about probabilities of **sets**: for a set $A$,
#   $\frac1n \log P(\bar v_n \in A) \to -\inf_{z\in A} I(z)$ (precisely: an upper bound with
#   the closure of $A$ and a lower bound with its interior, which agree for sets like
#   intervals whose interior meets that of the hull of the values; for
#   $[v_{\max}, v_{\max} + 1]$, which only touches the hull's edge, the lower bound is
#   $-\infty$ and the upper one finite). Sets away from attention have probabilities that fall exponentially in $n$.
# * **Densities** are another matter. $\bar v_n$ takes finitely many values (it averages $n$
#   draws from $T_k$ values), so it has no density; a histogram with bins wider than the
#   spacing of those values has a smooth envelope, and **Daniels' saddle-point approximation**
#   gives it: $f_n(z) \approx \sqrt{n/(2\pi\sigma_{\hat\zeta}^2)}\;e^{-nI(z)}$
#   (`bayes.saddlepoint_density`; $\sigma_{\hat\zeta}^2$ is the variance under the tilted
#   posterior). Its relative error is of order $1/n$.
# * **The peak of that density is not attention** at finite $n$. With $\kappa_2$ and
#   $\kappa_3$ the second and third cumulants of $v$ under $p$ (no relation to §2.1's
#   concentrations $\kappa_a$), the peak sits at about
#   $\mu - \kappa_3/(2 \kappa_2 n)$: attention is the most probable value of $\bar v_n$ only as
#   $n\to\infty$.
# * Near attention, $I(z) \approx \tfrac12 (z - \mu)^\top \Sigma^{-1} (z - \mu)$: the Gaussian
#   of the central limit theorem. Far from it, $I$ is not quadratic.
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
Qw = np.asarray(tilted)
kl_hand = np.swapaxes((Qw * np.log(Qw / post_np)).sum(-1), 1, 2)
np.testing.assert_allclose(kl_hand, rate_in, rtol=1e-10)

# Any other Q with the same mean (and total mass) is farther from p: move Q within the null
# space of the constraints [1; v^T] and the KL grows.
Q0, P0 = Qw[0, 0, 0], post_np[0, 0, 0]
null = np.linalg.svd(np.vstack([np.ones(Tk), vals_np[0].T]))[2][1 + Dv:]  # [Tk - 1 - Dv, Tk]
for d in np.asarray(jax.random.normal(jax.random.key(7), (20, null.shape[0]))) @ null:
    other = Q0 + 0.5 * Q0.min() * d / np.abs(d).max()
    np.testing.assert_allclose([other.sum(), *(other @ vals_np[0])],
                               [1.0, *np.asarray(z_in[0, 0, 0])], atol=1e-12)
    assert np.sum(other * np.log(other / P0)) > kl_hand[0, 0, 0]
print("I(z) = F*(z) + F(0) = KL(Q_zeta_hat || p) = min KL over Q with mean z; "
      "I(attention) = 0, I > 0 elsewhere   ✓")

# %% [markdown]
# Near attention the rate function is the quadratic form of the inverse covariance. The
# relative error is $O(\varepsilon)$ (the next term is cubic), so it should shrink tenfold when
# the step $\varepsilon$ does:

# %%
u = jax.random.normal(jax.random.key(8), att.shape)
quad = 0.5 * np.einsum("...i,...ij,...j->...", u, np.linalg.inv(cov_np), u)
rel = {eps: np.asarray(bayes.rate_function(att + eps * u, q, k, v)) / (eps**2 * quad) - 1
       for eps in (1e-3, 1e-4)}
bounds = {1e-3: 5e-4, 1e-4: 5e-5}  # the error is O(ε): a tenth of it at a tenth of ε
assert all(np.abs(rel[eps]).max() < bound for eps, bound in bounds.items())
np.testing.assert_allclose(rel[1e-3] / rel[1e-4], 10.0, rtol=0.05)
Markdown(f"Relative error of the quadratic approximation: below ${bounds[1e-3]:.0e}$ at "
         f"$\\varepsilon = 10^{{-3}}$ and below ${bounds[1e-4]:.0e}$ at "
         f"$\\varepsilon = 10^{{-4}}$, and in every row the ratio of the two is 10 to within "
         f"5%.")

# %% [markdown]
# **Monte Carlo.** `bayes.sample_means` draws $n = 16$ memories from the posterior of the
# one-query example and averages their values, two million times. First what is exact: the
# mean and the variance of $\bar v_n$. Then the discreteness, and the bins of a histogram,
# each a set $A$ whose probability we compare with Daniels' density integrated over the bin.
# The tolerance in a bin is honest: the count has a standard deviation of about
# $\sqrt{\text{count}}$, so its log is off by about $1/\sqrt{\text{count}}$; we allow five of
# those, plus $1/n$ for the saddle-point approximation's own error. Renormalising Daniels'
# density to integrate to 1 over the hull removes most of that error, which $\chi^2$ per bin
# resolves; the Gaussian of the central limit theorem fails in the tails.

# %%
n, num = 16, 2_000_000
means = np.asarray(bayes.sample_means(jax.random.key(9), n, num, q1, kk1, v1)).ravel()
assert abs(means.mean() - mu1) < 5 * np.sqrt(var1 / n / num)  # E[mean of n draws] = attention
np.testing.assert_allclose(means.var(), var1 / n, rtol=0.01)  # independence: Var = σ²/n
# Distinct values: one multiset of draws summed in another order can differ in its last bit,
# so means closer than 1e-12 count as one value. No two sorted means lie between 1e-13 and
# 1e-11 apart: rounding separates copies by far less, different multisets by far more.
gaps_sorted = np.diff(np.unique(means))
assert not ((gaps_sorted > 1e-13) & (gaps_sorted < 1e-11)).any()
distinct = 1 + int((gaps_sorted > 1e-12).sum())
possible = comb(n + Tk - 1, Tk - 1)  # multisets of n draws from Tk values


def daniels(z, n_draws):
    """Daniels' saddle-point density of the mean of n_draws draws at the points z."""
    z = np.atleast_1d(z)
    return np.asarray(bayes.saddlepoint_density(
        jnp.asarray(z).reshape(1, -1, 1, 1), n_draws,
        jnp.broadcast_to(q1, (1, z.size, 1, D)), kk1, v1)).ravel()


fine = np.linspace(vmin, vmax, 4001)[1:-1]  # strictly inside the hull
total = np.trapezoid(daniels(fine, n), fine)  # ≠ 1: the approximation's own error
counts, edges = np.histogram(means, bins=z_curve.size)
mids, width = (edges[1:] + edges[:-1]) / 2, edges[1] - edges[0]
density = daniels(mids, n)
rate_mids = np.asarray(bayes.rate_function(jnp.asarray(mids).reshape(1, -1, 1, 1), q_curve,
                                           kk1, v1)).ravel()
gauss = np.sqrt(n / (2 * np.pi * var1)) * np.exp(-n * (mids - mu1) ** 2 / (2 * var1))
keep = counts >= 100
tolerance = 5 / np.sqrt(counts[keep]) + 1 / n
expected = {name: num * width * f[keep] for name, f in
            (("Daniels", density), ("renormalised", density / total), ("Gaussian", gauss))}
miss = {name: np.abs(np.log(counts[keep] / e)) / tolerance for name, e in expected.items()}
chi2 = {name: np.mean((counts[keep] - e) ** 2 / e) for name, e in expected.items()}
assert miss["Daniels"].max() < 1 and miss["renormalised"].max() < 1  # every bin passes
assert miss["Gaussian"].max() > 1  # the Gaussian does not, in the tails
assert chi2["renormalised"] < 1.5 < 3 < chi2["Daniels"] < chi2["Gaussian"]
prefactor = np.log(density) + n * rate_mids  # the slowly varying part
slope = np.polyfit(-n * rate_mids[keep], np.log(counts[keep] / (num * width))
                   - prefactor[keep], 1)[0]
assert abs(slope - 1) < 0.03
Markdown(f"Mean of the {num:,} sample means: ${means.mean():.5f}$, attention ${mu1:.5f}$; "
         f"their variance is $\\sigma^2/n$ to 1%. They take {distinct:,} distinct values "
         f"(of {possible:,} possible multisets of {n} draws from {Tk} values; means within "
         f"$10^{{-12}}$ of each other count as one): a discrete distribution. "
         f"{keep.sum()} bins hold at least 100 means, and in the farthest of "
         f"them $nI(z) = {(n * rate_mids[keep]).max():.1f}$. Daniels' density integrates to "
         f"${total:.4f}$ over the hull. The worst bin misses it by "
         f"{miss['Daniels'].max():.2f} of the tolerance (renormalised: "
         f"{miss['renormalised'].max():.2f}) and the Gaussian by "
         f"{miss['Gaussian'].max():.2f}; $\\chi^2$ per bin is {chi2['Daniels']:.2f} for "
         f"Daniels, {chi2['renormalised']:.2f} renormalised and {chi2['Gaussian']:.2f} for the "
         f"Gaussian. Fitting the log probability of a bin against $-nI(z)$ gives a slope of "
         f"${slope:.3f}$: the exponent is $-nI$.")

# %% [markdown]
# **Predict, then run.** Here $n = 16$, and the values under the posterior are skewed to the
# right ($\kappa_3 > 0$). Is the most frequent sample mean left or right of attention, and by
# about how much?
#
# <details><summary>Answer</summary>
#
# Left, by about $\kappa_3/(2 \kappa_2 n)$. The Edgeworth correction to the Gaussian adds a cubic term
# to the log density; setting its derivative to zero moves the peak from $\mu$ to
# $\mu - \kappa_3/(2 \kappa_2 n)$ (to first order in $1/n$). The same follows from Daniels' density:
# its log-derivative is $-n\hat\zeta(z)$ minus a prefactor term $\kappa_3/(2\kappa_2^2)$ to leading
# order, which vanishes where $\hat\zeta \approx -\kappa_3/(2\kappa_2^2 n)$, i.e. at
# $z - \mu \approx \kappa_2\hat\zeta$. The cell computes $\kappa_2$, $\kappa_3$ in numpy, the peak of
# Daniels' density (by a scalar maximisation), and the peak of the Monte Carlo histogram (by
# a cubic fit of the log counts within two standard deviations of attention, which averages
# the counting noise of 200 bins), and compares all three with the formula.
#
# </details>

# %%
kappa2 = float(p1 @ (vals1 - mu1) ** 2)  # cumulants of v under the posterior, in numpy
kappa3 = float(p1 @ (vals1 - mu1) ** 3)


def daniels_peak(n_draws):
    """The z that maximises Daniels' density of the mean of n_draws draws."""
    return optimize.minimize_scalar(lambda z: -np.log(daniels(z, n_draws)[0]),
                                    bracket=(mu1 - 0.02, mu1), tol=1e-12).x


formula = mu1 - kappa3 / (2 * kappa2 * n)
peak_daniels = daniels_peak(n)
sd = np.sqrt(kappa2 / n)
hist, e2 = np.histogram(means, bins=200, range=(mu1 - 2 * sd, mu1 + 2 * sd))
cubic = np.polyfit((e2[1:] + e2[:-1]) / 2 - mu1, np.log(hist), 3, w=np.sqrt(hist))
roots = np.roots(np.polyder(cubic))
peak_mc = mu1 + roots[np.isreal(roots)].real[np.argmin(np.abs(roots[np.isreal(roots)]))]
# The Monte Carlo peak scatters between seeds, and the two approximations differ at order
# 1/n²: the tolerance allows both, and stays below the offset itself.
assert kappa3 > 0 and abs(mu1 - formula) > 5e-3
np.testing.assert_allclose([peak_daniels, peak_mc], formula, rtol=0, atol=1.5e-3)
assert abs(peak_mc - mu1) > 4e-3 and abs(peak_daniels - mu1) > 4e-3  # the peak is not μ
# The offset shrinks like 1/n: n·(peak − μ) tends to −kappa3/(2 kappa2).
scaled = {m: m * (daniels_peak(m) - mu1) for m in (16, 64, 256)}
np.testing.assert_allclose(scaled[256], -kappa3 / (2 * kappa2), rtol=0.01)
limit = -kappa3 / (2 * kappa2)
assert abs(scaled[16] - limit) > abs(scaled[64] - limit) > abs(scaled[256] - limit)
print(f"kappa2 = {kappa2:.5f}, kappa3 = {kappa3:.5f}, n = {n}")
print(f"attention (the exact mean)        {mu1:.4f}")
print(f"formula mu - kappa3/(2 kappa2 n)  {formula:.4f}")
print(f"peak of Daniels' density          {peak_daniels:.4f}")
print(f"peak of the Monte Carlo histogram {peak_mc:.4f}")
print("n * (Daniels' peak - mu):", ", ".join(f"{val:.4f} at n = {m}" for m, val in
                                             scaled.items()),
      f"-> -kappa3/(2 kappa2) = {-kappa3 / (2 * kappa2):.4f}")

# %%
rate_curve = np.asarray(bayes.rate_function(z_curve_j, q_curve, kk1, v1)).ravel()
np.testing.assert_allclose(rate_curve, fstar_curve + F0_1, rtol=1e-10, atol=1e-13)

fig, axes = plt.subplots(1, 3, figsize=(15, 4))
axes[0].plot(z_curve, rate_curve, "-", color="0.3", label=r"$I(z)$")
axes[0].plot(z_curve, (z_curve - mu1) ** 2 / (2 * var1), color=BASELINE, ls="--",
             label=r"$\frac{(z-\mu)^2}{2\sigma^2}$")
axes[0].axvline(mu1, color=REFERENCE, ls=":", label="attention")
axes[0].set_xlabel(r"$z$", fontsize=10)
axes[0].set_ylabel("rate", fontsize=10)
axes[0].set_title("Rate function and its quadratic", fontsize=11)
axes[0].legend(fontsize=10)
axes[1].semilogy(mids[keep], counts[keep] / (num * width), "o", color="0.3", ms=4,
                 label="Monte Carlo")
axes[1].semilogy(mids, density / total, "-", color="0.3",
                 label=r"$\propto e^{-nI(z)}$ (Daniels, renormalised)")
axes[1].semilogy(mids, gauss, color=BASELINE, ls="--", label="Gaussian (CLT)")
axes[1].set_ylim(0.3 * (counts[keep] / (num * width)).min(), 3 * density.max())
axes[1].set_xlabel(r"mean of $n$ draws", fontsize=10)
axes[1].set_ylabel("density", fontsize=10)
axes[1].set_title(f"Means of n = {n} memories' values", fontsize=11)
axes[1].legend(fontsize=9)
zoom = np.linspace(mu1 - 0.6 * sd, mu1 + 0.6 * sd, 121)
axes[2].plot(zoom, daniels(zoom, n) / total, "-", color="0.3", label="Daniels, renormalised")
axes[2].plot(zoom, np.exp(np.polyval(cubic, zoom - mu1)) / (num * (e2[1] - e2[0])), "--",
             color=BASELINE, label="Monte Carlo (cubic fit)")
axes[2].axvline(mu1, color=REFERENCE, ls=":", label="attention (the mean)")
axes[2].axvline(peak_daniels, color="0.3", ls="-.", label="peak")
axes[2].set_xlabel(r"mean of $n$ draws", fontsize=10)
axes[2].set_title("Near the peak: the peak is not the mean", fontsize=11)
axes[2].legend(fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: left, the rate function $I$ is zero only at attention and matches the quadratic
# (dashed) near it, but not towards the edges of the hull. Middle, the histogram of sample
# means on a log scale: look at the tails, where the points follow $e^{-nI}$ and leave the
# Gaussian, which is symmetric while the values under the posterior are not. Right, near the
# top: the density peaks left of attention (dotted), which is nevertheless the exact mean.*
#
# **Exercise (code).** The package's `sample_means` draws with JAX. Write your own sampler in
# numpy, `sample_means_np(p, vals, n, num, rng)`: `num` means of `n` values drawn with
# probabilities `p`. The test draws 400,000 means of 16 and checks what is exact (the mean
# and variance of $\bar v_n$) and that a histogram matches the renormalised Daniels density:
# its $\chi^2$ per bin must stay below the level a correct sampler exceeds with probability
# $10^{-6}$ ($\chi^2$ with one degree of freedom per bin kept). So a correct sampler, however
# it draws, fails each of the two checks (this one and the exact-law check below) only about
# once in a million runs, to the accuracy of that threshold (the renormalised Daniels density
# and the $\chi^2$ law are both approximations here). A Gaussian of the right mean and
# variance fails this check (the test cell checks that too). The test then draws from a distribution it builds
# itself, on integer values, and compares the sums with their exact law, so only a sampler
# passes: the package's `sample_means` raises while your function runs.

# %%
def sample_means_np(p, vals, n, num, rng):
    """num means of n values drawn i.i.d. from vals with probabilities p: [num]."""
    # TODO: rng.choice draws indices with given probabilities; each mean averages n values.
    return np.full(num, vals.mean())  # placeholder: runs, and the test below rejects it


stub_sample_means_np = sample_means_np


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "sample_means_np", "locked": false, "schema_version": 3, "solution": true, "task": false}
def sample_means_np(p, vals, n, num, rng):
    """num means of n values drawn i.i.d. from vals with probabilities p: [num]."""
    return vals[rng.choice(len(vals), size=(num, n), p=p)].mean(axis=1)


# %% nbgrader={"grade": true, "grade_id": "test_sample_means_np", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def check_sample_means_np(fn_given):
    """Raises AssertionError unless fn samples means of n draws from the posterior, and
    sums whose exact law it knows, on integer values of its own."""
    own = AssertionError("write the sampler yourself: bayes.sample_means is the answer")

    def fn(p, vals, n_draws, num_means, rng):  # the package's samplers raise meanwhile
        with contextlib.ExitStack() as stack:
            for module in (bayes, tae):
                for name in ("sample_means", "_sample_means"):
                    if hasattr(module, name):
                        stack.enter_context(mock.patch.object(module, name, side_effect=own))
            return np.asarray(fn_given(p, vals, n_draws, num_means, rng))

    m_np = fn(p1, vals1, n, 400_000, np.random.default_rng(0))
    assert abs(m_np.mean() - mu1) < 5 * np.sqrt(var1 / n / m_np.size)
    np.testing.assert_allclose(m_np.var(), var1 / n, rtol=0.02)
    c_np, e_np = np.histogram(m_np, bins=50)
    ok = c_np >= 100
    expect = m_np.size * (e_np[1] - e_np[0]) * daniels((e_np[1:] + e_np[:-1]) / 2, n)[ok] / total
    chi2_np = np.mean((c_np[ok] - expect) ** 2 / expect)
    limit = stats.chi2.isf(1e-6, df=ok.sum()) / ok.sum()  # P(a correct sampler above) = 1e-6
    assert chi2_np < limit, (chi2_np, limit)
    # A distribution built here, not the posterior of §2.6 (whose draws `means` holds):
    # integer values -2..4, so the sum of 5 draws is an integer whose exact law is the
    # 5-fold convolution of p. The same chi^2 level, now against that exact law.
    rng = np.random.default_rng(11)
    p_new, vals_new, n_new = rng.dirichlet(np.ones(7)), rng.permutation(7) - 2.0, 5
    sums = np.asarray(fn(p_new, vals_new, n_new, 200_000, rng)) * n_new + 2 * n_new
    assert sums.shape == (200_000,) and np.abs(sums - np.rint(sums)).max() < 1e-9
    assert 0 <= sums.min() and sums.max() <= 6 * n_new  # sums of values in -2..4
    law = np.zeros(7)
    law[(vals_new + 2).astype(int)] = p_new  # the law of one draw, shifted to 0..6
    law_sum = law
    for _ in range(n_new - 1):
        law_sum = np.convolve(law_sum, law)  # the sum's law on 0..30
    c_new = np.bincount(np.rint(sums).astype(int), minlength=law_sum.size)
    e_new = sums.size * law_sum
    kept = e_new >= 100
    chi2_new = np.mean((c_new[kept] - e_new[kept]) ** 2 / e_new[kept])
    limit_new = stats.chi2.isf(1e-6, df=kept.sum()) / kept.sum()
    assert chi2_new < limit_new, ("exact law", chi2_new, limit_new)
    return chi2_np, limit


def gaussian_means(p, vals, n, num, rng):
    """The central limit theorem's answer: the right mean and variance, the wrong shape."""
    return rng.normal(p @ vals, np.sqrt(p @ (vals - p @ vals) ** 2 / n), num)


try:
    check_sample_means_np(gaussian_means)
except AssertionError as e:  # its mean and variance pass; the chi^2 check rejects it
    assert e.args and isinstance(e.args[0], tuple), e
else:
    raise AssertionError("the chi^2 check passes a Gaussian: it would pass a wrong sampler")
try:
    check_sample_means_np(stub_sample_means_np)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given fails the test")
chi2_np, chi2_limit = check_sample_means_np(sample_means_np)
print(f"sample_means_np: mean = attention, variance = sigma^2/n, chi^2 per bin against the "
      f"renormalised Daniels density below {chi2_limit:.1f}; and the sums' exact law on "
      "integer values   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>With $K(\zeta) = F(\zeta) - F(0)$, the rate function $I = K^* = F^* + F(0)$ is a minimum
# KL divergence whose unique zero is attention. For the mean of $n$ draws from the attention
# weights, attention is the exact expected value for every $n$; sets away from it have
# probabilities $\approx e^{-n\inf I}$ (Cramér). Its histogram follows Daniels' density, which
# peaks about $\kappa_3/(2\kappa_2 n)$ from attention: "most probable" holds only as
# $n\to\infty$.</p></div>
#
# ## 2.7 Summary
#
# * The attention weights are a posterior over memories under an unnormalised likelihood
#   $e^{s_a}$ (normalised on the sphere only for keys of equal norm); attention is the
#   posterior mean, the Bayes estimate under squared loss. The log evidence is
#   $F(0) - \log T_k$ plus a constant.
# * The paper's $\Gamma(\zeta, z) = \sum z\cdot\zeta - F(\zeta)$ (with $F$ counted once; eq. 30
#   as printed counts it $N d$ times) is stationary exactly at $\zeta^* = 0$,
#   $z^* = \nabla F(0)$ = attention. But $\Gamma$ is linear in $z$, so it is unbounded in both
#   directions: $\operatorname{argmax} e^{-\Gamma}$ (= minimising $\Gamma$) does not exist,
#   and the stationary point is a saddle for every input (Hessian eigenvalues
#   $(-c\pm\sqrt{c^2+4})/2$).
# * **MAP:** the MAP memory gives hard attention, the $\beta\to\infty$ limit of attention
#   (scale $\beta/D$) when the best key is unique.
# * **Legendre (optional):** $F^*(z) = \sup_\zeta\Gamma$ is the convex conjugate, finite on
#   the hull of the values and attained inside it; attention $= \operatorname{argmin} F^*$,
#   $\min F^* = -F(0)$, $\nabla F^* = \hat\zeta$ where $\Sigma$ is invertible.
# * **Cramér (optional):** $I = F^* + F(0)$ is the minimum KL divergence to the posterior under
#   a mean constraint, zero only at attention, quadratic nearby. Attention is the exact mean of
#   the sample mean for every $n$; probabilities of sets fall like $e^{-n\inf I}$; the
#   sample mean's (saddle-point) density peaks at attention only as $n\to\infty$.
# * Next: why the log-sum-exp behind all of this can be split across devices (notebook 3).
#
# ## 2.8 More exercises
#
# Each answer is hidden: open "Answer" to read it, and the collapsed cell below it checks it.
#
# 1. **Predict, then measure** (optional part). In the one-query example with scalar values,
#    $I(z)$ stays finite as $z$ approaches the largest value $v_{\max}$, the edge of the hull.
#    Before running anything, predict its limit as a number you can read off the posterior.
#    (Hint: what is the probability that the mean of $n$ draws equals $v_{\max}$?) Then
#    measure `rate_function` ever closer to the edge.
# 2. Section 2.3 showed the Hessian of $\Gamma$ is indefinite at the stationary point. Is it
#    indefinite at every $(\zeta, z)$? Argue from the $2\times 2$ blocks, then check with
#    `gamma_hessian(..., zeta=...)` at random $\zeta$.
#
# <details><summary>Answer 1</summary>
#
# $-\log p(a_{\max})$, where $a_{\max}$ is the memory holding $v_{\max}$. The only way for
# the mean of $n$ draws to equal $v_{\max}$ is to draw $a_{\max}$ every time, which has
# probability $p(a_{\max})^n = e^{-n(-\log p(a_{\max}))}$, so Cramér's exponent there is
# $-\log p(a_{\max})$. In the limit the maximising $\hat\zeta$ runs off to $+\infty$ (the
# tilted posterior piles onto $a_{\max}$): the supremum is finite but not attained. The cell
# evaluates $I$ at distances from $10^{-2}$ down to $10^{-8}$ of the hull's width from the
# edge.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_2", "locked": false, "schema_version": 3, "solution": true, "task": false}
predicted = -np.log(p1[np.argmax(vals1)])
gaps_edge = np.geomspace(1e-2, 1e-8, z_curve.size)
near_edge = jnp.asarray(vmax - gaps_edge * (vmax - vmin)).reshape(1, -1, 1, 1)
rate_edge, zeta_edge = bayes.conjugate_energy(near_edge, q_curve, kk1, v1, max_newton=200)
rate_edge = np.asarray(rate_edge).ravel() + F0_1  # I = F* + F(0)
zeta_edge = np.asarray(zeta_edge).ravel()
assert np.all(np.diff(rate_edge) > 0) and np.all(rate_edge < predicted)
assert predicted - rate_edge[-1] < 1e-5
assert np.all(np.diff(zeta_edge) > 0) and zeta_edge[-1] > 10  # the maximiser runs off
# Printed to 4 decimals (a solver's last digits depend on the CPU); the closeness to the
# limit is the bound asserted above.
print(f"-log p(a_max) = {predicted:.4f}")
for i in (0, gaps_edge.size // 2, -1):
    print(f"  {sci(gaps_edge[i], 1)} of the hull's width from the edge: I = {rate_edge[i]:.4f}, "
          f"zeta_hat = {zeta_edge[i]:.0f}")
print("nearest the edge, -log p(a_max) - I < 10^-5 (asserted)")

# %% [markdown]
# <details><summary>Answer 2</summary>
#
# Yes. At any $\zeta$ the Hessian is $\begin{pmatrix}-\nabla^2F(\zeta) & I\\ I & 0\end{pmatrix}$,
# and $\nabla^2 F(\zeta)$ is the covariance of the values under the tilted posterior, still
# positive semi-definite. The same rotation splits it into blocks
# $\begin{pmatrix}-c & 1\\ 1 & 0\end{pmatrix}$ with determinant $-1$, so $\Gamma$ has no local
# maximum or minimum anywhere: it is a saddle-shaped surface everywhere.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_3", "locked": false, "schema_version": 3, "solution": true, "task": false}
for key in jax.random.split(jax.random.key(12), 3):
    zeta_r = 2.0 * jax.random.normal(key, att.shape)
    eig_r = np.linalg.eigvalsh(np.asarray(tae.gamma_hessian(q, k, v, zeta=zeta_r)))
    assert (eig_r.min(-1) < 0).all() and (eig_r.max(-1) > 0).all()
    np.testing.assert_allclose(np.prod(eig_r, -1), (-1.0) ** Dv, rtol=1e-10)
print("at random zeta: eigenvalues of both signs in every row, determinant (-1)^Dv   ✓")

# %% [markdown]
# ## 2.9 References
#
# Shyam et al., *Tree Attention: Topology-aware Decoding for Long-Context Attention on GPU
# clusters*, [arXiv 2408.04093](https://arxiv.org/abs/2408.04093):
#
# * paper §4, Observation 1, eqs. (5)–(6): the energy $F(\zeta)$ and attention as its
#   gradient;
# * Appendix C.1, eqs. (16)–(18): attention as the expectation of the values under the
#   weights $P_a$, and the partition function $Z$;
# * Appendix C.2, eqs. (30)–(34): the "log-likelihood" $\Gamma$ (eq. 30, quoted: it counts
#   $F$ once per term), its stationary conditions (eqs. 31–33, correct with $F$ counted once)
#   and the MAP claim (eq. 34, corrected here); Table I of Appendix G names $\Gamma$ the
#   "attention log-likelihood";
# * Appendix A: the related Bayesian reading of attention (Singh & Buckley), and why
#   Ramsauer et al.'s Hopfield update is auto-associative (quoted in section 2.4).
#
# Background:
#
# * Ramsauer et al., *Hopfield Networks is All You Need*,
#   [arXiv 2008.02217](https://arxiv.org/abs/2008.02217): the modern Hopfield energy and
#   its one-step retrieval $\xi^{\text{new}} = X\operatorname{softmax}(\beta X^\top\xi)$.
# * R. T. Rockafellar, *Convex Analysis*, section 12 (conjugate functions) and section 26
#   (the Legendre transformation).
# * A. Dembo and O. Zeitouni, *Large Deviations Techniques and Applications*, section 2.2
#   (Cramér's theorem, for probabilities of sets).
# * T. M. Cover and J. A. Thomas, *Elements of Information Theory*, chapter 11 (Sanov's
#   theorem and the minimum-KL distribution under a mean constraint).
# * H. E. Daniels, *Saddlepoint approximations in statistics*, Annals of Mathematical
#   Statistics 25 (1954): the density of a sample mean from the cumulant-generating
#   function, with relative error of order $1/n$.
# * K. V. Mardia and P. E. Jupp, *Directional Statistics*, section 9.3: the von Mises–Fisher
#   density and its normaliser.
#
# This notebook quotes no hardware figures.
