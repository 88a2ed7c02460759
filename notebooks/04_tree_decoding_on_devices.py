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
# **Prerequisites:** notebook 1 (attention as the gradient of an energy) and notebook 3 (the
# partial state $(o, \ell)$ and its `combine`); what a JAX array and `jax.jit` are.
# **Time:** about 30 minutes to read and run.
#
# The chunks of notebook 3 now live on different devices. The KV cache of a long sequence
# is split along the sequence axis over $p$ devices; each device reduces its shard to a
# partial result; and instead of an explicit tree, the partial results meet in two
# **Allreduce** collectives (paper, Algorithm 3):
#
# 1. $M = \text{Allreduce}_{\max}(m)$ of the devices' local maxima,
# 2. $(N, L) = \text{Allreduce}_{\text{sum}}\big(e^{m - M} o,\; e^{m - M} l\big)$, and the
#    output is $N / L$.
#
# **Where this runs.** Everything here runs on 8 *simulated CPU devices* in one Python
# process, also on a machine with a GPU: the first cell tells JAX to use the CPU. With one
# process there is no network and no gloo; XLA's CPU runtime performs each collective inside
# the process by copying between the devices' buffers. On a GPU cluster the same programs
# run their collectives through NCCL, which implements Allreduce with rings and trees
# (paper, §5.3); across processes on CPUs JAX uses gloo (see `tree_attention_edu.cluster.launch`).
#
# **Learning objectives.** After this notebook you can
#
# * explain a `Mesh`, a `PartitionSpec` and what each device holds of a sharded array;
# * write tree decoding yourself in about ten lines of `jax.shard_map` with `lax.pmax` and
#   `lax.psum`, and the energy version (Algorithms 1–2) with `jax.grad`, and check both
#   against the package;
# * trust `tree_decode` on awkward inputs: lengths not divisible by $p$, empty shards, NaN
#   in masked slots, causal multi-token decoding;
# * read what the compiled program sends (`collective_stats`), and tell an Allreduce's
#   payload from the bytes it puts on the wire;
# * recognise the topology-aware schedule on a 2-level `("node", "gpu")` mesh, and see
#   what XLA finds on its own.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tree_attention_edu import plots
from tree_attention_edu.perf import costmodel
from tree_attention_edu.perf.introspect import structs

jax.config.update("jax_enable_x64", True)  # float64 makes "equal" mean equal to ~1e-13
assert jax.device_count() == 8, jax.devices()
assert jax.process_count() == 1  # one process: in-process collectives, no gloo, no network
print(jax.devices())

# %% [markdown]
# ## 4.1 Meshes, partition specs and what each device holds
#
# A **mesh** is a grid of devices with named axes; `tae.make_mesh(8, "x")` puts all 8 on
# one axis called `"x"`. A **`PartitionSpec`** says, for each axis of an array, which mesh
# axis it is split over (`None`: not split). `NamedSharding(mesh, spec)` binds the two, and
# `jax.device_put` places the array. `x.addressable_shards` then tells what each device
# holds: here is one vector of 8 numbers placed two ways.

# %%
mesh = tae.make_mesh(8, "x")
print(mesh)


def held(a):
    """{device id: the block of `a` that device stores}."""
    return {s.device.id: np.asarray(s.data) for s in a.addressable_shards}


x = jnp.array([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0])
split = jax.device_put(x, NamedSharding(mesh, P("x")))  # axis 0 split over "x"
copied = jax.device_put(x, NamedSharding(mesh, P()))  # no axis split: replicated
print('P("x"): ', {d: b.tolist() for d, b in held(split).items()})
print("P():    every device holds", held(copied)[0].tolist())
assert all(np.array_equal(b, x) for b in held(copied).values())

# %% [markdown]
# The KV cache `k` of shape `[B, Tk, H, D]` is split along its **sequence** axis with
# `P(None, "x")`: device $i$ holds keys $[i\,T_k/8,\ (i+1)\,T_k/8)$ of every sequence and head.
# The query is replicated with `P()`: every device holds all of it.

# %%
kq, kk, kv = jax.random.split(jax.random.key(4), 3)
B, Tq, H, D, Tk = 2, 1, 4, 16, 4096
q = jax.random.normal(kq, (B, Tq, H, D))
k = jax.random.normal(kk, (B, Tk, H, D))
v = jax.random.normal(kv, (B, Tk, H, D))

kv_sharding = NamedSharding(mesh, P(None, "x"))
k_sh, v_sh = jax.device_put(k, kv_sharding), jax.device_put(v, kv_sharding)
for s in k_sh.addressable_shards:
    keys = s.index[1]
    print(f"device {s.device.id}: keys [{keys.start:>4}, {keys.stop:>4}), block shape {s.data.shape}")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A <code>PartitionSpec</code> names, per array axis, the mesh axis it is split over. The cache is split
# along the sequence (<code>P(None, "x")</code>), the query is replicated (<code>P()</code>).</p></div>
#
# ## 4.2 Collectives: what each device holds before and after
#
# `jax.shard_map(f, mesh=..., in_specs=..., out_specs=...)` runs `f` once per device, on the
# block that device holds. Devices see each other only through **collectives**:
# `lax.pmax(a, "x")` and `lax.psum(a, "x")` give every device the max or sum of all
# devices' `a` (an Allreduce). `out_specs=P("x")` stacks the devices' results along axis 0,
# so we can print what each device holds after each step. (`jax.jit` around it compiles the
# per-device program once, instead of running it op by op.)

# %%
def before_and_after(block):  # block: this device's one number, shape [1]
    return block, lax.pmax(block, "x"), lax.psum(block, "x")


steps = jax.jit(jax.shard_map(before_and_after, mesh=mesh, in_specs=P("x"),
                              out_specs=(P("x"),) * 3))
before, after_max, after_sum = steps(split)
print("device      ", "".join(f"{d:>5}" for d in range(8)))
for name, a in (("before", before), ("after pmax", after_max), ("after psum", after_sum)):
    print(f"{name:<12}", "".join(f"{val:>5.0f}" for val in np.asarray(a)))
assert np.all(after_max == x.max()) and np.all(after_sum == x.sum())

# %% [markdown]
# After a `pmax` or `psum` every device holds the same value, and `shard_map` knows it: a
# result of these collectives may be returned with `out_specs=P()` (replicated), which is
# how the decoders below return their output.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Inside <code>shard_map</code> a function sees one device's block; <code>pmax</code> and <code>psum</code> are
# Allreduces that leave the same result on every device.</p></div>
#
# ## 4.3 Tree decoding by hand
#
# Each device reduces its shard of keys to three local quantities, for every sequence, query
# and head: the max score $m$, the sum $l = \sum_a e^{s_a - m}$ and the unnormalised output
# $o = \sum_a e^{s_a - m} v_a$. Shifting all of them to the global max
# $M = \max_{\text{devices}} m$ makes them addable:
#
# $$\text{attention} = \frac{\sum_{\text{devices}} e^{m - M}\, o}{\sum_{\text{devices}} e^{m - M}\, l}.$$
#
# That is the whole algorithm: one `pmax` and one `psum` (of two arrays).

# %%
scale = D**-0.5  # the package's default score scale, 1/sqrt(D) (the paper writes none)


def local_parts(q, k, v):
    """One shard's (m, l, o): max score, sum of e^(s-m) [B, Tq, H], numerator [B, Tq, H, Dv]."""
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k) * scale  # scores against this shard's keys
    m = s.max(-1)
    e = jnp.exp(s - m[..., None])
    return m, e.sum(-1), jnp.einsum("bqhk,bkhd->bqhd", e, v)


def tree_decode_by_hand(q, k, v):
    """Inside shard_map: q replicated, k and v this device's shard [B, Tk/p, H, D]."""
    m, l, o = local_parts(q, k, v)
    M = lax.pmax(m, "x")  # Allreduce(max): the global max, on every device
    w = jnp.exp(m - M)  # rescale this shard's sums to the global max
    L, N = lax.psum((l * w, o * w[..., None]), "x")  # Allreduce(sum) of both
    return N / L[..., None]


kv_spec = P(None, "x")  # k and v: split along the sequence; q: replicated, P()
by_hand = jax.jit(jax.shard_map(tree_decode_by_hand, mesh=mesh,
                                in_specs=(P(), kv_spec, kv_spec), out_specs=P()))
mine = by_hand(q, k_sh, v_sh)
np.testing.assert_allclose(mine, tae.tree_decode(q, k_sh, v_sh, mesh=mesh), rtol=1e-12, atol=1e-13)
np.testing.assert_allclose(mine, tae.attention(q, k, v), rtol=1e-12, atol=1e-13)
print("tree_decode_by_hand == tae.tree_decode == tae.attention   ✓")

# %% [markdown]
# ### 4.3.1 Watching the collectives
#
# The same steps, with every device's values returned (`out_specs=P("x")`) so that we can
# print them before and after each collective, for sequence 0 and head 0. Before `pmax`
# every device has its own max; after it, all hold the same $M$. After `psum` all hold the
# same denominator $L$.

# %%
def watch(q, k, v):
    m, l, _ = local_parts(q, k, v)
    M = lax.pmax(m, "x")
    L = lax.psum(l * jnp.exp(m - M), "x")
    return [a[None, 0, 0, 0] for a in (m, l, M, L)]  # sequence 0, query 0, head 0


watched = jax.jit(jax.shard_map(watch, mesh=mesh, in_specs=(P(), kv_spec, kv_spec),
                                out_specs=[P("x")] * 4))
m_, l_, M_, L_ = watched(q, k_sh, v_sh)
print("device             ", "".join(f"{d:>9}" for d in range(8)))
for name, a in (("local max m", m_), ("local sum l", l_), ("after pmax: M", M_),
                ("after psum: L", L_)):
    print(f"{name:<19}", "".join(f"{val:>9.4f}" for val in np.asarray(a)))
np.testing.assert_allclose(M_, m_.max())
np.testing.assert_allclose(L_, np.sum(l_ * np.exp(m_ - m_.max())))

# %% [markdown]
# The package's states are the same quantities in another form: `tae.local_state` returns
# the normalised output $o / l$ and the log-sum-exp $m + \log l$ of a chunk (notebook 3),
# and `tae.tree_decode` merges them with the same `pmax` and `psum`
# (`states.allreduce_combine`), adding masks, padding and empty shards, which the ten lines
# above ignore.

# %%
shard0 = slice(0, Tk // 8)  # device 0's keys
m0, l0, o0 = local_parts(q, k[:, shard0], v[:, shard0])
state0 = tae.local_state(q, k[:, shard0], v[:, shard0])
np.testing.assert_allclose(state0.out, o0 / l0[..., None], rtol=1e-12, atol=1e-13)
np.testing.assert_allclose(state0.lse, m0 + np.log(l0), rtol=1e-13)
print("local_state(shard) == (o / l, m + log l)   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Tree decoding is local (m, l, o) per shard, one <code>pmax</code> of m, and one <code>psum</code> of
# l·e^(m−M) and o·e^(m−M). Nothing the size of the cache ever leaves a device.</p></div>
#
# ## 4.4 The energy path by hand (Algorithms 1–2)
#
# The paper reaches the same algorithm from the energy of notebook 1,
# $F(\zeta) = \sum_{\text{rows}} \log\sum_a \exp(s_a + \zeta\cdot v_a)$, whose gradient at
# $\zeta = 0$ is attention. **Algorithm 1** computes $F$ across devices: local scores
# $r_a = s_a + \zeta\cdot v_a$, a max Allreduce, a sum Allreduce of $e^{r_a - M}$, and a log.
# **Algorithm 2** is its gradient: with the lse saved, each device computes
# $\sum_a e^{r_a - \text{lse}}\, v_a$ over its keys, and one more sum Allreduce finishes.
# We write Algorithm 1 and let `jax.grad` derive Algorithm 2.

# %%
def energy_by_hand(q, k, v, zeta):
    """Algorithm 1 inside shard_map: F(zeta) of the whole cache, the same on every device."""
    r = jnp.einsum("bqhd,bkhd->bqhk", q, k) * scale + jnp.einsum("bqhd,bkhd->bqhk", zeta, v)
    M = lax.pmax(lax.stop_gradient(r.max(-1)), "x")  # a shift: it carries no gradient
    lse = M + jnp.log(lax.psum(jnp.exp(r - M[..., None]).sum(-1), "x"))
    return lse.sum()


F = jax.shard_map(energy_by_hand, mesh=mesh, in_specs=(P(), kv_spec, kv_spec, P()),
                  out_specs=P())  # jitted below, with its gradient
zeta0 = jnp.zeros((B, Tq, H, D))
np.testing.assert_allclose(jax.jit(F)(q, k_sh, v_sh, zeta0), tae.energy(q, k, v, zeta0),
                           rtol=1e-13)
grad_F = jax.jit(jax.grad(F, argnums=3))  # Algorithm 2, derived by JAX
from_energy = grad_F(q, k_sh, v_sh, zeta0)
np.testing.assert_allclose(from_energy, tae.tree_decode_from_energy(q, k_sh, v_sh, mesh=mesh),
                           rtol=1e-12, atol=1e-13)
np.testing.assert_allclose(from_energy, tae.attention(q, k, v), rtol=1e-12, atol=1e-13)
print("F by hand == tae.energy;  jax.grad(F) == tae.tree_decode_from_energy == attention   ✓")

# %% [markdown]
# Algorithm 2 written out, to check what `jax.grad` derived: at $\zeta = 0$ the lse of
# Algorithm 1 is computed once, and the gradient is one local weighted sum and one `psum`.

# %%
def algorithm2_by_hand(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k) * scale
    M = lax.pmax(s.max(-1), "x")
    lse = M + jnp.log(lax.psum(jnp.exp(s - M[..., None]).sum(-1), "x"))  # Algorithm 1, saved
    return lax.psum(jnp.einsum("bqhk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v), "x")


alg2 = jax.jit(jax.shard_map(algorithm2_by_hand, mesh=mesh, in_specs=(P(), kv_spec, kv_spec),
                             out_specs=P()))(q, k_sh, v_sh)
np.testing.assert_allclose(alg2, from_energy, rtol=1e-12, atol=1e-13)

grad_stats = tae.collective_stats(grad_F, q, k_sh, v_sh, zeta0)
print(grad_stats)
kinds = [c.kind for c in grad_stats.collectives]
assert kinds == ["all-reduce"] * 3, kinds  # max and sum-exp (Alg. 1), numerator (Alg. 2)
print("Algorithm 2 by hand == jax.grad of Algorithm 1; its program holds 3 all-reduces   ✓")

# %% [markdown]
# The compiled gradient holds three all-reduces: the max and the sum of exponentials of
# Algorithm 1 (one number per row each) and the numerator of Algorithm 2 (one vector per
# row). Algorithm 3 needs the same three, fed by a flash-attention kernel instead of autodiff.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The energy path is Algorithm 1 (pmax, psum, log) plus <code>jax.grad</code>; autodiff turns it into
# Algorithm 2, one more <code>psum</code>. Same answer, same three Allreduces.</p></div>
#
# ## 4.5 The package's two tree decoders
#
# The package's decoders take unsharded or sharded arrays and a mesh, and return the
# replicated output in the input's dtype. In float64 they equal single-device attention to
# rounding; in float32 and bfloat16 they are compared with float64 attention on the same
# rounded inputs.

# %%
reference = tae.attention(q, k, v)
np.testing.assert_allclose(tae.tree_decode(q, k_sh, v_sh, mesh=mesh), reference,
                           rtol=1e-12, atol=1e-13)
np.testing.assert_allclose(tae.tree_decode_from_energy(q, k_sh, v_sh, mesh=mesh), reference,
                           rtol=1e-12, atol=1e-13)
print("float64: tree_decode == tree_decode_from_energy == attention   ✓")

for dtype, atol in ((jnp.float32, 2e-6), (jnp.bfloat16, 1.6e-2)):
    args = [a.astype(dtype) for a in (q, k, v)]
    out = tae.tree_decode(*args, mesh=mesh)
    assert out.dtype == dtype  # accumulates in float32, returns the input dtype
    ref = tae.attention(*[a.astype(jnp.float64) for a in args])
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=atol)
    print(f"{jnp.dtype(dtype).name:>8}: agrees with float64 attention on the same inputs to {atol:g}   ✓")

# %% [markdown]
# The bfloat16 tolerance is one bfloat16 rounding of the output (a relative $2^{-8}$ on
# values of order one), not accumulated error: sums are carried in float32.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p><code>tree_decode</code> is the by-hand algorithm, productised: any dtype in, the same dtype out,
# float32 accumulation inside.</p></div>
#
# ## 4.6 Awkward inputs just work
#
# * A length not divisible by the device count: the cache is padded and the padding masked
#   inside `tree_decode`; the user never pads.
# * Per-sequence `kv_lengths` that leave whole shards with nothing visible. Such a device's
#   state is $(0, -\infty)$, the identity of `combine`, and a global max of $-\infty$ is
#   replaced by 0, so $(-\infty) - (-\infty)$ never appears.
# * Masked slots may hold anything, NaN included: they are selected away, never multiplied
#   by a zero weight.
# * Causal decoding of several new tokens at once (speculative decoding), with grouped-query
#   attention (4 query heads sharing 2 KV heads) and a batch.

# %%
k_odd, v_odd = k[:, :1003, :2], v[:, :1003, :2]  # 2 KV heads; 1003 keys = 8 * 125 + 3
q3 = jax.random.normal(jax.random.key(5), (B, 3, H, D))
lengths = jnp.array([1003, 90])  # sequence 1 lives entirely on device 0
k_nan = k_odd.at[1, 90:].set(jnp.nan)  # what lies past a length is never read
v_nan = v_odd.at[1, 90:].set(jnp.nan)
kw = dict(causal=True, kv_lengths=lengths)
want = tae.attention(q3, k_odd, v_odd, **kw)
for method in (tae.tree_decode, tae.tree_decode_from_energy, tae.ring_decode):
    for kk_, vv_ in ((k_odd, v_odd), (k_nan, v_nan)):
        got = method(q3, kk_, vv_, mesh=mesh, **kw)
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
print(f"Tk = {k_odd.shape[1]} on 8 devices, sequence 1 ({lengths[1]} keys) on device 0 only, "
      f"NaN past its length, GQA {H}:{k_odd.shape[2]}, causal Tq = {q3.shape[1]}: exact   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>An empty shard contributes the identity state; padding, lengths and NaN in masked slots
# change nothing in the result.</p></div>
#
# ## 4.7 What crosses the wire: payload and wire bytes
#
# `collective_stats` compiles a function and reads the collectives out of XLA's program:
# their kind, the device groups that talk, and each collective's **payload**, the bytes each
# device contributes. Its arguments can be abstract (`jax.ShapeDtypeStruct`s with
# shardings), so nothing is allocated: `tree_attention_edu.introspect.structs` builds them,
# by default at the paper's microbenchmark shape (one query, 16 heads of 128, float32).

# %%
tree_fn = lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh)  # noqa: E731
print(structs(mesh, 65536)[1])
stats = tae.collective_stats(tree_fn, *structs(mesh, 65536))
print(stats)
payload = stats.total_bytes
assert payload == costmodel.tree_payload_bytes(1, 1, 16, 128)  # B·Tq·Hq·(Dv + 2) float32
assert [c.bytes for c in stats.collectives] == [16 * 4, 16 * (128 + 1) * 4]  # max; num + den

# %% [markdown]
# Two all-reduces: the max of the 16 per-head lse values, and the numerator and denominator
# together (XLA fused the two sums into one collective). The payload does not depend on the
# sequence length:

# %%
by_tk = {tk: tae.collective_stats(tree_fn, *structs(mesh, tk)).total_bytes
         for tk in (1024, 16384, 262144)}
print(by_tk)
assert set(by_tk.values()) == {payload}

# %% [markdown]
# The payload is not what a device puts on the wire. How an Allreduce moves its payload is
# the collective library's choice (NCCL picks ring or tree algorithms by message size and
# topology; paper §5.3). The bandwidth-optimal **ring Allreduce** is a reduce-scatter and an
# all-gather, each of $p-1$ steps that send $1/p$ of the payload, so each device sends
# $2\frac{p-1}{p}$ times the payload. That is the factor in the paper's eq. (12), and it
# turns the payload into the paper's $V_\text{tree}$ (eq. 14):

# %%
p = mesh.size
wire = 2 * (p - 1) / p * payload  # bytes each device sends in a ring Allreduce
paper_v_tree = costmodel.paper_volume_tree(1, 16, 128, p) * 4  # eq. 14, elements x 4 bytes
assert wire == paper_v_tree
print(f"payload (what each device contributes): {payload:>8,} B")
print(f"on the wire, ring Allreduce, 2(p-1)/p x payload with p = {p}: {wire:>8,.0f} B "
      f"(paper eq. 14 x 4 bytes: {paper_v_tree:,.0f} B)")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Tree decoding's payload is B·Tq·Hq·(Dv + 2) numbers per device, whatever the sequence
# length; a ring Allreduce puts 2(p−1)/p times that on the wire.</p></div>
#
# ## 4.8 Two levels: nodes and GPUs
#
# A GPU cluster is two-level: the GPUs of a node share NVLink, while nodes talk over
# InfiniBand, an order of magnitude slower per GPU (the DGX H100 figures the course uses are
# printed below, with their source). `make_mesh((2, 4), ("node", "gpu"))` models 2 nodes of
# 4 devices. `tree_decode` reduces over the **inner axis first**: each node combines its 4
# states over the fast links, and only then do the nodes exchange one already-reduced
# message per device position over the slow links.

# %%
dgx = costmodel.DGX_H100
print(f"NVLink, per GPU and direction:     {dgx.intra.beta_Bps / 1e9:>5.0f} GB/s")
print(f"InfiniBand NDR, per GPU:           {dgx.inter.beta_Bps / 1e9:>5.0f} GB/s")
print("source:", dgx.sources[1])

mesh2 = tae.make_mesh((2, 4), ("node", "gpu"))
print(mesh2.devices)
tree2 = lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh2)  # noqa: E731
stats2 = tae.collective_stats(tree2, *structs(mesh2, 65536))
print(stats2)
inner = ((0, 1, 2, 3), (4, 5, 6, 7))
outer = ((0, 4), (1, 5), (2, 6), (3, 7))
assert [c.groups for c in stats2.collectives] == [inner, outer, inner, outer]
np.testing.assert_allclose(tae.tree_decode(q, k, v, mesh=mesh2), reference, rtol=1e-12, atol=1e-13)

level_payload = {lvl: sum(c.bytes for c in stats2.collectives if c.groups == g)
                 for lvl, g in (("inside nodes", inner), ("across nodes", outer))}
assert level_payload == {"inside nodes": payload, "across nodes": payload}
for lvl, g in (("inside nodes", inner), ("across nodes", outer)):
    n = len(g[0])
    print(f"{lvl}: groups of {n}, payload {level_payload[lvl]:,} B, ring-Allreduce wire "
          f"bytes 2({n}-1)/{n} x payload = {2 * (n - 1) / n * level_payload[lvl]:,.0f} B")

fig, ax = plt.subplots(figsize=(8, 3.2))
plots.two_level_schedule(stats2.collectives[0].groups, stats2.collectives[1].groups, ax=ax)
ax.set_title("The schedule in the compiled program (replica groups)")
plt.show()

# %% [markdown]
# *Figure: look at the two kinds of link. Solid blue arrows are the first level, inside each
# node; dotted grey arrows are the second, between matching devices of the two nodes. Both
# are drawn from the replica groups that `collective_stats` read out of the compiled
# program.*
#
# The replica groups are the schedule: `{0,1,2,3},{4,5,6,7}` are the two nodes reducing
# internally, then `{0,4},{1,5},{2,6},{3,7}` pair each GPU with its counterpart in the other
# node. Each level carries the same small payload, so the total payload is twice the 1-D
# figure, and only the second level, already reduced, crosses the slow links.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>On a ("node", "gpu") mesh the tree reduces inside nodes first: the slow links carry one
# already-reduced payload per device position.</p></div>
#
# ## 4.9 Does XLA discover tree attention by itself?
#
# What would you get by writing plain attention and only telling XLA that K and V are
# sharded along the sequence, with no `shard_map`? We compile `jax.nn.dot_product_attention`
# with K/V carrying a sequence `NamedSharding` and read its collectives.

# %%
rep = NamedSharding(mesh, P())
auto = jax.jit(jax.nn.dot_product_attention, out_shardings=rep)
auto_stats = tae.collective_stats(auto, *structs(mesh, 65536))
print(auto_stats)
assert auto_stats.by_kind() == {"all-reduce": payload}

auto2 = jax.jit(jax.nn.dot_product_attention, out_shardings=NamedSharding(mesh2, P()))
auto2_stats = tae.collective_stats(auto2, *structs(mesh2, 65536))
print(auto2_stats)
assert all(c.groups in ((), (tuple(range(8)),)) for c in auto2_stats.collectives)

# %% [markdown]
# **Yes, on a flat mesh.** XLA's SPMD partitioner turns the sharded softmax reduction into
# three all-reduces (max, denominator sum, numerator sum) whose payload is exactly the
# tree's (asserted above): the reduction over a sharded axis is partitioned the way the
# paper prescribes. (Empty groups in the table mean "all devices".)
#
# **But not topology-aware.** On the 2-level mesh it still emits flat all-reduces over all 8
# devices; it does not split them into an intra-node and an inter-node level. Whether the
# flat all-reduce is fast then depends on the collective library (NCCL builds its own rings
# and trees across nodes). `tree_decode` states the hierarchy explicitly in the program, and
# it adds what the compiler cannot infer: padding for lengths not divisible by $p$, global
# positions for causal masks, and a choice of local kernel (notebook 5 and the `bench`
# command measure the latencies side by side).
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>XLA finds the flat tree reduction by itself; the topology-aware schedule has to be
# written down.</p></div>
#
# ## 4.10 Summary
#
# * A mesh names the devices, a `PartitionSpec` says how an array is split over them, and
#   `shard_map` runs a function per device, which meets the others only in collectives.
# * Tree decoding is local $(m, l, o)$ per shard, `pmax` of $m$, and `psum` of
#   $l\,e^{m-M}$ and $o\,e^{m-M}$: about ten lines, equal to `tae.tree_decode`.
# * The energy path is Algorithm 1 (distributed log-sum-exp) and `jax.grad` of it
#   (Algorithm 2): equal to `tae.tree_decode_from_energy` and to attention.
# * The package's decoders are exact for every mask, length and dtype tried here, NaN in
#   masked slots included, and return the input dtype.
# * The compiled program's payload is $B\,T_q\,H_q\,(D_v + 2)$ numbers per device,
#   independent of the sequence length; a ring Allreduce sends $2\frac{p-1}{p}$ times that.
#   On a `("node", "gpu")` mesh the reduction runs inside nodes first.
# * XLA finds the flat version of this reduction by itself, but not the topology-aware one.
#
# ## 4.11 Exercises
#
# **Exercise 1 (predict, then measure).** How many bytes per device does `tree_decode`
# contribute (payload) for batch 4, 2 query tokens and 32 heads of dimension 64 in
# bfloat16, on the 1-D mesh of 8? And how many does a ring Allreduce put on the wire?
# Write both numbers down before you run the answer.
#
# <details><summary>Answer</summary>
#
# The payload is $B\,T_q\,H_q\,(D_v + 2)$ numbers, but 4 bytes each, not 2: the states are
# accumulated and reduced in float32 even for bfloat16 inputs (accuracy costs a few tens of
# kB, independent of $T_k$). The wire bytes are $2\cdot 7/8$ of the payload. The cell below
# prints and checks both.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
s1 = tae.collective_stats(tree_fn, *structs(mesh, 8192, batch=4, q_len=2, q_heads=32,
                                             head_dim=64, dtype=jnp.bfloat16))
predicted = 4 * 2 * 32 * (64 + 2) * 4
assert s1.total_bytes == predicted, s1.total_bytes
print(f"payload {s1.total_bytes:,} B, ring-Allreduce wire bytes {2 * 7 / 8 * predicted:,.0f} B")

# %% [markdown]
# **Exercise 2.** Shard over the `"gpu"` axis only (`seq_axes="gpu"`) on the 2-level mesh.
# Which collectives remain?
#
# <details><summary>Answer</summary>
#
# Only the intra-node groups: the cache is replicated across nodes, so each node already
# holds every key, and nothing needs to cross the slow links.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
s2 = tae.collective_stats(lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh2, seq_axes="gpu"),
                          *structs(mesh2, 8192, seq_axes="gpu"))
assert {c.groups for c in s2.collectives} == {inner}
print(s2)

# %% [markdown]
# **Exercise 3.** Give the two sequences lengths that end exactly on a shard boundary and
# one key past it (shards hold `Tk // 8` keys here). Is the answer still exact?
#
# <details><summary>Answer</summary>
#
# Yes. A boundary is just a place where one device's state becomes the identity, or holds a
# single key.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
edge = jnp.array([3 * (Tk // 8), 3 * (Tk // 8) + 1])
np.testing.assert_allclose(tae.tree_decode(q, k_sh, v_sh, mesh=mesh, kv_lengths=edge),
                           tae.attention(q, k, v, kv_lengths=edge), rtol=1e-12, atol=1e-13)
print("exact at a shard boundary and one key past it   ✓")

# %% [markdown]
# **Exercise 4.** Is the `pmax` in `tree_decode_by_hand` necessary? Try two shortcuts:
# (a) each device keeps its own shift $m$ and the sums are added unshifted; (b) no shift at
# all ($M = 0$). Predict what each returns on the data above and on queries scaled by a
# thousand (large logits), then run them.
#
# <details><summary>Answer</summary>
#
# (a) is wrong on any data: sums taken relative to different shifts cannot be added.
# (b) is right in exact arithmetic and works for moderate logits, but $e^{s}$ overflows to
# infinity once a score passes the log of the largest float (the cell prints it), and the
# output becomes $\infty/\infty$ = NaN. The common shift $M$ makes the sum both correct
# and safe.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
def own_shift(q, k, v):
    _, l, o = local_parts(q, k, v)  # (a): each device's sums scaled by its own e^(-m)
    L, N = lax.psum((l, o), "x")
    return N / L[..., None]


def no_shift(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k) * scale
    e = jnp.exp(s)  # (b): M = 0
    L, N = lax.psum((e.sum(-1), jnp.einsum("bqhk,bkhd->bqhd", e, v)), "x")
    return N / L[..., None]


def run_by_hand(f, q):
    fn = jax.shard_map(f, mesh=mesh, in_specs=(P(), kv_spec, kv_spec), out_specs=P())
    return jax.jit(fn)(q, k_sh, v_sh)


print(f"e^s overflows float64 beyond s = {np.log(np.finfo(np.float64).max):.1f}")
assert not np.allclose(run_by_hand(own_shift, q), reference, atol=1e-3)  # (a) wrong
np.testing.assert_allclose(run_by_hand(no_shift, q), reference, rtol=1e-12, atol=1e-13)  # (b) fine
big = 1000 * q
assert np.isnan(np.asarray(run_by_hand(no_shift, big))).all()  # (b) overflows: inf / inf
np.testing.assert_allclose(run_by_hand(tree_decode_by_hand, big), tae.attention(big, k, v),
                           rtol=1e-12, atol=1e-12)  # the shifted version does not
print("own shifts: wrong; no shift: NaN at large logits; global max shift: exact   ✓")

# %% [markdown]
# ## 4.12 References
#
# * Shyam, Pilault, Shepperd, Anthony, Millidge, *Tree Attention: Topology-aware Decoding
#   for Long-Context Attention on GPU Clusters*, arXiv 2408.04093:
#   §5.1 and Algorithm 1 (the energy forward, eq. 7; Theorem 1 for the reduction's cost);
#   §5.2, Algorithm 2 (its gradient) and Algorithm 3 (tree decoding with a flash kernel);
#   §5.3 (topology awareness, NCCL's ring inside and tree across nodes);
#   §6.3, eqs. (12)–(14) (Allreduce volume $2\frac{p-1}{p}\,\text{numel}$ and $V_\text{tree}$).
# * JAX documentation, *Manual parallelism with `shard_map`*
#   (https://docs.jax.dev/en/latest/notebooks/shard_map.html), whose per-device printing
#   this notebook follows.
# * In-process CPU collectives: `jax/_src/xla_bridge.py`, `make_cpu_client` creates gloo (or
#   MPI) collectives only when `jax.distributed` is initialised (more than one process).
# * Ring Allreduce volume: Patarasuk and Yuan, *Bandwidth optimal all-reduce algorithms for
#   clusters of workstations*, JPDC 69(2), 2009. NCCL's algorithm choice: NCCL documentation,
#   `NCCL_ALGO`.
# * Hardware figures (printed in §4.8 from `costmodel.DGX_H100.sources`): NVIDIA DGX H100
#   user guide (NVLink 4 per GPU per direction; one 400 Gb/s NDR InfiniBand port per GPU).
