"""An independent Llama in float64 numpy, and a writer of tiny Hugging Face checkpoints.

The model follows transformers' `models/llama/modeling_llama.py` (5.x) and
`modeling_rope_utils.py` function by function, under the same names (`LlamaRMSNorm`,
`rotate_half`, `apply_rotary_pos_emb`, `repeat_kv`, `eager_attention_forward`, ...), with
torch replaced by numpy and every dtype by float64. It reads checkpoints with its own code
(safetensors' numpy API and json) and imports nothing from `tree_attention_edu`, so the
package's loader and decoder are checked against an implementation that shares none of
their code. It was checked once against transformers' own `LlamaForCausalLM` on the test
checkpoints: about 1e-15 of the logit scale once transformers' float32 islands (RoPE
frequencies, RMSNorm, softmax) run in float64 too (tests/test_checkpoint.py has the figures).

Differences from transformers, on purpose: float64 throughout (transformers computes the
inverse frequencies, RMSNorm and softmax in float32), no KV cache (every step recomputes the
whole sequence), and one sequence at a time (no padding masks).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

F64 = np.float64


# --- configuration (LlamaConfig and the rope standardisation) ---------------------------------


def standardize(config: dict) -> dict:
    """LlamaConfig's defaults and `standardize_rope_params`: a flat dict with `head_dim`,
    `num_key_value_heads` and `rope_parameters` filled in."""
    c = {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        **{k: v for k, v in config.items() if v is not None},
    }
    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    c.setdefault("num_key_value_heads", c["num_attention_heads"])
    rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", c["rope_theta"])
    if rope["rope_type"] == "llama3":
        rope.setdefault("original_max_position_embeddings", c["max_position_embeddings"])
    c["rope_parameters"] = rope
    return c


# --- modeling_rope_utils.py ---------------------------------------------------------------------


def compute_default_rope_parameters(config):
    base = config["rope_parameters"]["rope_theta"]
    dim = config["head_dim"]
    attention_factor = 1.0
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(F64) / dim))
    return inv_freq, attention_factor


def _compute_llama3_parameters(config):
    inv_freq, attention_factor = compute_default_rope_parameters(config)
    rope = config["rope_parameters"]
    factor = rope["factor"]
    low_freq_factor = rope["low_freq_factor"]
    high_freq_factor = rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + (
        smooth_factor * inv_freq_llama
    )
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    inv_freq_llama = np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq_llama, attention_factor


ROPE_INIT_FUNCTIONS = {
    "default": compute_default_rope_parameters,
    "llama3": _compute_llama3_parameters,
}


# --- modeling_llama.py --------------------------------------------------------------------------


def LlamaRMSNorm(weight, eps, hidden_states):
    hidden_states = hidden_states.astype(F64)
    variance = np.mean(hidden_states**2, axis=-1, keepdims=True)
    hidden_states = hidden_states * (1.0 / np.sqrt(variance + eps))
    return weight * hidden_states


def LlamaRotaryEmbedding(config, position_ids):
    """`forward(x, position_ids)`: cos and sin `[batch, seq, head_dim]`."""
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[config["rope_parameters"]["rope_type"]](
        config
    )
    freqs = position_ids[..., None].astype(F64) * inv_freq
    emb = np.concatenate((freqs, freqs), axis=-1)
    cos = np.cos(emb) * attention_scaling
    sin = np.sin(emb) * attention_scaling
    return cos, sin


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return np.concatenate((-x2, x1), axis=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = np.expand_dims(cos, unsqueeze_dim)
    sin = np.expand_dims(sin, unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def linear(weight, x):
    """`nn.Linear` without bias: `x @ weight.T` with `weight [out, in]`."""
    return x @ weight.T


def silu(x):
    return x / (1.0 + np.exp(-x))


def LlamaMLP(w, prefix, x):
    gate = linear(w[prefix + "gate_proj.weight"], x)
    up = linear(w[prefix + "up_proj.weight"], x)
    return linear(w[prefix + "down_proj.weight"], silu(gate) * up)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = np.broadcast_to(
        hidden_states[:, :, None, :, :], (batch, num_key_value_heads, n_rep, slen, head_dim)
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


ATTENTION_LOG: list | None = None
"""Not in transformers: when a list, `eager_attention_forward` appends each layer's
`(scores, values)`: the scaled scores `[batch, heads, seq, seq]` with the causal mask added
(before the softmax) and the values repeated per query head `[batch, heads, seq, head_dim]`,
so that a test can compute attention over any subset of the keys."""


def eager_attention_forward(num_key_value_groups, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, num_key_value_groups)
    value_states = repeat_kv(value, num_key_value_groups)
    attn_weights = np.matmul(query, key_states.transpose(0, 1, 3, 2)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    if ATTENTION_LOG is not None:
        ATTENTION_LOG.append((attn_weights.copy(), value_states))
    attn_weights = softmax(attn_weights, axis=-1)
    attn_output = np.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(0, 2, 1, 3)
    return attn_output, attn_weights


def LlamaAttention(config, w, prefix, hidden_states, position_embeddings, attention_mask):
    head_dim = config["head_dim"]
    num_key_value_groups = config["num_attention_heads"] // config["num_key_value_heads"]
    scaling = head_dim**-0.5
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, head_dim)

    query_states = (
        linear(w[prefix + "q_proj.weight"], hidden_states)
        .reshape(hidden_shape)
        .transpose(0, 2, 1, 3)
    )
    key_states = (
        linear(w[prefix + "k_proj.weight"], hidden_states)
        .reshape(hidden_shape)
        .transpose(0, 2, 1, 3)
    )
    value_states = (
        linear(w[prefix + "v_proj.weight"], hidden_states)
        .reshape(hidden_shape)
        .transpose(0, 2, 1, 3)
    )

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

    attn_output, _ = eager_attention_forward(
        num_key_value_groups, query_states, key_states, value_states, attention_mask, scaling
    )
    attn_output = attn_output.reshape(*input_shape, -1)
    return linear(w[prefix + "o_proj.weight"], attn_output)


def LlamaDecoderLayer(config, w, i, hidden_states, attention_mask, position_embeddings):
    prefix = f"model.layers.{i}."
    eps = config["rms_norm_eps"]
    residual = hidden_states
    hidden_states = LlamaRMSNorm(w[prefix + "input_layernorm.weight"], eps, hidden_states)
    hidden_states = LlamaAttention(
        config, w, prefix + "self_attn.", hidden_states, position_embeddings, attention_mask
    )
    hidden_states = residual + hidden_states

    residual = hidden_states
    hidden_states = LlamaRMSNorm(w[prefix + "post_attention_layernorm.weight"], eps, hidden_states)
    hidden_states = LlamaMLP(w, prefix + "mlp.", hidden_states)
    return residual + hidden_states


def create_causal_mask(seq_len):
    """Additive mask `[1, 1, T, T]`: 0 where key <= query, the most negative float above."""
    min_dtype = np.finfo(F64).min
    mask = np.triu(np.full((seq_len, seq_len), min_dtype), k=1)
    return mask[None, None]


def LlamaModel(config, w, input_ids):
    inputs_embeds = w["model.embed_tokens.weight"][input_ids]
    position_ids = np.arange(inputs_embeds.shape[1])[None, :]
    causal_mask = create_causal_mask(inputs_embeds.shape[1])
    hidden_states = inputs_embeds
    position_embeddings = LlamaRotaryEmbedding(config, position_ids)
    for i in range(config["num_hidden_layers"]):
        hidden_states = LlamaDecoderLayer(
            config, w, i, hidden_states, causal_mask, position_embeddings
        )
    return LlamaRMSNorm(w["model.norm.weight"], config["rms_norm_eps"], hidden_states)


def LlamaForCausalLM(config, w, input_ids):
    """Logits `[batch, seq, vocab]` (float64) of `input_ids [batch, seq]`."""
    hidden_states = LlamaModel(config, w, np.asarray(input_ids))
    lm_head = (
        w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    )
    return linear(lm_head, hidden_states)


def greedy(config, w, prompt, new_tokens):
    """Greedy decoding of one prompt: (tokens [new_tokens], logits [new_tokens, vocab]), each
    step recomputing the whole sequence."""
    ids, tokens, logits = list(prompt), [], []
    for _ in range(new_tokens):
        last = LlamaForCausalLM(config, w, np.array([ids]))[0, -1]
        logits.append(last)
        tokens.append(int(np.argmax(last)))
        ids.append(tokens[-1])
    return np.array(tokens), np.stack(logits)


def teacher_forced(config, w, prompt, generated):
    """Logits `[len(generated), vocab]` at each generated position, given the tokens the
    package generated (so that a disagreement shows in logits, not only in tokens)."""
    ids = np.array([list(prompt) + list(generated)])
    return LlamaForCausalLM(config, w, ids)[0, len(prompt) - 1 : len(prompt) - 1 + len(generated)]


# --- checkpoints on disk ------------------------------------------------------------------------


def read_checkpoint(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(standardised config, float64 weights by Hugging Face name) of a checkpoint folder."""
    path = Path(path)
    config = standardize(json.loads((path / "config.json").read_text()))
    weights = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).astype(F64)
    return config, weights


def weight_shapes(config) -> dict[str, tuple[int, ...]]:
    c = standardize(config)
    d, h = c["hidden_size"], c["intermediate_size"]
    qd, kd = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (qd, d),
            p + "self_attn.k_proj.weight": (kd, d),
            p + "self_attn.v_proj.weight": (kd, d),
            p + "self_attn.o_proj.weight": (d, qd),
            p + "mlp.gate_proj.weight": (h, d),
            p + "mlp.up_proj.weight": (h, d),
            p + "mlp.down_proj.weight": (d, h),
        }
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], d)
    return shapes


def random_weights(config, seed) -> dict[str, np.ndarray]:
    """float64 weights: Linear ~ N(0, 1/in), embeddings ~ N(0, 0.1²), norm gains ~
    1 + N(0, 0.1²) (not 1, so that a norm applied to the wrong place shows). Small embeddings
    keep a tied model from repeating its input token forever."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            out[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            out[name] = 0.1 * rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) / math.sqrt(shape[1])
    return out


DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def write_checkpoint(path, config, weights, dtype="float32", shards=1, extra=None):
    """Write `weights` (by Hugging Face name) as `dtype` into `path` as transformers saves a
    checkpoint: config.json, and model.safetensors or `shards` files with an index.
    `extra` adds tensors (or replaces them) as given, unconverted."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {n: np.ascontiguousarray(w.astype(DTYPES[dtype])) for n, w in weights.items()}
    tensors |= extra or {}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    total = sum(t.nbytes for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return path


def tiny_config(
    *,
    tied=False,
    llama3=False,
    rope_spelling="v4",
    head_dim=None,
    vocab=64,
    dim=32,
    layers=2,
    heads=4,
    kv_heads=2,
    hidden=64,
    theta=10000.0,
    eps=1e-5,
):
    """A config.json for a tiny Llama. `rope_spelling`: "v4" (`rope_theta` + `rope_scaling`)
    or "v5" (`rope_parameters`). llama3 scaling uses original_max_position_embeddings 16, so
    that positions of a short test already fall in all three frequency bands."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": dim,
        "intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    rope = (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        if llama3
        else None
    )
    if rope_spelling == "v5":
        config["rope_parameters"] = {"rope_type": "default", **(rope or {}), "rope_theta": theta}
    else:
        config["rope_theta"] = theta
        config["rope_scaling"] = rope
    return config


def write_tokenizer(path, vocab):
    """A word-level tokenizer.json of `vocab` entries: `<unk>` 0, `<s>` 1 (prepended to every
    encoding, as Llama's tokenizers do), `</s>` 2, then the words `w3 ... w{vocab-1}`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(Path(path) / "tokenizer.json"))
    return tok
