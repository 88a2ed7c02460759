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
# # 7. Decoding a model with a sharded KV cache, and an associative memory
#
# The paper's practical claim is about a real decoder (Llama 3.1-8B). Here the attention
# kernels run inside a generation loop, with the bookkeeping a KV cache needs: a fixed
# capacity, prompts of different lengths, and every new token's keys and values appended to
# the device that owns its position. Then we put a large associative memory on 8 devices.
#
# This notebook runs on 8 simulated CPU devices, also on a machine with a GPU: the first cell
# pins JAX to the CPU.
#
# **Prerequisites.** Notebook 1 (the energy $F$), notebook 4 (tree decoding on a mesh),
# notebook 5 (Ring Attention) and notebook 6, section 6.2 (why the cache is head-major). A
# transformer decoder with a KV cache (e.g. the Annotated Transformer) helps.
#
# **Time.** About 35 minutes to read and work the exercises; a few minutes to run.
#
# **Learning objectives.** After this notebook you can
#
# * describe how `tree_attention_edu.llama.model` builds a small Llama-style decoder (RMSNorm,
#   rotary embeddings, grouped-query attention, SwiGLU) and shards its cache along the
#   sequence, and say which device owns a position;
# * show that single-device, tree (1-D and 2-level meshes) and ring attention generate *the
#   same tokens*, and why float32 rounding cannot change a greedy choice here;
# * measure per-token latency of tree against ring decoding, and count the bytes each moves;
# * read attention as a modern Hopfield memory: retrieval as a gradient step on an energy,
#   and its accuracy against the number of stored patterns and the inverse temperature,
#   sharded and single-device alike;
# * load a Llama checkpoint in the Hugging Face layout from disk and decode it across devices.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import dataclasses
import shutil
import statistics
import tempfile
from pathlib import Path

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from matplotlib import ticker
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from tree_attention_edu import plots
from tree_attention_edu.llama import checkpoint, model
from tree_attention_edu.perf import costmodel as cm
from tree_attention_edu.theory import hopfield as hf

assert jax.device_count() == 8, jax.devices()
mesh = tae.make_mesh(8, "x")
mesh2 = tae.make_mesh((2, 4), ("node", "gpu"))

# %% [markdown]
# **Settings.** The defaults keep this notebook to a few minutes on a 2-core laptop;
# `LARGE = True` doubles the context of the latency measurement in section 7.4.

# %%
LARGE = False
NEW_TOKENS = 32  # greedy tokens per prompt in section 7.3
PREFILL_CHUNK = 16  # prompt tokens per prefill step in section 7.3
CTX = 4096 if LARGE else 2048  # longest prompt of the latency measurement (section 7.4)
TIMED_TOKENS = 16  # new tokens per prompt in section 7.4

# %% [markdown]
# ## 7.1 The model
#
# `model.Config` holds the sizes; `init_params` draws weights from an explicit key (no
# training, no download). The `tiny` preset runs quickly on a CPU; `small` shows scale. The
# cell counts the weights, and checks the count against `costmodel.ModelShape`, the formula
# notebook 6 uses for Llama 3.1-8B.

# %%
def shape_of(cfg: model.Config) -> cm.ModelShape:
    return cm.ModelShape(cfg.layers, cfg.dim, cfg.q_heads, cfg.kv_heads, cfg.head_dim,
                         cfg.hidden, cfg.vocab, cfg.tie_embeddings, itemsize=4)


cfg = model.PRESETS["tiny"]
params = model.init_params(cfg, jax.random.key(0))
n_params = sum(x.size for x in jax.tree.leaves(params))
assert n_params == shape_of(cfg).params
print(f"tiny: {cfg.layers} layers, dim {cfg.dim}, vocabulary {cfg.vocab}, SwiGLU width "
      f"{cfg.hidden}, {n_params:,} parameters;\n      {cfg.q_heads} query heads of "
      f"{cfg.head_dim} share {cfg.kv_heads} kv heads (groups of {cfg.q_heads // cfg.kv_heads})")
small = model.PRESETS["small"]
print(f"small: {small.layers} layers, dim {small.dim}, {shape_of(small).params:,} parameters")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>The model is Llama's architecture at toy size, with weights from an explicit key, so every
# output below is reproducible.</p></div>
#
# ## 7.2 The cache and its partitioning rule
#
# Each layer's cache is `k, v [B, Hkv, S, D]`: head-major, because the `"xla"` kernel reads
# that layout in one streaming pass with no cache-sized temporary (notebook 6, section 6.2).
# Its capacity `S` is fixed, so the decode step has one shape and compiles once. Along `S` it
# is cut into `p` contiguous blocks: position `pos` lives on device `pos // (S/p)`. A decode
# step appends each sequence's token at its own length, on whichever device owns that slot;
# attention then masks every sequence to its own length.

# %%
lengths = [5, 17, 40]
capacity, p = 64, mesh.size
fig, ax = plt.subplots(figsize=(9, 2.6))
plots.cache_partition(lengths, capacity=capacity, p=p, ax=ax)
ax.set_title(f"A ragged batch in a {capacity}-slot cache on {p} devices")
plt.show()
owner = [n // (capacity // p) for n in lengths]
print("next token's slot and owning device per sequence:", list(zip(lengths, owner, strict=True)))
assert owner == [0, 2, 5]

# %% [markdown]
# *Figure: one row per sequence; the grey bar is its filled cache, the green box the slot its
# next token goes to, and the vertical lines the boundaries between devices. Look at how the
# three next slots fall on three different devices: each decode step writes on whichever
# device owns the slot.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A fixed capacity cut into contiguous blocks gives every position one owner, so decoding
# appends in place and attention never moves the cache.</p></div>

# %% [markdown]
# ## 7.3 The same tokens, whichever attention
#
# Greedy generation for three prompts of different lengths, with the attention of every
# prefill chunk and decode step computed four ways. Prefill goes through the model in
# chunks using the *same* method as decoding (tree, ring or single-device), with the causal
# mask. (`prefill_method=` chooses a different one; `tests/test_model.py` checks that the
# tokens and logits are then the same too.) The number of new tokens and the chunk size are `NEW_TOKENS` and
# `PREFILL_CHUNK` in the settings cell.

# %%
rng = np.random.default_rng(0)
prompts = [rng.integers(0, cfg.vocab, n).tolist() for n in lengths]
runs = {}
for name, m, method in (("single", mesh, "single"), ("tree, 1-D mesh", mesh, "tree"),
                        ("tree, (node, gpu) mesh", mesh2, "tree"), ("ring", mesh, "ring")):
    gen = model.Generator(params, cfg, m, method, prefill_chunk=PREFILL_CHUNK)
    runs[name] = gen.generate(prompts, NEW_TOKENS, key=jax.random.key(1))
    assert gen.traces == 1, gen.traces  # one compilation of the decode step

ref = runs["single"]
# The size of float32 rounding differences depends on the CPU's vector instructions, so
# the checked output states the tolerance that the assertion enforces, not the difference.
LOGIT_ATOL = 1e-4
for name, out in runs.items():
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    diff = np.abs(out.logits - ref.logits).max()
    assert diff < LOGIT_ATOL, (name, diff)
    print(f"{name:>24}: tokens identical; logits within {LOGIT_ATOL:g} at every step")
print(f"\n{NEW_TOKENS} tokens per prompt, prefill chunks of {PREFILL_CHUNK}; first 12 generated "
      "tokens per sequence:")
for row in ref.tokens[:, :12].tolist():
    print("  ", row)
assert all(len(set(row)) > NEW_TOKENS // 2 for row in ref.tokens.tolist())  # not constant

# %% [markdown]
# The logit differences are float32 rounding: the methods add the same numbers in a
# different order. Greedy decoding picks the same token as long as no logit moves by half the
# gap between the best and the second-best token. The next cell measures the smallest such
# gap over every step and sequence, bounds the differences by a power of ten (their exact
# size depends on the CPU's vector instructions, the bound much less), and asserts that the
# bound is far below the gap.

# %%
top2 = np.sort(ref.logits, axis=-1)[..., -2:]
gap = float((top2[..., 1] - top2[..., 0]).min())
largest = max(float(np.abs(o.logits - ref.logits).max()) for o in runs.values())
bound = 10.0 ** np.ceil(np.log10(largest))
assert largest < bound and bound < gap / 100
print(f"smallest gap between the top two logits, over all steps: {gap:.2e}")
print(f"largest logit difference between methods:                below {bound:.0e}")
print(f"the gap is more than {gap / bound:.0f} times the bound")

# %% [markdown]
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Tree, 2-level tree and ring attention are exact: they change only the order of
# float32 additions, by far less than the margin of any greedy choice, so they generate the
# same tokens as one device.</p></div>
#
# ## 7.4 Per-token latency: tree against ring
#
# A longer context makes the difference visible: two prompts of `CTX` and three quarters of
# `CTX` tokens, and the `tiny` model widened to more query and kv heads (printed below). Each
# decode step of ring attention moves every layer's cache shards around the ring; tree
# attention Allreduces a few small vectors per layer. The next cell counts both from the
# formulas of `costmodel` (which `tests/test_costmodel.py` checks against the compiled
# programs).

# %%
cfg_t = dataclasses.replace(cfg, kv_heads=4, q_heads=8)
lens_t = (CTX, CTX * 3 // 4)
PREFILL_T = 512
cap_t = -(-max(lens_t) // PREFILL_T) * PREFILL_T + TIMED_TOKENS  # as Generator.generate
cap_t = -(-cap_t // p) * p  # a whole number of shards, as model.empty_cache
batch_t = len(lens_t)
tree_b = cfg_t.layers * cm.tree_payload_bytes(batch_t, 1, cfg_t.q_heads, cfg_t.head_dim)
ring_b = cfg_t.layers * cm.ring_payload_bytes(batch_t, cap_t, cfg_t.kv_heads, cfg_t.head_dim,
                                              cfg_t.head_dim, p)
assert ring_b > 100 * tree_b
print(f"prompts of {lens_t} tokens, {TIMED_TOKENS} new tokens; {cfg_t.q_heads} query and "
      f"{cfg_t.kv_heads} kv heads of {cfg_t.head_dim}, {cfg_t.layers} layers; cache "
      f"capacity {cap_t}")
print(f"bytes sent per device per decode step: tree {tree_b:,}, ring {ring_b:,} "
      f"({ring_b / tree_b:,.0f}x)")

# %% [markdown]
# Ring's prompt is prefilled with tree attention (`prefill_method="tree"`): ring prefill would
# pass every shard around the ring once per chunk and layer, and only the decode steps are
# timed. (Timings depend on the machine; this cell's output is not checked.) For a long
# context, from a terminal:
#
# ```bash
# tree-attention-edu generate --devices 8 --method tree,ring --prefill-method tree \
#     --prompt-len 32768 --new-tokens 32 --prefill-chunk 2048
# ```

# %%
# NBVAL_IGNORE_OUTPUT
params_t = model.init_params(cfg_t, jax.random.key(2))
prompts_t = [rng.integers(0, cfg_t.vocab, n).tolist() for n in lens_t]
latency = {}
for method in ("single", "tree", "ring"):
    gen = model.Generator(params_t, cfg_t, mesh, method, prefill_chunk=PREFILL_T,
                          prefill_method="single" if method == "single" else "tree")
    out = gen.generate(prompts_t, TIMED_TOKENS, key=jax.random.key(3))
    latency[method] = out.step_s[1:]  # the first decode step includes compilation
    print(f"{method:>6}: median per-token latency {statistics.median(out.step_s[1:]) * 1e3:.1f} "
          f"ms (median of {len(out.step_s) - 1} steps)")

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
for method, color in (("single", "0.5"), ("tree", plots.TREE_COLOR), ("ring", plots.RING_COLOR)):
    ax.plot(np.arange(2, 2 + len(latency[method])), np.array(latency[method]) * 1e3, "o-",
            color=color, label=method)
ax.set_yscale("log")
ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
ax.yaxis.set_minor_formatter(ticker.NullFormatter())
ax.set_xlabel("decode step")
ax.set_ylabel("latency (ms)")
ax.set_title(f"Per-token latency, context ~{CTX} tokens, 8 simulated devices")
ax.legend(fontsize=10)
plt.show()

# %% [markdown]
# *Figure: the latency of each decode step, for one device (grey), tree (blue) and ring (red)
# on 8 simulated devices. Look at the vertical gap between red and blue: ring pays for the
# bytes counted above at every step. (Timings: the points move from run to run.)*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>In a real generation loop, ring decoding moves the whole cache at every step and tree
# decoding a few kilobytes; the latency follows the bytes.</p></div>

# %% [markdown]
# ## 7.5 Attention as an associative memory
#
# Store `M` random ±1 key→value patterns of dimension `DIM`; query with a stored key with a
# fraction `FLIP` of its signs flipped (both set in the next cell); read out
# `softmax(β · X ξ / D)ᵀ Y` and count a query as retrieved when the sign of the readout is
# exactly its value. This is a modern Hopfield network (Ramsauer et al., 2020): with
# $s = \beta/D$ its energy is
#
# $$ E(\xi) = -\frac{1}{s}\log\sum_a e^{s\,x_a\cdot\xi} + \tfrac12\,\xi\cdot\xi, $$
#
# whose log-sum-exp is the energy $F$ of notebook 1 at $\zeta = 0$ with query $\xi$, keys
# $x_a$ and scale $s$ (the log-partition of the attention weights). Retrieval is one gradient
# step: $\xi - \nabla E(\xi) = X^\top\mathrm{softmax}(s X\xi)$, attention with values equal
# to keys. We check that with `jax.grad` (`hf.hopfield_step`).

# %%
DIM, FLIP, BETA = 64, 0.2, 8.0
print(f"patterns of dimension {DIM}, {FLIP:.0%} of signs flipped; gradient check at beta={BETA:g}")
mem = hf.make_memory(jax.random.key(4), 300, DIM)
xi = hf.noisy_queries(jax.random.key(5), mem, jnp.arange(8), FLIP)
step = jax.vmap(lambda x: hf.hopfield_step(x, mem.keys, BETA))(xi)
readout = hf.retrieve(xi, hf.Memory(mem.keys, mem.keys), BETA)  # values = keys
np.testing.assert_allclose(step, readout, rtol=0, atol=1e-5)
print("one gradient step on E equals the attention readout (float32, within 1e-5)")

# %% [markdown]
# Now the accuracy grid, with every memory sharded across the 8 devices and read by
# `tree_decode`, and again on one device.

# %%
SIZES = (16, 64, 256, 1024, 4096, 16384)
BETAS = (1.0, 4.0, 16.0, 64.0)
acc_tree = hf.accuracy_grid(jax.random.key(6), SIZES, BETAS, dim=DIM, flip=FLIP, mesh=mesh)
acc_one = hf.accuracy_grid(jax.random.key(6), SIZES, BETAS, dim=DIM, flip=FLIP)
np.testing.assert_array_equal(acc_tree, acc_one)  # identical answers, query by query
print("retrieval accuracy (rows: patterns M, columns: beta), 8 devices == 1 device")
print(f"{'M':>7}" + "".join(f"{f'beta={b:g}':>10}" for b in BETAS))
for m, row in zip(SIZES, acc_tree, strict=True):
    print(f"{m:>7}" + "".join(f"{x:>10.2f}" for x in row))
assert (acc_tree[:, 0] == 0).all()  # beta = 1: a flat softmax retrieves nothing
assert acc_tree[0, -1] == 1.0 and (np.diff(acc_tree[:, -1]) <= 0).all()  # worse as M grows

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
beta_colors = plt.cm.Greens(np.linspace(0.45, 1.0, len(BETAS)))
size_colors = plt.cm.copper(np.linspace(0.0, 0.85, len(SIZES)))
for j, beta in enumerate(BETAS):
    axes[0].plot(SIZES, acc_tree[:, j], "o-", color=beta_colors[j], label=f"β = {beta:g}")
plots.pow2_axis(axes[0], SIZES)
axes[0].set_xlabel("stored patterns M")
axes[0].set_ylabel("fraction retrieved exactly")
axes[0].set_title("Capacity: accuracy against M")
axes[0].legend(fontsize=10)
for i, m in enumerate(SIZES):
    axes[1].plot(BETAS, acc_tree[i], "s-", color=size_colors[i], label=f"M = {m:,}")
plots.pow2_axis(axes[1], BETAS)
axes[1].set_xlabel("inverse temperature β")
axes[1].set_title("Temperature: accuracy against β")
axes[1].legend(fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# *Figure: left, the fraction of noisy queries retrieved exactly against the number of stored
# patterns, one line per β (darker green: larger β); right, the same against β, one line per
# M (lighter: larger M). At small β the softmax is flat and the readout blurs many patterns
# together, so nothing is retrieved. At large β it concentrates on the stored key with the
# largest overlap, and fails only when some other pattern overlaps the noisy query more, which
# becomes likely as M grows. The memory is sharded over 8 devices and combined by tree
# decoding's Allreduces; the answers are identical to one device's.*
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>Reading a modern Hopfield memory is one attention step, a gradient step on its energy.
# A memory too large for one device can be sharded along its patterns and read with tree
# decoding, with the same answers.</p></div>

# %% [markdown]
# ## 7.6 A checkpoint from disk
#
# A researcher with a cluster has weights on disk, not a PRNG key. Llama checkpoints come in
# the Hugging Face layout: a folder with `config.json`, the weights in `*.safetensors` files
# (with `model.safetensors.index.json` when they are split into shards), and often a
# `tokenizer.json`. `tree_attention_edu.llama.checkpoint` reads that layout with the `safetensors`
# and `tokenizers` packages (no torch) into the same `model.Config` and params that the
# `Generator` above decodes.
#
# Three conventions have to match exactly, and the loader's docstring says how each does:
#
# * a `torch.nn.Linear` stores its weight as `[out, in]` and computes `x Wᵀ`; the model
#   computes `x W`, so each Linear weight is transposed once, at load time;
# * Hugging Face's rotary embedding rotates the first half of each head against the second
#   half (`rotate_half`); `model.rope` pairs feature `i` with `i + D/2` the same way, so the
#   query and key weights need no permutation. Llama 3.1's `"llama3"` frequency scaling is
#   `model.RopeScaling`;
# * grouped-query attention: query head `h` reads kv head `h // (q_heads // kv_heads)`,
#   which is what transformers' `repeat_kv` does.
#
# The cell below writes a small model as such a checkpoint, stored in bfloat16 and split into
# shards, with a toy word-level tokenizer. The tests check the loader against an independent
# float64 Llama that follows transformers line by line, on checkpoints in every combination
# of dtype, tied embeddings, rope scaling and sharding.

# %%
ckpt_cfg = model.Config(vocab=64, dim=64, layers=2, q_heads=4, kv_heads=2, head_dim=16,
                        hidden=128, rope_scaling=model.RopeScaling())  # Llama 3.1's scaling
ckpt_params = model.init_params(ckpt_cfg, jax.random.key(7))
folder = Path(tempfile.mkdtemp(prefix="tiny-llama-"))
files = checkpoint.save_checkpoint(folder, ckpt_params, ckpt_cfg, dtype=jnp.bfloat16,
                                   max_shard_bytes=40_000)

# A toy tokenizer: <unk>, <s> (put in front of every prompt, as Llama's tokenizers do), </s>,
# then the words w3 ... w63, one token each.
words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, ckpt_cfg.vocab)}
tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
tok.add_special_tokens(["<unk>", "<s>", "</s>"])
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
tok.save(str(folder / "tokenizer.json"))

for f in sorted(folder.iterdir()):
    print(f"{f.name:>36}  {f.stat().st_size:>7,} bytes")
assert len([f for f in files if f.suffix == ".safetensors"]) > 1  # sharded, with an index

# %% [markdown]
# `inspect_checkpoint` reads `config.json` and every tensor's name, dtype and shape from the
# files' headers, without reading any weight, and checks them all against the config. A
# malformed checkpoint (no `config.json`, head counts that do not divide, a missing tensor, a
# dtype it cannot read) stops here with one message that names the problem.

# %%
info = checkpoint.inspect_checkpoint(folder)
assert info.cfg == ckpt_cfg and info.tokenizer is not None
print(info.cfg)
print(f"{len(info.tensors)} tensors in {len({t.file for t in info.tensors.values()})} files, "
      f"{info.num_params:,} weights, {info.stored_bytes:,} bytes stored as bfloat16")
for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"):
    t = info.tensors[name]
    print(f"  {name:<40} {t.dtype:<5} {list(t.shape)}")
try:
    checkpoint.inspect_checkpoint(folder / "tokenizer.json")  # a file, not a folder
except ValueError as err:
    print("a wrong path:", str(err).split(";")[0].replace(str(folder), "<folder>"))

# %% [markdown]
# `load_checkpoint` reads one tensor at a time, converts it to float32 (the default; pass
# `dtype=jnp.bfloat16` to keep bf16 weights, which the model then promotes to float32 inside
# each product), and places it replicated on the mesh: this package shards the sequence, not
# the weights. On a CPU the eight simulated devices even share one host copy of each weight,
# which the cell checks by comparing buffer addresses.

# %%
params_disk, cfg_disk = checkpoint.load_checkpoint(folder, mesh=mesh)
rounded = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)),
                       ckpt_params)
same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), params_disk, rounded)
assert all(jax.tree.leaves(same))  # what was saved, rounded to bfloat16 once
embed = params_disk["embed"]
copies = {s.data.unsafe_buffer_pointer() for s in embed.addressable_shards}
print(f"embedding {embed.dtype} {embed.shape}, replicated on {len(embed.devices())} devices, "
      f"{len(copies)} host copy")
assert embed.sharding.is_fully_replicated and len(copies) == 1

# %% [markdown]
# Now decode from the loaded weights: two text prompts through the tokenizer, greedy tokens
# with tree attention on the 8 devices, checked against one device.

# %%
texts = ["w5 w17 w63 w8 w30 w12", "w40 w41"]
prompts_disk = [tok.encode(t).ids for t in texts]
outs = {}
for method in ("single", "tree"):
    gen = model.Generator(params_disk, cfg_disk, mesh, method, prefill_chunk=8)
    outs[method] = gen.generate(prompts_disk, 8, key=jax.random.key(0))
np.testing.assert_array_equal(outs["tree"].tokens, outs["single"].tokens)
assert np.abs(outs["tree"].logits - outs["single"].logits).max() < 1e-4
for ids, row in zip(prompts_disk, outs["tree"].tokens.tolist(), strict=True):
    print(f"{tok.decode(ids)!r:>24} -> {tok.decode(row)!r}")
print("tree tokens identical to single-device tokens (logits within 1e-4)")
assert all(len(set(row)) > 1 for row in outs["tree"].tokens.tolist())  # not a constant output
shutil.rmtree(folder)  # the weights now live in memory; the scratch folder can go

# %% [markdown]
# From a terminal, the same on any Hugging Face Llama folder (`--prompt-ids 1,2,3`, repeated,
# when there is no tokenizer; `--json OUT` saves the tokens and the first step's logits):
#
# ```bash
# tree-attention-edu generate --checkpoint DIR --prompt "w5 w17 w63" --new-tokens 8 \
#     --method tree,ring --devices 8
# ```
#
# Llama-3.1-8B itself needs its bfloat16 weights once per device on GPUs, or once in host
# memory on a CPU (shared by the simulated devices); the loader's docstring gives the figures.
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>A Hugging Face Llama checkpoint loads into the same model with two conventions matched
# (Linear weights transposed, rotate_half pairing), and decodes across devices to the same
# tokens as on one.</p></div>

# %% [markdown]
# ## 7.7 Summary
#
# * `tree_attention_edu.llama.model` is a small Llama-style decoder whose KV cache is head-major,
#   of fixed capacity, and cut into contiguous blocks, one per device; decoding appends each
#   token on the device that owns its position.
# * Single-device, tree (flat and 2-level) and ring attention generate identical tokens: their
#   float32 rounding differences are far below the smallest greedy margin, asserted.
# * Per decode step, ring attention moves every layer's cache shards and tree attention a
#   few kilobytes; the measured per-token latency follows.
# * A modern Hopfield memory is read by attention, as a gradient step on its energy; sharded
#   over 8 devices with tree decoding it retrieves exactly what one device does.
# * A Llama checkpoint in the Hugging Face layout loads into the same model (Linear weights
#   transposed once; `rotate_half` is the model's own RoPE pairing) and decodes across
#   devices to the tokens one device gives.
#
# ## 7.8 Exercises
#
# **Exercise 1 (predict, then measure).** In the grid above, with $M = 256$ patterns and
# $\beta = 64$, almost every noisy query is retrieved. Predict the accuracy when 30% of the
# signs are flipped instead: higher or lower, and roughly how much? Then measure it with
# `hf.accuracy_grid` (one device is enough).
#
# <details><summary>Answer</summary>
#
# Lower, and by a lot. A query with a fraction $f$ of flipped signs overlaps its own key by
# $D(1-2f)$ on average, which falls from $0.6D$ to $0.4D$, while its overlaps with the other
# random patterns stay spread about 0 with standard deviation $\sqrt{D}$; the largest of $n$
# of them is typically about $\sqrt{2 \ln n}\,\sqrt{D}$. The cell prints the three
# overlaps: the true one drops from above the rivals' typical maximum to below it, and the
# measured accuracy with it.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
M1, B1, FLIP1 = 256, 64.0, 0.3
before = acc_tree[SIZES.index(M1), BETAS.index(B1)]
after = hf.accuracy_grid(jax.random.key(6), (M1,), (B1,), dim=DIM, flip=FLIP1)[0, 0]
rival = np.sqrt(2 * np.log(M1 - 1) * DIM)  # typical largest overlap of M1 - 1 random patterns
own = {f: DIM * (1 - 2 * f) for f in (FLIP, FLIP1)}  # mean overlap with the query's own key
print(f"own key's overlap: {own[FLIP]:.1f} at {FLIP:.0%} flipped, {own[FLIP1]:.1f} at "
      f"{FLIP1:.0%}; the rivals' typical largest: {rival:.1f}")
print(f"accuracy at M={M1}, beta={B1:g}: {before:.2f} -> {after:.2f}")
assert own[FLIP] > rival > own[FLIP1]
assert after < before - 0.2

# %% [markdown]
# **Exercise 2.** Section 7.4 counted the bytes each method sends per decode step. Without
# running a model: how do both numbers change when the context doubles? And for the `small`
# preset at a context of 32,768 tokens with batch 1? Use `cm.tree_payload_bytes` and
# `cm.ring_payload_bytes`.
#
# <details><summary>Answer</summary>
#
# Ring sends $(p-1)$ blocks of $S/p$ positions of K and V per layer, so its bytes double with
# the context; tree Allreduces $H_q(D_v+2)$ floats per query and layer, whatever the
# context. For `small` the cell prints both: ring sends hundreds of megabytes per token,
# tree kilobytes.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
def step_bytes(c: model.Config, batch: int, cap: int) -> tuple[int, int]:
    tree = c.layers * cm.tree_payload_bytes(batch, 1, c.q_heads, c.head_dim)
    ring = c.layers * cm.ring_payload_bytes(batch, cap, c.kv_heads, c.head_dim, c.head_dim, p)
    return tree, ring


t1, r1 = step_bytes(cfg_t, batch_t, cap_t)
t2, r2 = step_bytes(cfg_t, batch_t, 2 * cap_t)
assert (t1, r1) == (tree_b, ring_b) and t2 == t1 and r2 == 2 * r1
ts_, rs_ = step_bytes(small, 1, 32768)
print(f"small at 32k: tree {ts_:,} bytes, ring {rs_:,} bytes per decode step")
assert ts_ < 100_000 and rs_ > 100_000_000

# %% [markdown]
# **Exercise 3.** Ramsauer et al. show that the update $\xi \mapsto X^\top\mathrm{softmax}(s
# X\xi)$ never increases the energy $E$. Check it for the noisy queries of section 7.5 at
# every β of the grid, with `hf.hopfield_energy` and `hf.hopfield_step`. For how many of the
# queries is one step already (nearly) a fixed point, so that a second step barely moves
# them, at small and at large β?
#
# <details><summary>Answer</summary>
#
# The energy is a concave term plus a convex one, and the update is the step of the
# concave-convex procedure, which never increases it: $E(\text{step}(\xi)) \le E(\xi)$.
# The cell asserts it at every β, up to float32 rounding. At large β the softmax is almost
# one-hot, so one step lands on (or next to) a stored pattern and a second step barely moves
# most queries; at small β the first step lands near the average of all patterns and the
# iteration keeps moving, slowly. The cell counts the queries that a second step moves by
# less than 0.01.
#
# </details>

# %% tags=["solution"] jupyter={"source_hidden": true}
def energies(x, beta):
    return jax.vmap(lambda v: hf.hopfield_energy(v, mem.keys, beta))(x)


def update(x, beta):
    return jax.vmap(lambda v: hf.hopfield_step(v, mem.keys, beta))(x)


still = {}
for beta in BETAS:
    one = update(xi, beta)
    two = update(one, beta)
    e0, e1, e2 = energies(xi, beta), energies(one, beta), energies(two, beta)
    tol = 1e-5 * jnp.abs(e0) + 1e-5  # float32 rounding of energies of this size
    assert (e1 <= e0 + tol).all() and (e2 <= e1 + tol).all(), beta
    still[beta] = int((jnp.abs(two - one).max(axis=1) < 0.01).sum())
    print(f"beta={beta:>4g}: energy never rises; {still[beta]} of {len(xi)} queries are "
          f"(nearly) fixed after one step")
assert still[BETAS[0]] == 0 and still[BETAS[-1]] > len(xi) // 2


# %% [markdown]
# ## 7.9 References
#
# * Shyam et al., *Tree Attention*, arXiv 2408.04093: Section 4 eqs. 5–6 (attention as the
#   gradient of $F$; the Hopfield energy's log-sum-exp is $F$ at $\zeta = 0$), Section 5.2
#   Algorithm 3 (tree decoding), Section 6.4 and Table 1 (Llama 3.1-8B decoding).
# * H. Ramsauer et al., *Hopfield Networks is All You Need*, arXiv 2008.02217 (the modern
#   Hopfield energy, its update rule and the proof that the update decreases the energy).
# * A. Grattafiori et al., *The Llama 3 Herd of Models*, arXiv 2407.21783 (the architecture
#   that `tree_attention_edu.llama.model` follows at toy size).
# * H. Liu, M. Zaharia, P. Abbeel, *Ring Attention with Blockwise Transformers for
#   Near-Infinite Context*, arXiv 2310.01889.
