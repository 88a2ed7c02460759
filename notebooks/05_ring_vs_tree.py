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
# # 5. Ring Attention against Tree Attention
#
# **Prerequisites:** notebook 3 (the online softmax as a `combine` of partial states) and
# notebook 4 (meshes, `shard_map`, collectives, and an Allreduce's payload against its wire
# bytes). **Time:** about 30 minutes to read, plus a couple of minutes of measurement.
#
# Ring Attention (Liu, Zaharia and Abbeel, 2023) is the standard way to attend over a
# sequence sharded across devices, and the baseline the paper beats for decoding. Here we
# write it by hand, check it against the package, and then measure both methods from the
# compiled programs and the clock: what each sends, how much memory it needs, and how long
# it takes as the sequence and the device count grow.
#
# **Where this runs.** On 8 *simulated CPU devices* in one process, also on a machine with
# a GPU (the first cell tells JAX to use the CPU). Bytes and memory are read from the
# compiled programs, so they are what a cluster would run; the clock measures this machine,
# where the 8 devices share its cores and memory.
#
# **Learning objectives.** After this notebook you can
#
# * write Ring Attention decoding yourself with `lax.ppermute`: $p-1$ transfers of K/V
#   blocks, folded into an online softmax, and check it against `tae.ring_decode`;
# * compare ring and tree communication like with like (wire bytes per device), against the
#   formulas and the paper's eqs. 10–14;
# * read per-device memory from the compiled programs next to the paper's eqs. 8–9;
# * interpret latencies measured on simulated devices, and say why the paper's speedups
#   appear on a real cluster.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import itertools

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display
from jax import lax
from jax.sharding import PartitionSpec as P

from tree_attention_edu import plots
from tree_attention_edu.perf import benchmark, costmodel
from tree_attention_edu.perf.introspect import structs

jax.config.update("jax_enable_x64", True)  # float64 makes "equal" mean equal to ~1e-13
assert jax.device_count() == 8, jax.devices()

# %% [markdown]
# **Settings.** The defaults are sized for a 2-core laptop. `LARGE = True` switches to the
# paper's 16 heads × 128 and longer sequences: several minutes, and far more memory (the
# cell prints the size of the longest K/V cache it will time).

# %%
LARGE = False
H, HEAD_DIM = (16, 128) if LARGE else (8, 64)
TK_TIMED = (16384, 65536, 262144) if LARGE else (4096, 16384, 65536)
REPEATS = 5 if LARGE else 3
SHAPE = dict(q_heads=H, head_dim=HEAD_DIM)  # for introspect.structs
longest = benchmark.Problem(seq_len=TK_TIMED[-1], q_heads=H, kv_heads=H, head_dim=HEAD_DIM)
print(f"{H} heads x {HEAD_DIM}, float32; longest timed K/V cache: {longest.kv_bytes / 1e6:,.0f} MB")

# %% [markdown]
# ## 5.1 Ring Attention by hand
#
# ### 5.1.1 Passing blocks around the ring (ppermute)
#
# `lax.ppermute(x, "x", perm)` sends each device's `x` to another device: with
# `perm = [(i, i + 1 mod p)]`, device $i$ sends to device $i+1$ and receives from $i-1$, all
# at once. Repeated $p-1$ times, every block visits every device. Here each device starts
# with its own index as its "block", and we print what every device holds after each step.

# %%
mesh = tae.make_mesh(8, "x")
p = mesh.size
perm = [(i, (i + 1) % p) for i in range(p)]  # device i sends to device i + 1


def pass_around(block):  # block: this device's block, shape [1]
    seen = [block]
    for _ in range(p - 1):
        block = lax.ppermute(block, "x", perm)
        seen.append(block)
    return jnp.stack(seen, axis=1)  # [1, p]: the block held after each step


seen = jax.jit(jax.shard_map(pass_around, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(
    jnp.arange(p))
print("block held by device", "".join(f"{d:>4}" for d in range(p)))
for step in range(p):
    print(f"after {step} ppermutes ", "".join(f"{b:>4}" for b in np.asarray(seen[:, step])))
assert all(seen[i, s] == (i - s) % p for i in range(p) for s in range(p))

# %% [markdown]
# After $p-1$ steps each device has held every block exactly once, arriving in the order
# $i, i-1, \dots$. Each step moves one whole block per device: that is what Ring Attention
# pays for.
#
# ### 5.1.2 The online-softmax fold
#
# Each device keeps a running max $m$, sum $l$ and unnormalised output $o$ (notebook 3).
# At every step it scores the block it holds, rescales what it has folded so far to the new
# max, adds the block, and passes the block on to its neighbour:
#
# $$m' = \max(m, \max_a s_a),\quad l' = e^{m - m'} l + \sum_a e^{s_a - m'},\quad
# o' = e^{m - m'} o + \sum_a e^{s_a - m'} v_a .$$

# %%
kq, kk, kv = jax.random.split(jax.random.key(5), 3)
B, Tq, Hq, D, Tk = 2, 1, 4, 16, 1024
q = jax.random.normal(kq, (B, Tq, Hq, D))
k = jax.random.normal(kk, (B, Tk, Hq, D))
v = jax.random.normal(kv, (B, Tk, Hq, D))
scale = D**-0.5  # the package's default, 1/sqrt(D)


def ring_decode_by_hand(q, k, v, send_to=+1):
    """Inside shard_map: q replicated, k and v this device's block. This device's answer."""
    ring = [(i, (i + send_to) % p) for i in range(p)]  # device i sends to i + send_to
    m = jnp.full(q.shape[:3], -jnp.inf)  # nothing folded yet
    l = jnp.zeros(q.shape[:3])
    o = jnp.zeros(q.shape[:3] + v.shape[-1:])
    for step in range(p):
        s = jnp.einsum("bqhd,bkhd->bqhk", q, k) * scale  # scores against the block held
        m_new = jnp.maximum(m, s.max(-1))
        c = jnp.exp(m - m_new)  # rescales what was folded so far (0 at the first step)
        e = jnp.exp(s - m_new[..., None])
        l, o = l * c + e.sum(-1), o * c[..., None] + jnp.einsum("bqhk,bkhd->bqhd", e, v)
        m = m_new
        if step < p - 1:  # p − 1 transfers of a whole K/V block
            k, v = lax.ppermute((k, v), "x", ring)
    return (o / l[..., None])[None]  # [1, B, Tq, H, Dv]: stacked over devices


kv_spec = P(None, "x")
ring_by_hand = jax.jit(jax.shard_map(ring_decode_by_hand, mesh=mesh,
                                     in_specs=(P(), kv_spec, kv_spec), out_specs=P("x")))
per_device = ring_by_hand(q, k, v)
ring_pkg = tae.ring_decode(q, k, v, mesh=mesh)
for answer in per_device:  # every device ends with the whole answer
    np.testing.assert_allclose(answer, ring_pkg, rtol=1e-12, atol=1e-13)
np.testing.assert_allclose(ring_pkg, tae.attention(q, k, v), rtol=1e-12, atol=1e-13)
print(f"{p} devices, each folded {p} blocks in its own order: "
      "all equal tae.ring_decode == tae.attention   ✓")

# %% [markdown]
# The package's `ring_decode` is the same fold on `AttentionState`s (its `combine` is this
# rescale-and-add), with masks, padding and grouped-query attention added, and it sends each
# block on *before* computing on it so that the transfer can overlap the computation.
#
# Our loop above is a Python `for`, so the compiled program holds $p$ copies of its body,
# and XLA decides how many of the $p-1$ received blocks (and the einsums' temporaries) are
# alive at once. The package's ring is a `lax.scan` over $p-1$ steps instead: the loop's carry
# is the block in use, the `ppermute`'s result is the one in flight, and that is two K/V
# buffers whatever $p$ (double buffering). The compiled programs' temporaries, in K/V shards
# (one device's K and V), say what that is worth:

# %%
tk_hand = 65536
hand_shards = 2 * (tk_hand // p) * H * HEAD_DIM * 4  # one device's K and V, float32
temp_hand = tae.memory_stats(ring_by_hand, *structs(mesh, tk_hand, **SHAPE)).temp_bytes
temp_scan = tae.memory_stats(lambda q, k, v: tae.ring_decode(q, k, v, mesh=mesh),
                             *structs(mesh, tk_hand, **SHAPE)).temp_bytes
assert temp_scan < temp_hand
display(Markdown(
    f"At $T_k$ = {tk_hand:,} ({H} heads × {HEAD_DIM}) the unrolled ring by hand needs "
    f"**{temp_hand / hand_shards:.1f}** K/V shards of temporaries per device, the package's "
    f"scan ring **{temp_scan / hand_shards:.2f}**: the block in use and the block in flight "
    f"(section 5.4 reads where they are in the compiled program)."))

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Ring decoding is an online softmax whose blocks arrive by <code>ppermute</code>: p − 1 sequential
# transfers of a whole K/V block per device, after which every device holds the answer.</p></div>
#
# ## 5.2 The package: ring and tree on the same data
#
# Both package decoders are exact on the hard cases: causal decoding of two tokens, ragged
# lengths, grouped-query attention and a length that is not a multiple of 8.

# %%
k2 = jax.random.normal(kk, (2, 1000, 4, 32))
v2 = jax.random.normal(kv, (2, 1000, 4, 16))
q2 = jax.random.normal(kq, (2, 2, 8, 32))
kw = dict(causal=True, kv_lengths=jnp.array([1000, 333]))
want = tae.attention(q2, k2, v2, **kw)
np.testing.assert_allclose(tae.ring_decode(q2, k2, v2, mesh=mesh, **kw), want, rtol=1e-12, atol=1e-13)
np.testing.assert_allclose(tae.tree_decode(q2, k2, v2, mesh=mesh, **kw), want, rtol=1e-12, atol=1e-13)
print("ring_decode == tree_decode == attention (causal Tq = 2, ragged, GQA 8:4, Tk = 1000 on 8 devices)   ✓")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Ring and tree compute the same exact attention; they differ in what they move and hold.</p></div>
#
# ## 5.3 Bytes on the wire, like with like
#
# Two different things are easy to confuse (notebook 4, §4.7):
#
# * a collective's **payload**, the buffer each device contributes, which `collective_stats`
#   reads from the compiled program;
# * the **wire bytes**, what each device actually sends.
#
# For the ring they coincide: each `ppermute` sends its block once, over one link, so ring
# sends $B\,(p-1)\,\frac{T_k}{p}\,H_{kv}(D + D_v)$ numbers per device. For the tree they do not:
# its Allreduce payload is $B\,T_q\,H_q\,(D_v + 2)$ numbers, and a ring Allreduce puts
# $2\frac{p-1}{p}$ times that on the wire (the paper's eq. 12). We compare **wire bytes per
# device**, for one decode step, measured on compiled programs with abstract inputs
# (`introspect.structs`), so even a 1M-token cache costs nothing to measure.

# %%
def fn(method, mesh):
    return lambda q, k, v: method(q, k, v, mesh=mesh)


def payload(method, mesh, tk):
    return tae.collective_stats(fn(method, mesh), *structs(mesh, tk, **SHAPE)).total_bytes


def allreduce_wire(nbytes, p):
    return 2 * (p - 1) / p * nbytes  # ring Allreduce: reduce-scatter + all-gather


tks = [2**n for n in range(12, 21, 2)]  # 4k to 1M
wire = {"ring": [payload(tae.ring_decode, mesh, tk) for tk in tks],  # a ppermute sends once
        "tree": [allreduce_wire(payload(tae.tree_decode, mesh, tk), p) for tk in tks]}
formula = {"ring": [costmodel.ring_payload_bytes(1, tk, H, HEAD_DIM, HEAD_DIM, p) for tk in tks],
           "tree": [allreduce_wire(costmodel.tree_payload_bytes(1, 1, H, HEAD_DIM), p)] * len(tks)}
assert wire == formula  # exact, byte for byte
# The paper's eqs. 10 and 14, in elements x 4 bytes:
paper_ring = [4 * costmodel.paper_volume_ring(1, tk // p, H, HEAD_DIM, p) for tk in tks]
assert wire["tree"][0] == 4 * costmodel.paper_volume_tree(1, H, HEAD_DIM, p)  # eq. 14: equal
assert all(pr == w * p / (p - 1) for pr, w in zip(paper_ring, wire["ring"]))  # eq. 10: p steps

ps = [2, 4, 8]
wire_p = {"ring": [], "tree": []}
for n in ps:
    mesh_n = tae.make_mesh(n, "x")
    wire_p["ring"].append(payload(tae.ring_decode, mesh_n, 65536))
    wire_p["tree"].append(allreduce_wire(payload(tae.tree_decode, mesh_n, 65536), n))
assert wire_p["ring"] == [costmodel.ring_payload_bytes(1, 65536, H, HEAD_DIM, HEAD_DIM, n) for n in ps]

fig, axes = plt.subplots(1, 2, figsize=(10, 4))
ax = axes[0]
ax.plot(tks, wire["ring"], "o", color=plots.RING_COLOR, label="ring, measured")
ax.plot(tks, formula["ring"], "-", color=plots.RING_COLOR, alpha=0.5,
        label=r"ring: $(p-1)\frac{T_k}{p}H(D+D_v)\cdot 4$")
ax.plot(tks, wire["tree"], "s", color=plots.TREE_COLOR, label="tree, measured")
ax.plot(tks, formula["tree"], "-", color=plots.TREE_COLOR, alpha=0.5,
        label=r"tree: $2\frac{p-1}{p}H(D_v+2)\cdot 4$")
plots.pow2_axis(ax, tks)
ax.set_xlabel("sequence length $T_k$ (p = 8)")
ax.set_title("Against sequence length")
ax = axes[1]
ax.plot(ps, wire_p["ring"], "o-", color=plots.RING_COLOR, label="ring")
ax.plot(ps, wire_p["tree"], "s-", color=plots.TREE_COLOR, label="tree")
plots.pow2_axis(ax, ps)
ax.set_xlabel("devices p ($T_k$ = 64k)")
ax.set_title("Against device count")
for ax in axes:
    plots.bytes_axis(ax)
    ax.set_ylabel("wire bytes sent per device")
    ax.legend(fontsize=10)
    ax.grid(alpha=0.3)
fig.suptitle("Wire bytes per device for one decode step (tree: ring-Allreduce algorithm)")
fig.tight_layout()
plt.show()
print(f"at Tk = {tks[-1]:,}: ring sends {wire['ring'][-1]:,} B, tree {wire['tree'][-1]:,.0f} B "
      f"per device ({wire['ring'][-1] / wire['tree'][-1]:,.0f}x)")
print(f"paper eq. 10 counts p steps where ring makes p - 1 transfers: eq. 10 / measured = "
      f"{paper_ring[-1] / wire['ring'][-1]:.4f} = p/(p-1)")

# %% [markdown]
# *Figure: both panels show wire bytes per device, so the two colours are directly
# comparable. Left: measured points (markers) lie exactly on the formulas (lines); ring's
# line rises with $T_k$, tree's is flat. Right: at a fixed $T_k$, both grow by the same
# factor $(p-1)/p$ as devices are added, ring from a level set by the cache and tree from a
# level set by one query's output.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Counted the same way, ring sends (p−1)/p of the whole K/V cache per device and per step;
# tree sends 2(p−1)/p of one output row per head, whatever the sequence length.</p></div>
#
# ## 5.4 Memory
#
# The paper counts peak memory per device in elements (eqs. 8–9), with $t = T_k/p$ and
# $d = n_h d_h$: $\text{Mem}_\text{ring} = 4btd + 2bd$ (its own K/V block plus the one
# arriving) and $\text{Mem}_\text{tree} = 2btd + 2bd + 2bn_h$, so ring needs about 2× tree.
# We read the compiled programs' arguments, outputs and temporaries (`memory_stats`): what
# XLA will allocate. Their sum, the **total** per device, is what compares with eqs. 8–9.

# %%
mem = {"ring": [], "tree": []}
tks_mem = [2**n for n in range(12, 19, 2)]  # 4k to 256k
for tk in tks_mem:
    for name, method in (("ring", tae.ring_decode), ("tree", tae.tree_decode)):
        mem[name].append(tae.memory_stats(fn(method, mesh), *structs(mesh, tk, **SHAPE)))
eq8 = [4 * costmodel.paper_memory_ring(1, tk // p, H, HEAD_DIM) for tk in tks_mem]  # bytes
eq9 = [4 * costmodel.paper_memory_tree(1, tk // p, H, HEAD_DIM) for tk in tks_mem]
ring_total = [m.peak_bytes for m in mem["ring"]]
tree_total = [m.peak_bytes for m in mem["tree"]]
# A ring must hold its own block and the one arriving: it cannot go below eq. 8.
assert all(r >= e for r, e in zip(ring_total, eq8))
# Tree streams its shard; a fixed few blocks of kernel scratch on top of eq. 9 fade as t grows.
tree_vs_eq9 = [m / e for m, e in zip(tree_total, eq9)]
assert all(a > b >= 1.0 for a, b in itertools.pairwise(tree_vs_eq9)) and tree_vs_eq9[-1] < 1.02

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(tks_mem, ring_total, "o-", color=plots.RING_COLOR, label="ring: args + out + temp (XLA)")
ax.plot(tks_mem, tree_total, "s-", color=plots.TREE_COLOR, label="tree: args + out + temp (XLA)")
ax.plot(tks_mem, eq8, "--", color=plots.RING_COLOR, label="paper eq. 8: 4btd + 2bd")
ax.plot(tks_mem, eq9, "--", color=plots.TREE_COLOR, label="paper eq. 9: 2btd + 2bd + 2bn_h")
plots.pow2_axis(ax, tks_mem)
plots.bytes_axis(ax)
ax.set_xlabel("sequence length $T_k$ (p = 8)")
ax.set_ylabel("bytes per device")
ax.set_title("Memory per device")
ax.legend(fontsize=10)
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# *Figure: look at the gap between each solid line and its dashed formula. Both methods grow
# linearly in $T_k$. Tree's total (blue) closes in on eq. 9 as the shard grows: its local
# kernel streams the shard block by block without copying it (notebook 6). Ring's total
# (red) runs parallel to eq. 8 and above it: by a constant factor, not a growing one, since
# the scan ring keeps a fixed number of blocks alive.*
#
# The ratios, computed from the compiled programs, in K/V shards (one device's K and V,
# $2btd$ elements):

# %%
def shards(nbytes, tk):
    return nbytes / (2 * (tk // p) * H * HEAD_DIM * 4)  # float32


t_last = tks_mem[-1]
ring_args, ring_temp = (shards(mem["ring"][-1].argument_bytes, t_last),
                        shards(mem["ring"][-1].temp_bytes, t_last))
tree_args = shards(mem["tree"][-1].argument_bytes, t_last)
total_ratio = [r / t for r, t in zip(ring_total, tree_total)]
paper_ratio = [a / b for a, b in zip(eq8, eq9)]
# The scan ring: its own shard as arguments, two shards of temporaries (in use, in flight).
assert 0.99 < ring_args < 1.01 and 2.0 <= ring_temp < 2.05, (ring_args, ring_temp)
assert all(a < b for a, b in itertools.pairwise(total_ratio)) and 2.9 < total_ratio[-1] < 3.0
memory_md = (
    f"From $T_k$ = {tks_mem[0]:,} to {t_last:,} on {p} devices, ring's total memory per "
    f"device (arguments + outputs + temporaries) is **{min(total_ratio):.2f}× to "
    f"{max(total_ratio):.2f}×** tree's, where the paper's eqs. 8–9 predict "
    f"{np.mean(paper_ratio):.2f}×. At the longest length ring holds "
    f"{ring_args:.2f} shard as arguments and {ring_temp:.2f} shards of temporaries, "
    f"**{ring_args + ring_temp:.2f} shards** in all where eq. 8 counts two; tree holds "
    f"{tree_args:.2f} shard plus {mem['tree'][-1].temp_bytes / 1e6:.2f} MB of kernel scratch "
    f"({tree_vs_eq9[-1]:.3f}× eq. 9)."
)
display(Markdown(memory_md))

# %% [markdown]
# Where is ring's third shard? The compiled program says. Below are its instructions that
# produce a whole K or V block (shape `[1, t, H, D]`): the arguments are copied into the
# loop's carry before the loop starts, and inside the loop each `collective-permute`
# writes the block arriving from the neighbour into a buffer of its own.

# %%
block = f"f32[1,{t_last // p},{H},{HEAD_DIM}]"
hlo = jax.jit(fn(tae.ring_decode, mesh)).lower(*structs(mesh, t_last, **SHAPE)).compile().as_text()
entry = hlo[hlo.index("\nENTRY"):]
carry_copies = [ln.split(" = ")[0].strip() for ln in entry.splitlines()
                if ln.split(" = ")[-1].startswith(block) and " copy(%param" in ln]
in_flight = [ln.split(" = ")[0].strip() for ln in hlo.splitlines()
             if ln.split(" = ")[-1].startswith(block) and " collective-permute(" in ln]
print(f"one K or V block: {block}")
print("loop carry, copied from the arguments (K and V):", carry_copies)
print("collective-permute outputs, the blocks in flight (K and V):", in_flight)
assert len(carry_copies) == 2 and len(in_flight) == 2

# %% [markdown]
# So the ring's memory is three shards, each for a reason:
#
# 1. **The arguments**: the device's own K/V shard. A decode step must not overwrite it:
#    the cache persists, and the next token reads it again. XLA therefore copies it into
#    the loop's carry instead of rotating blocks through it.
# 2. **The block in use**: the loop's carry, the block being folded at this step.
# 3. **The block in flight**: the `ppermute`'s receive buffer, filled while the block in
#    use is computed on.
#
# The paper's eq. 8 counts two, because it lets the arriving block overwrite the device's
# own shard: right for a single forward pass whose K/V are thrown away, not for a decode
# step over a cache that must survive it. Tree needs the shard and a few kernel blocks of
# scratch, so the measured ratio tends to three, not two. Double buffering has brought ring
# down to the fewest buffers a ring can have here; it cannot remove the second K/V block
# that ring decoding needs and tree decoding does not.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Tree needs its shard plus a fixed kernel scratch. The ring needs its own
# shard, which a decode step must keep, plus the block in use and the block in flight:
# about three shards against tree's one, where the paper's eqs. 8–9 count two.</p></div>
#
# ## 5.5 Latency on simulated devices
#
# Finally the clock. All 8 simulated devices share this machine's cores, so a "collective"
# is a memory copy and 8 devices are not 8× faster than one. What the measurement does show
# is the cost of moving K/V around: ring copies the whole cache through the ring, tree
# copies kilobytes. Timings depend on the machine, so these cells' outputs are not checked;
# only a loose, robust property is asserted (ring is slower than tree).

# %%
# NBVAL_IGNORE_OUTPUT
records = []
for tk in TK_TIMED:
    problem = benchmark.Problem(seq_len=tk, q_heads=H, kv_heads=H, head_dim=HEAD_DIM)
    records += benchmark.run(mesh, problem, methods=["single", "tree", "ring"], repeats=REPEATS)
print(benchmark.table(records))

# %%
by = {(r.method, r.seq_len): r for r in records}
for r in records:
    assert r.max_abs_err < 1e-5, r  # every timed method computed the right answer
fig, ax = plt.subplots(figsize=(9, 4))
for name, style in (("ring", "o-"), ("tree", "s-"), ("single", "^--")):
    ax.plot(TK_TIMED, [by[(name, tk)].median_s * 1e3 for tk in TK_TIMED], style,
            color=plots.method_color(name),
            label=name if name != "single" else "one device\n(dot_product_attention)")
plots.pow2_axis(ax, TK_TIMED)
plots.plain_log_axis(ax)
ax.set_xlabel("sequence length $T_k$")
ax.set_ylabel("median latency (ms)")
ax.set_title("Decode latency, 8 simulated devices")
ax.legend(fontsize=10, loc="center left", bbox_to_anchor=(1.01, 0.5))
fig.tight_layout()
ax.grid(alpha=0.3)
plt.show()

# %%
# NBVAL_IGNORE_OUTPUT
ms = {(name, tk): by[(name, tk)].median_s * 1e3 for name in ("ring", "tree", "single")
      for tk in TK_TIMED}
speedup = {tk: ms[("ring", tk)] / ms[("tree", tk)] for tk in TK_TIMED}
assert all(s > 1 for s in speedup.values()), speedup  # robust: ring moves the whole cache
at = TK_TIMED[-1]
vs_single = ms[("tree", at)] / ms[("single", at)]
display(Markdown(
    f"*Figure: median decode latency against sequence length, measured when this notebook "
    f"ran. Ring (red) took {min(speedup.values()):.1f}× to {max(speedup.values()):.1f}× "
    f"tree's time (blue). At $T_k$ = {at:,}: ring {ms[('ring', at)]:.1f} ms, tree "
    f"{ms[('tree', at)]:.1f} ms, one device {ms[('single', at)]:.1f} ms, so tree took "
    f"{vs_single:.2f}× one device's time.*"
))

# %% [markdown]
# Ring pays for moving the cache $p-1$ times, and the gap between red and blue is that cost.
# The comparison with one device (grey) is not about communication: the 8 simulated devices
# share this machine's cores and memory bandwidth, and the single-device baseline runs a
# different kernel (`jax.nn.dot_product_attention`; notebook 6 compares kernels), so tree
# may come out faster or slower than one device here, depending on the machine.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Even with no network, ring is slower than tree at every length measured here: it copies
# the cache around the ring, while tree copies kilobytes.</p></div>
#
# ## 5.6 Why the paper's speedups appear
#
# On a real cluster each device has its own memory bandwidth, so the local work of both
# methods shrinks as $T_k/p$. What remains is communication:
#
# * Ring moves $(p-1)\,t\,H(D+D_v)$ elements per device per decode step, in $p-1$ sequential
#   transfers. It overlaps those transfers with computation, but a decode step has little
#   computation to hide behind (one query), so once K/V blocks cross InfiniBand the transfer
#   dominates. The slowest link sets the pace of every step: Ring Attention is not
#   topology-aware (paper §5.3).
# * Tree sends $O(B\,T_q\,H\,D_v)$ numbers, independent of $T_k$; its Allreduces cost a few
#   latency terms $\alpha$ of the network, $\log p$ of them for a tree-shaped Allreduce, and
#   the topology-aware schedule keeps most traffic on NVLink (notebook 4, §4.8).
#
# So the ratio grows with both $T_k$ and $p$, as the paper's Figure 3 shows (close to 8× at
# 128 GPUs and 5.12M tokens, §6.1). Notebook 6 turns this into a calibrated cost model.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>On a cluster, ring's cost is bytes over the slowest link, p − 1 times per token; tree's
# is a few network latencies. The gap grows with both the sequence and the device count.</p></div>
#
# ## 5.7 Summary
#
# * Ring Attention decoding is an online softmax over K/V blocks that travel by `ppermute`;
#   written by hand in a dozen lines, it equals `tae.ring_decode` and attention.
# * Counted like with like (wire bytes per device), ring sends $(p-1)/p$ of the K/V cache
#   per decode step, growing with the sequence; tree sends $2\frac{p-1}{p}B\,T_q\,H_q(D_v+2)$
#   numbers, whatever the sequence length. Measured bytes equal the formulas exactly.
# * Memory and the measured ratios, computed from the compiled programs above:

# %%
at_bytes = tks[-1]
display(Markdown(
    f"* Wire bytes at $T_k$ = {at_bytes:,}: ring {plots.bytes_label(wire['ring'][-1])}, tree "
    f"{plots.bytes_label(wire['tree'][-1])} per device, a ratio of "
    f"{wire['ring'][-1] / wire['tree'][-1]:,.0f}.\n"
    f"* Memory: ring's total per device (arguments + outputs + temporaries) is "
    f"{min(total_ratio):.2f}× to {max(total_ratio):.2f}× tree's over $T_k$ = "
    f"{tks_mem[0]:,} to {tks_mem[-1]:,} (eqs. 8–9 predict {np.mean(paper_ratio):.2f}×): "
    f"{ring_args + ring_temp:.2f} shards, its own (kept for the next token), the block in use "
    f"and the block in flight, against tree's {tree_args:.2f} and scratch."
))

# %% [markdown]
# * On simulated devices ring was slower than tree at every length timed (§5.5 prints the
#   measured ratios); on a cluster the gap grows with the network's cost per byte and
#   with $p$.
#
# ## 5.8 Exercises
#
# **Exercise 1 (predict, then measure).** Going from $p = 4$ to $p = 8$ devices at a fixed
# $T_k$ = 64k, by what factor do ring's and tree's wire bytes per device change? Predict
# both factors before you run the answer.
#
# <details><summary>Answer</summary>
#
# Both change by $\frac{7/8}{3/4} = 7/6$: ring's because each device forwards $p-1$ blocks
# of $T_k/p$ keys, which is $(p-1)/p$ of the cache; tree's because the payload is fixed and
# the ring-Allreduce factor $2(p-1)/p$ grows the same way. Neither volume explodes with
# $p$. What grows is ring's number of sequential transfers, $p-1$, each paying the link's
# latency.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
i4, i8 = ps.index(4), ps.index(8)
for name in ("ring", "tree"):
    factor = wire_p[name][i8] / wire_p[name][i4]
    print(f"{name}: x{factor:.4f}")
    np.testing.assert_allclose(factor, 7 / 6, rtol=1e-12)

# %% [markdown]
# **Exercise 2.** At what $T_k$ (a power of two) does ring's volume per device first reach
# 1 GB for this notebook's head configuration? Use `costmodel.ring_payload_bytes` and
# confirm with `collective_stats`.
#
# <details><summary>Answer</summary>
#
# Solve $(p-1)\,\frac{T_k}{p}\,H\cdot 2D\cdot 4$ bytes $\ge$ 1 GB for $T_k$; the cell finds the
# first power of two and confirms it on the compiled program.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
tk_gb = next(2**n for n in range(10, 30)
             if costmodel.ring_payload_bytes(1, 2**n, H, HEAD_DIM, HEAD_DIM, p) >= 1e9)
assert payload(tae.ring_decode, mesh, tk_gb) >= 1e9  # the compiled program agrees
print(f"ring first sends >= 1 GB per device at Tk = {tk_gb:,}")

# %% [markdown]
# **Exercise 3.** For $p = 8$ and one query, is there *any* $T_k \ge 8$ at which ring puts
# fewer bytes on the wire than tree?
#
# <details><summary>Answer</summary>
#
# No. Ring sends $\frac{p-1}{p}T_k\,H\cdot 2D$ numbers, tree $2\frac{p-1}{p}H(D+2)$; ring is
# smaller only if $T_k\,D < D + 2$, that is for $T_k = 1$. With one key per device or more,
# ring already sends more.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
tree_wire = allreduce_wire(costmodel.tree_payload_bytes(1, 1, H, HEAD_DIM), p)
assert all(costmodel.ring_payload_bytes(1, tk, H, HEAD_DIM, HEAD_DIM, p) > tree_wire
           for tk in range(8, 4096, 8))
print("ring sends more than tree at every Tk >= 8   ✓")

# %% [markdown]
# **Exercise 4.** Turn the ring around in `ring_decode_by_hand` (device $i$ sends to
# $i-1$). Which blocks does each device fold, in which order, and does the answer change?
#
# <details><summary>Answer</summary>
#
# Each device now folds blocks $i, i+1, \dots$: a different order, the same set. The online
# softmax is a fold of an associative and commutative `combine` (notebook 3), so the
# answer is the same up to float64 rounding.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
reverse = jax.jit(jax.shard_map(lambda q, k, v: ring_decode_by_hand(q, k, v, send_to=-1),
                                mesh=mesh, in_specs=(P(), kv_spec, kv_spec), out_specs=P("x")))
backward = reverse(q, k, v)
for answer in backward:
    np.testing.assert_allclose(answer, ring_pkg, rtol=1e-12, atol=1e-13)
assert not np.array_equal(backward, per_device)  # other orders, other roundings
print(f"reversed ring: same answer on every device, to {np.abs(backward - per_device).max():.0e}   ✓")

# %% [markdown]
# ## 5.9 References
#
# * Liu, Zaharia and Abbeel, *Ring Attention with Blockwise Transformers for Near-Infinite
#   Context*, arXiv 2310.01889: the ring of K/V blocks and its overlap of transfer with
#   computation.
# * Milakov and Gimelshein, *Online normalizer calculation for softmax*, arXiv 1805.02867:
#   the online-softmax rescaling of §5.1.2.
# * Shyam et al., *Tree Attention*, arXiv 2408.04093: §5.3 (Ring Attention is not
#   topology-aware), §6.1 and Figure 3 (latency against sequence length and GPUs),
#   §6.2, eqs. (8)–(9) (peak memory), §6.3, eqs. (10)–(14) (communication volume).
# * Ring Allreduce volume $2\frac{p-1}{p}$ (the paper's eq. 12, which cites Anthony et al.,
#   2024): Patarasuk and Yuan, *Bandwidth optimal all-reduce algorithms for clusters of
#   workstations*, JPDC 69(2), 2009.
# * JAX documentation, *Manual parallelism with `shard_map`*
#   (https://docs.jax.dev/en/latest/notebooks/shard_map.html): `ppermute` and collectives.
