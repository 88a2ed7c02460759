"""Speed of generation against the memory roofline (`llama.speed`, `tree-attention-edu
speed`): the bytes a decode step reads, by closed forms written here; no decode step copies
the cache (read from the compiled program); the benchmark's record and the command line."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from tree_attention_edu import cli
from tree_attention_edu.llama import model, speed

CFG = model.Config(vocab=96, dim=64, layers=2, q_heads=4, kv_heads=2, head_dim=16, hidden=160)


@pytest.mark.parametrize("tied", [False, True])
def test_step_bytes_by_closed_form(tied):
    """Every layer weight, the final norm and one [dim, vocab] projection, float32; the
    cache's 2·L·B·Hkv·S·D floats; p replicas of the weights on p simulated devices."""
    import dataclasses

    cfg = dataclasses.replace(CFG, tie_embeddings=tied)
    params = model.init_params(cfg, jax.random.key(0))
    d, hq, hkv, hd, h = cfg.dim, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden
    layer = d * hq * hd * 2 + d * hkv * hd * 2 + 3 * d * h + 2 * d
    weights = 4 * (cfg.layers * layer + d + cfg.vocab * d)
    cache = 4 * 2 * cfg.layers * 3 * hkv * 100 * hd
    got = speed.step_bytes(params, cfg, 100, batch=3, devices=8)
    assert (got.weights, got.cache) == (weights, cache)
    assert got.machine == 8 * weights + cache and got.per_device == weights + cache // 8
    # the ring: every device folds every block of the query it holds (all of it)
    ring = speed.step_bytes(params, cfg, 100, batch=3, devices=8, method="ring")
    assert ring.machine == 8 * weights + 8 * cache and ring.per_device == weights + cache


@pytest.mark.parametrize("method", ["single", "tree"])
def test_a_decode_step_copies_no_cache(method, mesh8):
    """The compiled step updates the donated cache in place (the outputs alias all of it)
    and its scratch memory is far below one layer's keys: nothing cache-sized is written.
    (Plain attention on the head-major cache wrote a transposed, masked copy of each
    layer's K and V: two layers' worth of scratch.)"""
    gen = model.Generator(model.init_params(CFG, jax.random.key(0)), CFG, mesh8, method)
    cache = model.empty_cache(CFG, 1, 16384, gen.mesh)
    tok = jax.device_put(jnp.zeros((1,), jnp.int32), gen._rep)
    args = (tok, jax.random.key(0), 0.0, True)
    per_device = speed.cache_bytes(CFG, 16384) // gen.mesh.size
    layer_k = per_device // (2 * CFG.layers)
    if method == "single":  # a program that only reads the cache, then one that appends
        read = gen._programs.read_step.lower(gen.params, cache, *args).compile()
        assert read.memory_analysis().temp_size_in_bytes < layer_k / 2
        new = [(jnp.zeros((1, CFG.kv_heads, 1, CFG.head_dim), jnp.float32),) * 2] * CFG.layers
        compiled = gen._programs.append.lower(cache, new).compile()
    else:
        compiled = gen._programs.step.lower(gen.params, cache, *args).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= per_device
    assert mem.temp_size_in_bytes < layer_k / 2, (mem.temp_size_in_bytes, layer_k)


def test_a_one_device_step_chooses_a_branch_once(mesh8):
    """The read step mends a cache with non-finite padding with one `lax.cond` per step, not
    one per layer: 30 of them cost a
    SmolLM2-shaped step 2.74 of its 7.33 ms on an H200 (two machines of that kind,
    results/gpu/README.md)."""
    import dataclasses
    import re

    cfg = dataclasses.replace(CFG, layers=5)
    gen = model.Generator(model.init_params(cfg, jax.random.key(0)), cfg, mesh8, "single")
    cache = model.empty_cache(cfg, 2, 64, gen.mesh)
    tok = jax.device_put(jnp.zeros((2,), jnp.int32), gen._rep)
    hlo = gen._programs.read_step.lower(gen.params, cache, tok, jax.random.key(0), 0.0, True)
    conds = re.findall(r"\bconditional\(", hlo.compile().as_text())
    assert len(conds) == 1, len(conds)


@pytest.mark.cpu_only
def test_one_program_cannot_write_and_read_the_cache_without_a_copy():
    """Why one device's step is two programs: XLA copies a donated buffer that one operation
    updates in place while a matrix product reads it whole (the cache-sized copy this test
    finds). If a later XLA stops copying, the split in `forward.read_only_step` can go."""

    def step(cache, q, new, i):
        return lax.dynamic_update_slice_in_dim(cache, new, i, axis=2), jnp.einsum(
            "bhmd,bhsd->bhms", q, cache
        )

    cache = jnp.zeros((1, 2, 16384, 16), jnp.float32)
    compiled = (
        jax.jit(step, donate_argnums=0)
        .lower(cache, *(jnp.ones((1, 2, n, 16), jnp.float32) for n in (2, 1)), 3)
        .compile()
    )
    assert compiled.memory_analysis().temp_size_in_bytes >= cache.nbytes


def test_decode_speed_record(mesh8):
    """The record against what this test computes itself: the bytes by closed form (as in
    `test_step_bytes_by_closed_form`), the rates from the recorded step times at batch 2,
    and the step times within the wall time of the call."""
    import statistics
    import time

    params = model.init_params(CFG, jax.random.key(0))
    t0 = time.perf_counter()
    rec = speed.decode_speed(params, CFG, mesh8, "tree", 40, steps=2, batch=2)
    wall = time.perf_counter() - t0
    assert rec.capacity % 8 == 0 and rec.capacity >= 40 + 2 + 1 and rec.batch == 2
    # Seconds, of the steps themselves: positive, and with the compiling step within the call.
    assert len(rec.step_s) == 2 and all(t > 0 for t in rec.step_s)
    assert 0 < rec.compile_s and rec.compile_s + sum(rec.step_s) < wall
    median = statistics.median(rec.step_s)
    assert rec.median_s == median
    d, hq, hkv, hd, h = CFG.dim, CFG.q_heads, CFG.kv_heads, CFG.head_dim, CFG.hidden
    weights = 4 * (
        CFG.layers * (d * hq * hd * 2 + d * hkv * hd * 2 + 3 * d * h + 2 * d) + d + CFG.vocab * d
    )
    cache = 4 * 2 * CFG.layers * 2 * hkv * rec.capacity * hd
    assert (rec.weight_bytes, rec.cache_bytes) == (weights, cache)
    assert (rec.machine_bytes, rec.per_device_bytes) == (8 * weights + cache, weights + cache // 8)
    roofline = (8 * weights + cache) / (rec.read_gbs * 1e9)
    assert rec.read_gbs > 0 and rec.roofline_s == pytest.approx(roofline, rel=1e-12)
    assert rec.gpu_roofline_s == pytest.approx(
        (weights + cache // 8) / (rec.read_gbs * 1e9), rel=1e-12
    )
    row = rec.as_json()  # what a report records: two tokens per step, one per sequence
    assert row["tokens_per_s"] == pytest.approx(2 / median, rel=1e-12)
    assert row["fraction"] == pytest.approx(roofline / median, rel=1e-12)
    assert row["step_s"] == rec.step_s and row["method"] == "tree" and row["devices"] == 8
    with pytest.raises(ValueError, match="context"):
        speed.synthetic_cache(CFG, 1, 40, 40, mesh8, jax.random.key(0))


@pytest.mark.cpu_only
def test_speed_command(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert (
        cli.main(
            [
                "speed",
                "--contexts",
                "24",
                "--methods",
                "single,tree",
                "--steps",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "roofline ms" in text and "tokens/s" in text
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["records"]] == ["single", "tree"]
    assert all(r["context"] == 24 and r["devices"] in (1, 8) for r in report["records"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["speed", "--contexts", "0"], "--contexts"),
        (["speed", "--methods", "tree,foo"], "'foo'"),
        (["speed", "--steps", "0"], "--steps"),
        (["speed", "--checkpoint", "x.gguf", "--preset", "tiny"], "--preset"),
        (["speed", "--checkpoint", "/nonexistent/model.gguf"], "--checkpoint"),
    ],
)
def test_speed_rejects_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert needle in err[-1]
