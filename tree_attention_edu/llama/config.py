"""The model's sizes and weights: `Config` (with Llama 3.1's `RopeScaling`), the
`PRESETS`, random weights from an explicit PRNG key (`init_params`), and the checks that
weights fit a config (`check_params`).

Weights also come from a Hugging Face Llama checkpoint on disk
(`tree_attention_edu.llama.checkpoint.load_checkpoint`) or a GGUF file
(`tree_attention_edu.llama.gguf_checkpoint.load_gguf`); nothing is trained or downloaded.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from ..core import inputs, validate


def _check_even_head_dim(head_dim: int) -> None:
    if head_dim % 2:
        raise ValueError(
            f"`head_dim` must be even for rotary embeddings (they rotate pairs of "
            f"features), got {head_dim}; use e.g. {head_dim + 1}."
        )


def _params_mismatch(path: str, got: tuple[int, ...] | None, want: tuple[int, ...]) -> None:
    """A model's weights against the shapes its `Config` implies."""
    if got is None:
        raise ValueError(
            f"`params` lacks {path}; build params with `init_params(cfg, key)` for the same `cfg`."
        )
    if got != want:
        raise ValueError(
            f"`params` {path} has shape {got} but `cfg` implies {want}; params "
            f"and cfg must come from the same Config (`init_params(cfg, key)`)."
        )


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's `"llama3"` rescaling of the rotary frequencies (Hugging Face's
    `rope_scaling` / `rope_parameters` with `rope_type: "llama3"`).

    With wavelength `λ = 2π / f` of each inverse frequency `f` and `L` =
    `original_max_position_embeddings`: `f` is kept where `λ < L / high_freq_factor`, divided
    by `factor` where `λ > L / low_freq_factor`, and interpolated between the two in between
    (smoothly in `L / λ`). Llama 3.1 uses factor 8, low 1, high 4, L = 8192.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        validate.check_real(self.factor, "factor", low=1.0, hint="Llama 3.1 uses 8.0")
        validate.check_real(
            self.low_freq_factor,
            "low_freq_factor",
            low=0.0,
            low_open=True,
            hint="Llama 3.1 uses 1.0",
        )
        validate.check_real(
            self.high_freq_factor,
            "high_freq_factor",
            low=float(self.low_freq_factor),
            low_open=True,
            hint="it must exceed low_freq_factor; Llama 3.1 uses 4.0",
        )
        validate.check_int(
            self.original_max_position_embeddings,
            "original_max_position_embeddings",
            example="8192",
        )


@dataclass(frozen=True)
class Config:
    """Model sizes. `hidden` is the SwiGLU width; `q_heads` must be a multiple of `kv_heads`.

    `rope_scaling` is None (plain RoPE) or a `RopeScaling` (Llama 3.1's long-context
    frequencies)."""

    vocab: int = 256
    dim: int = 128
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    hidden: int = 352
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_scale: float = 1.0
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        for name in ("vocab", "dim", "layers", "q_heads", "kv_heads", "head_dim", "hidden"):
            validate.check_int(getattr(self, name), name)
        inputs.check_head_groups(self.q_heads, self.kv_heads)
        _check_even_head_dim(self.head_dim)
        # A base <= 1 gives frequencies >= 1 that grow without bound over the head (1e-300
        # overflows them to inf, and the logits to NaN); real models use 1e4 to 1e6.
        validate.check_real(
            self.rope_theta,
            "rope_theta",
            low=1.0,
            low_open=True,
            hint="the RoPE base, e.g. 500000.0",
        )
        validate.check_real(self.norm_eps, "norm_eps", low=0.0, hint="e.g. 1e-5")
        # Weights of scale s give logits of order s**(2 * layers + 1): past ~100 float32
        # overflows after a few layers.
        validate.check_real(
            self.init_scale,
            "init_scale",
            low=0.0,
            high=100.0,
            low_open=True,
            hint="the weights' scale relative to 1/sqrt(fan_in), e.g. 1.0",
        )
        validate.check_bool(self.tie_embeddings, "tie_embeddings")
        if self.rope_scaling is not None:
            validate.check_instance(
                self.rope_scaling,
                RopeScaling,
                "rope_scaling",
                "None, or RopeScaling(factor=8.0, ...) for Llama 3.1",
            )


PRESETS = {
    "tiny": Config(),
    "small": Config(vocab=4096, dim=512, layers=8, q_heads=8, kv_heads=2, head_dim=64, hidden=1408),
}
"""`tiny` runs a 32k-token context on a laptop CPU; `small` (~30M parameters) shows scale."""

Params = dict[str, Any]
"""A model's weights: `embed`, `layers` (one dict of arrays per layer), `final_norm`, and
`unembed` unless the embeddings are tied (`init_params` builds them)."""


def init_params(cfg: Config, key: Array) -> Params:
    """Random float32 weights from `key`: normal, scaled by 1/sqrt(fan_in), RMSNorm gains 1."""
    check_config(cfg)
    validate.check_prng_key(key)
    keys = iter(jax.random.split(key, 2 + 7 * cfg.layers))

    def dense(shape, fan_in):  # float32 whatever jax_enable_x64 says
        return (cfg.init_scale / math.sqrt(fan_in)) * jax.random.normal(
            next(keys), shape, jnp.float32
        )

    qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layers = [
        dict(
            attn_norm=jnp.ones(cfg.dim, jnp.float32),
            wq=dense((cfg.dim, qd), cfg.dim),
            wk=dense((cfg.dim, kd), cfg.dim),
            wv=dense((cfg.dim, kd), cfg.dim),
            wo=dense((qd, cfg.dim), qd),
            mlp_norm=jnp.ones(cfg.dim, jnp.float32),
            w_gate=dense((cfg.dim, cfg.hidden), cfg.dim),
            w_up=dense((cfg.dim, cfg.hidden), cfg.dim),
            w_down=dense((cfg.hidden, cfg.dim), cfg.hidden),
        )
        for _ in range(cfg.layers)
    ]
    params = dict(
        embed=jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32),
        layers=layers,
        final_norm=jnp.ones(cfg.dim, jnp.float32),
    )
    if not cfg.tie_embeddings:
        params["unembed"] = dense((cfg.dim, cfg.vocab), cfg.dim)
    return params


def check_config(cfg: Config) -> None:
    validate.check_instance(cfg, Config, "cfg", "e.g. Config() or PRESETS['tiny']")


def check_params(params: Params, cfg: Config) -> None:
    """`params` has the structure and shapes `init_params(cfg, ...)` gives."""
    validate.check_instance(params, dict, "params", "build them with init_params(cfg, key)")
    want = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
    got_leaves = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(want)[0]:
        got = got_leaves.get(path)
        _params_mismatch(
            jax.tree_util.keystr(path),
            None if got is None else tuple(getattr(got, "shape", ())),
            tuple(leaf.shape),
        )
        dtype = getattr(got, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"`params` {jax.tree_util.keystr(path)} has dtype {dtype}; the "
                "weights must be floating (float32, bfloat16, ...): cast them, "
                "e.g. `jax.tree.map(lambda x: x.astype(jnp.float32), params)`."
            )
