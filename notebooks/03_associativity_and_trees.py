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
# # 3. Associativity, and why a tree is enough
#
# Attention over a long sequence is a reduction over keys. If the reduction's operation is
# associative, the keys can be split into chunks, each chunk reduced on its own, and the
# partial results combined in **any tree shape**. With $p$ workers that takes
# $O(N/p + \log p)$ steps instead of $O(N)$: the paper's Theorem 1.
#
# **What you will learn**
#
# * the shift invariance that makes log-sum-exp numerically safe;
# * that log-sum-exp over a union of chunks is the log-sum-exp of the chunks' log-sum-exps;
# * the partial state $(\text{out}, \text{lse})$ and its `combine`, a commutative monoid, proved in
#   sympy and checked on random and adversarial inputs (empty chunks, huge logits);
# * that chunked attention equals full attention for every chunking and tree shape;
# * how many sequential steps a tree reduction takes.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from tree_attention_edu import costmodel, plots, symbolic

jax.config.update("jax_enable_x64", True)
assert jax.device_count() == 8, jax.devices()

# %% [markdown]
# ## 3.1 Two facts about log-sum-exp
#
# **Shift invariance.** For any constant $c$,
# $\log\sum_a e^{s_a} = c + \log\sum_a e^{s_a - c}$. Choosing $c = \max_a s_a$ makes every
# exponent $\le 0$, so nothing overflows: the "safe max".
#
# **Union of chunks.** If the keys are split into chunks $C_1, \dots, C_p$,
# $$\operatorname{lse}(s) = \operatorname{lse}\big(\operatorname{lse}(s_{C_1}), \dots, \operatorname{lse}(s_{C_p})\big).$$
# Each chunk can be summarised by one number, and the summaries reduce like the originals.

# %%
identities = symbolic.shift_invariance(3) + symbolic.lse_of_union((2, 3)) + \
    symbolic.lse_of_union((1, 2, 2))
for ident in identities:
    assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
    print(f"{ident.name:<28} ✓   {ident.lhs}")

# %% [markdown]
# ## 3.2 The partial state and its combine
#
# Attention needs more than the log-sum-exp: it needs the weighted values. A chunk is
# summarised by its state $(o, \ell)$, the output normalised over the chunk and its
# log-sum-exp. Two states combine as
#
# $$\ell = \log(e^{\ell_a} + e^{\ell_b}), \qquad o = \frac{e^{\ell_a} o_a + e^{\ell_b} o_b}{e^{\ell_a} + e^{\ell_b}}.$$
#
# sympy proves that this `combine` is associative and commutative, and that combining two
# chunks' states gives the attention and log-sum-exp of their union:

# %%
for make in (symbolic.combine_associative, symbolic.combine_commutative,
             symbolic.combine_matches_chunks):
    for ident in make():
        assert sp.simplify(ident.lhs - ident.rhs) == 0, ident.name
        print(f"{ident.name:<34} ✓")

# %% [markdown]
# The empty chunk, $(o, \ell) = (0, -\infty)$, is the identity: $e^{-\infty} = 0$ drops it
# from both sums. States with `combine` and this identity form a **commutative monoid**.
#
# In floating point the identity needs care: combining two empty states naively computes
# $(-\infty) - (-\infty)$ = NaN. The package shifts by $m = \max(\ell_a, \ell_b)$, replaced
# by 0 when both are $-\infty$, so the identity is *exact* and NaN never appears.
#
# ## 3.3 Random and adversarial trials
#
# `hypothesis` draws states, empty ones included, and checks the monoid laws on the package's
# float64 `combine` (derandomised, so this notebook's output is reproducible; the test suite
# draws from the whole float range).

# %%
# Realistic log-sum-exps and the empty state (section 3.4 shows what goes wrong at 1e300).
# XLA's CPU backend flushes subnormals to zero, so they are left out of the draws.
lse_values = st.one_of(st.just(-np.inf), st.floats(-50, 50, allow_subnormal=False))
state = st.tuples(st.floats(-10, 10, allow_subnormal=False), lse_values).map(
    lambda t: tae.AttentionState(jnp.array([[[[0.0 if np.isneginf(t[1]) else t[0]]]]]),
                                 jnp.array([[[t[1]]]])))
empty = tae.identity_state(1, 1, 1, 1, jnp.float64)


combine = jax.jit(tae.combine)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(state, state, state)
def monoid_laws(a, b, c):
    left, right = combine(combine(a, b), c), combine(a, combine(b, c))
    np.testing.assert_allclose(left.lse, right.lse, rtol=1e-14)
    np.testing.assert_allclose(left.out, right.out, atol=1e-12)
    ab, ba = combine(a, b), combine(b, a)
    assert np.array_equal(ab.out, ba.out) and np.array_equal(ab.lse, ba.lse)  # bit for bit
    for x in (combine(a, empty), combine(empty, a)):
        np.testing.assert_array_equal(x.out, a.out)
        np.testing.assert_array_equal(x.lse, a.lse)
    assert not np.isnan(np.asarray(combine(empty, empty).out)).any()


monoid_laws()
print("associative, commutative, exact identity, no NaN: 200 adversarial triples   ✓")

# %% [markdown]
# ## 3.4 Where floating point stops: an lse of 1e300 cannot remember log 2
#
# Associativity is exact in the reals but holds only up to rounding in floats, and the
# rounding of a state lives in its lse: an lse of size $L$ is known to about $L\cdot\varepsilon$.
# At $L = 10^{300}$ that is $10^{284}$, so $\log 2$ (two equal chunks) is lost entirely:
# three equal chunks then combine like a `max`, and the bracketing changes the answer.
# Real logits are nowhere near this (the package's float32 path would lose $\log 2$ only
# beyond $|\ell| \approx 10^8$), but it shows exactly what "associative up to rounding"
# means.

# %%
def one(out, lse):
    return tae.AttentionState(jnp.full((1, 1, 1, 1), out), jnp.full((1, 1, 1), lse))


for L in (0.0, -1e300):
    a, b, c = one(0.0, L), one(0.0, L), one(1.0, L)  # true answer: out = 1/3
    left = float(combine(combine(a, b), c).out.ravel()[0])
    right = float(combine(a, combine(b, c)).out.ravel()[0])
    print(f"lse = {L:>7g}: (a+b)+c -> {left:.4f},  a+(b+c) -> {right:.4f}   (exact: 0.3333)")
np.testing.assert_allclose([left, right], [0.5, 0.25])  # at 1e300: log 2 rounded away
assert float(one(0.0, -1e300).lse.ravel()[0]) + np.log(2) == -1e300

# %% [markdown]
# ## 3.5 Chunked attention equals full attention, for any chunking
#
# `chunk_states` cuts the cache into consecutive chunks (sizes may be 0) and computes each
# chunk's state with **global** positions, so causal masks and `kv_lengths` mean the same in
# every chunk. We compare full attention with a left-to-right (ring-order) reduction and with
# binary and ternary trees, over many random chunkings.

# %%
kq, kk, kv = jax.random.split(jax.random.key(3), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 2, 3, 4, 2, 8, 5, 50
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))
kw = dict(causal=True, kv_lengths=jnp.array([50, 17]))
full = tae.attention(q, k, v, **kw)

rng = np.random.default_rng(0)
worst = 0.0
for _ in range(20):
    cuts = np.sort(rng.integers(0, Tk + 1, size=rng.integers(1, 9)))
    sizes = np.diff(np.concatenate([[0], cuts, [Tk]])).tolist()
    chunks = tae.chunk_states(q, k, v, sizes, **kw)
    for reduced in (tae.sequential_reduce(chunks), tae.tree_reduce(chunks, 2),
                    tae.tree_reduce(chunks, 3)):
        np.testing.assert_allclose(tae.finalize(reduced), full, rtol=1e-12, atol=1e-13)
print("20 random chunkings x {sequential, binary tree, ternary tree} == full attention   ✓")
print("example chunking:", sizes)

# %% [markdown]
# ## 3.6 The reduction tree
#
# With $p$ partial states, a binary tree combines pairs level by level: $\lceil\log_2 p\rceil$
# levels. Any associative operation can be reduced this way; `tree_reduce(..., op=)` takes
# one, and with a counting operation it measures the tree's depth.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 3.6))
plots.reduction_tree(axes[0], 8, 2, title="p = 8 devices, binary tree: 3 levels")
plots.reduction_tree(axes[1], 9, 3, title="p = 9 devices, ternary tree: 2 levels")
fig.tight_layout()
for p_ in (8, 9, 128, 1000):
    # Each leaf starts at depth 0; a combine sits one level above its deeper child.
    counted = tae.tree_reduce([0] * p_, 2, op=lambda x, y: max(x, y) + 1)
    assert counted == costmodel.tree_depth(p_, 2) == int(np.ceil(np.log2(p_)))
    print(f"p = {p_:>4}: binary tree depth {counted}")

# %% [markdown]
# *Figure: leaves are devices (or chunks) holding partial states; each blue node is one
# `combine`. Every level runs in parallel, so depth, not node count, is the time.*
#
# ## 3.7 Counting steps: O(N/p + log p) against O(N)
#
# Reducing $N$ keys on one worker takes $N - 1$ sequential combines. On $p$ workers each
# reduces $N/p$ keys ($N/p - 1$ steps) and the $p$ states meet in $\lceil\log_2 p\rceil$
# levels (`costmodel.reduction_steps`).

# %%
N = 2**20
ps = 2 ** np.arange(0, 21)
steps = [costmodel.reduction_steps(N, int(p_)) for p_ in ps]
assert steps[0] == N - 1 and steps[-1] == 20  # p = N: only the log N tree remains
speedup = [steps[0] / s_ for s_ in steps]
print(f"N = {N}: p = 8 takes {steps[3]:,} steps ({speedup[3]:.2f}x), p = 1024 takes "
      f"{steps[10]:,} ({speedup[10]:.0f}x), p = N takes {steps[-1]}")

ax = plots.scaling(ps, {"tree: N/p - 1 + ceil(log2 p)": steps,
                        "serial: N - 1": [N - 1] * len(ps), "ideal: N/p": N / ps},
                   xlabel="workers p", ylabel="sequential steps",
                   title="Reducing N = 2^20 elements", styles={"ideal: N/p": "k:",
                                                               "serial: N - 1": "r--"})

# %% [markdown]
# *Figure: sequential steps against the number of workers (log–log). The tree follows the
# ideal $N/p$ until $p$ approaches $N$, where the $\log p$ term takes over.*
#
# ## Summary
#
# * log-sum-exp is shift invariant (the safe max) and decomposes over chunks.
# * The states $(o, \ell)$ with `combine` form a commutative monoid with an exact identity,
#   the empty chunk; the package's float64 `combine` obeys the laws on adversarial inputs.
# * Chunked attention is exact for any chunking and tree shape; chunks only need their
#   global key positions.
# * Reduction over $p$ workers takes $O(N/p + \log p)$ steps. Notebook 4 puts the chunks on
#   devices and replaces the tree by Allreduce.
#
# ## Exercises
#
# 1. `max` is associative too. Use `tree_reduce(..., op=max)` on a list of numbers and check
#    it against `max`.
# 2. Is `combine` still associative if you drop the safe-max shift? Find inputs where the
#    unshifted formula returns NaN in float64.
# 3. For $N = 10^6$, what is the fewest `reduction_steps`, and which $p$ reach it?

# %%
# Answer 1
xs = list(rng.normal(size=37))
assert tae.tree_reduce(xs, 2, op=max) == max(xs) == tae.tree_reduce(xs, 5, op=max)

# Answer 2: exp(1000) overflows, giving inf/inf = NaN without the shift.
with np.errstate(over="ignore", invalid="ignore"):
    la, lb = 1000.0, 1000.0
    naive = (np.exp(la) * 1.0 + np.exp(lb) * 2.0) / (np.exp(la) + np.exp(lb))
assert np.isnan(naive)
safe = tae.combine(tae.AttentionState(jnp.ones((1, 1, 1, 1)), jnp.full((1, 1, 1), la)),
                   tae.AttentionState(2 * jnp.ones((1, 1, 1, 1)), jnp.full((1, 1, 1), lb)))
assert float(safe.out.ravel()[0]) == 1.5

# Answer 3: 20 steps. p = N leaves only the tree (ceil(log2 1e6) = 20 levels); p = N/2 ties
# (1 local step + 19 levels). No p does better.
steps_by_p = {p_: costmodel.reduction_steps(10**6, p_)
              for p_ in [1, 2, 10, 1000, 250_000, 500_000, 999_999, 10**6]}
assert min(steps_by_p.values()) == steps_by_p[10**6] == steps_by_p[500_000] == 20
print(steps_by_p)
