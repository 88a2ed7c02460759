"""The streaming xla kernel against the reference; kernel selection; the flash adapter.

The flash adapter's layout handling is checked with a stand-in kernel.

flash-attn-jax runs only on CUDA; here a pure-JAX stand-in with its exact output contract
(`out [B, Tq, Hq, D]` in the input dtype, `lse` float32 `[B, Hq, Tq]`) checks that the
adapter transposes and casts correctly. On a GPU the real kernel takes its place.
"""

import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_ACCELERATOR, rand_qkv, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import np_attention_state

import tree_attention_edu as tae
from tree_attention_edu import memory_stats
from tree_attention_edu.core import decode, kernels, states


@pytest.mark.cpu_only
def test_auto_picks_xla_on_cpu():
    assert (
        kernels.resolve("auto", dtype=jnp.bfloat16, head_dim=64, v_dim=64, needs_mask=False)
        == "xla"
    )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(dtype=jnp.float32, head_dim=64, v_dim=64, needs_mask=False), "float16 or bfloat16"),
        (dict(dtype=jnp.bfloat16, head_dim=512, v_dim=512, needs_mask=False), "head_dim <= 256"),
        (dict(dtype=jnp.bfloat16, head_dim=64, v_dim=32, needs_mask=False), "v_dim == head_dim"),
        (dict(dtype=jnp.bfloat16, head_dim=64, v_dim=64, needs_mask=True), "cannot mask keys"),
    ],
)
def test_flash_limits_on_a_gpu(kw, match, monkeypatch):
    monkeypatch.setattr(kernels.flash.importlib.util, "find_spec", lambda name: object())
    assert match in kernels.flash.unsupported_reason(backend="gpu", **kw)


def test_flash_not_installed_message(monkeypatch):
    monkeypatch.setattr(kernels.flash.importlib.util, "find_spec", lambda name: None)
    reason = kernels.flash.unsupported_reason(jnp.bfloat16, 64, 64, False, backend="gpu")
    assert "pip install 'tree_attention_edu[flash]'" in reason
    q, k, v = rand_qkv(0, Dv=8, dtype=jnp.bfloat16)
    with pytest.raises(RuntimeError, match="needs flash-attn-jax, which is not installed"):
        kernels.flash_state(q, k, v)


def test_flash_adapter_layout(monkeypatch):
    def fake_fwd(q, k, v, *, softmax_scale, is_causal, window_size_left, window_size_right):
        # 0.6.2's signature and shapes (flash_attn_jax/flash_fwd.py): lse is [B, Hq, Tq].
        assert (is_causal, window_size_left, window_size_right) == (False, -1, -1)
        out, lse, _ = np_attention_state(q, k, v, scale=softmax_scale)
        return jnp.asarray(out, q.dtype), jnp.asarray(lse.transpose(0, 2, 1), jnp.float32)

    fwd = types.ModuleType(kernels.flash.MODULE)
    setattr(fwd, kernels.flash.FORWARD, fake_fwd)
    monkeypatch.setitem(sys.modules, "flash_attn_jax", types.ModuleType("flash_attn_jax"))
    monkeypatch.setitem(sys.modules, kernels.flash.MODULE, fwd)
    q, k, v = rand_qkv(0, Dv=8, dtype=jnp.bfloat16)
    state = kernels.flash_state(q, k, v)
    out, lse, _ = np_attention_state(q, k, v)
    assert state.lse.shape == (2, 3, 4) and state.out.dtype == jnp.float32
    np.testing.assert_allclose(state.lse, lse, rtol=1e-6)
    np.testing.assert_allclose(state.out, out, atol=2e-2)


# --- the streaming xla kernel ------------------------------------------------------------

XLA_STATE_JIT = jax.jit(kernels.xla_state, static_argnames=("causal", "layout", "block", "padding"))


def _as_layout(x, layout):
    return kernels.to_layout(jnp.asarray(x), "bthd", layout)


@settings(max_examples=10)
@given(
    layout=st.sampled_from(kernels.LAYOUTS),
    block=st.integers(1, 12),
    tk=st.integers(1, 30),
    tq=st.integers(1, 3),
    group=st.sampled_from([1, 2]),
    causal=st.booleans(),
    offset=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_xla_state_matches_reference(layout, block, tk, tq, group, causal, offset, seed):
    """Any block size (tails, a block longer than the chunk), mask, offset and GQA grouping."""
    q, k, v = rand_qkv(seed, B=2, Tq=tq, Hq=2 * group, Hkv=2, Tk=tk)
    lengths = np.array([offset + tk, offset + tk // 2])  # sequence 1 ends inside the chunk
    # One compiled program per example (eagerly, every primitive of a new shape compiles on
    # its own); `tests/test_jit_native.py` checks eager and jit agree.
    got = XLA_STATE_JIT(
        q,
        _as_layout(k, layout),
        _as_layout(v, layout),
        kv_offset=offset,
        causal=causal,
        kv_lengths=lengths,
        layout=layout,
        block=block,
    )
    # Global positions shift out: the chunk alone with lengths `L - offset` sees the same keys,
    # and under the causal mask query i sits at `L - Tq + i`, i.e. at `L - offset - Tq + i`.
    out, lse, _ = np_attention_state(q, k, v, causal=causal, kv_lengths=lengths - offset)
    np.testing.assert_allclose(got.out, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(got.lse), np.isneginf(lse))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(np.asarray(got.lse)[finite], lse[finite], rtol=1e-12)


@pytest.mark.parametrize("layout", kernels.LAYOUTS)
def test_xla_state_hard_inputs(layout):
    q, k, v = rand_qkv(7, Tk=40, dtype=jnp.float32)
    kk, vv = _as_layout(k, layout), _as_layout(v, layout)
    # Huge logits: no overflow, no NaN.
    big = kernels.xla_state(q * 300, kk * 300, vv, layout=layout, block=16)
    np.testing.assert_allclose(
        big.out, np_attention_state(q * 300, k * 300, v)[0], **tol(jnp.float32)
    )
    # Every key masked: the exact identity state.
    empty = kernels.xla_state(q, kk, vv, layout=layout, kv_lengths=np.array([0, 0]), block=16)
    assert np.all(np.asarray(empty.out) == 0) and np.all(np.isneginf(empty.lse))
    # bf16 inputs accumulate in float32.
    b16 = kernels.xla_state(*(x.astype(jnp.bfloat16) for x in (q, kk, vv)), layout=layout)
    assert b16.out.dtype == jnp.float32


@settings(max_examples=8)
@given(
    layout=st.sampled_from(kernels.LAYOUTS),
    tk=st.integers(1, 30),
    tq=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
    garbage=st.floats(-1e30, 1e30),
    seed=st.integers(0, 2**16),
)
def test_finite_padding_matches_the_reference(layout, tk, tq, group, causal, garbage, seed):
    """`padding="finite"`: only the scores are selected, in one pass where `G·Tq <= D` and
    block by block otherwise; finite padding of any size weighs exactly nothing."""
    q, k, v = rand_qkv(seed, B=2, Tq=tq, Hq=2 * group, Hkv=2, Tk=tk)
    lengths = np.array([tk, tk // 2])
    pad = (np.arange(tk)[None, :] >= lengths[:, None])[:, :, None, None]
    kk, vv = (jnp.where(pad, garbage, x) for x in (k, v))
    got = XLA_STATE_JIT(  # one program per example, as above
        q,
        _as_layout(kk, layout),
        _as_layout(vv, layout),
        causal=causal,
        kv_lengths=lengths,
        layout=layout,
        block=4,
        padding="finite",
    )
    out, lse, _ = np_attention_state(q, k, v, causal=causal, kv_lengths=lengths)
    np.testing.assert_allclose(got.out, out, rtol=1e-12, atol=1e-12)
    finite = np.isfinite(lse)
    np.testing.assert_array_equal(np.isneginf(got.lse), ~finite)
    np.testing.assert_allclose(np.asarray(got.lse)[finite], lse[finite], rtol=1e-12)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_broken_finite_padding_promise_is_nan_never_silent(bad):
    """Non-finite padding under `padding="finite"`: a key's garbage is selected away with its
    score; a value's makes `0·v` NaN, so that sequence's output is NaN, and only its."""
    q, k, v = rand_qkv(3, B=2, Tq=1, Hq=4, Hkv=2, Tk=12, dtype=jnp.float32)
    kk, vv = (kernels.to_layout(x, "bthd", "bhtd") for x in (k, v))
    lengths = np.array([12, 7])
    kv = dict(kv_lengths=lengths, layout="bhtd", padding="finite")
    bad_k = kernels.xla_state(q, kk.at[1, :, 7:].set(bad), vv, **kv)
    exact = kernels.xla_state(q, kk, vv, kv_lengths=lengths, layout="bhtd")
    np.testing.assert_allclose(bad_k.out, exact.out, rtol=1e-6, atol=1e-6)
    bad_v = kernels.xla_state(q, kk, vv.at[1, :, 7:].set(bad), **kv).out
    assert np.isnan(np.asarray(bad_v[1])).all() and np.isfinite(np.asarray(bad_v[0])).all()
    # ...where the default ("any") selects it away and stays exact.
    anyway = kernels.xla_state(
        q, kk, vv.at[1, :, 7:].set(bad), kv_lengths=lengths, layout="bhtd"
    ).out
    np.testing.assert_allclose(anyway, exact.out, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="`padding`"):
        kernels.xla_state(q, kk, vv, kv_lengths=lengths, layout="bhtd", padding="zeros")


@pytest.mark.xfail(
    ON_ACCELERATOR,
    strict=True,
    reason="on a GPU the 'bthd' walk writes cache-sized scratch (measured on an H200: "
    "33,569,344 bytes for a 33,554,432-byte cache; a transpose moved out of the scan, "
    "inferred from the size)",
)
def test_xla_state_copies_nothing_cache_sized():
    """Compiled temp memory of a decode step stays far below the size of the cache."""
    q, k, v = rand_qkv(8, B=1, Tq=1, Hq=8, Hkv=8, D=64, Dv=64, Tk=8192, dtype=jnp.float32)
    kv_bytes = k.nbytes + v.nbytes
    for layout in kernels.LAYOUTS:
        kk, vv = _as_layout(k, layout), _as_layout(v, layout)
        fn = jax.jit(lambda q, k, v, layout=layout: kernels.xla_state(q, k, v, layout=layout))
        temp = memory_stats(fn, q, kk, vv).temp_bytes
        assert temp <= 0.05 * kv_bytes, (layout, temp, kv_bytes)
        for padding in kernels.PADDINGS:  # padded decode: blockwise, or one pass
            fn = jax.jit(
                lambda q, k, v, layout=layout, padding=padding: kernels.xla_state(
                    q, k, v, kv_lengths=jnp.array([5000]), layout=layout, padding=padding
                )
            )
            temp = memory_stats(fn, q, kk, vv).temp_bytes
            assert temp <= 0.05 * kv_bytes, (layout, padding, temp, kv_bytes)
    # ...whereas the plain einsum formulation copies the cache into head-major order.
    assert memory_stats(jax.jit(states.local_state), q, k, v).temp_bytes >= kv_bytes / 2


def test_layout_and_block_errors():
    q, k, v = rand_qkv(0)
    with pytest.raises(ValueError, match=r"`layout` must be one of \('bthd', 'bhtd'\)"):
        kernels.xla_state(q, k, v, layout="thd")
    with pytest.raises(ValueError, match="`block` must be a positive int"):
        kernels.xla_state(q, k, v, block=0)
    with pytest.raises(ValueError, match="reads the 'bthd' `layout`"):
        kernels.flash_state(q, k, v, layout="bhtd")


# --- the cudnn adapter, through JAX's xla implementation of the same call -----------------
# `jax.nn.dot_product_attention`'s xla implementation runs the softmax in float32 even for
# float64 inputs, so the adapter refuses float64 (`test_cudnn_state_refuses_float64`): these
# tests give it float32 inputs and compare with the float64 reference of the same inputs.


_cudnn_jit = jax.jit(
    kernels.cudnn_state, static_argnames=("scale", "causal", "layout", "implementation")
)


def _cudnn(q, k, v, **kw):  # jitted: one compile beats dozens of eagerly dispatched ops
    return _cudnn_jit(q, k, v, implementation="xla", **kw)


def _assert_state(got, out, lse, **tolerance):
    np.testing.assert_array_equal(np.isneginf(got.lse), np.isneginf(lse))
    finite = np.isfinite(lse)
    np.testing.assert_allclose(np.asarray(got.lse)[finite], lse[finite], **tolerance)
    np.testing.assert_allclose(got.out, out, **tolerance)
    # Rows that see nothing are the identity exactly.
    assert np.all(np.asarray(got.out)[~finite] == 0)


@pytest.mark.parametrize("layout", kernels.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_state_matches_reference(layout, causal):
    """Ragged global lengths on a chunk at kv_offset 5, GQA 8/2, Tq = 3 (decode-convention
    causal: query i sits at L - 3 + i); sequence 1 ends before the chunk starts. Keys past
    the lengths hold NaN: they are selected away, never weighed by 0."""
    offset, tc = 5, 20
    q, k, v = rand_qkv(3, B=3, Tq=3, Hq=8, Hkv=2, D=8, Dv=8, Tk=tc, dtype=jnp.float32)
    lengths = np.array([offset + tc, offset - 2, offset + 7])
    valid = (offset + np.arange(tc))[None, :, None, None] < lengths[:, None, None, None]
    kk, vv = (_as_layout(jnp.where(valid, x, jnp.nan), layout) for x in (k, v))
    got = _cudnn(q, kk, vv, kv_offset=offset, causal=causal, kv_lengths=lengths, layout=layout)
    assert got.out.dtype == got.lse.dtype == jnp.float32
    out, lse, _ = np_attention_state(q, k, v, causal=causal, kv_lengths=lengths - offset)
    _assert_state(got, out, lse, **tol(jnp.float32))
    assert np.all(np.isneginf(got.lse[1])) and np.all(np.asarray(got.out[1]) == 0)
    if causal:  # query 0 of sequence 2 sits at 9: it sees local keys 0..4 only
        assert np.isfinite(got.lse[2]).all()
    ref = jax.jit(kernels.xla_state, static_argnames=("causal", "layout"))(
        q, kk, vv, kv_offset=offset, causal=causal, kv_lengths=lengths, layout=layout
    )
    _assert_state(got, np.asarray(ref.out), np.asarray(ref.lse), **tol(jnp.float32))


@pytest.mark.codegen
def test_cudnn_state_without_lengths():
    """No `kv_lengths`: every key holds data, and the chunk ends the sequence (the causal
    queries are its last Tq positions), as for `xla_state`; the offset moves nothing."""
    q, k, v = rand_qkv(4, B=2, Tq=4, Hq=4, Hkv=4, D=8, Dv=8, Tk=9, dtype=jnp.float32)
    for causal in (False, True):
        got = _cudnn(q, k, v, kv_offset=7, causal=causal)
        out, lse, _ = np_attention_state(q, k, v, causal=causal)
        _assert_state(got, out, lse, **tol(jnp.float32))
    # Causal with Tq > 1 hides keys; a single causal query sees them all.
    assert not np.allclose(_cudnn(q, k, v, causal=True).lse, _cudnn(q, k, v).lse)
    one = _cudnn(q[:, -1:], k, v, causal=True)
    np.testing.assert_array_equal(one.lse, _cudnn(q[:, -1:], k, v).lse)


def test_cudnn_chunk_states_combine_to_attention():
    q, k, v = rand_qkv(5, B=2, Tq=2, Hq=8, Hkv=2, D=8, Dv=8, Tk=30, dtype=jnp.float32)
    lengths = np.array([30, 13])
    parts = [
        _cudnn(q, k[:, a : a + 15], v[:, a : a + 15], kv_offset=a, causal=True, kv_lengths=lengths)
        for a in (0, 15)
    ]  # sequence 1 ends in chunk 0
    whole = states.combine(*parts)
    out, lse, _ = np_attention_state(q, k, v, causal=True, kv_lengths=lengths)
    _assert_state(whole, out, lse, **tol(jnp.float32))


def test_cudnn_bf16_lse_cost():
    """What the bf16 lse costs. JAX rounds the lse to the input dtype; the adapter casts it
    to float32, so each chunk's lse carries one bf16 rounding (at most half a spacing: 2^-5
    = 0.031 for an lse in [8, 16)) and a merge weighs the chunks by up to e^0.031 - 1 = 3%
    wrongly.

    bf16 inputs, scores scaled so that each chunk's lse lies in [8.5, 14.5], two chunks of
    256 keys merged, against float64 attention on the same bf16-rounded inputs. Measured on
    CPU (jax 0.10.2, this seed, NumPy's draws): max |lse err| 0.030 (xla_state's float32
    lse: 1.2e-6); merged output max |err| 0.023, of which 0.023 with the bf16 lse and an
    exact out, 7.1e-3 with the bf16 out and an exact lse; xla_state (float32 out and lse)
    1.7e-6. The lse's part is checked against its derived bound, elementwise.
    """
    q, k, v = rand_qkv(6, B=1, Tq=1, Hq=16, Hkv=4, D=64, Dv=64, Tk=512, dtype=jnp.bfloat16)
    scale = 4.0 / 8  # scores ~ N(0, 16): the lse of each chunk of 256 keys is 8.5-14.5
    halves = [(k[:, a : a + 256], v[:, a : a + 256]) for a in (0, 256)]
    cud = [_cudnn(q, kh, vh, scale=scale) for kh, vh in halves]
    xla = [kernels.xla_state(q, kh, vh, scale=scale) for kh, vh in halves]
    assert cud[0].lse.dtype == jnp.float32 and cud[0].out.dtype == jnp.float32
    ref = [np_attention_state(q, kh, vh, scale=scale) for kh, vh in halves]
    lse_ref = np.stack([r[1] for r in ref])
    assert 8 <= lse_ref.min() and lse_ref.max() < 16  # the bf16 spacing there is 2^-4
    lse_err = np.abs(np.stack([np.asarray(c.lse) for c in cud]) - lse_ref)
    half_spacing = float(jnp.finfo(jnp.bfloat16).eps) * 2.0 ** np.floor(np.log2(lse_ref)) / 2
    assert np.all(lse_err <= half_spacing + 1e-5)
    lse_err_xla = np.abs(np.stack([np.asarray(x.lse) for x in xla]) - lse_ref).max()
    assert lse_err_xla <= 1e-5

    def mixed(outs, lses):
        return [
            states.AttentionState.from_lse(jnp.asarray(o, jnp.float32), jnp.asarray(s, jnp.float32))
            for o, s in zip(outs, lses, strict=True)
        ]

    # The lse's part, derived elementwise. Two chunks' weights are w0 = sigmoid(l0 - l1) and
    # 1 - w0; lse errors d0, d1 (each at most its half spacing h) move w0 by at most
    # max sigmoid' * |d0 - d1| <= (h0 + h1) / 4, so the output by that times |o0 - o1|.
    # 1e-5: float32 arithmetic in the merge. (A base-2 lse read as natural, or an lse rounded
    # twice, breaks it.) The bf16 output's part is the bf16 tolerance of O(1) outputs, and
    # the two add up to first order (the cross term is below 1e-4).
    outs = np.stack([r[0] for r in ref])  # [2, B, Tq, Hq, Dv]: exact chunk outputs
    spacing = half_spacing[..., None]  # [2, B, Tq, Hq, 1]
    lse_bound = (spacing[0] + spacing[1]) / 4 * np.abs(outs[0] - outs[1])
    want = np_attention_state(q, k, v, scale=scale)[0]

    def error(parts):
        return np.abs(np.asarray(states.combine(*parts).out, np.float64) - want)

    lse_part = error(mixed([r[0] for r in ref], [c.lse for c in cud]))
    out_part = error(mixed([c.out for c in cud], [r[1] for r in ref]))
    assert np.all(lse_part <= lse_bound + 1e-5)
    assert out_part.max() <= tol(jnp.bfloat16)["atol"]
    err, err_xla = error(cud), error(xla)
    print(
        f"bf16 lse: max |lse err| {lse_err.max():.3g} (xla_state {lse_err_xla:.2g}); merged "
        f"out max |err| {err.max():.3g}: bf16 lse only {lse_part.max():.3g}, bf16 out only "
        f"{out_part.max():.3g}; xla_state {err_xla.max():.3g}"
    )
    assert np.all(err <= lse_bound + out_part + 1e-4)
    # The bound bites: the worst error is a good part of it.
    assert lse_part.max() >= 0.25 * lse_bound.max()
    assert err_xla.max() <= tol(jnp.float32)["atol"]


@pytest.mark.cpu_only
def test_cudnn_state_checks():
    q, k, v = rand_qkv(0, Dv=8, dtype=jnp.float32)  # float64: see the next test
    with pytest.raises(ValueError, match="`implementation` must be one of"):
        kernels.cudnn_state(q, k, v, implementation="triton")
    with pytest.raises(ValueError, match="`v` must have v_dim == head_dim"):
        kernels.cudnn_state(q, k, v[..., :4], implementation="xla")
    with pytest.raises(ValueError, match=r"`local_kernel`='cudnn' needs an NVIDIA GPU.*'cpu'"):
        kernels.cudnn_state(q.astype(jnp.bfloat16), k, v)  # the cudnn implementation, on CPU
    empty = kernels.cudnn_state(q[:, :0], k, v, implementation="xla")
    assert empty.out.shape == (2, 0, 4, 8) and empty.lse.shape == (2, 0, 4)
    assert kernels.KERNELS["cudnn"] is kernels.cudnn_state and "cudnn" in kernels.KERNEL_NAMES


def test_cudnn_state_refuses_float64():
    """`jax.nn.dot_product_attention` runs its softmax in float32 on both implementations,
    so float64 inputs came back as float64 arrays with float32 errors (out 1.3e-7, lse
    3.4e-7 against the float64 reference, where `xla_state` is within 1e-15): refused,
    naming the inputs and `xla_state`. Mixed inputs are refused by their common dtype."""
    q, k, v = rand_qkv(3, Dv=8)
    match = r"`q`, `k` and `v`.*float64.*`xla_state` \(local_kernel='xla'"
    with pytest.raises(ValueError, match=match):
        kernels.cudnn_state(q, k, v, implementation="xla")
    with pytest.raises(ValueError, match=match):
        _cudnn(q.astype(jnp.float32), k, v)  # under jit too: it reads dtypes only
    got = _cudnn(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert got.out.dtype == got.lse.dtype == jnp.float32


# --- choosing a kernel -------------------------------------------------------------------


@pytest.mark.cpu_only
def test_explicit_cudnn_is_refused_off_a_gpu():
    with pytest.raises(
        ValueError,
        match=r"`local_kernel`='cudnn' needs an NVIDIA GPU.*"
        r"use local_kernel='xla'",
    ):
        kernels.resolve("cudnn", dtype=jnp.bfloat16, head_dim=64, v_dim=64, needs_mask=False)


@pytest.fixture
def gpu(monkeypatch):
    """Stand in a CUDA GPU of compute capability `cc` (default Hopper) for `resolve`, with
    or without flash-attn-jax."""

    def make(cc=(9, 0), flash=False):
        monkeypatch.setattr(kernels.common, "default_backend", lambda: "gpu")
        monkeypatch.setattr(kernels.cudnn, "cuda_capability", lambda: cc)
        monkeypatch.setattr(
            kernels.flash.importlib.util, "find_spec", lambda name: object() if flash else None
        )
        if flash:  # installed and importable, as on a machine with a working build
            monkeypatch.setattr(kernels.flash, "import_error", lambda: None)

    return make


AUTO = dict(dtype=jnp.bfloat16, head_dim=128, v_dim=128, needs_mask=False)


@pytest.mark.parametrize(
    ("kw", "cc", "want"),
    [
        ({}, (9, 0), "cudnn"),
        (dict(needs_mask=True), (9, 0), "cudnn"),  # cudnn masks keys
        (dict(dtype=jnp.float16), (8, 0), "cudnn"),
        (dict(dtype=jnp.float32), (9, 0), "xla"),  # cuDNN's flash attention: fp16/bf16 only
        (dict(dtype=jnp.float64), (9, 0), "xla"),
        (dict(head_dim=256, v_dim=256), (9, 0), "cudnn"),
        (dict(head_dim=256, v_dim=256), (8, 0), "xla"),  # 128 before Hopper
        (dict(head_dim=100, v_dim=100), (9, 0), "xla"),  # not a multiple of 8
        (dict(v_dim=64), (9, 0), "xla"),
        (dict(layout="bhtd"), (9, 0), "xla"),  # cudnn would copy the cache; xla streams it
        ({}, None, "xla"),  # a GPU that is not CUDA (ROCm)
    ],
)
def test_auto_on_a_gpu_without_flash(gpu, kw, cc, want):
    gpu(cc)
    assert kernels.resolve("auto", **(AUTO | kw)) == want


def test_auto_prefers_flash_then_cudnn(gpu):
    gpu(flash=True)
    assert kernels.resolve("auto", **AUTO) == "flash"
    assert kernels.resolve("auto", **(AUTO | dict(needs_mask=True))) == "cudnn"
    assert kernels.resolve("cudnn", **AUTO) == "cudnn"
    assert kernels.resolve("cudnn", **(AUTO | dict(layout="bhtd"))) == "cudnn"  # a copy


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(dtype=jnp.float32), "float16 or bfloat16"),
        (dict(dtype=jnp.float64), "float16 or bfloat16.*got float64"),
        (dict(head_dim=12, v_dim=12), "multiple of 8 and <= 256"),
        (dict(v_dim=64), "v_dim == head_dim"),
    ],
)
def test_explicit_cudnn_limits_on_a_gpu(gpu, kw, match):
    gpu()
    with pytest.raises(ValueError, match=match):
        kernels.resolve("cudnn", **(AUTO | kw))


@pytest.mark.cpu_only
def test_decoders_choose_the_kernel_by_the_common_dtype(gpu):
    """The kernels compute in the common dtype of q, k and v, so the decoders choose by it:
    a bfloat16 q with a float64 cache is float64 work, which cudnn refuses (through the
    decoders as through `cudnn_state`) and "auto" gives to xla."""
    mesh = tae.make_mesh(8, "x")
    q, k, v = rand_qkv(0, Dv=8, Tk=16, dtype=jnp.bfloat16)
    gpu()

    def kernel(q, k, v, local_kernel):
        static = dict(seq_axes=None, scale=None, causal=False, layout="bthd")
        plan, _ = decode.make_plan(
            q, k, v, mesh=mesh, kv_lengths=None, local_kernel=local_kernel, **static
        )
        return plan.kernel

    assert kernel(q, k, v, "auto") == kernel(q, k, v, "cudnn") == "cudnn"
    k64, v64 = k.astype(jnp.float64), v.astype(jnp.float64)
    assert kernel(q, k64, v64, "auto") == "xla"
    match = r"`local_kernel`='cudnn' takes float16 or bfloat16.*got float64.*local_kernel='xla'"
    with pytest.raises(ValueError, match=match):
        kernel(q, k64, v64, "cudnn")
    with pytest.raises(ValueError, match=match):  # refused before anything is traced
        tae.tree_decode(q.astype(jnp.float64), k64, v64, mesh=mesh, local_kernel="cudnn")


def test_cudnn_head_dim_limit():
    assert [kernels.cudnn.head_dim_limit(c) for c in [(7, 0), (8, 9), (9, 0), (10, 0), None]] == [
        128,
        128,
        256,
        256,
        128,
    ]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_gradients_keep_float32_sums_and_precision(dtype):
    """The scores of a 16-bit cache multiply its own operands (`xla._scores16`), but q's
    gradient is summed over the blocks in float32 and every backward product runs at
    `PRECISION`. JAX's own derivative of that product summed dq in bf16: 1.7e-2 of
    max|dq| over these 256 blocks, against 1.9e-3 here (helper review of the second lease's
    change); a float64 reference of the same rounded inputs decides."""
    rng = np.random.default_rng(0)
    Tk = 2048
    q0, k0, v0 = (rng.standard_normal(s) for s in ((1, 1, 2, 8), (1, Tk, 1, 8), (1, Tk, 1, 8)))
    wo, wl = rng.standard_normal((1, 1, 2, 8)), rng.standard_normal((1, 1, 2))
    lengths = jnp.array([Tk - 3])

    def loss(q, k, v):
        st = kernels.xla_state(q, k, v, block=8, kv_lengths=lengths)
        return jnp.sum(st.out * wo) + jnp.sum(st.lse * wl)

    q, k, v = (jnp.asarray(x, dtype) for x in (q0, k0, v0))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert [g.dtype for g in grads] == [dtype] * 3
    want = np_grads(loss, q, k, v)
    bound = 4e-3 if dtype == jnp.bfloat16 else 4e-4
    for g, w in zip(grads, want, strict=True):
        assert np.abs(np.asarray(g, np.float64) - w).max() < bound * np.abs(w).max()
    # Every product of float32 operands runs at HIGHEST; only the 16-bit forward does not.
    hlo = jax.jit(jax.grad(loss)).lower(q, k, v).as_text()
    dots = re.findall(r"dot_general .*precision = \[(\w+), \w+\] : \(([^)]*)\)", hlo)
    assert len(dots) >= 4, dots
    for precision, operands in dots:
        assert precision == "HIGHEST" or "f32" not in operands, (precision, operands)


def np_grads(loss, q, k, v):
    """The gradients of `loss` in float64 at the (rounded) 16-bit inputs."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
        return [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(*args)]
