"""Local decode kernels: the per-device computation of an `AttentionState` for one KV shard.

* `"xla"`: pure JAX (`xla.xla_state`): a streaming, flash-decoding style kernel that reads
  the cache once and makes no copy of it; every backend, dtype, mask and layout.
* `"cudnn"`: cuDNN's flash attention through `jax.nn.dot_product_attention`
  (`cudnn.cudnn_state`), with its own VJP so that gradients through out *and* lse are exact;
  float16 and bfloat16 on a GPU, never float64 (its softmax is float32).
* `"flash"`: flash-attn-jax's FlashAttention-2 forward on a CUDA GPU (`flash.flash_state`):
  unmasked shards only, forward-only.
* `"auto"`: on a CUDA GPU, flash where all of its limits hold and flash-attn-jax (the tested
  release) is installed, else cudnn where its limits hold and the layout is "bthd", else
  xla. On any other backend, xla.

Every kernel has the signature of `core.states.local_state` plus `layout`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import inputs, validate
from ..inputs import LAYOUTS
from ..names import KERNEL_CHOICES, KernelChoice, KernelName, Layout
from ..states import AttentionState
from . import cudnn, flash, xla
from .common import default_backend, to_layout
from .cudnn import cudnn_core, cudnn_state
from .flash import flash_core, flash_state
from .xla import DEFAULT_BLOCK, PADDINGS, xla_core, xla_state

Kernel = Callable[..., AttentionState]
KERNELS: dict[KernelName, Kernel] = {"xla": xla_state, "flash": flash_state, "cudnn": cudnn_state}
"""Local kernels by name (`local_kernel=`): each checks its arguments."""
CORES: dict[KernelName, Kernel] = {"xla": xla_core, "flash": flash_core, "cudnn": cudnn_core}
"""The same kernels without their checks (`xla_core`, ...), for the decoders, which check
their arguments once at their own door: keyword arguments `kv_offset`, `scale` (a float),
`causal`, `kv_lengths` (int lengths or None) and `layout`."""
KERNEL_NAMES: tuple[KernelChoice, ...] = KERNEL_CHOICES


def check_name(name: Any) -> KernelChoice:
    if name not in KERNEL_NAMES:
        raise ValueError(f"`local_kernel` must be one of {KERNEL_NAMES}, got {name!r}.")
    return name


def resolve(
    name: KernelChoice,
    *,
    dtype: Any,
    head_dim: int,
    v_dim: int,
    needs_mask: bool,
    layout: Layout = "bthd",
) -> KernelName:
    """Turn "auto" into a concrete kernel name; check an explicit "flash" or "cudnn" can run.

    "auto" picks, on a CUDA GPU, flash (when `flash.unsupported_reason` has no objection and
    the layout is "bthd"), else cudnn (when `cudnn.unsupported_reason` has none and the
    layout is "bthd": on "bhtd" the cudnn kernel would copy the cache into "bthd" first,
    while xla streams "bhtd" as it lies), else xla; on any other backend, xla. An explicit
    "flash" or "cudnn" that cannot run here raises a ValueError that says why and what to
    use instead.

    `dtype` is the dtype the kernel computes in: the common dtype of q, k and v (the
    decoders pass `jnp.result_type` of the three). flash and cudnn take float16 and
    bfloat16 only, so "auto" gives float32 and float64 to xla, and an explicit "cudnn" or
    "flash" refuses them.
    """
    check_name(name)
    inputs.check_layout(layout)
    validate.check_float_dtype(dtype, "dtype")
    validate.check_int(head_dim, "head_dim")
    validate.check_int(v_dim, "v_dim")
    if name == "xla":
        return name
    if name in ("auto", "flash"):
        why = flash.unsupported_reason(dtype, head_dim, v_dim, needs_mask)
        if why is None and layout != "bthd":
            why = flash.layout_reason(layout)
        if name == "flash":
            if why:
                raise ValueError(why)
            return name
        if why is None:
            return "flash"
    why = cudnn.unsupported_reason(dtype, head_dim, v_dim)
    if name == "cudnn":
        if why:
            raise ValueError(why)
        return name
    return "cudnn" if why is None and layout == "bthd" else "xla"


__all__ = [
    "CORES",
    "DEFAULT_BLOCK",
    "KERNELS",
    "KERNEL_NAMES",
    "LAYOUTS",
    "PADDINGS",
    "Kernel",
    "check_name",
    "cudnn",
    "cudnn_core",
    "cudnn_state",
    "default_backend",
    "flash",
    "flash_core",
    "flash_state",
    "resolve",
    "to_layout",
    "xla",
    "xla_core",
    "xla_state",
]
