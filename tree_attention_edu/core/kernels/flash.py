"""flash-attn-jax's FlashAttention-2 forward on a CUDA GPU, as a forward-only local kernel.

It returns the log-sum-exp the tree merge needs. It takes fp16/bf16, head_dim ≤ 256,
`Dv == D`, and no key mask, so it serves shards that are fully valid (no `kv_lengths`, and
no causal mask over several queries). The lse comes from flash-attn-jax's internal
`flash_attn_jax.flash_fwd.flash_mha_fwd` (the public `flash_mha` returns none), so only the
tested release line is accepted. (Until the second GPU lease this adapter called
`flash_attn_jax.flash._flash_mha_fwd`, a name that no release from 0.5.4 to 0.6.2 has: it
had never run. The H200 found it; results/gpu/README.md.) flash-attn-jax defines no
derivative for that call, so `flash_state` refuses differentiation with a clear error rather
than returning a wrong or missing gradient; use `local_kernel="cudnn"` or `"xla"` to
differentiate.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from .. import inputs
from ..names import Layout
from ..states import AttentionState
from . import common

TESTED = ("0", "6")
"""flash-attn-jax release line (0.6.x) whose internal `flash_fwd.flash_mha_fwd` `flash_state`
calls (read from 0.6.2's source: `(q, k, v, *, softmax_scale, is_causal, window_size_left,
window_size_right) -> (out [B, Tq, Hq, D], lse float32 [B, Hq, Tq])`)."""
MODULE, FORWARD = "flash_attn_jax.flash_fwd", "flash_mha_fwd"
INSTALL = "`pip install 'tree_attention_edu[flash]'`"


def installed() -> bool:
    """flash-attn-jax can be imported (whatever its version)."""
    if "flash_attn_jax" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("flash_attn_jax") is not None
    except (ImportError, ValueError):
        return False


def version_reason() -> str | None:
    """Why the installed flash-attn-jax cannot be used, or None if it can.

    An internal name can change in any release, so only the tested 0.6.x line is accepted. A
    copy without package metadata (a source tree on `sys.path`) passes here, and
    `flash_state` still checks that the name exists. A copy that is installed but cannot be
    imported (`import_error`) cannot be used either.
    """
    from importlib import metadata

    if not installed():
        return (
            f"local_kernel='flash' needs flash-attn-jax, which is not installed: {INSTALL} "
            f"(it pins jax<0.9 and needs CUDA), or use local_kernel='xla' or 'cudnn'."
        )
    try:
        version = metadata.version("flash-attn-jax")
    except metadata.PackageNotFoundError:
        return import_error()
    if tuple(version.split(".")[:2]) == TESTED:
        return import_error()
    return (
        f"local_kernel='flash' is tested with flash-attn-jax {'.'.join(TESTED)}.x "
        f"only (it calls the internal `{MODULE}.{FORWARD}` for the "
        f"log-sum-exp), but {version} is installed; {INSTALL} installs the tested release, "
        f"or use local_kernel='xla'."
    )


def import_error() -> str | None:
    """Why an installed flash-attn-jax cannot be imported, or None if it can. A wheel can be
    installed and still fail to load: on the H200 of the second GPU lease
    (results/gpu/README.md), flash-attn-jax 0.6.2 needed `libcudart.so.12` beside JAX's CUDA
    13, and without this check "auto" would have picked it there and failed. A failed import
    is tried again at the next call (Python caches only a module that loaded)."""
    try:
        importlib.import_module("flash_attn_jax")
    except Exception as e:  # an ImportError, or whatever a native module's init raises
        return (
            f"flash-attn-jax is installed but cannot be imported ({type(e).__name__}: "
            f"{e}); use local_kernel='xla' or 'cudnn', or install a build for this "
            f"machine's CUDA."
        )
    return None


def available() -> bool:
    """flash-attn-jax (the tested release) is importable and the backend is a CUDA GPU."""
    return common.default_backend() == "gpu" and version_reason() is None


def unsupported_reason(
    dtype: Any, head_dim: int, v_dim: int, needs_mask: bool, backend: str | None = None
) -> str | None:
    """Why the flash kernel cannot run this problem, or None if it can."""
    backend = common.default_backend() if backend is None else backend
    if backend != "gpu":
        return (
            f"local_kernel='flash' needs a CUDA GPU, but JAX's default backend is "
            f"{backend!r}; use local_kernel='xla' (or 'auto', which picks xla here)."
        )
    if not installed():
        return version_reason()
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return (
            f"local_kernel='flash' takes float16 or bfloat16 inputs, got "
            f"{jnp.dtype(dtype)}; cast q, k, v or use local_kernel='xla'."
        )
    if head_dim > 256 or v_dim != head_dim:
        return (
            f"local_kernel='flash' needs head_dim <= 256 and v_dim == head_dim, got "
            f"head_dim={head_dim}, v_dim={v_dim}; use local_kernel='xla'."
        )
    if needs_mask:
        return (
            "local_kernel='flash' cannot mask keys: this call has `kv_lengths` or a "
            "causal mask over several queries; use local_kernel='xla' (or 'auto')."
        )
    return version_reason()


def layout_reason(layout: str) -> str:
    return (
        f"local_kernel='flash' reads the 'bthd' `layout`, got layout={layout!r}; "
        f"use local_kernel='xla'."
    )


def forward_only(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn`, with a VJP that refuses differentiation with a clear error (for kernels whose
    library defines no derivative: a missing rule must not become a silent zero)."""

    @jax.custom_vjp
    def wrapped(*args):
        return fn(*args)

    def fwd(*args):
        return fn(*args), None

    def bwd(_res, _g):
        raise TypeError(
            f"{name} is forward-only: its library defines no derivative, so it cannot be "
            f"differentiated. Use local_kernel='cudnn' (exact gradients through out and lse) "
            f"or local_kernel='xla' under jax.grad."
        )

    wrapped.defvjp(fwd, bwd)
    return wrapped


def flash_state(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array = 0,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    layout: Layout = "bthd",
) -> AttentionState:
    """FlashAttention-2 forward on an unmasked "bthd" shard: `AttentionState` in float32.

    It masks nothing, so it refuses `kv_lengths` and a causal mask over several queries
    (a single causal query at the end of the cache sees every key, which needs no mask);
    `kv_offset` only places the shard and changes nothing here. Forward-only: under
    `jax.grad` it raises (see the module docstring).
    """
    inputs.check_kv_offset(kv_offset)  # places the shard only: checked, then unused
    inputs.check_layout(layout)
    if layout != "bthd":
        raise ValueError(layout_reason(layout))
    dims = inputs.check_qkv(q, k_chunk, v_chunk, kv_lengths)
    if kv_lengths is not None or (causal and dims.q_len > 1):
        raise ValueError(
            "local_kernel='flash' cannot mask keys, so it refuses `kv_lengths` "
            "and `causal=True` with more than one query; use local_kernel='xla' "
            "or 'cudnn' for masked shards."
        )
    scale = inputs.resolve_scale(scale, q.shape[-1], q.dtype)
    reason = version_reason()
    if reason:
        raise RuntimeError(reason)
    _forward_fn()  # the internal name it calls must be there: said here, not when traced
    return flash_core(
        q,
        k_chunk,
        v_chunk,
        kv_offset=kv_offset,
        scale=scale,
        causal=bool(causal),
        kv_lengths=None,
        layout=layout,
    )


def flash_core(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array,
    scale: float,
    causal: bool,
    kv_lengths: Array | None,
    layout: Layout,
) -> AttentionState:
    """`flash_state` without its checks, on an unmasked "bthd" shard (`kv_lengths` None, no
    causal mask over several queries; `kv_offset`, `causal` and `layout` are accepted for
    the kernels' common signature). The decoders call this on arguments they checked once,
    at their own door (`kernels.resolve` checks flash can run)."""
    return forward_only(partial(_run, _forward_fn(), scale), "local_kernel='flash'")(
        q, k_chunk, v_chunk
    )


def _forward_fn() -> Callable[..., Any]:
    """flash-attn-jax's forward, imported lazily (CUDA-only, an optional extra)."""
    module = importlib.import_module(MODULE)
    forward = getattr(module, FORWARD, None)  # internal: see `version_reason`
    if forward is None:
        raise RuntimeError(
            "local_kernel='flash' calls flash-attn-jax's internal "
            f"`{MODULE}.{FORWARD}` (tested with flash-attn-jax "
            f"{'.'.join(TESTED)}.x), and the installed flash-attn-jax has no such name; "
            f"{INSTALL} installs the tested release, or use local_kernel='xla'."
        )
    return forward


def _run(forward: Callable[..., Any], scale: float, q: Array, k: Array, v: Array) -> AttentionState:
    out, lse = forward(
        q, k, v, softmax_scale=scale, is_causal=False, window_size_left=-1, window_size_right=-1
    )
    # flash returns out [B, Tq, Hq, D] in the input dtype and lse float32 [B, Hq, Tq].
    return AttentionState.from_lse(out.astype(jnp.float32), jnp.transpose(lse, (0, 2, 1)))
