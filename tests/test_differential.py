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

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import np_attention, np_attention_grads

import tree_attention_edu as tae
from tree_attention_edu.core import kernels


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
    return {jnp.float64: dict(rtol=1e-12, atol=1e-12),
            jnp.float32: dict(rtol=1e-5, atol=1e-5),
            jnp.bfloat16: dict(rtol=2**-7, atol=2**-7)}[dtype]


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
        yield pytest.param(method, mesh, HEADS[(i + j) % len(HEADS)],
                           DTYPES[(i + 2 * j) % len(DTYPES)], LAYOUTS[(i + j) % 2],
                           id=f"{method}-{mesh}")
    # The shapes that broke the pass-Q ring and that the head-scattered merges pad: every
    # head count where 3 and 8 devices do not divide it.
    for method, mesh, heads in itertools.product(
            ("ring_pass_q", "tree[reduce_scatter]", "tree[all_to_all]"), ("p3", "p8"), HEADS):
        yield pytest.param(method, mesh, heads, jnp.float64, "bthd",
                           id=f"{method}-{mesh}-{heads[0]}x{heads[1]}")


@pytest.mark.parametrize("method, mesh_name, heads, dtype, layout", list(cases()))
def test_grid(method, mesh_name, heads, dtype, layout):
    mesh, seq_axes = make_mesh(mesh_name)
    q, k, v, lengths = problem(heads, dtype, mesh.size)
    want = np_attention(q, k, v, causal=True, kv_lengths=lengths)
    got = METHODS[method](q, to_layout(k, layout), to_layout(v, layout), mesh=mesh,
                          seq_axes=seq_axes, causal=True, kv_lengths=jnp.asarray(lengths),
                          layout=layout)
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
    return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float64) * g),
                    argnums=(0, 1, 2))(q, k, v)


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


@pytest.mark.parametrize("method, mesh_name, heads", [
    ("tree[allreduce]", "2x4[gpu,node]", (6, 3)),
    ("tree[one_pass]", "p4", (3, 3)),
    ("tree[all_to_all]", "p3", (9, 3)),
    ("ring", "p3", (32, 8)),
    ("ring_pass_q", "p3", (32, 8)),
    ("energy", "p2", (9, 3)),
])
def test_decoder_gradients(method, mesh_name, heads):
    """`jax.grad` through each decoder (the xla kernel, merge weights included) equals the
    textbook backward pass of plain attention, in float64."""
    mesh, seq_axes = make_mesh(mesh_name)
    q, k, v, lengths = problem(heads, jnp.float64, mesh.size)
    g = np.random.default_rng(1).standard_normal((*q.shape[:3], v.shape[-1]))
    got = _grads(lambda q, k, v: METHODS[method](
        q, k, v, mesh=mesh, seq_axes=seq_axes, causal=True, kv_lengths=jnp.asarray(lengths),
        local_kernel="xla"), q, k, v, g)
    _check_grads(got, q, k, v, g, lengths, jnp.float64)


def _merged_chunks(kernel, chunks=3):
    """Attention as `combine` of `kernel`'s states of consecutive chunks: the merge weights
    exp(lse_i - lse) carry the lse's gradient, which a kernel must get right."""
    def run(q, k, v, lengths):
        n = k.shape[1] // chunks
        states = [kernel(q, k[:, i * n:(i + 1) * n], v[:, i * n:(i + 1) * n], kv_offset=i * n,
                         causal=True, kv_lengths=lengths) for i in range(chunks)]
        return tae.sequential_reduce(states).out
    return run


@pytest.mark.parametrize("name", ["xla", "cudnn[implementation=xla]"])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_kernel_gradients_through_the_merge(name, dtype):
    """Every local kernel that runs on CPU: gradients through out *and* lse of its states.
    (cuDNN's own backward drops the lse's cotangent; `cudnn_state` adds it back.)"""
    kernel = (kernels.xla_state if name == "xla" else
              lambda *a, **kw: kernels.cudnn_state(*a, implementation="xla", **kw))
    hq, hkv = (6, 3)
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype)
               for s in ((2, 2, hq, 8), (2, 24, hkv, 8), (2, 24, hkv, 8)))
    lengths = np.array([24, 11])
    g = rng.standard_normal((2, 2, hq, 8))
    got = _grads(lambda q, k, v: _merged_chunks(kernel)(q, k, v, jnp.asarray(lengths)),
                 q, k, v, g)
    # JAX's xla implementation of dot_product_attention computes its softmax in float32.
    tol_dtype = jnp.float32 if name != "xla" else dtype
    _check_grads(got, q, k, v, g, lengths, tol_dtype)


def test_flash_refuses_differentiation():
    """A kernel whose library defines no derivative raises under `jax.grad`, naming the
    kernel and what to use instead: never a silent zero."""
    fn = kernels.flash.forward_only(lambda x: jnp.sin(x), "local_kernel='flash'")
    assert float(fn(jnp.float32(0.5))) == pytest.approx(np.sin(0.5))
    with pytest.raises(TypeError, match=r"forward-only.*local_kernel='cudnn'"):
        jax.grad(fn)(jnp.float32(0.5))
