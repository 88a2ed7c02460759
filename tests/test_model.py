"""The Llama-style decoder: token identity across attention methods, the sharded cache, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tree_attention_edu as tae
from tree_attention_edu.core import names
from tree_attention_edu.llama import generator, model
from tree_attention_edu.llama.forward import _one_key_state, attend_fn

CFG = model.Config()
PROMPT_LENS = (5, 17, 40)  # ragged: three prompts, three lengths
NEW = 32
LOGIT_TOL = dict(rtol=0, atol=1e-4)  # float32 logits of size ~3, summed over 2 layers


@pytest.fixture(scope="module")
def generations(mesh8, mesh2x4):
    generator._programs.cache_clear()  # compile afresh: each generator's `traces` counts its own
    params = model.init_params(CFG, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, CFG.vocab, n)) for n in PROMPT_LENS]
    out = {}
    for name, mesh, method, prefill in (
        ("single", mesh8, "single", None),
        ("tree_1d", mesh8, "tree", None),
        ("tree_2level", mesh2x4, "tree", None),
        ("ring", mesh8, "ring", None),
        ("ring_after_tree_prefill", mesh8, "ring", "tree"),
        ("tree_after_ring_prefill", mesh2x4, "tree", "ring"),
    ):
        gen = model.Generator(params, CFG, mesh, method, prefill_chunk=16, prefill_method=prefill)
        out[name] = (gen.generate(prompts, NEW, key=jax.random.key(1)), gen.traces)
    return out


@pytest.mark.parametrize(
    "name", ["tree_1d", "tree_2level", "ring", "ring_after_tree_prefill", "tree_after_ring_prefill"]
)
def test_identical_tokens_across_methods(generations, name):
    want, _ = generations["single"]
    got, traces = generations[name]
    assert got.tokens.shape == (len(PROMPT_LENS), NEW)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, **LOGIT_TOL)  # at every step
    assert traces == 1  # the decode step compiled once for all 31 steps


def test_generators_of_one_model_share_their_programs(mesh8):
    """A second Generator of the same model, mesh and methods compiles nothing."""
    params = model.init_params(CFG, jax.random.key(0))
    first = model.Generator(params, CFG, mesh8, "tree", prefill_chunk=16)
    again = model.Generator(params, CFG, mesh8, "tree", prefill_chunk=16)
    a = first.generate([[1, 2, 3]], 3, key=jax.random.key(0))
    b = again.generate([[1, 2, 3]], 3, key=jax.random.key(0))
    assert first._programs is again._programs and again.traces == 0
    np.testing.assert_array_equal(a.tokens, b.tokens)
    # A ring decoder after a tree prefill runs the tree's prefill program, not a copy of it.
    ring = model.Generator(params, CFG, mesh8, "ring", prefill_chunk=16, prefill_method="tree")
    assert ring._programs is not first._programs
    assert ring._programs.prefill is first._programs.prefill


def test_tokens_are_not_trivial(generations):
    """A constant output would make the identity test vacuous."""
    tokens = generations["single"][0].tokens
    assert all(len(set(row)) > NEW // 2 for row in tokens.tolist())


def test_sampling_is_reproducible(mesh8):
    params = model.init_params(CFG, jax.random.key(3))
    gen = model.Generator(params, CFG, mesh8, "tree", prefill_chunk=8)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]]
    a = gen.generate(prompts, 6, key=jax.random.key(5), temperature=1.0)
    b = gen.generate(prompts, 6, key=jax.random.key(5), temperature=1.0)
    c = gen.generate(prompts, 6, key=jax.random.key(5), temperature=0.0)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.tokens.min() >= 0 and a.tokens.max() < CFG.vocab
    assert not np.array_equal(a.tokens, c.tokens)


def _gather(x):
    return np.asarray(jax.device_get(x))


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
def test_cache_writes_at_shard_boundaries(mesh_name, request):
    """Capacity 16 on 8 devices: 2 slots per device, so positions 1|2 and 15 are boundaries."""
    mesh = request.getfixturevalue(mesh_name)
    B, H, S, D = 3, 2, 16, 4
    sh = model.cache_sharding(mesh)
    assert sh.spec == P(None, None, tuple(mesh.axis_names))
    ck = jax.device_put(jnp.zeros((B, H, S, D)), sh)
    cv = jax.device_put(jnp.zeros((B, H, S, D)), sh)
    # One token per sequence (a decode step) at the last slot of a shard, the first slot of
    # the next, and the last position of the cache.
    new = jnp.arange(1, B + 1, dtype=jnp.float32)[:, None, None, None] * jnp.ones((B, H, 1, D))
    pos = jnp.array([1, 2, 15])
    ck, cv = model.write(ck, cv, new, -new, pos, mesh)
    want = np.zeros((B, H, S, D))
    for b, p in enumerate([1, 2, 15]):
        want[b, :, p] = b + 1
    np.testing.assert_array_equal(_gather(ck), want)
    np.testing.assert_array_equal(_gather(cv), -want)
    assert ck.sharding.is_equivalent_to(sh, 4)
    # A chunk of 5 tokens spanning three shards, at different starts per sequence.
    chunk = jnp.arange(B * H * 5 * D, dtype=jnp.float32).reshape(B, H, 5, D) + 100
    starts = np.array([3, 0, 13])  # the last one runs off the end: dropped, not wrapped
    ck2, _ = model.write(ck, cv, chunk, chunk, jnp.asarray(starts), mesh)
    for b, s0 in enumerate(starts):
        n = min(5, S - s0)
        want[b, :, s0 : s0 + n] = np.asarray(chunk)[b, :, :n]
    np.testing.assert_array_equal(_gather(ck2), want)


def test_float32_even_with_x64(generations):
    """The tests run with jax_enable_x64: the model must still compute in float32."""
    params = model.init_params(CFG, jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert generations["single"][0].logits.dtype == np.float32


def test_empty_cache_capacity_rounds_up(mesh8):
    cache = model.empty_cache(CFG, 2, 30, mesh8)
    assert cache.layers[0][0].shape == (2, CFG.kv_heads, 32, CFG.head_dim)
    assert isinstance(cache.layers[0][0].sharding, NamedSharding)


def test_bad_arguments(mesh8):
    with pytest.raises(ValueError, match=r"`q_heads` \(6\) must be a multiple of `kv_heads`"):
        model.Config(q_heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="`head_dim` must be even"):
        model.Config(head_dim=33)
    params = model.init_params(CFG, jax.random.key(0))
    with pytest.raises(ValueError, match="`method` must be one of"):
        model.Generator(params, CFG, mesh8, "star")
    with pytest.raises(ValueError, match="`prefill_method` must be one of"):
        model.Generator(params, CFG, mesh8, "ring", prefill_method="flash")
    gen = model.Generator(params, CFG, mesh8, "tree", prefill_chunk=8)
    with pytest.raises(ValueError, match="cannot hold the longest prompt"):
        gen.generate([[1] * 10], 8, key=jax.random.key(0), capacity=12)
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[1], []], 2, key=jax.random.key(0))


def test_the_model_runs_a_declared_subset_of_the_registered_methods(mesh8):
    """`model.METHODS` names methods of the one registry, `core.names.METHODS`; a method
    registered there that the model does not run is refused by name."""
    assert model.METHODS and set(model.METHODS) <= set(names.METHODS)
    others = [m for m in names.METHODS if m not in model.METHODS]
    assert others  # the subset is a real one: tree_energy and ring_pass_q are not run here
    params = model.init_params(CFG, jax.random.key(0))
    for method in others:
        with pytest.raises(ValueError, match="`method` must be one of"):
            model.Generator(params, CFG, mesh8, method)


def test_rope_is_a_rotation():
    """RoPE preserves norms and makes q·k depend only on the position difference."""
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 8))

    def pos(p):
        return jnp.array([[p]])

    def dot(a, b):
        return float(jnp.sum(model.rope(q, pos(a), 1e4) * model.rope(k, pos(b), 1e4)))

    np.testing.assert_allclose(dot(3, 1), dot(10, 8), rtol=1e-5)
    np.testing.assert_allclose(
        jnp.linalg.norm(model.rope(q, pos(7), 1e4)), jnp.linalg.norm(q), rtol=1e-6
    )


def test_prefill_method_chooses_the_prefill_attention(mesh8):
    """Ring decoding after tree prefill: only the decode step passes K/V around the ring."""
    params = model.init_params(CFG, jax.random.key(0))
    cache = model.empty_cache(CFG, 1, 16, mesh8)
    tok, last = jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)

    def hlo(gen):
        pre = gen._programs.prefill.lower(gen.params, cache, jnp.zeros((1, 8), jnp.int32), last)
        step = gen._programs.step.lower(gen.params, cache, tok, jax.random.key(0), 0.0, True)
        return pre.as_text(), step.as_text()

    pre, step = hlo(model.Generator(params, CFG, mesh8, "ring", prefill_method="tree"))
    assert "collective_permute" not in pre and "collective_permute" in step
    pre, step = hlo(model.Generator(params, CFG, mesh8, "ring"))
    assert "collective_permute" in pre and "collective_permute" in step


def test_prefill_progress_bar_counts_chunks(mesh8, capsys):
    params = model.init_params(CFG, jax.random.key(0))
    gen = model.Generator(params, CFG, mesh8, "tree", prefill_chunk=8)
    gen.prefill([[1] * 20, [2] * 3], 32, progress=True)
    err = capsys.readouterr().err
    assert "tree prefill" in err and "3/3" in err, err
    gen.prefill([[1] * 20], 32, progress=None)  # 3 chunks: short, so no bar
    assert capsys.readouterr().err == ""


# --- bad arguments fail before any work ---------------------------------------


@pytest.fixture(scope="module")
def gen8(mesh8):
    params = model.init_params(CFG, jax.random.key(0))
    return model.Generator(params, CFG, mesh8, "tree", prefill_chunk=8)


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a cache is allocated: validation must come before any work."""

    def allocate(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(model, "empty_cache", allocate)


BAD_GENERATE = {
    "token-above-vocab": (
        dict(prompts=[[1, 2], [3, 300]]),
        ValueError,
        r"`prompts\[1\]` has token id 300 at position 1; token ids must lie "
        r"in \[0, vocab\) = \[0, 256\)",
    ),
    "token-negative": (
        dict(prompts=[[-1, 2]]),
        ValueError,
        r"`prompts\[0\]` has token id -1 at position 0",
    ),
    "token-float": (dict(prompts=[[1.0, 2.0]]), TypeError, r"`prompts\[0\]` must hold int"),
    "prompts-str": (dict(prompts="abc"), TypeError, r"`prompts` must be a list of prompts"),
    "no-prompts": (dict(prompts=[]), ValueError, r"`prompts` is empty; pass at least one"),
    "empty-prompt": (
        dict(prompts=[[1], []]),
        ValueError,
        r"`prompts\[1\]` is empty; every prompt needs at least one token",
    ),
    "temperature-negative": (
        dict(temperature=-1.0),
        ValueError,
        r"`temperature` must be >= 0, got -1; 0 is greedy",
    ),
    "temperature-nan": (
        dict(temperature=float("nan")),
        ValueError,
        r"`temperature` must be a finite number >= 0, got nan",
    ),
    "temperature-str": (dict(temperature="0.5"), TypeError, r"`temperature` must be a real"),
    "capacity-0": (dict(capacity=0), ValueError, r"`capacity` must be a positive int, got 0"),
    "capacity-float": (dict(capacity=64.0), TypeError, r"`capacity` must be an int"),
    "prompt-longer-than-capacity": (
        dict(prompts=[[1] * 20], capacity=16),
        ValueError,
        r"`capacity` 16 cannot hold the longest prompt \(20 tokens, 24 once padded to whole "
        r"prefill chunks\) plus 4 new tokens; pass capacity >= 24",
    ),
    "new-tokens-do-not-fit": (
        dict(new_tokens=20, capacity=16),
        ValueError,
        r"cannot hold the longest prompt \(3 tokens.*plus 20 new tokens; pass capacity >= 23",
    ),
    "new_tokens-0": (dict(new_tokens=0), ValueError, r"`new_tokens` must be a positive int"),
    "new_tokens-negative": (dict(new_tokens=-2), ValueError, r"`new_tokens` must be a positive"),
    "new_tokens-float": (dict(new_tokens=2.0), TypeError, r"`new_tokens` must be an int"),
    "new_tokens-bool": (dict(new_tokens=True), TypeError, r"`new_tokens` must be an int"),
    "key-int": (dict(key=0), TypeError, r"`key` must be a JAX PRNG key such as"),
    "key-batch": (
        dict(key=jax.random.split(jax.random.key(0))),
        ValueError,
        r"`key` must be a single PRNG key",
    ),
    "progress": (dict(progress="yes"), TypeError, r"`progress` must be True or False"),
}


@pytest.mark.parametrize("name", BAD_GENERATE)
def test_generate_rejects_bad_arguments_before_any_work(gen8, no_work, name):
    kw, exc, match = BAD_GENERATE[name]
    kw = dict(prompts=[[1, 2, 3]], new_tokens=4, key=jax.random.key(0)) | kw
    with pytest.raises(exc, match=match):
        gen8.generate(kw.pop("prompts"), kw.pop("new_tokens"), **kw)
    assert gen8.traces == 0  # nothing was compiled either


def test_prefill_rejects_bad_arguments_before_any_work(gen8, no_work):
    with pytest.raises(ValueError, match=r"`prompts\[0\]` has token id 256"):
        gen8.prefill([[256]], 8)
    with pytest.raises(ValueError, match=r"`capacity` 8 cannot hold the longest prompt \(9 "):
        gen8.prefill([[1] * 9], 8)
    with pytest.raises(TypeError, match=r"`capacity` must be an int"):
        gen8.prefill([[1]], None)


def test_sampling_rejects_bad_temperatures():
    logits = jnp.zeros((2, CFG.vocab), jnp.float32)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="`temperature` must be"):
            model.sample(logits, jax.random.key(0), bad)
    with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
        model.sample(logits, 0, 1.0)


def test_sampling_is_softmax_at_temperature_and_greedy_as_it_vanishes():
    """Against the closed form softmax(l / T) (float64 numpy): the frequencies of 20,000
    draws at T = 0.5 and T = 2 lie within 5 standard errors; a temperature too small for
    l / T to be finite in float32 (1e-45, once every sample was token 0) gives the greedy
    token, as does 1e-38."""
    logits = np.array([[1.0, 2.0, 0.5, -np.inf, 1.5]], np.float32)
    many = jnp.broadcast_to(jnp.asarray(logits), (20_000, 5))
    for t in (0.5, 2.0):
        drawn = np.asarray(model.sample(many, jax.random.key(7), t))
        z = logits[0].astype(np.float64) / t
        want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        got = np.bincount(drawn, minlength=5) / drawn.size
        se = np.sqrt(want * (1 - want) / drawn.size)
        assert np.all(np.abs(got - want) <= 5 * se + 1e-12), (t, got, want)
        assert got[3] == 0  # a masked token is never drawn
    for tiny in (1e-45, 1e-40, 1e-38):
        drawn = np.asarray(model.sample(many[:64], jax.random.key(7), tiny))
        assert (drawn == 1).all(), tiny


@pytest.mark.codegen
def test_generator_on_an_explicit_mesh_matches_an_auto_one(mesh8):
    """`jax.make_mesh` gives Explicit axes, which refuse the model's sharding constraints;
    the Generator runs on the same devices with Auto axes, and gives the same tokens."""
    params = model.init_params(CFG, jax.random.key(0))
    explicit = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    outs = [
        model.Generator(params, CFG, m, "tree", prefill_chunk=8)
        .generate([[1, 2, 3]], 3, key=jax.random.key(0))
        .tokens
        for m in (explicit, mesh8)
    ]
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("method", ["tree", "single"])
def test_a_step_past_the_capacity_gives_nan_not_a_silent_answer(mesh8, method):
    """No device owns a slot past the capacity, so the token's k/v cannot be written: its
    logits are NaN (the next sequence's are not), instead of finite logits of a cache that
    lacks the token."""
    params = model.init_params(CFG, jax.random.key(0))
    gen = model.Generator(params, CFG, mesh8, method, prefill_chunk=8)
    _, cache = gen.prefill([[1] * 8, [2] * 3], 8)
    _, logits, _ = gen.step(cache, np.array([1, 2], np.int32))
    logits = np.asarray(logits)
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()


def test_temperatures_share_one_compiled_step(mesh8):
    """The temperature is traced: a new value compiles nothing (only greedy is static)."""
    params = model.init_params(CFG, jax.random.key(0))
    generator._programs.cache_clear()
    gen = model.Generator(params, CFG, mesh8, "single", prefill_chunk=8)
    for t in (0.5, 0.6, 0.6000001, 2.0):
        gen.generate([[1, 2, 3]], 3, key=jax.random.key(0), temperature=t)
    assert gen.traces == 1


@pytest.mark.codegen
def test_generator_under_an_explicit_context_mesh(mesh8):
    """A caller's `jax.set_mesh(Explicit mesh)` does not leak into the Generator's programs."""
    params = model.init_params(CFG, jax.random.key(0))
    explicit = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    want = (
        model.Generator(params, CFG, mesh8, "tree", prefill_chunk=8)
        .generate([[1, 2, 3]], 3, key=jax.random.key(0))
        .tokens
    )
    with jax.set_mesh(explicit):
        got = (
            model.Generator(params, CFG, explicit, "tree", prefill_chunk=8)
            .generate([[1, 2, 3]], 3, key=jax.random.key(0))
            .tokens
        )
    np.testing.assert_array_equal(got, want)


def test_generator_checks_params_against_cfg(mesh8):
    small = model.Config(vocab=16, dim=8, layers=1, q_heads=2, kv_heads=1, head_dim=4, hidden=8)
    params = jax.eval_shape(lambda: model.init_params(small, jax.random.key(0)))
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), params)
    with pytest.raises(
        ValueError,
        match=r"`params` \['embed'\] has shape \(16, 8\) but `cfg` "
        r"implies \(256, 128\)",
    ):
        model.Generator(params, CFG, mesh8)
    with pytest.raises(TypeError, match="`cfg` must be a Config"):
        model.Generator(params, "tiny", mesh8)
    with pytest.raises(TypeError, match="`mesh` must be a Mesh"):
        model.Generator(params, small, None)
    with pytest.raises(TypeError, match="`prefill_chunk` must be an int"):
        model.Generator(params, small, mesh8, prefill_chunk=8.0)


def test_config_rejects_bad_sizes():
    with pytest.raises(TypeError, match=r"`vocab` must be an int, got float 256\.0"):
        model.Config(vocab=256.0)
    with pytest.raises(ValueError, match="`rope_theta` must be > 1"):
        model.Config(rope_theta=-1.0)
    with pytest.raises(TypeError, match="`tie_embeddings` must be True or False"):
        model.Config(tie_embeddings=1)


def test_out_of_vocab_tokens_give_nan_logits(mesh8):
    """A token id is a value, not inspected (that would differ under `jit`): an id outside
    the vocabulary gives NaN logits for its sequence (JAX would clamp it to another token),
    eagerly and under `jit`; the other sequence is unaffected."""
    params = model.init_params(CFG, jax.random.key(0))
    cache = model.empty_cache(CFG, 2, 8, mesh8)
    attend = attend_fn("single", mesh8)
    tokens = jnp.array([[3], [300]], jnp.int32)  # and -1 below: never wrapped to the last id
    for fwd in (model.forward, jax.jit(model.forward, static_argnums=(1, 4, 5))):
        logits, _ = fwd(params, CFG, tokens, cache, attend, mesh8)
        assert np.isfinite(np.asarray(logits[0])).all() and np.isnan(np.asarray(logits[1])).all()


# --- Hugging Face conventions -------------------------------------------------------


@pytest.mark.parametrize("scaling", [None, model.RopeScaling(8.0, 1.0, 4.0, 16)])
def test_rope_is_hugging_faces_rotate_half(scaling):
    """`rope` equals transformers' `apply_rotary_pos_emb` with `rotate_half`, default and
    llama3 frequencies (the float64 reference follows transformers line by line)."""
    import llama_reference as ref

    B, T, H, D = 2, 40, 3, 16
    x = np.random.default_rng(0).standard_normal((B, T, H, D)).astype(np.float32)
    positions = np.stack([np.arange(T), np.arange(T) + 1000])  # llama3's three bands
    config = ref.standardize(ref.tiny_config(llama3=scaling is not None, dim=H * D, heads=H))
    cos, sin = ref.LlamaRotaryEmbedding(config, positions)
    xt = x.transpose(0, 2, 1, 3).astype(np.float64)  # transformers' [B, H, T, D]
    want, _ = ref.apply_rotary_pos_emb(xt, xt, cos, sin)
    got = model.rope(jnp.asarray(x), jnp.asarray(positions), 10000.0, scaling)
    assert got.dtype == jnp.float32
    # float32 angles at positions up to ~1000: |error| <= ~1000 * eps32 relative
    np.testing.assert_allclose(np.asarray(got).transpose(0, 2, 1, 3), want, rtol=0, atol=2e-4)
    if scaling is not None:  # and the scaling matters: plain RoPE differs at these positions
        plain = model.rope(jnp.asarray(x), jnp.asarray(positions), 10000.0)
        assert np.abs(np.asarray(plain) - np.asarray(got)).max() > 0.1


def test_rope_scaling_rejects_bad_values():
    with pytest.raises(ValueError, match=r"`factor` must be >= 1"):
        model.RopeScaling(factor=0.5)
    with pytest.raises(ValueError, match=r"`high_freq_factor` must be > 1"):
        model.RopeScaling(low_freq_factor=1.0, high_freq_factor=1.0)
    with pytest.raises(TypeError, match=r"`original_max_position_embeddings` must be an int"):
        model.RopeScaling(original_max_position_embeddings=8192.0)
    with pytest.raises(TypeError, match=r"`rope_scaling` must be a RopeScaling"):
        model.Config(rope_scaling={"factor": 8.0})


def test_read_then_append_is_the_write_then_attend_step(mesh8):
    """One device's decode step reads the cache in one program and appends in a second
    (`_attend_then_append`, `append`); it must be the step that writes first and attends
    over the written cache (`forward`, with the generator's packed weights): the same
    logits and cache to rounding, at every step, for sequences of different lengths and an
    empty one."""
    params = model.init_params(CFG, jax.random.key(0))
    gen = model.Generator(params, CFG, mesh8, "single", prefill_chunk=8)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]]
    _, cache = gen.prefill(prompts, 24)
    tok = jnp.array([1, 2, 3], jnp.int32)
    attend = attend_fn("single", gen.mesh)
    forward = jax.jit(model.forward, static_argnums=(1, 4, 5))
    for _ in range(4):
        want_logits, want = forward(gen.params, CFG, tok[:, None], cache, attend, gen.mesh)
        got_tok, got_logits, cache = gen.step(cache, tok)
        np.testing.assert_allclose(got_logits, want_logits[:, 0], rtol=2e-5, atol=2e-5)
        # To rounding: the programs differ (one pass and a merge, against one pass over
        # the written cache; jit against op by op), and later layers inherit it.
        for got_kv, want_kv in zip(cache.layers, want.layers, strict=True):
            np.testing.assert_allclose(got_kv, want_kv, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(cache.lengths, want.lengths)
        tok = got_tok
    # An empty cache: the step's own key is all there is.
    empty = model.empty_cache(CFG, 1, 8, gen.mesh)
    want_logits, _ = forward(gen.params, CFG, tok[:1, None], empty, attend, gen.mesh)
    _, got_logits, _ = gen.step(model.empty_cache(CFG, 1, 8, gen.mesh), tok[:1])
    np.testing.assert_allclose(got_logits, want_logits[:, 0], rtol=2e-5, atol=2e-5)


def test_one_key_state_is_attention_over_one_key():
    """The closed form of a single key's state against softmax over one key, in float64."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 1, 6, 8))
    k, v = rng.normal(size=(2, 3, 1, 8)), rng.normal(size=(2, 3, 1, 8))
    state = _one_key_state(
        jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)
    )
    heads = np.arange(6) // 2  # GQA: query head h reads kv head h // 2
    s = np.einsum("bhd,bhd->bh", q[:, 0], k[:, heads, 0]) / np.sqrt(8)
    np.testing.assert_allclose(state.lse[:, 0], s, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state.out[:, 0], v[:, heads, 0], rtol=1e-7, atol=1e-7)


def test_packed_projections_compute_the_same_model(mesh8):
    """`pack_projections` concatenates q/k/v and gate/up; the model is the same function
    (rounding aside: a product of a packed matrix sums in the same order per column)."""
    params = model.init_params(CFG, jax.random.key(0))
    packed = model.pack_projections(params, CFG)
    layer = packed["layers"][0]
    assert set(model.PACKED) <= set(layer) and not {"wq", "wk", "wv", "w_gate", "w_up"} & set(layer)
    assert layer["wqkv"].shape == (CFG.dim, (CFG.q_heads + 2 * CFG.kv_heads) * CFG.head_dim)
    np.testing.assert_array_equal(layer["w_gate_up"][:, CFG.hidden :], params["layers"][0]["w_up"])
    assert packed["embed"] is params["embed"]  # shared, not copied
    mesh1 = tae.make_mesh(1, "x")
    attend = attend_fn("single", mesh1)
    forward = jax.jit(model.forward, static_argnums=(1, 4, 5))
    tokens = jnp.array([[1, 5, 9, 2, 7]], jnp.int32)
    want, _ = forward(params, CFG, tokens, model.empty_cache(CFG, 1, 8, mesh1), attend, mesh1)
    got, _ = forward(packed, CFG, tokens, model.empty_cache(CFG, 1, 8, mesh1), attend, mesh1)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="params"):
        model.pack_projections(packed, CFG)  # already packed: not the layout of init_params
