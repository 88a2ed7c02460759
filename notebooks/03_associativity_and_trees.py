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
# **Prerequisites.** Notebook 1 (the energy $F$ and its log-sum-exp). What a floating-point
# number is: a sign, an exponent and a fixed number of significant bits. Reading a proof of
# associativity, $(a\circ b)\circ c = a\circ(b\circ c)$.
#
# **Time.** About 40 minutes to read and run.
#
# **Learning objectives.** After this notebook you can
#
# * use the shift invariance that makes log-sum-exp numerically safe;
# * show that log-sum-exp over a union of chunks is the log-sum-exp of the chunks'
#   log-sum-exps;
# * define the partial state $(\text{out}, \text{lse})$ and its `combine`, and prove that they
#   form a commutative monoid (in sympy, and on random and adversarial inputs);
# * say where floating point stops a merge from being exact, compute the float32 thresholds,
#   and explain how the package's double-word lse removes them;
# * check that chunked attention equals full attention for every chunking and tree shape;
# * count the sequential steps of a tree reduction.
#
# **Where it runs.** The first cell asks JAX for 8 simulated CPU devices and pins JAX to the
# CPU, so the notebook runs on those CPU devices even on a GPU runtime; a GPU, if present, is
# not used. Everything here runs on one device; notebook 4 puts the chunks on devices.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from IPython.display import Markdown

from tree_attention_edu import plots
from tree_attention_edu.perf import costmodel
from tree_attention_edu.theory import symbolic

jax.config.update("jax_enable_x64", True)  # float64 for the laws; section 4 uses float32
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
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A log-sum-exp can be shifted by any constant, and split over chunks: one number per
# chunk is enough to finish the reduction.</p></div>
#
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
# by 0 when both are $-\infty$, and when one side is empty it returns the other side as it
# is, so the identity is *exact* and empty states never create a NaN.
#
# The package's `AttentionState` has a third field, `lse_lo`, the rounding error of the
# stored lse (0 in exact arithmetic). The fourth section of this notebook shows why it is
# there.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A chunk's state is (normalised output, log-sum-exp). <code>combine</code> is associative
# and commutative, with the empty chunk as its identity: a commutative monoid.</p></div>
#
# ## 3.3 Random and adversarial trials
#
# `hypothesis` draws states, empty ones included, and checks the monoid laws on the package's
# float64 `combine` (derandomised, so this notebook's output is reproducible; the test suite,
# `tests/test_states.py`, also draws huge log-sum-exps, near the limit of float64).

# %%
# Realistic log-sum-exps and the empty state. XLA's CPU backend flushes subnormals to zero,
# so they are left out of the draws.
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
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The package's <code>combine</code> obeys the monoid laws on random states, including
# empty ones: commutativity and the identity hold bit for bit, associativity to rounding.</p></div>
#
# ## 3.4 Where floating point stops, and how the state keeps going
#
# Associativity is exact in the reals but holds only up to rounding in floats, and the
# delicate part of a state is its lse. A float32 number $\ell$ carries 24 significant bits, so
# for $2^e \le |\ell| < 2^{e+1}$ neighbouring floats are a *spacing* of $2^{e-23}$ apart (at
# most $|\ell|\cdot 2^{-23}$), and $\ell$ is stored with an error of up to half a spacing.
# Merging two equal chunks adds $\log 2$ to the lse. Where is that increment rounded to a
# whole spacing, and where is it lost altogether? The cell searches the float32 numbers for
# both thresholds (each property is false below its threshold and true above, so a bisection
# over the floats' bit patterns finds the first float where it holds).

# %%
LOG2 = np.float32(np.log(2))


def first_float32(holds, lo, hi):
    """The smallest float32 x in [lo, hi] for which `holds(x)`, for a property that is False
    below some threshold and True above it. Positive float32 numbers are ordered like their
    bit patterns read as int32, so bisect over those."""
    a, b = (int(np.array(x, np.float32).view(np.int32)) for x in (lo, hi))
    assert not holds(np.float32(lo)) and holds(np.float32(hi))
    while b - a > 1:
        mid = (a + b) // 2
        a, b = (a, mid) if holds(np.array(mid, np.int32).view(np.float32)[()]) else (mid, b)
    return np.array(b, np.int32).view(np.float32)[()]


def whole_step(x):  # the spacing above x exceeds log 2: x + log 2 lands on x or the next float
    return np.spacing(np.float32(x)) > LOG2


def lost(x):  # x + log 2 rounds back to x
    return np.float32(x) + LOG2 == np.float32(x)


rounds_from, lost_from = first_float32(whole_step, 1.0, 1e9), first_float32(lost, 1.0, 1e9)
assert (rounds_from, lost_from) == (2.0**23, 2.0**24)
samples = np.geomspace(1.0, 1e9, 2001, dtype=np.float32)  # the properties really are monotone
assert all(whole_step(x) == (x >= rounds_from) and lost(x) == (x >= lost_from) for x in samples)

print(f"{'l':>12} {'spacing':>8} {'fl(l + log 2) - l':>18}")
for e in range(20, 26):
    x = np.float32(2.0**e)
    print(f"{'2^' + str(e):>12} {np.spacing(x):>8g} {float((x + LOG2) - x):>18g}")


def tex(x):
    """`x` as LaTeX: all digits, then two significant ones times a power of 10."""
    e = int(np.floor(np.log10(x)))
    return f"{x:,.0f}".replace(",", "{,}") + f" \\approx {x / 10**e:.2g}\\cdot 10^{{{e}}}"


display(Markdown(
    f"In float32, $\\ell + \\log 2$ is rounded to a whole spacing from "
    f"$\\ell = 2^{{{int(np.log2(rounds_from))}}} = {tex(rounds_from)}$ on (the spacing is "
    f"{np.spacing(rounds_from):g} there, more than $\\log 2 \\approx {LOG2:.4f}$), and "
    f"$\\log 2$ is lost entirely from $\\ell = 2^{{{int(np.log2(lost_from))}}} = "
    f"{tex(lost_from)}$ on (spacing {np.spacing(lost_from):g}, so half a spacing exceeds "
    f"$\\log 2$)."))

# %% [markdown]
# Well before those thresholds the rounding already hurts: a chunk's weight is
# $e^{\ell}$, so an absolute error $\delta$ in $\ell$ is a relative error $e^{\delta} - 1
# \approx \delta$ in the weight, and $\delta$ grows with $|\ell|$. The package therefore
# stores the lse as a **double word**: `lse` is the rounded float32 value of $m + \log l$
# (shift plus log of the shifted sum) and `lse_lo` the rounding error of that addition,
# computed exactly with Knuth's TwoSum. A merge computes its weights from
# $(\ell_a - m) + \text{lo}_a$, so it sees the small part, $\log 2$ say, to float32's relative
# precision however large $\ell$ is.
#
# The test: three keys with equal logits $\ell$ and values 0, 1, 2, split into chunks of two
# keys and one key. The exact answer is the mean value, 1. `combine` merges the two chunk
# states; "single word" drops `lse_lo` first, `AttentionState(s.out, s.lse)`, which is what a
# state without the double word would hold.

# %%
def three_equal_keys(logit):
    q = jnp.ones((1, 1, 1, 1), jnp.float32)
    k = jnp.full((1, 3, 1, 1), logit, jnp.float32)  # every score is `logit` (scale 1)
    v = jnp.arange(3, dtype=jnp.float32).reshape(1, 3, 1, 1)
    return q, k, v


def single_word(s):
    return tae.AttentionState(s.out, s.lse)  # lse_lo dropped (defaults to 0)


print(f"{'logit':>8} {'double word':>12} {'single word':>12}   exact: 1")
for logit in (1e2, 1e4, 1e6, 1e8):
    chunks = tae.chunk_states(*three_equal_keys(logit), [2, 1], scale=1.0)
    double = float(tae.combine(*chunks).out.ravel()[0])
    single = float(tae.combine(*map(single_word, chunks)).out.ravel()[0])
    print(f"{logit:>8.0e} {double:>12.8f} {single:>12.8f}")
    np.testing.assert_allclose(double, 1.0, rtol=2 * np.finfo(np.float32).eps)

# At 1e8 in detail: the chunk of two keys has lse = 1e8 + log 2, which float32 stores as 1e8.
two_keys, one_key = tae.chunk_states(*three_equal_keys(1e8), [2, 1], scale=1.0)
assert float(two_keys.lse.ravel()[0]) == 1e8  # log 2 rounded away from the lse ...
np.testing.assert_allclose(two_keys.lse_lo, np.log(2), rtol=1e-6)  # ... and kept in lse_lo
merged = tae.combine(two_keys, one_key)
assert float(merged.out.ravel()[0]) == 1.0  # exact
np.testing.assert_allclose(float(merged.lse.ravel()[0]) - 1e8 + float(merged.lse_lo.ravel()[0]),
                           np.log(3), rtol=1e-6)  # lse = 1e8 + log 3
wrong = float(tae.combine(single_word(two_keys), one_key).out.ravel()[0])
assert wrong == 1.25  # the two-key chunk weighs like one key: (0.5 + 2) / 2
print(f"logit 1e8: double word {float(merged.out.ravel()[0])}, single word {wrong}")

# %% [markdown]
# With a single word the merge weighs the two-key chunk like a one-key chunk, and the answer
# depends on the logits' size. The same rounding breaks **associativity**: three one-key
# states with equal lse and outputs 0, 0, 1 should give 1/3 in any bracketing. With single
# words, whichever pair is merged first loses its $\log 2$:

# %%
def one(out, lse):
    return tae.AttentionState(jnp.full((1, 1, 1, 1), out, jnp.float32),
                              jnp.full((1, 1, 1), lse, jnp.float32))


def combine_single(a, b):
    return single_word(tae.combine(a, b))


a, b, c = one(0.0, 1e8), one(0.0, 1e8), one(1.0, 1e8)  # exact: 1/3
for name, op in (("double word", tae.combine), ("single word", combine_single)):
    left = float(op(op(a, b), c).out.ravel()[0])
    right = float(op(a, op(b, c)).out.ravel()[0])
    print(f"{name}: (a+b)+c -> {left:.7f},  a+(b+c) -> {right:.7f}")
assert float(tae.combine(tae.combine(a, b), c).out.ravel()[0]) == np.float32(1 / 3)
assert float(tae.combine(a, tae.combine(b, c)).out.ravel()[0]) == np.float32(1 / 3)
assert float(combine_single(combine_single(a, b), c).out.ravel()[0]) == 0.5
assert float(combine_single(a, combine_single(b, c)).out.ravel()[0]) == 0.25

# %% [markdown]
# What the double word cannot undo is the rounding of the *scores* themselves: at the test's
# largest logit a float32 score is a multiple of the spacing there (printed below), so scores
# that differ by less than half of it are the same number before any merge. That rounding
# happens on one device just the same, so it is no error of the merge.
# `scripts/extreme_logits.py` runs the equal-logits test through every decoding path (tree,
# ring, energy) on 8 devices and prints their outputs next to one-device attention.

# %%
big = np.float32(1e8)
print("float32 spacing at 1e8:", np.spacing(big), "; 1e8 + 3 == 1e8 in float32:",
      np.float32(1e8 + 3) == big)
assert np.spacing(big) == 8 and np.float32(1e8 + 3) == big

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A float32 lse rounds an increment of $\log 2$ to a whole spacing from $2^{23}$ on, and
# loses it from $2^{24}$; even below, its rounding skews the weights. Carrying the rounding
# error in <code>lse_lo</code> keeps merges exact and associative at any logit size.</p></div>
#
# ## 3.5 Chunked attention equals full attention, for any chunking
#
# `chunk_states` cuts the cache into consecutive chunks (sizes may be 0) and computes each
# chunk's state with **global** positions, so causal masks and `kv_lengths` mean the same in
# every chunk. We compare full attention with a left-to-right (ring-order) reduction and with
# binary and ternary trees, over many random chunkings. (The cache is short on purpose: run op
# by op, JAX compiles each operation once per chunk size, so a short cache bounds the number
# of compilations.)

# %%
kq, kk, kv = jax.random.split(jax.random.key(3), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 2, 3, 4, 2, 8, 5, 12
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))
kw = dict(causal=True, kv_lengths=jnp.array([12, 5]))
full = tae.attention(q, k, v, **kw)

rng = np.random.default_rng(0)
trials = 20
for _ in range(trials):
    cuts = np.sort(rng.integers(0, Tk + 1, size=rng.integers(1, 9)))
    sizes = np.diff(np.concatenate([[0], cuts, [Tk]])).tolist()
    chunks = tae.chunk_states(q, k, v, sizes, **kw)
    for reduced in (tae.sequential_reduce(chunks, op=combine), tae.tree_reduce(chunks, 2, combine),
                    tae.tree_reduce(chunks, 3, combine)):
        np.testing.assert_allclose(tae.finalize(reduced), full, rtol=1e-12, atol=1e-13)
print(f"{trials} random chunkings x {{sequential, binary, ternary tree}} == full attention ✓")
print("example chunking:", sizes)

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Any chunking, empty chunks included, and any reduction order give full attention, as long
# as each chunk knows its keys' global positions.</p></div>
#
# ## 3.6 The reduction tree
#
# With $p$ partial states, a binary tree combines pairs level by level: $\lceil\log_2 p\rceil$
# levels. Any associative operation can be reduced this way; `tree_reduce(..., op=)` takes
# one, and with a counting operation it measures the tree's depth.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw=dict(width_ratios=[8, 9]))
plots.reduction_tree(axes[0], 8, 2, title="p = 8 devices, binary tree: 3 levels")
plots.reduction_tree(axes[1], 9, 3, title="p = 9 devices, ternary tree: 2 levels")
for ax in axes:
    ax.title.set_fontsize(11)
fig.tight_layout()
for p_ in (8, 128, 1000):
    # Each leaf starts at depth 0; a combine sits one level above its deeper child.
    counted = tae.tree_reduce([0] * p_, 2, op=lambda x, y: max(x, y) + 1)
    assert counted == costmodel.tree_depth(p_, 2) == int(np.ceil(np.log2(p_)))
    print(f"p = {p_:>4}: binary tree depth {counted}")
assert costmodel.tree_depth(9, 3) == 2  # the ternary tree drawn on the right

# %% [markdown]
# *Figure: leaves are devices (or chunks) holding partial states; each blue node is one
# `combine`. Look at the height, not the width: every level runs in parallel, so the depth
# (printed above for larger $p$) is the time.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A $b$-ary tree over $p$ states has $\lceil\log_b p\rceil$ levels; the depth, not the
# number of combines, sets the time.</p></div>
#
# ## 3.7 Counting steps: O(N/p + log p) against O(N)
#
# Reducing $N$ keys on one worker takes $N - 1$ sequential combines. On $p$ workers each
# reduces $N/p$ keys ($N/p - 1$ steps) and the $p$ states meet in $\lceil\log_2 p\rceil$
# levels (`costmodel.reduction_steps`).

# %%
N = 2**20
ps = 2 ** np.arange(0, 21)
steps = np.array([costmodel.reduction_steps(N, int(p_)) for p_ in ps])
assert steps[0] == N - 1 and steps[-1] == 20  # p = N: only the log N tree remains
speedup = steps[0] / steps
print(f"N = {N:,}: p = 8 takes {steps[3]:,} steps ({speedup[3]:.2f}x), p = 1024 takes "
      f"{steps[10]:,} ({speedup[10]:.0f}x), p = N takes {steps[-1]}")
over_ideal = steps / (N / ps)
print(f"tree / ideal N/p: {over_ideal[10]:.3f} at p = 1024, {over_ideal[-1]:.0f} at p = N")
assert over_ideal[10] < 1.01 and over_ideal[-1] == 20

fig, ax = plt.subplots(figsize=(6, 4))
ax.plot(ps, steps, "o-", color=plots.TREE_COLOR, label="tree: N/p − 1 + ⌈log₂ p⌉")
ax.plot(ps, [N - 1] * len(ps), "--", color=plots.NEUTRAL_COLOR, label="serial: N − 1")
ax.plot(ps, N / ps, ":", color="black", label="ideal: N/p")
plots.pow2_axis(ax, [2**e for e in range(0, 21, 4)], "x")  # ticks 1, 16, 256, 4k, 64k, 1M
plots.pow2_axis(ax, [4**e for e in range(0, 11, 2)], "y")
ax.set_xlabel("workers p (k = 1024, M = 1024²)", fontsize=10)
ax.set_ylabel("sequential steps", fontsize=10)
ax.set_title("Reducing N = 2²⁰ elements", fontsize=11)
ax.legend(fontsize=10)
ax.grid(alpha=0.3);

# %% [markdown]
# *Figure: sequential steps against the number of workers (log–log). Follow the blue line:
# it lies on the ideal $N/p$ until $p$ approaches $N$, where the $\log p$ term takes over
# (the ratio to the ideal is printed above).*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Reduction over $p$ workers takes $N/p - 1 + \lceil\log_2 p\rceil$ steps: linear speedup
# until $p$ nears $N$, then the tree's depth is all that is left.</p></div>
#
# ## 3.8 Summary
#
# * log-sum-exp is shift invariant (the safe max) and decomposes over chunks.
# * The states $(o, \ell)$ with `combine` form a commutative monoid with an exact identity,
#   the empty chunk; the package's float64 `combine` obeys the laws on adversarial inputs.
# * In float32 an lse loses the $\log 2$ of a merge to rounding at large logits (computed
#   above); the package carries the rounding error in `lse_lo`, so merges stay exact and
#   associative.
# * Chunked attention is exact for any chunking and tree shape; chunks only need their
#   global key positions.
# * Reduction over $p$ workers takes $O(N/p + \log p)$ steps. Notebook 4 puts the chunks on
#   devices and replaces the tree by Allreduce.
#
# ## 3.9 Exercises
#
# Each answer is hidden: open "Answer" to read it, and the collapsed cell below it checks it.
#
# 1. `max` is associative too. Use `tree_reduce(..., op=max)` on a list of numbers and check
#    it against `max`.
# 2. Drop the safe-max shift from `combine`: compute $e^{\ell_a}$ and $e^{\ell_b}$ directly.
#    Is the result still associative, in exact arithmetic and in float64? Find inputs where
#    the unshifted formula returns NaN, and inputs where the two bracketings disagree.
# 3. For $N = 10^6$, what is the fewest `reduction_steps`, and which $p$ reach it?
# 4. **Predict, then measure.** Merging three equal chunks adds $\log 3$ to the lse. Before
#    running anything, predict the smallest float32 $\ell$ for which $\ell + \log 3$ rounds
#    back to $\ell$. (Hint: the spacing doubles at every power of 2, and is 1 at $2^{23}$.)
#    Then find it with `first_float32`, and check that the package's merge of three one-key
#    chunks at that logit is still exact.
#
# <details><summary>Answer 1</summary>
#
# `tree_reduce` only needs an associative operation; with `max` every tree shape returns
# the largest element.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
xs = list(rng.normal(size=37))
assert tae.tree_reduce(xs, 2, op=max) == max(xs) == tae.tree_reduce(xs, 5, op=max)
print("tree_reduce(op=max) == max for branching 2 and 5   ✓")

# %% [markdown]
# <details><summary>Answer 2</summary>
#
# **In exact arithmetic, yes**: the unshifted formula is exactly `symbolic.combine_expr`,
# which sympy proved associative in the second section. The shift changes no value.
#
# **In float64, no.** The unshifted formula is only defined while every $e^{\ell}$ stays
# within float64's range:
#
# * $\ell = 1000$: $e^{\ell}$ overflows to inf, and $\text{inf}/\text{inf}$ = NaN in *both*
#   bracketings. NaN is not a state, so the question of associativity has no answer there.
# * $\ell_a = \ell_b = -800$, $\ell_c = 0$: $e^{-800}$ underflows to 0. Merging $a$ and $b$
#   first gives $0/0$ = NaN, and $(a\circ b)\circ c$ = NaN; merging $b$ and $c$ first gives
#   a finite state, and $a\circ(b\circ c) = o_c$. The bracketing changes the answer:
#   **associativity fails**.
#
# Where all $e^{\ell}$ stay in range, the unshifted formula agrees with itself in both
# bracketings to rounding. The shifted `combine` returns $o_c$ for the second example in both
# bracketings (the true answer to within a relative $e^{-800}$).
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
def combine_unshifted(sa, sb):
    """The textbook formula without the shift: (out, lse) pairs of float64 numbers."""
    (oa, la), (ob, lb) = sa, sb
    den = np.exp(la) + np.exp(lb)
    return (np.exp(la) * oa + np.exp(lb) * ob) / den, np.log(den)


with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
    # Overflow: NaN in both bracketings.
    big_a, big_b, big_c = (1.0, 1000.0), (2.0, 1000.0), (3.0, 1000.0)
    assert np.isnan(combine_unshifted(combine_unshifted(big_a, big_b), big_c)[0])
    assert np.isnan(combine_unshifted(big_a, combine_unshifted(big_b, big_c))[0])
    # Underflow: the bracketing decides between NaN and a number.
    small_a, small_b, mid_c = (1.0, -800.0), (2.0, -800.0), (3.0, 0.0)
    left_u = combine_unshifted(combine_unshifted(small_a, small_b), mid_c)[0]
    right_u = combine_unshifted(small_a, combine_unshifted(small_b, mid_c))[0]
assert np.isnan(left_u) and right_u == 3.0
print(f"unshifted: (a+b)+c = {left_u}, a+(b+c) = {right_u}")

# In range, the unshifted formula is associative to rounding.
for la, lb, lc in np.random.default_rng(1).uniform(-30, 30, size=(100, 3)):
    sa, sb, sc = (0.5, la), (-1.0, lb), (2.0, lc)
    np.testing.assert_allclose(combine_unshifted(combine_unshifted(sa, sb), sc),
                               combine_unshifted(sa, combine_unshifted(sb, sc)), rtol=1e-12)


# The package's combine, same underflow inputs: o_c in both bracketings.
def state64(out, lse):
    return tae.AttentionState(jnp.full((1, 1, 1, 1), out), jnp.full((1, 1, 1), lse))


sa, sb, sc = state64(*small_a), state64(*small_b), state64(*mid_c)
for x in (combine(combine(sa, sb), sc), combine(sa, combine(sb, sc))):
    assert float(x.out.ravel()[0]) == 3.0
print("shifted combine: 3.0 in both bracketings   ✓")

# %% [markdown]
# <details><summary>Answer 3</summary>
#
# The fewest is $\lceil\log_2 N\rceil$ steps. With $p = N$ only the tree remains,
# $\lceil\log_2 N\rceil$ levels. With $N/2 \le p \le 2^{\lceil\log_2 N\rceil - 1}$ each
# worker holds at most two keys (1 step) and the tree has one level less: a tie, and since
# $N$ is not a power of 2, that is a whole range of $p$. Below $N/2$ some worker holds three
# keys (2 steps) while the tree is no shorter; above the range and below $N$, the tree is as
# deep as for $p = N$ plus the local step. The cell checks every $p$ from 1 to $N$ (with the
# formula vectorised, and checked against `costmodel.reduction_steps`).
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
N6 = 10**6
p_all = np.arange(1, N6 + 1)
# ceil(N/p) - 1 local steps, then ceil(log2 p) tree levels (exact: log2 of a power of 2 is)
steps_6 = -(-N6 // p_all) - 1 + np.ceil(np.log2(p_all)).astype(int)
for p_ in [*np.random.default_rng(2).integers(1, N6 + 1, 300), 1, 2, 3, 499_999, 500_000,
           524_288, 524_289, N6 - 1, N6]:
    assert steps_6[p_ - 1] == costmodel.reduction_steps(N6, int(p_)), p_
best = int(steps_6.min())
winners = p_all[steps_6 == best]
depth = int(np.ceil(np.log2(N6)))
assert best == depth and winners[-1] == N6
assert winners[:-1].tolist() == list(range(N6 // 2, 2 ** (depth - 1) + 1))
print(f"N = {N6:,}: fewest steps {best} = ceil(log2 N), reached at p = N and at every p from "
      f"{winners[0]:,} = N/2 to {winners[-2]:,} = 2^{depth - 1} ({len(winners):,} values in all)")

# %% [markdown]
# <details><summary>Answer 4</summary>
#
# $\ell + \log 3$ rounds back to $\ell$ once half the spacing exceeds $\log 3$, that is once
# the spacing is 4 or more: from $\ell = 2^{25}$ on. (With spacing 2, from $2^{24}$, the
# increment rounds up to 2 instead.) The merge stays exact there because the lost $\log 3$
# is kept in `lse_lo`.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
LOG3 = np.float32(np.log(3))
lost3_from = first_float32(lambda x: np.float32(x) + LOG3 == np.float32(x), 1.0, 1e9)
assert lost3_from == 2.0**25
q3 = jnp.ones((1, 1, 1, 1), jnp.float32)
k3 = jnp.full((1, 3, 1, 1), lost3_from, jnp.float32)
v3 = jnp.arange(3, dtype=jnp.float32).reshape(1, 3, 1, 1)
merged3 = tae.tree_reduce(tae.chunk_states(q3, k3, v3, [1, 1, 1], scale=1.0))
assert float(merged3.out.ravel()[0]) == 1.0 and float(merged3.lse.ravel()[0]) == lost3_from
np.testing.assert_allclose(merged3.lse_lo, np.log(3), rtol=1e-6)
print(f"log 3 is lost from l = {lost3_from:,.0f} = 2^25; merged out there: "
      f"{float(merged3.out.ravel()[0])} (exact), lse_lo = {float(merged3.lse_lo.ravel()[0]):.6f}")

# %% [markdown]
# ## 3.10 References
#
# Shyam et al., *Tree Attention: Topology-aware Decoding for Long-Context Attention on GPU
# clusters*, [arXiv 2408.04093](https://arxiv.org/abs/2408.04093):
#
# * section 5.1, eq. (7): the decoding energy $F_{\text{dec}}$ as a log-sum-exp, and the
#   associativity of logsumexp and max stated just after it;
# * section 5.1, Theorem 1, proved in Appendix E: a reduction with an associative operation
#   over $N$ elements on $p$ processors takes $O(N/p + \log p)$ time;
# * Appendix B: background on tree reductions ($k$-ary trees);
# * Algorithm 3: the merge of (out, lse) states with Allreduce(max) and Allreduce(sum), which
#   notebook 4 runs on devices;
# * Appendix F, eqs. (35)–(38): the max shift ("safe softmax").
#
# Floating point: IEEE 754 binary32 (float32) has a 24-bit significand (23 bits stored),
# which sets the spacings computed in the fourth section. TwoSum: D. E. Knuth, *The Art of
# Computer Programming*, vol. 2, section 4.2.2. This notebook quotes no hardware figures.
