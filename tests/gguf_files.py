"""Tiny llama GGUF files written as llama.cpp's converter writes them, for the loader's tests.

Written with `gguf.GGUFWriter` from Hugging Face-layout float64 weights
(`llama_reference.random_weights`), with this file's own code for what the converter does:
the GGUF tensor names, the Q/K row permutation (`permute_rows`, from its documented rule,
not from the package), and quantisation. `write_gguf` returns the weights the file really
holds, dequantised and in the Hugging Face layout, for the float64 reference to run on:

* Q8_0, Q4_0 and Q4_1 are dequantised here, from ggml's block layouts (`dequantize_simple`);
* K-quants (Q2_K ... Q6_K) and Q5_0/Q5_1 are filled with random blocks, and their values come
  from `gguf.quants.dequantize` (llama.cpp's reference dequantiser: what the file *means*);
* F32, F16 and BF16 are rounded with numpy / ml_dtypes.

Nothing here imports tree_attention_edu.
"""

from __future__ import annotations

import math

import gguf
import ml_dtypes
import numpy as np

Q = gguf.GGMLQuantizationType

# Hugging Face name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.")
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# Byte offsets of the float16 scales in one block of each randomly filled type.
F16_FIELDS = {
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{LAYER_NAMES[rest]}"


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute()` as its converter documents it: within each head of D rows,
    Hugging Face row i goes to row 2i and row D/2 + i to row 2i + 1 (written index by index)."""
    rows = w.shape[0]
    d = rows // heads
    out = np.empty_like(w)
    for h in range(heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def dequantize_simple(raw: np.ndarray, qtype) -> np.ndarray:
    """Q8_0, Q4_0 and Q4_1 blocks of 32 values, from ggml's layouts: `[rows, bytes]` ->
    `[rows, values]` float64."""
    rows = raw.shape[0]
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    blocks = raw.reshape(-1, size)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)  # [n, 1]
    if qtype == Q.Q8_0:  # d, then 32 int8
        vals = d * blocks[:, 2:].view(np.int8)
    else:  # d (and m), then 16 bytes: value j in the low nibble of byte j, j + 16 in the high
        qs = blocks[:, size - 16 :]
        nib = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)
        if qtype == Q.Q4_0:
            vals = d * (nib - 8)
        else:
            m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
            vals = d * nib + m
    return vals.reshape(rows, -1)


def _random_blocks(shape: tuple[int, int], qtype, rng, std: float) -> np.ndarray:
    """Random blocks of `qtype` for `[rows, cols]` values, their scales set so that the
    values have standard deviation about `std`."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off : off + 2] = np.full((n, 1), 1.0, np.float16).view(np.uint8)
    s = gguf.quants.dequantize(raw.reshape(shape[0], -1), qtype).std()
    for off in F16_FIELDS[qtype]:  # every value is linear in these scales
        scale = rng.uniform(0.5, 1.5, (n, 1)) * std / s
        raw[:, off : off + 2] = scale.astype(np.float16).view(np.uint8)
    return raw.reshape(shape[0], -1)


def encode(w: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(what to store, the float64 values it holds) for weights `w` as `qtype`."""
    if qtype == Q.F32:
        return w.astype(np.float32), w.astype(np.float32).astype(np.float64)
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float64)
    if qtype == Q.BF16:
        stored = gguf.quants.quantize(w.astype(np.float32), qtype)
        return stored, w.astype(ml_dtypes.bfloat16).astype(np.float64)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        stored = gguf.quants.quantize(w.astype(np.float32), qtype)
        return stored, dequantize_simple(stored, qtype)
    std = float(w.std()) or 1.0
    stored = _random_blocks(w.shape, qtype, rng, std)
    return stored, gguf.quants.dequantize(stored, qtype).astype(np.float64)


def write_gguf(
    path,
    config: dict,
    weights: dict[str, np.ndarray],
    types: dict | None = None,
    *,
    seed: int = 0,
    tokenizer: dict | None = None,
    metadata=None,
    skip_tensors=(),
    extra_tensors=None,
) -> dict[str, np.ndarray]:
    """Write a llama GGUF file of `config` (a `llama_reference.tiny_config` dict) holding
    `weights` (Hugging Face names), each stored as `types[hf_name]` (default: F32 for norms,
    Q8_0 otherwise). Returns the float64 Hugging Face-layout weights the file holds.

    `tokenizer`: {"tokens", "merges", "types", "pre", "bos", "eos", "add_bos",
    "chat_template"} written under `tokenizer.*`; `metadata`: a function
    `f(writer)` adding or replacing keys (called last); `skip_tensors`: GGUF names left out;
    `extra_tensors`: GGUF name -> float32 array added as F32.
    """
    rng = np.random.default_rng(seed)
    types = types or {}
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config.get("max_position_embeddings", 128))
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_rope_dimension_count(head_dim)
    if "head_dim" in config:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    if tokenizer is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer.get("pre", "smollm"))
        w.add_token_list(tokenizer["tokens"])
        w.add_token_merges(tokenizer["merges"])
        w.add_token_types(tokenizer["types"])
        w.add_bos_token_id(tokenizer.get("bos", 1))
        w.add_eos_token_id(tokenizer.get("eos", 2))
        w.add_add_bos_token(tokenizer.get("add_bos", False))
        if "chat_template" in tokenizer:
            w.add_chat_template(tokenizer["chat_template"])
    if metadata is not None:
        metadata(w)
    held = {}
    for hf, value in weights.items():
        name = gguf_name(hf)
        if name in skip_tensors:
            continue
        if name.endswith("attn_q.weight"):
            value = permute_rows(value, heads)
        elif name.endswith("attn_k.weight"):
            value = permute_rows(value, kv)
        qtype = types.get(hf, Q.F32 if value.ndim == 1 else Q.Q8_0)
        stored, values = encode(value, qtype, rng)
        if name.endswith("attn_q.weight") or name.endswith("attn_k.weight"):
            # what the file means in the Hugging Face order: undo the permutation (its inverse
            # written independently: row 2i came from i, row 2i + 1 from D/2 + i)
            h = heads if name.endswith("attn_q.weight") else kv
            d = values.shape[0] // h
            values = values.reshape(h, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(values.shape)
        held[hf] = values
        raw = qtype not in (Q.F32, Q.F16)
        w.add_tensor(name, stored, raw_dtype=qtype if raw else None)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def byte_tokenizer(words=(), merges=(), pre="smollm", add_bos=False, template=None) -> dict:
    """A byte-level BPE vocabulary: `<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>` 2
    (control tokens), the 256 byte symbols of GPT-2's alphabet, then `words` (each must be
    the result of one of `merges`, given as "a b" strings)."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, *words]
    out = {
        "tokens": tokens,
        "merges": list(merges),
        "pre": pre,
        "bos": 1,
        "eos": 2,
        "add_bos": add_bos,
        "types": [3, 3, 3] + [1] * (len(tokens) - 3),
    }
    if template is not None:
        out["chat_template"] = template
    return out


def field_offsets(path) -> dict[str, int]:
    """Byte offset of each metadata value (`key`) and tensor-info part (`tensor:NAME:dims`,
    `...:type`, `...:offset`) of a valid file, read with gguf.GGUFReader."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = f.offset + 8 + len(key.encode()) + 4
    for t in r.tensors:
        start = t.field.offset + 8 + len(t.name.encode())
        out[f"tensor:{t.name}:ndims"] = start
        out[f"tensor:{t.name}:dims"] = start + 4
        out[f"tensor:{t.name}:type"] = start + 4 + 8 * len(t.shape)
        out[f"tensor:{t.name}:offset"] = start + 4 + 8 * len(t.shape) + 4
    out["data"] = r.data_offset
    return out


def num_weights(weights: dict) -> int:
    return sum(math.prod(v.shape) for v in weights.values())
