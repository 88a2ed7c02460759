"""The pieces of a Llama layer: RMSNorm, rotary position embeddings (`rope`, with Llama
3.1's frequency scaling), the query/key/value projections and the SwiGLU MLP, and
`pack_projections`, which fuses a layer's projections into fewer, larger matrix products.

**Numerics.** Activations are float32 whatever the weights' dtype: bfloat16 weights are
promoted to float32 inside each matrix product. Rotary embeddings follow Hugging Face's
`rotate_half` convention (feature `i` pairs with `i + D/2`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from ..core import validate
from .config import Config, Params, RopeScaling, check_config, check_params


def _check_even_last_axis(head_dim: int, name: str) -> None:
    if head_dim % 2:
        raise ValueError(
            f"`{name}` must have an even last axis (head_dim) for rotary "
            f"embeddings, which rotate pairs of features; got {head_dim}."
        )


def rms_norm(x: Array, gain: Array, eps: float) -> Array:
    """`x / rms(x) · gain` over the last axis; `gain` is `[x.shape[-1]]`, `eps >= 0`."""
    s = validate.check_array(x, "x", kind="float", min_rank=1)
    validate.check_shape(
        validate.check_array(gain, "gain", rank=1, layout="[dim]", kind="float"),
        s[-1:],
        "gain",
        "[x.shape[-1]]",
        "one gain per feature",
    )
    validate.check_real(eps, "eps", low=0.0, hint="e.g. 1e-5")
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def _inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """`1 / theta^(2i / D)` for `i < D/2`, in float64, then Llama 3.1's rescaling (the steps
    of transformers' `_compute_llama3_parameters`)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def rope(x: Array, positions: Array, theta: float, scaling: RopeScaling | None = None) -> Array:
    """Rotary embedding of `x [B, T, H, D]` at integer `positions [B, T]`.

    Feature `i` is rotated together with feature `i + D/2` by the angle `pos · f_i`, with
    `f_i = theta^(-2i/D)` (rescaled by `scaling`, Llama 3.1's `"llama3"` rule): this is
    Hugging Face's `rotate_half` convention, `x · cos + rotate_half(x) · sin`, so Llama
    checkpoints need no permutation of their q/k weights. The frequencies are computed in
    float64 and rounded once to float32; angles and the rotation are float32.
    """
    s = validate.check_array(x, "x", rank=4, layout="[B, T, H, D]", kind="float")
    _check_even_last_axis(s[3], "x")
    validate.check_shape(
        validate.check_array(positions, "positions", kind="int"),
        s[:2],
        "positions",
        "[B, T] (x's first two axes)",
        "one position per token",
    )
    validate.check_real(theta, "theta", low=0.0, low_open=True, hint="the RoPE base, e.g. 1e4")
    if scaling is not None:
        validate.check_instance(
            scaling, RopeScaling, "scaling", "None, or RopeScaling(factor=8.0, ...) for Llama 3.1"
        )
    half = x.shape[-1] // 2
    freqs = jnp.asarray(_inverse_frequencies(2 * half, float(theta), scaling), jnp.float32)
    angles = positions[..., None].astype(jnp.float32) * freqs  # [B, T, D/2]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def swiglu(x: Array, layer: dict[str, Array]) -> Array:
    if "w_gate_up" in layer:  # packed (`pack_projections`): one product, then split
        gate, up = jnp.split(x @ layer["w_gate_up"], 2, axis=-1)
    else:
        gate, up = x @ layer["w_gate"], x @ layer["w_up"]
    return (jax.nn.silu(gate) * up) @ layer["w_down"]


def project_qkv(h: Array, layer: dict[str, Array], cfg: Config) -> tuple[Array, Array, Array]:
    """Queries `[B, T, Hq, D]`, keys and values `[B, T, Hkv, D]` of `h [B, T, dim]`, from
    separate projections or from a packed `wqkv` (`pack_projections`)."""
    B, T, _ = h.shape
    nq, nkv = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if "wqkv" in layer:
        q, k, v = jnp.split(h @ layer["wqkv"], [nq, nq + nkv], axis=-1)
    else:
        q, k, v = h @ layer["wq"], h @ layer["wk"], h @ layer["wv"]
    return (
        q.reshape(B, T, cfg.q_heads, cfg.head_dim),
        k.reshape(B, T, cfg.kv_heads, cfg.head_dim),
        v.reshape(B, T, cfg.kv_heads, cfg.head_dim),
    )


PACKED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
"""The layer weights `pack_projections` concatenates (along their output axis), by name."""


def pack_projections(params: Params, cfg: Config) -> Params:
    """`params` with each layer's query, key and value projections packed into one matrix
    `wqkv [dim, (Hq + 2·Hkv)·D]`, and the gate and up projections into `w_gate_up
    [dim, 2·hidden]` (`PACKED`); every other weight is shared, not copied.

    The same numbers in fewer, larger matrix products: on XLA:CPU, which runs a decode
    step's products one at a time, three products a layer fewer make a one-device SmolLM2
    step at a 4k context about 5% faster (`scripts/decode_variants.py`). `forward`
    and the `Generator` take either form; a one-device `Generator` packs its own copy
    (the packed matrices are new arrays, the size of the five they replace)."""
    check_config(cfg)
    check_params(params, cfg)

    @jax.jit
    def pack(layers):
        return [
            {
                **{
                    n: w
                    for n, w in layer.items()
                    if all(n not in parts for parts in PACKED.values())
                },
                **{
                    name: jnp.concatenate([layer[n] for n in parts], axis=1)
                    for name, parts in PACKED.items()
                },
            }
            for layer in layers
        ]

    return {**params, "layers": pack(params["layers"])}
