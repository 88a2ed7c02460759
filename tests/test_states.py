"""The partial-state monoid: unit tests and hypothesis properties."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand_qkv, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import np_attention

import tree_attention_edu as tae

# lse values that exercise the hard cases: empty chunks (-inf), huge and tiny magnitudes.
# XLA's CPU backend flushes subnormals to zero, so they are left out: exactness is claimed for
# the algebra, not for the float environment.
LSE = st.one_of(
    st.just(-np.inf),
    st.floats(-1e4, 1e4, allow_subnormal=False),
    st.floats(-1e300, 1e300, allow_subnormal=False),
)
OUT = st.floats(-10, 10, allow_subnormal=False)


@st.composite
def states(draw, n=1, size=3):
    out = []
    for _ in range(n):
        o = draw(st.lists(OUT, min_size=size, max_size=size))
        l = draw(st.lists(LSE, min_size=size, max_size=size))
        o = [0.0 if np.isneginf(li) else oi for oi, li in zip(o, l, strict=True)]
        out.append(
            tae.AttentionState.from_lse(
                jnp.array(o).reshape(1, size, 1, 1), jnp.array(l).reshape(1, size, 1)
            )
        )
    return out


@given(states(n=3))
def test_combine_associative(s):
    a, b, c = s
    left, right = tae.combine(tae.combine(a, b), c), tae.combine(a, tae.combine(b, c))
    np.testing.assert_allclose(left.lse, right.lse, rtol=1e-14)
    # An lse of size L is known only to ~L·eps absolutely, and that error enters the weights
    # e^{lse - m} relatively, so the bracketing can move `out` by ~(1 + L)·eps·max|out|
    # (never more than 2·max|out|: out is a convex combination).
    lse = np.concatenate([np.asarray(x.lse).ravel() for x in s])
    outs = np.concatenate([np.asarray(x.out).ravel() for x in s])
    big = 1 + np.abs(lse[np.isfinite(lse)]).max(initial=0)
    atol = min(16 * np.finfo(np.float64).eps * big, 2.0) * np.abs(outs).max()
    np.testing.assert_allclose(left.out, right.out, rtol=0, atol=atol)


COMBINE_JIT = jax.jit(tae.combine)


@pytest.mark.codegen
@given(states(n=2))
def test_combine_commutative_exactly(s):
    """Bit for bit, eagerly and under `jit` (where XLA may fuse a product and a sum into an
    FMA, whose rounding depends on the operands' order)."""
    a, b = s
    for combine in (tae.combine, COMBINE_JIT):
        left, right = combine(a, b), combine(b, a)
        np.testing.assert_array_equal(left.out, right.out)
        np.testing.assert_array_equal(left.lse, right.lse)


@pytest.mark.codegen
@given(states(n=1))
def test_identity_is_exact_and_never_nan(s):
    (a,) = s
    e = tae.identity_state(1, 3, 1, 1, jnp.float64)
    for got in (tae.combine(a, e), tae.combine(e, a)):
        np.testing.assert_array_equal(got.out, a.out)
        np.testing.assert_array_equal(got.lse, a.lse)
    both = tae.combine(e, e)  # (-inf) - (-inf) must not appear
    assert not np.isnan(np.asarray(both.out)).any() and np.all(np.isneginf(both.lse))


@st.composite
def problems(draw):
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    B, Tq, Tk = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    causal = draw(st.booleans())
    lengths = draw(st.one_of(st.none(), st.lists(st.integers(0, Tk), min_size=B, max_size=B)))
    seed = draw(st.integers(0, 2**16))
    return dict(seed=seed, B=B, Tq=Tq, Hq=hq, Hkv=hkv, D=4, Dv=3, Tk=Tk), dict(
        causal=causal, kv_lengths=None if lengths is None else np.array(lengths)
    )


def random_chunks(draw, tk):
    cuts = sorted(draw(st.lists(st.integers(0, tk), max_size=5)))
    bounds = [0, *cuts, tk]
    return [b - a for a, b in itertools.pairwise(bounds)]  # zero-size chunks allowed


@settings(max_examples=8)
@given(problems(), st.data())
def test_tree_reduce_invariant_to_chunking_and_tree_shape(problem, data):
    """Any chunking, any branching, and the sequential order give attention. The batch,
    query and head sizes are fixed here (2, 3, 4 over 2 kv heads: several queries and
    grouped heads), so that `combine` compiles once for all examples; the shapes themselves
    are the differential grid's (tests/test_differential.py)."""
    shape, kw = problem
    shape = {**shape, "B": 2, "Tq": 3, "Hq": 4, "Hkv": 2}
    if kw["kv_lengths"] is not None:
        kw = {**kw, "kv_lengths": np.resize(kw["kv_lengths"], 2)}
    q, k, v = rand_qkv(**shape)
    ref = np_attention(q, k, v, **kw)
    sizes = tuple(random_chunks(data.draw, shape["Tk"]))
    branching = data.draw(st.integers(2, 4))
    for out in _reduce_both(q, k, v, kw["kv_lengths"], sizes, branching, kw["causal"]):
        assert not np.isnan(np.asarray(out)).any()
        np.testing.assert_allclose(out, ref, **tol(q.dtype))


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _reduce_both(q, k, v, kv_lengths, sizes, branching, causal):
    """Tree and sequential reductions of the chunks' states, finalised: one program per
    example (eagerly, each primitive of a new shape compiles on its own, about 5 s an
    example here; tests/test_jit_native.py checks that eager and jit agree)."""
    chunks = tae.chunk_states(q, k, v, list(sizes), causal=causal, kv_lengths=kv_lengths)
    return tae.finalize(tae.tree_reduce(chunks, branching)), tae.finalize(
        tae.sequential_reduce(chunks)
    )


ATTENTION_JIT = jax.jit(tae.attention, static_argnames=("causal",))


@settings(max_examples=6)
@given(problems(), st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_low_precision_agreement(problem, dtype):
    shape, kw = problem
    q, k, v = rand_qkv(**shape, dtype=dtype)
    out = ATTENTION_JIT(q, k, v, **kw)  # one program per example, as above
    np.testing.assert_allclose(
        np.asarray(out, np.float64), np_attention(q, k, v, **kw), **tol(dtype)
    )


def test_chunk_offsets_use_global_positions():
    """A causal chunk in the middle of the cache masks by global, not local, positions."""
    q, k, v = rand_qkv(0, Tq=4)
    full = tae.local_state(q, k, v, causal=True)
    parts = tae.chunk_states(q, k, v, [8, 9], causal=True)
    np.testing.assert_allclose(tae.combine(*parts).lse, full.lse, **tol(q.dtype))


def test_finalize_casts():
    q, k, v = rand_qkv(1)
    s = tae.local_state(q, k, v)
    assert tae.finalize(s, jnp.bfloat16).dtype == jnp.bfloat16
    assert tae.finalize(s) is s.out
