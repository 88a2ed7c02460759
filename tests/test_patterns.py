"""Merge patterns and the fair rings: exact against the float64 reference, and what they
move and keep, read from the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded, rand_qkv, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from reference import np_attention
from test_decode import HARD_CASES

import tree_attention_edu as tae
from tree_attention_edu.core import kernels, merges
from tree_attention_edu.core.states import AttentionState
from tree_attention_edu.perf import costmodel, introspect


def _merge(name):
    def run(q, k, v, **kw):
        return tae.tree_decode(q, k, v, merge=name, **kw)

    run.__name__ = f"tree_decode[{name}]"
    return padded(run)


DECODERS = {
    **{m: _merge(m) for m in tae.MERGES},
    "ring": padded(tae.ring_decode),
    "ring_pass_q": padded(tae.ring_decode_pass_q),
}


@st.composite
def problems(draw):
    """Shapes, GQA groups, head counts that the 8 devices do not divide, ragged lengths and
    causal blocks; every drawn problem runs on one of the two meshes."""
    B, Tq = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    Hkv, G = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3]))
    Tk = draw(st.integers(1, 40))
    lengths = draw(st.none() | st.lists(st.integers(0, Tk), min_size=B, max_size=B))
    return (
        dict(B=B, Tq=Tq, Hq=Hkv * G, Hkv=Hkv, Tk=Tk, D=4, Dv=3),
        dict(causal=draw(st.booleans()), kv_lengths=None if lengths is None else np.array(lengths)),
        draw(st.sampled_from(["mesh8", "mesh2x4"])),
        draw(st.integers(0, 2**16)),
    )


@settings(max_examples=2)  # random shapes; tests/test_differential.py holds the grid
@given(problems())
def test_every_pattern_is_exact(request, problem):
    shape, kw, mesh_name, seed = problem
    mesh = request.getfixturevalue(mesh_name)
    q, k, v = rand_qkv(seed, **shape)
    want = np_attention(q, k, v, **kw)
    for name, decoder in DECODERS.items():
        got = decoder(q, k, v, mesh=mesh, **kw)
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, **tol(jnp.float64), err_msg=name)


@pytest.mark.parametrize("case", ["long_shards", "mqa", "causal_ragged"])
def test_pass_q_ring_hard_cases(case, mesh2x4):
    """The pass-Q ring's kernel reads a window of kv heads: shards longer than a block, one
    kv head for 8 devices (7 of 8 query blocks are padding), causal with ragged lengths
    (whole shards masked: the differential grid's lengths 0 and mid-shard)."""
    shape, kw = HARD_CASES[case]
    q, k, v = rand_qkv(sorted(HARD_CASES).index(case), **shape)
    out = DECODERS["ring_pass_q"](q, k, v, mesh=mesh2x4, **kw)
    np.testing.assert_allclose(out, np_attention(q, k, v, **kw), **tol(jnp.float64))


@pytest.mark.parametrize("name", ["reduce_scatter", "all_to_all"])
def test_head_scattered_output_stays_on_its_devices(name, mesh8):
    """With heads divisible by p, each device keeps its own heads: the result is sharded over
    heads, and nothing gathers it."""
    q, k, v = rand_qkv(1, B=1, Tq=1, Hq=16, Hkv=4, Tk=64)
    out = tae.tree_decode(q, k, v, mesh=mesh8, merge=name)
    assert out.sharding.spec[2] in ("x", ("x",))
    assert {s.data.shape[2] for s in out.addressable_shards} == {2}
    np.testing.assert_allclose(out, np_attention(q, k, v), **tol(jnp.float64))


@pytest.mark.codegen
def test_one_pass_falls_back_exactly_past_its_window(mesh8):
    """Logits near 1e4 put every lse outside float32's window around the shared shift: the
    flag is raised and the exact two-collective merge runs, bit for bit."""
    q, k, v = rand_qkv(2, Tk=64, dtype=jnp.float32)
    low, high = merges.one_pass_window(jnp.float32, 8)
    lse = np.asarray(tae.local_state(q, k, v, scale=1e3).lse)
    assert ((lse < low) | (lse > high)).any()  # these logits leave the window
    huge = dict(mesh=mesh8, scale=1e3)
    fallback = tae.tree_decode(q, k, v, merge="one_pass", **huge)
    np.testing.assert_array_equal(fallback, tae.tree_decode(q, k, v, merge="allreduce", **huge))
    inside = tae.tree_decode(q, k, v, mesh=mesh8, merge="one_pass")
    np.testing.assert_allclose(inside, np_attention(q, k, v), **tol(jnp.float32))


@pytest.mark.codegen
@pytest.mark.parametrize(("value", "shift"), [(1e5, 77.0), (1e-6, -79.0), (1.0, 85.9)])
def test_one_pass_window_counts_the_outputs(value, shift, mesh8):
    """Weights that are normal numbers are not enough: `e^x · out` must be too, and so must
    the reciprocal of their sum. With every lse at `shift` and outputs of 1e5 the numerator
    overflowed (inf); with outputs of 1e-6 it flushed to 0; with outputs of 1 to 2 at 85.9
    the sum of 8 weights (1.7e38) is finite but its reciprocal is subnormal, and XLA's
    N · (1/L) read 0. The window now includes each row's `|out|` and the reciprocal, so all
    three fall back to the exact merge and agree with the float64 reference."""
    B, Tk, H, D = 1, 64, 2, 4
    q = jnp.zeros((B, 1, H, D), jnp.float32)  # equal scores: lse = shift exactly
    k = jnp.zeros((B, Tk, H, D), jnp.float32)
    rng = np.random.default_rng(0)
    v = jnp.asarray(value * (1 + rng.random((B, Tk, H, D))), jnp.float32)
    lse = np.log(Tk / 8)  # each device's lse at zero scores
    # Move every score to `shift - lse` (so each device's lse is `shift`) through one key
    # feature that is 1 everywhere.
    k = k.at[..., 0].set(1.0)
    q = q.at[..., 0].set(np.float32(shift - lse))
    got = tae.tree_decode(q, k, v, mesh=mesh8, merge="one_pass", scale=1.0)
    want = np.asarray(v, np.float64).mean(axis=1, keepdims=True)
    assert np.all(np.isfinite(np.asarray(got))) and np.all(np.asarray(got) != 0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6)


def test_one_pass_window_is_where_every_term_stays_normal():
    """At the window's ends each term of the sums, `e^x·out`, is at least `tiny/ε` (so a
    partial sum that cancels below `tiny` is below the sum's rounding), p of them do not
    overflow, and the reciprocal of p weights is normal (derived in `one_pass_window`);
    each bound is reached by one of the cases."""
    for dtype in (jnp.float32, jnp.float64):
        info = np.finfo(dtype)
        for out_min, out_max in ((1.0, 1.0), (1e-3, 1e3)):
            low, high = merges.one_pass_window(dtype, 8, out_max=out_max, out_min=out_min)
            # in logs, so that float64's own bounds can be checked in float64
            assert low + np.log(out_min) >= np.log(info.tiny) - np.log(info.eps) - 1e-12
            assert high + np.log(8) + np.log(out_max) <= np.log(info.max) + 1e-12
            assert high + np.log(8) + np.log(info.tiny) <= 1e-12
    low, high = merges.one_pass_window(jnp.float32, 8)
    # ln(tiny) + ln(1/eps) = -87.34 + 15.94 at the bottom; 1/L binds at the top (85.26);
    # each moved 2^-8 inward for the test's own rounding
    assert (round(low, 3), round(high, 3)) == (-71.39, 85.253)
    assert round(merges.one_pass_window(jnp.float32, 8, out_max=1e3)[1], 2) == 79.73


def test_auto_asks_the_policy_it_is_given(mesh8):
    """The core asks the policy it is given, and by default the cost model's."""
    q, k, v = rand_qkv(3, B=1, Tq=1, Hq=4, Hkv=2, Tk=32)
    problem = merges.MergeProblem(1, 1, 4, 2, 8, 6, 32, jnp.dtype(jnp.float64), (8,))
    chosen = costmodel.auto_merge(problem)
    assert chosen == costmodel.best_merge(
        32,
        costmodel.DGX_H100.with_devices(8),
        batch=1,
        q_heads=4,
        kv_heads=2,
        head_dim=8,
        v_dim=6,
        itemsize=8,
        q_len=1,
        stat_itemsize=8,
        patterns=merges.AUTO_MERGES,
    )
    assert merges.resolve_merge("auto", problem) == chosen
    np.testing.assert_allclose(
        tae.tree_decode(q, k, v, mesh=mesh8, merge="auto"),
        np_attention(q, k, v),
        **tol(jnp.float64),
    )
    seen = []
    picked = lambda p: seen.append(p) or "allgather"  # noqa: E731
    assert merges.resolve_merge("auto", problem, picked) == "allgather" and seen == [problem]
    np.testing.assert_allclose(
        tae.tree_decode(q, k, v, mesh=mesh8, merge="auto", merge_policy=picked),
        np_attention(q, k, v),
        **tol(jnp.float64),
    )
    assert len(seen) == 2  # the decoder asked the policy it was given
    with pytest.raises(ValueError, match="auto merge policy returned 'ring'"):
        merges.resolve_merge("auto", problem, lambda p: "ring")
    with pytest.raises(TypeError, match="merge_policy"):
        tae.tree_decode(q, k, v, mesh=mesh8, merge="auto", merge_policy=42)


def test_who_decides_auto_is_named_in_the_core():
    """`merge="auto"` without a policy asks the function `merges.DEFAULT_POLICY` names: the
    cost model's, found from the core in one hop (and imported only then)."""
    assert merges.default_policy() is costmodel.auto_merge


def test_merge_names_are_the_cost_models():
    assert tuple(tae.MERGES) == costmodel.MERGES


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
@pytest.mark.parametrize("q_heads", [16, 12])
def test_collective_bytes_equal_the_cost_model(mesh_name, q_heads, request):
    """Every pattern's collectives, read from the compiled program, move exactly the bytes
    the cost model counts (the one-pass merge's exact fallback, a conditional, apart)."""
    mesh = request.getfixturevalue(mesh_name)
    p, B, Tq, Hkv, D, Tk = 8, 2, 1, 4, 16, 256
    q, k, v = introspect.structs(
        mesh, Tk, batch=B, q_len=Tq, q_heads=q_heads, kv_heads=Hkv, head_dim=D
    )
    # float32 inputs (`structs`' default): statistics and outputs of 4 bytes.
    sizes = dict(
        batch=B,
        q_len=Tq,
        q_heads=q_heads,
        v_dim=D,
        p=p,
        stat_itemsize=4,
        out_itemsize=4,
        levels=len(mesh.axis_names),
    )
    for name in tae.MERGES:
        stats = introspect.collective_stats(
            lambda q, k, v, name=name: tae.tree_decode(q, k, v, mesh=mesh, merge=name), q, k, v
        )
        model = costmodel.merge_collectives(name, **sizes)
        assert stats.fast_path().total_bytes == sum(b * n for _, b, n in model), name
        assert sorted({c.kind for c in stats.fast_path().collectives}) == sorted(
            {kind for kind, _, _ in model}
        ), name
    ring = dict(batch=B, kv_heads=Hkv, head_dim=D, v_dim=D, p=p, itemsize=4)
    for fn, model in (
        (tae.ring_decode, costmodel.ring_collectives(**ring, kv_len=Tk, q_len=Tq, q_heads=q_heads)),
        (
            tae.ring_decode_pass_q,
            costmodel.pass_q_collectives(**ring, q_len=Tq, q_heads=q_heads, stat_itemsize=4),
        ),
    ):
        stats = introspect.collective_stats(lambda q, k, v, fn=fn: fn(q, k, v, mesh=mesh), q, k, v)
        assert stats.total_bytes == sum(b * n for _, b, n in model), fn.__name__


def test_one_pass_fallback_is_marked_conditional(mesh8):
    q, k, v = introspect.structs(mesh8, 64, q_heads=4, head_dim=8)
    stats = introspect.collective_stats(
        lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh8, merge="one_pass"), q, k, v
    )
    plain = introspect.collective_stats(
        lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh8), q, k, v
    )
    assert [c.kind for c in stats.fast_path().collectives] == ["all-reduce"]
    fallback = [c for c in stats.collectives if c.conditional]
    assert sum(c.total_bytes for c in fallback) == plain.total_bytes
    assert "(if)" in str(stats)


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_fair_ring_and_streaming_energy_memory(layout, mesh8):
    """The scan ring holds the block in use and the one in flight, no more; the energy path
    streams the shard like tree_decode (compile-only: nothing is allocated)."""
    Tk, H, D = 8 * 2048, 4, 64
    q, k, v = introspect.structs(mesh8, Tk, q_heads=H, head_dim=D, layout=layout)
    shard = 2 * (Tk // 8) * H * D * 8  # K and V of one device, float64
    block = 2 * kernels.DEFAULT_BLOCK * H * D * 8  # the kernel's transposed K and V block

    def temp(fn):
        return introspect.memory_stats(
            lambda q, k, v: fn(q, k, v, mesh=mesh8, layout=layout), q, k, v
        ).temp_bytes

    assert temp(tae.ring_decode) <= 2 * shard + block
    # The energy path keeps what tree_decode keeps (the kernel's block) and a few rows of
    # statistics: no copy of the shard (the einsum energy's temp was a whole shard).
    assert temp(tae.tree_decode_from_energy) <= temp(tae.tree_decode) + 0.01 * shard
    # The pass-Q ring's kernel reads each query block's window of heads in place.
    assert temp(tae.ring_decode_pass_q) <= temp(tae.tree_decode) + 0.01 * shard


@pytest.mark.parametrize("layout", ["bthd", "bhtd"])
def test_kv_head_window_reads_those_heads(layout):
    """`xla_state(kv_head_window=(start, count))` is the kernel on the sliced cache."""
    q, k, v = rand_qkv(5, Hq=4, Hkv=2, Tk=300)
    kk, vv = (kernels.to_layout(x, "bthd", layout) for x in (k, v))
    q_block = q[:, :, 2:4]  # the two query heads of kv head 1
    got = kernels.xla_state(
        q_block,
        kk,
        vv,
        layout=layout,
        kv_head_window=(jnp.int32(1), 1),
        kv_lengths=jnp.array([300, 120]),
    )
    want = tae.local_state(q_block, k[:, :, 1:2], v[:, :, 1:2], kv_lengths=jnp.array([300, 120]))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, **tol(jnp.float64))


@pytest.mark.parametrize(
    ("shape", "names"), [(8, ("x",)), ((2, 4), ("node", "gpu")), (6, ("x",)), (3, ("x",))]
)
def test_butterfly_is_a_tree_of_permutes(shape, names):
    """The butterfly merge compiles to `butterfly_rounds(p)` collective-permutes (log2 p for
    a power of two, and one more each way to fold a non-power of two in) and no all-reduce,
    over one or both mesh axes, moving exactly the bytes the cost model counts."""
    mesh = tae.make_mesh(shape, names)
    p, B, Hq, D, Tk = mesh.size, 2, 4, 8, 48
    q, k, v = introspect.structs(mesh, Tk, batch=B, q_heads=Hq, kv_heads=Hq, head_dim=D)
    stats = introspect.collective_stats(
        lambda q, k, v: tae.tree_decode(q, k, v, mesh=mesh, merge="butterfly"), q, k, v
    )
    kinds = [c.kind for c in stats.collectives]
    assert set(kinds) == {"collective-permute"}, kinds
    assert sum(c.count for c in stats.collectives) == costmodel.butterfly_rounds(p)
    assert costmodel.butterfly_rounds(p) == {8: 3, 6: 4, 3: 3}[p]
    model = costmodel.merge_collectives(
        "butterfly", batch=B, q_len=1, q_heads=Hq, v_dim=D, p=p, stat_itemsize=4
    )
    assert stats.total_bytes == sum(b * n for _, b, n in model)


@pytest.mark.codegen
@pytest.mark.parametrize("p", [8, 6, 5])
def test_butterfly_leaves_every_device_the_same_bits(p):
    """Every device ends with the same state, bit for bit (it is declared replicated with
    `check_vma` off), including a row only one device saw and a row no device saw."""
    mesh = tae.make_mesh(p, "x")
    rng = np.random.default_rng(p)
    B, Hq, Dv = 2, 4, 8
    lse = rng.uniform(-30, 30, (p, B, 1, Hq)).astype(np.float32)
    lse[1:, 0, 0, 0] = -np.inf  # seen by device 0 only
    lse[:, 1, 0, 1] = -np.inf  # seen by no device
    stacked = AttentionState(
        jnp.asarray(rng.standard_normal((p, B, 1, Hq, Dv)), jnp.float32),
        jnp.asarray(lse),
        jnp.asarray(rng.uniform(-1e-7, 1e-7, lse.shape), jnp.float32),
    )

    def body(st):
        mine = jax.tree.map(lambda x: x[0], st)
        return jax.tree.map(lambda x: x[None], merges.MERGES["butterfly"](mine, ("x",)))

    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    got = jax.jit(f)(stacked)
    for field in got:
        bits = np.asarray(field).view(np.uint32)
        assert (bits == bits[:1]).all()
    want = merges.MERGES["allgather"]
    ref = jax.jit(
        jax.shard_map(
            lambda st: want(jax.tree.map(lambda x: x[0], st), ("x",)),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P(),
        )
    )(stacked)
    np.testing.assert_allclose(np.asarray(got.out)[0], np.asarray(ref.out), rtol=1e-6, atol=1e-6)
    assert (
        np.isneginf(np.asarray(got.lse)[0, 1, 0, 1]) and np.asarray(got.out)[0, 1, 0, 1].max() == 0
    )


@pytest.mark.codegen
@pytest.mark.parametrize(
    ("shape", "seq_axes"),
    [((2, 3), ("gpu", "node")), ((3, 2), ("gpu", "node")), ((2, 4), ("gpu", "node"))],
)
def test_butterfly_on_axes_out_of_mesh_order(shape, seq_axes):
    """`ppermute` over a tuple of axes numbers devices in the mesh's order, `axis_index` in
    the tuple's: the butterfly must use one numbering. With both (reviewed: a (2, 3) mesh
    with seq_axes ("gpu", "node") read 2.35 off, and on 2x4 the partners combined in
    opposite orders, so the float32 copies differed in up to 57 of 128 elements)."""
    mesh = tae.make_mesh(shape, ("node", "gpu"))
    p = mesh.size
    q, k, v = rand_qkv(p, B=2, Tq=1, Hq=4, Hkv=2, D=8, Dv=8, Tk=4 * p, dtype=jnp.float32)
    n = np.array([4 * p, p + 1])
    out = tae.tree_decode(
        q, k, v, mesh=mesh, seq_axes=seq_axes, kv_lengths=jnp.asarray(n), merge="butterfly"
    )
    np.testing.assert_allclose(
        np.asarray(out, np.float64), np_attention(q, k, v, kv_lengths=n), **tol(jnp.float32)
    )
    copies = [np.asarray(s.data).view(np.uint32) for s in out.addressable_shards]
    assert len(copies) == p and all((c == copies[0]).all() for c in copies)
