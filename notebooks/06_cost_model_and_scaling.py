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
# # 6. A cost model, calibrated here, and the paper's scaling claims
#
# Two questions: how fast is decoding on the hardware in front of us, and what would it do on
# a cluster we do not have? We answer the first by measuring. For the second we use an
# alpha-beta model (`tree_attention_edu.perf.costmodel`): we measure its parameters on this
# machine and compare its predictions with measured decode latencies. That comparison is
# not a validation: how far the predictions miss varies from run to run, and section 6.3
# prints this run's errors. Then we fill the model with published DGX H100 figures and
# compare it with what the paper reports. That step is an extrapolation: the published
# figures were not measured here, and XLA:CPU's in-process collectives are memory copies,
# not NCCL. Read its numbers as orders of magnitude.
#
# **Where it runs:** 8 simulated CPU devices in one process (notebook 1, "Where it runs").
# Every measured number in this notebook is XLA:CPU's on this machine, except in sections
# 6.2.1 and 6.2.2, which read back the records of two sessions on NVIDIA H200s
# (`results/gpu/`): records, not tests this notebook runs on a GPU. Every other GPU number is the model's,
# from published figures, or the paper's own.
#
# **Prerequisites.** Notebook 4 (tree decoding on a mesh, Allreduce) and notebook 5 (Ring
# Attention: its redundant compute and its bytes on the wire). The roofline model helps, as
# in "How to Scale Your Model", part 1; this notebook introduces what it needs.
#
# **Time.** About 50 minutes to read and work the exercises; under a minute to run on an
# idle 2-core CPU.
#
# **Learning objectives.** After this notebook you can
#
# * compute the arithmetic intensity of a decode step, check it against a compiled
#   program's flop count, and say why decode is bound by memory bandwidth (its roofline),
#   in float32 and in bf16;
# * write down the alpha-beta cost of a link, of ring and recursive-doubling Allreduce
#   (by counting the steps of each algorithm), and of tree and ring decoding; fit a link's
#   α and β, and calibrate the model on real devices;
# * predict the paper's microbenchmark and Llama 3.1-8B setting from published hardware
#   figures, and say what such a prediction can and cannot tell about the paper's
#   measurements.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises

import jax

jax.config.update("jax_platforms", "cpu")  # CPU devices even on a GPU machine (notebook 1)
import contextlib
import dataclasses
import inspect
import itertools
import json
import math
from pathlib import Path
from unittest import mock

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown
from matplotlib import ticker

from tree_attention_edu import plots
from tree_attention_edu.core import kernels
from tree_attention_edu.core.merges import AUTO_MERGES
from tree_attention_edu.course.printing import sci
from tree_attention_edu.perf import benchmark, calibrate, links, localfit, microbench, modelcheck
from tree_attention_edu.perf import costmodel as cm

jax.config.update("jax_enable_x64", True)
assert jax.device_count() == 8, jax.devices()
mesh = tae.make_mesh(8, "x")

# Colours: ring red, tree blue (plots.color); series that are neither are dark grey, told
# apart by line style and marker; bounds and the paper's figures light grey.
GREY, LIGHT = plots.NEUTRAL_COLOR, plots.color("baseline")
STYLES = ("o-", "s--", "^-.", "d:")

# %% [markdown]
# **Settings.** The defaults keep this notebook under a minute on an idle 2-core CPU.
# `LARGE = True` runs the paper's head shape and longer sequences (several minutes).

# %%
LARGE = False
H, HEAD_DIM = (16, 128) if LARGE else (8, 64)
TK_BW = 65536 if LARGE else 16384  # sequence length of the bandwidth measurement
TK_CAL = (16384, 32768, 65536, 131072) if LARGE else (8192, 16384, 32768)
REPEATS = 5 if LARGE else 3
problem = benchmark.Problem(seq_len=TK_BW, q_heads=H, kv_heads=H, head_dim=HEAD_DIM)

# %% [markdown]
# ## 6.1 The roofline of decode
#
# One decode step reads every key and value once. Per key and query head it does a dot
# product $q\cdot k$ ($2D$ flops: $D$ multiply-adds) and adds $p\,v$ to the numerator
# ($2D_v$ flops). With $G = H_q/H_{kv}$ query heads sharing each kv head and $T_q$ queries
# per sequence, its **arithmetic intensity** (flops per byte of K and V read) is
#
# $$ I = \frac{2\, T_q\, G H_{kv} T_k (D + D_v)}{H_{kv} T_k (D + D_v) \cdot \text{itemsize}}
#      = \frac{2\, G\, T_q}{\text{itemsize}} \ \text{flop/byte}. $$
#
# The sequence length, the head dimension and the batch cancel. The numerator is a claim
# about what a decode step computes, so we check it against an independent count: XLA's
# `cost_analysis` of a compiled decode step (plain `jnp`, no loop), for multi-head and
# grouped-query attention and several queries. XLA counts every op, the softmax's
# exponentials included, so it may exceed the two products' count by a little.

# %%
def decode_step(q, k, v):
    """One decode step, grouped-query: q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D]."""
    b, tq, hq, d = q.shape
    qg = q.reshape(b, tq, k.shape[2], hq // k.shape[2], d)
    w = jax.nn.softmax(jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) * d**-0.5, axis=-1)
    return jnp.einsum("bhgqk,bkhd->bqhgd", w, v).reshape(b, tq, hq, -1)


print(f"{'Hq':>4}{'Hkv':>5}{'Tq':>4}{'XLA flops':>14}{'formula':>14}{'ratio':>8}"
      f"{'XLA bytes / K+V bytes':>24}")
for hq, hkv, tq in ((8, 8, 1), (32, 8, 1), (8, 8, 4)):
    tk, d = 4096, 128
    args = [jax.ShapeDtypeStruct(s, jnp.float32)
            for s in ((1, tq, hq, d), (1, tk, hkv, d), (1, tk, hkv, d))]
    cost = jax.jit(decode_step).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    formula = 2 * tq * hq * tk * (d + d)  # 2·Tq·Hq·Tk·(D + Dv), batch 1
    kv_bytes = tk * hkv * (d + d) * 4
    print(f"{hq:>4}{hkv:>5}{tq:>4}{cost['flops']:>14,.0f}{formula:>14,}"
          f"{cost['flops'] / formula:>8.3f}{cost['bytes accessed'] / kv_bytes:>24.2f}")
    assert 1 <= cost["flops"] / formula < 1.02  # the formula counts the program's flops
    assert cost["bytes accessed"] >= kv_bytes  # the cache is read at least once
    assert 2.5 < cost["bytes accessed"] / kv_bytes < 3.5  # "about three times the cache"
    assert cm.decode_flops(1, tk, hq, d, d, tq) == formula

# %% [markdown]
# The flops agree to within 2%. The bytes do not: XLA:CPU's program touches about three
# times the cache, because this plain `jnp` step copies K and V into other layouts and then
# reads the copies: read, write and read again (the scores are a fraction of a percent of
# it; section 6.2 measures a kernel that makes no copy). The formula's bytes are
# what an ideal kernel reads, once.
#
# A device is memory-bound below its **ridge point**, peak flops divided by memory
# bandwidth; there its time is (bytes of K and V) / (memory bandwidth), the roofline that
# `costmodel` uses. The ridge point depends on the dtype: an H100 SXM's 989 TFLOP/s are
# dense bf16 on the tensor cores; plain float32 runs on the CUDA cores at 67 TFLOP/s (the
# H100 datasheet).

# %%
llama, h100 = cm.LLAMA_3_1_8B, cm.DGX_H100
H100_FP32_FLOPS = 67e12  # NVIDIA H100 datasheet, SXM5: FP32 (CUDA cores), TFLOP/s
ridge = {"bf16": h100.ridge_point, "float32": H100_FP32_FLOPS / h100.mem_Bps}
llama_group = llama.q_heads // llama.kv_heads
points = {"float32 multi-head": (cm.decode_intensity(1, 4), "float32"),
          "bf16 multi-head": (cm.decode_intensity(1, 2), "bf16"),
          "Llama 3.1-8B bf16 GQA": (cm.decode_intensity(llama_group, llama.itemsize), "bf16")}
assert [i for i, _ in points.values()] == [0.5, 1.0, 4.0]
below = {name: ridge[dt] / i for name, (i, dt) in points.items()}
assert all(b > 10 for b in below.values())  # memory-bound by more than an order

for dt, r in ridge.items():
    print(f"H100 ridge point, {dt:>7}: {r:6.1f} flop/byte")
for name, (i, dt) in points.items():
    print(f"{name:>22}: I = {i:g} flop/byte, {below[name]:.0f}x below the {dt} ridge")
Markdown(
    f"Decode is {points['float32 multi-head'][0]:g} flop/byte in float32 multi-head "
    f"attention, {points['bf16 multi-head'][0]:g} in bf16, and "
    f"{points['Llama 3.1-8B bf16 GQA'][0]:g} for Llama 3.1-8B's bf16 grouped-query attention "
    f"($G = {llama.q_heads}/{llama.kv_heads} = {llama_group}$). An H100's ridge point is "
    f"about {ridge['bf16']:.0f} flop/byte in bf16 and {ridge['float32']:.0f} in float32, so "
    f"decode sits {min(below.values()):.0f}× to {max(below.values()):.0f}× below the ridge "
    f"of its own dtype.")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
xs = np.logspace(-1, 3.5, 200)
ax.plot(xs, np.minimum(h100.flops, xs * h100.mem_Bps) / 1e12, "-", color=LIGHT, lw=2,
        label="H100 SXM roofline, bf16")
ax.plot(xs, np.minimum(H100_FP32_FLOPS, xs * h100.mem_Bps) / 1e12, "--", color=LIGHT, lw=2,
        label="H100 SXM roofline, float32")
for (name, (i, _)), ls in zip(points.items(), ("-.", "--", ":"), strict=True):
    ax.axvline(i, color=GREY, ls=ls, label=f"decode, {name}: {i:g} flop/byte")
plots.plain_log_axis(ax, "x")
plots.plain_log_axis(ax, "y")
ax.set_xlabel("arithmetic intensity (flop/byte)")
ax.set_ylabel("attainable TFLOP/s")
ax.set_title("Decode is memory-bound")
ax.legend(fontsize=8, loc="lower right")
plt.show()

# %% [markdown]
# *Figure: the grey rooflines are the H100's attainable flop rate at each intensity (the
# sloped part is memory bandwidth times intensity, the flat part the peak: bf16 solid,
# float32 dashed). Look at the gap between the dark vertical lines, the decode
# intensities, and the knee of each roofline: everything left of the knee runs at the speed
# of memory.*
#
# **Quiz (predict, then run).** Speculative (multi-token) decoding puts several query
# tokens $T_q$ of one sequence into one step against the same cache. From how many query
# tokens on is the attention of a bf16 decode step of Llama 3.1-8B compute-bound on an H100?
# (Attention only: the step's weight products have an intensity of their own.)
#
# <details><summary>Answer</summary>
#
# $I = 2 G T_q/\text{itemsize} = 4 T_q$ for $G = 4$ in bf16, so the step turns
# compute-bound once $4 T_q$ exceeds the bf16 ridge point, at the $T_q$ the cell below
# prints. Below that, extra query tokens are almost free: the step still reads the same
# bytes.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_1", "locked": false, "schema_version": 3, "solution": true, "task": false}
tq_min = next(tq for tq in range(1, 1000)
              if cm.decode_intensity(llama_group, llama.itemsize, tq) > ridge["bf16"])
print("compute-bound from T_q =", tq_min)
assert tq_min == math.ceil(ridge["bf16"] / (2 * llama_group / llama.itemsize))

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A decode step does 2·G·Tq/itemsize flops per byte it reads, whatever the sequence length
# (XLA's count of a compiled step agrees), far below an H100's ridge point in either dtype.
# Its time is the bytes of K and V over the memory bandwidth.</p></div>

# %% [markdown]
# ## 6.2 How close the kernels come to this machine's limit
#
# `calibrate.bandwidth` times, in the same run, a reference read of the machine's memory (a
# jitted `jnp.sum` over 512 MB on one device) and each kernel's effective bandwidth (K + V
# bytes over median time). The reference is what one device reads, not a hard limit: the 8
# simulated devices together may read faster.
#
# * `einsum_reference` is the textbook einsum → softmax → einsum on `[B, T, H, D]`
#   (`states.local_state`). XLA copies K and V into head-major order before the
#   matrix-vector products: temp memory as large as the cache, and the time to write it.
# * `xla_bthd` is the package's `"xla"` kernel on the same layout: it walks the cache in
#   blocks of `kernels.DEFAULT_BLOCK` keys (printed below), transposes each while it is in
#   cache, and folds it into an online softmax (`lax.scan`). On this CPU nothing cache-sized
#   is written (on a GPU XLA does write a copy: section 6.2.1).
# * `xla_bhtd` reads a head-major cache `[B, H, T, D]`, where each head's keys are
#   contiguous: one streaming pass. This is the layout `tree_attention_edu.llama.model` uses.
# * `tree_*` run the same kernels on 8 simulated devices, which share this machine's memory
#   bus. (Timings depend on the machine; this cell's output is not checked.)

# %%
# NBVAL_IGNORE_OUTPUT
bw = calibrate.bandwidth(mesh, problem, repeats=REPEATS,
                         names=["einsum_reference", "xla_bthd", "xla_bhtd", "tree_bthd",
                                "tree_bhtd"])
print(calibrate.bandwidth_table(bw))

# %% [markdown]
# Temp memory is a property of the compiled program, not of the clock, so it is asserted:
# the streaming kernels allocate under 5% of the cache, the reference a full copy.

# %%
kernels_bw = bw["kernels"]
for name in ("xla_bthd", "xla_bhtd", "tree_bthd", "tree_bhtd"):
    assert kernels_bw[name]["temp_bytes"] <= 0.05 * kernels_bw[name]["kv_bytes"], name
assert kernels_bw["einsum_reference"]["temp_bytes"] >= 0.5 * problem.kv_bytes
print(f"streaming block: {kernels.DEFAULT_BLOCK} keys")
print("temp / KV bytes:", {k: f"{r['temp_bytes'] / r['kv_bytes']:.1%}"
                           for k, r in kernels_bw.items()})

fig, ax = plt.subplots(figsize=(7, 3))
names = list(kernels_bw)
ax.barh(names, [kernels_bw[n]["fraction"] for n in names],
        color=[plots.color("tree") if n.startswith("tree") else LIGHT for n in names])
ax.axvline(1.0, color="k", lw=1)
ax.axvline(0.5, color=GREY, ls="--", lw=1, label="50% of the reference read")
ax.set_xlabel("fraction of the reference read bandwidth")
ax.set_title(f"Decode kernels, Tk={TK_BW}, {H}×{HEAD_DIM}, float32")
ax.legend(fontsize=9)
plt.show()

# %% [markdown]
# *Figure: each bar is one kernel's share of the reference read bandwidth measured in the
# same run (the black line). Blue bars are tree decoding on the 8 devices, grey bars run
# on one. Compare the head-major (`bhtd`) kernels with the einsum reference, which first
# writes a copy of the cache. Timings vary from run to run; the bars are not checked.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A decode kernel is judged by the fraction of the memory bandwidth it reaches. What it
# needs is to read the cache once, with no cache-sized temporary (asserted above for the
# streaming kernels); this CPU's timings are not checked, and §6.2.1 shows what such kernels
# reached on an H200.</p></div>

# %% [markdown]
# ### 6.2.1 On a real GPU: the recorded figures
#
# Two of the same kernels (`xla_bthd`, `xla_bhtd`) ran on one NVIDIA H200
# (`scripts/gpu_bench.py`; the commands and the logs are in `results/gpu/`), with three
# more: `cudnn`, the package's adapter to cuDNN's flash attention (16-bit caches only);
# `dot_product_attention`, JAX's `jax.nn.dot_product_attention`; and `tree_decode` with its
# default `local_kernel="auto"`, which on a GPU picks `cudnn` for 16-bit caches in the
# `bthd` layout and the xla kernel otherwise (not the `merge="auto"` of notebook 8). A
# kernel's "fraction of nominal" is its bandwidth over the H200's published HBM peak. The
# shapes are named `gqa32_8x128_b8` (32 query heads sharing 8 kv heads, head width 128,
# batch 8) and `h16x128_b1` (16 heads, no grouping, width 128, batch 1). That is one recorded session, and the next cell is **a record
# read back**: nothing in it runs on a GPU, so it runs anywhere, and its assertions check
# the record, not a GPU. What it can check is the record's consistency: each kernel's GB/s
# and fraction of nominal are recomputed from its raw fields (the K + V bytes, from the
# shape and dtype, and the median seconds), and the best kernel is found again from them.
# It also checks the target the session was run for, a bfloat16 kernel at $T_k \ge$ 128k
# reaching at least 70% of the nominal bandwidth, length by length: the target is met from
# 256k keys on, not at 128k itself (the cell prints the best bf16 run at each length).
# Each kernel's effective bandwidth (K + V bytes over the
# median step) times the decode intensity of section 6.1 is the flop rate it reached: a
# point under the H200's roofline. A kernel at the memory limit sits on the sloped line.
#
# This sweep ran at XLA's default matmul precision, which on NVIDIA GPUs computes float32
# products in TF32 (TensorFloat-32: the tensor cores round float32 operands to about three
# decimal digits and accumulate in float32) and bf16 products with bf16 operands. The package has since pinned its
# kernels' products to `numerics.PRECISION` (HIGHEST: float32 products in float32), so the
# head-major `xla_bhtd` rows below are not what the package runs now. Later calls on the
# same kind of GPU (`results/gpu/README.md`, "5. Precision") measured the cost. On float32
# caches they showed no clear cost, comparing runs on different machines; a second H200
# session (§6.2.2, the "second lease": the machine is lent for one session), comparing both
# settings in one run (one einsum per product on a head-major cache, at
# HIGHEST and at TF32: §6.2.2's `einsum_bhtd_hi_hi` and `einsum_bhtd_df_df` rows, asserted
# there), found HIGHEST slower on float32 caches too. On bf16 caches `xla_bhtd`
# with GQA at 128k fell from this
# record's 2,995 GB/s to 1,381 and 1,402 GB/s, less than half (the cell recomputes all
# three from the record: the later two are its `highest_precision_runs`).
# `cudnn`, which "auto" picks for bf16 caches in the `bthd` layout, is unaffected; on
# head-major (`bhtd`) bf16 caches, the layout of `llama.model`, "auto" runs `xla_bhtd` and
# paid this cost; §6.2.2 measures an einsum form that recovers most of it (the package's
# kernel in that form has not run on a GPU).

# %%
ROOT = Path(tae.__file__).resolve().parent.parent  # the repository
gpu = json.loads((ROOT / "results" / "gpu" / "nvidia_h200.json").read_text())
H200_BF16_FLOPS, H200_FP32_FLOPS = 989e12, 67e12  # dense, as the H100 (NVIDIA's datasheets)
nominal = gpu["device"]["nominal_gbs"] * 1e9
timed = [r for r in gpu["bandwidth"]["kernels"].values() if r.get("gbs")]
longest = {}  # (kernel, dtype, shape) -> the record at its longest timed Tk
for r in timed:
    key = (r["kernel"], r["dtype"], r["shape"])
    if r["seq_len"] > longest.get(key, {"seq_len": 0})["seq_len"]:
        longest[key] = r
print(f"{gpu['device']['kind']}, jax {gpu['device']['jax_version']}: nominal "
      f"{nominal / 1e9:,.0f} GB/s; a jnp.sum over 2 GiB read "
      f"{gpu['device']['measured_gbs']:,.0f} GB/s")
print(f"{'kernel':<22}{'dtype':<10}{'shape':<16}{'Tk':>9}{'GB/s':>8}{'of nominal':>12}")
for (kernel, dtype, shape), r in sorted(longest.items(), key=lambda kv: -kv[1]["gbs"]):
    print(f"{kernel:<22}{dtype:<10}{shape:<16}{r['seq_len']:>9,}{r['gbs']:>8,.0f}"
          f"{r['gbs'] * 1e9 / nominal:>12.1%}")
# A record read back: recompute from each run's raw fields (shape, dtype, median seconds)
# what the record derived from them, rather than compare the record with itself.
ITEMSIZE = {"bfloat16": 2, "float32": 4}
for r in timed:
    assert r["kv_bytes"] == 2 * r["batch"] * r["seq_len"] * r["kv_heads"] * r["head_dim"] * (
        ITEMSIZE[r["dtype"]])  # K + V
    np.testing.assert_allclose(r["gbs"], r["kv_bytes"] / r["median_s"] / 1e9, rtol=1e-9)
    np.testing.assert_allclose(r["frac_nominal"], r["kv_bytes"] / r["median_s"] / nominal,
                               rtol=1e-9)
fastest = max((r for r in timed if r["dtype"] == "bfloat16" and r["seq_len"] >= 2**17),
              key=lambda r: r["kv_bytes"] / r["median_s"])  # found again from bytes and seconds
best = gpu["best"]
assert (best["kernel"], best["shape"], best["seq_len"]) == (
    fastest["kernel"], fastest["shape"], fastest["seq_len"])
best_frac = fastest["kv_bytes"] / fastest["median_s"] / nominal  # recomputed
np.testing.assert_allclose(best["frac_nominal"], best_frac, rtol=1e-9)
assert best_frac >= 0.7  # the target stated above: >= 70% of nominal at Tk >= 128k, bf16
per_length = {}  # Tk -> the best bf16 fraction of nominal at that length
for r in timed:
    if r["dtype"] == "bfloat16" and r["seq_len"] >= 2**17:
        frac = r["kv_bytes"] / r["median_s"] / nominal
        per_length[r["seq_len"]] = max(per_length.get(r["seq_len"], 0.0), frac)
assert per_length[2**17] < 0.7 <= min(f for tk, f in per_length.items() if tk >= 2**18)
print("best bf16 run per length: " + ", ".join(
    f"Tk = {tk // 1024:,}k {f:.0%}" for tk, f in sorted(per_length.items())))
print(f"a record read back: for all {len(timed)} timed runs, GB/s and the fraction of nominal "
      f"recomputed from K + V bytes and median seconds agree with the record; the best bf16 "
      f"run at Tk >= 128k, found again, is the recorded best, at {best_frac:.0%} of nominal")
gqa_128k = next(r for r in timed if (r["kernel"], r["dtype"], r["shape"], r["seq_len"])
                == ("xla_bhtd", "bfloat16", "gqa32_8x128_b8", 2**17))
LATER_HIGHEST_GBS = tuple(  # the record's later runs at HIGHEST, recomputed
    r["kv_bytes"] / r["median_s"] / 1e9
    for run in gpu["highest_precision_runs"]["runs"]
    for r in [run["kernels"]["xla_bhtd bfloat16 gqa32_8x128_b8 Tk=131072"]])
assert max(LATER_HIGHEST_GBS) < 0.5 * gqa_128k["kv_bytes"] / gqa_128k["median_s"] / 1e9
print(f"xla_bhtd bf16 gqa32_8x128_b8 at Tk = 131,072 in this record: {gqa_128k['gbs']:,.0f} "
      f"GB/s; at HIGHEST in later calls: {LATER_HIGHEST_GBS[0]:,.0f} and "
      f"{LATER_HIGHEST_GBS[1]:,.0f} GB/s")
bthd = [r for r in timed if r["seq_len"] >= 2**17 and (
    r["kernel"] == "xla_bthd" or (r["kernel"] == "tree_decode" and r["dtype"] == "float32"))]
assert max(r["kv_bytes"] / r["median_s"] / nominal for r in bthd) < 0.15  # blockwise walk
dpa_gqa = [r for (k_, _, shape), r in longest.items()
           if k_ == "dot_product_attention" and shape.startswith("gqa")]
assert dpa_gqa and all(0.2 < r["kv_bytes"] / r["median_s"] / nominal < 0.3 for r in dpa_gqa)
Markdown(f"The best bf16 run at 128k keys and more, `{best['kernel']}` on "
         f"`{best['shape']}` at Tk = {best['seq_len']:,}, reached {best['gbs']:,.0f} GB/s: "
         f"**{best['frac_nominal']:.0%} of the nominal {nominal / 1e9:,.0f} GB/s**; at "
         f"128k itself the best bf16 run reached {per_length[2**17]:.0%}. The "
         f"blockwise `xla_bthd` walk (and float32 `tree_decode`, which runs it) reached at most "
         f"{max(r['frac_nominal'] for r in bthd):.0%}: on a GPU its compiled program writes "
         f"temp memory (scratch) as large as the cache (a transpose moved out of the loop, inferred from "
         f"that size; the HLO was not read) "
         f"(`tests/test_kernels.py` expects that failure there), then runs thousands of "
         f"small steps.")

# %%
fig, ax = plt.subplots(figsize=(7, 4))
xs = np.logspace(-1, 1.5, 100)
ax.plot(xs, np.minimum(H200_BF16_FLOPS, xs * nominal) / 1e12, "-", color=LIGHT, lw=2,
        label="H200 roofline (nominal HBM)")
for dtype, marker in (("bfloat16", "o"), ("float32", "s")):
    for (kernel, dt, _shape), r in longest.items():
        if dt != dtype:
            continue
        group = r["q_heads"] // r["kv_heads"]
        intensity = cm.decode_intensity(group, jnp.dtype(dtype).itemsize)
        ax.scatter(intensity, intensity * r["gbs"] / 1e3, marker=marker, s=30,
                   color=plots.color("tree") if kernel == "tree_decode" else GREY,
                   alpha=0.8)
ax.scatter([], [], marker="o", color=GREY, label="a kernel, bf16 (blue: tree_decode)")
ax.scatter([], [], marker="s", color=GREY, label="a kernel, float32")
plots.plain_log_axis(ax, "x")
plots.plain_log_axis(ax, "y")
ax.set_xlabel("arithmetic intensity (flop/byte)")
ax.set_ylabel("attained TFLOP/s")
ax.set_title(f"Recorded decode kernels on an {gpu['device']['kind']}, longest Tk each")
ax.legend(fontsize=8, loc="upper left")
plt.show()

# %% [markdown]
# *Figure: the line is the H200's roofline at its nominal bandwidth; each point is one
# kernel, dtype and shape at its longest recorded cache (1M keys where it fit), placed at
# the decode intensity of section 6.1. Points on the line run at the memory limit; the low
# points are the blockwise `xla_bthd` walk, float32 `tree_decode` (whose "auto" kernel is
# that walk on this layout), and, at the grouped-query intensities, `dot_product_attention`,
# at about a quarter of nominal.*

# %% [markdown]
# ### 6.2.2 The second lease: which form reads the cache, and what a GPU step is made of
#
# A second H200 session (`scripts/gpu_lease2.py`, `results/gpu/lease2/`) asked what the
# first one left open, again as **a record read back**: nothing below runs on a GPU. Its
# targets (the project's GPU issue) were: on the default `bthd` layout, a kernel that copies
# nothing and reaches at least 70% of nominal from 128k keys, in float32 as in bf16
# (`tree_decode`'s default path); the best bf16 kernel at 80% of nominal at 128k itself; and
# SmolLM2's decode step at half its roofline on a 128k cache.
#
# It timed one decode step (one query per sequence, grouped queries 32/8 of width 128, batch
# 8) in several forms on both cache layouts, and read each compiled program's scratch (the
# temp memory of §6.2), so a copy of the cache shows as scratch of its size. Each time is the
# median of 7 calls from Python, each waited for, so it includes the host's dispatch (about
# 82 µs, measured below): the fractions of nominal are lower bounds on what the kernels
# reach. The forms, as the table names them:
#
# * `pkg_xla_bthd`, `pkg_xla_bhtd`, `pkg_cudnn`: the package's kernels as they were before
#   this lease; `dpa`: `jax.nn.dot_product_attention`;
# * `einsum_<layout>_<scores>_<weights>`: one `einsum` per product over the whole cache,
#   written to read it in its own layout (no explicit transpose). The scores' product runs as
#   `hi` (float32 upcasts at HIGHEST), `mx` (the cache's bf16 operands with float32
#   accumulation: the product of two bf16 numbers is exact in float32, so only the sums
#   round) or `df` (float32 at XLA's default precision: TF32); the weighted sum of the values
#   as `hi`, `p16` (the softmax weights rounded to bf16 too, flash attention's choice) or `df`;
# * `chunkC_...`: the same folded over chunks of C keys (online softmax).
#
# The error column is the largest |out − ref| over max|v| at 16,384 keys, against a float64
# numpy reference on the same rounded inputs. At that length the chunked forms run a single
# chunk, so their error column is the unchunked einsum's, printed as "=". The cell recomputes GB/s and the scratch's
# share from the raw fields, and asserts what the text after it says.

# %%
lease2 = json.loads((ROOT / "results" / "gpu" / "lease2" / "forms_fixed_smollm2.json")
                    .read_text())
forms2 = {k: r for k, r in lease2["forms"].items() if isinstance(r, dict) and "median_s" in r}
nominal2 = lease2["device"]["nominal_gbs"] * 1e9
for r in forms2.values():  # recomputed from the raw fields, not read from the record's gbs
    B2, Hq2, Hkv2, D2 = lease2["config"]["shape"]
    assert r["kv_bytes"] == 2 * B2 * r["seq_len"] * Hkv2 * D2 * ITEMSIZE[r["dtype"]]
    r["frac"] = r["kv_bytes"] / r["median_s"] / nominal2
    r["scratch"] = r["temp_bytes"] / r["kv_bytes"]


def form2(name, dtype, tk=2**17):
    return forms2[f"{name} {dtype} Tk={tk}"]


print(f"{lease2['device']['kind']}, jax {lease2['device']['jax_version']}; at Tk = 131,072:")
print(f"{'form':<24}{'dtype':<10}{'GB/s':>7}{'of nominal':>12}{'scratch / cache':>17}"
      f"{'error at 16k':>14}")
for k, r in forms2.items():
    if r["seq_len"] == 2**17:
        err = forms2[k.replace("Tk=131072", "Tk=16384")].get("err_over_max_v")
        shown = "=" if r["form"].startswith("chunk") else sci(err, 2)  # one chunk at 16k
        print(f"{r['form']:<24}{r['dtype']:<10}{r['kv_bytes'] / r['median_s'] / 1e9:>7,.0f}"
              f"{r['frac']:>12.0%}{r['scratch']:>17.2f}{shown:>14}")
long2 = [r for r in forms2.values() if r["seq_len"] >= 2**17]
bthd_xla = [r for r in long2 if r["layout"] == "bthd" and r["form"] != "pkg_cudnn"]
assert all(r["scratch"] > 0.5 for r in bthd_xla)  # each at least the size of K or of V
assert all(r["scratch"] >= 1 for r in long2 if r["form"] == "pkg_xla_bthd")  # K and V
assert max(r["frac"] for r in bthd_xla) < 0.3
cudnn128 = form2("pkg_cudnn", "bfloat16")
assert cudnn128["scratch"] < 0.01 and 0.7 < cudnn128["frac"] < 0.8
up, mixed, p16, tf32 = (form2(f"einsum_bhtd_{v}", "bfloat16")
                        for v in ("hi_hi", "mx_hi", "mx_p16", "df_df"))
e_up, e_mx, e_p16 = (forms2[f"einsum_bhtd_{v} bfloat16 Tk=16384"]["err_over_max_v"]
                     for v in ("hi_hi", "mx_hi", "mx_p16"))
speedup2 = up["median_s"] / mixed["median_s"]
recovered = (1 / mixed["median_s"] - 1 / up["median_s"]) / (
    1 / tf32["median_s"] - 1 / up["median_s"])  # of the bandwidth HIGHEST lost against TF32
assert speedup2 > 1.5 and abs(e_mx / e_up - 1) < 0.2 and e_p16 > 100 * e_mx
assert p16["median_s"] < mixed["median_s"] and 0.5 < recovered < 1
for tk in (2**17, 2**18):  # float32 caches: HIGHEST slower than TF32 in the same run (§6.2.1)
    assert (form2("einsum_bhtd_hi_hi", "float32", tk)["median_s"]
            > form2("einsum_bhtd_df_df", "float32", tk)["median_s"])
Markdown(f"- **No XLA form tried reads a `bthd` cache in place.** Every one of them on that "
         f"layout (the package's blockwise walk, one einsum, chunks, `dot_product_attention`) "
         f"wrote scratch of at least half the cache, the size of a copy of K or of V (of both, "
         f"for the blockwise walk; more still, for the chunked forms): inferred from the size, "
         f"the programs' HLO was not read. "
         f"The best of them reached only {max(r['frac'] for r in bthd_xla):.0%} of nominal "
         f"at 128k keys or more. On that layout only cuDNN streams (scratch "
         f"{sci(cudnn128['scratch'], 2)} of the cache): {cudnn128['frac']:.0%} of nominal at "
         f"128k, in bf16 only: so neither the 70% target (float32 too) nor the 80% one is "
         f"met. None of the XLA forms "
         f"tried avoids the copy; a hand-written kernel (Pallas or Triton) might, and none was "
         f"built.\n"
         f"- **Products.** On the head-major layout at 128k keys, bf16 operands with float32 "
         f"accumulation for the scores (`mx_hi`: the weights stay float32 at HIGHEST) ran "
         f"{speedup2:.2f}x as fast as the float32 upcasts (`hi_hi`), and recovered "
         f"{recovered:.0%} of the bandwidth that HIGHEST loses against TF32, at about the same "
         f"error at 16k keys ({sci(e_mx, 2)} and {sci(e_up, 2)} of max|v|, within "
         f"{abs(e_mx / e_up - 1):.0%}). Rounding the weights to bf16 too (`mx_p16`) was "
         f"faster again, but at {e_p16 / e_mx:,.0f} times the error: it rounds the weights "
         f"themselves, not only the sums, which breaks the package's float32-accumulation "
         f"contract. The xla kernel now takes its scores' product in the `mx_hi` way when q "
         f"and the cache share a 16-bit dtype (`kernels.xla._exact_products`); that kernel "
         f"itself has not yet run on a GPU.")

# %% [markdown]
# The same lease timed SmolLM2-135M's decode step, with random weights of its shape (the
# time does not depend on the weights), on one device. On one device the package reads the
# cache in one program and appends the step's keys in a second (notebook 7). The read step
# then held a `lax.cond` (JAX's on-device if/else) in every layer: a cache handed in may hold
# NaN in its unused slots, and a layer whose one-pass read came out non-finite was read again
# selecting them away. The "roofline" below is the step's bytes over the read bandwidth
# measured in the same run (a `jnp.sum`), not the nominal one. The variant without the conds
# ran in a later call of the lease, on a freshly started machine of the same kind.

# %%
more2 = json.loads((ROOT / "results" / "gpu" / "lease2" / "smollm2_more.json").read_text())
steps2, programs2 = {}, {}  # the two calls that ran SmolLM2's shape
for part in (lease2["smollm2"], more2["smollm2"]):
    steps2.update({(r["method"], r["context"], r["variant"]): r for r in part["records"]})
    programs2.update({k: v["read_step"] for k, v in part["programs"].items() if "read_step" in v})
with_cond, no_cond = steps2[("single", 4096, "as is")], steps2[("single", 4096, "no cond")]
k_cond, k_none = programs2["single as is"], programs2["single no cond"]
print("SmolLM2-135M's shape (random weights), one device, 4,096 tokens of context:")
for r, k_ in ((with_cond, k_cond), (no_cond, k_none)):
    print(f"  {r['variant']:<8}{r['median_s'] * 1e3:6.2f} ms per token, "
          f"{r['fraction']:.1%} of the roofline ({r['roofline_s'] * 1e3:.2f} ms); "
          f"{k_['kernels']} operations and {k_['conditionals']} lax.cond in the read step")
per_op = no_cond["median_s"] / k_none["kernels"]
per_cond = (with_cond["median_s"] - no_cond["median_s"]) / k_cond["conditionals"]
floor2 = lease2["fixed_cost"]["trivial_call_s"]  # a jitted x + 1, called from the host
assert with_cond["median_s"] > 1.4 * no_cond["median_s"] and no_cond["fraction"] < 0.1
assert k_cond["conditionals"] == 30 and k_none["conditionals"] == 0
assert 0.5 < per_cond / floor2 < 2  # "about as long as"
assert "stopped" in lease2["smollm2"] and not any(c == 2**17 for _, c, _ in steps2)  # no 128k
Markdown(f"A step of this small model is not memory-bound: at a 4k context its bytes would "
         f"take {no_cond['roofline_s'] * 1e3:.2f} ms at the measured read bandwidth, and "
         f"the step took {no_cond['median_s'] * 1e3:.2f} ms even without its conds, about "
         f"{per_op * 1e6:.0f} µs for each of the {k_none['kernels']} operations of the "
         f"compiled program, the order of a kernel launch (inferred from the program, not "
         f"profiled). Removing the {k_cond['conditionals']} conds, with the finiteness check "
         f"each one branched on, saved "
         f"{(with_cond['median_s'] - no_cond['median_s']) * 1e3:.2f} ms of "
         f"{with_cond['median_s'] * 1e3:.2f} ({per_cond * 1e6:.0f} µs per layer): about as "
         f"long as a trivial jitted call from the host ({floor2 * 1e6:.0f} µs), as a branch "
         f"chosen on the host would take (an explanation, not profiled; the two rows come "
         f"from two machines, and no run was repeated across them). The step now has one "
         f"cond (`forward.read_only_step`; `tests/test_speed.py` counts it); its time on a "
         f"GPU was not measured. Nor was the 128k cache: the first call's budget ended "
         f"before it, and the later call's time limit came, by the run order, during it "
         f"(its log does not show when a run starts), so that target is open.")

# %% [markdown]
# ## 6.3 The alpha-beta model, calibrated here
#
# A message of $n$ bytes over a link costs $\alpha + n/\beta$ (Hockney's model). A
# collective is a schedule of such messages, and its cost follows from counting them
# (Thakur, Rabenseifner and Gropp, 2005, the algorithms of MPICH):
#
# * **ring allreduce**: a reduce-scatter and an all-gather, each $p-1$ steps in which every
#   rank sends $n/p$ bytes: $2(p-1)\alpha + 2\frac{p-1}{p}\, n/\beta$;
# * **recursive-doubling allreduce**: $\lceil\log_2 p\rceil$ rounds in which every rank
#   exchanges all $n$ bytes with a partner: $\lceil\log_2 p\rceil(\alpha + n/\beta)$.
#
# The model takes the cheaper of the two for each message, and reduces inside nodes first,
# then across. That choice is the model's, in MPICH's style. NCCL, which the paper's GPUs
# ran, has other algorithms: rings, double binary trees, NVLS and CollNet on switches that
# reduce in the network, and PAT; it has no recursive doubling, and its tuner picks among
# its own algorithms from its own cost tables. So on GPUs the model's collective costs are
# estimates of the right order, not NCCL's.
#
# **Exercise 1 (code).** Write the two costs from their step counts. The test runs each
# algorithm on numpy vectors of 8 ranks, step by step: it checks that the result is the
# sum, logs how many bytes each rank sends at every step, and prices the log with
# $\alpha + n/\beta$ per step. Your formulas must equal the priced logs, and the package's
# `cm.ring_allreduce_time` and `cm.tree_allreduce_time` (in the package's names, "tree"
# here is recursive doubling, the butterfly's schedule: not NCCL's trees, nor the method),
# which the test makes raise while your formulas run.

# %%
def ring_allreduce_time(n, p, alpha, beta):
    """Seconds of a ring allreduce of n bytes over p ranks."""
    # TODO: 2(p - 1) steps; how many bytes does each rank send per step?
    return 0.0


def recursive_doubling_time(n, p, alpha, beta):
    """Seconds of a recursive-doubling allreduce of n bytes over p ranks (p a power of 2)."""
    # TODO: how many rounds, and how many bytes per round?
    return 0.0


stub_ring_allreduce_time, stub_recursive_doubling_time = (ring_allreduce_time,
                                                          recursive_doubling_time)


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "allreduce_times", "locked": false, "schema_version": 3, "solution": true, "task": false}
def ring_allreduce_time(n, p, alpha, beta):  # the solution replaces the stub
    """Seconds of a ring allreduce of n bytes over p ranks."""
    return 2 * (p - 1) * (alpha + n / p / beta)


def recursive_doubling_time(n, p, alpha, beta):  # the solution replaces the stub
    """Seconds of a recursive-doubling allreduce of n bytes over p ranks (p a power of 2)."""
    return math.ceil(math.log2(p)) * (alpha + n / beta)


# %% nbgrader={"grade": true, "grade_id": "test_allreduce_times", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def ring_allreduce_log(x):
    """Run a ring allreduce on x [p, n] (rank i holds x[i]); return the result and the bytes
    each rank sends at each step."""
    p = x.shape[0]
    chunks = [list(np.array_split(row.copy(), p)) for row in x]  # chunks[rank][c]
    log = []
    for step in range(p - 1):  # reduce-scatter: rank i sends chunk (i - step) to i + 1
        sent = [chunks[i][(i - step) % p].copy() for i in range(p)]
        for i in range(p):
            chunks[(i + 1) % p][(i - step) % p] += sent[i]
        log.append(max(c.nbytes for c in sent))
    for step in range(p - 1):  # all-gather: rank i forwards its finished chunk (i + 1 - step)
        sent = [chunks[i][(i + 1 - step) % p].copy() for i in range(p)]
        for i in range(p):
            chunks[(i + 1) % p][(i + 1 - step) % p] = sent[i]
        log.append(max(c.nbytes for c in sent))
    return np.array([np.concatenate(c) for c in chunks]), log


def recursive_doubling_log(x):
    """Recursive doubling on x [p, n], p a power of 2: rank i exchanges with i XOR 2^r."""
    x, log = x.copy(), []
    for r in range(int(math.log2(x.shape[0]))):
        x = x + x[np.arange(x.shape[0]) ^ (1 << r)]
        log.append(x[0].nbytes)
    return x, log


rng = np.random.default_rng(6)
x = rng.normal(size=(8, 1040))  # 8 ranks, 8,320 bytes each: the tree's payload of notebook 4


def own_formula(formula, *args):
    """formula(*args) with the package's allreduce costs made to raise: the test checks
    your step counts, not a call to the answer."""
    own = AssertionError("count the steps yourself: the package's costs are the answer")
    with contextlib.ExitStack() as stack:
        for module in (cm, links):
            for name in ("ring_allreduce_time", "tree_allreduce_time", "allreduce_time"):
                stack.enter_context(mock.patch.object(module, name, side_effect=own))
        return formula(*args)


def check_allreduce_time(algorithm, formula, package):
    """Raises AssertionError unless formula prices algorithm's step log, as package does.
    Returns the log."""
    result, log = algorithm(x)
    np.testing.assert_allclose(result, np.broadcast_to(x.sum(0), x.shape), rtol=1e-12)
    for alpha, beta in ((6e-6, 450e9), (46e-6, 50e9), (0.0, 1e9)):
        priced = sum(alpha + n / beta for n in log)
        np.testing.assert_allclose(own_formula(formula, x[0].nbytes, 8, alpha, beta), priced,
                                   rtol=1e-12)
        np.testing.assert_allclose(package(x[0].nbytes, 8, cm.Link(alpha, beta)), priced,
                                   rtol=1e-12)
    return log


for algorithm, formula, stub, package in (
        (ring_allreduce_log, ring_allreduce_time, stub_ring_allreduce_time,
         cm.ring_allreduce_time),
        (recursive_doubling_log, recursive_doubling_time, stub_recursive_doubling_time,
         cm.tree_allreduce_time)):
    try:
        check_allreduce_time(algorithm, stub, package)
        print(f"{stub.__name__}: the stub cell passes the test (filled in?)")
    except AssertionError:
        print(f"{stub.__name__}: the stub as given fails the test")
    log = check_allreduce_time(algorithm, formula, package)
    print(f"{algorithm.__name__}: {len(log)} steps of "
          f"{sorted(set(log))} bytes per rank; formula == priced log == costmodel   ✓")

# %% [markdown]
# **Quiz (predict, then run).** Tree decoding's Allreduce at the paper's shape carries 8,320
# bytes (notebook 4). On 8 GPUs of one node with the model's α = 6 µs and β = 450 GB/s, which
# term dominates a ring allreduce, and which algorithm does the model pick?
#
# <details><summary>Answer</summary>
#
# The latency terms, by three orders of magnitude: $14\alpha$ against well under a
# microsecond of bytes. So the model picks recursive doubling ($3\alpha$): at a few
# kilobytes only the number of steps matters.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_2", "locked": false, "schema_version": 3, "solution": true, "task": false}
intra = h100.intra
n_tree = 8320
print(f"ring: latency {2 * 7 * intra.alpha_s * 1e6:.1f} us, bytes "
      f"{2 * 7 / 8 * n_tree / intra.beta_Bps * 1e6:.3f} us; recursive doubling "
      f"{cm.tree_allreduce_time(n_tree, 8, intra) * 1e6:.1f} us; the model picks "
      f"{cm.allreduce_time(n_tree, 8, intra)[1]!r}")
assert cm.allreduce_time(n_tree, 8, intra)[1] == "recursive_doubling"
latency_s, bytes_s = 2 * 7 * intra.alpha_s, 2 * 7 / 8 * n_tree / intra.beta_Bps
assert latency_s > 1000 * bytes_s and bytes_s < 1e-7  # "dominates", "well under a microsecond"

# %% [markdown]
# With the collectives priced, the model of one decode step:
#
# * **Tree decode** = local roofline time over $N/p$ keys + Allreduce(max) of $B H_q$ floats
#   + Allreduce(sum) of the numerator, $B H_q D_v$ floats, and of the denominator, $B H_q$
#   floats (one all-reduce op with two operands, which XLA:CPU runs one after the other, so
#   the calibrated topology prices them apart: `Topology.operands_apart`) + the local merge
#   (the summed numerator divided by the denominator: $B H_q (D_v + 1)$ floats read at the
#   decode bandwidth) + a fixed per-call overhead.
# * **Ring decode** = $p$ block computations of $N/p$ keys (every device folds all $N$ keys:
#   notebook 5's redundant compute) + $p-1$ transfers of a K and a V block over the slowest
#   link of the ring, each hidden behind a block's compute only where the device can
#   overlap, + $p-1$ copies of a block, read and written at the measured local-copy rate
#   (XLA:CPU's compiled ring copies its block at every step; a GPU ring receives into its
#   second buffer instead, and the published topologies price no copy) + the broadcast of
#   the output (notebook 5, §5.4) + the same per-call overhead.
#
# `calibrate.measure_topology` measures on the 8 simulated devices:
#
# * the per-call overhead, the median time of a trivial program on the mesh, timed in the
#   same interleaved rounds (each round times every program once, in an order drawn afresh
#   from a fixed seed, and the median over rounds is kept: `benchmark.median_times`) as a
#   program of one all-reduce and
#   one of four dependent all-reduces, each taking the previous one's result
#   (`microbench.collective_chain_times`). What one more all-reduce adds, the slope (with
#   the small scaling step that keeps XLA from merging the chain), is an all-reduce's
#   latency α, printed as `psum` in the table's first line. (For small
#   messages a lone all-reduce less a trivial program timed apart does not give it: in
#   earlier runs on mesh 8 the trivial program timed apart took about as long as a lone
#   all-reduce, `results/calibrate/README.md`. Larger messages are still timed alone, less
#   the overhead.) This notebook's tree does not use that α: its all-reduces are priced by
#   MPICH's algorithms over the `ppermute` link, as set out above, and notebook 8 prices
#   every collective kind as measured: this section keeps the formulas that §6.4 fills with
#   GPU figures. The sentence under the table sets the two side by side;
# * `ppermute`, used the way a ring uses it, at message sizes spanning the K/V blocks the
#   ring will send (printed below): the model reads a message's time off a curve of these
#   points (`Link.points`, linear between the two sizes around it), whose first point is α
#   at 16 KiB, standing for every smaller message; β prices a single message only beyond
#   the largest size (the ring all-reduce's formula still uses α and β at every size);
# * one fold of a block into a running state inside a compiled loop, the ring's work at
#   every step, at a tiny block and at 3/4 of each length (`calibrate.fold_problems`, its
#   lengths printed below): the ring's $p$ block computations are priced off that curve
#   (`Topology.fold_points`), not as $p$ kernel calls on their own; a block larger than
#   the largest measured one costs that one's time plus the rest at the decode bandwidth;
# * the per-device decode bandwidth with all 8 devices busy, at a sequence length it does
#   not validate on, and the rate of a local copy, which XLA:CPU's compiled ring makes of
#   its block at every step (a GPU ring receives into its second buffer instead).
#
# XLA:CPU runs one op at a time per device, so this topology has `overlap=False`. Then we
# set the model's sum of parts beside the measured tree and ring latency at each sequence
# length of `TK_CAL`.

# %%
item = jnp.dtype(problem.dtype).itemsize
blocks = [problem.batch * (n // mesh.size) * problem.kv_heads * problem.head_dim * item
          for n in TK_CAL]
sizes = calibrate.message_sizes(blocks, points=4)
small = [s for s in sizes if s <= calibrate.SMALL_MESSAGE]
cal_len = 3 * TK_CAL[-1] // 4  # the decode bandwidth is measured at a length not validated
print(f"sequence lengths: {TK_CAL}; decode bandwidth measured at {cal_len}")
print("one K (or V) block of N/p keys:", ", ".join(f"{b / 2**20:g} MiB" for b in blocks))
print(f"alpha from messages of {', '.join(f'{s:,}' for s in small)} bytes")
print(f"the curve (and beta) from {len(sizes) - len(small)} sizes, "
      f"{sizes[len(small)] / 2**20:.2f} MiB to {sizes[-1] / 2**20:.0f} MiB")
fold_lens = [p.seq_len for p in calibrate.fold_problems(problem, mesh.size, TK_CAL)]
assert fold_lens[1:] == [3 * n // 4 // mesh.size * mesh.size for n in TK_CAL]  # "3/4"
print(f"folds in a loop timed at sequence lengths {fold_lens} "
      f"({fold_lens[0] // mesh.size} keys per device, then 3/4 of each length)")
assert sizes[-1] == 2 * max(blocks) and cal_len not in TK_CAL

# %% [markdown]
# The calibration itself (timings: this cell's output is not checked):

# %%
# NBVAL_IGNORE_OUTPUT
cal = calibrate.measure_topology(mesh, sizes=sizes, repeats=REPEATS,
                                 kernel_problem=dataclasses.replace(problem, seq_len=cal_len),
                                 fold_problems=calibrate.fold_problems(problem, mesh.size, TK_CAL))
rows = []
for n in TK_CAL:
    prob = dataclasses.replace(problem, seq_len=n)
    for rec in benchmark.run(mesh, prob, methods=("tree", "ring"), repeats=REPEATS):
        assert rec.max_abs_err < 1e-5, rec  # every timed call computed attention
        pred = calibrate.predict(rec.method, n, cal.topology, prob).total_s
        rows.append(dict(method=rec.method, devices=rec.devices, seq_len=n, predicted_s=pred,
                         measured_s=rec.median_s, error=pred / rec.median_s - 1))
table = calibrate.calibration_table(cal, rows)
print(table)
BAND = calibrate.BAND  # the model's target (±30%), also calibrate --check's
errors = [x["error"] for x in rows]
worst_err = max(abs(e) for e in errors)
assert f"worst |error| {worst_err:.0%}" in table  # the sentence below reads the printed table
within = sum(abs(e) <= BAND for e in errors)
over = sum(e > 0 for e in errors)
tree_ms = [x["measured_s"] * 1e3 for x in rows if x["method"] == "tree"]
monotonic = all(a < b for a, b in itertools.pairwise(tree_ms))
zero_alpha = ["ppermute"] if round(cal.ppermute.alpha_s * 1e6) == 0 else []
zero_chain = round(cal.psum.alpha_s * 1e6) == 0  # a chain of four no slower than one
text = (f"In this run the predictions miss by {min(errors):+.0%} to {max(errors):+.0%} "
        f"(worst {worst_err:.0%}): {within} of {len(errors)} within ±{BAND:.0%}; the model "
        f"over-predicted {over} and under-predicted {len(errors) - over}. "
        + ("So in this run the sum of parts does not describe the measured latencies. "
           if within < len(errors) / 2 else "")
        + f"The measured tree step is {'' if monotonic else 'not '}monotonic in $T_k$ ("
        + ", ".join(f"{t:.1f}" for t in tree_ms) + " ms), "
        + ("as the model's is." if monotonic else "while the model's grows with $T_k$: "
           "on shared cores the timings carry noise of that size."))
if zero_alpha:
    text += (f" The fitted α of {' and '.join(zero_alpha)} prints as 0 µs: its small "
             f"messages took no longer than the per-call overhead "
             f"({cal.overhead_s * 1e6:.0f} µs, or its share per step) that the fit subtracts "
             f"first, so α is too small "
             f"to measure against that overhead, not zero.")
if zero_chain:
    text += (" The all-reduce's α prints as 0 µs: in this run four chained all-reduces took "
             "no longer than one, so the chain did not resolve it; it is not zero.")
tree0 = calibrate.predict("tree", TK_CAL[0], cal.topology, dataclasses.replace(
    problem, seq_len=TK_CAL[0]))
# "by MPICH's algorithms over the ppermute link": no kind is priced as measured here.
assert not cal.topology.measured and cal.topology.intra == cal.ppermute
assert cal.topology.operands_apart  # "the calibrated topology prices them apart"
assert cal.topology.kernel_fixed_s == 0  # §6.6: the check fits a fixed part; this does not
assert microbench.CHAIN == 4  # "one of four dependent all-reduces"
n_allreduce = sum(count for kind, _, count in cm.merge_collectives(
    "allreduce", batch=problem.batch, q_len=problem.q_len, q_heads=problem.q_heads,
    v_dim=problem.head_dim, p=mesh.size, operands_apart=cal.topology.operands_apart)
    if kind == "all-reduce")
assert n_allreduce == 3  # "its max, and its sum's two operands"
text += (f" The tree's {n_allreduce} all-reduces (its max, and its sum's two operands) are "
         f"priced at {tree0.comm_s * 1e3:.2f} ms here, by MPICH's algorithms over the "
         f"`ppermute` link; at the chain's α they would cost "
         f"{n_allreduce * cal.psum.alpha_s * 1e3:.2f} ms. This section keeps the formulas, "
         f"which §6.4 fills with GPU figures; the errors above are for that price, and "
         f"this notebook does not test which of the two this machine's tree times favour.")
tree_pred = [x["predicted_s"] for x in rows if x["method"] == "tree"]
assert all(a < b for a, b in itertools.pairwise(tree_pred))  # "the model's grows"
Markdown(text)

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
ax = axes[0]
for method in ("tree", "ring"):
    r = [x for x in rows if x["method"] == method]
    ax.plot([x["measured_s"] * 1e3 for x in r], [x["predicted_s"] * 1e3 for x in r], "o",
            color=plots.color(method), label=method)
lo = min(min(x["measured_s"], x["predicted_s"]) for x in rows) * 1e3 / 2
hi = max(max(x["measured_s"], x["predicted_s"]) for x in rows) * 1e3 * 2
grid = np.array([lo, hi])
ax.plot(grid, grid, "k-", lw=1, label="predicted = measured")
ax.fill_between(grid, grid * (1 - BAND), grid * (1 + BAND), color="0.85",
                label=f"±{BAND:.0%}")
plots.plain_log_axis(ax, "x")
plots.plain_log_axis(ax, "y")
ax.set_xlabel("measured (ms)")
ax.set_ylabel("predicted (ms)")
ax.set_title("Calibration on 8 simulated devices")
ax.legend(fontsize=10)
ax = axes[1]
for method in ("tree", "ring"):
    r = [x for x in rows if x["method"] == method]
    ax.plot([x["seq_len"] for x in r], [x["error"] * 100 for x in r], "o-",
            color=plots.color(method), label=method)
ax.axhspan(-BAND * 100, BAND * 100, color="0.9")
ax.axhline(0, color="k", lw=1)
plots.pow2_axis(ax, TK_CAL)
ax.set_xlabel("sequence length $T_k$")
ax.set_ylabel("prediction error (%)")
ax.set_title("Error against sequence length")
ax.legend(fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: left, each point is one (method, sequence length), predicted against measured. On
# the black diagonal the model is exact; inside the grey band it is within the calibration
# target. Right, the same errors against sequence length. (The points come from timings and
# move from run to run; the sentence under the table gives this run's range of errors.)*
#
# How to read this comparison. It is not a gate and not a validation: nothing above asserts
# the band, because on a shared machine a neighbour's load moves the timings, and how far
# the predictions miss, and in which direction, varies from run to run (the sentence under
# the table gives this run's). The model prices each part of a decoder (a fixed overhead,
# each link's time read off its measured points, a roofline for the tree's local work, the
# ring's $p$ folds off the in-loop curve and its $p-1$ block copies at the copy rate) by
# micro-benchmarks at other sizes. A prediction within the band says that those parts add up to the
# measured time in that run; a miss beyond it says they do not, and this notebook does not
# isolate which part is off. It says nothing about the GPU figures of the next section,
# which are published figures, not measurements.
#
# **Exercise 2 (code).** Fit a link's α and β the way ping-pong benchmarks do: α is the
# median time of the small messages (at most `calibrate.SMALL_MESSAGE` bytes), β the median
# of $n/(t - \alpha)$ over the larger ones. The test makes synthetic timings from a known
# link with 5% noise (a fixed seed) and checks that your fit recovers it within 5%, and that
# it equals `calibrate.fit_link` on the same points (which it makes raise while your fit
# runs). The cell after the test fits this run's
# `ppermute` timings the way your fit does (with the package's `calibrate.fit_link`, which
# the test checked yours against).

# %%
def fit_alpha_beta(points):
    """Hockney parameters (alpha seconds, beta bytes/s) from (bytes, seconds) points."""
    # TODO: alpha from the small messages, beta from the large ones.
    return 0.0, 1.0


stub_fit_alpha_beta = fit_alpha_beta


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "fit_alpha_beta", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fit_alpha_beta(points):  # the solution replaces the stub
    """Hockney parameters (alpha seconds, beta bytes/s) from (bytes, seconds) points."""
    small = [t for n, t in points if n <= calibrate.SMALL_MESSAGE]
    alpha = float(np.median(small))
    beta = float(np.median([n / (t - alpha) for n, t in points
                            if n > calibrate.SMALL_MESSAGE and t > alpha]))
    return alpha, beta


# %% nbgrader={"grade": true, "grade_id": "test_fit_alpha_beta", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
true = cm.Link(alpha_s=20e-6, beta_Bps=20e9)
test_sizes = (1024, 4096, 16384, 2**19, 2**21, 2**23)  # three small, three large
noise = np.random.default_rng(0).uniform(0.95, 1.05, size=(len(test_sizes), 3))
synthetic = [(n, true.send(n) * f) for n, row in zip(test_sizes, noise, strict=True)
             for f in row]


def check_fit(fit):
    """Raises AssertionError unless fit recovers the true link within 5% and equals
    calibrate.fit_link. Returns (alpha, beta)."""
    own = AssertionError("fit it yourself: calibrate.fit_link is the answer")
    with mock.patch.object(calibrate, "fit_link", side_effect=own), \
            mock.patch.object(microbench, "fit_link", side_effect=own):
        alpha, beta = fit(synthetic)
    reference_fit = calibrate.fit_link(synthetic)  # after the fit: no global holds the answer
    # The small messages' own bytes bias alpha up by at most 16 KiB / beta (0.8 us here).
    assert abs(alpha / true.alpha_s - 1) < 0.05 and abs(beta / true.beta_Bps - 1) < 0.05
    np.testing.assert_allclose((alpha, beta), (reference_fit.alpha_s, reference_fit.beta_Bps))
    return alpha, beta


try:
    check_fit(stub_fit_alpha_beta)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given fails the test")
alpha, beta = check_fit(fit_alpha_beta)
print(f"fitted alpha {alpha * 1e6:.2f} us (true "
      f"{true.alpha_s * 1e6:.0f}), beta {beta / 1e9:.3f} GB/s (true {true.beta_Bps / 1e9:.0f})")

# %%
# NBVAL_IGNORE_OUTPUT
share = cal.overhead_s / (2 * (mesh.size - 1))  # as calibrate.measure_topology: dispatch
fitted = calibrate.fit_link([(n, max(t - share, 0.0))
                             for n, t in cal.collective_points["ppermute"]])
np.testing.assert_allclose((fitted.alpha_s, fitted.beta_Bps),
                           (cal.ppermute.alpha_s, cal.ppermute.beta_Bps))  # the model's link
assert fitted.points == () and cal.ppermute.points  # the model's link keeps its points
assert calibrate.SMALL_MESSAGE == 16 * 1024  # "alpha at 16 KiB" (section 6.3's bullet)
print(f"this run's ppermute, fitted as in Exercise 2 after subtracting each step's share "
      f"of the per-call overhead (the overhead over the {2 * (mesh.size - 1)} sends of one "
      f"timed program): alpha {fitted.alpha_s * 1e6:.0f} us, "
      f"beta {fitted.beta_Bps / 1e9:.2f} GB/s: the summary of the link the model prices "
      f"the ring with; it reads each message's time off a curve of "
      f"{len(cal.ppermute.points)} points (alpha at {calibrate.SMALL_MESSAGE // 1024} KiB "
      f"for every smaller message, then "
      f"the larger sizes), and beta prices a single message only beyond the largest (the "
      f"ring all-reduce's formula still uses alpha and beta)")
print("fold curve, MB per device -> ms per fold in the loop:",
      ", ".join(f"{n / 1e6:.2f} -> {t * 1e3:.2f}" for n, t in cal.topology.fold_points))

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A collective's cost is its schedule of messages, each α + n/β in Hockney's model (here
# read off the measured points). Measurements give the
# model its rates on this machine: a per-call overhead, a link's time at each measured
# size (α and β summarise them), the decode bandwidth, a local copy's rate, and a fold's
# time inside the ring's loop. How close its sum of parts comes to both decoders' measured latencies
# varies from run to run (the sentence under the table gives this run's errors): a
# comparison on XLA:CPU, not a validation, and not of the GPU figures it is filled with
# next.</p></div>

# %% [markdown]
# ## 6.4 Extrapolating to the paper's cluster
#
# The paper ran on 16 DGX H100 nodes of 8 GPUs (paper §6). `costmodel.DGX_H100` holds
# published figures for that hardware; its `sources` say where each comes from. Nothing in
# it was tuned to the paper's results, and nothing in it was measured here. α inside a node
# is a best case: a small allreduce on two GPUs with NVLS and CUDA graphs, so a lower bound
# for an allreduce over 8 GPUs launched by a framework. A larger α slows the model's tree (a
# few Allreduces, all latency) more than its ring (mostly bandwidth): the cell checks it
# with four times the NVLink α, so the ring/tree ratios below are optimistic for the tree
# at small $N$.

# %%
for line in h100.sources:
    print("source:", line)
intra, inter = h100.intra, h100.inter
Markdown(
    f"So: {h100.devices_per_node} GPUs per node on NVLink 4 at "
    f"{intra.beta_Bps / 1e9:.0f} GB/s per direction with α = {intra.alpha_s * 1e6:.0f} µs; "
    f"one NDR InfiniBand port per GPU at {inter.beta_Bps / 1e9:.0f} GB/s with "
    f"α = {inter.alpha_s * 1e6:.0f} µs; HBM3 at {h100.mem_Bps / 1e12:.2f} TB/s; "
    f"{h100.flops / 1e12:.0f} TFLOP/s dense bf16.")

# %%
# A larger alpha inside the node (4x): the tree, all latency, slows more than the ring.
slow_alpha = dataclasses.replace(h100, intra=dataclasses.replace(intra,
                                                                 alpha_s=4 * intra.alpha_s))
at_best, at_slow = cm.paper_microbenchmark(80_000, 8), cm.paper_microbenchmark(80_000, 8,
                                                                              slow_alpha)
tree_x, ring_x = (at_slow[m].total_s / at_best[m].total_s for m in ("tree", "ring"))
assert tree_x > ring_x  # so the ring/tree ratio falls as alpha grows
print(f"8 GPUs, N = 80,000, NVLink alpha x4: the tree's step x{tree_x:.2f}, the ring's "
      f"x{ring_x:.2f}; ring/tree {at_best['ring'].total_s / at_best['tree'].total_s:.0f}x -> "
      f"{at_slow['ring'].total_s / at_slow['tree'].total_s:.0f}x")

# %% [markdown]
# ### 6.4.1 The microbenchmark
#
# The paper's microbenchmark (paper §6.1, Fig. 3) times one attention block on 1 to 16
# nodes at sequence lengths up to 5.12M tokens (the sizes are in `cm.PAPER_MICROBENCHMARK`,
# printed below). `cm.paper_microbenchmark(N, p)` predicts one decode step of it with tree
# and with ring attention, part by part.

# %%
PS = (8, 16, 32, 64, 128)
NS = (80_000, 320_000, 1_280_000, 5_120_000)
micro = {(p, n): cm.paper_microbenchmark(n, p) for p in PS for n in NS}
ratio = {k: v["ring"].total_s / v["tree"].total_s for k, v in micro.items()}
print("shape:", cm.PAPER_MICROBENCHMARK)
print(f"\n{'p':>4}{'N':>11}{'tree ms':>10}{'ring ms':>11}{'ring/tree':>11}"
      f"{'ring compute / tree compute':>29}")
for (p, n), v in micro.items():
    print(f"{p:>4}{n:>11,}{v['tree'].total_s * 1e3:>10.3f}{v['ring'].total_s * 1e3:>11.2f}"
          f"{ratio[p, n]:>10.0f}x{v['ring'].compute_s / v['tree'].compute_s:>28.1f}x")
one_node = [ratio[8, n] for n in NS]
multi_node = [ratio[p, n] for p in PS[1:] for n in NS]
big = ratio[128, 5_120_000]
# Properties of the model, not evidence about GPUs: by construction of the model, its ring
# computes p blocks (notebook 5 counted them in the compiled programs) and sends whole
# blocks over the slowest link. These assertions check the model's code, not a measurement.
assert all(v["ring"].compute_s == p * v["tree"].compute_s for (p, _), v in micro.items())
assert max(one_node) < min(multi_node)
PAPER_RATIO = 8  # paper §6.1: "close ×8 speedups" at 128 GPUs and 5.12M tokens
assert 10 < min(ratio.values()) and max(ratio.values()) < 1e4  # one to three orders
assert big > 100 * PAPER_RATIO  # the paper measured much less
assert 1650 <= max(multi_node) < 1750  # §6.7's "up to about 1,700× across nodes"
print("ring compute == p x tree compute: by construction of the model (the last column)")
# The ring's time is a sum of parts (Prediction fields): its compute, p x the tree's, plus
# its transfers (everything else). The ratio need not reach p, although the compute is p x.
assert all(v["ring"].overhead_s == 0 == v["ring"].merge_s for v in micro.values())
transfer_share = {k: 1 - v["ring"].compute_s / v["ring"].total_s for k, v in micro.items()}
share_1 = [transfer_share[8, n] for n in NS]
share_128 = [transfer_share[128, n] for n in NS]
assert h100.overlap  # the printed transfers are the part no block's compute hides
print(f"{'p':>4}{'N':>11}{'ring compute ms':>17}{'unhidden transfers ms':>23}{'share':>9}")
for (p, n), v in micro.items():
    print(f"{p:>4}{n:>11,}{v['ring'].compute_s * 1e3:>17.3f}{v['ring'].comm_s * 1e3:>23.3f}"
          f"{transfer_share[p, n]:>9.1%}")
assert min(transfer_share.values()) > 0.8  # "most of the ring's time is its transfers"
assert ratio[64, NS[0]] < 64 and ratio[128, NS[0]] < 128  # the ratio is not a multiple of p
Markdown(
    f"The model predicts ring/tree = {min(one_node):.0f}–{max(one_node):.0f}× on one node "
    f"and {min(multi_node):.0f}–{max(multi_node):.0f}× across nodes; at $p = 128$ and "
    f"$N$ = {NS[-1]:,} it predicts {big:,.0f}×, where the paper reports close to "
    f"{PAPER_RATIO}× "
    f"(paper §6.1). The ring's predicted time is a sum of two parts: its compute, $p$ × "
    f"the tree's compute (the last column of the first table, by construction of the "
    f"model), plus the part of its transfers not hidden behind a block's compute (the "
    f"model's H100s overlap a transfer with compute, so a step costs the longer of the "
    f"two). Most of the ring's time is that unhidden transfer time: "
    f"{min(share_1):.0%}–{max(share_1):.0%} of it on one node, "
    f"{min(share_128):.1%}–{max(share_128):.1%} at $p = 128$ (the second table). So the "
    f"ring/tree ratio need not reach $p$, although the ring's compute is $p$ × the tree's: "
    f"at $N$ = {NS[0]:,} it is {ratio[64, NS[0]]:.0f}× with $p = 64$ and "
    f"{ratio[128, NS[0]]:.0f}× with $p = 128$.")

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
ax = axes[0]
for n, style in zip(NS, STYLES, strict=True):
    ax.plot(PS, [ratio[p, n] for p in PS], style, color=GREY, label=f"N = {n:,}")
ax.plot([128], [8], "*", color=LIGHT, mec="k", ms=16, label="paper: about 8×")
plots.pow2_axis(ax, PS)
plots.plain_log_axis(ax, "y")
ax.set_xlabel("GPUs p")
ax.set_ylabel("predicted ring / tree")
ax.set_ylim(5, 5e4)  # room for the legend above the lines
ax.set_title("Predicted ring / tree (model)")
ax.legend(fontsize=9, loc="upper left", ncol=2)
ax = axes[1]
ns = np.geomspace(NS[0], NS[-1], 7).astype(int)
for p, ls in ((8, "-"), (128, "--")):
    curves = [cm.paper_microbenchmark(int(n), p) for n in ns]
    for method in ("ring", "tree"):
        ax.plot(ns, [c[method].total_s * 1e3 for c in curves], ls, marker="o", ms=4,
                color=plots.color(method), label=f"{method}, p={p}")
    if p == 128:  # the caption's "nearly flat": N grows 64x, tree's time less than 1.5x
        assert curves[-1]["tree"].total_s < 1.5 * curves[0]["tree"].total_s
ax.set_xscale("log")
ax.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
ax.xaxis.set_minor_formatter(ticker.NullFormatter())
plots.plain_log_axis(ax, "y")
ax.set_xlabel("sequence length N")
ax.set_ylim(0.01, 3000)  # room for the legend below the lines
ax.set_ylabel("ms per decode step")
ax.set_title("Predicted latency (model)")
ax.legend(fontsize=10, loc="lower right", ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: left, the model's ring/tree ratio against the number of GPUs, one dark line per
# sequence length (told apart by marker and style); the grey star is the paper's
# measurement. Look at the jump from one node to two: the model's ring then waits on
# InfiniBand. Right, the model's latency per step: ring (red) grows linearly with $N$ on one
# node (solid) and across sixteen (dashed), while tree (blue) stays nearly flat once it
# spans many GPUs.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>From published hardware figures, the model predicts that ring decoding is one to three
# orders of magnitude slower than tree decoding. The ring's predicted time is its compute
# (p × the tree's) plus the part of its transfers that compute does not hide, and that
# part is most of it (see the shares printed above). The paper measured much less; the next
# sections ask why.</p></div>

# %% [markdown]
# ### 6.4.2 Llama 3.1-8B on one node
#
# The paper's Table 1 (paper §6.4) times Llama 3.1-8B on 8 H100s and on 4 MI300X: a
# prefill plus 10 decoded tokens, mean ± standard error of 10 runs, in seconds. The table is
# in `cm.PAPER_LLAMA` and `cm.PAPER_LLAMA_STDERR`; the next cell prints it, with the ratio's
# standard error (first-order propagation of the two standard errors), and checks our
# transcription against the table's own rounded "Speedup" column.

# %%
print(f"{'hardware':<10}{'context':>8}{'tree s':>14}{'ring s':>14}{'ring/tree':>16}"
      f"{'table':>7}")
for hw, table in cm.PAPER_LLAMA.items():
    for n, (pt, pr) in table.items():
        et, er = cm.PAPER_LLAMA_STDERR[hw][n]
        r = pr / pt
        er_r = r * math.hypot(er / pr, et / pt)
        print(f"{hw:<10}{n:>8}{pt:>8.2f} ±{et:.2f}{pr:>8.2f} ±{er:.2f}{r:>9.1f} ±{er_r:.1f}x"
              f"{cm.PAPER_LLAMA_SPEEDUP[hw][n]:>6}x")
        assert round(pr / pt) == cm.PAPER_LLAMA_SPEEDUP[hw][n]

# %% [markdown]
# <div class="admonition note"><p class="admonition-title">Read the paper critically</p>
# <p>Two sentences around this table disagree with it. Paper §6.4 says "Ring Attention is up
# to ×4 faster using 8x H100s and up to ×3 faster using 4x MI300x": Tree Attention is meant.
# The conclusion (paper §7) reports "×3-5 speedupds" for Llama 3.1 with 1B and 8B
# parameters, while Table 1 (8B) shows ×2 to ×4; ×5 appears only in Table 2 of the appendix,
# Llama 3.2-1B on two RTX 4090s.</p></div>
#
# The model of the same run on one DGX H100 node: the sizes of `cm.LLAMA_3_1_8B` (from the
# Llama 3 paper's Table 3, printed below), one attention decode step per layer per token,
# plus reading the weights once per token. With only the sequence sharded, every GPU holds
# all the weights, so this part is the same for both methods. `cm.generation_time` adds it
# up; it leaves out the prefill.

# %%
node = h100.with_devices(8)
print(f"{llama.name}: {llama.layers} layers, {llama.q_heads} query heads and "
      f"{llama.kv_heads} kv heads of {llama.head_dim}, {llama.params:,} weights "
      f"= {llama.weight_bytes / 1e9:.2f} GB")
assert llama.params == 8_030_261_248  # the model card's "8.03B"
paper = cm.PAPER_LLAMA["8x H100"]
model_s = {n: cm.generation_time(n, node, tokens=10) for n in paper}
print(f"\n{'context':>8}{'model tree s':>14}{'model ring s':>14}{'ratio':>8}"
      f"{'paper tree s':>14}{'paper ring s':>14}{'ratio':>8}{'ring-tree: model':>18}"
      f"{'paper':>8}")
for n, (pt, pr) in paper.items():
    t, r = model_s[n]["tree"], model_s[n]["ring"]
    print(f"{n:>8}{t:>14.3f}{r:>14.3f}{r / t:>7.1f}x{pt:>14.2f}{pr:>14.2f}{pr / pt:>7.1f}x"
          f"{r - t:>18.3f}{pr - pt:>8.2f}")
model_ratio = [m["ring"] / m["tree"] for m in model_s.values()]
paper_ratio = [pr / pt for pt, pr in paper.values()]
paper_err = [pr / pt * math.hypot(er / pr, et / pt)
             for (pt, pr), (et, er) in zip(paper.values(), cm.PAPER_LLAMA_STDERR["8x H100"].values(),
                                          strict=True)]
share = [model_s[n]["tree"] / pt for n, (pt, _) in paper.items()]
gap = [(pr - pt) / (model_s[n]["ring"] - model_s[n]["tree"]) for n, (pt, pr) in paper.items()]
Markdown(
    f"The model's ratio grows with the context ({model_ratio[0]:.1f}× to "
    f"{model_ratio[-1]:.1f}×); the paper's, {paper_ratio[0]:.1f} ± {paper_err[0]:.1f} at "
    f"32k and {paper_ratio[-1]:.1f} ± {paper_err[-1]:.1f} at 256k, does not grow, within its "
    f"error bars. The model's tree time, which has no prefill, is only "
    f"{min(share):.0%}–{max(share):.0%} of the paper's, and the paper's ring − tree "
    f"difference is {min(gap):.0f}–{max(gap):.0f}× the model's.")

# %% [markdown]
# What else is in the paper's times? The table's times include a prefill over the whole
# prompt, and the paper does not say how it parallelises it.
#
# **Quiz (predict, then compute).** Estimate the prefill's flops for Llama 3.1-8B at a 32k
# and a 256k context: about $2 \times$ (number of weights) per token for the matrix
# products, plus causal attention, $2 \cdot 2 \cdot \frac{N^2}{2} \cdot H_q D$ per layer (the
# scores and the weighted sum, half of them masked). At the 8 GPUs' combined bf16 peak, how
# long would it take, at the very least, and how does that compare with Table 1's tree
# column?
#
# <details><summary>Answer</summary>
#
# About a tenth of a second at 32k, against 0.60 s in the table; nearly 3 s at 256k, about
# the table's 2.89 s (the cell prints both). At peak is a lower bound, so at long contexts
# the prefill alone can account for the tree's whole time. The table measures prefill as
# much as decoding; only the difference ring − tree isolates what decoding adds (if both
# methods prefill alike).
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_3", "locked": false, "schema_version": 3, "solution": true, "task": false}
prefill = {}
for n, (pt, _) in paper.items():
    matmul = 2 * llama.params * n
    attention_flops = llama.layers * 2 * 2 * n**2 / 2 * llama.q_heads * llama.head_dim
    prefill[n] = (matmul + attention_flops) / (8 * h100.flops)
    print(f"context {n:>7}: prefill >= {prefill[n]:.2f} s at peak; Table 1 tree {pt:.2f} s")
assert prefill[32768] < 0.25 * paper[32768][0] and prefill[262144] > 0.8 * paper[262144][0]
assert 0.05 < prefill[32768] < 0.2 and 2.5 < prefill[262144] < 3  # "about a tenth", "nearly 3"
assert abs(prefill[262144] / paper[262144][0] - 1) < 0.1  # "about the table's" tree time

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The paper's Llama timings include a prefill that a decode model leaves out: at the
# longest context, 256k, a prefill at peak speed alone (a lower bound on its time)
# takes about as long as the tree column; at 32k, under a quarter of it (both asserted in the
# quiz's answer cell). Only the
# difference ring − tree compares with a model of decoding, and there the paper's ring is
# slower than the model's.</p></div>

# %% [markdown]
# ## 6.5 Memory
#
# The paper's eqs. 8–9 (paper §6.2), in elements, with $t = N/p$ keys per device and
# $d = n_h d_h$: $\text{Mem}_\text{ring} = 4btd + 2bd$, the device's own K/V block and the
# one arriving from its neighbour (plus query and output), and $\text{Mem}_\text{tree} =
# 2btd + 2bd + 2bn_h$, its own block (plus query, numerator and two statistics per head).
# `cm.peak_memory_ring` and `cm.peak_memory_tree` add up these parts. Their ratio tends to
# 2 as the shard grows:

# %%
ts = np.geomspace(1_000, 640_000, 12).astype(int)
mem_tree = [cm.peak_memory_tree(1, int(t), 16, 128, itemsize=2) / 2**30 for t in ts]
mem_ring = [cm.peak_memory_ring(1, int(t), 16, 128, itemsize=2) / 2**30 for t in ts]
mem_ratio = [r / t for r, t in zip(mem_ring, mem_tree, strict=True)]
print(f"ring/tree peak memory: {mem_ratio[0]:.4f} at t={ts[0]:,} keys/device, "
      f"{mem_ratio[-1]:.6f} at t={ts[-1]:,}")
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(ts, mem_ring, "o-", color=plots.color("ring"), label="ring: 4btd + 2bd")
ax.plot(ts, mem_tree, "s-", color=plots.color("tree"), label="tree: 2btd + 2bd + 2bn_h")
plots.plain_log_axis(ax, "x")
plots.plain_log_axis(ax, "y")
ax.set_xlabel("keys per device t = N/p")
ax.set_ylabel("peak memory per device (GiB)")
ax.set_title("One attention block, 16×128, bf16 (paper's eqs. 8–9)")
ax.legend(fontsize=10)
plt.show()

# %% [markdown]
# *Figure: peak memory per device of ring (red) and tree (blue) against the keys each device
# holds, from the paper's eqs. 8–9. Look at the constant vertical gap: on a log axis a
# factor of 2.*
#
# What compiled programs allocate is measured in notebook 5 (§5.5), on XLA:CPU: this
# package's ring holds three K/V shards, its own, the block in use and the block in flight.
# The extra one is the block in use, a copy of its own shard in the loop's carry, because
# the step may not overwrite the cache (which, after its $p-1$ permutes, would not be back
# home); a ring that permutes $p$ times like the one the paper's footnote 2 links, and is
# given the cache, holds eq. 8's two.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>By the paper's formulas a ring needs twice the memory of tree for long shards: its own
# K/V block and the one arriving. More than that is an implementation's choice.</p></div>

# %% [markdown]
# ## 6.6 Why the model and the paper disagree
#
# On this machine the model's sum of parts was set beside measured decode latencies
# (section 6.3). The sentence under that table gives this run's errors, which vary from run
# to run. The package's model check (`tree-attention-edu calibrate --check`) sets predicted
# beside measured for every merge pattern (notebook 8 introduces them: six ways of
# combining the devices' partial states, of which `merge="auto"` picks among four) and both
# rings, `ring` (the pass-KV ring this notebook prices) and `ring_pass_q` (notebook 5's
# pass-Q ring), at three lengths on two meshes (`8`, the 8 devices in one row, and `2x4`,
# the same 8 devices arranged as 2 × 4): 48 cells, one per (method, mesh, length). Its
# calibration differs from §6.3's: it prices every collective kind as measured (not by
# MPICH's algorithms over the `ppermute` link), fits a fixed part to each kernel call (the
# intercept of the kernel's time at two lengths), and after calibrating at other sizes it
# times every cell in the same interleaved rounds as its local programs (the kernel at its
# two lengths, a copy of every device's K shard at once at 3/4 of the longest length, the
# fold loops) and its ring-shaped `ppermute` programs,
# and fits those parts again from these rounds. So its errors are not comparable with §6.3's
# table. Each run also records the regret of the calibrated model's pick among the four
# patterns `merge="auto"` chooses from: how much slower it measured, round by round, than
# the pattern it does worst against, with a target of at most 10%. It is measured in
# rounds of its own, after the cells': the four patterns without the other methods, at
# every length with batch 1 and at the shortest with a batch of 8 and 32 query heads (no
# cell covers that
# problem). Against each pattern, the pick's slowdown is the median over rounds of its
# time over that pattern's in the same round, less 1; the regret is the largest of these
# (0 where no pattern beats it that way; the pattern with the lowest median time can
# still be another).
# Each file's `failures` field lists every cell outside ±30% (the band) and every regret over
# its target, and the README in `results/calibrate/` summarises them.
#
# Two of the sets recorded there, three runs each, made on the same machine on the same
# day (per that README): `results/calibrate/` holds the check as it is now, and
# `results/calibrate/before/` the check before the last changes (`older/` holds older sets
# of which this notebook reads only `older/round15/`, for one number: an all-reduce's α).
# In both sets each collective kind's latency but the ring `ppermute`'s is timed as a chain
# (as the first bullet of §6.3's list of what `calibrate.measure_topology` measures
# describes for the all-reduce; an all-reduce's α on mesh 8, printed below, is
# over 100 µs in every calibration, where a lone all-reduce less a trivial program timed
# apart gave 0 to 5 µs in `older/round15/`),
# each operand of an all-reduce is priced apart, and the local programs are timed in the
# cells' rounds. Before, `auto`'s regret was the ratio of
# two medians, each round's order was the last one's rotated by one, and the ring's
# `ppermute` was timed only in the calibration's own rounds, its programs passing one
# array as both K and V. Now the regret pairs the rounds as above, over 61 of them, each
# round's order is drawn afresh from a fixed seed, and the ring-shaped `ppermute` programs
# pass K and V as two arrays and run again in the cells' rounds, the ring's link refitted
# from them. The next cell reads the records back: records, not tests.
# Notebook 8, §8.6, runs a shorter, different check live (its local parts and ring link
# timed apart), whose errors are not comparable with these records.

# %%
def read_checks(folder):
    """The recorded model checks in `folder`, by file name."""
    return {f.name: json.loads(f.read_text()) for f in sorted(folder.glob("check-run*.json"))}


checks = {"before": read_checks(ROOT / "results" / "calibrate" / "before"),
          "now": read_checks(ROOT / "results" / "calibrate")}
assert [len(runs) for runs in checks.values()] == [3, 3]
assert len(cm.MERGES) == 6 and len(AUTO_MERGES) == 4  # "six ways", "among four"
for runs in checks.values():  # "three lengths on two meshes", "48 cells"
    for rec in runs.values():
        assert len(rec["cells"]) == 48
        assert {c["seq_len"] for c in rec["cells"]} == {4096, 16384, 65536}
        assert {c["mesh"] for c in rec["cells"]} == {"8", "2x4"}
summary = {}  # by set: cells within the band, worst |error|, auto's worst regret, per run
for label, runs in checks.items():
    for name, rec in runs.items():
        cells = rec["cells"]
        far = max(cells, key=lambda c: abs(c["rel_err"]))
        n_in = sum(abs(c["rel_err"]) <= rec["band"] for c in cells)
        regret = max(a["regret"] for a in rec["auto"])
        summary.setdefault(label, []).append((n_in, abs(far["rel_err"]), regret))
        print(f"{label:>6} {name}: {n_in} of {len(cells)} cells within ±{rec['band']:.0%}; "
              f"worst {far['method']} on mesh {far['mesh']} at Tk = {far['seq_len']:,}: "
              f"{far['rel_err']:+.0%}; auto's worst regret {regret:+.1%}")
rec_band = checks["now"]["check-run1.json"]["regret_band"]
assert calibrate.BAND == 0.30  # "±30%"
assert all((rec["band"], rec["regret_band"]) == (calibrate.BAND, 0.10)
           for runs in checks.values() for rec in runs.values())
assert modelcheck.AUTO_REPEATS == 61  # "61 of them"
assert [(x.batch, x.q_heads) for x in modelcheck.AUTO_PROBLEMS] == [(8, 32)]  # "8 and 32"
before, now = summary["before"], summary["now"]
met = {label: [n == 48 and g <= rec_band for n, _, g in runs] for label, runs in summary.items()}
assert (sum(met["before"]), sum(met["now"])) == (1, 3)  # "one run of three", "all three"
errors = [c["rel_err"] for rec in checks["now"].values() for c in rec["cells"]]
assert all(not rec["failures"] for rec in checks["now"].values())
# Before: one miss in each of two runs, both on mesh 2x4 at the shortest length.
misses = {name: rec["failures"] for name, rec in checks["before"].items()}
assert [len(f) for f in misses.values()] == [0, 1, 1]
assert misses["check-run3.json"][0].startswith("ring on 2x4 at Tk=4096")  # "a cell"
assert misses["check-run2.json"][0].startswith("auto on 2x4 at Tk=4096")  # "a regret"
# The regret miss: the model priced its pick and the pattern it lost to within 1% of each
# other, and the same run's cell rounds measured the pick faster.
run = checks["before"]["check-run2.json"]
row = max(run["auto"], key=lambda a: a["regret"])
assert (row["mesh"], row["seq_len"], row["batch"]) == ("2x4", 4096, 1)
cell = {c["method"]: c for c in run["cells"] if (c["mesh"], c["seq_len"]) == ("2x4", 4096)}
priced = cell[row["picked"]]["predicted_s"] / cell[row["best"]]["predicted_s"]
assert row["regret"] > rec_band and abs(priced - 1) < 0.01  # "within 1%"
assert cell[row["picked"]]["measured_s"] < cell[row["best"]]["measured_s"]  # "faster"
# In both sets an all-reduce's α on mesh 8 is a chain's slope (a lone all-reduce less a
# no-op timed apart gave 0 to 5 µs, results/calibrate/README.md), and each fits a fixed part.
alpha_us = {label: [r["calibrations"]["8"]["links"]["all-reduce"]["alpha_s"] * 1e6
                    for r in runs.values()] for label, runs in checks.items()}
assert min(min(a) for a in alpha_us.values()) > 100  # "over 100 µs"
older = read_checks(ROOT / "results" / "calibrate" / "older" / "round15")
alpha_old = [r["calibrations"]["8"]["links"]["all-reduce"]["alpha_s"] * 1e6
             for r in older.values()]
assert len(alpha_old) == 3 and 0 <= min(alpha_old) and max(alpha_old) < 5  # "0 to 5 µs"
assert all(r["calibrations"][m]["kernel_fixed_s"] > 0 for runs in checks.values()
           for r in runs.values() for m in ("8", "2x4"))
print("all-reduce alpha on mesh 8, us: " + "; ".join(
    f"{label} {', '.join(f'{a:.0f}' for a in al)}" for label, al in alpha_us.items()))


# The ring's miss: the model's split of the pass-KV ring on mesh 2x4 at the shortest length,
# recomputed from each record's calibration: p folds off the fold curve, p - 1 copies of a
# shard at the copy rate (each reads and writes the shard, K and V), 2(p - 1) transfers
# (K and V sent apart) of one K or V block, read off the ppermute's curve.
def ring_split_ms(rec, mesh="2x4", seq_len=4096, p=8):
    """(folds, copies, transfers) of the ring's price in a record, ms."""
    cal, prob = rec["calibrations"][mesh], modelcheck.PROBLEM
    shard = 2 * (seq_len // p) * prob.kv_heads * prob.head_dim * 4  # K and V, float32
    link = cal["links"]["collective-permute"]
    fold = links.read_curve(tuple(map(tuple, cal["fold_points"])), shard, cal["mem_Bps"])
    send = links.read_curve(tuple(map(tuple, link["points"])), shard / 2, link["beta_Bps"])
    return 1e3 * p * fold, 1e3 * (p - 1) * 2 * shard / cal["copy_Bps"], 1e3 * 2 * (p - 1) * send


POINT = 522_240  # a point of the ppermute curve below the ring's block at Tk = 4,096


def permute_ms(rec, mesh, nbytes=POINT):
    """The ring-shaped ppermute's time at `nbytes` in a record's calibration of `mesh`, ms."""
    points = rec["calibrations"][mesh]["links"]["collective-permute"]["points"]
    return dict((int(n), t) for n, t in points)[nbytes] * 1e3


p052 = {label: [permute_ms(r, "2x4") for r in runs.values()] for label, runs in checks.items()}
NEXT = 2_095_104  # the curve's next point, above the 1.05 MB transfer
p21 = [permute_ms(r, "2x4", NEXT) for r in checks["before"].values()]
assert p21[2] / max(p21[:2]) < p052["before"][2] / max(p052["before"][:2])  # "rose less"
assert p052["before"][2] > 2.5 * max(p052["before"][:2])  # before's run 3: the slow point
assert max(p052["now"]) / min(p052["now"]) < 1.1  # refitted in the cells' rounds: narrower
assert min(p052["now"]) > max(p052["before"][:2])  # "at a higher level"
print(f"ppermute at {POINT / 1e6:.2f} MB on mesh 2x4, ms: " + "; ".join(
    f"{label} {', '.join(f'{t:.2f}' for t in ts)}" for label, ts in p052.items()))
split = {label: [ring_split_ms(r) for r in runs.values()] for label, runs in checks.items()}
block_mb = (4096 // 8) * modelcheck.PROBLEM.kv_heads * modelcheck.PROBLEM.head_dim * 4 / 1e6
assert (NEXT / 1e6 - block_mb) / (NEXT / 1e6 - POINT / 1e6) > 0.5  # "mostly at" POINT
for label, rows in split.items():
    print(f"{label:>6} ring on 2x4 at Tk = 4,096, folds / copies / transfers, ms: " + "; ".join(
        " / ".join(f"{x:.1f}" for x in row) for row in rows))
ring_cell = {label: [next(c for c in r["cells"] if (c["method"], c["mesh"], c["seq_len"])
                          == ("ring", "2x4", 4096)) for r in runs.values()]
             for label, runs in checks.items()}
sends_b, copies_n = [t for _, _, t in split["before"]], [c for _, c, _ in split["now"]]
transfers_n = [t for _, _, t in split["now"]]
rise = [x - (a + b) / 2 for x, a, b in zip(split["now"][2], *split["now"][:2])]
assert rise[1] > sum(rise) / 2  # "mostly because of its copies": most of the rise
pred_3 = [c[2]["predicted_s"] for c in (ring_cell["now"], ring_cell["before"])]
assert abs(pred_3[0] / pred_3[1] - 1) < 0.05  # "about as before's run 3"
copy_gbs = [r["calibrations"]["2x4"]["copy_Bps"] / 1e9 for r in checks["now"].values()]
ring_ms = [c["measured_s"] * 1e3 for c in ring_cell["now"]]
copy_slows = sorted(g / copy_gbs[2] for g in copy_gbs[:2])
copy_slow = copy_slows[0]
ring_slow = sorted(ring_ms[2] / t for t in ring_ms[:2])
assert copy_slow > 1.5 > 1.2 > ring_slow[1]  # the copy slowed "far more" than the ring
kernel_long = localfit.kernel_problems(modelcheck.PROBLEM, 8, modelcheck.GRID_SEQ_LENS)[-1]
copy_mb = kernel_long.kv_bytes / 2 / 8 / 1e6  # the copy program copies a device's K shard
assert kernel_long.seq_len == 3 * max(modelcheck.GRID_SEQ_LENS) // 4  # "3/4 of the longest"
cell_rounds = inspect.signature(modelcheck.run).parameters["repeats"].default
cluster = json.loads((ROOT / "results" / "cluster" / "2x2x2.json").read_text())
errs = [m["predicted_s"] / m["median_s"] - 1 for rate in cluster["rates"]
        for m in rate["methods"].values() if m.get("predicted_s") and m.get("median_s")]
cl_in, cl_n = sum(abs(e) <= calibrate.BAND for e in errs), len(errs)
assert cl_in < cl_n  # "not met on the 2×2×2 cluster"
price = [c["predicted_s"] * 1e3 for c in ring_cell["now"]]
price_rise = sorted(price[2] / t - 1 for t in price[:2])
ring_rise = sorted(ring_ms[2] / t - 1 for t in ring_ms[:2])
assert price_rise[0] > 2 * ring_rise[1]  # the price rose far more than the measured time
gpu = json.loads((ROOT / "results" / "gpu" / "single-device-check.json").read_text())
assert gpu["band"] == calibrate.BAND  # "the same band"
(gpu_in, gpu_n), (gpu_in_s, gpu_n_s) = (
    (gpu["summary"][k]["within"], gpu["summary"][k]["cells"]) for k in ("Tk >= 128k", "Tk < 128k"))
assert gpu_in < gpu_n and gpu_in_s < gpu_n_s  # "not met"
assert sends_b[2] > 1.6 * max(sends_b[:2])  # before: run 3's transfers
assert copies_n[2] > 1.6 * max(copies_n[:2])  # now: run 3's copies
assert all(abs(sum(split[k][i]) / (c["predicted_s"] * 1e3) - 1) < 0.02
           for k in split for i, c in enumerate(ring_cell[k]))  # the split is the price
# Now: run 3's largest error is a ring cell, and it over-predicts the ring on every cell.
cells3 = checks["now"]["check-run3.json"]["cells"]
assert max(cells3, key=lambda c: abs(c["rel_err"]))["method"] == "ring"
ring3 = [c["rel_err"] for c in cells3 if c["method"] == "ring"]
assert min(ring3) > 0.05
# auto's pick on mesh 8 at the shortest length: allgather and all_to_all priced within 1%.
rows8 = [(a, {c["method"]: c["predicted_s"] for c in r["cells"]
              if (c["mesh"], c["seq_len"]) == ("8", 4096)})
         for r in checks["now"].values() for a in r["auto"]
         if (a["mesh"], a["seq_len"], a["batch"]) == ("8", 4096, 1)]
picks = [a["picked"] for a, _ in rows8]
regrets8 = [f"{a['regret']:.1%}" for a, _ in rows8]


# The cross-check that told against before's regret: the pick against the fastest of the
# four in the cells' own rounds (one median of the check's 11 rounds each), per run.
def cells_regret(rec):
    """The largest slowdown of a batch-1 pick against the fastest of AUTO_MERGES, as the
    cells' rounds measured them."""
    worst = 0.0
    for a in (a for a in rec["auto"] if a["batch"] == 1):
        t = {c["method"]: c["measured_s"] for c in rec["cells"]
             if (c["mesh"], c["seq_len"]) == (a["mesh"], a["seq_len"])}
        worst = max(worst, t[a["picked"]] / min(t[m] for m in AUTO_MERGES) - 1)
    return worst


cross = {label: [cells_regret(r) for r in runs.values()] for label, runs in checks.items()}
print("the pick against the fastest in the cells' rounds, worst per run: " + "; ".join(
    f"{label} {', '.join(f'{g:.1%}' for g in gs)}" for label, gs in cross.items()))
assert max(cross["now"]) > rec_band >= max(cross["before"])  # "one run over", "no better"
# The old formula (a ratio of two medians) over the new rounds: each row's medians_s.
unpaired = [max(a["medians_s"][a["picked"]] / min(a["medians_s"].values()) - 1
                for a in r["auto"]) for r in checks["now"].values()]
assert max(unpaired) < rec_band / 3  # "not what brought it under the target"
# One measure for both sets: every cell in the band and the cells'-rounds regret within it.
met_common = {label: sum(n == 48 and g <= rec_band for (n, _, _), g in zip(summary[label], gs))
              for label, gs in cross.items()}
assert met_common["before"] == met_common["now"]  # no better, by that measure
assert len(set(picks)) > 1  # "moves"
assert all(abs(pred[a["picked"]] / pred[other] - 1) < 0.01  # "near-tied": priced within 1%
           for a, pred in rows8 for other in ("allgather", "all_to_all"))
Markdown(
    f"Before, the runs had {', '.join(str(n) for n, _, _ in before)} of 48 cells within "
    f"±{calibrate.BAND:.0%} and `auto`'s worst regret was "
    f"{', '.join(f'{g:.1%}' for _, _, g in before)}: both targets (every cell within the "
    f"band, every regret at most {rec_band:.0%}) were met in one run of three. Each other "
    f"run missed one, on mesh 2x4 at $T_k$ = 4,096. One was a regret of {row['regret']:.1%}, "
    f"then a ratio of two medians over `auto`'s own rounds: the model priced "
    f"{row['picked']}, which it picked, and {row['best']} within 1% of each other, while "
    f"the same run's cell rounds measured {row['picked']} faster. The other was a cell "
    f"({misses['check-run3.json'][0]}): the model's split of that ring (printed above) put "
    f"its transfers at {sends_b[2]:.1f} ms against {sends_b[0]:.1f} and {sends_b[1]:.1f} ms "
    f"in the other two runs, read off the `ppermute` curve mostly at its "
    f"{POINT / 1e6:.2f} MB point (each transfer, one K or V block of {block_mb:.2f} MB, is "
    f"read between that point and the next), which run 3's calibration timed "
    f"at {p052['before'][2]:.2f} ms, against "
    f"{' and '.join(f'{t:.2f}' for t in p052['before'][:2])} ms (the next point, "
    f"{NEXT / 1e6:.1f} MB, rose less: {p21[2]:.2f} against {p21[0]:.2f} and {p21[1]:.2f} "
    f"ms). Now the runs have "
    f"{', '.join(str(n) for n, _, _ in now)} of 48 cells within the band, every error "
    f"between {min(errors):+.0%} and {max(errors):+.0%}, and `auto`'s worst regret is "
    f"{', '.join(f'{g:.1%}' for _, _, g in now)}: both targets are met in all three runs, "
    f"on these simulated devices, as the check now measures the regret (below, another "
    f"measure of it, common to both sets, meets both targets in {met_common['before']} runs "
    f"of three before and in {met_common['now']} now). The same band is not met on the "
    f"2×2×2 cluster ({cl_in} of {cl_n} predictions within it in `results/cluster/`'s "
    f"record, notebook 9) or against the recorded H200 kernels (`results/gpu/`: {gpu_in} of {gpu_n} kernel "
    f"cells within it at $T_k$ ≥ 128k, {gpu_in_s} of {gpu_n_s} below). Refitted in the cells' rounds, "
    f"that {POINT / 1e6:.2f} MB point on mesh 2x4 is {min(p052['now']):.2f} to "
    f"{max(p052['now']):.2f} ms in the three runs: a narrower spread, higher than before's "
    f"runs 1 and 2, from programs that now also pass K and V as two arrays. Run "
    f"3's largest error is the "
    f"ring's, over-predicted on every cell, {min(ring3):+.0%} to {max(ring3):+.0%}: on mesh "
    f"2x4 at the shortest length it is priced {price[2]:.1f} ms, about as before's run 3 "
    f"({ring_cell['before'][2]['predicted_s'] * 1e3:.1f} ms), against {price[0]:.1f} and "
    f"{price[1]:.1f} ms in runs 1 and 2, {price_rise[0]:+.0%} to {price_rise[1]:+.0%}, where "
    f"its measured time rose {ring_rise[0]:+.0%} to {ring_rise[1]:+.0%}. The price rose "
    f"mostly because of its copies of a shard (one device's K and V), "
    f"{copies_n[2]:.1f} ms against {copies_n[0]:.1f} and {copies_n[1]:.1f} ms (its "
    f"{2 * (8 - 1)} transfers {transfers_n[2]:.1f} against {transfers_n[0]:.1f} and {transfers_n[1]:.1f} "
    f"ms; the split printed above leaves out the per-call overhead and the output's "
    f"all-reduce). The copies' rate comes from a standalone copy of each device's K shard "
    f"(all 8 at once) at 3/4 of the "
    f"longest length ({copy_mb:.1f} MB per device), timed in the cells' rounds: {copy_gbs[2]:.2f} GB/s "
    f"(bytes read plus written) against {copy_gbs[0]:.2f} and {copy_gbs[1]:.2f}, "
    f"{copy_slows[0]:.2f} to {copy_slows[1]:.2f} times slower. Why that copy slowed so "
    f"much more than the ring, and "
    f"whether a copy of that size prices the ring's smaller ones, was not measured. "
    f"The calibrated model's pick (what `merge=\"auto\"` would pick with that run's "
    f"calibration; `tree_decode(merge=\"auto\")` itself prices DGX H100 figures) on mesh 8 "
    f"at the shortest length moves from run to run "
    f"({', '.join(picks)}) between patterns the model prices within 1% of each other, with "
    f"regrets of {', '.join(regrets8)}. Measured instead as the cells' rounds measured them "
    f"(one median of {cell_rounds} rounds each, the cross-check that told against before's "
    f"regret), "
    f"the batch-1 picks, over both meshes and all lengths, are up to "
    f"{', '.join(f'{g:.1%}' for g in cross['now'])} slower than the fastest of the four in "
    f"the three runs, against "
    f"{', '.join(f'{g:.1%}' for g in cross['before'])} before: by that measure the picks "
    f"are no better than before, and one run is over the target. The two measures "
    f"disagree, and which is nearer the truth was not measured. The model prices the four "
    f"patterns by the same formulas as before, its prices moving with each run's "
    f"calibration; what changed for the regret is the rounds it is measured in: the old "
    f"formula, a ratio of two medians, over the new {modelcheck.AUTO_REPEATS} rounds gives "
    f"{', '.join(f'{g:.1%}' for g in unpaired)}, so the pairing is not what brought it "
    f"under the target, and the disagreement is between `auto`'s rounds and the cells' "
    f"rounds, not between the formulas. The records do not separate the rounds' number "
    f"from their drawn order, and they do not validate the model: they show how far "
    f"it gets on this machine on one day, and the check exits 1 whenever a run misses. They "
    f"say nothing of the GPU cluster: the same sum of parts, filled with published figures "
    f"instead of these measurements, is what the rest of this section sets beside the "
    f"paper's timings.")

# %% [markdown]
# Filled with published GPU figures, it predicts much larger ring/tree gaps than the paper
# reports. We do not tune the model until it agrees. The disagreement is a question
# about what the paper's timings contain, and about what the model leaves out; the next
# cell computes the numbers the argument needs.

# %%
worst = micro[128, 5_120_000]
t_step, r_step = worst["tree"].total_s, worst["ring"].total_s
need = (r_step - 8 * t_step) / 7  # (r + o) / (t + o) = 8
slowed = cm.paper_microbenchmark(5_120_000, 128, dataclasses.replace(h100, overhead_s=need))
np.testing.assert_allclose(slowed["ring"].total_s / slowed["tree"].total_s, 8, rtol=1e-12)

# The paper's overlap example (paper §6.3): 640,000 tokens on the 8 GPUs of one node,
# hidden size 2048 (16 heads of 128), bf16.
N_EX, P_EX = 640_000, 8
t_ex = N_EX // P_EX
block_s = cm.local_decode_time(1, t_ex, 16, 128, 128, 16, node, itemsize=2)
send_s = 2 * node.intra.send(t_ex * 16 * 128 * 2)  # its K and its V block
assert 1e-4 < block_s < 1e-3 and 1e-3 < send_s < 1e-2 and send_s > 5 * block_s
assert send_s < 100 * block_s  # several times longer than compute, not a hundred
assert need > 10 * t_step  # such a fixed cost would dominate the modelled tree step
tree_range = [v["tree"].total_s for v in micro.values()]
Markdown(
    f"* For the model to report the paper's 8× at $p = 128$, $N$ = {NS[-1]:,}, each decode "
    f"call would need a fixed cost of about {need * 1e3:.0f} ms paid by both methods "
    f"(the model's tree step is {t_step * 1e3:.2f} ms).\n"
    f"* In the paper's overlap example (paper §6.3: {N_EX:,} tokens on {P_EX} GPUs, hidden "
    f"size 2048, bf16) the model gives {block_s * 1e6:.0f} µs to read one device's K and V "
    f"block at {h100.mem_Bps / 1e12:.2f} TB/s and {send_s * 1e3:.2f} ms to pass it to the "
    f"next GPU over NVLink: {send_s / block_s:.1f}×. The paper writes $O(10^{{-5}})$ s "
    f"and $O(10^{{-3}})$ s; reading the block from memory cannot take less than "
    f"{block_s * 1e6:.0f} µs, so the ratio is nearer {send_s / block_s:.0f}× than a hundred.\n"
    f"* The model's tree step ranges from {min(tree_range) * 1e3:.2f} ms to "
    f"{max(tree_range) * 1e3:.2f} ms over the microbenchmark's sizes.")

# %% [markdown]
# **Exercise 3.** On one DGX H100 node at the microbenchmark's $N$ = 1,280,000, how fast
# would each GPU's link have to be (per direction) for ring decoding to hide every K/V
# transfer behind a block's compute? Compare the answer with the HBM bandwidth. Check it
# with `cm.predict_ring` on a modified topology (`dataclasses.replace`): with the link just
# fast enough, the only communication left is the final broadcast of the output.
#
# <details><summary>Answer</summary>
#
# A step hides its transfer when sending the K and V blocks, $2(\alpha + n/\beta)$ with $n$
# the bytes of one block, takes no longer than reading both from memory, $2n/\text{HBM}$.
# So $\beta \ge n/(n/\text{HBM} - \alpha)$: slightly *more* than the memory bandwidth itself
# (printed below). No interconnect comes close, which is why ring decoding cannot hide its
# transfers, whatever the overlap.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "answer_4", "locked": false, "schema_version": 3, "solution": true, "task": false}
N3, P3 = 1_280_000, 8
t3 = N3 // P3
block_bytes = t3 * 16 * 128 * 2  # one K (or V) block of the microbenchmark, bf16
beta_need = block_bytes / (block_bytes / node.mem_Bps - node.intra.alpha_s)
print(f"link bandwidth needed: {beta_need / 1e12:.3f} TB/s per direction "
      f"(HBM: {node.mem_Bps / 1e12:.2f} TB/s; NVLink 4: {node.intra.beta_Bps / 1e12:.2f} TB/s)")
kw = cm.PAPER_MICROBENCHMARK
broadcast = cm.ring_collectives(batch=1, kv_len=N3, kv_heads=16, head_dim=128, v_dim=128,
                                p=P3, itemsize=2, q_heads=16)[2:]  # the output's all-reduce
for factor, hidden in ((1.001, True), (0.999, False)):
    topo = dataclasses.replace(node, intra=cm.Link(node.intra.alpha_s, beta_need * factor))
    left = cm.predict_ring(N3, topo, **kw).comm_s - cm.collectives_time(broadcast, topo)
    assert (abs(left) < 1e-15) == hidden, (factor, left)  # transfers hidden, or not
assert beta_need > node.mem_Bps

# %% [markdown]
# Reading these:
#
# * **What the timings include.** A fixed cost per call (Python dispatch, launching a jitted
#   program on many hosts, host synchronisation, a profiler) is paid by both methods and
#   compresses the ratio; the first bullet above says how large it would have to be. The
#   Llama times add a prefill over the whole prompt (section 6.4.2). If the prefill is the
#   same for both methods, the *difference* ring − tree is what decoding contributes.
# * **Overlap.** The model lets a GPU overlap the next block's transfer with compute; the
#   paper argues (paper §6.3) that decoding cannot hide transfers. The second bullet and
#   exercise 3 agree that transfers take several times longer than compute, though not a
#   hundred times, so overlap does not close the gap either way.
# * **The collectives.** The model prices links with Hockney's α + n/β and collectives with
#   MPICH's algorithms. NCCL's protocols, channels and in-switch reductions (NVLS) move data
#   differently, and large transfers reach less than a link's peak (NCCL measures an
#   allreduce bus bandwidth of about 370 GB/s on NVLink 4, whose peak is 450 GB/s per
#   direction; NVIDIA/nccl issue 1455). This makes real ring times *larger* than the
#   model's, widening the gap.
# * **The ring baseline.** The ring the paper's footnote 2 links to (nshepperd's
#   flash_attn_jax; the paper itself does not say how its ring runs) runs Flash Attention 2
#   on each block and, in that repository's code, permutes $p$ times. Overlapping its
#   transfers across layers, or smaller blocks, could hide at most its compute share, not
#   the unhidden transfer time that is most of the model's ring time (section 6.4.1's
#   split, asserted there).
# * **The model itself.** Its CPU calibration compared it with XLA:CPU, where collectives
#   are memory copies and the compiled ring copies its block at every step, and its errors
#   there vary from run to run (section 6.3); the published GPU figures enter untested. The extrapolation reaches sequence lengths more than a hundred times
#   the calibrated ones. Read its ratios as orders of magnitude.
#
# What survives every reading: tree decoding's traffic is independent of $N$ and ring's grows
# linearly with it (measured in the compiled programs of notebooks 4 and 5); ring decoding
# repeats the tree's local work $p$ times (counted in notebook 5); and ring needs more memory
# per device than tree, twice by the paper's formulas.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Filled with published figures, the model's ring/tree ratios span one to three orders
# of magnitude (§6.4.1); against the paper's microbenchmark at its largest point the model's
# ratio is over a hundred times the paper's "close ×8". That is a question, not evidence: on this machine the same model
# misses measured latencies by the errors §6.3 prints, and its GPU figures are untested.
# One hypothesis the model supports is that the paper's timings are dominated by costs that
# are not the attention step (a prefill, fixed per-call costs). The model is consistent
# with it; it does not test it.</p></div>

# %% [markdown]
# ## 6.7 Summary
#
# * A decode step does $2 G T_q/\text{itemsize}$ flops per byte of K and V (XLA's count of a
#   compiled step agrees), so it runs at the speed of memory in bf16 and in float32; a good
#   kernel reads a head-major cache in one pass.
# * A collective's cost is its schedule of messages, each $\alpha + n/\beta$ in Hockney's
#   model (on this machine, read off the measured points); the model uses
#   MPICH's ring and recursive-doubling algorithms (NCCL has others). Calibrated on this
#   machine by micro-benchmarks at other sizes (an overhead, each link's time per message
#   size, the decode bandwidth, a copy's rate, a fold inside the ring's loop), it is set
#   beside tree and
#   ring latencies it was not fitted to, on XLA:CPU; section 6.3 prints this run's errors,
#   and §6.6 the recorded checks (`results/calibrate/`), before and after the changes that
#   section lists (`auto`'s regret from ratios in the same rounds, each round's order drawn
#   from a seed, the ring's `ppermute` programs passing K and V as two arrays and timed
#   again in the cells' rounds, 61 rounds for the regret): both targets met in all three
#   runs now on the simulated devices, as the check now measures the regret (before, as
#   its own check measured it: in one of three, and the same formula over the new rounds
#   meets them in all three); measured from the cells' own rounds, another measure common to
#   both sets, both targets are met in two runs of three before and now (one run now over
#   10%). The same band is not met on the 2×2×2 cluster (notebook 9)
#   or against the recorded H200 kernels (§6.6 prints how far), so the project's issue for
#   this model stays open. That is how far
#   the model gets on this machine, not a validation of it (notebook 8, §8.6, runs a
#   shorter, different check live).
# * With published DGX H100 figures it predicts ring/tree gaps of tens on one node and up to
#   about 1,700× across nodes (section 6.4.1 prints both ranges), far above the paper's
#   reported speedups. The ring's predicted
#   time is its compute ($p$ × the tree's) plus its transfers, and the transfers are most of
#   it. Why the paper measured less (a prefill, fixed per-call costs) is a hypothesis the
#   model supports, not one it tests. The paper's Llama timings include a prefill that, at
#   the longest context (256k), takes at peak speed alone about as long as its tree column.
# * Tree decoding's traffic does not grow with $N$; ring's does. By the paper's formulas ring
#   needs twice the memory (notebook 5 measures what compiled programs hold).
#
# The exercises are in the sections: quizzes in §6.1, §6.3 and §6.4.2, and three exercises
# (the allreduce costs from their step counts and a link fit in §6.3, the link a ring would
# need in §6.6).
#
# ## 6.8 References
#
# * Shyam, Pilault, Shepperd, Anthony, Millidge, *Tree Attention: Topology-aware Decoding for
#   Long-Context Attention on GPU Clusters*, arXiv 2408.04093: §5.3 (NCCL's
#   algorithms), §6 (the DGX H100 cluster), §6.1 and Fig. 3 (the
#   microbenchmark, about 8× at 128 GPUs and 5.12M tokens), §6.2 eqs. 8–9 (peak
#   memory), §6.3 (communication volume and its overlap example), §6.4 Table 1
#   (Llama 3.1-8B on 8× H100 and 4× MI300X), Appendix C.3 Table 2 (Llama 3.2-1B on RTX
#   4090s), footnote 2 (the ring baseline).
# * R. Hockney, *The communication challenge for MPP: Intel Paragon and Meiko CS-2*,
#   Parallel Computing 20(3), 1994 (the α + n/β model).
# * R. Thakur, R. Rabenseifner, W. Gropp, *Optimization of Collective Communication
#   Operations in MPICH*, IJHPCA 19(1), 2005 (ring and recursive-doubling allreduce).
# * NCCL documentation, environment variables `NCCL_ALGO` (Ring, Tree, CollNet, NVLS, PAT)
#   and `NCCL_PROTO`: the algorithms NCCL chooses among.
# * A. Grattafiori et al., *The Llama 3 Herd of Models*, arXiv 2407.21783, Table 3 (the 8B
#   model's sizes).
# * Hardware figures (`cm.DGX_H100.sources`, printed in section 6.4): the NVIDIA H100 Tensor
#   Core GPU datasheet (HBM3 bandwidth, bf16 and FP32 flops), the NVIDIA DGX H100 user guide
#   (NVLink 4, NDR InfiniBand per GPU), NVIDIA/nccl issues 1259 (small-message allreduce on
#   2 H100s) and 1244 (across 2 nodes), and issue 1455 (NVLink allreduce bus bandwidth).
# * J. Austin et al., *How to Scale Your Model* (jax-ml/scaling-book), part 1 on rooflines.
