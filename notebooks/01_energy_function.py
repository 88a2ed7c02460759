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
# **Time.** About 45 minutes to read, run and do the exercises; it runs in under a minute on
# an idle 2-core CPU.
#
# **Learning objectives.** After this notebook you can
#
# * write down the energy $F(\zeta) = \log \sum_a \exp(q\cdot k_a + \zeta\cdot v_a)$ and prove,
#   for any number of keys, that $\nabla F(0)$ is attention and $\nabla^2 F$ a covariance of
#   the values, so that $F$ is convex: up to the constant $F(0)$, $F$ is a
#   cumulant-generating function;
# * build $F$, its gradient and its Hessian from scratch in numpy, and check them against
#   finite differences and against `jax.grad` and `jax.hessian`;
# * compute a Hessian with Hessian-vector products (forward-over-reverse autodiff);
# * write the energy of many queries, heads and a causal mask, $F_{\text{tot}}$, and say why
#   its Hessian is block diagonal;
# * keep $F$ finite for any logits, and predict what attention becomes as the logits grow.
#
# Every claim below is an assertion that would fail if it were false, checked against
# something computed independently: a numpy float64 formula written in the cell, a finite
# difference, a closed form or an exact limit.
#
# ## Where it runs
#
# This is the one place the course explains its set-up; every other notebook links here.
#
# * **The first cell of every notebook** asks JAX for 8 simulated CPU devices
#   (`tae.simulate_devices(8)`, before JAX starts), pins JAX to the CPU and asserts that the
#   8 devices are there.
# * **Simulated devices** are 8 XLA:CPU devices in one process, sharing this machine's cores
#   and memory. A collective between them (`psum`, `ppermute`) is a memory copy inside the
#   process. So the bytes an algorithm must move between devices are the real ones, the
#   same on any backend; which collectives carry them is XLA:CPU's choice (notebook 4, §4.3,
#   shows it merging two sums into one all-reduce; another backend may split or merge them
#   differently). Times show compute and copies, not a network, and memory figures
#   (temporary buffers, peaks) are XLA:CPU's: a GPU compiler places buffers differently.
#   Where a figure is XLA:CPU's own, the notebook says so.
# * **On a GPU runtime** the notebooks still run on the 8 CPU devices: the pin keeps every
#   figure reproducible on any machine, and a GPU, if present, is not used.
# * **Real processes:** notebook 9 (*A cluster on one machine*) runs the same programs as
#   separate `jax.distributed` processes joined by an emulated network.
# * **GPUs:** one GPU session was recorded (`results/gpu/`, whose README has the commands and
#   the logs): most of it on one NVIDIA H200, and two highest-precision runs of part of the
#   kernel sweep on a second H200 in a later call. Notebook 6 (section 6.2.1) reads that
#   record back: it is a record of one session, not a test the notebooks run. Every other
#   GPU figure in the course is the cost model's, filled with published hardware figures,
#   quoted from the paper or a datasheet, or a third-party measurement: the NCCL latencies
#   from NVIDIA/nccl GitHub issues #1259 and #1244 (#1455's bus bandwidth is cited as a
#   caveat; link bandwidths come from the DGX H100 user guide).
#
# This notebook needs one device; notebooks 4 onward shard over all 8.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises; later notebooks shard over these

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import contextlib
from unittest import mock

import jax.numpy as jnp
import matplotlib.pyplot as plt
import mpmath
import numpy as np
import sympy as sp
from IPython.display import Markdown

from tree_attention_edu import plots
from tree_attention_edu.theory import energy as energy_module
from tree_attention_edu.theory import symbolic

jax.config.update("jax_enable_x64", True)  # identities are checked in float64
assert jax.device_count() == 8, jax.devices()
print(jax.device_count(), "devices,", jax.default_backend())

# %% [markdown]
# ## 1.1 The energy and its gradient
#
# The paper states (paper §4):
#
# > **Observation 1.** Attention can be expressed at the gradient of an scalar energy function
# > $F(\zeta)$ with respect to the source $\zeta$, such that:
# > $\sum_{a=1}^{N} \operatorname{softmax}(q \cdot k_a) v_a = \frac{\partial F}{\partial \zeta}\Big|_{\zeta=0}$,
# > (5) where the moment generating function (i.e. the energy function) $F(\zeta)$ is defined
# > as: $F(\zeta) = \log \sum_{a} \exp\left(q \cdot k_a^T + \zeta \cdot v_a^T\right)$. (6)
#
# Read it critically: up to the constant $F(0) = \log Z$, with $Z = \sum_a e^{q\cdot k_a}$,
# $F$ is the *log* of a moment-generating function
# ($e^{F(\zeta)} = Z\,\mathrm{E}_p[e^{\zeta\cdot v}]$, $Z$ times a moment-generating
# function, §1.2), that is a
# **cumulant**-generating function, as the paper's own appendix C.1 says ("the energy
# function is given by the cumulant-generating function"). The difference matters in the
# next section: the derivatives of $F$ are cumulants (mean, covariance), not raw moments.
#
# Take $n$ keys with scores $s_a = \text{scale}\cdot q\cdot k_a$ and values
# $v_a \in \mathbf{R}^d$; the *source* $\zeta \in \mathbf{R}^d$ couples to the values.
# Differentiating the log of a sum of exponentials gives a softmax-weighted average:
#
# $$\frac{\partial F}{\partial \zeta_j}\Big|_{\zeta=0} = \sum_a \underbrace{\frac{e^{s_a}}{\sum_b e^{s_b}}}_{p_a} v_{a,j},$$
#
# which is exactly softmax attention. (The paper writes no scale, i.e. scale 1; this
# package's default is $1/\sqrt{D}$, with $D$ the head dimension, the length of $q$ and $k_a$. The scale only multiplies the scores, so nothing below
# depends on it.)
#
# **A proof for every $n$.** sympy can differentiate a sum whose length $n$ is a symbol
# (`Sum` over an `IndexedBase`). Restrict $F$ to a line, $\zeta = t\,u$ for any direction
# $u$: then $F(t u) = \log\sum_{a=1}^n e^{s_a + t w_a}$ with $w_a = u\cdot v_a$, a scalar
# per key. A gradient is fixed by its directional derivatives, so proving
# $\frac{d}{dt}F(tu)\big|_0 = \mathrm{E}_p[w]$ for every $u$ proves $\nabla F(0) = \mathrm{E}_p[v]$,
# for any number of keys and any value dimension. The cell proves that, and shows a wrong
# claim false by a counterexample: with numbers substituted (3 keys), the difference is
# printed and asserted far from zero. (A `simplify(...) != 0` would prove nothing: it also
# holds whenever sympy merely fails to simplify.)

# %%
cumulants = symbolic.cumulants_any_n()  # derivatives 1, 2, 3 of F(t u) at t = 0, symbolic n
gradient = cumulants[0]
n_sym, a_sym, s_sym, w_sym, t_sym = symbolic.symbols_any_n()
display(sp.Eq(sp.Symbol("F(tu)"), symbolic.directional_energy_any_n()))
# The claim, with its left side unevaluated (d/dt F(tu) at t = 0) and its right side E_p[w]:
display(sp.Eq(sp.Subs(sp.Derivative(symbolic.directional_energy_any_n(), t_sym), t_sym, 0),
              gradient.rhs, evaluate=False))
assert sp.simplify(gradient.lhs - gradient.rhs) == 0, gradient.name
assert sp.Symbol("n", integer=True, positive=True) in gradient.lhs.free_symbols  # any n
wrong = symbolic.expectation_any_n(w_sym[a_sym] ** 2, n_sym, a_sym, s_sym)  # E[w^2]
COUNTER_S, COUNTER_W = (0, 1, sp.Rational(-1, 2)), (1, -2, 3)  # a counterexample, n = 3


def at_counterexample(expr):
    """expr with n = 3 keys and the scores COUNTER_S, projected values COUNTER_W: a number."""
    expr = expr.subs(n_sym, len(COUNTER_S)).doit()
    point = {s_sym[i + 1]: x for i, x in enumerate(COUNTER_S)}
    point |= {w_sym[i + 1]: x for i, x in enumerate(COUNTER_W)}
    return float(expr.subs(point).evalf(30))


gap = at_counterexample(gradient.lhs - wrong)
assert abs(gap) > 1  # a wrong right-hand side is false: shown at a point, with a margin
print(f"{gradient.name}: proved for symbolic n   ✓")
print(f"wrong claim dF/dt = E[w^2]: at s = (0, 1, -1/2), w = (1, -2, 3) the difference is "
      f"{gap:.3f}, not 0: false   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Attention is the gradient at $\zeta = 0$ of one scalar, the energy $F(\zeta)$: the
# source $\zeta$ pulls the values out of the log-sum-exp. sympy proves it for any number of
# keys.</p></div>
#
# ## 1.2 The Hessian is a covariance
#
# $e^{F(\zeta)} / e^{F(0)} = \mathrm{E}_p[e^{\zeta \cdot v}]$ is the moment-generating function
# of $v$ under the attention weights, so $F$'s derivatives at 0 are the **cumulants** of $v$:
# the first is the mean (attention), the second the covariance
#
# $$\frac{\partial^2 F}{\partial\zeta_i\partial\zeta_j}\Big|_0 = \mathrm{E}_p[v_i v_j] - \mathrm{E}_p[v_i]\,\mathrm{E}_p[v_j].$$
#
# Along a line, $\frac{d^2}{dt^2}F(tu)\big|_0 = u^\top \nabla^2F(0)\, u$ and
# $\operatorname{Var}_p(u\cdot v) = u^\top \Sigma\, u$; a symmetric matrix is fixed by its
# quadratic form, so proving $\frac{d^2}{dt^2}F(tu)\big|_0 = \operatorname{Var}_p(w)$ for every
# $u$ proves $\nabla^2 F(0) = \Sigma$. The same computation at any other $\zeta$ gives the
# covariance under the *tilted* weights $p_a(\zeta) \propto e^{s_a + \zeta\cdot v_a}$ (replace
# $s_a$ by $s_a + \zeta\cdot v_a$). A covariance is positive semi-definite, so the Hessian is
# positive semi-definite everywhere and $F$ is **convex** in $\zeta$.

# %%
hessian = cumulants[1]
display(sp.Eq(hessian.lhs, hessian.rhs, evaluate=False))
assert sp.simplify(hessian.lhs - hessian.rhs) == 0, hessian.name
raw_second = symbolic.expectation_any_n(w_sym[a_sym] ** 2, n_sym, a_sym, s_sym)
gap2 = at_counterexample(hessian.lhs - raw_second)
assert abs(gap2) > 0.1  # the raw second moment is false: a counterexample, with a margin
print(f"{hessian.name}: proved for symbolic n   ✓")
print(f"wrong claim d2F/dt2 = E[w^2] (the raw moment): at the same point the difference is "
      f"{gap2:.3f}, not 0: false   ✓")

# %% [markdown]
# **Predict, then run.** $F$ is convex in $\zeta$. Is it convex in the query $q$ (keys
# fixed)? In the keys (query fixed)? Jointly in $(q, k)$?
#
# <details><summary>Answer</summary>
#
# In $q$: yes. $F$ is a log-sum-exp of the affine functions $q\cdot k_a$, and its Hessian in
# $q$ is the covariance of the keys under the weights. In the keys: yes, for the same reason
# ($q\cdot k_a$ is linear in $k_a$). Jointly: **no**. $q\cdot k_a$ is bilinear: with one key
# and $D = 1$, $F = qk$, whose Hessian $\begin{pmatrix}0&1\\1&0\end{pmatrix}$ has eigenvalues
# $\pm 1$. The cell computes the three Hessians with `jax.hessian` for 3 keys in $D = 2$.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_1", "locked": false, "schema_version": 3, "solution": true, "task": false}
def F_qk(qk):
    """F at ζ = 0 (scale 1) for one query q [2] and three keys k [3, 2], packed in qk [8]."""
    q_, k_ = qk[:2], qk[2:].reshape(3, 2)
    return jax.nn.logsumexp(k_ @ q_)


qk0 = jax.random.normal(jax.random.key(20), (8,))
H_qk = np.asarray(jax.jit(jax.hessian(F_qk))(qk0))
eig_q, eig_k = np.linalg.eigvalsh(H_qk[:2, :2]), np.linalg.eigvalsh(H_qk[2:, 2:])
eig_joint = np.linalg.eigvalsh(H_qk)
assert eig_q.min() > -1e-12 and eig_k.min() > -1e-12 and eig_joint.min() < -0.1
smallest = [round(float(e.min()), 3) + 0.0 for e in (eig_q, eig_k, eig_joint)]  # no "-0.0"
print("smallest Hessian eigenvalue: in q {}, in k {}, jointly in (q, k) {}".format(*smallest))

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>$F$ generates cumulants: its gradient is the mean of the values under the attention
# weights, its Hessian their covariance, for any number of keys. So $F$ is convex in
# $\zeta$ (but not jointly in the query and the keys).</p></div>
#
# ## 1.3 From scratch: $F$, its gradient and its Hessian in numpy
#
# Before any package code, the three objects for one query, written in numpy float64 from
# their definitions: the energy, the weights $p_a(\zeta) \propto e^{s_a + \zeta\cdot v_a}$,
# their mean (the gradient) and their covariance (the Hessian). Two independent checks
# follow: central finite differences of `energy_np`, and `jax.grad` / `jax.hessian` of a
# line-for-line `jax.numpy` copy of it.

# %%
def energy_np(s, v, zeta):
    """F(ζ) = log Σ_a exp(s_a + ζ·v_a) for one query: s [n], v [n, d], ζ [d] (float64)."""
    return np.log(np.sum(np.exp(s + v @ zeta)))


def weights_np(s, v, zeta):
    """The tilted attention weights p_a(ζ) ∝ exp(s_a + ζ·v_a), [n]; ζ = 0 gives softmax(s)."""
    x = s + v @ zeta
    e = np.exp(x - x.max())
    return e / e.sum()


def gradient_np(s, v, zeta):
    """∇F(ζ) = E_p[v], [d]: attention at ζ = 0."""
    return weights_np(s, v, zeta) @ v


def hessian_np(s, v, zeta):
    """∇²F(ζ) = E_p[v vᵀ] − E_p[v] E_p[v]ᵀ, [d, d]: the covariance of the values."""
    p = weights_np(s, v, zeta)
    mean = p @ v
    return (v * p[:, None]).T @ v - np.outer(mean, mean)


rng = np.random.default_rng(0)
n_keys, dv = 12, 3
s_row, v_row = rng.normal(size=n_keys), rng.normal(size=(n_keys, dv))
zeta_row = 0.5 * rng.normal(size=dv)

# Central differences: O(h²) truncation error, so h = 1e-4 leaves about 1e-8 for the
# gradient and, with differences of gradients, about 1e-7 for the Hessian.
h, eye = 1e-4, np.eye(dv)
fd_grad = np.array([(energy_np(s_row, v_row, zeta_row + h * e)
                     - energy_np(s_row, v_row, zeta_row - h * e)) / (2 * h) for e in eye])
fd_hess = np.array([(gradient_np(s_row, v_row, zeta_row + h * e)
                     - gradient_np(s_row, v_row, zeta_row - h * e)) / (2 * h) for e in eye])
np.testing.assert_allclose(fd_grad, gradient_np(s_row, v_row, zeta_row), rtol=0, atol=1e-8)
np.testing.assert_allclose(fd_hess, hessian_np(s_row, v_row, zeta_row), rtol=0, atol=1e-7)


def energy_jnp(s, v, zeta):
    """`energy_np`, line for line, in jax.numpy, so that autodiff can differentiate it."""
    return jnp.log(jnp.sum(jnp.exp(s + v @ zeta)))


auto_grad = jax.jit(jax.grad(energy_jnp, argnums=2))(s_row, v_row, zeta_row)
auto_hess = jax.jit(jax.hessian(energy_jnp, argnums=2))(s_row, v_row, zeta_row)
np.testing.assert_allclose(auto_grad, gradient_np(s_row, v_row, zeta_row), rtol=1e-13)
np.testing.assert_allclose(auto_hess, hessian_np(s_row, v_row, zeta_row), rtol=0, atol=1e-14)
print("numpy mean == finite differences of F == jax.grad;   "
      "numpy covariance == finite differences == jax.hessian   ✓")
print("attention of this row (zeta = 0):", np.round(gradient_np(s_row, v_row, 0 * zeta_row), 4))

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Ten lines of numpy give $F$, its gradient (the weighted mean of the values) and its
# Hessian (their covariance). Finite differences and autodiff agree with them; everything
# the package does below is checked against these functions.</p></div>
#
# ## 1.4 The package's energy: batch, heads and grouped kv heads
#
# The package's `energy` is $F_{\text{tot}}$, one log-sum-exp per batch element $b$, query
# $i$ and head $h$, summed (layout `q [B, Tq, Hq, D]`, `k [B, Tk, Hkv, D]`,
# `v [B, Tk, Hkv, Dv]`; the source $\zeta$ has the output's shape `[B, Tq, Hq, Dv]`).
# With grouped-query attention several query heads share one kv head: query head $h$ reads
# kv head $h' = \lfloor h / (H_q/H_{kv})\rfloor$ (printed below). `attention_from_energy` is
# `jax.grad` of `energy` at $\zeta = 0$; `value_covariance` its Hessian blocks. We check
# both, row by row, against the numpy functions of the previous section, in float64.

# %%
def compiled(f):
    """`f` compiled with `jax.jit`; `scale` and `causal` fix the program, so they are static."""
    return jax.jit(f, static_argnames=("scale", "causal"))


attention_from_energy, energy, value_covariance = map(compiled, (
    tae.attention_from_energy, tae.energy, tae.value_covariance))

kq, kk, kv = jax.random.split(jax.random.key(0), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 2, 3, 4, 2, 16, 3, 40
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))
kv_head = np.arange(Hq) // (Hq // Hkv)  # query head h reads kv head h // (Hq / Hkv)
print("query heads", np.arange(Hq), "read kv heads", kv_head)


def rows_np(q, k, v, zeta, *, causal=False, kv_lengths=None):
    """F_tot, its gradient [B, Tq, Hq, Dv] and its Hessian blocks [B, Tq, Hq, Dv, Dv], one
    (b, i, h) row at a time with the numpy functions above, in float64. Query i of Tq sits at
    position L_b − Tq + i (the decode convention) and sees keys a < L_b, and a ≤ its own
    position if causal. A row that sees no key adds nothing to F and has gradient 0."""
    q, k, v, zeta = (np.asarray(x, np.float64) for x in (q, k, v, zeta))
    b_, tq, hq, d = q.shape
    tk, dv_ = k.shape[1], v.shape[-1]
    lengths = np.full(b_, tk) if kv_lengths is None else np.asarray(kv_lengths)
    F_tot, grad = 0.0, np.zeros((b_, tq, hq, dv_))
    hess = np.zeros((b_, tq, hq, dv_, dv_))
    for b, i, hh in np.ndindex(b_, tq, hq):
        pos = lengths[b] - tq + i
        seen = [a for a in range(tk) if a < lengths[b] and (not causal or a <= pos)]
        if not seen:
            continue
        g = hh // (hq // k.shape[2])
        s = k[b, seen, g] @ q[b, i, hh] / np.sqrt(d)  # default scale 1/√D
        vals = v[b, seen, g]
        F_tot += energy_np(s, vals, zeta[b, i, hh])
        grad[b, i, hh] = gradient_np(s, vals, zeta[b, i, hh])
        hess[b, i, hh] = hessian_np(s, vals, zeta[b, i, hh])
    return F_tot, grad, hess


zeta0 = jnp.zeros((B, Tq, Hq, Dv))
F_ref, att_ref, cov_ref = rows_np(q, k, v, zeta0)
np.testing.assert_allclose(energy(q, k, v, zeta0), F_ref, rtol=1e-14)
np.testing.assert_allclose(attention_from_energy(q, k, v), att_ref, rtol=0, atol=1e-14)
np.testing.assert_allclose(value_covariance(q, k, v), cov_ref, rtol=0, atol=1e-14)
zeta_r = 0.5 * jax.random.normal(jax.random.key(2), zeta0.shape)  # away from 0: tilted
np.testing.assert_allclose(energy(q, k, v, zeta_r), rows_np(q, k, v, zeta_r)[0], rtol=1e-14)
print(f"energy, attention_from_energy, value_covariance == numpy, row by row "
      f"({B * Tq * Hq} rows)   ✓")

# %% [markdown]
# **Predict, then run.** Here $B = 2$, $T_q = 3$, $H_q = 4$ and $D_v = 3$. The full Hessian of
# $F_{\text{tot}}$ in $\zeta$ is a square matrix with one row per entry of $\zeta$. How many
# entries does it have, and how many of them can be non-zero?
#
# <details><summary>Answer</summary>
#
# $\zeta$ has $B\,T_q\,H_q\,D_v = 72$ entries, so the Hessian has $72^2 = 5184$. Each
# $(b, i, h)$ term of $F_{\text{tot}}$ depends only on its own row $\zeta_{bih}$, so the
# Hessian is **block diagonal**: $B\,T_q\,H_q = 24$ blocks of $3\times 3$ on the diagonal,
# $24\cdot 9 = 216$ entries, and zeros elsewhere. The cell builds the full matrix with
# `jax.hessian` and counts.
#
# </details>

# %%
full = np.asarray(jax.jit(jax.hessian(tae.energy, argnums=3))(q, k, v, zeta0))
rows = B * Tq * Hq  # one log-sum-exp term of F_tot per (b, i, h)
flat = full.reshape(rows, Dv, rows, Dv)  # [row, Dv, row', Dv]
blocks = np.stack([flat[r, :, r, :] for r in range(rows)]).reshape(B, Tq, Hq, Dv, Dv)
np.testing.assert_allclose(blocks, cov_ref, rtol=0, atol=1e-14)
off_diag = flat.copy()
for r in range(rows):
    off_diag[r, :, r, :] = 0
assert np.abs(off_diag).max() == 0.0
assert np.count_nonzero(full) == rows * Dv**2  # covariances of random values: no zero entry
print(f"full Hessian: {full.size} entries, {np.count_nonzero(full)} non-zero "
      f"({rows} diagonal blocks of {Dv}x{Dv}); off-diagonal blocks exactly 0")

# %% [markdown]
# So the package never builds the full matrix. It uses **Hessian-vector products**: for a
# function $f$, `jax.jvp(jax.grad(f), (ζ,), (e,))` differentiates the gradient along the
# direction $e$ (forward mode over reverse mode) and returns $\nabla^2 f(\zeta)\, e$ without
# forming $\nabla^2 f$. By hand, for one row with $D_v = 2$, one product along a direction
# $u$, checked against the numpy Hessian times $u$:

# %%
s2, v2 = s_row[:5], v_row[:5, :2]  # one row, five keys, two value dimensions
grad2 = jax.grad(lambda z: energy_jnp(s2, v2, z))
z2 = jnp.zeros(2)
u = jnp.array([0.6, -0.8])  # any direction
hvp = jax.jvp(grad2, (z2,), (u,))[1]  # H u, without forming H
h_u = hessian_np(s2, v2, np.zeros(2)) @ np.asarray(u, np.float64)
np.testing.assert_allclose(hvp, h_u, atol=1e-15)
print(f"one Hessian-vector product H u: {np.round(np.asarray(hvp), 5)}; numpy's H @ u: "
      f"{np.round(h_u, 5)}")

# %% [markdown]
# The whole Hessian is $D_v$ such products along well-chosen directions (the exercise below
# asks which). `value_covariance` adds one twist: each direction is placed in *every*
# $(b, i, h)$ row of $\zeta$ at once. Since the Hessian is block diagonal, one product then
# serves every block, and $D_v$ products give all of them.
#
# **Exercise (code).** Write `covariance_by_hvp(f, zeta, dv)`: the $d_v \times d_v$ Hessian of
# a scalar function `f` of a vector $\zeta$ at `zeta`, from $d_v$ Hessian-vector products.
# Fill in the stub; the hidden cell after it holds a solution, and the test cell checks
# whichever definition ran last against the numpy covariance of section 1.3, at a $\zeta$
# away from 0, and against the Hessian of a second function, $\tfrac12\zeta^\top A\zeta +
# \log\sum_j e^{(M\zeta)_j}$, that it writes out itself. `jax.hessian` and the package's
# `value_covariance` raise while your function runs.

# %%
def covariance_by_hvp(f, zeta, dv):
    """∇²f(ζ) [dv, dv] from dv Hessian-vector products of the scalar function f."""
    # TODO: a Hessian-vector product is a forward derivative of the gradient (jax.jvp of
    # jax.grad(f)); which dv vectors give the Hessian's columns?
    return jnp.zeros((dv, dv))  # placeholder: runs, and the test below rejects it


stub_covariance_by_hvp = covariance_by_hvp


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "covariance_by_hvp", "locked": false, "schema_version": 3, "solution": true, "task": false}
def covariance_by_hvp(f, zeta, dv):
    """∇²f(ζ) [dv, dv] from dv Hessian-vector products of the scalar function f."""
    columns = [jax.jvp(jax.grad(f), (zeta,), (e,))[1] for e in jnp.eye(dv)]
    return jnp.stack(columns, axis=1)


# %% nbgrader={"grade": true, "grade_id": "test_covariance_by_hvp", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def check_covariance_by_hvp(fn):
    """Raises AssertionError unless fn gives the tilted covariance of section 1.3, and the
    Hessian of a second function that no cell of this notebook computes."""
    zeta_t = jnp.asarray(zeta_row)  # not 0: a solution that evaluates at 0 fails
    # The second function, g(z) = z·Az/2 + logsumexp(Mz), its Hessian written out below.
    r = np.random.default_rng(11)
    a_mat = r.normal(size=(dv, dv))
    a_mat = a_mat @ a_mat.T  # symmetric
    m_mat, z_g = r.normal(size=(7, dv)), r.normal(size=dv)
    own = AssertionError("write it from Hessian-vector products, not the package's or jax's")
    with mock.patch.object(tae, "value_covariance", side_effect=own), \
            mock.patch.object(energy_module, "value_covariance", side_effect=own), \
            mock.patch.object(jax, "hessian", side_effect=own):
        got = fn(lambda z: energy_jnp(s_row, v_row, z), zeta_t, dv)
        got_g = fn(lambda z: z @ jnp.asarray(a_mat) @ z / 2
                   + jax.nn.logsumexp(jnp.asarray(m_mat) @ z), jnp.asarray(z_g), dv)
    np.testing.assert_allclose(got, hessian_np(s_row, v_row, zeta_row), rtol=0, atol=1e-13)
    w = np.exp(m_mat @ z_g - (m_mat @ z_g).max())
    w /= w.sum()  # softmax(Mz): the second term's Hessian is M^T (diag w - w w^T) M
    want_g = a_mat + m_mat.T @ (np.diag(w) - np.outer(w, w)) @ m_mat
    np.testing.assert_allclose(got_g, want_g, rtol=1e-12, atol=1e-12)


try:
    check_covariance_by_hvp(stub_covariance_by_hvp)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given fails the test")
check_covariance_by_hvp(covariance_by_hvp)
print("covariance_by_hvp == numpy covariance at zeta != 0, and == the second function's "
      "Hessian written out   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The package's energy, gradient and covariance equal the from-scratch numpy ones row by
# row. The Hessian of $F_{\text{tot}}$ is block diagonal, one block per (batch, query,
# head), so $D_v$ Hessian-vector products give every block.</p></div>
#
# ## 1.5 Many queries, heads and a causal mask
#
# With queries $i$, heads $h$ and a causal mask the energy is (paper, eqs. 25 and 27–28)
#
# $$F_{\text{tot}}(\zeta) = \sum_b \sum_i \sum_h \log \sum_{a \le \text{pos}(i)} \exp(\text{scale}\, q_{bih}\cdot k_{b,a,h'} + \zeta_{bih}\cdot v_{b,a,h'}).$$
#
# The package uses the **decode convention**: the $T_q$ queries are the newest tokens, so
# query $i$ sits at position $L_b - T_q + i$, where $L_b$ is the sequence's length
# (`kv_lengths`), and sees the keys at positions up to its own. A sequence of length 0 sees
# nothing: its term is left out of $F$, so its gradient, like `attention`'s output, is zero.
# `rows_np` spells the rule out as a loop; the cell compares the package with it.

# %%
lengths = jnp.array([40, 7])
kw = dict(causal=True, kv_lengths=lengths)
F_m, att_m, cov_m = rows_np(q, k, v, zeta0, **kw)
np.testing.assert_allclose(energy(q, k, v, zeta0, **kw), F_m, rtol=1e-14)
np.testing.assert_allclose(attention_from_energy(q, k, v, **kw), att_m, rtol=0, atol=1e-14)
np.testing.assert_allclose(value_covariance(q, k, v, **kw), cov_m, rtol=0, atol=1e-14)
visible = np.array([[[a < lengths[b] and a <= lengths[b] - Tq + i for a in range(Tk)]
                     for i in range(Tq)] for b in range(B)])  # [B, Tq, Tk], the rule
print("keys visible to each query of sequence 1 (length 7):", visible[1].sum(-1))

# A sequence of length 0: no term in F, zero gradient.
empty = jnp.array([40, 0])
grad_empty = attention_from_energy(q, k, v, causal=True, kv_lengths=empty)
assert np.all(np.asarray(grad_empty[1]) == 0)
np.testing.assert_allclose(energy(q, k, v, zeta0, causal=True, kv_lengths=empty),
                           rows_np(q[:1], k[:1], v[:1], zeta0[:1], causal=True)[0], rtol=1e-14)
print("causal, ragged lengths: package == numpy loop; length 0: gradient exactly 0 and "
      "no term in F   ✓")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 2.2))
for b, ax in enumerate(axes):
    ax.imshow(visible[b], aspect="auto", cmap="Greys", interpolation="nearest")
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
# ## 1.6 Stable for huge logits
#
# `energy_np` overflows as soon as a logit passes about 709, where float64's `exp` overflows.
# The fix is the paper's "safe softmax" (appendix F): shift each log-sum-exp by its row
# maximum $m$,
#
# > $F'_{tot} = \sum_{i} \log \sum_{a=1}^{i} \exp\left(q_i \cdot k_a^T + \zeta_i \cdot v_a^T - m_i\right)$ (36)
# > [...] When we take the derivative of these two quantities, we see that we get the same
# > result (37).
#
# (The paper's eq. 35, the unshifted $F_{tot}$, has a typo: it writes the source as
# $\zeta_a$, indexed by the key, where eq. 36 and eq. 25 have $\zeta_i$, indexed by the
# query.) The shift changes $F$ by the constant $m$ and the gradient not at all, and every
# exponent becomes $\le 0$. The package's `energy` computes
# $m + \log\sum_a e^{s_a + \zeta\cdot v_a - m}$.
#
# **Predict, then run.** Multiply $q$ and $k$ by 1000. That multiplies every logit by a
# million: the scores of section 1.4, of order 1, become of order $10^6$. What is attention
# then, and what is $F(0)$?
#
# <details><summary>Answer</summary>
#
# The one-hot limit. Each row's two largest logits are now thousands apart, so every weight
# but the largest is $e^{-\text{thousands}} = 0$ in float64: attention is **exactly** the
# value of the key with the largest logit, $v_{\arg\max}$, and each row's log-sum-exp is
# exactly its largest logit (adding $\log(1 + 0)$ changes nothing), so $F(0)$ is the sum of
# the row maxima. The cell prints the smallest gap between a row's two largest logits and
# asserts both limits.
#
# </details>

# %%
q_big, k_big = q * 1e3, k * 1e3
k_rep = np.repeat(np.asarray(k_big), Hq // Hkv, axis=2)  # kv head of each query head
scores = np.einsum("bihd,bahd->bhia", np.asarray(q_big), k_rep) / np.sqrt(D)  # [B, Hq, Tq, Tk]
exp_limit = float(np.log(np.finfo(np.float64).max))  # exp overflows above this
top2 = np.sort(scores, -1)[..., -2:]
gap = (top2[..., 1] - top2[..., 0]).min()  # the smallest top-2 gap over all rows
winner = scores.argmax(-1)  # [B, Hq, Tq]
v_rep = np.repeat(np.asarray(v), Hq // Hkv, axis=2)  # [B, Tk, Hq, Dv]
one_hot = np.stack([[[v_rep[b, winner[b, hh, i], hh] for hh in range(Hq)] for i in range(Tq)]
                    for b in range(B)])  # [B, Tq, Hq, Dv]: v of the largest logit
f_huge = energy(q_big, k_big, v, zeta0)
g_huge = attention_from_energy(q_big, k_big, v)
np.testing.assert_array_equal(g_huge, one_hot)  # exactly the one-hot limit
np.testing.assert_allclose(f_huge, scores.max(-1).sum(), rtol=1e-15)  # F = Σ row maxima
with np.errstate(over="ignore", divide="ignore"):
    assert np.isinf(energy_np(scores[0, 0, 0], np.asarray(v[0, :, 0]), np.zeros(Dv)))
# exp(-x) rounds to 0 in float64 beyond x = -log(half the smallest subnormal): there every
# weight but the largest is exactly 0, whatever the values. (The limit can be reached
# sooner: once 1 + e^(-gap) rounds to 1, depending on the values.)
underflow_gap = -float(np.log(np.finfo(np.float64).smallest_subnormal)) + float(np.log(2))
assert np.exp(-underflow_gap * (1 + 1e-12)) == 0 and np.exp(-underflow_gap + 1) > 0
assert gap > underflow_gap  # every other weight of every row is exactly 0
display(Markdown(
    f"The largest logit is ${np.abs(scores).max():.3g}$, while float64's `exp` overflows "
    f"above ${exp_limit:.2f}$, and the smallest gap between a row's two largest logits is "
    f"${gap:,.0f}$, past the ${underflow_gap:.2f}$ beyond which $e^{{-\\text{{gap}}}}$ "
    f"underflows to 0. The unshifted `energy_np` returns inf; the package's $F$ equals the "
    f"sum of the row maxima and its gradient is exactly $v_{{\\arg\\max}}$ in every row."))

# %% [markdown]
# The one-hot case exercises only the maximum. A case where the shift matters and every
# weight counts: logits of about 800 (past the overflow) that differ by a few units. We add
# 800 to every score through an extra coordinate of $q$ and $k$, and compare with a numpy
# softmax shifted by hand, in float64.

# %%
offset = 800.0
q_off = jnp.concatenate([q / np.sqrt(D), jnp.full((B, Tq, Hq, 1), offset / 40)], -1)
k_off = jnp.concatenate([k, jnp.full((B, Tk, Hkv, 1), 40.0)], -1)  # q·k gains 800
s_off = np.einsum("bihd,bahd->bhia", np.asarray(q_off),
                  np.repeat(np.asarray(k_off), Hq // Hkv, axis=2))  # scale 1: [B, Hq, Tq, Tk]
w_off = np.exp(s_off - s_off.max(-1, keepdims=True))
att_off = np.einsum("bhia,bahd->bihd", w_off / w_off.sum(-1, keepdims=True), v_rep)
F_off = (s_off.max(-1) + np.log(w_off.sum(-1))).sum()
np.testing.assert_allclose(attention_from_energy(q_off, k_off, v, scale=1.0), att_off,
                           rtol=0, atol=1e-13)
np.testing.assert_allclose(energy(q_off, k_off, v, zeta0, scale=1.0), F_off, rtol=1e-14)
p_top = (w_off / w_off.sum(-1, keepdims=True)).max()  # the largest weight of any row
assert p_top < 0.99  # no row is one-hot: every weight counts
print(f"logits from {s_off.min():.1f} to {s_off.max():.1f}, largest weight {p_top:.3f}: "
      f"package == numpy shifted softmax   ✓")

# %% [markdown]
# **Exercise (code).** Make `energy_np` stable: write `energy_stable(s, v, zeta)`, equal to
# `energy_np` wherever that is finite, and finite for any finite logits. The test compares
# it with `energy_np` on small logits and with an exact reference at logits of $10^6$,
# computed by `mpmath` with 50 significant digits. Writing the stable logsumexp is the
# exercise: the library ones (`jax.nn`'s and `jax.scipy.special`'s, `scipy.special`'s,
# `np.logaddexp`) and the package's `energy` and `energy_terms` raise while your function
# runs.

# %%
def energy_stable(s, v, zeta):
    """F(ζ) = log Σ_a exp(s_a + ζ·v_a) for one query, finite for any finite logits."""
    # TODO: exp overflows long before the log of the sum would. Hint: the safe softmax
    # above; which shift keeps every exponent at most 0, and what must be added back?
    return energy_np(s, v, zeta)  # placeholder: overflows at large logits


stub_energy_stable = energy_stable


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "energy_stable", "locked": false, "schema_version": 3, "solution": true, "task": false}
def energy_stable(s, v, zeta):
    """F(ζ) = log Σ_a exp(s_a + ζ·v_a) for one query, finite for any finite logits."""
    x = s + v @ zeta
    m = x.max()
    return m + np.log(np.sum(np.exp(x - m)))


# %% nbgrader={"grade": true, "grade_id": "test_energy_stable", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def check_energy_stable(fn_given):
    """Raises AssertionError unless fn equals energy_np on small logits and the exact value
    on logits of a million."""
    import jax.scipy.special
    import scipy.special

    class Blocked:  # stands in for a library logsumexp: calling it, or any method, raises
        def __call__(self, *args, **kwargs):
            raise AssertionError("write the stable logsumexp yourself, not a library's")

        def __getattr__(self, name):  # np.logaddexp.reduce
            if name.startswith("__"):
                raise AttributeError(name)
            self()

    def fn(s, v, zeta):  # the student's function, with every library logsumexp raising
        with contextlib.ExitStack() as stack:
            for module, name in ((jax.nn, "logsumexp"), (jax.scipy.special, "logsumexp"),
                                 (scipy.special, "logsumexp"), (np, "logaddexp"),
                                 (tae, "energy"), (energy_module, "energy"),
                                 (energy_module, "energy_terms")):
                stack.enter_context(mock.patch.object(module, name, new=Blocked()))
            return fn_given(s, v, zeta)

    np.testing.assert_allclose(fn(s_row, v_row, zeta_row), energy_np(s_row, v_row, zeta_row),
                               rtol=1e-14)
    s_huge = 1e6 + s_row  # every exp overflows
    with mpmath.workdps(50):  # the float64 inputs, summed and exponentiated to 50 digits
        x = [mpmath.mpf(float(si)) + mpmath.mpf(float(zi)) for si, zi in
             zip(s_huge, v_row @ zeta_row, strict=True)]
        exact = float(mpmath.log(mpmath.fsum(mpmath.exp(xi) for xi in x)))
    with np.errstate(over="ignore"):
        got = fn(s_huge, v_row, zeta_row)
    assert np.isfinite(got), got
    np.testing.assert_allclose(got, exact, rtol=1e-15)


try:
    check_energy_stable(stub_energy_stable)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given fails the test")
check_energy_stable(energy_stable)
print("energy_stable == energy_np on small logits, == mpmath at logits 1e6   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Computing $F$ as $m + \log\sum_a e^{s_a + \zeta\cdot v_a - m}$, with $m$ the row max,
# gives the same value and gradient, and every exponent is at most 0: nothing overflows.
# As logits grow, attention tends to the value of the largest logit's key, and reaches it
# exactly, at the latest, once $e^{-\text{gap}}$ underflows to 0 (the cell above prints
# where).</p></div>
#
# ## 1.7 The energy landscape
#
# For one query with $D_v = 2$ we can draw $F$ over the $\zeta$ plane. $F$ is convex, and its
# gradient at the origin, the arrow, **is** the attention output.

# %%
q1, k1, v1 = q[:1, :1, :1], k[:1, :, :1], v[:1, :, :1, :2]
grid = jnp.linspace(-2.0, 2.0, 81)
Z1, Z2 = jnp.meshgrid(grid, grid)
zetas = jnp.stack([Z1, Z2], -1).reshape(-1, 1, 1, 1, 2)
F_grid = jax.jit(jax.vmap(lambda z: tae.energy(q1, k1, v1, z)))(zetas).reshape(Z1.shape)
s1 = np.asarray(q1[0, 0, 0] @ k1[0, :, 0].T) / np.sqrt(D)  # scores [Tk]
vals = np.asarray(v1[0, :, 0])  # values [Tk, 2]
g0 = np.asarray(attention_from_energy(q1, k1, v1)).ravel()
np.testing.assert_allclose(g0, gradient_np(s1, vals, np.zeros(2)), rtol=1e-13)

fig, ax = plt.subplots(figsize=(5.2, 4.4))
cs = ax.contourf(np.asarray(Z1), np.asarray(Z2), np.asarray(F_grid), levels=25, cmap="Greys")
fig.colorbar(cs, label=r"$F(\zeta)$")
ax.quiver(0, 0, g0[0], g0[1], angles="xy", scale_units="xy", scale=1,
          color=plots.color("reference"), width=0.012)
ax.plot(0, 0, "o", color=plots.color("reference"))
ax.set_xlabel(r"$\zeta_1$")
ax.set_ylabel(r"$\zeta_2$")
ax.set_title(r"Energy landscape; arrow: $\nabla F(0)$ = attention output", fontsize=11)
print("attention output (= gradient at 0):", np.round(g0, 4))

# %% [markdown]
# *Figure: the energy over a 2-D source (darker is higher). Look at the contours: they bound
# convex regions, as for any convex function. The black arrow is $\nabla_\zeta F(0)$, which
# equals the attention output printed above.*
#
# The convexity of section 1.2, checked on this landscape: at random points $\zeta$, the
# Hessian of the package's `energy` from `jax.hessian` equals `hessian_np`, the covariance
# of the values under the tilted weights, and its eigenvalues are $\ge 0$.

# %%
hess_at = jax.jit(jax.vmap(jax.hessian(lambda z: tae.energy(q1, k1, v1, z))))
points = 2 * jax.random.normal(jax.random.key(1), (5, 1, 1, 1, 2))
H_points = np.asarray(hess_at(points)).reshape(5, 2, 2)
for z, H in zip(np.asarray(points).reshape(5, 2), H_points, strict=True):
    np.testing.assert_allclose(H, hessian_np(s1, vals, z), rtol=1e-10, atol=1e-13)
    assert np.linalg.eigvalsh(H).min() >= 0
print("Hessian at 5 random zeta == tilted covariance, eigenvalues >= 0   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>$F$ is a smooth convex bowl over the source space; attention is the slope of the bowl at
# the origin.</p></div>
#
# ## 1.8 Summary
#
# * Attention is $\nabla_\zeta F(0)$ for the energy $F(\zeta)=\log\sum_a e^{s_a+\zeta\cdot v_a}$,
#   and the Hessian is the value covariance, because $F - F(0)$ is a cumulant-generating
#   function (the paper's eq. 6 calls $F$ a moment-generating function); so $F$ is convex in $\zeta$.
# * Both identities are proved in sympy for any number of keys, and $F$, its gradient and
#   its Hessian, written from scratch in numpy, agree with finite differences, with
#   `jax.grad`/`jax.hessian` and with the package, in float64.
# * $F_{\text{tot}}$ sums one log-sum-exp per batch, query and head; causal masks and
#   per-sequence lengths only change which keys enter each sum, and its Hessian is block
#   diagonal, so Hessian-vector products give every block.
# * Shifting each log-sum-exp by its max keeps $F$ finite for any logits; as logits grow,
#   attention reaches the one-hot limit.
# * Next: the same energy read as a probability model (notebook 2), then why a log-sum-exp
#   can be split across devices (notebook 3).
#
# ## 1.9 More exercises
#
# Each answer is hidden: open "Answer" to read it, and the collapsed cell below it checks it.
#
# 1. The third derivative of $t \mapsto F(tu)$ at 0 is the third *central* moment of
#    $w = u\cdot v$. Prove it with sympy for any number of keys. Does the pattern
#    "derivative = central moment" continue to the fourth derivative?
# 2. **Predict, then measure.** A query sees exactly two keys, with weights $p$ and $1-p$ and
#    values $v_1 \ne v_2 \in \mathbf{R}^{3}$. Before running anything, predict how many
#    eigenvalues of its $3\times 3$ value covariance are non-zero, and what the non-zero ones
#    are. Then measure with `value_covariance` (hint: `kv_lengths` with a length of 2).
#
# <details><summary>Answer 1</summary>
#
# The third identity of `symbolic.cumulants_any_n()` is
# $\frac{d^3}{dt^3}F(tu)\big|_0 = \mathrm{E}_p[(w - \mathrm{E}_p w)^3]$, proved for symbolic
# $n$: the third cumulant is the third central moment. The pattern stops there: the fourth
# derivative, the fourth cumulant, is the fourth central moment minus three times the squared
# variance. The cell shows "fourth central moment" false by a counterexample (3 keys,
# numbers substituted, a nonzero difference), and checks the correct value numerically with nested `jax.grad` on the row of section 1.3.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_2", "locked": false, "schema_version": 3, "solution": true, "task": false}
third = cumulants[2]
assert sp.simplify(third.lhs - third.rhs) == 0
mean_w = symbolic.expectation_any_n(w_sym[a_sym], n_sym, a_sym, s_sym)
fourth_central = symbolic.expectation_any_n((w_sym[a_sym] - mean_w) ** 4, n_sym, a_sym, s_sym)
d4_sym = sp.diff(symbolic.directional_energy_any_n(), t_sym, 4).subs(t_sym, 0)
gap4 = at_counterexample(d4_sym - fourth_central)
assert abs(gap4) > 1  # false at a point, with a margin
print(f"{third.name}: proved for symbolic n; d4F/dt4 = E[(w - E w)^4] is false: at "
      f"s = (0, 1, -1/2), w = (1, -2, 3) the difference is {gap4:.2f}   ✓")

# Numerically, along u = e_0 for the row of section 1.3: derivatives 3 and 4 of F at 0.
w_n = v_row[:, 0]


def F_line(t):
    return energy_jnp(s_row, v_row, t * jnp.eye(dv)[0])


d3 = jax.jit(jax.grad(jax.grad(jax.grad(F_line))))(0.0)
d4 = jax.jit(jax.grad(jax.grad(jax.grad(jax.grad(F_line)))))(0.0)
p_n = weights_np(s_row, v_row, np.zeros(dv))
centred = w_n - p_n @ w_n
m2, m3, m4 = (p_n @ centred**2, p_n @ centred**3, p_n @ centred**4)
np.testing.assert_allclose(d3, m3, rtol=1e-10)
np.testing.assert_allclose(d4, m4 - 3 * m2**2, rtol=1e-10)
assert abs(d4 - m4) > 1e-3  # the fourth derivative is not the fourth central moment
print(f"F''' = {float(d3):.4f} = E[(w-Ew)^3];  F'''' = {float(d4):.4f} = "
      f"E[(w-Ew)^4] - 3 Var^2 ({m4:.4f} - {3 * m2**2:.4f})   ✓")

# %% [markdown]
# <details><summary>Answer 2</summary>
#
# One. With two keys the mean is $\mu = p v_1 + (1-p) v_2$ and
# $\mathrm{Cov} = p\,v_1v_1^\top + (1-p)\,v_2v_2^\top - \mu\mu^\top = p(1-p)\,(v_1-v_2)(v_1-v_2)^\top$,
# a rank-one matrix: one eigenvalue $p(1-p)\,\lVert v_1 - v_2\rVert^2$ and two zeros (the
# values vary only along $v_1 - v_2$). A query that sees a single key has covariance 0. The
# cell gives sequence 0 two keys and sequence 1 one key; $p$ comes from a numpy softmax of
# the two scores.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_3", "locked": false, "schema_version": 3, "solution": true, "task": false}
two = jnp.array([2, 1])
cov2 = np.asarray(value_covariance(q[:, :1], k, v, kv_lengths=two))  # [B, 1, Hq, Dv, Dv]
for hh in range(Hq):
    g = kv_head[hh]
    s_two = np.asarray(k[0, :2, g]) @ np.asarray(q[0, 0, hh]) / np.sqrt(D)
    p = weights_np(s_two, np.zeros((2, 1)), np.zeros(1))[0]
    v_1, v_2 = np.asarray(v[0, 0, g]), np.asarray(v[0, 1, g])
    eig = np.linalg.eigvalsh(cov2[0, 0, hh])
    np.testing.assert_allclose(eig[:2], 0, atol=1e-14)
    np.testing.assert_allclose(eig[2], p * (1 - p) * np.sum((v_1 - v_2) ** 2), rtol=1e-12)
    print(f"head {hh}: p = {p:.3f}, non-zero eigenvalue {eig[2]:.4f}, "
          f"p(1-p)|v1-v2|^2 = {p * (1 - p) * np.sum((v_1 - v_2) ** 2):.4f}")
np.testing.assert_allclose(cov2[1], 0, atol=1e-15)  # one key: no spread
print("two keys: one non-zero eigenvalue p(1-p)|v1 - v2|^2; one key: covariance 0   ✓")

# %% [markdown]
# ## 1.10 References
#
# Shyam et al., *Tree Attention: Topology-aware Decoding for Long-Context Attention on GPU
# clusters*, [arXiv 2408.04093](https://arxiv.org/abs/2408.04093):
#
# * paper §4, Observation 1, eqs. (5)–(6): attention as the gradient of the energy $F(\zeta)$
#   (quoted in section 1.1; eq. 6's "moment generating function" is corrected by C.1);
# * Appendix C.1, eqs. (15)–(24): the proof, with $F$ as the cumulant-generating function
#   ("free energy") and the moments as derivatives of the partition function (eq. 20);
# * Appendix C.1, eq. (25): $F_{\text{tot}}$ with a causal mask, and eqs. (27)–(28): many heads;
# * Appendix F, eqs. (35)–(38): the max shift ("safe softmax") leaves the gradient unchanged
#   (quoted in section 1.6, with eq. 35's typo);
# * paper §5: why the energy's log-sum-exp can be reduced in parallel (notebook 3).
#
# Tools: sympy's `Sum` and `IndexedBase` for the proofs with a symbolic number of keys;
# `mpmath` (installed with sympy) for the 50-digit reference. This notebook quotes no
# hardware figures.
