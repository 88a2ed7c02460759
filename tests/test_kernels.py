"""The streaming xla kernel against the reference; kernel selection; the flash adapter.

The flash adapter's layout handling is checked with a stand-in kernel.

flash-attn-jax runs only on CUDA; here a pure-JAX stand-in with its exact output contract
(`out [B, Tq, Hq, D]` in the input dtype, `lse` float32 `[B, Hq, Tq]`) checks that the
adapter transposes and casts correctly. On a GPU the real kernel takes its place.
"""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand_qkv, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import np_attention_state

from tree_attention_edu import kernels, memory_stats, states


def test_auto_picks_xla_on_cpu():
    assert kernels.resolve("auto", dtype=jnp.bfloat16, head_dim=64, v_dim=64,
                           needs_mask=False) == "xla"


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
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: object())
    assert match in kernels.flash_unsupported_reason(backend="gpu", **kw)


def test_flash_not_installed_message(monkeypatch):
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)
    reason = kernels.flash_unsupported_reason(jnp.bfloat16, 64, 64, False, backend="gpu")
    assert "pip install 'tree_attention_edu[flash]'" in reason


def test_flash_adapter_layout(monkeypatch):
    def fake_fwd(q, k, v, softmax_scale, is_causal, window_size):
        out, lse, _ = np_attention_state(q, k, v, scale=softmax_scale)
        return jnp.asarray(out, q.dtype), jnp.asarray(lse.transpose(0, 2, 1), jnp.float32)

    flash = types.ModuleType("flash_attn_jax.flash")
    flash._flash_mha_fwd = fake_fwd
    monkeypatch.setitem(sys.modules, "flash_attn_jax", types.ModuleType("flash_attn_jax"))
    monkeypatch.setitem(sys.modules, "flash_attn_jax.flash", flash)
    q, k, v = rand_qkv(0, Dv=8, dtype=jnp.bfloat16)
    state = kernels.flash_state(q, k, v)
    out, lse, _ = np_attention_state(q, k, v)
    assert state.lse.shape == (2, 3, 4) and state.out.dtype == jnp.float32
    np.testing.assert_allclose(state.lse, lse, rtol=1e-6)
    np.testing.assert_allclose(state.out, out, atol=2e-2)


# --- the streaming xla kernel ------------------------------------------------------------

def _as_layout(x, layout):
    return kernels.to_layout(jnp.asarray(x), "bthd", layout)


@settings(max_examples=25)
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
    got = kernels.xla_state(q, _as_layout(k, layout), _as_layout(v, layout), kv_offset=offset,
                            causal=causal, kv_lengths=lengths, layout=layout, block=block)
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
    np.testing.assert_allclose(big.out, np_attention_state(q * 300, k * 300, v)[0],
                               **tol(jnp.float32))
    # Every key masked: the exact identity state.
    empty = kernels.xla_state(q, kk, vv, layout=layout, kv_lengths=np.array([0, 0]), block=16)
    assert np.all(np.asarray(empty.out) == 0) and np.all(np.isneginf(empty.lse))
    # bf16 inputs accumulate in float32.
    b16 = kernels.xla_state(*(x.astype(jnp.bfloat16) for x in (q, kk, vv)), layout=layout)
    assert b16.out.dtype == jnp.float32


def test_xla_state_copies_nothing_cache_sized():
    """Compiled temp memory of a decode step stays far below the size of the cache."""
    q, k, v = rand_qkv(8, B=1, Tq=1, Hq=8, Hkv=8, D=64, Dv=64, Tk=8192, dtype=jnp.float32)
    kv_bytes = k.nbytes + v.nbytes
    for layout in kernels.LAYOUTS:
        kk, vv = _as_layout(k, layout), _as_layout(v, layout)
        fn = jax.jit(lambda q, k, v, layout=layout: kernels.xla_state(q, k, v, layout=layout))
        temp = memory_stats(fn, q, kk, vv).temp_bytes
        assert temp <= 0.05 * kv_bytes, (layout, temp, kv_bytes)
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
