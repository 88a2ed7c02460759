"""What each device's shard of the cache contributes, read from inside the model
(`Generator.teacher_force`, `model.ShardStats`): checked against per-shard sums written
here in float64 over the scores of the independent numpy Llama (`llama_reference`)."""

import math

import jax
import llama_reference as ref
import numpy as np
import pytest

from tree_attention_edu.llama import model, shards

CFG = model.Config(
    vocab=64, dim=32, layers=2, q_heads=4, kv_heads=2, head_dim=8, hidden=64, rope_theta=10000.0
)
PROMPT, FORCED, CAPACITY = 13, 8, 32  # 21 positions in a cache of 4 slots per device


def _hf(params) -> tuple[dict, dict]:
    """The reference's config and float64 weights (Hugging Face names, Linear `[out, in]`)."""
    config = ref.standardize(
        {
            "vocab_size": CFG.vocab,
            "hidden_size": CFG.dim,
            "intermediate_size": CFG.hidden,
            "num_hidden_layers": CFG.layers,
            "num_attention_heads": CFG.q_heads,
            "num_key_value_heads": CFG.kv_heads,
            "head_dim": CFG.head_dim,
            "rms_norm_eps": CFG.norm_eps,
            "rope_theta": CFG.rope_theta,
            "tie_word_embeddings": False,
        }
    )
    f = lambda x: np.asarray(x, np.float64)  # noqa: E731
    w = {
        "model.embed_tokens.weight": f(params["embed"]),
        "model.norm.weight": f(params["final_norm"]),
        "lm_head.weight": f(params["unembed"]).T,
    }
    names = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    for i, layer in enumerate(params["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = f(layer["attn_norm"])
        w[p + "post_attention_layernorm.weight"] = f(layer["mlp_norm"])
        w |= {p + hf + ".weight": f(layer[k]).T for k, hf in names.items()}
    return config, w


@pytest.mark.parametrize("method", ["tree", "ring"])
def test_shard_stats_are_per_shard_logsumexps(method, mesh8):
    """A prompt prefilled, then 8 tokens teacher-forced: each layer's per-shard lse and
    local output sizes equal float64 logsumexps and softmax means over the keys of each
    shard (4 positions each) that each query sees; empty shards are (-inf, 0, inf)."""
    params = model.init_params(CFG, jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, CFG.vocab, PROMPT + FORCED)
    gen = model.Generator(params, CFG, mesh8, method, prefill_chunk=8)
    _, cache = gen.prefill([ids[:PROMPT]], CAPACITY)
    logits, cache, stats = gen.teacher_force(cache, ids[None, PROMPT:])
    p = mesh8.size
    assert stats.lse.shape == (CFG.layers, p, 1, FORCED, CFG.q_heads)
    assert int(cache.lengths[0]) == PROMPT + FORCED

    ref.ATTENTION_LOG = []
    try:
        config, w = _hf(params)
        want_logits = ref.LlamaForCausalLM(config, w, ids[None])[0, PROMPT:]
        log = ref.ATTENTION_LOG
    finally:
        ref.ATTENTION_LOG = None
    np.testing.assert_allclose(np.asarray(logits[0]), want_logits, rtol=0, atol=1e-4)
    per = CAPACITY // p
    for layer, (scores, values) in enumerate(log):
        n = scores.shape[-1]  # the reference's sequence; the cache has CAPACITY slots
        s = np.full((CFG.q_heads, FORCED, CAPACITY), -np.inf)
        s[..., :n] = scores[0, :, PROMPT:]  # [Hq, FORCED, slots]: forced queries, every key
        visible = s > np.finfo(np.float64).min / 2  # the reference's causal mask, undone
        values = np.concatenate(
            [values, np.zeros((*values.shape[:2], CAPACITY - n, values.shape[3]))], axis=2
        )
        for i in range(p):
            keys = slice(i * per, (i + 1) * per)
            si, vis = s[:, :, keys], visible[:, :, keys]
            m = np.where(vis, si, -np.inf).max(-1, keepdims=True)
            e = np.where(vis, np.exp(np.where(vis, si, 0) - np.where(np.isfinite(m), m, 0)), 0.0)
            total = e.sum(-1)  # 0 where shard i holds no visible key: lse -inf
            lse = np.where(total > 0, np.log(np.where(total > 0, total, 1)) + m[..., 0], -np.inf)
            out = (
                np.einsum("htk,hkd->htd", e, values[0][:, keys])
                / np.where(e.sum(-1) > 0, e.sum(-1), 1)[..., None]
            )
            got = [np.asarray(x[layer, i, 0]).T for x in stats]  # [Hq, FORCED] each
            np.testing.assert_allclose(got[0], lse, rtol=0, atol=2e-5)
            np.testing.assert_allclose(got[1], np.abs(out).max(-1), rtol=0, atol=2e-5)
            small = np.where(np.abs(out) > 0, np.abs(out), np.inf).min(-1)
            np.testing.assert_allclose(got[2], small, rtol=0, atol=2e-5)
    # Shards past the longest query hold no visible key: exactly empty.
    assert np.isneginf(np.asarray(stats.lse[:, -2:])).all()
    assert (np.asarray(stats.out_max[:, -2:]) == 0).all()


# --- the posterior over shards and the lse profile (llama.shards) ------------------------------


def test_shard_weights_are_a_stable_posterior():
    """Closed forms: weights 1:0:3, an overflow-sized pair, and a row with every shard empty."""
    lse = np.array(
        [[0.0, -np.inf, np.log(3.0)], [1000.0, 999.0, -np.inf], [-np.inf, -np.inf, -np.inf]]
    )
    w = shards.shard_weights(lse, axis=1)
    e = np.exp(-1.0)
    np.testing.assert_allclose(
        w, [[0.25, 0, 0.75], [1 / (1 + e), e / (1 + e), 0], [0, 0, 0]], rtol=1e-15, atol=0
    )


def test_lse_profile_is_the_same_on_eight_devices_and_on_one(mesh8):
    """The full lse merged from 8 shards equals the lse one device computes over the whole
    cache; on one device every shard's lse is the full lse."""
    params = model.init_params(CFG, jax.random.key(1))
    ids = np.random.default_rng(1).integers(0, CFG.vocab, 40)
    tree = shards.lse_profile(model.Generator(params, CFG, mesh8, "tree"), ids, chunk=16)
    one = shards.lse_profile(model.Generator(params, CFG, mesh8, "single"), ids, chunk=16)
    for field in ("lse_min", "lse_max"):
        np.testing.assert_allclose(tree[field], one[field], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(one["shard_lse_min"], one["lse_min"])
    np.testing.assert_array_equal(one["shard_lse_max"], one["lse_max"])
    assert (tree["shard_lse_max"] <= tree["lse_max"] + 1e-6).all()
    assert (tree["shard_lse_min"] < one["lse_min"]).any()  # a shard sees less than all keys


def test_one_pass_verdict_against_the_float32_window():
    """float32, 8 devices, by the closed form of `merges.one_pass_window`, each end 2^-8
    (`WINDOW_MARGIN`) inside: the fast path holds while lse + ln|out| <= min(ln max,
    -ln tiny) - ln 8 = 87.34 - 2.08 = 85.26 (the reciprocal of the denominator must stay
    normal) and lse + ln|out| >= ln(tiny/eps) = -87.34 + 15.94 = -71.39 (no term that a
    cancelling sum could flush)."""
    f32 = np.finfo(np.float32)
    margin = 2.0**-8
    bottom = math.log(float(f32.tiny)) - math.log(float(f32.eps)) + margin
    top = min(math.log(float(f32.max)), -math.log(float(f32.tiny))) - math.log(8) - margin
    assert 85.25 < top < 85.26 and -71.40 < bottom < -71.38
    ok = shards.one_pass_verdict({"high": np.array([[85.0]]), "low": np.array([[-5.0]])}, 8)
    assert ok["safe"] and math.isclose(ok["top_margin"], top - 85.0, rel_tol=1e-12)
    assert math.isclose(ok["bottom_margin"], -5.0 - bottom, rel_tol=1e-12)
    assert not shards.one_pass_verdict({"high": np.array([[85.5]]), "low": np.array([[0.0]])}, 8)[
        "safe"
    ]
    for low in (-87.5, -75.0):  # -75: above ln(tiny), yet a cancelling sum there flushes
        assert not shards.one_pass_verdict(
            {"high": np.array([[0.0]]), "low": np.array([[low]])}, 8
        )["safe"]
    # The centred shift leaves the same headroom at both ends.
    v = shards.one_pass_verdict({"high": np.array([[120.0]]), "low": np.array([[-10.0]])}, 8)
    c = shards.one_pass_verdict(
        {"high": np.array([[120.0]]), "low": np.array([[-10.0]])}, 8, shift=v["centred_shift"]
    )
    assert not v["safe"] and c["safe"]
    assert math.isclose(c["top_margin"], c["bottom_margin"], rel_tol=1e-12)
    assert math.isclose(c["top_margin"], (top - bottom - 130.0) / 2, rel_tol=1e-12)
