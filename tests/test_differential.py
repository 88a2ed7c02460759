"""The differential grid: every decoder and merge pattern against an independent float64
numpy reference (`tests/reference.py`, explicit loops), on the shapes that broke before.

The grid reaches what the earlier suites never did: device counts that do not divide the
kv heads (p = 3 with Hkv = 8, p = 2 with Hkv = 3, p = 8 > Hkv), 2-level meshes with
`seq_axes` in both orders, lengths of 0 and masked slots that hold NaN, causal blocks of
several queries, and float64, float32 and bfloat16. Each (method, mesh) pair compiles once;
head counts, dtypes and layouts rotate over the pairs so that every method meets every
head count, dtype and mesh (a covering design, not the full product, to keep `make test`
short). Gradients are checked the same way, against the textbook backward pass.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from reference import np_attention, np_attention_grads

import tree_attention_edu as tae
from tree_attention_edu.core import kernels, merges
from tree_attention_edu.core.states import AttentionState


def _tree(merge):
    def run(*args, **kw):
        return tae.tree_decode(*args, merge=merge, **kw)

    return run


METHODS = {
    **{f"tree[{m}]": _tree(m) for m in tae.MERGES},
    "ring": tae.ring_decode,
    "ring_pass_q": tae.ring_decode_pass_q,
    "energy": tae.tree_decode_from_energy,
}
MESHES = {  # name -> (mesh shape, axis names, seq_axes)
    "p1": ((1,), ("x",), None),
    "p2": ((2,), ("x",), None),
    "p3": ((3,), ("x",), None),
    "p4": ((4,), ("x",), None),
    "p8": ((8,), ("x",), None),
    "2x4[node,gpu]": ((2, 4), ("node", "gpu"), ("node", "gpu")),
    "2x4[gpu,node]": ((2, 4), ("node", "gpu"), ("gpu", "node")),
}
HEADS = [(32, 8), (9, 3), (6, 3), (3, 3), (1, 1)]
DTYPES = [jnp.float64, jnp.float32, jnp.bfloat16]
LAYOUTS = ["bthd", "bhtd"]
SHARD = 5  # keys per device: lengths end mid-shard and whole shards are masked


def tolerance(dtype) -> dict:
    """Outputs are O(1) means of unit normals. float64: summation order only. float32:
    float32 accumulation over <= 40 keys. bfloat16: the inputs are rounded in the reference
    too, and the output is rounded to bfloat16 once (2^-8 relative). Dropping one device's
    shard moves the output by ~0.1, far outside each."""
    return {
        jnp.float64: dict(rtol=1e-12, atol=1e-12),
        jnp.float32: dict(rtol=1e-5, atol=1e-5),
        jnp.bfloat16: dict(rtol=2**-7, atol=2**-7),
    }[dtype]


def make_mesh(name):
    shape, axes, seq_axes = MESHES[name]
    return tae.make_mesh(shape, axes), seq_axes


def problem(heads, dtype, p, seed=0, masked=True):
    """q `[3, 2, Hq, 8]`, k `[3, Tk, Hkv, 8]`, v `[3, Tk, Hkv, 6]` with Tk = 5p; lengths
    0, mid-shard and full; every key past a length holds NaN (masks must select)."""
    hq, hkv = heads
    tk = SHARD * p
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((3, 2, hq, 8))
    k = rng.standard_normal((3, tk, hkv, 8))
    v = rng.standard_normal((3, tk, hkv, 6))
    lengths = np.array([0, tk // 2 + 1, tk]) if masked else None
    if masked:
        for b, n in enumerate(lengths):
            k[b, n:] = np.nan
            v[b, n:] = np.nan
    q, k, v = (jnp.asarray(x, jnp.float64).astype(dtype) for x in (q, k, v))
    return q, k, v, lengths


def to_layout(x, layout):
    return x if layout == "bthd" else jnp.swapaxes(x, 1, 2)


def cases():
    """Every (method, mesh) pair once, with rotating heads, dtype and layout."""
    for (i, method), (j, mesh) in itertools.product(enumerate(METHODS), enumerate(MESHES)):
        yield pytest.param(
            method,
            mesh,
            HEADS[(i + j) % len(HEADS)],
            DTYPES[(i + 2 * j) % len(DTYPES)],
            LAYOUTS[(i + j) % 2],
            id=f"{method}-{mesh}",
        )
    # The shapes that broke the pass-Q ring and that the head-scattered merges pad: every
    # head count where 3 and 8 devices do not divide it.
    for method, mesh, heads in itertools.product(
        ("ring_pass_q", "tree[reduce_scatter]", "tree[all_to_all]"), ("p3", "p8"), HEADS
    ):
        yield pytest.param(
            method, mesh, heads, jnp.float64, "bthd", id=f"{method}-{mesh}-{heads[0]}x{heads[1]}"
        )


@pytest.mark.parametrize("method, mesh_name, heads, dtype, layout", list(cases()))
def test_grid(method, mesh_name, heads, dtype, layout):
    mesh, seq_axes = make_mesh(mesh_name)
    q, k, v, lengths = problem(heads, dtype, mesh.size)
    want = np_attention(q, k, v, causal=True, kv_lengths=lengths)
    got = METHODS[method](
        q,
        to_layout(k, layout),
        to_layout(v, layout),
        mesh=mesh,
        seq_axes=seq_axes,
        causal=True,
        kv_lengths=jnp.asarray(lengths),
        layout=layout,
    )
    assert got.shape == want.shape and got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **tolerance(dtype))


@pytest.mark.parametrize("method", list(METHODS))
def test_grid_unmasked(method):
    """No lengths and no causal mask: the kernels take their unmasked path."""
    mesh, seq_axes = make_mesh("2x4[gpu,node]")
    q, k, v, _ = problem((6, 3), jnp.float32, mesh.size, masked=False)
    want = np_attention(q, k, v)
    got = METHODS[method](q, k, v, mesh=mesh, seq_axes=seq_axes)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **tolerance(jnp.float32))


# --- gradients ------------------------------------------------------------------------


def _grads(fn, q, k, v, g):
    return jax.grad(
        lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float64) * g), argnums=(0, 1, 2)
    )(q, k, v)


def _check_grads(got, q, k, v, g, lengths, dtype):
    want = np_attention_grads(q, k, v, g, causal=True, kv_lengths=lengths)
    tol = tolerance(dtype)
    for name, a, b in zip("qkv", got, want, strict=True):
        a = np.asarray(a, np.float64)
        if lengths is not None:  # keys past the lengths hold NaN and get no gradient
            valid = np.arange(a.shape[1])[None, :] < np.asarray(lengths)[:, None]
            if name != "q":
                a, b = a[valid], b[valid]
        np.testing.assert_allclose(a, b, **tol, err_msg=f"d{name}")


@pytest.mark.parametrize(
    "method, mesh_name, heads",
    [
        ("tree[allreduce]", "2x4[gpu,node]", (6, 3)),
        ("tree[one_pass]", "p4", (3, 3)),
        ("tree[all_to_all]", "p3", (9, 3)),
        ("ring", "p3", (32, 8)),
        ("ring_pass_q", "p3", (32, 8)),
        ("energy", "p2", (9, 3)),
    ],
)
def test_decoder_gradients(method, mesh_name, heads):
    """`jax.grad` through each decoder (the xla kernel, merge weights included) equals the
    textbook backward pass of plain attention, in float64."""
    mesh, seq_axes = make_mesh(mesh_name)
    q, k, v, lengths = problem(heads, jnp.float64, mesh.size)
    g = np.random.default_rng(1).standard_normal((*q.shape[:3], v.shape[-1]))
    got = _grads(
        lambda q, k, v: METHODS[method](
            q,
            k,
            v,
            mesh=mesh,
            seq_axes=seq_axes,
            causal=True,
            kv_lengths=jnp.asarray(lengths),
            local_kernel="xla",
        ),
        q,
        k,
        v,
        g,
    )
    _check_grads(got, q, k, v, g, lengths, jnp.float64)


def _merged_chunks(kernel, chunks=3):
    """Attention as `combine` of `kernel`'s states of consecutive chunks: the merge weights
    exp(lse_i - lse) carry the lse's gradient, which a kernel must get right."""

    def run(q, k, v, lengths):
        n = k.shape[1] // chunks
        states = [
            kernel(
                q,
                k[:, i * n : (i + 1) * n],
                v[:, i * n : (i + 1) * n],
                kv_offset=i * n,
                causal=True,
                kv_lengths=lengths,
            )
            for i in range(chunks)
        ]
        return tae.sequential_reduce(states).out

    return run


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("xla", jnp.float64), ("xla", jnp.float32), ("cudnn[implementation=xla]", jnp.float32)],
)  # float64 is refused there
def test_kernel_gradients_through_the_merge(name, dtype):
    """Every local kernel that runs on CPU: gradients through out *and* lse of its states.
    (cuDNN's own backward drops the lse's cotangent; `cudnn_state` adds it back.)"""
    kernel = (
        kernels.xla_state
        if name == "xla"
        else lambda *a, **kw: kernels.cudnn_state(*a, implementation="xla", **kw)
    )
    hq, hkv = (6, 3)
    rng = np.random.default_rng(2)
    q, k, v = (
        jnp.asarray(rng.standard_normal(s), dtype)
        for s in ((2, 2, hq, 8), (2, 24, hkv, 8), (2, 24, hkv, 8))
    )
    lengths = np.array([24, 11])
    g = rng.standard_normal((2, 2, hq, 8))
    got = _grads(lambda q, k, v: _merged_chunks(kernel)(q, k, v, jnp.asarray(lengths)), q, k, v, g)
    _check_grads(got, q, k, v, g, lengths, dtype)


def test_flash_refuses_differentiation():
    """A kernel whose library defines no derivative raises under `jax.grad`, naming the
    kernel and what to use instead: never a silent zero."""
    fn = kernels.flash.forward_only(lambda x: jnp.sin(x), "local_kernel='flash'")
    assert float(fn(jnp.float32(0.5))) == pytest.approx(np.sin(0.5))
    with pytest.raises(TypeError, match=r"forward-only.*local_kernel='cudnn'"):
        jax.grad(fn)(jnp.float32(0.5))


# --- merges of handed-in states: the one-pass window, empty rows --------------------------
#
# The merges run inside `shard_map` on states given per device (`[p, B, ...]`, one row of
# the leading axis per device), so that the lse levels, signs and magnitudes the one-pass
# window's derivation covers are reached exactly. The reference merges the same states in
# mpmath at 50 digits: independent of any float unit, so it serves float64 as well as
# float32.


@functools.cache
def _merge_program(name, p):
    """`MERGES[name]` over `p` devices as one jitted program of the stacked states
    `[p, B, Tq, Hq, ·]` (row i for device i); the head-scattered patterns' heads are
    gathered back by the out_specs."""
    mesh = tae.make_mesh(p, "x")
    scattered = name in merges.HEAD_SCATTERED
    heads = P(None, None, "x") if scattered else P()
    out_specs = AttentionState(P(None, None, "x", None) if scattered else P(), heads, heads)

    def body(st):
        return merges.MERGES[name](jax.tree.map(lambda x: x[0], st), ("x",))

    # A butterfly's result is the same on every device but typed varying (ppermutes).
    check = name not in merges.VARYING_REPLICATED
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=out_specs, check_vma=check)
    )


def _merge_on_mesh(name, stacked, p):
    """The merged state, as float64 numpy."""
    return jax.tree.map(lambda x: np.asarray(x, np.float64), _merge_program(name, p)(stacked))


def _exact_merge(lse, lo, out):
    """Merge `[p, R]` lse double words and `[p, R, Dv]` outputs exactly: returns out
    `[R, Dv]` and `cond [R, Dv]`, the rounding-free size `Σ w_i |out_i| / Σ w_i` the error of
    any merge is measured against (a cancelling sum is judged by its terms)."""
    import mpmath

    with mpmath.workdps(50):
        return _exact_merge_50(lse, lo, out, mpmath)


def _exact_merge_50(lse, lo, out, mpmath):
    p, R, Dv = out.shape
    got_out, cond = np.zeros((R, Dv)), np.zeros((R, Dv))
    for r in range(R):
        w = [
            mpmath.exp(mpmath.mpf(float(lse[i, r])) + mpmath.mpf(float(lo[i, r])))
            if np.isfinite(lse[i, r])
            else mpmath.mpf(0)
            for i in range(p)
        ]
        total = sum(w)
        if not total:  # every device empty: nothing to attend
            continue
        for j in range(Dv):
            terms = [w[i] * mpmath.mpf(float(out[i, r, j])) for i in range(p) if w[i]]
            got_out[r, j] = float(sum(terms) / total)
            cond[r, j] = float(sum(abs(t) for t in terms) / total)
    return got_out, cond


def _one_pass_rows(dtype, p, seed=0):
    """Rows `[p, R]` that walk the one-pass window's derivation: levels just inside and just
    outside each end (and the middle), outputs of sizes 1e-20, 1 and 1e20, and signs all
    positive, alternating +1/-0.9 (the numerator cancels to a twentieth of its terms) or
    random; every row's lse has a nonzero low word, as a merged shard's has."""
    low, high = merges.one_pass_window(dtype, p)
    rng = np.random.default_rng(seed)
    lses, outs = [], []
    for level, size, signs in itertools.product(
        (low - 2.0, low + 0.5, 0.0, high - 0.5, high + 0.5),
        (1e-20, 1.0, 1e20) if dtype == jnp.float32 else (1e-150, 1.0, 1e150),
        ("positive", "alternating", "random"),
    ):
        lse = level + rng.uniform(-0.4, 0.0, p)  # all at or below the level
        if signs == "positive":
            out = rng.uniform(1.0, 1.5, (p, 3))
        elif signs == "alternating":
            out = np.where(np.arange(p)[:, None] % 2 == 0, 1.0, -0.9) * np.ones((p, 3))
            lse[:] = level - 0.2  # equal weights: the cancellation is exact, to 0.05
        else:
            out = rng.standard_normal((p, 3))
        lses.append(lse)
        outs.append(size * out)
    lse = np.stack(lses, 1).astype(dtype)
    lo = (rng.uniform(-0.5, 0.5, lse.shape) * np.spacing(np.abs(lse))).astype(dtype)
    return lse, lo, np.stack(outs, 1).astype(dtype)


def _stack_rows(lse, lo, out, batch):
    """`[p, R]` rows as per-device states `[p, B, 1, H]` with `R = B·H`."""
    p, R = lse.shape
    shape = (p, batch, 1, R // batch)
    return AttentionState(
        jnp.asarray(out.reshape(*shape, -1)),
        jnp.asarray(lse.reshape(shape)),
        jnp.asarray(lo.reshape(shape)),
    )


@pytest.mark.codegen
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("p", [2, 8])
def test_one_pass_on_the_window_grid(dtype, p):
    """Every row of the window's grid merged by `one_pass`, one row at a time (each takes its
    own path, fast or exact) and all at once (a batch that mixes rows inside and
    outside the window falls back as a whole): within the merge's rounding bound of the
    exact merge, `(p + 4)·u` times each component's terms (u the unit roundoff).

    Before the window's `ln(1/ε)` the alternating rows just above `ln(tiny)` read 0 where
    the answer is 0.05 times their size; before the split exponent (`states.lse_weight`) a
    row at `|x| ≈ 80` in float32 erred by up to `u·|x|` per weight."""
    lse, lo, out = _one_pass_rows(dtype, p)
    want, cond = _exact_merge(lse, lo, out)
    bound = (p + 4) * float(np.finfo(dtype).eps) / 2 * cond
    rows = lse.shape[1]
    blocks = [slice(0, rows)] + [slice(i, i + 1) for i in range(rows)]
    for rs in blocks:
        got = _merge_on_mesh("one_pass", _stack_rows(lse[:, rs], lo[:, rs], out[:, rs], 1), p)
        err = np.abs(got.out.reshape(-1, out.shape[-1]) - want[rs])
        worst = np.unravel_index(np.argmax(err / bound[rs]), err.shape)
        assert np.all(err <= bound[rs]), (rs, worst, err[worst], bound[rs][worst])


@pytest.mark.codegen
@pytest.mark.parametrize("name", list(merges.MERGES))
def test_merges_ignore_every_field_of_an_empty_state(name):
    """Empty rows as another kernel may hand them over, `(NaN, -inf, NaN)` or with `lse_lo`
    = +inf: every merge ignores them, and a row that every device left empty comes out
    canonical, `(0, -inf, 0)` bit for bit. Before, every merge returned NaN for such rows
    (`e^{-inf + NaN}` is NaN)."""
    p, B, H, Dv = 4, 3, 4, 5
    rng = np.random.default_rng(3)
    lse = rng.uniform(-3, 3, (p, B, 1, H))
    lo = rng.uniform(-1e-17, 1e-17, lse.shape)
    out = rng.standard_normal((p, B, 1, H, Dv))
    empty = rng.random(lse.shape) < 0.4
    empty[:, 0, 0, 0] = True  # a row every device left empty
    empty[0, 1] = empty[1, 1] = False  # rows that two devices see
    lse[empty] = -np.inf
    lo[empty] = np.where(rng.random(empty.sum()) < 0.5, np.nan, np.inf)
    out[empty] = np.nan
    state = AttentionState(*(jnp.asarray(x) for x in (out, lse, lo)))
    got = _merge_on_mesh(name, state, p)
    want, _ = _exact_merge(lse.reshape(p, -1), lo.reshape(p, -1), out.reshape(p, -1, Dv))
    none = empty.all(axis=0)  # [B, 1, H]
    np.testing.assert_allclose(
        got.out[~none], want.reshape(B, 1, H, Dv)[~none], rtol=1e-13, atol=1e-13
    )
    assert np.all(got.out[none] == 0) and np.all(np.isneginf(got.lse[none]))
    assert np.all(got.lse_lo[none] == 0) and np.all(np.isfinite(got.lse[~none]))


@pytest.mark.codegen
def test_combine_of_empty_states_is_canonical_whatever_they_hold():
    """`combine(empty, empty)` is `(0, -inf, 0)` even when both hold NaN in `out` and
    `lse_lo` (it returned `lse_lo = NaN`); `combine(empty, s)` is `s` bit for bit."""
    shape = (2, 1, 3)
    junk = AttentionState(
        jnp.full((*shape, 4), jnp.nan), jnp.full(shape, -jnp.inf), jnp.full(shape, jnp.nan)
    )
    both = tae.combine(junk, junk)
    assert np.all(np.asarray(both.out) == 0) and np.all(np.isneginf(np.asarray(both.lse)))
    np.testing.assert_array_equal(both.lse_lo, np.zeros(shape))
    s = AttentionState(jnp.ones((*shape, 4)), jnp.full(shape, 2.0), jnp.full(shape, 1e-17))
    for merged in (tae.combine(junk, s), tae.combine(s, junk)):
        for x, y in zip(merged, s, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.codegen
@pytest.mark.parametrize(
    ("dtype", "score"), [(jnp.float32, -86.0), (jnp.float32, -87.0), (jnp.float64, -707.0)]
)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_one_pass_cancelling_shards_end_to_end(dtype, score, p):
    """The case an outside hunt found, through `tree_decode`: one key per device, every
    score at `score`, values alternating +1 and -0.9 over the devices. Each term lay inside
    the old window, their sum cancelled into a subnormal that XLA:CPU flushed, and
    `one_pass` returned 0 where the answer is 0.05 (`allreduce` was exact)."""
    q = jnp.ones((1, 1, 1, 1), dtype)
    k = jnp.full((1, p, 1, 1), score, dtype)
    vals = np.where(np.arange(p) % 2 == 0, 1.0, -0.9)
    v = jnp.asarray(vals.reshape(1, p, 1, 1), dtype)
    got = tae.tree_decode(q, k, v, mesh=tae.make_mesh(p, "x"), scale=1.0, merge="one_pass")
    np.testing.assert_allclose(
        float(got[0, 0, 0, 0]), vals.mean(), rtol=4 * float(np.finfo(dtype).eps)
    )


def _one_pass_grads(dtype, level, p=8):
    """`jax.grad` in q of a scalar of `tree_decode`, one_pass and allreduce, with every
    score near `level` (two keys per device, so each lse has a low word)."""
    rng = np.random.default_rng(4)
    q = jnp.ones((1, 1, 2, 2), dtype)
    k = jnp.asarray(level / 2 + rng.uniform(-0.3, 0.3, (1, 2 * p, 2, 2)), dtype)
    v = jnp.asarray(rng.standard_normal((1, 2 * p, 2, 3)), dtype)
    g = jnp.asarray(rng.standard_normal((1, 1, 2, 3)), dtype)
    mesh = tae.make_mesh(p, "x")

    def loss(q, merge):
        return jnp.sum(g * tae.tree_decode(q, k, v, mesh=mesh, scale=1.0, merge=merge))

    return (np.asarray(jax.grad(loss)(q, m), np.float64) for m in ("one_pass", "allreduce"))


@pytest.mark.codegen
@pytest.mark.parametrize(
    ("dtype", "level"),
    [
        (jnp.float32, 60.0),
        (jnp.float32, -60.0),
        (jnp.float32, 95.0),
        (jnp.float64, 400.0),
        (jnp.float64, -400.0),
        (jnp.float64, 750.0),
    ],
)
def test_one_pass_gradients_at_any_level(dtype, level):
    """The one-pass merge's gradient equals the exact merge's inside its window (60, -60 in
    float32; ±400 in float64) and past it (95, 750: the fallback). Its denominators there
    are near e^{±level}: JAX's rule for a division goes through y^-2, which under- or
    overflows, and gave wrong gradients (-2.47 for -3e-6 at 60) or NaN; an overflowed
    weight in the discarded fast sums gave NaN past the window."""
    one, two = _one_pass_grads(dtype, level)
    assert np.all(np.isfinite(one))
    rtol = 1e-4 if dtype == jnp.float32 else 1e-10
    np.testing.assert_allclose(one, two, rtol=rtol, atol=rtol * np.abs(two).max())


@pytest.mark.codegen
@pytest.mark.parametrize("name", list(merges.MERGES))
def test_merge_gradients_ignore_empty_states(name):
    """The gradient of every merge in each device's lse and out, with empty rows that hold
    NaN in out and lse_lo: finite, and 0 for the empty rows (reduce_scatter's was NaN on
    rows that were not empty: the `0·NaN` of a product selected after it)."""
    p, B, H, Dv = 4, 2, 4, 3
    rng = np.random.default_rng(5)
    lse = rng.uniform(-2, 2, (p, B, 1, H))
    out = rng.standard_normal((p, B, 1, H, Dv))
    lo = np.zeros_like(lse)
    lse[0, 0, 0, 0] = -np.inf
    out[0, 0, 0, 0] = np.nan
    lo[0, 0, 0, 0] = np.nan
    program = _merge_program(name, p)

    def loss(lse, out):
        return jnp.sum(program(AttentionState(out, lse, jnp.asarray(lo))).out ** 2)

    d_lse, d_out = jax.grad(loss, argnums=(0, 1))(jnp.asarray(lse), jnp.asarray(out))
    assert np.all(np.isfinite(np.asarray(d_lse))) and np.all(np.isfinite(np.asarray(d_out)))
    assert np.asarray(d_lse)[0, 0, 0, 0] == 0 and np.all(np.asarray(d_out)[0, 0, 0, 0] == 0)


@pytest.mark.codegen
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_one_pass_at_the_top_of_its_window(dtype):
    """Every device's lse exactly at the window's top, and a hair past it with a low word
    that rounds back inside: the merge is exact (the reciprocal of the denominator stays
    normal). Without the window's margin both read 0."""
    p = 8
    high = merges.one_pass_window(dtype, p)[1]
    u = float(np.finfo(dtype).eps) / 2
    for lse_value, lo in (
        (high, 0.0),
        (high + 2**-8, 0.0),
        (high + 2**-8, 0.49 * np.spacing(dtype(high))),
    ):
        lse = np.full((p, 1, 1, 2), lse_value, dtype)
        out = np.ones((p, 1, 1, 2, 2), dtype) * np.array([1.0, 0.5], dtype)
        state = AttentionState(jnp.asarray(out), jnp.asarray(lse), jnp.full(lse.shape, lo, dtype))
        got = _merge_on_mesh("one_pass", state, p).out
        np.testing.assert_allclose(got, np.broadcast_to([1.0, 0.5], got.shape), rtol=(p + 4) * u)
