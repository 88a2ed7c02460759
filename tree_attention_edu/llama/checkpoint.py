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
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from ..core import validate
from .config import Config, Params, check_config, check_params
from .hf_config import config_from_hf, config_to_hf, not_hf_json, read_json
from .paths import StrPath, check_path, make_folder

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"

READABLE = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F64": np.dtype(np.float64),
}
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
        return sum(math.prod(t.shape) * READABLE[t.dtype].itemsize for t in self.tensors.values())


# --- names ------------------------------------------------------------------------------------


def _layout(cfg: Config) -> list[tuple[str, tuple, tuple[int, ...], bool]]:
    """(Hugging Face name, params path, stored shape, transpose?) for every weight of `cfg`."""
    qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out: list[tuple[str, tuple, tuple[int, ...], bool]] = [
        ("model.embed_tokens.weight", ("embed",), (cfg.vocab, cfg.dim), False)
    ]
    for i in range(cfg.layers):
        pre = f"model.layers.{i}."
        out += [
            (pre + "input_layernorm.weight", ("layers", i, "attn_norm"), (cfg.dim,), False),
            (pre + "self_attn.q_proj.weight", ("layers", i, "wq"), (qd, cfg.dim), True),
            (pre + "self_attn.k_proj.weight", ("layers", i, "wk"), (kd, cfg.dim), True),
            (pre + "self_attn.v_proj.weight", ("layers", i, "wv"), (kd, cfg.dim), True),
            (pre + "self_attn.o_proj.weight", ("layers", i, "wo"), (cfg.dim, qd), True),
            (pre + "post_attention_layernorm.weight", ("layers", i, "mlp_norm"), (cfg.dim,), False),
            (pre + "mlp.gate_proj.weight", ("layers", i, "w_gate"), (cfg.hidden, cfg.dim), True),
            (pre + "mlp.up_proj.weight", ("layers", i, "w_up"), (cfg.hidden, cfg.dim), True),
            (pre + "mlp.down_proj.weight", ("layers", i, "w_down"), (cfg.dim, cfg.hidden), True),
        ]
    out.append(("model.norm.weight", ("final_norm",), (cfg.dim,), False))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", ("unembed",), (cfg.vocab, cfg.dim), True))
    return out


# --- finding and checking the tensors ---------------------------------------------------------


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """The safetensors files, and the index's weight map (None without an index)."""
    index = path / INDEX
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise not_hf_json(
                index, what='an index with a "weight_map" of tensor names to file names'
            )
        files = []
        for shard in dict.fromkeys(weight_map.values()):
            parts = PurePosixPath(shard).parts
            if (
                not parts
                or PurePosixPath(shard).is_absolute()
                or ".." in parts
                or "\\" in shard
                or ":" in shard
            ):  # a name inside the folder, nothing else
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


def inspect_checkpoint(path: StrPath) -> CheckpointInfo:
    """Read config.json and every tensor's name, dtype and shape (no weights), and check them.

    Raises a ValueError naming the problem, before any weight is read: no config.json, a
    config this loader cannot map exactly (head counts that do not divide, biases, another
    rope type...), a missing, misplaced or unexpected tensor, a wrong shape, or a dtype other
    than F32, BF16, F16 or F64.
    """
    path = _check_checkpoint_dir(path)
    cfg = config_from_hf(read_json(path / CONFIG), str(path))
    files, weight_map, index = _weight_files(path)
    found: dict[str, TensorInfo] = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                s = f.get_slice(name)
                found[name] = TensorInfo(file, s.get_dtype(), tuple(s.get_shape()))
    if 9 * cfg.layers + 2 > len(found):  # before `_layout` lists 9 names per layer
        raise _checkpoint_too_few_tensors(path, cfg.layers, len(found))
    if weight_map is not None and index is not None:  # the index and the files must agree
        for name, shard in weight_map.items():
            info = found.get(name)
            if info is None or info.file != path / shard:
                raise _checkpoint_tensor_misplaced(name, index, shard)
    tensors = {}
    for name, _, shape, _ in _layout(cfg):
        if name not in found:
            raise _checkpoint_tensor_missing(name, path, shape)
        t = found[name]
        _check_checkpoint_tensor(name, t.file, t.dtype, list(t.shape), shape, tuple(READABLE))
        tensors[name] = t
    for name, t in found.items():
        ignorable = name.endswith(_IGNORED_SUFFIXES) or (
            cfg.tie_embeddings and name == "lm_head.weight"
        )
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
    return raw[start : start + n].view(dtype).reshape(shape)


def load_checkpoint(
    path: StrPath, *, dtype: DTypeLike | None = np.float32, mesh: Mesh | None = None
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
                    raise ValueError(
                        f"{file}: tensor {name!r} holds NaN or inf weights (or "
                        f"values past {np.dtype(want).name}'s range); the "
                        "checkpoint is damaged."
                    )
                placed = jax.device_put(host, where)
                del host  # on CPU `placed` may use it in place; otherwise it is freed here
                _leaf(params, dest[:-1])[dest[-1]] = placed
    return params, cfg


def load_tokenizer(path: StrPath) -> Tokenizer | None:
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
        raise not_hf_json(file, err, "a tokenizers file") from None


# --- writing ------------------------------------------------------------------------------------


def save_checkpoint(
    path: StrPath,
    params: Params,
    cfg: Config,
    *,
    dtype: DTypeLike | None = None,
    max_shard_bytes: int | None = None,
) -> list[Path]:
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

    path = check_path(path, "path", "a folder")
    check_config(cfg)
    check_params(params, cfg)
    dtype = check_weight_dtype(dtype)
    max_shard_bytes = _check_shard_bytes(max_shard_bytes)
    make_folder(path, "path")
    (path / CONFIG).write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")

    def stored(dest, transpose) -> np.ndarray:
        x = np.asarray(jax.device_get(_leaf(params, dest)))
        x = x.T if transpose else x
        return np.ascontiguousarray(x, dtype=x.dtype if dtype is None else dtype)

    entries = _layout(cfg)
    itemsize = {
        name: np.dtype(_leaf(params, dest).dtype if dtype is None else dtype).itemsize
        for name, dest, _, _ in entries
    }
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
        save_file(
            {name: stored(dest, t) for name, dest, _, t in groups[0]},
            str(path / SINGLE_FILE),
            metadata=meta,
        )
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
    (path / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return [*written, path / INDEX]


def _leaf(params: Params, dest: tuple):
    for key in dest:
        params = params[key]
    return params


# --- errors: what a malformed checkpoint is told --------------------------------------------

_CHECKPOINT_HINT = (
    "a Hugging Face checkpoint folder holds config.json and the weights "
    "(model.safetensors, or shards listed in model.safetensors.index.json)"
)


def _check_checkpoint_dir(path: StrPath, name: str = "path") -> Path:
    """An existing folder with a config.json; returns it as a `pathlib.Path`."""
    p = check_path(path, name, "a folder")
    if not p.is_dir():
        raise ValueError(f"`{name}` {str(p)!r} is not a folder; {_CHECKPOINT_HINT}.")
    if not (p / "config.json").is_file():
        raise ValueError(f"`{name}` {str(p)!r} has no config.json; {_CHECKPOINT_HINT}.")
    return p


def _checkpoint_no_weights(path: Path) -> ValueError:
    return ValueError(
        f"`path` {str(path)!r} has no weights: no model.safetensors, no "
        f"model.safetensors.index.json and no other *.safetensors file."
    )


def _checkpoint_shard_missing(index: Path, shard: str) -> ValueError:
    return ValueError(
        f"`{index.name}` in {str(index.parent)!r} lists the shard {shard!r}, "
        f"which is not there; copy the whole checkpoint folder."
    )


def _checkpoint_unreadable(file: Path, err: Exception) -> ValueError:
    return ValueError(
        f"`{file.name}` in {str(file.parent)!r} is not a readable safetensors "
        f"file ({' '.join(str(err).split())})."
    )


def _checkpoint_shard_outside(index: Path, shard: str) -> ValueError:
    return ValueError(
        f"`{index.name}` in {str(index.parent)!r} lists the shard {shard!r}, "
        f"which is not a file name inside the checkpoint folder (an absolute "
        f"path or a '..'); the loader reads only the folder's own files."
    )


def _checkpoint_too_few_tensors(path: Path, layers: int, found: int) -> ValueError:
    return ValueError(
        f"`config.json` in {str(path)!r} declares {layers} layers (9 tensors "
        f"each), but the checkpoint holds only {found} tensors; the config and "
        f"the weights do not belong together."
    )


def _checkpoint_tensor_missing(name: str, path: Path, shape: tuple[int, ...]) -> ValueError:
    return ValueError(
        f"`{name}` is missing from the checkpoint {str(path)!r}; config.json "
        f"implies a tensor of shape {list(shape)} under that name."
    )


def _checkpoint_tensor_misplaced(name: str, index: Path, shard: str) -> ValueError:
    return ValueError(
        f"`{name}` is listed in {index.name} under {shard!r} but that file does "
        f"not hold it; the index and the shards disagree."
    )


def _checkpoint_tensor_unexpected(name: str, file: Path) -> ValueError:
    return ValueError(
        f"`{name}` in {file.name} is not a weight of the Llama model that "
        f"config.json describes (a bias, an extra layer, another architecture?); "
        f"the loader will not guess what it is for."
    )


def _check_checkpoint_tensor(
    name: str,
    file: Path,
    dtype: str,
    shape: list[int],
    want: tuple[int, ...],
    readable: tuple[str, ...],
) -> None:
    """A stored tensor's safetensors dtype and shape against what the loader reads."""
    if dtype not in readable:
        raise ValueError(
            f"`{name}` in {file.name} has dtype {dtype}, which the loader cannot "
            f"read as weights; it reads {', '.join(readable)} (dequantise the "
            f"checkpoint first)."
        )
    if tuple(shape) != tuple(want):
        raise ValueError(
            f"`{name}` in {file.name} has shape {list(shape)}, but config.json "
            f"implies {list(want)} (Hugging Face stores Linear weights as "
            f"[out, in])."
        )


def check_weight_dtype(dtype: DTypeLike | None, name: str = "dtype") -> np.dtype | None:
    """None (keep the checkpoint's dtype) or a floating dtype, as a numpy dtype."""
    if dtype is None:
        return None
    validate.check_float_dtype(dtype, name)
    return np.dtype(jnp.dtype(dtype))


def _check_shard_bytes(value: int | None, name: str = "max_shard_bytes") -> int | None:
    if value is None:
        return None
    return validate.check_int(value, name, example="`max_shard_bytes=2_000_000_000` (2 GB files)")
