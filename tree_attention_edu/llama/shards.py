"""What each shard of a model's KV cache contributes: the posterior over shards, and the
range of the per-shard lse that decides whether the one-pass merge is safe for a model.

`forward.forward_with_shard_stats` (through `Generator.teacher_force`) gives, at every layer, each
device's local state of its shard summarised per query and head (`forward.ShardStats`). Here:

* `shard_weights`: `w_i = exp(lse_i - lse)` with `lse = log Σ_i exp(lse_i)`, the weight
  of shard `i`'s partial output in the merged attention: the posterior probability that
  the attended key lies in shard `i` (an empty shard weighs 0);
* `lse_profile`: a prompt teacher-forced in chunks, reduced to per-layer, per-head ranges;
* `one_pass_verdict`: those ranges against `core.merges.one_pass_window` (FlashDecoding++
  fixes one shift per model from such a profile).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from jax.typing import DTypeLike
from numpy.typing import ArrayLike

from ..core import merges, validate
from .cache import empty_cache
from .generator import Generator, check_prompts


def shard_weights(lse: ArrayLike, axis: int = 1) -> np.ndarray:
    """`exp(lse_i - logsumexp_i lse)` along `axis` (the shards; axis 1 of a `ShardStats`
    field `[layers, p, ...]`), in float64: they sum to 1 wherever some shard is non-empty,
    an empty shard (`lse = -inf`) weighs 0, and rows with every shard empty are all 0.
    Shifted by the row's largest lse, so lse values of any size give no overflow."""
    x = np.asarray(lse, np.float64)
    top = np.max(x, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(x - top)  # exp(-inf) = 0 for empty shards
    total = e.sum(axis=axis, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


PROFILE_FIELDS = ("shard_lse_min", "shard_lse_max", "lse_min", "lse_max", "high", "low", "out_max")


def lse_profile(
    gen: Generator,
    ids: Sequence[int] | np.ndarray,
    chunk: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Teacher-force the prompt `ids [T]` through `gen` (tree, ring or single) in chunks of
    `chunk` tokens, and reduce each layer's `ShardStats` over positions and shards to
    `[layers, q_heads]` float64 arrays:

    * `shard_lse_min`, `shard_lse_max`: the range of the finite per-shard lse;
    * `lse_min`, `lse_max`: the range of the full lse, `log Σ_i exp(lse_i)`;
    * `high`: the largest `lse_i + ln max(max|out_i|, 1)`, and `low`: the smallest
      `lse_i + ln min(min|out_i| (nonzero), 1)`: the two quantities `one_pass_combine`
      holds to its window (with shift 0);
    * `out_max`: the largest `|out_i|`.

    `progress(first, last)` is called after each chunk when given."""
    validate.check_instance(gen, Generator, "gen", "a model.Generator")
    # Checked: an id outside the vocabulary embeds as NaN, and its rows would drop out of
    # the profile without a word.
    ids = np.asarray(check_prompts([ids], gen.cfg.vocab)[0])
    validate.check_int(chunk, "chunk")
    capacity = -(-len(ids) // chunk) * chunk
    cache = empty_cache(gen.cfg, 1, capacity, gen.mesh)
    shape = (gen.cfg.layers, gen.cfg.q_heads)
    acc = {
        "shard_lse_min": np.full(shape, np.inf),
        "shard_lse_max": np.full(shape, -np.inf),
        "lse_min": np.full(shape, np.inf),
        "lse_max": np.full(shape, -np.inf),
        "high": np.full(shape, -np.inf),
        "low": np.full(shape, np.inf),
        "out_max": np.zeros(shape),
    }
    for c in range(0, len(ids), chunk):
        _, cache, stats = gen.teacher_force(cache, ids[None, c : c + chunk])
        lse, big, small = (np.asarray(x, np.float64)[:, :, 0] for x in stats)  # [L, p, T, H]
        seen = np.isfinite(lse)
        full = np.logaddexp.reduce(lse, axis=1)  # [L, T, H]
        acc["shard_lse_min"] = np.minimum(
            acc["shard_lse_min"], np.where(seen, lse, np.inf).min(axis=(1, 2))
        )
        acc["shard_lse_max"] = np.maximum(
            acc["shard_lse_max"], np.where(seen, lse, -np.inf).max(axis=(1, 2))
        )
        acc["lse_min"] = np.minimum(acc["lse_min"], full.min(axis=1))
        acc["lse_max"] = np.maximum(acc["lse_max"], full.max(axis=1))
        with np.errstate(divide="ignore"):
            high = lse + np.log(np.maximum(big, 1.0))
            low = lse + np.log(np.minimum(small, 1.0))
        acc["high"] = np.maximum(acc["high"], np.where(seen, high, -np.inf).max(axis=(1, 2)))
        acc["low"] = np.minimum(acc["low"], np.where(seen, low, np.inf).min(axis=(1, 2)))
        acc["out_max"] = np.maximum(acc["out_max"], big.max(axis=(1, 2)))
        if progress is not None:
            progress(c, min(c + chunk, len(ids)) - 1)
    return acc


def one_pass_verdict(
    profile: dict[str, np.ndarray], p: int, dtype: DTypeLike = np.float32, shift: float = 0.0
) -> dict[str, float | bool]:
    """Is `merges.one_pass_combine` with this fixed `shift` exact on every row the profile
    saw, for `p` devices? Its fast path needs, per row, `lse_i - shift + ln max(|out_i|, 1)
    <= min(ln(max), -ln(tiny)) - ln p` and `lse_i - shift + ln min(|out_i|, 1) >=
    ln(tiny/ε)`, each bound `merges.WINDOW_MARGIN` inside (`merges.one_pass_window`); past
    either it falls back to the exact two-collective merge.

    Returns the window `(low, high)` for outputs of size one, the profile's extremes, the
    headroom on each side (`top_margin`, `bottom_margin`, positive when inside), `safe`,
    and `centred_shift`: the shift that leaves equal headroom on both sides."""
    validate.check_int(p, "p")
    low, high = merges.one_pass_window(dtype, p)
    top = float(np.max(profile["high"]))
    bottom = float(np.min(profile["low"]))
    top_margin = high - (top - shift)
    bottom_margin = (bottom - shift) - low
    return {
        "window_low": low,
        "window_high": high,
        "high": top,
        "low": bottom,
        "shift": float(shift),
        "top_margin": top_margin,
        "bottom_margin": bottom_margin,
        "safe": bool(top_margin >= 0 and bottom_margin >= 0),
        "centred_shift": (top + bottom) / 2 - (high + low) / 2,
        "span": top - bottom,
        "window_span": high - low,
        "ln_p": math.log(p),
    }
