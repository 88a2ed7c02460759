"""cuDNN's flash attention through JAX itself, as a local kernel with exact gradients.

`jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)` returns
the output and the log-sum-exp a merge needs; no extra dependency and no cap on the JAX
version. Its backward pass, however, ignores the residual's cotangent: the lse it returns
carries no gradient, so `jax.grad` through merged partial states (whose weights are
`exp(lse_i - lse)`) would be silently wrong. `cudnn_state` therefore has its own VJP:

* the output's cotangent goes through the library's backward (cuDNN's, on a GPU);
* the lse's cotangent `g` adds `∂lse/∂s = P` row-scaled by `g` to the scores' cotangent,
  computed by JAX's autodiff of the same masked log-sum-exp in plain XLA (one more pass
  over K, on the backward pass only, and only when the lse's cotangent is not zero).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
from jax import Array
from jax.typing import DTypeLike

from .. import inputs, masks, validate
from ..names import Layout
from ..numerics import PRECISION_NAME, accum_dtype, logsumexp
from ..reference import scaled_scores
from ..states import AttentionState
from . import common
from .common import swap_layout

Implementation = Literal["cudnn", "xla"]
IMPLEMENTATIONS: tuple[Implementation, ...] = get_args(Implementation)
"""`implementation` values of `cudnn_state`: "cudnn" on an NVIDIA GPU; "xla", JAX's own
implementation of the same call, runs anywhere (how the adapter is tested on CPU), in float16,
bfloat16 or float32 (its softmax is float32: no float64)."""


def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of the first device, e.g. (9, 0) on an H100; None if it is not a
    CUDA device (a CPU, a TPU, a ROCm GPU)."""
    try:
        cc = jax.devices()[0].compute_capability
    except (AttributeError, RuntimeError):
        return None
    try:
        major, minor, *_ = (int(x) for x in str(cc).split("."))
    except ValueError:
        return None
    return major, minor


def head_dim_limit(capability: tuple[int, int] | None) -> int:
    """Largest head_dim cuDNN's bf16/fp16 flash attention takes: 256 from Hopper (compute
    capability 9.0) on, 128 before (JAX's `check_is_flash_attention`).

    Args:
      capability: the GPU's compute capability `(major, minor)` as ints, or None (unknown).
    """
    if capability is not None and not (
        isinstance(capability, tuple | list)
        and len(capability) == 2
        and all(isinstance(c, int) and not isinstance(c, bool) for c in capability)
    ):
        raise TypeError(
            f"`capability` must be a (major, minor) pair of ints such as (9, 0), "
            f"or None, got {validate.describe(capability)}."
        )
    return 256 if capability is not None and tuple(capability) >= (9, 0) else 128


def unsupported_reason(
    dtype: Any,
    head_dim: int,
    v_dim: int,
    backend: str | None = None,
    capability: tuple[int, int] | None = None,
) -> str | None:
    """Why `local_kernel='cudnn'` cannot run this problem here, or None if it can.

    It needs JAX's default backend to be a CUDA GPU, float16 or bfloat16 inputs, a head_dim
    that is a multiple of 8 and at most `head_dim_limit` of the GPU, and `v_dim ==
    head_dim`. Masks are no objection. `capability` defaults to the first device's.
    """
    backend = common.default_backend() if backend is None else backend
    if backend != "gpu":
        return _needs_gpu(backend)
    if capability is None:
        capability = cuda_capability()
    if capability is None:
        return _needs_gpu("a GPU that is not CUDA")
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return (
            f"`local_kernel`='cudnn' takes float16 or bfloat16 inputs (cuDNN's flash "
            f"attention), got {dt}; cast q, k, v or use local_kernel='xla'."
        )
    limit = head_dim_limit(capability)
    if head_dim % 8 or head_dim > limit or v_dim != head_dim:
        cc = ".".join(str(c) for c in capability)
        return (
            f"`local_kernel`='cudnn' needs head_dim a multiple of 8 and <= {limit} "
            f"(compute capability {cc}) and v_dim == head_dim, got head_dim={head_dim}, "
            f"v_dim={v_dim}; use local_kernel='xla'."
        )
    return None


def _needs_gpu(backend: str) -> str:
    return (
        f"`local_kernel`='cudnn' needs an NVIDIA GPU with cuDNN (it calls "
        f"jax.nn.dot_product_attention(implementation='cudnn')), but JAX's default backend "
        f"is {backend!r}; use local_kernel='xla' (or 'auto', which picks xla here)."
    )


def _check_supported(
    dt: DTypeLike, head_dim: int, v_dim: int, implementation: Implementation
) -> None:
    """Refuse what `dot_product_attention` cannot compute as asked: two head sizes, what
    cuDNN does not take, and float64 (which would come back with float32 errors)."""
    if v_dim != head_dim:
        raise ValueError(
            f"`v` must have v_dim == head_dim for the cudnn kernel "
            f"(jax.nn.dot_product_attention takes one head size), got head_dim={head_dim}, "
            f"v_dim={v_dim}; use local_kernel='xla' (kernels.xla_state)."
        )
    if implementation == "cudnn":
        reason = unsupported_reason(dt, head_dim, v_dim)
        if reason:
            raise ValueError(reason)
    if dt == jnp.float64:
        # dot_product_attention's xla implementation runs its softmax in float32 whatever
        # the inputs (and cuDNN takes no float64): a float64 result would carry float32
        # errors, ~1e-7 instead of ~1e-16. Refused rather than silently imprecise.
        raise ValueError(
            "`q`, `k` and `v` have the common dtype float64, which `cudnn_state` cannot "
            "compute in: jax.nn.dot_product_attention runs its softmax in float32 on both "
            "implementations. Use `xla_state` (local_kernel='xla' in the decoders), which "
            "accumulates in float64, or cast q, k, v to float32."
        )


def cudnn_state(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array = 0,
    scale: float | None = None,
    causal: bool = False,
    kv_lengths: Array | None = None,
    layout: Layout = "bthd",
    implementation: Implementation = "cudnn",
) -> AttentionState:
    """State of one chunk of the cache from `jax.nn.dot_product_attention`, which returns
    the log-sum-exp with `return_residual=True`; through cuDNN's flash attention on an
    NVIDIA GPU (`implementation="cudnn"`), or anywhere through JAX's xla implementation of
    the same call (`implementation="xla"`, how the adapter is tested on CPU).

    Same contract as `xla_state` and `core.states.local_state`, with exact gradients in q,
    k and v through both `out` and `lse` (see the module docstring). What the adapter does:

    * **lse precision.** JAX returns the lse in the input dtype (cuDNN computes it in
      float32; JAX rounds it). A bfloat16 lse near 10 has a spacing of 0.0625: each chunk's
      weight in a merge, `exp(lse_i - lse)`, is off by up to half that, about 3%. The lse is
      cast to float32 here and every merge after this runs in float32, so the cost is one
      rounding per chunk, not one per merge (measured in tests/test_kernels.py).
    * **Masks** go through `key_value_seq_lengths`. `kv_lengths` are global and the chunk
      starts at `kv_offset`, so the chunk's own lengths are `clip(kv_lengths - kv_offset,
      0, Tc)`. The causal mask of this package puts query `i` at `L_b - Tq + i` (the decode
      convention, `core.masks`); `dot_product_attention`'s `is_causal` aligns the diagonal
      top-left instead, so with `causal=True` and `Tq > 1` the exact visibility is passed
      as a boolean `mask [B, 1, Tq, Tc]`. A single causal query sees every valid key.
    * **Rows that see nothing** (a chunk wholly past a length, a causal row before the
      chunk) get whatever the library returns there; they are replaced (`where`) by the
      identity `(0, -inf)` exactly.
    * **Layout.** cuDNN reads "bthd" through this API; a "bhtd" chunk is transposed to it
      first, which is a copy as large as the chunk (use `xla_state` for "bhtd" caches).
    * **GQA** (`Hq` a multiple of `Hkv`) is native. `Dv` must equal `D`. Inputs of mixed
      dtypes are cast to a common one.
    * **No float64.** `dot_product_attention` runs its softmax in float32 on both
      implementations, so float64 inputs would come back as float64 arrays with float32
      errors (1.3e-7 in out, 3.4e-7 in lse, measured on CPU; `xla_state`: 1e-15). A float64
      common dtype is refused (a ValueError that names `xla_state`).
    * **Padding.** cuDNN skips keys past the lengths; the xla implementation would weigh
      them by 0 (0·NaN is NaN), so on it they are selected away first (`where`): masked keys
      may hold anything on both.

    Args:
      implementation: "cudnn" (needs a CUDA GPU, fp16/bf16, head_dim a multiple of 8 and at
        most 128, or 256 on Hopper and later) or "xla" (fp16, bf16 or float32).

    Returns:
      `AttentionState` (`out [B, Tq, Hq, Dv]`, `lse [B, Tq, Hq]`) in float32, the
      accumulation dtype of every dtype it takes.
    """
    dims = inputs.check_qkv(q, k_chunk, v_chunk, kv_lengths, layout=layout)
    kv_offset = inputs.check_kv_offset(kv_offset)
    validate.check_choice(implementation, IMPLEMENTATIONS, "implementation")
    validate.check_bool(causal, "causal")
    scale = inputs.resolve_scale(scale, dims.head_dim, q.dtype)
    dt = jnp.result_type(q.dtype, k_chunk.dtype, v_chunk.dtype)  # what is computed in
    _check_supported(dt, dims.head_dim, dims.v_dim, implementation)
    return cudnn_core(
        q,
        k_chunk,
        v_chunk,
        kv_offset=kv_offset,
        scale=scale,
        causal=bool(causal),
        kv_lengths=None if kv_lengths is None else masks.as_lengths(kv_lengths),
        layout=layout,
        implementation=implementation,
    )


def cudnn_core(
    q: Array,
    k_chunk: Array,
    v_chunk: Array,
    *,
    kv_offset: int | Array,
    scale: float,
    causal: bool,
    kv_lengths: Array | None,
    layout: Layout,
    implementation: Implementation = "cudnn",
) -> AttentionState:
    """`cudnn_state` without its checks: the arguments as `cudnn_state` hands them on
    (`scale` a float, `kv_lengths` int lengths or None). The decoders call this on
    arguments they checked once, at their own door."""
    dt = jnp.result_type(q.dtype, k_chunk.dtype, v_chunk.dtype)
    acc = accum_dtype(dt)
    B, Tq, Hq, D = q.shape
    if B == 0 or Tq == 0:
        return AttentionState(
            jnp.zeros((B, Tq, Hq, D), acc),
            jnp.full((B, Tq, Hq), -jnp.inf, acc),
            jnp.zeros((B, Tq, Hq), acc),
        )
    q, k, v = (jnp.asarray(x) for x in (q, k_chunk, v_chunk))
    q, k, v = (x if x.dtype == dt else x.astype(dt) for x in (q, k, v))
    k, v = swap_layout(k, layout, "bthd"), swap_layout(v, layout, "bthd")  # "bhtd": a copy
    offset = jnp.asarray(kv_offset, jnp.int32)
    out, lse = _state(q, k, v, offset, kv_lengths, scale, causal, implementation)
    return AttentionState(out, lse, jnp.zeros_like(lse))


def _forward(q, k, v, offset, lengths, scale, causal, implementation, residual=True):
    """`(out, lse)` of one "bthd" chunk in the accumulation dtype, empty rows selected to
    `(0, -inf)`; with `residual=False`, the output alone."""
    B, Tq = q.shape[:2]
    Tc = k.shape[1]
    acc = accum_dtype(q.dtype)
    local = mask = None
    if lengths is not None:  # the chunk's own lengths
        local = jnp.clip(lengths - offset, 0, Tc).astype(jnp.int32)
    if causal and Tq > 1:  # decode convention, bottom-right aligned: an explicit mask
        full = masks.full_lengths(B, Tc) + offset if lengths is None else lengths
        vis = masks.visible(Tq, Tc, full, kv_offset=offset, causal=True)  # [B, Tq, Tc]
        mask = vis[:, None]
        seen = jnp.any(vis, axis=-1)  # [B, Tq]
    elif local is not None:
        seen = jnp.broadcast_to((local > 0)[:, None], (B, Tq))
    else:
        seen = None  # every key of the chunk holds data and is visible (Tc >= 1)
    if implementation == "xla" and lengths is not None:
        # JAX's xla implementation weighs keys past the lengths by 0 (and 0·NaN is NaN):
        # select them away first. cuDNN does not read them.
        k = masks.select_valid_keys(k, lengths, offset)
        v = masks.select_valid_keys(v, lengths, offset)
    # The library's xla implementation multiplies at XLA's default precision, which on an
    # NVIDIA GPU rounds float32 operands to TF32: its lse was off by 5e-4 on an H200 (second
    # lease, results/gpu/README.md). Trace it at the package's PRECISION, like every product.
    with jax.default_matmul_precision(PRECISION_NAME):
        result = jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            scale=scale,
            is_causal=False,
            key_value_seq_lengths=local,
            implementation=implementation,
            return_residual=residual,
        )
    if not residual:  # the output alone
        out = result.astype(acc)
        return (
            jnp.where(seen[:, :, None, None], out, jnp.zeros((), acc)) if seen is not None else out
        )
    out, lse = result
    out = out.astype(acc)
    if seen is not None:  # select, never multiply: the library's empty rows may hold NaN
        out = jnp.where(seen[:, :, None, None], out, jnp.zeros((), acc))
    lse = lse.astype(acc)  # the lse comes back in the input dtype
    if seen is not None:
        lse = jnp.where(seen[:, :, None], lse, jnp.asarray(-jnp.inf, acc))
    return out, lse


def _xla_lse(q, k, offset, lengths, scale, causal):
    """The chunk's masked log-sum-exp `[B, Tq, Hq]` in plain XLA: what the lse's cotangent
    is differentiated through."""
    s, mask = scaled_scores(q, k, scale=scale, causal=causal, kv_lengths=lengths, kv_offset=offset)
    return jnp.swapaxes(logsumexp(s, mask), 1, 2)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _state(q, k, v, offset, lengths, scale, causal, implementation):
    return _forward(q, k, v, offset, lengths, scale, causal, implementation)


def _state_fwd(q, k, v, offset, lengths, scale, causal, implementation):
    return _forward(q, k, v, offset, lengths, scale, causal, implementation), (
        q,
        k,
        v,
        offset,
        lengths,
    )


def _state_bwd(scale, causal, implementation, res, cotangents):
    q, k, v, offset, lengths = res
    g_out, g_lse = cotangents
    _, pull_out = jax.vjp(
        lambda q, k, v: _forward(
            q, k, v, offset, lengths, scale, causal, implementation, residual=False
        ),
        q,
        k,
        v,
    )
    dq, dk, dv = pull_out(g_out)
    # The lse's cotangent: ∂lse/∂scores is the softmax, so this is d(lse)·P through the
    # scores, by autodiff of the same masked log-sum-exp. Rows that see nothing have lse
    # -inf and no gradient (the where in `logsumexp` selects them away).
    _, pull_lse = jax.vjp(lambda q, k: _xla_lse(q, k, offset, lengths, scale, causal), q, k)
    dq_lse, dk_lse = pull_lse(g_lse.astype(accum_dtype(q.dtype)))
    acc = accum_dtype(q.dtype)
    dq = (dq.astype(acc) + dq_lse.astype(acc)).astype(q.dtype)
    dk = (dk.astype(acc) + dk_lse.astype(acc)).astype(k.dtype)
    return dq, dk, dv, None, None


_state.defvjp(_state_fwd, _state_bwd)
