"""A Hugging Face `config.json` (`LlamaConfig`) read into `config.Config`, and written back.

Both spellings of the rotary embedding's settings are read: transformers 4's `rope_theta`
with `rope_scaling`, and transformers 5's `rope_parameters`. Every value is checked for its
type and range before a `Config` is built, and whatever the model cannot represent exactly
(biases, another activation or rope type, partial rotary) is refused, naming the key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..core import validate
from .config import Config, RopeScaling, check_config

MAX_JSON_BYTES = 64 << 20  # config.json is ~1 KB, a 400-shard index ~100 KB


def read_json(file: Path) -> dict:
    """A JSON object from `file` (config.json or a shard index), at most `MAX_JSON_BYTES`."""
    try:
        if file.stat().st_size > MAX_JSON_BYTES:
            raise ValueError(f"{file.stat().st_size:,} bytes, more than {MAX_JSON_BYTES:,}")
        data = json.loads(file.read_text())
    # ValueError: also an integer of more than 4300 digits; RecursionError: deep nesting
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise not_hf_json(file, err) from None
    if not isinstance(data, dict):
        raise not_hf_json(file)
    return data


def config_from_hf(config: dict, where: str = "config.json") -> Config:
    """`model.Config` of a Hugging Face `LlamaConfig` dict (config.json's contents).

    Reads `vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
    `num_attention_heads`, `num_key_value_heads` (default: the attention heads), `head_dim`
    (default `hidden_size / num_attention_heads`), `rms_norm_eps` (default 1e-6),
    `tie_word_embeddings` (default false), and the rope: `rope_theta` (default 10000) with
    `rope_scaling`, or transformers 5's `rope_parameters`; `rope_type` "default" or "llama3".
    Biases, activations other than SiLU, and other rope types are refused with a clear error.
    """
    validate.check_instance(config, dict, "config", "the parsed contents of config.json")
    validate.check_instance(where, str, "where", "a name for messages, e.g. the folder")
    model_type = config.get("model_type", "llama")
    if model_type != "llama":
        raise _config_unsupported(
            where, "model_type", model_type, 'Llama checkpoints (model_type "llama")'
        )

    def get(key, kind, default=None, minimum=None):
        return _config_value(config, key, where, kind, default, minimum)

    if get("hidden_act", "str", "silu") != "silu":
        raise _config_unsupported(where, "hidden_act", config["hidden_act"], 'SwiGLU MLPs ("silu")')
    for key in ("attention_bias", "mlp_bias"):
        if get(key, "bool", False):
            raise _config_unsupported(where, key, True, "Llama layers without biases")
    heads = get("num_attention_heads", "int")
    kv_heads = get("num_key_value_heads", "int", heads)
    hidden_size = get("hidden_size", "int")
    head_dim_given = config.get("head_dim") is not None
    _check_config_heads(where, heads, kv_heads, hidden_size, head_dim_given)
    head_dim = get("head_dim", "int", hidden_size // heads)
    if head_dim % 2:
        raise _config_unsupported(
            where, "head_dim", head_dim, "an even head_dim (rotary embeddings rotate pairs)"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise _config_unsupported(where, "rope_parameters", rope, "a dict or null")
    theta = _config_value(
        rope, "rope_theta", where, "real", get("rope_theta", "real", 10000.0, 0.0), 0.0
    )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _config_unsupported(
            where, "partial_rotary_factor", rope["partial_rotary_factor"], "1.0 (full rotary)"
        )
    if rope_type not in ("default", "llama3"):
        raise _config_unsupported(
            where, "rope_type", rope_type, '"default" and "llama3" rotary embeddings'
        )
    sizes = dict(
        vocab=get("vocab_size", "int"),
        dim=hidden_size,
        layers=get("num_hidden_layers", "int"),
        q_heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=get("intermediate_size", "int"),
        rope_theta=float(theta),
        norm_eps=float(get("rms_norm_eps", "real", 1e-6)),
        tie_embeddings=get("tie_word_embeddings", "bool", False),
    )
    try:  # Config and RopeScaling check the values' ranges
        if rope_type == "llama3":
            max_pos = get("max_position_embeddings", "int", 8192)
            sizes["rope_scaling"] = RopeScaling(
                factor=float(_config_value(rope, "factor", where, "real")),
                low_freq_factor=float(_config_value(rope, "low_freq_factor", where, "real")),
                high_freq_factor=float(_config_value(rope, "high_freq_factor", where, "real")),
                original_max_position_embeddings=_config_value(
                    rope, "original_max_position_embeddings", where, "int", max_pos
                ),
            )
        return Config(**sizes)
    except (ValueError, TypeError) as err:
        if str(err).startswith("`config.json`"):
            raise
        raise _config_invalid(where, err) from None


def config_to_hf(cfg: Config) -> dict:
    """The config.json of `cfg` (a `LlamaConfig` that transformers 4 and 5 both read)."""
    check_config(cfg)
    rope_scaling: dict[str, Any] | None = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.q_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": max(
            8192, 2 * (rope_scaling or {}).get("original_max_position_embeddings", 0)
        ),
    }


def not_hf_json(
    file: Path, err: Exception | None = None, what: str = "a JSON object"
) -> ValueError:
    """`file` (config.json or the shard index) could not be read as `what`."""
    why = f" ({' '.join(str(err).split())})" if err is not None else ""
    return ValueError(
        f"`{file.name}` in {str(file.parent)!r} is not {what}{why}; it must be "
        f"the file a Hugging Face checkpoint saves."
    )


def _config_value(
    config: dict, key: str, where: str, kind: str, default: Any = None, minimum: float | None = None
) -> Any:
    """`config[key]` of a config.json as `kind` ("int", "real", "bool" or "str"); `default`
    when absent (None: the key is required). Ints must be >= `minimum` (default 1); reals
    > `minimum` when it is given."""
    if key not in config or config[key] is None:
        if default is None:
            raise ValueError(
                f'`config.json` in {where!r} lacks "{key}"; a Llama config '
                f"names vocab_size, hidden_size, intermediate_size, "
                f"num_hidden_layers and num_attention_heads."
            )
        return default
    value = config[key]
    if kind == "real":  # an int too large for a float (JSON allows 10**400) is not finite
        ok = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and (isinstance(value, float) or abs(value) < 2**1023)
            and math.isfinite(value)
        )
    else:
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "bool": isinstance(value, bool),
            "str": isinstance(value, str),
        }[kind]
    if kind == "int" and ok:  # below 2**53: any size a real model has, exact in JSON
        ok = (1 if minimum is None else minimum) <= value < 2**53
    elif kind == "real" and ok and minimum is not None:
        ok = value > minimum
    if not ok:
        want = {
            "int": f"an int >= {1 if minimum is None else int(minimum)} and < 2**53",
            "real": "a finite number" + (f" > {minimum:g}" if minimum is not None else ""),
            "bool": "true or false",
            "str": "a string",
        }[kind]
        shown = validate.describe(value) if len(repr(value)) > 60 else repr(value)
        raise ValueError(f'`config.json` in {where!r}: "{key}" must be {want}, got {shown}.')
    return value


def _config_invalid(where: str, err: Exception) -> ValueError:
    """A config.json value that `model.Config` or `model.RopeScaling` refused."""
    return ValueError(f"`config.json` in {where!r}: {err}")


def _config_unsupported(where: str, key: str, value: Any, supported: str) -> ValueError:
    return ValueError(
        f'`config.json` in {where!r}: "{key}" is {value!r}, which this '
        f"loader does not support; it reads {supported}."
    )


def _check_config_heads(
    where: str, q_heads: int, kv_heads: int, hidden: int, head_dim_given: bool
) -> None:
    """Grouped-query attention needs kv heads dividing the query heads; without an explicit
    head_dim, the heads must divide hidden_size."""
    if q_heads % kv_heads:
        raise ValueError(
            f"`config.json` in {where!r}: num_attention_heads ({q_heads}) must be "
            f"a multiple of num_key_value_heads ({kv_heads}) (grouped-query "
            f"attention: each kv head serves a whole group of query heads)."
        )
    if not head_dim_given and hidden % q_heads:
        raise ValueError(
            f"`config.json` in {where!r}: hidden_size ({hidden}) is not a "
            f"multiple of num_attention_heads ({q_heads}), and no head_dim is "
            f'given; add "head_dim" or fix the head count.'
        )
