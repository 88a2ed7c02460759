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
# # 4. Tree decoding on devices
#
# Now the chunks of notebook 3 live on different devices. The KV cache of a long sequence is
# split along the sequence axis over $p$ devices; each device reduces its shard to a state
# $(o, \ell)$; and instead of an explicit tree, the states meet in two **Allreduce**
# collectives (paper, Algorithm 3):
#
# 1. $m = \text{Allreduce}_{\max}(\ell)$,
# 2. $(n, d) = \text{Allreduce}_{\text{sum}}\big(e^{\ell - m} o,\; e^{\ell - m}\big)$, and the
#    output is $n / d$.
#
# NCCL (on GPUs) and gloo (on CPUs) implement Allreduce with trees and rings internally.
#
# **What you will learn**
#
# * how to run `tree_decode` and `tree_decode_from_energy` with `shard_map` on 8 simulated
#   devices, and that they equal single-device attention;
# * that awkward inputs just work: lengths not divisible by $p$, shards with nothing visible;
# * how to read what the compiled program sends (`collective_stats`);
# * the topology-aware schedule on a 2-level `("node", "gpu")` mesh, visible as replica groups;
# * whether XLA discovers tree attention on its own.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises: 8 CPU devices stand in for 8 GPUs

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tree_attention_edu import plots

jax.config.update("jax_enable_x64", True)
assert jax.device_count() == 8, jax.devices()
print(jax.devices())

# %% [markdown]
# ## 4.1 A mesh and a sharded cache
#
# `make_mesh(8, "x")` arranges the devices along one axis. The cache `k, v` of shape
# `[B, Tk, Hkv, D]` is sharded along `Tk` with `PartitionSpec(None, "x")`: device $i$ holds
# keys $[i\,T_k/8, (i+1)\,T_k/8)$. The query is replicated.

# %%
mesh = tae.make_mesh(8, "x")
kq, kk, kv = jax.random.split(jax.random.key(4), 3)
B, Tq, Hq, Hkv, D, Dv, Tk = 2, 1, 8, 2, 32, 32, 4096
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hkv, D))
v = jax.random.normal(kv, (B, Tk, Hkv, Dv))

kv_sharding = NamedSharding(mesh, P(None, "x"))
k_sh, v_sh = jax.device_put(k, kv_sharding), jax.device_put(v, kv_sharding)
for shard in k_sh.addressable_shards[:3]:
    print(shard.device, "holds keys", shard.index[1])
print("...")

# %% [markdown]
# ## 4.2 Tree decoding equals single-device attention
#
# Three ways to the same output:
#
# * `tae.attention` on one device;
# * `tae.tree_decode`: local states, Allreduce(max), Allreduce(sum);
# * `tae.tree_decode_from_energy`: the paper's Algorithms 1–2. The *energy* is reduced across
#   devices (max, then sum of exponentials) and attention is `jax.grad` of it; JAX derives the
#   backward pass, which is one more Allreduce(sum).

# %%
reference = tae.attention(q, k, v)
tree = tae.tree_decode(q, k_sh, v_sh, mesh=mesh)
tree_energy = tae.tree_decode_from_energy(q, k_sh, v_sh, mesh=mesh)
np.testing.assert_allclose(tree, reference, rtol=1e-12, atol=1e-13)
np.testing.assert_allclose(tree_energy, reference, rtol=1e-12, atol=1e-13)
print("float64: tree_decode == tree_decode_from_energy == attention   ✓")

for dtype, atol in ((jnp.float32, 2e-6), (jnp.bfloat16, 1.6e-2)):
    args = [x.astype(dtype) for x in (q, k, v)]
    out = tae.tree_decode(*args, mesh=mesh)
    assert out.dtype == dtype  # accumulates in float32, returns the input dtype
    ref = tae.attention(*[a.astype(jnp.float64) for a in args])
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=atol)
    print(f"{jnp.dtype(dtype).name:>8}: agrees with float64 attention on the same inputs to {atol:g}   ✓")

# %% [markdown]
# The bfloat16 tolerance is one bfloat16 rounding of the output ($2^{-8}$ relative), not
# accumulated error: sums are carried in float32.
#
# ## 4.3 Awkward inputs just work
#
# * A length not divisible by the device count: the cache is padded and the padding masked
#   inside `tree_decode`; the user never pads.
# * Per-sequence `kv_lengths` that leave whole shards with nothing visible. Such a device's
#   state is $(0, -\infty)$, the identity of `combine`, and the shift by a global max that is
#   replaced by 0 when it is $-\infty$ keeps $(-\infty) - (-\infty)$ from ever appearing.
# * Causal decoding of several new tokens at once (speculative decoding), with GQA and a batch.

# %%
k_odd, v_odd = k[:, :1003], v[:, :1003]  # 1003 = 8 * 125 + 3
q3 = jax.random.normal(jax.random.key(5), (B, 3, Hq, D))
lengths = jnp.array([1003, 90])  # sequence 1 lives entirely on device 0
kw = dict(causal=True, kv_lengths=lengths)
want = tae.attention(q3, k_odd, v_odd, **kw)
for method in (tae.tree_decode, tae.tree_decode_from_energy, tae.ring_decode):
    got = method(q3, k_odd, v_odd, mesh=mesh, **kw)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
print("Tk = 1003 on 8 devices, 7 of 8 shards empty for sequence 1, causal Tq = 3: exact   ✓")

# %% [markdown]
# ## 4.4 What crosses the wire
#
# `collective_stats` compiles a function and reads the collectives out of XLA's program:
# their kind, the device groups that talk, and the bytes each device contributes. Its
# arguments can be `jax.ShapeDtypeStruct`s with shardings, so nothing is allocated. Here is
# the paper's microbenchmark shape (16 heads × 128, float32, one query) at 65,536 keys.

# %%
def structs(mesh, Tk, B=1, Tq=1, H=16, D=128, dtype=jnp.float32, axes=None):
    """Abstract q, k, v: q replicated, k and v sharded along Tk over `axes` (default: all)."""
    rep = NamedSharding(mesh, P())
    kv_ = NamedSharding(mesh, P(None, tuple(mesh.axis_names) if axes is None else axes))
    return (jax.ShapeDtypeStruct((B, Tq, H, D), dtype, sharding=rep),
            jax.ShapeDtypeStruct((B, Tk, H, D), dtype, sharding=kv_),
            jax.ShapeDtypeStruct((B, Tk, H, D), dtype, sharding=kv_))


tree_fn = lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh)  # noqa: E731
stats = tae.collective_stats(tree_fn, *structs(mesh, 65536))
print(stats)
assert stats.total_bytes == 1 * 1 * 16 * (128 + 2) * 4  # B·Tq·Hq·(Dv + 2) float32 numbers

# %% [markdown]
# Two all-reduces: 64 bytes for the max of the 16 per-head lse values, and 8,256 bytes for
# the numerator (16 × 128) and denominator (16) together; XLA fused the two sums into one
# collective. The volume does not depend on the sequence length:

# %%
by_tk = {tk: tae.collective_stats(tree_fn, *structs(mesh, tk)).total_bytes
         for tk in (1024, 16384, 262144)}
print(by_tk)
assert len(set(by_tk.values())) == 1

# %% [markdown]
# ## 4.5 Two levels: nodes and GPUs
#
# A GPU cluster is two-level: 8 GPUs in a node share NVLink (hundreds of GB/s), while nodes
# talk over InfiniBand (tens of GB/s per GPU). `make_mesh((2, 4), ("node", "gpu"))` models 2
# nodes of 4 devices. `tree_decode` reduces over the **inner axis first**: each node combines
# its 4 states over the fast links, and only then do the nodes exchange one already-reduced
# message per device position over the slow links.

# %%
mesh2 = tae.make_mesh((2, 4), ("node", "gpu"))
print(mesh2.devices)
tree2 = lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh2)  # noqa: E731
stats2 = tae.collective_stats(tree2, *structs(mesh2, 65536))
print(stats2)
inner = ((0, 1, 2, 3), (4, 5, 6, 7))
outer = ((0, 4), (1, 5), (2, 6), (3, 7))
assert [c.groups for c in stats2.collectives] == [inner, outer, inner, outer]
np.testing.assert_allclose(tae.tree_decode(q, k, v, mesh=mesh2), reference, rtol=1e-12, atol=1e-13)
plots.two_level_schedule(stats2.collectives[0].groups, stats2.collectives[1].groups)
plt.title("The schedule in the compiled program (replica groups)")
plt.show()

# %% [markdown]
# *Figure: the two all-reduce levels, drawn from the replica groups that `collective_stats`
# read out of the compiled program: first inside each node, then between matching devices.*
#
# The replica groups are the schedule: `{0,1,2,3},{4,5,6,7}` are the two nodes reducing
# internally, then `{0,4},{1,5},{2,6},{3,7}` pair each GPU with its counterpart in the other
# node. Each level carries the same small payload, so the total is twice the 1-D figure, and
# only half of it crosses the slow links.
#
# ## 4.6 Does XLA discover tree attention by itself?
#
# What would you get by writing plain attention and only telling XLA that K and V are
# sharded along the sequence, with no `shard_map`? We compile `jax.nn.dot_product_attention`
# with K/V carrying a sequence `NamedSharding` and read its collectives.

# %%
rep = NamedSharding(mesh, P())
auto = jax.jit(jax.nn.dot_product_attention, out_shardings=rep)
auto_stats = tae.collective_stats(auto, *structs(mesh, 65536))
print(auto_stats)
assert auto_stats.by_kind() == {"all-reduce": stats.total_bytes}

auto2 = jax.jit(jax.nn.dot_product_attention, out_shardings=NamedSharding(mesh2, P()))
auto2_stats = tae.collective_stats(auto2, *structs(mesh2, 65536))
print(auto2_stats)
assert all(c.groups in ((), (tuple(range(8)),)) for c in auto2_stats.collectives)

# %% [markdown]
# **Yes, on a flat mesh.** XLA's SPMD partitioner turns the sharded softmax reduction into
# three all-reduces (max, denominator sum, numerator sum) of exactly the tree payload, 8,320
# bytes per device: the reduction over a sharded axis is partitioned the way the paper
# prescribes. (Empty groups in the table mean "all devices".)
#
# **But not topology-aware.** On the 2-level mesh it still emits flat all-reduces over all 8
# devices; it does not split them into an intra-node and an inter-node level. Whether the
# flat all-reduce is fast then depends on the collective library (NCCL builds its own rings
# and trees across nodes). `tree_decode` states the hierarchy explicitly in the program, and
# it adds what the compiler cannot infer: padding for lengths not divisible by $p$, global
# positions for causal masks, and a choice of local kernel (notebook 5 and the `bench`
# command measure the latencies side by side).
#
# ## Summary
#
# * `tree_decode` = local `(out, lse)` per shard + Allreduce(max) + Allreduce(sum); it is exact
#   for every mask, length and dtype we tried, and returns the input dtype.
# * `tree_decode_from_energy` gets the same answer as the gradient of a tree-reduced energy.
# * The compiled program sends $B\,T_q\,H_q\,(D_v + 2)$ numbers per device, independent of
#   the sequence length; on a `("node", "gpu")` mesh it reduces inside nodes first.
# * XLA finds the flat version of this reduction by itself, but not the topology-aware one.
#
# ## Exercises
#
# 1. How many bytes per device does `tree_decode` send for batch 4, 2 query tokens and 32
#    heads of dimension 64 in bfloat16? Predict, then measure.
# 2. Shard over the `"gpu"` axis only (`seq_axes="gpu"`). Which collectives remain?
# 3. Give the two sequences lengths that end exactly on a shard boundary and one key past it
#    (shards hold 512 keys here). Is the answer still exact?

# %%
# Answer 1: B·Tq·Hq·(Dv + 2) numbers, but 4 bytes each, not 2: the states are accumulated and
# reduced in float32 even for bfloat16 inputs (accuracy costs 67 kB, independent of Tk).
s1 = tae.collective_stats(tree_fn, *structs(mesh, 8192, B=4, Tq=2, H=32, D=64, dtype=jnp.bfloat16))
assert s1.total_bytes == 4 * 2 * 32 * (64 + 2) * 4, s1.total_bytes

# Answer 2: only the intra-node groups; the cache is replicated across nodes.
s2 = tae.collective_stats(lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh2, seq_axes="gpu"),
                          *structs(mesh2, 8192, axes="gpu"))
assert {c.groups for c in s2.collectives} == {inner}

# Answer 3: yes; a boundary is just a place where one device's state becomes the identity.
edge = jnp.array([3 * 512, 3 * 512 + 1])
np.testing.assert_allclose(tae.tree_decode(q, k_sh, v_sh, mesh=mesh, kv_lengths=edge),
                           tae.attention(q, k, v, kv_lengths=edge), rtol=1e-12, atol=1e-13)
print("answers check out   ✓")
