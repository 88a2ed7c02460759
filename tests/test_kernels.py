"""Kernel selection, and the flash adapter's layout handling checked with a stand-in kernel.

flash-attn-jax runs only on CUDA; here a pure-JAX stand-in with its exact output contract
(`out [B, Tq, Hq, D]` in the input dtype, `lse` float32 `[B, Hq, Tq]`) checks that the
adapter transposes and casts correctly. On a GPU the real kernel takes its place.
"""

import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rand_qkv
from reference import np_attention_state

from tree_attention_edu import kernels


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
