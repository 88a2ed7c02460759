"""Llama checkpoints in llama.cpp's GGUF format: one file holding the config, the (quantised)
weights, the tokenizer and the chat template.

The file is read with the `gguf` package (llama.cpp's own reader, numpy only) and its
tensors are dequantised with `gguf.quants`, one block of rows at a time, straight into the
destination array: the loader never holds a second float32 copy of the model.

| GGUF tensor, numpy shape | model param |
|---|---|
| `token_embd.weight [vocab, dim]` | `embed` |
| `blk.{i}.attn_norm.weight [dim]` | `layers[i]["attn_norm"]` |
| `blk.{i}.attn_{q,k}.weight [heads·head_dim, dim]`, rows permuted | `wq`, `wk` (un-permuted, ᵀ) |
| `blk.{i}.attn_v.weight [kv_heads·head_dim, dim]` | `wv` (ᵀ) |
| `blk.{i}.attn_output.weight [dim, q_heads·head_dim]` | `wo` (ᵀ) |
| `blk.{i}.ffn_norm.weight [dim]` | `mlp_norm` |
| `blk.{i}.ffn_{gate,up}.weight [hidden, dim]` | `w_gate`, `w_up` (ᵀ) |
| `blk.{i}.ffn_down.weight [dim, hidden]` | `w_down` (ᵀ) |
| `output_norm.weight [dim]` | `final_norm` |
| `output.weight [vocab, dim]`, absent when the embeddings are tied | `unembed` (ᵀ) |

GGUF lists a tensor's dimensions fastest-first (ggml's `ne`), so its numpy shape is the
reverse: `[out, in]`, as in a Hugging Face checkpoint, and Linear weights are transposed
once, to the model's `[in, out]`.

**The Q/K permutation.** llama.cpp's converter (`convert_hf_to_gguf.py`, `permute()`)
reorders the rows of `q_proj` and `k_proj` within each head: Hugging Face's rotary embedding
pairs feature `i` with `i + D/2` (`rotate_half`), llama.cpp's "normal" RoPE pairs `2i` with
`2i + 1`, so the converter moves row `i` to `2i` and row `i + D/2` to `2i + 1`. A q·k product
is the same whichever order both use, so only the pairing matters, and `model.rope` pairs as
Hugging Face does: the loader moves the rows back (`unpermute_rows`).

**Untrusted input.** A GGUF file is parsed before `gguf.GGUFReader` sees it (`scan`): every
length, count, dimension, type and offset is checked against the file's size and against
fixed limits, so a truncated or hostile file fails with a ValueError that names the file and
the field, in time and memory proportional to the file, before anything is allocated.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import validate
from . import chat_template
from .checkpoint import aligned_empty, check_weight_dtype
from .model import Config, Params

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_KEYS = 1 << 16  # metadata entries; llama.cpp writes a few dozen
MAX_TENSORS = 1 << 20
MAX_ARRAY_ITEMS = 1 << 23  # all metadata arrays together (Gemma's 262k-token vocabulary x 3)
MAX_NAME = 1 << 16  # bytes of a key or tensor name
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
ROW_CHUNK_BYTES = 1 << 24  # dequantise about 16 MB of float32 at a time

# GGUFValueType: numpy scalar of the fixed-size ones, 8 = string, 9 = array.
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_INT_TYPES, _FLOAT_TYPES, _BOOL = {0, 1, 2, 3, 4, 5, 10, 11}, {6, 12}, 7

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
         "Q5_K", "Q6_K")
"""The tensor types the loader dequantises (llama.cpp's usual types for Llama weights)."""


class TensorEntry(NamedTuple):
    """One tensor of a GGUF file: its ggml `type` name, numpy `shape` (`[out, in]`), and
    where its bytes lie (`offset` from the start of the file, `nbytes`)."""

    type: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class GGUFInfo(NamedTuple):
    """What `inspect_gguf` found: the model's `cfg`, the `metadata` (key → Python value; the
    tokenizer's long arrays are left out), each `tensors` entry by GGUF name, and whether the
    file carries a tokenizer this package builds (`tokenizer`)."""

    path: Path
    cfg: Config
    metadata: dict[str, Any]
    tensors: dict[str, TensorEntry]
    tokenizer: bool

    @property
    def num_params(self) -> int:
        """The number of weights (each tensor's size, summed)."""
        return sum(math.prod(t.shape) for t in self.tensors.values())

    @property
    def stored_bytes(self) -> int:
        """Bytes of the weights as stored (quantised)."""
        return sum(t.nbytes for t in self.tensors.values())


# --- messages -----------------------------------------------------------------------------------

def _bad(file: Path, field: str, problem: str) -> ValueError:
    return ValueError(f"`{file.name}` ({str(file.parent)!r}): {field}: {problem}; it is not a "
                      f"GGUF file this loader can read (re-download or re-convert it).")


# --- a bounded walk over the file, before gguf.GGUFReader -------------------------------------

def _block(type_name: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a ggml type."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]


def scan(path: Any) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
    """Parse a GGUF file's header with every size checked: `(metadata, tensors)`.

    `metadata` maps each key to its value (numbers, bools, strings; arrays as lists, except
    arrays of more than 64 items, kept as `("array", element type, count)`); `tensors` maps
    each tensor name to its `TensorEntry`. Raises a ValueError naming the file and the field
    for anything malformed: bad magic or version, a count or length that runs past the end,
    an unknown value or tensor type, absurd dimensions, a tensor whose bytes lie outside the
    file. Reads only the header; time and memory are bounded by its size.
    """
    import gguf

    file = validate.check_path(path, "path", "a .gguf file")
    if not file.is_file():
        raise ValueError(f"`path` {str(file)!r} is not a file; a GGUF checkpoint is one "
                         f"*.gguf file (`tree-attention-edu fetch-model` fetches one).")
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != MAGIC:
            raise _bad(file, "header", f"the file ({size} bytes) does not start with the "
                                       f"GGUF magic and counts")
        version, n_tensors, n_keys = struct.unpack_from("<IQQ", head, 4)
        if version not in VERSIONS:
            raise _bad(file, "GGUF.version", f"version {version} (big-endian files read as a "
                                             f"huge number); this loader reads little-endian "
                                             f"versions {VERSIONS}")
        # Each entry takes at least 13 (key) or 24 (tensor) bytes, so a count the file cannot
        # hold is refused before any loop runs over it.
        if n_keys > min(MAX_KEYS, size // 13):
            raise _bad(file, "GGUF.kv_count", f"{n_keys} metadata entries in {size} bytes")
        if n_tensors > min(MAX_TENSORS, size // 24):
            raise _bad(file, "GGUF.tensor_count", f"{n_tensors} tensors in {size} bytes")
        reader = _Cursor(file, f, size, 24)
        metadata: dict[str, Any] = {}
        items = 0
        for i in range(n_keys):
            key = reader.string(f"metadata entry {i}: its key", MAX_NAME)
            if key in metadata:
                raise _bad(file, key, "appears twice")
            vtype = reader.unpack("<I", key)[0]
            if vtype == _ARRAY:
                etype, count = reader.unpack("<IQ", key)
                items += count
                if items > MAX_ARRAY_ITEMS:
                    raise _bad(file, key, f"arrays of {items} items in all, more than "
                                          f"{MAX_ARRAY_ITEMS}")
                if etype in _SCALARS:
                    width = np.dtype(_SCALARS[etype]).itemsize
                    data = reader.take(width * count, key)
                    value: Any = (np.frombuffer(data, _SCALARS[etype]).tolist() if count <= 64
                                  else ("array", etype, count))
                elif etype == _STRING:
                    strings = [reader.string(f"{key}[{j}]") for j in range(count)]
                    value = strings if count <= 64 else ("array", etype, count)
                else:
                    raise _bad(file, key, f"an array of value type {etype}, which GGUF does not "
                                          f"define for arrays (nested arrays are not read)")
            elif vtype == _STRING:
                value = reader.string(key)
            elif vtype in _SCALARS:
                width = np.dtype(_SCALARS[vtype]).itemsize
                value = np.frombuffer(reader.take(width, key), _SCALARS[vtype])[0].item()
                value = bool(value) if vtype == _BOOL else value
            else:
                raise _bad(file, key, f"value type {vtype}, which GGUF does not define")
            metadata[key] = (vtype, value)
        alignment = metadata.get("general.alignment", (4, 32))
        if alignment[0] != 4 or alignment[1] == 0 or alignment[1] & (alignment[1] - 1):
            raise _bad(file, "general.alignment", f"{alignment[1]!r} is not a uint32 power of "
                                                  f"two")
        infos, seen = [], set()
        for i in range(n_tensors):
            name = reader.string(f"tensor {i}: its name", MAX_NAME)
            n_dims = reader.unpack("<I", name)[0]
            if not 1 <= n_dims <= MAX_DIMS:
                raise _bad(file, name, f"{n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}")
            dims = reader.unpack(f"<{n_dims}Q", name)
            raw_type, offset = reader.unpack("<IQ", name)
            if name in seen:
                raise _bad(file, name, "appears twice")
            seen.add(name)
            infos.append((name, dims, raw_type, offset))
        data_start = -(-reader.pos // alignment[1]) * alignment[1]
    tensors = {}
    for name, dims, raw_type, offset in infos:
        try:
            type_name = gguf.GGMLQuantizationType(raw_type).name
        except ValueError:
            type_name = f"{raw_type} (unknown)"
        if type_name not in TYPES:
            raise _bad(file, name, f"tensor type {type_name}, which the loader does not "
                                   f"dequantise; it reads {', '.join(TYPES)}")
        if min(dims) < 1 or math.prod(dims) > MAX_ELEMENTS:
            raise _bad(file, name, f"dimensions {list(dims)}: each must be >= 1 and the "
                                   f"product at most {MAX_ELEMENTS}")
        block, block_bytes = _block(type_name)
        if dims[0] % block:
            raise _bad(file, name, f"a row of {dims[0]} values, not a whole number of "
                                   f"{type_name} blocks of {block}")
        nbytes = math.prod(dims) // block * block_bytes
        start = data_start + offset
        if offset % alignment[1] or start + nbytes > size:
            raise _bad(file, name, f"its {nbytes} bytes at offset {offset} of the data "
                                   f"(from byte {data_start}) lie outside the file's {size} "
                                   f"bytes or off its {alignment[1]}-byte alignment "
                                   f"(a truncated file?)")
        tensors[name] = TensorEntry(type_name, tuple(reversed(dims)), start, nbytes)
    return metadata, tensors


class _Cursor:
    """Reads the header from a file, refusing any length that would run past its end."""

    def __init__(self, file: Path, f, size: int, pos: int):
        self.file, self.f, self.size, self.pos = file, f, size, pos

    def take(self, n: int, field: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise _bad(self.file, field, f"{n} bytes at byte {self.pos} run past the end of "
                                         f"the file ({self.size} bytes; truncated?)")
        data = self.f.read(n)
        self.pos += n
        return data

    def unpack(self, fmt: str, field: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))

    def string(self, field: str, limit: int | None = None) -> str:
        """A length-prefixed UTF-8 string; `limit` caps its length (keys and names)."""
        n = self.unpack("<Q", field)[0]
        if limit is not None and n > limit:
            raise _bad(self.file, field, f"a name of {n} bytes, more than {limit}")
        try:
            return self.take(n, field).decode("utf-8")
        except UnicodeDecodeError as err:
            raise _bad(self.file, field, f"a string that is not UTF-8 ({err.reason})") from None


# --- metadata -> Config ---------------------------------------------------------------------

def _get(file: Path, metadata: dict, key: str, kind: str, default: Any = None,
         minimum: float | None = 1) -> Any:
    """`metadata[key]` checked to be `kind` ("int", "real", "bool", "str"); `default` when
    absent (None: required)."""
    if key not in metadata:
        if default is None:
            raise _bad(file, key, "missing; a llama GGUF file names its sizes under "
                                  "\"llama.*\"")
        return default
    vtype, value = metadata[key]
    ok = {"int": vtype in _INT_TYPES, "real": vtype in _FLOAT_TYPES | _INT_TYPES,
          "bool": vtype == _BOOL, "str": vtype == _STRING}[kind]
    if ok and kind == "real":
        ok = math.isfinite(value) and (minimum is None or value > minimum)
    if ok and kind == "int":
        ok = minimum is None or value >= minimum
    if not ok:
        want = {"int": f"an integer >= {minimum}", "real": "a finite number"
                + (f" > {minimum:g}" if minimum is not None else ""),
                "bool": "a bool", "str": "a string"}[kind]
        shown = value if not isinstance(value, tuple) else f"an array of {value[2]} items"
        raise _bad(file, key, f"must be {want}, got {shown!r} (value type {vtype})")
    return value


def config_from_gguf(file: Path, metadata: dict, tensors: dict[str, TensorEntry]) -> Config:
    """`model.Config` of a llama GGUF file's metadata (sizes under `llama.*`)."""
    arch = _get(file, metadata, "general.architecture", "str")
    if arch != "llama":
        raise _bad(file, "general.architecture", f"{arch!r}; the loader reads Llama models "
                                                 f"(\"llama\")")
    a = arch + "."
    layers = _get(file, metadata, a + "block_count", "int")
    if 9 * layers + 2 > len(tensors):  # 9 per layer, the embedding and the final norm
        raise _bad(file, a + "block_count", f"{layers} layers, but the file holds only "
                                            f"{len(tensors)} tensors (9 per layer and 2 more)")
    dim = _get(file, metadata, a + "embedding_length", "int")
    heads = _get(file, metadata, a + "attention.head_count", "int")
    kv_heads = _get(file, metadata, a + "attention.head_count_kv", "int", heads)
    if heads % kv_heads:
        raise _bad(file, a + "attention.head_count_kv", f"{kv_heads} kv heads do not divide "
                                                        f"{heads} query heads")
    if dim % heads and a + "attention.key_length" not in metadata:
        raise _bad(file, a + "attention.head_count", f"{heads} heads do not divide the "
                                                     f"embedding length {dim}")
    head_dim = _get(file, metadata, a + "attention.key_length", "int", dim // heads)
    if _get(file, metadata, a + "attention.value_length", "int", head_dim) != head_dim:
        raise _bad(file, a + "attention.value_length", "differs from the key length")
    if head_dim % 2:
        raise _bad(file, a + "attention.key_length", f"{head_dim} is odd; rotary embeddings "
                                                     f"rotate pairs")
    rotary = _get(file, metadata, a + "rope.dimension_count", "int", head_dim)
    if rotary != head_dim:
        raise _bad(file, a + "rope.dimension_count", f"{rotary} rotary dimensions of "
                                                     f"{head_dim}; partial rotary is not read")
    scaling = _get(file, metadata, a + "rope.scaling.type", "str", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        raise _bad(file, a + "rope.scaling.type", "rescaled rotary frequencies (linear, yarn, "
                                                  "or Llama 3.1's rope_freqs) are not read")
    if "token_embd.weight" not in tensors:
        raise _bad(file, "token_embd.weight", "missing")
    vocab = _get(file, metadata, a + "vocab_size", "int", tensors["token_embd.weight"].shape[0])
    try:
        return Config(vocab=vocab, dim=dim, layers=layers, q_heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, hidden=_get(file, metadata, a + "feed_forward_length",
                                                     "int"),
                      rope_theta=float(_get(file, metadata, a + "rope.freq_base", "real",
                                            10000.0, 0.0)),
                      norm_eps=float(_get(file, metadata, a + "attention.layer_norm_rms_epsilon",
                                          "real", 1e-5, 0.0)),
                      tie_embeddings="output.weight" not in tensors)
    except (ValueError, TypeError) as err:
        raise _bad(file, "metadata", str(err)) from None


def layout(cfg: Config) -> list[tuple[str, tuple, tuple[int, ...], bool]]:
    """(GGUF name, params path, numpy shape, transpose?) for every weight of `cfg`."""
    qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out: list[tuple[str, tuple, tuple[int, ...], bool]] = [
        ("token_embd.weight", ("embed",), (cfg.vocab, cfg.dim), False)]
    for i in range(cfg.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", ("layers", i, "attn_norm"), (cfg.dim,), False),
                (b + "attn_q.weight", ("layers", i, "wq"), (qd, cfg.dim), True),
                (b + "attn_k.weight", ("layers", i, "wk"), (kd, cfg.dim), True),
                (b + "attn_v.weight", ("layers", i, "wv"), (kd, cfg.dim), True),
                (b + "attn_output.weight", ("layers", i, "wo"), (cfg.dim, qd), True),
                (b + "ffn_norm.weight", ("layers", i, "mlp_norm"), (cfg.dim,), False),
                (b + "ffn_gate.weight", ("layers", i, "w_gate"), (cfg.hidden, cfg.dim), True),
                (b + "ffn_up.weight", ("layers", i, "w_up"), (cfg.hidden, cfg.dim), True),
                (b + "ffn_down.weight", ("layers", i, "w_down"), (cfg.dim, cfg.hidden), True)]
    out.append(("output_norm.weight", ("final_norm",), (cfg.dim,), False))
    if not cfg.tie_embeddings:
        out.append(("output.weight", ("unembed",), (cfg.vocab, cfg.dim), True))
    return out


def inspect_gguf(path: Any) -> GGUFInfo:
    """Read a GGUF file's metadata and tensor table (no weights) and check them.

    Raises a ValueError naming the file and the field: a malformed or truncated file
    (`scan`), another architecture, sizes that disagree, a missing, unexpected or misshapen
    tensor, a tensor type the loader does not dequantise (see `TYPES`).
    """
    metadata, tensors = scan(path)
    file = Path(path)
    cfg = config_from_gguf(file, metadata, tensors)
    wanted = layout(cfg)
    for name, _, shape, _ in wanted:
        if name not in tensors:
            raise _bad(file, name, f"missing (the metadata implies {cfg.layers} layers and a "
                                   f"tensor of shape {list(shape)})")
        if tensors[name].shape != shape:
            raise _bad(file, name, f"shape {list(tensors[name].shape)}, but the metadata "
                                   f"implies {list(shape)}")
    extra = set(tensors) - {name for name, *_ in wanted}
    if extra:
        raise _bad(file, sorted(extra)[0], "not a weight of the Llama model the metadata "
                                           "describes (a bias, an extra layer?)")
    plain = {k: v for k, (_, v) in metadata.items()}
    return GGUFInfo(file, cfg, plain, tensors, _tokenizer_supported(metadata))


# --- the Q/K rows ---------------------------------------------------------------------------

def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """`src [rows]`: Hugging Face row `r` of a q or k projection is GGUF row `src[r]`.

    llama.cpp's converter stores, within each head of `D = rows / heads` rows, Hugging Face
    row `i` at `2i` and row `D/2 + i` at `2i + 1` (its `permute()`), so that its interleaved
    RoPE rotates the same pairs as `rotate_half` does.
    """
    d = rows // heads
    r = np.arange(rows)
    head, j = np.divmod(r, d)
    # Hugging Face row j < D/2 came from 2j; row D/2 + i came from 2i + 1.
    return head * d + np.where(j < d // 2, 2 * j, 2 * (j - d // 2) + 1)


# --- loading ------------------------------------------------------------------------------------

def _dequantize_into(dest: np.ndarray, data: np.memmap, entry: TensorEntry, transpose: bool,
                     rows: np.ndarray | None) -> None:
    """Dequantise `entry` (numpy shape `[out, in]`, or `[n]`) into `dest`, a block of rows at
    a time: `dest = W.T` when `transpose`, else `W`, where `W[r] = stored[rows[r]]`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[entry.type]
    raw = data[entry.offset: entry.offset + entry.nbytes]
    if len(entry.shape) == 1:
        np.copyto(dest, gguf.quants.dequantize(raw, qtype), casting="unsafe")
        return
    n_rows, n_cols = entry.shape
    raw = raw.reshape(n_rows, -1)
    src = np.arange(n_rows) if rows is None else rows
    step = max(1, ROW_CHUNK_BYTES // (4 * n_cols))
    for r0 in range(0, n_rows, step):
        block = gguf.quants.dequantize(raw[src[r0:r0 + step]], qtype)  # [step, in] float32
        if transpose:
            np.copyto(dest[:, r0:r0 + step], block.T, casting="unsafe")
        else:
            np.copyto(dest[r0:r0 + step], block, casting="unsafe")


def load_gguf(path: Any, *, dtype: Any = np.float32, mesh: Mesh | None = None
              ) -> tuple[Params, Config]:
    """Load a Llama GGUF file: `(params, cfg)` for `model.Generator`.

    Args:
      path: the .gguf file. Everything is checked first (`inspect_gguf`).
      dtype: the weights' dtype in memory: float32 (the default) or e.g. `jnp.bfloat16`
        (quantised values rounded once). None means float32 too: a quantised tensor has no
        numpy dtype of its own. The model computes in float32 either way.
      mesh: where to put the weights, replicated on every device of `mesh`; None: JAX's
        default device.

    Memory: the file is memory-mapped; each tensor is dequantised a block of rows (about 16
    MB of float32) at a time into its own fresh 64-byte-aligned host array (transposed and
    un-permuted on the way), which is placed and dropped. The host holds the placed weights,
    one block in flight and the pages of the file it has touched; never two float32 copies.
    """
    dtype = check_weight_dtype(dtype) or np.dtype(np.float32)
    if mesh is not None:
        validate.check_instance(mesh, Mesh, "mesh", "build one with make_mesh(...)")
    info = inspect_gguf(path)
    cfg = info.cfg
    where = NamedSharding(mesh, P()) if mesh is not None else None
    params: dict = {"layers": [{} for _ in range(cfg.layers)]}
    data = np.memmap(info.path, dtype=np.uint8, mode="r")
    try:
        for name, dest, shape, transpose in layout(cfg):
            entry = info.tensors[name]
            rows = None
            if name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = cfg.q_heads if name.endswith("attn_q.weight") else cfg.kv_heads
                rows = unpermute_rows(shape[0], heads)
            host = aligned_empty(shape[::-1] if transpose else shape, dtype)
            _dequantize_into(host, data, entry, transpose, rows)
            if not np.isfinite(host).all():  # a NaN weight makes every logit NaN
                raise _bad(info.path, name, "holds NaN or inf weights")
            placed = jax.device_put(host, where)
            del host  # on CPU `placed` may use it in place; otherwise it is freed here
            leaf = params
            for key in dest[:-1]:
                leaf = leaf[key]
            leaf[dest[-1]] = placed
    finally:
        del data
    return params, cfg


# --- tokenizer and chat template --------------------------------------------------------------

# llama.cpp's pre-tokenizers (`tokenizer.ggml.pre`, src/llama-vocab.cpp): regexes applied one
# after the other, each splitting the pieces the previous one left. The last one of each is
# GPT-2's, which `tokenizers`' ByteLevel applies itself; the ones before it become `Split`s.
_DIGITS = r"\p{N}"
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (), "gpt2": (), "gpt-2": (), "mpt": (), "olmo": (),
    "smollm": (_DIGITS,), "starcoder": (_DIGITS,), "refact": (_DIGITS,),
    "codeshell": (_DIGITS,), "command-r": (_DIGITS,),
}
"""`tokenizer.ggml.pre` values the tokenizer builder knows, and the regexes each applies
before GPT-2's byte-level split (e.g. "smollm": every digit on its own first)."""

_CONTROL, _USER_DEFINED = 3, 4  # llama_token_type


def _tokenizer_supported(metadata: dict) -> bool:
    model = metadata.get("tokenizer.ggml.model", (None, None))[1]
    pre = metadata.get("tokenizer.ggml.pre", (None, "default"))[1]
    return model == "gpt2" and pre in PRE_TOKENIZERS and "tokenizer.ggml.tokens" in metadata


def _array(reader, file: Path, key: str, etypes: set[int], count: int | None = None) -> list:
    """A metadata array read through `gguf.GGUFReader`, its element type checked."""
    field = reader.fields.get(key)
    if field is None:
        raise _bad(file, key, "missing")
    import gguf

    if field.types[0] != gguf.GGUFValueType.ARRAY or int(field.types[-1]) not in etypes:
        raise _bad(file, key, f"value type {[t.name for t in field.types]}, not an array of "
                              f"the expected type")
    values = field.contents()
    if count is not None and len(values) != count:
        raise _bad(file, key, f"{len(values)} entries, but the vocabulary has {count}")
    return values


def load_gguf_tokenizer(path: Any):
    """The file's tokenizer as a `tokenizers.Tokenizer`, or None when it has none this
    package builds (only byte-level BPE, `tokenizer.ggml.model = "gpt2"`, with a
    pre-tokenizer named in `PRE_TOKENIZERS`).

    Built from the file alone: the vocabulary (`tokenizer.ggml.tokens`), the merges, the
    pre-tokenizer (`tokenizer.ggml.pre`), and the token types: control tokens (type 3, e.g.
    `<|im_start|>`) become special tokens, matched whole in text and skipped when decoding;
    user-defined ones (type 4) are matched whole too. `tokenizer.ggml.add_bos_token` (and
    `add_eos_token`) add the BOS (EOS) id to every encoding.
    """
    import gguf
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    metadata, _ = scan(path)
    file = Path(path)
    if not _tokenizer_supported(metadata):
        return None
    try:
        reader = gguf.GGUFReader(file)
    except Exception as err:  # the scan passed, so this is unexpected: still one clear line
        raise _bad(file, "header", f"gguf.GGUFReader failed ({type(err).__name__}: "
                                   f"{' '.join(str(err).split())})") from None
    tokens = _array(reader, file, "tokenizer.ggml.tokens", {_STRING})
    n = len(tokens)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if len(vocab) != n:
        raise _bad(file, "tokenizer.ggml.tokens", f"{n - len(vocab)} tokens appear twice")
    merges = []
    for j, m in enumerate(_array(reader, file, "tokenizer.ggml.merges", {_STRING})):
        parts = m.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise _bad(file, f"tokenizer.ggml.merges[{j}]", f"{m!r} is not two tokens of the "
                                                            f"vocabulary separated by a space")
        merges.append((parts[0], parts[1]))
    types = (_array(reader, file, "tokenizer.ggml.token_type", _INT_TYPES, n)
             if "tokenizer.ggml.token_type" in reader.fields else [1] * n)
    pre = _get(file, metadata, "tokenizer.ggml.pre", "str", "default")
    space = _get(file, metadata, "tokenizer.ggml.add_space_prefix", "bool", False)
    try:
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    except Exception as err:  # tokenizers raises a bare Exception
        raise _bad(file, "tokenizer.ggml.merges", f"tokenizers refused them ({err})") from None
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated")
              for r in PRE_TOKENIZERS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=space, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])
    bos = _get(file, metadata, "tokenizer.ggml.add_bos_token", "bool", False)
    eos = _get(file, metadata, "tokenizer.ggml.add_eos_token", "bool", False)
    special = [(tokens[tid], tid) for tid in
               [_token_id(file, metadata, w, n) for w, on in (("bos", bos), ("eos", eos)) if on]]
    pieces = ([f"{special[0][0]}:0"] if bos else []) + ["$A:0"] + \
        ([f"{special[-1][0]}:0"] if eos else [])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=" ".join(pieces), special_tokens=special)])
    return tok


def _token_id(file: Path, metadata: dict, which: str, n: int) -> int:
    """`tokenizer.ggml.{which}_token_id`, checked to lie in the vocabulary."""
    key = f"tokenizer.ggml.{which}_token_id"
    tid = _get(file, metadata, key, "int", minimum=0)
    if tid >= n:
        raise _bad(file, key, f"{tid} is outside the vocabulary of {n} tokens")
    return tid


def eos_token_id(info: GGUFInfo) -> int | None:
    """The end-of-sequence id the file names (`tokenizer.ggml.eos_token_id`), or None."""
    tid = info.metadata.get("tokenizer.ggml.eos_token_id")
    return tid if isinstance(tid, int) and 0 <= tid < info.cfg.vocab else None


def _check_messages(messages: Any) -> list[dict]:
    """A chat: a list of `{"role": str, "content": str}` dicts."""
    example = "e.g. [{'role': 'user', 'content': 'Hello'}]"
    if isinstance(messages, str | bytes | dict) or not isinstance(messages, list | tuple):
        raise TypeError(f"`messages` must be a list of {{'role', 'content'}} dicts, {example}, "
                        f"got {validate.describe(messages)}.")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise TypeError(f"`messages[{i}]` must be a dict with str 'role' and 'content', "
                            f"{example}, got {validate.describe(m)}.")
    return [dict(m) for m in messages]


def render_chat(info: GGUFInfo, messages: Sequence[dict], add_generation_prompt: bool = True,
                tokenizer: Any = None) -> str:
    """The file's chat template (`tokenizer.chat_template`, Jinja) applied to `messages`
    (`[{"role": "user", "content": "..."}]`), as transformers' `apply_chat_template` renders
    it: a sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`. `tokenizer`
    (`load_gguf_tokenizer`'s) spells the `bos_token` and `eos_token` the template may use.

    The template comes from an untrusted file, so it runs sandboxed (no attribute access to
    Python internals) and bounded in time, memory and output (`llama.chat_template`); a
    template that fails to render, for any reason, is a ValueError naming the file.

    Args:
      info: `inspect_gguf`'s description of the file.
      messages: a list of `{"role": str, "content": str}` dicts.
      add_generation_prompt: end with the assistant's turn header.
      tokenizer: `load_gguf_tokenizer(info)`, or None.
    """
    from jinja2 import TemplateError

    messages = _check_messages(messages)
    validate.check_bool(add_generation_prompt, "add_generation_prompt")
    template = info.metadata.get("tokenizer.chat_template")
    if not isinstance(template, str):
        raise _bad(info.path, "tokenizer.chat_template", "missing or not a string, so --chat "
                                                         "cannot format the prompt")

    def raise_exception(message):
        raise TemplateError(message)

    names = {}
    for w in ("bos", "eos"):
        tid = info.metadata.get(f"tokenizer.ggml.{w}_token_id")
        if tokenizer is not None and isinstance(tid, int):
            names[w] = tokenizer.id_to_token(tid) or ""
    try:
        return chat_template.render(
            template, messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=names.get("bos", ""), eos_token=names.get("eos", ""),
            raise_exception=raise_exception)
    except Exception as err:  # an untrusted template: any failure of it is the file's
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise _bad(info.path, "tokenizer.chat_template", f"does not render ({detail})") from None
