"""Llama checkpoints in the Hugging Face layout: load them into `model.Config` and params.

A checkpoint is a folder:

* `config.json`: `LlamaConfig` (transformers 4 or 5 spelling: `rope_theta` with
  `rope_scaling`, or `rope_parameters`);
* the weights, in `model.safetensors`, or in shards listed by `model.safetensors.index.json`
  (`"weight_map"`: tensor name → file);
* optionally `tokenizer.json`, read with the `tokenizers` package (`load_tokenizer`).

Tensors are read with the `safetensors` package's numpy API (no torch). Names and layouts:

| Hugging Face tensor, stored shape | model param |
|---|---|
| `model.embed_tokens.weight [vocab, dim]` | `embed` |
| `model.layers.{i}.input_layernorm.weight [dim]` | `layers[i]["attn_norm"]` |
| `model.layers.{i}.self_attn.{q,k,v}_proj.weight [heads·head_dim, dim]` | `wq`, `wk`, `wv` (ᵀ) |
| `model.layers.{i}.self_attn.o_proj.weight [dim, q_heads·head_dim]` | `wo` (ᵀ) |
| `model.layers.{i}.post_attention_layernorm.weight [dim]` | `mlp_norm` |
| `model.layers.{i}.mlp.{gate,up}_proj.weight [hidden, dim]` | `w_gate`, `w_up` (ᵀ) |
| `model.layers.{i}.mlp.down_proj.weight [dim, hidden]` | `w_down` (ᵀ) |
| `model.norm.weight [dim]` | `final_norm` |
| `lm_head.weight [vocab, dim]`, absent when tied | `unembed` (ᵀ) |

A `torch.nn.Linear` stores its weight `[out, in]` and computes `y = x Wᵀ`; the model computes
`y = x W` with `W [in, out]`, so Linear weights are transposed (ᵀ) once, at load time. Nothing
else changes: `model.rope` pairs feature `i` with `i + D/2`, which is Hugging Face's
`rotate_half`, so q/k need no permutation, and query head `h` reads kv head
`h // (q_heads // kv_heads)`, which is `repeat_kv`.

Anything the loader cannot map exactly is an error before any weight is read: a missing or
unexpected tensor, a shape that config.json does not imply, a dtype other than F32, BF16,
F16 or F64 (quantised weights), biases, another activation or rope type.
"""

from __future__ import annotations

import json
import math
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import validate
from .model import Config, Params, RopeScaling, check_config, check_params

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"

READABLE = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
            "F16": np.dtype(np.float16), "F64": np.dtype(np.float64)}
"""safetensors dtype names the loader reads, and their numpy dtypes."""

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some old checkpoints saved
_ALIGN = 64  # bytes: lets jax.device_put use a host buffer in place on CPU


class TensorInfo(NamedTuple):
    """Where a stored tensor lives: its `file`, safetensors `dtype` name and `shape`."""

    file: Path
    dtype: str
    shape: tuple[int, ...]


class CheckpointInfo(NamedTuple):
    """What `inspect_checkpoint` found: the model's `cfg`, each tensor's `TensorInfo` by
    Hugging Face name, and the `tokenizer` file (None when there is none)."""

    path: Path
    cfg: Config
    tensors: dict[str, TensorInfo]
    tokenizer: Path | None

    @property
    def num_params(self) -> int:
        """The number of weights (each tensor's size, summed)."""
        return sum(math.prod(t.shape) for t in self.tensors.values())

    @property
    def stored_bytes(self) -> int:
        """Bytes of the weights as stored."""
        return sum(math.prod(t.shape) * READABLE[t.dtype].itemsize
                   for t in self.tensors.values())


# --- names ------------------------------------------------------------------------------------

def _layout(cfg: Config) -> list[tuple[str, tuple, tuple[int, ...], bool]]:
    """(Hugging Face name, params path, stored shape, transpose?) for every weight of `cfg`."""
    qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out: list[tuple[str, tuple, tuple[int, ...], bool]] = [
        ("model.embed_tokens.weight", ("embed",), (cfg.vocab, cfg.dim), False)]
    for i in range(cfg.layers):
        pre = f"model.layers.{i}."
        out += [
            (pre + "input_layernorm.weight", ("layers", i, "attn_norm"), (cfg.dim,), False),
            (pre + "self_attn.q_proj.weight", ("layers", i, "wq"), (qd, cfg.dim), True),
            (pre + "self_attn.k_proj.weight", ("layers", i, "wk"), (kd, cfg.dim), True),
            (pre + "self_attn.v_proj.weight", ("layers", i, "wv"), (kd, cfg.dim), True),
            (pre + "self_attn.o_proj.weight", ("layers", i, "wo"), (cfg.dim, qd), True),
            (pre + "post_attention_layernorm.weight", ("layers", i, "mlp_norm"), (cfg.dim,),
             False),
            (pre + "mlp.gate_proj.weight", ("layers", i, "w_gate"), (cfg.hidden, cfg.dim), True),
            (pre + "mlp.up_proj.weight", ("layers", i, "w_up"), (cfg.hidden, cfg.dim), True),
            (pre + "mlp.down_proj.weight", ("layers", i, "w_down"), (cfg.dim, cfg.hidden), True),
        ]
    out.append(("model.norm.weight", ("final_norm",), (cfg.dim,), False))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", ("unembed",), (cfg.vocab, cfg.dim), True))
    return out


# --- config.json --------------------------------------------------------------------------------

MAX_JSON_BYTES = 64 << 20  # config.json is ~1 KB, a 400-shard index ~100 KB


def _read_json(file: Path) -> dict:
    try:
        if file.stat().st_size > MAX_JSON_BYTES:
            raise ValueError(f"{file.stat().st_size:,} bytes, more than {MAX_JSON_BYTES:,}")
        data = json.loads(file.read_text())
    # ValueError: also an integer of more than 4300 digits; RecursionError: deep nesting
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise _checkpoint_json(file, err) from None
    if not isinstance(data, dict):
        raise _checkpoint_json(file)
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
        raise _config_unsupported(where, "model_type", model_type,
                                         "Llama checkpoints (model_type \"llama\")")

    def get(key, kind, default=None, minimum=None):
        return _config_value(config, key, where, kind, default, minimum)

    if get("hidden_act", "str", "silu") != "silu":
        raise _config_unsupported(where, "hidden_act", config["hidden_act"],
                                         "SwiGLU MLPs (\"silu\")")
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
        raise _config_unsupported(where, "head_dim", head_dim,
                                         "an even head_dim (rotary embeddings rotate pairs)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise _config_unsupported(where, "rope_parameters", rope, "a dict or null")
    theta = _config_value(rope, "rope_theta", where, "real",
                                 get("rope_theta", "real", 10000.0, 0.0), 0.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _config_unsupported(where, "partial_rotary_factor",
                                         rope["partial_rotary_factor"], "1.0 (full rotary)")
    if rope_type not in ("default", "llama3"):
        raise _config_unsupported(where, "rope_type", rope_type,
                                         "\"default\" and \"llama3\" rotary embeddings")
    sizes = dict(vocab=get("vocab_size", "int"), dim=hidden_size,
                 layers=get("num_hidden_layers", "int"), q_heads=heads, kv_heads=kv_heads,
                 head_dim=head_dim, hidden=get("intermediate_size", "int"),
                 rope_theta=float(theta), norm_eps=float(get("rms_norm_eps", "real", 1e-6)),
                 tie_embeddings=get("tie_word_embeddings", "bool", False))
    try:  # Config and RopeScaling check the values' ranges
        if rope_type == "llama3":
            max_pos = get("max_position_embeddings", "int", 8192)
            sizes["rope_scaling"] = RopeScaling(
                factor=float(_config_value(rope, "factor", where, "real")),
                low_freq_factor=float(_config_value(rope, "low_freq_factor", where,
                                                           "real")),
                high_freq_factor=float(_config_value(rope, "high_freq_factor", where,
                                                            "real")),
                original_max_position_embeddings=_config_value(
                    rope, "original_max_position_embeddings", where, "int", max_pos))
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
        rope_scaling = {"rope_type": "llama3", "factor": s.factor,
                        "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab, "hidden_size": cfg.dim, "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.q_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": max(8192, 2 * (rope_scaling or {}).get(
            "original_max_position_embeddings", 0)),
    }


# --- finding and checking the tensors ---------------------------------------------------------

def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """The safetensors files, and the index's weight map (None without an index)."""
    index = path / INDEX
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise _checkpoint_json(index, what='an index with a "weight_map" of '
                                                      'tensor names to file names')
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            parts = PurePosixPath(shard).parts
            if (not parts or PurePosixPath(shard).is_absolute() or ".." in parts
                    or "\\" in shard or ":" in shard):  # a name inside the folder, nothing else
                raise _checkpoint_shard_outside(index, shard)
            if not (path / shard).is_file():
                raise _checkpoint_shard_missing(index, shard)
            files.append(path / shard)
        return files, weight_map, index
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE], None, None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _checkpoint_no_weights(path)
    return files, None, None


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="numpy")
    except Exception as err:  # safetensors raises its own SafetensorError, or OSError
        raise _checkpoint_unreadable(file, err) from None


def inspect_checkpoint(path: Any) -> CheckpointInfo:
    """Read config.json and every tensor's name, dtype and shape (no weights), and check them.

    Raises a ValueError naming the problem, before any weight is read: no config.json, a
    config this loader cannot map exactly (head counts that do not divide, biases, another
    rope type...), a missing, misplaced or unexpected tensor, a wrong shape, or a dtype other
    than F32, BF16, F16 or F64.
    """
    path = _check_checkpoint_dir(path)
    cfg = config_from_hf(_read_json(path / CONFIG), str(path))
    files, weight_map, index = _weight_files(path)
    found: dict[str, TensorInfo] = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                s = f.get_slice(name)
                found[name] = TensorInfo(file, s.get_dtype(), tuple(s.get_shape()))
    if 9 * cfg.layers + 2 > len(found):  # before `_layout` lists 9 names per layer
        raise _checkpoint_too_few_tensors(path, cfg.layers, len(found))
    if weight_map is not None:  # the index and the files must agree
        for name, shard in weight_map.items():
            info = found.get(name)
            if info is None or info.file != path / shard:
                raise _checkpoint_tensor_misplaced(name, index, shard)
    tensors = {}
    for name, _, shape, _ in _layout(cfg):
        if name not in found:
            raise _checkpoint_tensor_missing(name, path, shape)
        t = found[name]
        _check_checkpoint_tensor(name, t.file, t.dtype, list(t.shape), shape,
                                        tuple(READABLE))
        tensors[name] = t
    for name, t in found.items():
        ignorable = name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_embeddings
                                                         and name == "lm_head.weight")
        if name not in tensors and not ignorable:
            raise _checkpoint_tensor_unexpected(name, t.file)
    tokenizer = path / TOKENIZER
    return CheckpointInfo(path, cfg, tensors, tokenizer if tokenizer.is_file() else None)


# --- loading ------------------------------------------------------------------------------------

def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary."""
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + n].view(dtype).reshape(shape)


def load_checkpoint(path: Any, *, dtype: Any = np.float32, mesh: Mesh | None = None
                    ) -> tuple[Params, Config]:
    """Load a Hugging Face Llama checkpoint folder: `(params, cfg)` for `model.Generator`.

    Args:
      path: the folder (config.json, model.safetensors or sharded files with
        model.safetensors.index.json). Everything is checked first (`inspect_checkpoint`).
      dtype: the weights' dtype in memory. float32 (the default) converts BF16 and F16
        weights exactly (and rounds F64 ones); `jnp.bfloat16` keeps a bf16 checkpoint as
        stored (F32 weights are rounded); None keeps each tensor's stored dtype. The model
        computes in float32 whatever this is: bf16 weights are promoted inside each matrix
        product, so activations, the KV cache and all sums stay float32.
      mesh: where to put the weights: replicated on every device of `mesh` (this package
        shards the sequence, not the weights), which is where `Generator` wants them for
        that mesh. None: on JAX's default device.

    Memory: the weights are read one tensor at a time; each is converted (and transposed)
    into a fresh 64-byte-aligned host array, placed, and dropped, so host memory holds the
    placed weights plus one tensor in flight, never two copies of the model. On CPU,
    `jax.device_put` uses an aligned host array in place, so even the 8 simulated devices of
    a mesh share one copy. On GPUs each device gets its own copy and the host keeps none.

    Llama-3.1-8B (8.03 B weights, 16.1 GB of bf16 in 4 shards; the largest tensors are the
    embedding and `lm_head`, 1.05 GB each in bf16): on a GPU mesh every device holds a full
    replica, 16.1 GB with `dtype=jnp.bfloat16` or 32.1 GB in float32 (an 80 GB H100 holds
    either, next to its part of the float32 KV cache: 34.4 GB at 128k tokens, 4.3 GB per
    device when 8 share it), and the host needs only the tensor in flight: 3.2 GB while
    `lm_head` is transposed into float32. On a CPU the host holds the replica once, shared
    by all simulated devices: 16.1 GB with `dtype=jnp.bfloat16`, 32.1 GB in float32, plus
    that tensor in flight. (A 2-layer model of these shapes, 1.49 B weights, loaded as
    float32 on 8 simulated devices: 6.1 GB resident after loading, 8.2 GB at the peak.)
    """
    dtype = check_weight_dtype(dtype)
    if mesh is not None:
        validate.check_instance(mesh, Mesh, "mesh", "build one with make_mesh(...)")
    info = inspect_checkpoint(path)
    where = NamedSharding(mesh, P()) if mesh is not None else None
    cfg = info.cfg
    layout = {name: (dest, transpose) for name, dest, _, transpose in _layout(cfg)}
    params: dict = {"layers": [{} for _ in range(cfg.layers)]}
    by_file: dict[Path, list[str]] = {}
    for name, t in info.tensors.items():
        by_file.setdefault(t.file, []).append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                stored = f.get_tensor(name)
                want = stored.dtype if dtype is None else dtype
                dest, transpose = layout[name]
                src = stored.T if transpose else stored
                host = aligned_empty(src.shape, want)
                np.copyto(host, src, casting="unsafe")
                del stored, src
                if not np.isfinite(host).all():  # a NaN weight makes every logit NaN
                    raise ValueError(f"{file}: tensor {name!r} holds NaN or inf weights (or "
                                     f"values past {np.dtype(want).name}'s range); the "
                                     "checkpoint is damaged.")
                placed = jax.device_put(host, where)
                del host  # on CPU `placed` may use it in place; otherwise it is freed here
                _leaf(params, dest[:-1])[dest[-1]] = placed
    return params, cfg


def load_tokenizer(path: Any):
    """The checkpoint's `tokenizer.json` as a `tokenizers.Tokenizer`, or None if it has none.

    `tok.encode(text).ids` gives token ids (with the checkpoint's special tokens, e.g. Llama
    3's `<|begin_of_text|>`), `tok.decode(ids)` the text.
    """
    path = _check_checkpoint_dir(path)
    file = path / TOKENIZER
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise _checkpoint_json(file, err, "a tokenizers file") from None


# --- writing ------------------------------------------------------------------------------------

def save_checkpoint(path: Any, params: Params, cfg: Config, *, dtype: Any = None,
                    max_shard_bytes: int | None = None) -> list[Path]:
    """Write `params` of `cfg` as a Hugging Face Llama checkpoint that `load_checkpoint` and
    transformers' `LlamaForCausalLM.from_pretrained` read; return the files written.

    Args:
      path: the folder (created if needed; files of the same names are replaced).
      params: the model's weights (`init_params(cfg, key)`, or any params of those shapes).
      cfg: the model's `Config`.
      dtype: the stored dtype (e.g. `jnp.bfloat16`); None keeps each weight's own.
      max_shard_bytes: None writes one model.safetensors; a size splits the weights into
        `model-0000i-of-0000n.safetensors` files of at most that many bytes each (one tensor
        per file where a tensor is larger) and writes model.safetensors.index.json.

    Each file's tensors are converted one file at a time, so memory holds `params` plus one
    file's worth.
    """
    from safetensors.numpy import save_file

    path = validate.check_path(path, "path", "a folder")
    check_config(cfg)
    check_params(params, cfg)
    dtype = check_weight_dtype(dtype)
    max_shard_bytes = _check_shard_bytes(max_shard_bytes)
    validate.make_folder(path, "path")
    (path / CONFIG).write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")

    def stored(dest, transpose) -> np.ndarray:
        x = np.asarray(jax.device_get(_leaf(params, dest)))
        x = x.T if transpose else x
        return np.ascontiguousarray(x, dtype=x.dtype if dtype is None else dtype)

    entries = _layout(cfg)
    itemsize = {name: np.dtype(_leaf(params, dest).dtype if dtype is None else dtype).itemsize
                for name, dest, _, _ in entries}
    groups: list[list] = [[]]
    size = 0
    for entry in entries:
        n = math.prod(entry[2]) * itemsize[entry[0]]
        if max_shard_bytes is not None and groups[-1] and size + n > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += n
    meta = {"format": "pt"}  # transformers checks it
    if max_shard_bytes is None:
        save_file({name: stored(dest, t) for name, dest, _, t in groups[0]},
                  str(path / SINGLE_FILE), metadata=meta)
        (path / INDEX).unlink(missing_ok=True)
        return [path / CONFIG, path / SINGLE_FILE]
    written, weight_map, total = [path / CONFIG], {}, 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: stored(dest, t) for n, dest, _, t in group}
        total += sum(x.nbytes for x in tensors.values())
        save_file(tensors, str(path / name), metadata=meta)
        del tensors
        weight_map.update({n: name for n, *_ in group})
        written.append(path / name)
    (path / SINGLE_FILE).unlink(missing_ok=True)
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                          "weight_map": weight_map}, indent=2) + "\n")
    return [*written, path / INDEX]


def _leaf(params: Params, dest: tuple):
    for key in dest:
        params = params[key]
    return params


# --- errors: what a malformed checkpoint is told --------------------------------------------

_CHECKPOINT_HINT = ("a Hugging Face checkpoint folder holds config.json and the weights "
                    "(model.safetensors, or shards listed in model.safetensors.index.json)")


def _check_checkpoint_dir(path: Any, name: str = "path") -> Any:
    """An existing folder with a config.json; returns it as a `pathlib.Path`."""
    p = validate.check_path(path, name, "a folder")
    if not p.is_dir():
        raise ValueError(f"`{name}` {str(p)!r} is not a folder; {_CHECKPOINT_HINT}.")
    if not (p / "config.json").is_file():
        raise ValueError(f"`{name}` {str(p)!r} has no config.json; {_CHECKPOINT_HINT}.")
    return p


def _checkpoint_json(file: Any, err: Exception | None = None, what: str = "a JSON object"
                    ) -> ValueError:
    """`file` (config.json or the shard index) could not be read as `what`."""
    why = f" ({' '.join(str(err).split())})" if err is not None else ""
    return ValueError(f"`{file.name}` in {str(file.parent)!r} is not {what}{why}; it must be "
                      f"the file a Hugging Face checkpoint saves.")


def _config_value(config: dict, key: str, where: str, kind: str, default: Any = None,
                 minimum: float | None = None) -> Any:
    """`config[key]` of a config.json as `kind` ("int", "real", "bool" or "str"); `default`
    when absent (None: the key is required). Ints must be >= `minimum` (default 1); reals
    > `minimum` when it is given."""
    if key not in config or config[key] is None:
        if default is None:
            raise ValueError(f"`config.json` in {where!r} lacks \"{key}\"; a Llama config "
                             f"names vocab_size, hidden_size, intermediate_size, "
                             f"num_hidden_layers and num_attention_heads.")
        return default
    value = config[key]
    if kind == "real":  # an int too large for a float (JSON allows 10**400) is not finite
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and (isinstance(value, float) or abs(value) < 2**1023)
              and math.isfinite(value))
    else:
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "bool": isinstance(value, bool), "str": isinstance(value, str)}[kind]
    if kind == "int" and ok:  # below 2**53: any size a real model has, exact in JSON
        ok = (1 if minimum is None else minimum) <= value < 2**53
    elif kind == "real" and ok and minimum is not None:
        ok = value > minimum
    if not ok:
        want = {"int": f"an int >= {1 if minimum is None else int(minimum)} and < 2**53",
                "real": "a finite number" + (f" > {minimum:g}" if minimum is not None else ""),
                "bool": "true or false", "str": "a string"}[kind]
        shown = validate.describe(value) if len(repr(value)) > 60 else repr(value)
        raise ValueError(f"`config.json` in {where!r}: \"{key}\" must be {want}, got "
                         f"{shown}.")
    return value


def _config_invalid(where: str, err: Exception) -> ValueError:
    """A config.json value that `model.Config` or `model.RopeScaling` refused."""
    return ValueError(f"`config.json` in {where!r}: {err}")


def _config_unsupported(where: str, key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"`config.json` in {where!r}: \"{key}\" is {value!r}, which this "
                      f"loader does not support; it reads {supported}.")


def _check_config_heads(where: str, q_heads: int, kv_heads: int, hidden: int,
                       head_dim_given: bool) -> None:
    """Grouped-query attention needs kv heads dividing the query heads; without an explicit
    head_dim, the heads must divide hidden_size."""
    if q_heads % kv_heads:
        raise ValueError(f"`config.json` in {where!r}: num_attention_heads ({q_heads}) must be "
                         f"a multiple of num_key_value_heads ({kv_heads}) (grouped-query "
                         f"attention: each kv head serves a whole group of query heads).")
    if not head_dim_given and hidden % q_heads:
        raise ValueError(f"`config.json` in {where!r}: hidden_size ({hidden}) is not a "
                         f"multiple of num_attention_heads ({q_heads}), and no head_dim is "
                         f"given; add \"head_dim\" or fix the head count.")


def _checkpoint_no_weights(path: Any) -> ValueError:
    return ValueError(f"`path` {str(path)!r} has no weights: no model.safetensors, no "
                      f"model.safetensors.index.json and no other *.safetensors file.")


def _checkpoint_shard_missing(index: Any, shard: str) -> ValueError:
    return ValueError(f"`{index.name}` in {str(index.parent)!r} lists the shard {shard!r}, "
                      f"which is not there; copy the whole checkpoint folder.")


def _checkpoint_unreadable(file: Any, err: Exception) -> ValueError:
    return ValueError(f"`{file.name}` in {str(file.parent)!r} is not a readable safetensors "
                      f"file ({' '.join(str(err).split())}).")


def _checkpoint_shard_outside(index: Any, shard: str) -> ValueError:
    return ValueError(f"`{index.name}` in {str(index.parent)!r} lists the shard {shard!r}, "
                      f"which is not a file name inside the checkpoint folder (an absolute "
                      f"path or a '..'); the loader reads only the folder's own files.")


def _checkpoint_too_few_tensors(path: Any, layers: int, found: int) -> ValueError:
    return ValueError(f"`config.json` in {str(path)!r} declares {layers} layers (9 tensors "
                      f"each), but the checkpoint holds only {found} tensors; the config and "
                      f"the weights do not belong together.")


def _checkpoint_tensor_missing(name: str, path: Any, shape: tuple[int, ...]) -> ValueError:
    return ValueError(f"`{name}` is missing from the checkpoint {str(path)!r}; config.json "
                      f"implies a tensor of shape {list(shape)} under that name.")


def _checkpoint_tensor_misplaced(name: str, index: Any, shard: str) -> ValueError:
    return ValueError(f"`{name}` is listed in {index.name} under {shard!r} but that file does "
                      f"not hold it; the index and the shards disagree.")


def _checkpoint_tensor_unexpected(name: str, file: Any) -> ValueError:
    return ValueError(f"`{name}` in {file.name} is not a weight of the Llama model that "
                      f"config.json describes (a bias, an extra layer, another architecture?); "
                      f"the loader will not guess what it is for.")


def _check_checkpoint_tensor(name: str, file: Any, dtype: str, shape: list[int],
                            want: tuple[int, ...], readable: tuple[str, ...]) -> None:
    """A stored tensor's safetensors dtype and shape against what the loader reads."""
    if dtype not in readable:
        raise ValueError(f"`{name}` in {file.name} has dtype {dtype}, which the loader cannot "
                         f"read as weights; it reads {', '.join(readable)} (dequantise the "
                         f"checkpoint first).")
    if tuple(shape) != tuple(want):
        raise ValueError(f"`{name}` in {file.name} has shape {list(shape)}, but config.json "
                         f"implies {list(want)} (Hugging Face stores Linear weights as "
                         f"[out, in]).")


def _checkpoint_no_tokenizer(path: Any) -> ValueError:
    return ValueError(f"`path` {str(path)!r} has no tokenizer.json, so text cannot be turned "
                      f"into token ids; pass token ids instead.")


def check_weight_dtype(dtype: Any, name: str = "dtype") -> Any:
    """None (keep the checkpoint's dtype) or a floating dtype, as a numpy dtype."""
    if dtype is None:
        return None
    validate.check_float_dtype(dtype, name)
    return np.dtype(jnp.dtype(dtype))


def _check_shard_bytes(value: Any, name: str = "max_shard_bytes") -> Any:
    if value is None:
        return None
    return validate.check_int(value, name, example="`max_shard_bytes=2_000_000_000` (2 GB files)")

