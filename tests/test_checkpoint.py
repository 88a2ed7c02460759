"""Hugging Face Llama checkpoints: loading matches an independent float64 Llama, on every
attention method; malformed checkpoints fail with one clear message; writing round-trips.

The checkpoints are written here by `llama_reference.write_checkpoint` (numpy + safetensors,
no package code) in the four combinations that matter: float32 and bfloat16, tied and untied
embeddings, with and without Llama 3.1's rope scaling, one file and sharded with an index.

Agreement measured when this was written (max |package - reference| over every generated
position of both prompts, divided by the largest |reference logit|; float32 package, float64
reference): f32-untied 4.8e-7, bf16-untied-llama3 3.9e-7, f32-tied-llama3-sharded 1.0e-6,
bf16-tied-sharded 6.5e-7; greedy tokens identical in all four. `REL_TOL` leaves room for
other CPUs' rounding.

The reference was checked once against transformers 5.23's `LlamaForCausalLM` (torch 2.13
CPU, eager attention) on these four checkpoints: greedy tokens identical, and logits within
1.1e-7 to 4.4e-7 of the logit scale with `dtype=torch.float64` (transformers keeps RoPE
frequencies, RMSNorm and softmax in float32 even then) and within 0.7e-15 to 1.3e-15 once
those three are switched to float64 too.
"""

import json

import jax
import jax.numpy as jnp
import llama_reference as ref
import ml_dtypes
import numpy as np
import pytest

from tree_attention_edu.llama import checkpoint, model

# name: (tiny_config arguments, stored dtype, files)
CHECKPOINTS = {
    "f32-untied": (dict(), "float32", 1),
    "bf16-untied-llama3": (dict(llama3=True), "bfloat16", 1),
    "f32-tied-llama3-sharded": (
        dict(tied=True, llama3=True, rope_spelling="v5", head_dim=16),
        "float32",
        3,
    ),
    "bf16-tied-sharded": (dict(tied=True, kv_heads=1, rope_spelling="v5"), "bfloat16", 2),
}
# The dtype each is loaded as for the reference test: float32 (bf16 converted, the default),
# except one bf16 checkpoint kept in bfloat16, whose products the model promotes to float32.
LOAD_DTYPE = {"bf16-tied-sharded": jnp.bfloat16}
PROMPTS = [[1, 5, 9, 3, 7, 20, 33, 40, 2, 11, 60, 17], [4, 8, 15]]  # ragged; 2 prefill chunks
NEW = 8
CHUNK = 8  # a multiple of the 8 devices: prefill splits the chunk's tokens across them
REL_TOL = 3e-6  # of the largest |logit|; float32 compute against the float64 reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    for seed, (name, (kw, dtype, files)) in enumerate(CHECKPOINTS.items()):
        config = ref.tiny_config(**kw)
        ref.write_checkpoint(root / name, config, ref.random_weights(config, seed), dtype, files)
    return {name: root / name for name in CHECKPOINTS}


@pytest.fixture(scope="module")
def generate(checkpoints, mesh8, mesh2x4):
    """`generate(name, method, mesh, dtype)`: greedy generation of PROMPTS, run once."""
    done = {}

    def run(name, method="tree", mesh="1d", dtype=jnp.float32):
        key = (name, method, mesh, jnp.dtype(dtype).name)
        if key not in done:
            m = mesh8 if mesh == "1d" else mesh2x4
            params, cfg = checkpoint.load_checkpoint(checkpoints[name], dtype=dtype, mesh=m)
            # Ring prefill passes every shard around the ring per chunk and layer (slow, and
            # tested in test_model.py); ring decoding after tree prefill is what is timed.
            gen = model.Generator(
                params,
                cfg,
                m,
                method,
                prefill_chunk=CHUNK,
                prefill_method="tree" if method == "ring" else None,
            )
            done[key] = gen.generate(PROMPTS, NEW, key=jax.random.key(0))
        return done[key]

    return run


def reference_errors(path, out):
    """Per prompt: (greedy tokens equal?, max |logit error| / max |logit|) against the
    float64 reference, teacher-forced on the package's tokens."""
    config, weights = ref.read_checkpoint(path)
    result = []
    for b, prompt in enumerate(PROMPTS):
        tokens, _ = ref.greedy(config, weights, prompt, NEW)
        want = ref.teacher_forced(config, weights, prompt, out.tokens[b])
        err = float(np.abs(out.logits[b] - want).max() / np.abs(want).max())
        result.append((bool(np.array_equal(out.tokens[b], tokens)), err))
    return result


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tree_decoding_matches_the_reference(name, checkpoints, generate):
    out = generate(name, dtype=LOAD_DTYPE.get(name, jnp.float32))
    assert out.logits.dtype == np.float32
    errors = reference_errors(checkpoints[name], out)
    print(f"{name}: relative logit error per prompt {[f'{e:.1e}' for _, e in errors]}")
    assert all(same for same, _ in errors), errors
    assert max(e for _, e in errors) < REL_TOL, errors
    assert all(len(set(row)) > 1 for row in out.tokens.tolist())  # not a constant output


@pytest.mark.parametrize("method, mesh", [("single", "1d"), ("tree", "2level"), ("ring", "1d")])
def test_every_method_gives_the_same_tokens(method, mesh, checkpoints, generate):
    name = "bf16-untied-llama3"
    want, got = generate(name), generate(name, method, mesh)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    scale = np.abs(want.logits).max()
    assert np.abs(got.logits - want.logits).max() < REL_TOL * scale


def test_dtypes_and_placement(checkpoints, mesh8):
    """bf16 weights become float32 by default, stay bf16 when asked (LOAD_DTYPE decodes one
    checkpoint so), and are placed replicated."""
    f32, bf16 = checkpoints["f32-tied-llama3-sharded"], checkpoints["bf16-tied-sharded"]
    for path, dtype, want in (
        (bf16, None, jnp.bfloat16),
        (f32, None, jnp.float32),
        (bf16, jnp.float32, jnp.float32),
        (f32, jnp.bfloat16, jnp.bfloat16),
    ):
        params, _ = checkpoint.load_checkpoint(path, dtype=dtype)
        assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(want)}, (path, dtype)
    params, cfg = checkpoint.load_checkpoint(bf16, mesh=mesh8)
    assert "unembed" not in params and cfg.tie_embeddings
    for leaf in jax.tree.leaves(params):
        assert leaf.sharding.is_fully_replicated
        assert set(leaf.devices()) == set(mesh8.devices.flat)
        if jax.default_backend() == "cpu":  # the 8 simulated devices share one host copy
            assert len({s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards}) == 1


def test_config_is_read_as_transformers_reads_it(checkpoints):
    info = checkpoint.inspect_checkpoint(checkpoints["f32-tied-llama3-sharded"])
    assert info.cfg == model.Config(
        vocab=64,
        dim=32,
        layers=2,
        q_heads=4,
        kv_heads=2,
        head_dim=16,
        hidden=64,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        rope_scaling=model.RopeScaling(8.0, 1.0, 4.0, 16),
    )
    assert len({t.file for t in info.tensors.values()}) == 3 and info.tokenizer is None
    assert len(info.tensors) == 1 + 9 * 2 + 1  # embedding, 9 per layer, final norm; tied
    assert info.num_params == sum(
        np.prod(s)
        for s in ref.weight_shapes(ref.tiny_config(tied=True, llama3=True, head_dim=16)).values()
    )
    assert info.stored_bytes == 4 * info.num_params
    untied = checkpoint.inspect_checkpoint(checkpoints["bf16-untied-llama3"])
    assert untied.cfg.rope_scaling == model.RopeScaling(8.0, 1.0, 4.0, 16)
    assert not untied.cfg.tie_embeddings and untied.stored_bytes == 2 * untied.num_params
    for cfg in (info.cfg, untied.cfg, model.Config()):
        assert checkpoint.config_from_hf(checkpoint.config_to_hf(cfg)) == cfg


def test_save_writes_the_hugging_face_layout(checkpoints, tmp_path):
    """Loading and saving gives back the same tensors, byte for byte, under the same names;
    sharded bfloat16 saving rounds each weight once."""
    src = checkpoints["f32-tied-llama3-sharded"]
    params, cfg = checkpoint.load_checkpoint(src)
    files = checkpoint.save_checkpoint(tmp_path / "one", params, cfg)
    assert [f.name for f in files] == ["config.json", "model.safetensors"]
    (want_config, want), (got_config, got) = (
        ref.read_checkpoint(src),
        ref.read_checkpoint(tmp_path / "one"),
    )
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert got_config["rope_parameters"] == want_config["rope_parameters"]

    files = checkpoint.save_checkpoint(
        tmp_path / "bf16", params, cfg, dtype=jnp.bfloat16, max_shard_bytes=5_000
    )
    assert files[-1].name == checkpoint.INDEX and len(files) > 4
    index = json.loads(files[-1].read_text())
    assert set(index["weight_map"]) == set(want)
    back, back_cfg = checkpoint.load_checkpoint(tmp_path / "bf16", dtype=None)
    assert back_cfg == cfg
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(ml_dtypes.bfloat16))


def test_tokenizer(checkpoints, tmp_path):
    assert checkpoint.load_tokenizer(checkpoints["f32-untied"]) is None
    config = ref.tiny_config()
    ref.write_checkpoint(tmp_path, config, ref.random_weights(config, 0))
    ref.write_tokenizer(tmp_path, 64)
    assert checkpoint.inspect_checkpoint(tmp_path).tokenizer == tmp_path / "tokenizer.json"
    tok = checkpoint.load_tokenizer(tmp_path)
    assert tok.encode("w5 w17 w63").ids == [1, 5, 17, 63]
    assert tok.decode([1, 5, 17, 63]) == "w5 w17 w63"  # special tokens skipped


# --- malformed checkpoints: one clear message, before any weight is read ----------------------


def _drop(name):
    def change(config, weights, extra):
        weights.pop(name)

    return change


def _config(**changes):
    def change(config, weights, extra):
        for key, value in changes.items():
            if value is None:
                config.pop(key)
            else:
                config[key] = value

    return change


def _extra(name, make):
    def change(config, weights, extra):
        extra[name] = make(weights)

    return change


Q = "model.layers.0.self_attn.q_proj.weight"
K = "model.layers.0.self_attn.k_proj.weight"
BROKEN = {
    "heads-do-not-divide": (
        _config(num_key_value_heads=3),
        1,
        r"num_attention_heads \(4\) must be a multiple of "
        r"num_key_value_heads \(3\)",
    ),
    "hidden-not-a-multiple-of-heads": (
        _config(hidden_size=30),
        1,
        r"hidden_size \(30\) is not a multiple of "
        r"num_attention_heads \(4\)",
    ),
    "missing-key": (_config(hidden_size=None), 1, r"lacks \"hidden_size\""),
    "bad-value": (
        _config(num_hidden_layers=0),
        1,
        r"\"num_hidden_layers\" must be an int >= 1 and < 2\*\*53, got 0",
    ),
    "bad-type": (_config(rms_norm_eps="tiny"), 1, r"\"rms_norm_eps\" must be a finite number"),
    "another-model": (_config(model_type="gpt2"), 1, r"\"model_type\" is 'gpt2'"),
    "biases": (_config(attention_bias=True), 1, r"\"attention_bias\" is True"),
    "rope-yarn": (
        _config(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        1,
        r"\"rope_type\" is 'yarn'.*reads \"default\" and \"llama3\"",
    ),
    "llama3-factor-below-1": (
        _config(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 0.5,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            }
        ),
        1,
        r"`config.json` in .*: `factor` must be >= 1",
    ),
    "llama3-without-factor": (
        _config(rope_scaling={"rope_type": "llama3"}),
        1,
        r"lacks \"factor\"",
    ),
    "missing-tensor": (
        _drop("model.layers.1.mlp.up_proj.weight"),
        1,
        r"`model.layers.1.mlp.up_proj.weight` is missing from the checkpoint "
        r".*shape \[64, 32\]",
    ),
    "missing-lm-head": (_drop("lm_head.weight"), 2, r"`lm_head.weight` is missing"),
    "unreadable-dtype": (
        _extra(Q, lambda w: w[Q].astype(np.int8)),
        1,
        r"`model.layers.0.self_attn.q_proj.weight` in model.safetensors has "
        r"dtype I8, which the loader cannot read",
    ),
    "uint8": (_extra(Q, lambda w: w[Q].astype(np.uint8)), 1, r"has dtype U8"),
    "transposed": (
        _extra(K, lambda w: np.ascontiguousarray(w[K].T.astype(np.float32))),
        1,
        r"has shape \[32, 16\], but config.json implies \[16, 32\]",
    ),
    "unexpected-tensor": (
        _extra("model.layers.0.self_attn.q_proj.bias", lambda w: np.zeros(32, np.float32)),
        1,
        r"`model.layers.0.self_attn.q_proj.bias` in model.safetensors is not "
        r"a weight",
    ),
}


def _write_broken(path, change, files):
    config = ref.tiny_config()
    weights = ref.random_weights(config, 0)
    extra = {}
    change(config, weights, extra)
    return ref.write_checkpoint(path, config, weights, "float32", files, extra)


@pytest.mark.parametrize("name", BROKEN)
def test_malformed_checkpoints_fail_clearly(name, tmp_path):
    change, files, message = BROKEN[name]
    path = _write_broken(tmp_path, change, files)
    for fn in (checkpoint.inspect_checkpoint, checkpoint.load_checkpoint):
        with pytest.raises(ValueError, match=message):
            fn(path)


def test_malformed_files_fail_clearly(tmp_path):
    def fresh(name, files=1):
        return _write_broken(tmp_path / name, lambda *a: None, files)

    path = fresh("no-config")
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"`path` .* has no config.json; a Hugging Face"):
        checkpoint.load_checkpoint(path)
    with pytest.raises(ValueError, match=r"`path` .* is not a folder"):
        checkpoint.load_checkpoint(path / "model.safetensors")
    with pytest.raises(TypeError, match=r"`path` must be a folder \(str or pathlib.Path\)"):
        checkpoint.load_checkpoint(42)
    path = fresh("not-json")
    (path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"`config.json` in .* is not a JSON object"):
        checkpoint.load_checkpoint(path)
    path = fresh("no-weights")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"has no weights: no model.safetensors"):
        checkpoint.load_checkpoint(path)
    path = fresh("corrupt")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(
        ValueError,
        match=r"`model.safetensors` in .* is not a readable "
        r"safetensors file",
    ):
        checkpoint.load_checkpoint(path)
    path = fresh("lost-shard", files=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        ValueError,
        match=r"lists the shard 'model-00002-of-00002.safetensors', "
        r"which is not there",
    ):
        checkpoint.load_checkpoint(path)
    path = fresh("index-disagrees", files=2)
    index = json.loads((path / checkpoint.INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    index["weight_map"]["model.embed_tokens.weight"] = "model-00002-of-00002.safetensors"
    (path / checkpoint.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"the index and the shards disagree"):
        checkpoint.load_checkpoint(path)
    with pytest.raises(TypeError, match=r"`dtype` must be a floating dtype"):
        checkpoint.load_checkpoint(fresh("ok"), dtype=jnp.int8)


def test_hostile_folders_fail_clearly(tmp_path):
    """What a downloaded folder may hold to break the loader: an index that points outside
    the folder, numbers no float holds, JSON that defeats the parser, far more layers than
    the files hold. Each is one ValueError naming the file, before any weight is read."""
    import resource
    import time

    def fresh(name, files=2):
        return _write_broken(tmp_path / name, lambda *a: None, files)

    outside = fresh("outside")
    (tmp_path / "elsewhere.safetensors").write_bytes(
        (outside / "model-00001-of-00002.safetensors").read_bytes()
    )
    for shard in (
        "../elsewhere.safetensors",
        str(tmp_path / "elsewhere.safetensors"),
        "sub/../../elsewhere.safetensors",
    ):
        index = json.loads((outside / checkpoint.INDEX).read_text())
        index["weight_map"] = {
            k: (shard if v.startswith("model-00001") else v) for k, v in index["weight_map"].items()
        }
        (outside / checkpoint.INDEX).write_text(json.dumps(index))
        with pytest.raises(
            ValueError,
            match=r"lists the shard .*, which is not a file name "
            r"inside the checkpoint folder",
        ):
            checkpoint.inspect_checkpoint(outside)

    huge = 10**400  # JSON has no limit on integers; a float tops out near 1.8e308
    for key in (
        "rms_norm_eps",
        "rope_theta",
        "num_hidden_layers",
        "vocab_size",
        "tie_word_embeddings",
    ):
        path = _write_broken(tmp_path / f"huge-{key}", _config(**{key: huge}), 1)
        with pytest.raises(ValueError, match=rf"`config.json` in .*: \"{key}\" must be"):
            checkpoint.inspect_checkpoint(path)
    path = _write_broken(
        tmp_path / "huge-llama3",
        _config(
            rope_scaling={
                "rope_type": "llama3",
                "factor": huge,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            }
        ),
        1,
    )
    with pytest.raises(ValueError, match=r"\"factor\" must be a finite number"):
        checkpoint.inspect_checkpoint(path)

    path = fresh("json", 1)
    for text, why in (
        ('{"vocab_size": 1' + "0" * 5000 + "}", r"Exceeds the limit"),
        ("[" * 100_000 + "]" * 100_000, r"recursion"),
    ):
        (path / "config.json").write_text(text)
        with pytest.raises(
            ValueError,
            match=rf"`config.json` in .* is not a JSON object .*"
            rf"{why}",
        ):
            checkpoint.inspect_checkpoint(path)

    layers = _write_broken(tmp_path / "layers", _config(num_hidden_layers=10**9), 1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    for fn in (checkpoint.inspect_checkpoint, checkpoint.load_checkpoint):
        with pytest.raises(
            ValueError,
            match=r"declares 1000000000 layers \(9 tensors each\), "
            r"but the checkpoint holds only 21 tensors",
        ):
            fn(layers)
    assert time.perf_counter() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100_000  # KiB: < 100 MB
