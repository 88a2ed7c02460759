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
# # 8. Which merge, when
#
# **Prerequisites:** notebook 3 (the partial state $(o, \ell)$ and its `combine`), notebook 4
# (`shard_map`, collectives, `collective_stats`), notebook 5 (the ring) and notebook 6 (the
# alpha-beta cost model and its calibration). **Time:** about 40 minutes to read, under a
# minute to run.
#
# Tree decoding (paper, Algorithm 3) merges the devices' partial states with two Allreduces:
# a max, then a sum. Serving systems today merge the same states in other ways:
#
# * vLLM's and SGLang's **decode context parallelism** all-gather the log-sum-exps and
#   reduce-scatter the rescaled outputs over heads;
# * TensorRT-LLM's **Helix parallelism** exchanges the partial states with an all-to-all over
#   heads and merges them locally;
# * **FlashDecoding++** replaces the max by a *unified max* fixed in advance, with a
#   fallback when the guess is wrong; applied to the merge across devices, one
#   Allreduce(sum) suffices;
# * Meta's **context-parallel inference** runs a ring that passes the queries instead of K/V
#   when that moves fewer bytes.
#
# They all compute the same exact attention from the same algebra. They differ in which
# collectives carry which part of the merge, and so in bytes and in latency terms. This
# notebook derives each one, writes it by hand, checks it against the package, reads what
# its compiled program sends, and asks the cost model which one wins where.
#
# **Where this runs.** On 8 *simulated CPU devices* in one process, also on a machine with
# a GPU (the first cell tells JAX to use the CPU). Bytes are read from the compiled
# programs, so they are what a cluster would run. Timings measure this machine, where the
# 8 devices share its cores: they are noisy, their cells' outputs are not checked, and no
# conclusion below depends on them unless it is computed from them.
#
# **Learning objectives.** After this notebook you can
#
# * derive each merge pattern from $m = \max_i \ell_i$, $w_i = e^{\ell_i - m}$,
#   $o = \sum_i w_i o_i / \sum_i w_i$, and say which collective carries which part;
# * write each pattern in a few lines of `jax.shard_map` with `lax` collectives, and check
#   it against `tae.attention` and `tree_decode(merge=...)`;
# * read each pattern's collectives from the compiled program and match them, byte for byte,
#   to `costmodel.merge_collectives`;
# * explain the one-pass merge's window and fallback, and what it costs and saves;
# * say when the pass-Q ring moves fewer bytes than the pass-KV ring;
# * read the crossover map: which merge the model picks as devices and batch × heads grow.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import dataclasses
import functools

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display
from jax import lax
from jax.sharding import PartitionSpec as P

from tree_attention_edu import plots
from tree_attention_edu.core import decode, states
from tree_attention_edu.perf import benchmark, calibrate, costmodel
from tree_attention_edu.perf.introspect import structs

jax.config.update("jax_enable_x64", True)  # float64 makes "equal" mean equal to ~1e-13
assert jax.device_count() == 8, jax.devices()

# %% [markdown]
# ## 8.1 One algebra, three quantities to move
#
# Device $i$ holds the state of its shard of keys: the log-sum-exp of its scores
# $\ell_i = \log \sum_{a \in i} e^{s_a}$ and its normalised output
# $o_i = \sum_{a \in i} e^{s_a - \ell_i} v_a$. The state of all keys is
#
# $$\ell = \log \sum_i e^{\ell_i}, \qquad o = \sum_i e^{\ell_i - \ell}\, o_i
#   = \frac{\sum_i w_i\, o_i}{\sum_i w_i}, \qquad w_i = e^{\ell_i - c},$$
#
# and the last form holds for **any** shift $c$: it cancels between numerator and
# denominator. The usual choice $c = m = \max_i \ell_i$ makes every $w_i \le 1$ and one of
# them exactly 1, so nothing overflows and the sum cannot underflow to zero. A merge must
# therefore bring together three things, per query row and head:
#
# 1. the **shift** $c$, which needs every $\ell_i$ (a max over devices), unless it is fixed
#    in advance;
# 2. the **denominator** $L = \sum_i w_i$: one number per row;
# 3. the **numerator** $N = \sum_i w_i o_i$: $D_v$ numbers per row, the bulk of the bytes.
#
# | pattern | shift $c$ | denominator $L$ | numerator $N$ | collectives in sequence |
# |---|---|---|---|---|
# | `allreduce` (Algorithm 3) | Allreduce(max) of $\ell_i$ | Allreduce(sum) | same Allreduce(sum) | 2 |
# | `allgather` | all-gather of every $(o_i, \ell_i)$, then locally | locally | locally | 1 |
# | `reduce_scatter` (DCP) | all-gather of the $\ell_i$ only | computed locally from them | reduce-scatter over heads of $\frac{w_i}{L} o_i$ | 2 |
# | `all_to_all` (Helix) | all-to-all over heads: device $j$ receives every $(o_i, \ell_i)$ of its own heads, then locally | locally | locally | 1 |
# | `one_pass` (unified max) | fixed in advance: none | Allreduce(sum) | same Allreduce(sum), plus a flag | 1 (+ 2 in the fallback) |
#
# Before any collective, here is the algebra on its own. Each of the 8 devices computes the
# state of its shard with `tae.local_state` inside `shard_map` (notebook 4), and the 8
# states are stacked and brought to the host, where we merge them with three different
# shifts: all equal attention. Then two shifts that are far from the $\ell_i$: the weights
# overflow or underflow, and the merge breaks. That window is what the one-pass merge must
# respect.

# %%
p = 8
kq, kk, kv = jax.random.split(jax.random.key(8), 3)
B, Tq, Hq, Hkv, D, Tk = 2, 1, 16, 4, 16, 1024  # grouped-query attention: 4 queries per kv head
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, D))
want = tae.attention(q, k, v)  # float64, on one device

mesh = tae.make_mesh(p, "x")
t = Tk // p  # keys per device
kv_spec = P(None, "x")  # K/V split along the sequence: device i holds keys i·t to (i+1)·t - 1


@functools.partial(jax.jit, static_argnames="scale")
def shard_states(q, k, v, scale=None):
    """Every device's state of its own shard, stacked on a leading axis: out, lse."""
    def body(q, k, v):
        s = tae.local_state(q, k, v, kv_offset=lax.axis_index("x") * t, scale=scale)
        return s.out[None], s.lse[None]

    return jax.shard_map(body, mesh=mesh, in_specs=(P(), kv_spec, kv_spec),
                         out_specs=P("x"))(q, k, v)


outs, lses = (np.asarray(x) for x in shard_states(q, k, v))  # [p, B, Tq, Hq, Dv], [p, B, Tq, Hq]


def merge_with_shift(outs, lses, c):
    w = np.exp(lses - c)  # [p, B, Tq, Hq]
    return (w[..., None] * outs).sum(0) / w.sum(0)[..., None]


for name, c in (("max_i lse_i", lses.max(0)), ("0", 0.0), ("5", 5.0)):
    np.testing.assert_allclose(merge_with_shift(outs, lses, c), want, rtol=1e-12, atol=1e-13)
    print(f"shift c = {name:<12} merged == attention   ✓")
print(f"the lse_i lie in [{lses.min():.2f}, {lses.max():.2f}]")
with np.errstate(over="ignore", under="ignore", invalid="ignore"):
    for c in (lses.min() - 800, lses.max() + 800):
        bad = merge_with_shift(outs, lses, c)
        assert not np.isfinite(bad).all()
        print(f"shift c = {c:8.1f}: largest weight e^(lse - c) = {np.exp(lses - c).max():.3g}, "
              f"finite outputs: {np.isfinite(bad).mean():.0%}")

# %% [markdown]
# Any shift works in exact arithmetic; in floating point, only shifts close enough to the
# $\ell_i$ that every $e^{\ell_i - c}$ is a normal number and their sum does not overflow.
# $c = \max_i \ell_i$ is always such a shift, at the price of a collective to find it.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Every merge pattern computes (N / L) with some shift c. They differ in which collective
# finds c, which carries L and N, and which device ends up holding which heads.</p></div>
#
# ## 8.2 Five merges by hand, on 8 devices
#
# Each device computes its shard's state with `tae.local_state`, at the global position of
# its first key. The functions below run inside `jax.shard_map`: `q` replicated, `k` and `v`
# this device's shard. For brevity they carry only `(out, lse)`; the package also carries
# the lse's rounding error `lse_lo` (notebook 3) and handles empty shards, padding and head
# counts that $p$ does not divide.

# %%
def local(q, k, v):
    """This device's state: out [B, Tq, Hq, Dv] and lse [B, Tq, Hq]."""
    s = tae.local_state(q, k, v, kv_offset=lax.axis_index("x") * t)
    return s.out, s.lse


def merge_stacked(outs, lses):
    """The merge of p states stacked on axis 0, all three quantities computed locally."""
    m = lses.max(0)
    w = jnp.exp(lses - m)
    return (w[..., None] * outs).sum(0) / w.sum(0)[..., None]


def on_mesh(body, heads_scattered=False, check_vma=True):
    out_spec = P(None, None, "x", None) if heads_scattered else P()
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), kv_spec, kv_spec),
                                 out_specs=out_spec, check_vma=check_vma))


by_hand = {}

# %% [markdown]
# ### 8.2.1 `allreduce`: the paper's Algorithm 3
#
# The recap from notebook 4: Allreduce(max) finds the shift, one Allreduce(sum) carries the
# numerator and the denominator together. Every device ends with every head's output.

# %%
def merge_allreduce(out, lse):
    m = lax.pmax(lse, "x")  # collective 1: the shift
    w = jnp.exp(lse - m)
    num, den = lax.psum((w[..., None] * out, w), "x")  # collective 2: N and L
    return num / den[..., None]


by_hand["allreduce"] = on_mesh(lambda q, k, v: merge_allreduce(*local(q, k, v)))
np.testing.assert_allclose(by_hand["allreduce"](q, k, v), want, rtol=1e-12, atol=1e-13)
print("allreduce by hand == attention   ✓")

# %% [markdown]
# ### 8.2.2 `allgather`: everything to everyone, then merge locally
#
# One all-gather brings every device's $(o_i, \ell_i)$ to every device, which then computes
# the shift, the weights and both sums itself. One collective instead of two, but each
# device receives $p$ states instead of one: it pays when the latency of a collective
# matters more than its bytes.

# %%
def merge_allgather(out, lse):
    outs, lses = lax.all_gather((out, lse), "x")  # [p, ...] on every device: one collective
    return merge_stacked(outs, lses)


# The gathered result is the same on every device, but JAX types an all-gather's output as
# varying over "x", so the replicated out_spec is declared unchecked.
by_hand["allgather"] = on_mesh(lambda q, k, v: merge_allgather(*local(q, k, v)),
                               check_vma=False)
np.testing.assert_allclose(by_hand["allgather"](q, k, v), want, rtol=1e-12, atol=1e-13)
print("allgather by hand == attention   ✓")

# %% [markdown]
# ### 8.2.3 `reduce_scatter`: decode context parallelism (vLLM, SGLang)
#
# Only the small part travels to everyone: an all-gather of the $\ell_i$ (one number per row
# and head, not $D_v$). From them every device computes $m$ and $L$ itself, and scales its own
# output by its share $w_i / L$. The numerator is then a plain sum over devices, and a
# **reduce-scatter** over the head axis does it: each device receives the sum for its own
# slice of heads only. That is the layout a head-parallel output projection wants next.

# %%
def merge_reduce_scatter(out, lse):
    lses = lax.all_gather(lse, "x")  # collective 1: [p, B, Tq, Hq], small
    m = lses.max(0)
    L = jnp.exp(lses - m).sum(0)
    share = jnp.exp(lse - m) / L  # this device's weight in the union
    # collective 2: sum over devices, each device keeping Hq / p heads
    return lax.psum_scatter(share[..., None] * out, "x", scatter_dimension=2, tiled=True)


by_hand["reduce_scatter"] = on_mesh(lambda q, k, v: merge_reduce_scatter(*local(q, k, v)),
                                    heads_scattered=True)
np.testing.assert_allclose(by_hand["reduce_scatter"](q, k, v), want, rtol=1e-12, atol=1e-13)
print("reduce_scatter by hand == attention   ✓")

# %% [markdown]
# ### 8.2.4 `all_to_all`: Helix
#
# Each device cuts its state into $p$ slices of heads and sends slice $j$ to device $j$; one
# all-to-all does all these exchanges at once. Device $j$ then holds all $p$ partial states
# of its own heads and merges them locally, as the all-gather pattern does, but on
# $1/p$ of the heads: it receives no more bytes than it sends.

# %%
def merge_all_to_all(out, lse):
    Bq, Tqq, H, Dv = out.shape
    packed = jnp.concatenate([out, lse[..., None]], axis=-1)  # [B, Tq, Hq, Dv + 1]
    packed = jnp.moveaxis(packed.reshape(Bq, Tqq, p, H // p, Dv + 1), 2, 0)  # [p (to), ...]
    received = lax.all_to_all(packed, "x", 0, 0, tiled=True)  # [p (from), B, Tq, Hq/p, Dv+1]
    return merge_stacked(received[..., :-1], received[..., -1])


by_hand["all_to_all"] = on_mesh(lambda q, k, v: merge_all_to_all(*local(q, k, v)),
                                heads_scattered=True)
np.testing.assert_allclose(by_hand["all_to_all"](q, k, v), want, rtol=1e-12, atol=1e-13)
print("all_to_all by hand == attention   ✓")

# %% [markdown]
# ### 8.2.5 `one_pass`: a unified max, and a fallback
#
# FlashDecoding++ fixes the shift in advance (here $c = 0$) for every device. Then there is
# no max to find: one Allreduce(sum) of $(N, L)$ finishes the merge. It is exact only while
# every $e^{\ell_i - c}$ stays in the window where it is a normal number and $p$ of them sum
# without overflow (`states.one_pass_window`). So each device also sends a **flag**, 1 if
# any of its $\ell_i$ lies outside, in the same Allreduce; if the flags sum to more than 0,
# every device runs the exact two-collective merge instead. All devices see the same sum,
# so they all take the same branch.

# %%
SHIFT = 0.0


def merge_one_pass(out, lse):
    low, high = states.one_pass_window(out.dtype, p)
    x = lse - SHIFT
    flag = jnp.any((x < low) | (x > high)).astype(out.dtype)
    w = jnp.exp(x)
    num, den, flag = lax.psum((w[..., None] * out, w, flag), "x")  # one collective
    return lax.cond(flag > 0,
                    lambda: merge_allreduce(out, lse),  # the exact fallback
                    lambda: num / den[..., None])


by_hand["one_pass"] = on_mesh(lambda q, k, v: merge_one_pass(*local(q, k, v)))
np.testing.assert_allclose(by_hand["one_pass"](q, k, v), want, rtol=1e-12, atol=1e-13)
print("one_pass by hand == attention   ✓")

# %% [markdown]
# ### 8.2.6 The package: `tree_decode(merge=...)`
#
# The same five patterns are `tree_decode`'s `merge=` options (`decode.MERGES`). The cell
# checks each against its hand-written twin, and prints where the output lives: the
# head-scattered patterns leave each device with its own heads (a result sharded over
# heads), the others with all of them.

# %%
assert tuple(by_hand) == decode.MERGES
for name, fn in by_hand.items():
    mine = fn(q, k, v)
    pkg = tae.tree_decode(q, k, v, mesh=mesh, merge=name)
    np.testing.assert_allclose(pkg, mine, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(pkg, want, rtol=1e-12, atol=1e-13)
    heads = sorted({(s.index[2].start or 0, s.index[2].stop or Hq) for s in pkg.addressable_shards})
    where = ("every device holds all heads" if heads == [(0, Hq)] else
             f"each device holds {heads[0][1] - heads[0][0]} heads "
             f"({heads[0][0]}:{heads[0][1]}, {heads[1][0]}:{heads[1][1]}, ...)")
    print(f"{name:<15} by hand == tree_decode == attention   ✓   {where}")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Each pattern is a few lines of collectives around the same merge. Two of them leave the
# output scattered over heads, which is what a head-parallel layer wants next.</p></div>
#
# ## 8.3 What each compiled program moves
#
# Now the paper's microbenchmark heads (16 heads of dimension 128, float32), with a batch of
# 4 and 64k keys, compiled from abstract inputs (`introspect.structs`: nothing is allocated).
# `collective_stats` reads the collectives XLA will run, and each pattern's bytes per device
# must equal `costmodel.merge_collectives` exactly. As in notebook 4, bytes are each
# collective's payload: what a device contributes, or for an all-gather what it receives.
# The one-pass merge's fallback sits in a conditional, marked `(if)`: it runs only when the
# flag is raised, so the comparison is on the fast path (`.fast_path()`).

# %%
MB = dict(batch=4, q_heads=16, head_dim=128)  # microbenchmark heads, batch 4, float32
abstract = structs(mesh, 65536, **MB)
sizes = dict(batch=MB["batch"], q_len=1, q_heads=MB["q_heads"], v_dim=MB["head_dim"], p=p,
             stat_itemsize=4, out_itemsize=4)
compiled = {}
for name in decode.MERGES:
    stats = tae.collective_stats(
        lambda q, k, v, name=name: tae.tree_decode(q, k, v, mesh=mesh, merge=name), *abstract)
    model = costmodel.merge_collectives(name, **sizes)
    fast = stats.fast_path()
    assert fast.total_bytes == costmodel.collective_bytes(model), name  # exact
    assert sorted(c.kind for c in fast.collectives for _ in range(c.count)) == sorted(
        kind for kind, _, n in model for _ in range(n)), name
    compiled[name] = stats
    print(f"--- {name}\n{stats}\n")

# %%
rows = MB["batch"] * MB["q_heads"]  # B·Tq·Hq query rows
base = compiled["allreduce"].total_bytes
print(f"{'pattern':<15}{'collectives (fast path)':<34}{'bytes/device':>13}{'vs allreduce':>14}")
for name, stats in compiled.items():
    fast = stats.fast_path()
    kinds = " + ".join(f"{c.kind}" + (f" x{c.count}" if c.count > 1 else "")
                       for c in fast.collectives)
    print(f"{name:<15}{kinds:<34}{fast.total_bytes:>13,}{fast.total_bytes / base:>13.2f}x")
assert compiled["allgather"].total_bytes > 7 * base  # p states gathered: about p times
assert len(compiled["allgather"].collectives) == len(compiled["all_to_all"].collectives) == 1
print(f"\n{rows} query rows of Dv = {MB['head_dim']}: allgather receives "
      f"{compiled['allgather'].total_bytes / base:.2f}x the bytes of allreduce in one collective")

# %% [markdown]
# Three facts to read from the table:
#
# * `allgather` and `all_to_all` need **one** collective, `allreduce` and `reduce_scatter` two,
#   one after the other: the second depends on the first's result. On a fast network, the
#   number of collectives in sequence is the number of latency terms $\alpha$ to pay.
# * `allgather` buys its single collective with $p$ times the payload; `all_to_all` moves
#   about what `allreduce` moves, and its output is scattered over heads.
# * `one_pass` sends the `allreduce` sum plus one flag per device (4 bytes) in its single
#   collective, and carries the exact merge in its program, behind a branch.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The compiled programs confirm the derivation: every pattern moves exactly the bytes the
# cost model counts, and they trade the number of collectives in sequence against bytes.</p></div>
#
# ## 8.4 The one-pass merge: its window and its fallback
#
# The window depends on the dtype and on $p$: the weights must stay above the smallest
# normal number, and $p$ of them must sum below the largest. The sums the fast path sends
# are then exact to rounding.

# %%
for dtype in (jnp.float32, jnp.float64):
    low, high = states.one_pass_window(dtype, p)
    print(f"{jnp.dtype(dtype).name}: lse - shift must lie in [{low:.2f}, {high:.2f}] on {p} devices")

# %% [markdown]
# With the shift fixed at 0, the question is whether the devices' $\ell_i$ fall inside. They
# grow with the logits: here the same data in float32, at the default scale
# $1/\sqrt{D}$ and at larger `scale=`, which multiplies the logits as huge activations would.
# Where any state leaves the window, the flag goes up on its device, every device falls
# back, and the result is the `allreduce` merge **bit for bit**.

# %%
q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
low32, high32 = states.one_pass_window(jnp.float32, p)
print(f"{'scale':>8}{'lse range':>20}{'states outside':>16}{'devices flagged':>17}"
      f"{'== allreduce bitwise':>22}{'max err':>10}")
for scale in (None, 5.0, 1e3):
    lse = np.asarray(shard_states(q32, k32, v32, scale=scale)[1])
    outside = (lse < low32) | (lse > high32)  # [p, B, Tq, Hq]
    one = tae.tree_decode(q32, k32, v32, mesh=mesh, merge="one_pass", scale=scale)
    two = tae.tree_decode(q32, k32, v32, mesh=mesh, merge="allreduce", scale=scale)
    err = np.abs(np.asarray(one, np.float64) - tae.attention(q, k, v, scale=scale)).max()
    assert err < 1e-5  # float32 accuracy, fallback or not
    if outside.any():  # the flag is raised: the exact merge ran, bit for bit
        np.testing.assert_array_equal(one, two)
    label = "default" if scale is None else f"{scale:g}"
    print(f"{label:>8}{f'[{lse.min():.1f}, {lse.max():.1f}]':>20}"
          f"{f'{outside.sum()}/{outside.size}':>16}{f'{outside.any(axis=(1, 2, 3)).sum()}/{p}':>17}"
          f"{np.array_equal(one, two)!s:>22}{err:>10.1e}")

# %% [markdown]
# Inside the window the fast path's result differs from `allreduce` in its last bits (other
# weights, other roundings) and is as accurate, to float32 rounding; past it, a few states
# on a few devices are enough for all of them to fall back.
#
# **What it saves, what it adds.** On a network, the fast path saves the Allreduce(max): one
# collective latency $\alpha$ per merge (per level of the mesh). It adds a flag, one number
# per device, to the sum, which costs nothing, and a **conditional** whose predicate is the
# sum's result: nothing after it can start before the flag has arrived, and when the flag
# is up the step pays for three collectives instead of two. So it pays only if the fallback
# is rare. On DGX H100 the cost model gives the break-even fallback rate $f^*$: with $t_1$
# the fast path, $t_2$ the `allreduce` merge and $t_3 = t_1 + t_2$ the fallback, one-pass is
# faster on average while $f < f^* = (t_2 - t_1) / (t_3 - t_1)$.

# %%
def break_even(p_devices, batch_heads, heads=16):
    topo = costmodel.DGX_H100.with_devices(p_devices)
    kw = dict(batch=batch_heads // heads, q_heads=heads)
    t1, t2, t3 = (costmodel.predict_merge(m, 2**20, topo, fallback=fb, **kw).comm_s
                  for m, fb in (("one_pass", False), ("allreduce", False), ("one_pass", True)))
    return t1, t2, (t2 - t1) / (t3 - t1)


for p_devices, bh in ((8, 16), (128, 16), (8, 65536), (128, 65536)):
    t1, t2, f = break_even(p_devices, bh)
    assert t1 < t2 and 0 < f < 1
    print(f"DGX H100, p = {p_devices:>3}, batch x heads = {bh:>6,}: merge {t1 * 1e6:7.1f} us "
          f"(one_pass) vs {t2 * 1e6:7.1f} us (allreduce); pays while fallback rate < {f:.0%}")

# %% [markdown]
# Where latency dominates (few rows), skipping the max nearly halves the merge, and the
# fallback may run often before one-pass loses. Where bytes dominate, the max's payload is
# small next to the sum's, and the saving is a sliver that a rare fallback eats.
#
# And on this machine? The next cell times both merges of the package on the float32 data
# above (default scale, so the fast path runs), in five interleaved rounds so that a
# background load hits both alike. Its output is not checked; the sentence below it is
# computed from the measurement.

# %%
# NBVAL_IGNORE_OUTPUT
timed = {m: jax.jit(lambda q, k, v, m=m: tae.tree_decode(q, k, v, mesh=mesh, merge=m))
         for m in ("allreduce", "one_pass")}
ratios = []
for _ in range(5):
    sec = {m: benchmark.median_time(f, q32, k32, v32, repeats=15) for m, f in timed.items()}
    ratios.append(sec["one_pass"] / sec["allreduce"])
lo, hi, mid = min(ratios), max(ratios), float(np.median(ratios))
verdict = ("one_pass was faster in every round: here the saved collective paid for the flag "
           "and the branch" if hi < 1 else
           "one_pass was slower in every round: here the branch cost more than the saved "
           "collective" if lo > 1 else
           "neither was faster in every round: on this machine the saved collective is "
           "smaller than the noise")
display(Markdown(f"one_pass / allreduce time over 5 rounds: median {mid:.2f}, range "
                 f"{lo:.2f} to {hi:.2f}. So {verdict}."))

# %% [markdown]
# On simulated devices a collective is a copy between buffers in one process, and each call
# pays a dispatch overhead far larger than a collective's latency, so a single saved
# collective is hard to see. On a GPU cluster the saving is one network latency per merge,
# which the cost model above prices with published figures. That is also why
# `merge="auto"` leaves `one_pass` out (`decode.AUTO_MERGES`): its cost depends on the data.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A shift fixed in advance removes the max collective; a flag in the same Allreduce keeps
# the merge exact, by falling back to the two-collective merge, bit for bit, whenever the
# guess was wrong. It pays when latency dominates and the fallback is rare.</p></div>
#
# ## 8.5 Two rings: pass-KV against pass-Q
#
# The merge patterns all start from a state per device. A ring can instead move the inputs.
# Ring Attention (notebook 5) passes the **K/V blocks**: each device sends
# $(p-1)$ blocks of $\frac{T_k}{p} H_{kv} (D + D_v)$ numbers. Meta's context-parallel
# inference may pass the **queries** instead (`ring_decode_pass_q`): the queries are cut into
# $p$ blocks by kv head, each block visits every device, and each device keeps the partial
# state it computed for every block; one all-to-all sends the partial states home, where they
# are merged, and one all-gather shares the outputs. Its bytes grow with $T_q H_q$, the pass-KV
# ring's with $T_k H_{kv}$.
#
# The pass-Q ring is exact (the pass-KV ring was checked in notebook 5). Then both rings'
# compiled bytes at a grouped-query shape like Llama 3's (32 query heads, 8 kv heads of
# dimension 128), for a single decoded token and for a long chunk of queries.

# %%
np.testing.assert_allclose(tae.ring_decode_pass_q(q, k, v, mesh=mesh), want, rtol=1e-12, atol=1e-13)
print("ring_decode_pass_q == attention   ✓  (ring_decode: notebook 5)")

GQA = dict(q_heads=32, kv_heads=8, head_dim=128)
TK_RING = 65536
ring_model = dict(batch=1, kv_heads=GQA["kv_heads"], head_dim=GQA["head_dim"],
                  v_dim=GQA["head_dim"], p=p, itemsize=4)


def pass_kv_bytes(tk):
    return costmodel.collective_bytes(costmodel.ring_collectives(**ring_model, kv_len=tk))


def pass_q_bytes(tq):
    return costmodel.collective_bytes(costmodel.pass_q_collectives(
        **ring_model, q_len=tq, q_heads=GQA["q_heads"], stat_itemsize=4))


measured_ring = {}
# The pass-KV ring's bytes do not depend on Tq: compiled once; the pass-Q ring at both.
for fn, tq, predicted in ((tae.ring_decode, 1, pass_kv_bytes(TK_RING)),
                          (tae.ring_decode_pass_q, 1, pass_q_bytes(1)),
                          (tae.ring_decode_pass_q, 2048, pass_q_bytes(2048))):
    abstract_gqa = structs(mesh, TK_RING, q_len=tq, **GQA)
    stats = tae.collective_stats(lambda q, k, v, fn=fn: fn(q, k, v, mesh=mesh), *abstract_gqa)
    assert stats.total_bytes == predicted, (fn.__name__, tq)  # exact
    measured_ring[(fn.__name__, tq)] = stats.total_bytes
    print(f"Tq = {tq:>5}, Tk = {TK_RING:,}: {fn.__name__:<19} {stats.total_bytes:>13,} B per device")

# %% [markdown]
# Both rings' compiled bytes equal the cost model's formulas. Since the formulas are exact,
# they can sweep $T_q$ for us: the pass-Q ring's bytes grow linearly in $T_q$, the pass-KV
# ring's do not depend on it, and the two cross at one chunk length.

# %%
tqs = [2**n for n in range(0, 17)]
per_query = pass_q_bytes(2) - pass_q_bytes(1)  # bytes per query token: linear in Tq
assert all(pass_q_bytes(tq) == tq * per_query for tq in tqs)
tq_star = pass_kv_bytes(TK_RING) / per_query  # where the two rings move equal bytes
assert pass_q_bytes(int(tq_star)) < pass_kv_bytes(TK_RING) < pass_q_bytes(int(tq_star) + 1)
rule = (TK_RING * GQA["kv_heads"]) / (tq_star * GQA["q_heads"])  # Tk·Hkv / (Tq·Hq) at the crossover

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(tqs, [pass_kv_bytes(TK_RING)] * len(tqs), "-", color=plots.PATTERN_COLORS["ring"],
        label="pass-KV ring (ring_decode)")
ax.plot(tqs, [pass_q_bytes(tq) for tq in tqs], "-", color=plots.PATTERN_COLORS["ring_pass_q"],
        label="pass-Q ring (ring_decode_pass_q)")
for (name, tq), nbytes in measured_ring.items():
    key = "ring" if name == "ring_decode" else "ring_pass_q"
    ax.plot(tq, nbytes, "o", color=plots.PATTERN_COLORS[key])
ax.axvline(tq_star, color=plots.NEUTRAL_COLOR, ls=":", label=f"crossover, Tq = {tq_star:,.0f}")
plots.pow2_axis(ax, tqs[::2])
plots.bytes_axis(ax)
ax.set_xlabel("query tokens $T_q$ per step")
ax.set_ylabel("bytes per device")
ax.set_title(f"Ring bytes per device, Tk = {TK_RING:,}, 32 q / 8 kv heads, p = {p}")
ax.legend(fontsize=9)
ax.grid(alpha=0.3)
plt.show()
print(f"pass-Q moves fewer bytes than pass-KV for Tq < {tq_star:,.0f} at Tk = {TK_RING:,} "
      f"(Tq/Tk < {tq_star / TK_RING:.3f}); at the crossover Tk·Hkv / (Tq·Hq) = {rule:.2f}")

# %% [markdown]
# *Figure: bytes per device for one step of each ring, dots read from the compiled programs,
# lines from the cost model's formulas. The pass-KV ring (red) sends the whole cache around
# whatever the number of queries; the pass-Q ring (pink) sends queries out and partial states
# back, so it is far cheaper for decoding and for short chunks, and loses only when the
# chunk of queries approaches the cache in size.*
#
# The rule of thumb "pass-Q when $T_q H_q \ll T_k H_{kv}$" has a constant in it, printed
# above: a query block travels $p-1$ hops like a K/V block, but its partial states also
# travel home and its outputs are shared, about three $D$-sized vectors per query row and
# head against two ($K$ and $V$) per key and kv head. For decoding, though, neither ring is
# the right tool: the tree merges of §8.2 move one state per row, with no loop of $p-1$
# sequential transfers.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Pass-KV moves the cache, pass-Q moves the queries and their partial states: pass-Q is
# cheaper until the chunk of queries nears the cache (with the constant computed above).</p></div>
#
# ## 8.6 Predicted against measured, on this machine
#
# Notebook 6 calibrated the alpha-beta model on this machine's simulated devices. Here the
# same calibration covers every collective the patterns use (`measure_topology` with every
# kind of `calibrate.COLLECTIVE_FNS`, each timed at message sizes spanning the patterns'
# and the ring's own messages), and `calibrate.validate_patterns` then times every pattern
# and both rings at one cache length that the calibration did not use. It is kept short:
# one length, few repeats, and a small problem. The simulated devices share this machine's
# cores and memory with everything else running on it, so expect errors beyond the ±35%
# the calibration aims at on a quiet machine; only a robust fact is asserted (the pass-KV
# ring, which copies the cache around, is the slowest).

# %%
# NBVAL_IGNORE_OUTPUT
PROB = benchmark.Problem(seq_len=8192, q_heads=8, kv_heads=8, head_dim=64)
shape8 = dict(batch=1, q_len=1, q_heads=PROB.q_heads, v_dim=PROB.head_dim, p=p, stat_itemsize=4)
messages = [b for m in costmodel.MERGES
            for _, b, _ in costmodel.merge_collectives(m, **shape8, out_itemsize=4)]
messages += [b for _, b, _ in costmodel.ring_collectives(
    batch=1, kv_len=PROB.seq_len, kv_heads=PROB.kv_heads, head_dim=PROB.head_dim,
    v_dim=PROB.head_dim, p=p)]
cal = calibrate.measure_topology(
    mesh, kernel_problem=benchmark.Problem(seq_len=6144, q_heads=8, kv_heads=8, head_dim=64),
    sizes=calibrate.message_sizes(messages, points=2), repeats=3,
    kinds=tuple(calibrate.COLLECTIVE_FNS))
cal, rows = calibrate.validate_patterns(mesh, seq_lens=(PROB.seq_len,), problem=PROB,
                                        calibration=cal, repeats=3)
print(calibrate.patterns_table(cal, rows))
by_name = {r["name"]: r for r in rows}
assert max(by_name, key=lambda n: by_name[n]["median_s"]) == "ring"  # robust: it moves the cache
assert max(by_name, key=lambda n: by_name[n]["predicted_s"]) == "ring"
worst = max(rows, key=lambda r: abs(r["rel_err"]))
display(Markdown(
    f"Worst error: {worst['rel_err']:+.0%} ({worst['name']}); "
    f"{sum(abs(r['rel_err']) <= 0.35 for r in rows)} of {len(rows)} predictions within ±35%. "
    f"The pass-KV ring took {by_name['ring']['median_s'] / by_name['allreduce']['median_s']:.0f}× "
    f"the allreduce merge's time (predicted "
    f"{by_name['ring']['predicted_s'] / by_name['allreduce']['predicted_s']:.0f}×)."))

# %%
names = [r["name"] for r in rows]
fig, ax = plt.subplots(figsize=(8, 3.6))
xs = np.arange(len(names))
ax.bar(xs - 0.2, [r["predicted_s"] * 1e3 for r in rows], 0.4, color=plots.NEUTRAL_COLOR,
       alpha=0.45, label="predicted (calibrated model)")
ax.bar(xs + 0.2, [r["median_s"] * 1e3 for r in rows], 0.4,
       color=[plots.PATTERN_COLORS[n] for n in names], label="measured (median)")
ax.set_xticks(xs, names, rotation=20)
ax.set_yscale("log")
plots.plain_log_axis(ax)
ax.set_ylabel("ms per decode step")
ax.set_title(f"Every pattern and ring on {p} simulated devices, Tk = {PROB.seq_len:,}")
ax.legend(fontsize=9)
ax.grid(alpha=0.3, axis="y")
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: predicted (grey) and measured (coloured) latency of each method, on a log scale,
# when this notebook ran. The merge patterns are close to each other: at this size a decode
# step is dominated by the local kernel and a fixed per-call overhead, which every pattern
# shares, so their differences are within this machine's noise. The pass-KV ring stands
# apart, in the model and on the clock.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>On simulated devices the merge patterns are indistinguishable: what separates them is a
# network's latency and bandwidth, which this machine does not have. The crossover on a real
# cluster comes from the model, with published figures.</p></div>
#
# ## 8.7 The crossover map on DGX H100
#
# `costmodel.crossover_map` predicts every pattern's latency for one decode step of the
# paper's microbenchmark heads (16 heads × 128, bf16, 1M keys) on DGX H100 nodes, as the
# number of devices $p$ and the number of query rows (batch × heads) grow, and records the
# winner. Its figures are published ones, not fitted here:

# %%
for source in costmodel.DGX_H100.sources:
    print("*", source)

# %% [markdown]
# Two maps: the patterns `merge="auto"` chooses from (`decode.AUTO_MERGES`, without
# `one_pass`, whose cost depends on the data), and all five with `one_pass` priced by its
# fast path, as if the fallback never ran. Each cell is coloured by its winner and labelled
# with the winner's predicted speedup over `allreduce` for the whole decode step.

# %%
auto_map = costmodel.crossover_map(patterns=decode.AUTO_MERGES)
all_map = costmodel.crossover_map()
fig, axes = plt.subplots(2, 1, figsize=(10, 9))
plots.crossover_map(auto_map, ax=axes[0])
axes[0].set_title("merge='auto' chooses among " + ", ".join(decode.AUTO_MERGES)
                  + f"\n{auto_map['topology']}", fontsize=10)
plots.crossover_map(all_map, ax=axes[1])
axes[1].set_title("all five patterns, one_pass by its fast path", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: x is the number of GPUs (one node up to eight GPUs, whole nodes beyond), y the
# number of query rows, batch × heads. The conclusions, computed from the same data:*

# %%
ps, bhs = auto_map["ps"], auto_map["batch_heads"]


def winners(data, where):
    return {data["winner"][i][j] for i, bh in enumerate(bhs) for j, pp in enumerate(ps)
            if where(pp, bh)}


node = costmodel.DGX_H100.devices_per_node
few_rows, many_rows = bhs[:2], bhs[-3:]
conclusions = {
    f"batch x heads <= {few_rows[-1]:,}, p >= 4": winners(
        auto_map, lambda pp, bh: bh in few_rows and pp >= 4),
    f"batch x heads >= {many_rows[0]:,}, one node (p <= {node})": winners(
        auto_map, lambda pp, bh: bh in many_rows and pp <= node),
    f"batch x heads >= {many_rows[0]:,}, two nodes (p = {2 * node})": winners(
        auto_map, lambda pp, bh: bh in many_rows and pp == 2 * node),
    f"batch x heads >= {many_rows[0]:,}, p >= {4 * node}": winners(
        auto_map, lambda pp, bh: bh in many_rows and pp >= 4 * node),
}
for regime, won in conclusions.items():
    print(f"auto map, {regime:<45} -> {', '.join(sorted(won))}")
# What the model guarantees, asserted:
# latency dominates (few rows, many devices): one collective beats two, so allgather wins;
assert conclusions[f"batch x heads <= {few_rows[-1]:,}, p >= 4"] == {"allgather"}
# bytes dominate on NVLink: all_to_all sends (p-1)/p of the states once, allreduce twice that;
assert conclusions[f"batch x heads >= {many_rows[0]:,}, one node (p <= {node})"] == {"all_to_all"}
# across nodes the all-to-all pays one slow alpha per remote peer, allgather p x the bytes:
# reduce_scatter on two nodes, and the hierarchical Allreduces beyond.
assert conclusions[f"batch x heads >= {many_rows[0]:,}, two nodes (p = {2 * node})"] == {
    "reduce_scatter"}
assert conclusions[f"batch x heads >= {many_rows[0]:,}, p >= {4 * node}"] == {"allreduce"}
# one_pass's fast path is allreduce minus one collective: never slower, by construction.
assert all(o <= a for ro, ra in zip(all_map["seconds"]["one_pass"], all_map["seconds"]["allreduce"])
           for o, a in zip(ro, ra))
best = max((s, bhs[i], ps[j], auto_map["winner"][i][j])
           for i, row in enumerate(auto_map["speedup"]) for j, s in enumerate(row))
one_pass_cells = sum(w == "one_pass" for row in all_map["winner"] for w in row)
print(f"largest predicted gain over allreduce (auto map): {best[0]:.2f}x, {best[3]} at "
      f"batch x heads = {best[1]:,}, p = {best[2]}")
print(f"with one_pass priced by its fast path, it wins {one_pass_cells} of "
      f"{len(ps) * len(bhs)} cells")

# %% [markdown]
# Read the maps from the top-left corner down:
#
# * **Few rows, many devices: `allgather`.** The merge's bytes are tiny and each collective
#   costs mostly its latency, so one all-gather of $p$ states beats two Allreduces. The gain
#   is largest across nodes, where $\alpha$ is a network round trip.
# * **Many rows inside one node: `all_to_all` (Helix).** Bytes dominate; the all-to-all
#   sends each state once, $(p-1)/p$ of it, where a ring Allreduce sends $2(p-1)/p$.
# * **Many rows on two nodes: `reduce_scatter` (DCP)**, and **on more nodes: `allreduce`**.
#   The all-to-all does not aggregate, so each remote peer costs one slow $\alpha$; the
#   Allreduce's hierarchical schedule (notebook 4, §4.8) sends one reduced message per node.
# * **`one_pass`**, priced by its fast path, takes most cells of the second map: it is the
#   `allreduce` merge minus one collective. Whether it truly wins depends on how often the
#   fallback runs (§8.4), which the model cannot know.
# * Where a cell's speedup rounds to one, the local kernel over a million keys dwarfs every merge:
#   the choice of merge matters when the shards are short or the batch is small.
#
# ### `merge="auto"`
#
# `tree_decode(..., merge="auto")` asks the same question of `costmodel.best_merge`, for the
# actual problem, on DGX H100 links shaped like the mesh. For this notebook's small problem
# on one node of 8 it picks the pattern below; the compiled program confirms that it runs
# that pattern's collectives.

# %%
chosen = costmodel.best_merge(
    Tk, costmodel.DGX_H100.with_devices(p), batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=D,
    v_dim=D, itemsize=8, q_len=Tq, stat_itemsize=8, patterns=decode.AUTO_MERGES)
small = (q, k, v)
auto_stats = tae.collective_stats(
    lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh, merge="auto"), *small)
chosen_stats = tae.collective_stats(
    lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh, merge=chosen), *small)
assert auto_stats == chosen_stats
np.testing.assert_allclose(tae.tree_decode(q, k, v, mesh=mesh, merge="auto"), want,
                           rtol=1e-12, atol=1e-13)
print(f"B = {B}, Hq = {Hq} ({B * Tq * Hq} rows) on {p} devices: auto chose {chosen!r}\n{auto_stats}")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>On DGX H100 the model says: gather everything when rows are few (latency), exchange over
# heads when rows are many inside a node (bandwidth), reduce-scatter or Allreduce when they are
# many across nodes (aggregation). The paper's Allreduce pair is the right choice at scale with
# large batches, not everywhere.</p></div>
#
# ## 8.8 Summary
#
# * All five merges compute $N/L$ with a shift $c$; they differ in which collective finds $c$,
#   which carries $L$ and $N$, and where the output ends up. Each is a few lines of
#   `shard_map`, equal to `tae.attention` and to `tree_decode(merge=...)`.
# * The compiled programs move exactly the bytes of `costmodel.merge_collectives`:
#   `allgather` one collective of $p$ times the payload, `all_to_all` one collective of about
#   the `allreduce` payload, `reduce_scatter` a small all-gather and a reduce-scatter over
#   heads, `one_pass` one Allreduce with a flag and a conditional fallback.
# * The one-pass merge is exact: past its window it falls back to `allreduce`, bit for bit.
#   It saves one collective latency per merge and pays only if the fallback is rare.
# * The pass-Q ring moves queries and partial states instead of the cache: cheaper than
#   pass-KV until the chunk of queries nears the cache in size.
# * On simulated devices the patterns are indistinguishable on the clock; on DGX H100 the
#   model picks `allgather` for few rows, `all_to_all` for many rows in a node, and
#   `reduce_scatter` or `allreduce` across nodes.
#
# ## 8.9 Exercises
#
# **Exercise 1 (predict, then compile).** With 12 query heads on 8 devices, the
# head-scattered patterns cannot give every device the same number of heads. What does the
# package do, and which collectives does `all_to_all` then run? Predict, then check with
# `collective_stats` and `costmodel.merge_collectives`.
#
# <details><summary>Answer</summary>
#
# The heads are padded with empty states to the next multiple of $p$, so each device merges
# $\lceil H_q/p \rceil$ heads, some of them padding. A result split unevenly over heads
# cannot stay scattered, so one more all-gather replicates the output and the padding is
# dropped. `merge_collectives` counts both; the cell checks them against the compiled program.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
H12 = 12
abstract12 = structs(mesh, 65536, batch=1, q_heads=H12, head_dim=128)
for name in ("all_to_all", "reduce_scatter"):
    stats = tae.collective_stats(
        lambda q, k, v, name=name: tae.tree_decode(q, k, v, mesh=mesh, merge=name), *abstract12)
    model = costmodel.merge_collectives(name, batch=1, q_len=1, q_heads=H12, v_dim=128, p=p,
                                        stat_itemsize=4, out_itemsize=4)
    assert stats.total_bytes == costmodel.collective_bytes(model)
    print(f"{name}: heads padded to {costmodel.padded_heads(H12, p)}, "
          f"{states.heads_per_device(H12, p)} per device\n{stats}\n")

# %% [markdown]
# **Exercise 2.** On two DGX H100 nodes (16 GPUs) with one sequence of 16 heads, what is the
# largest fraction of decode steps that may take the one-pass fallback before one-pass is
# slower on average than `allreduce`? And with a batch of 4096 sequences?
#
# <details><summary>Answer</summary>
#
# The expected merge time is $(1-f)\,t_1 + f\,t_3$ against $t_2$, so the break-even is
# $f^* = (t_2 - t_1)/(t_3 - t_1)$, with $t_3$ the fast path plus the exact merge
# (`predict_merge(..., fallback=True)`). With one sequence, the merge is latency-bound and
# skipping the max saves about half of it, so the fallback may run often. With a large batch
# the saved max is a small part of the merge, and even a rare fallback cancels it.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
for batch in (1, 4096):
    t1, t2, f = break_even(16, 16 * batch)
    print(f"batch {batch:>5}: one_pass {t1 * 1e6:7.1f} us, allreduce {t2 * 1e6:7.1f} us; "
          f"break-even fallback rate {f:.1%}")
assert break_even(16, 16)[2] > break_even(16, 16 * 4096)[2]

# %% [markdown]
# **Exercise 3.** On one DGX H100 node ($p = 8$), up to which batch × heads does `allgather`
# beat `allreduce` (multiples of 16 heads)? Why does it stop?
#
# <details><summary>Answer</summary>
#
# `allgather` saves latency terms: one all-gather (recursive doubling, $\log_2 p$ steps) in
# place of two Allreduces (as many steps each). It pays for them with bytes: $p$ states per
# row against about two. Once the extra bytes take longer over NVLink than the latency saved,
# it loses. The cell finds the last batch at which it still wins, and splits the two merges'
# communication time into its latency part (infinite bandwidth) and its bandwidth part (zero
# latency): at the crossover, the latency saved and the bandwidth added are about equal.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
topo8 = costmodel.DGX_H100.with_devices(8)


def gather_wins(batch):
    t = {m: costmodel.predict_merge(m, 2**20, topo8, batch=batch).total_s
         for m in ("allgather", "allreduce")}
    return t["allgather"] < t["allreduce"]


last = max(b for b in range(1, 1025) if gather_wins(b))
assert all(gather_wins(b) for b in range(1, last + 1))
latency_only = dataclasses.replace(topo8, intra=costmodel.Link(topo8.intra.alpha_s, float("inf")))
bytes_only = dataclasses.replace(topo8, intra=costmodel.Link(0.0, topo8.intra.beta_Bps))


def comm(m, topo):
    return costmodel.predict_merge(m, 2**20, topo, batch=last).comm_s


saved = comm("allreduce", latency_only) - comm("allgather", latency_only)
added = comm("allgather", bytes_only) - comm("allreduce", bytes_only)
assert abs(added / saved - 1) < 0.25
print(f"allgather wins up to batch {last} (batch x heads = {16 * last:,}); there it saves "
      f"{saved * 1e6:.1f} us of latency ({saved / topo8.intra.alpha_s:.0f} alpha) and adds "
      f"{added * 1e6:.1f} us of transfer")

# %% [markdown]
# ## 8.10 References
#
# * Shyam et al., *Tree Attention: Topology-aware Decoding for Long-Context Attention on
#   GPU Clusters*, arXiv 2408.04093: Algorithm 3, the Allreduce(max) + Allreduce(sum) merge.
# * Hong et al., *FlashDecoding++: Faster Large Language Model Inference on GPUs*,
#   arXiv 2311.01282: the unified max and its recomputation fallback, inside one GPU's
#   kernel; §8.4 applies the same idea to the merge across devices.
# * Bhatia et al., *Helix Parallelism: Rethinking Sharding Strategies for Interactive
#   Multi-Million-Token LLM Decoding*, arXiv 2507.07120: KV parallelism with an all-to-all
#   over heads.
# * Yang et al., *Context Parallelism for Scalable Million-Token Inference*,
#   arXiv 2411.01783: pass-KV and pass-Q rings, and when each is cheaper.
# * vLLM and SGLang, decode context parallelism: all-gather of the LSEs and reduce-scatter
#   of the outputs over heads (GitHub: vllm-project/vllm #25049, sgl-project/sglang #14982).
# * Thakur, Rabenseifner and Gropp, *Optimization of Collective Communication Operations in
#   MPICH*, IJHPCA 19(1), 2005: the cost of each collective in the alpha-beta model.
# * JAX documentation, *Manual parallelism with `shard_map`*
#   (https://docs.jax.dev/en/latest/notebooks/shard_map.html): `all_gather`, `psum_scatter`,
#   `all_to_all`.
