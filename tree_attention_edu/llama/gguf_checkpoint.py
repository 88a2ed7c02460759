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

**Untrusted input.** A GGUF file is parsed before `gguf.GGUFReader` sees it
(`llama.gguf_scan.scan`): every length, count, dimension, type and offset is checked against
the file's size and against fixed limits, so a truncated or hostile file fails with a
ValueError that names the file and the field, in time and memory proportional to the file,
before anything is allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike

from ..core import validate
from . import chat_template
from .checkpoint import aligned_empty, check_weight_dtype
from .config import Config, Params
from .gguf_scan import (
    BOOL_TYPE,
    FLOAT_TYPES,
    INT_TYPES,
    STRING_TYPE,
    Metadata,
    TensorEntry,
    not_gguf,
    scan,
)
from .paths import StrPath

if TYPE_CHECKING:
    from gguf import GGUFReader
    from tokenizers import Tokenizer
    from tokenizers.processors import PostProcessor

ROW_CHUNK_BYTES = 1 << 24  # dequantise about 16 MB of float32 at a time


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


# --- metadata -> Config ---------------------------------------------------------------------


def _get(
    file: Path,
    metadata: Metadata,
    key: str,
    kind: str,
    default: Any = None,
    minimum: float | None = 1,
) -> Any:
    """`metadata[key]` checked to be `kind` ("int", "real", "bool", "str"); `default` when
    absent (None: required)."""
    if key not in metadata:
        if default is None:
            raise not_gguf(file, key, 'missing; a llama GGUF file names its sizes under "llama.*"')
        return default
    vtype, value = metadata[key]
    ok = {
        "int": vtype in INT_TYPES,
        "real": vtype in FLOAT_TYPES | INT_TYPES,
        "bool": vtype == BOOL_TYPE,
        "str": vtype == STRING_TYPE,
    }[kind]
    if ok and kind == "real":
        ok = math.isfinite(value) and (minimum is None or value > minimum)
    if ok and kind == "int":
        ok = minimum is None or value >= minimum
    if not ok:
        want = {
            "int": f"an integer >= {minimum}",
            "real": "a finite number" + (f" > {minimum:g}" if minimum is not None else ""),
            "bool": "a bool",
            "str": "a string",
        }[kind]
        shown = value if not isinstance(value, tuple) else f"an array of {value[2]} items"
        raise not_gguf(file, key, f"must be {want}, got {shown!r} (value type {vtype})")
    return value


def config_from_gguf(file: Path, metadata: Metadata, tensors: dict[str, TensorEntry]) -> Config:
    """`model.Config` of a llama GGUF file's metadata (sizes under `llama.*`)."""
    arch = _get(file, metadata, "general.architecture", "str")
    if arch != "llama":
        raise not_gguf(
            file, "general.architecture", f'{arch!r}; the loader reads Llama models ("llama")'
        )
    a = arch + "."
    layers = _get(file, metadata, a + "block_count", "int")
    if 9 * layers + 2 > len(tensors):  # 9 per layer, the embedding and the final norm
        raise not_gguf(
            file,
            a + "block_count",
            f"{layers} layers, but the file holds only "
            f"{len(tensors)} tensors (9 per layer and 2 more)",
        )
    dim = _get(file, metadata, a + "embedding_length", "int")
    heads = _get(file, metadata, a + "attention.head_count", "int")
    kv_heads = _get(file, metadata, a + "attention.head_count_kv", "int", heads)
    if heads % kv_heads:
        raise not_gguf(
            file,
            a + "attention.head_count_kv",
            f"{kv_heads} kv heads do not divide {heads} query heads",
        )
    if dim % heads and a + "attention.key_length" not in metadata:
        raise not_gguf(
            file,
            a + "attention.head_count",
            f"{heads} heads do not divide the embedding length {dim}",
        )
    head_dim = _get(file, metadata, a + "attention.key_length", "int", dim // heads)
    if _get(file, metadata, a + "attention.value_length", "int", head_dim) != head_dim:
        raise not_gguf(file, a + "attention.value_length", "differs from the key length")
    if head_dim % 2:
        raise not_gguf(
            file, a + "attention.key_length", f"{head_dim} is odd; rotary embeddings rotate pairs"
        )
    rotary = _get(file, metadata, a + "rope.dimension_count", "int", head_dim)
    if rotary != head_dim:
        raise not_gguf(
            file,
            a + "rope.dimension_count",
            f"{rotary} rotary dimensions of {head_dim}; partial rotary is not read",
        )
    scaling = _get(file, metadata, a + "rope.scaling.type", "str", "none")
    if scaling != "none" or "rope_freqs.weight" in tensors:
        raise not_gguf(
            file,
            a + "rope.scaling.type",
            "rescaled rotary frequencies (linear, yarn, or Llama 3.1's rope_freqs) are not read",
        )
    if "token_embd.weight" not in tensors:
        raise not_gguf(file, "token_embd.weight", "missing")
    vocab = _get(file, metadata, a + "vocab_size", "int", tensors["token_embd.weight"].shape[0])
    try:
        return Config(
            vocab=vocab,
            dim=dim,
            layers=layers,
            q_heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            hidden=_get(file, metadata, a + "feed_forward_length", "int"),
            rope_theta=float(_get(file, metadata, a + "rope.freq_base", "real", 10000.0, 0.0)),
            norm_eps=float(
                _get(file, metadata, a + "attention.layer_norm_rms_epsilon", "real", 1e-5, 0.0)
            ),
            tie_embeddings="output.weight" not in tensors,
        )
    except (ValueError, TypeError) as err:
        raise not_gguf(file, "metadata", str(err)) from None


def layout(cfg: Config) -> list[tuple[str, tuple, tuple[int, ...], bool]]:
    """(GGUF name, params path, numpy shape, transpose?) for every weight of `cfg`."""
    qd, kd = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    out: list[tuple[str, tuple, tuple[int, ...], bool]] = [
        ("token_embd.weight", ("embed",), (cfg.vocab, cfg.dim), False)
    ]
    for i in range(cfg.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", ("layers", i, "attn_norm"), (cfg.dim,), False),
            (b + "attn_q.weight", ("layers", i, "wq"), (qd, cfg.dim), True),
            (b + "attn_k.weight", ("layers", i, "wk"), (kd, cfg.dim), True),
            (b + "attn_v.weight", ("layers", i, "wv"), (kd, cfg.dim), True),
            (b + "attn_output.weight", ("layers", i, "wo"), (cfg.dim, qd), True),
            (b + "ffn_norm.weight", ("layers", i, "mlp_norm"), (cfg.dim,), False),
            (b + "ffn_gate.weight", ("layers", i, "w_gate"), (cfg.hidden, cfg.dim), True),
            (b + "ffn_up.weight", ("layers", i, "w_up"), (cfg.hidden, cfg.dim), True),
            (b + "ffn_down.weight", ("layers", i, "w_down"), (cfg.dim, cfg.hidden), True),
        ]
    out.append(("output_norm.weight", ("final_norm",), (cfg.dim,), False))
    if not cfg.tie_embeddings:
        out.append(("output.weight", ("unembed",), (cfg.vocab, cfg.dim), True))
    return out


def inspect_gguf(path: StrPath) -> GGUFInfo:
    """Read a GGUF file's metadata and tensor table (no weights) and check them.

    Raises a ValueError naming the file and the field: a malformed or truncated file
    (`scan`), another architecture, sizes that disagree, a missing, unexpected or misshapen
    tensor, a tensor type the loader does not dequantise (see `gguf_scan.TYPES`).
    """
    metadata, tensors = scan(path)
    file = Path(path)
    cfg = config_from_gguf(file, metadata, tensors)
    wanted = layout(cfg)
    for name, _, shape, _ in wanted:
        if name not in tensors:
            raise not_gguf(
                file,
                name,
                f"missing (the metadata implies {cfg.layers} layers and a "
                f"tensor of shape {list(shape)})",
            )
        if tensors[name].shape != shape:
            raise not_gguf(
                file,
                name,
                f"shape {list(tensors[name].shape)}, but the metadata implies {list(shape)}",
            )
    extra = set(tensors) - {name for name, *_ in wanted}
    if extra:
        raise not_gguf(
            file,
            sorted(extra)[0],
            "not a weight of the Llama model the metadata describes (a bias, an extra layer?)",
        )
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


def _dequantize_into(
    dest: np.ndarray, data: np.memmap, entry: TensorEntry, transpose: bool, rows: np.ndarray | None
) -> None:
    """Dequantise `entry` (numpy shape `[out, in]`, or `[n]`) into `dest`, a block of rows at
    a time: `dest = W.T` when `transpose`, else `W`, where `W[r] = stored[rows[r]]`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[entry.type]
    raw = data[entry.offset : entry.offset + entry.nbytes]
    if len(entry.shape) == 1:
        np.copyto(dest, gguf.quants.dequantize(raw, qtype), casting="unsafe")
        return
    n_rows, n_cols = entry.shape
    raw = raw.reshape(n_rows, -1)
    src = np.arange(n_rows) if rows is None else rows
    step = max(1, ROW_CHUNK_BYTES // (4 * n_cols))
    for r0 in range(0, n_rows, step):
        block = gguf.quants.dequantize(raw[src[r0 : r0 + step]], qtype)  # [step, in] float32
        if transpose:
            np.copyto(dest[:, r0 : r0 + step], block.T, casting="unsafe")
        else:
            np.copyto(dest[r0 : r0 + step], block, casting="unsafe")


def load_gguf(
    path: StrPath, *, dtype: DTypeLike | None = np.float32, mesh: Mesh | None = None
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
                raise not_gguf(info.path, name, "holds NaN or inf weights")
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
    "default": (),
    "gpt2": (),
    "gpt-2": (),
    "mpt": (),
    "olmo": (),
    "smollm": (_DIGITS,),
    "starcoder": (_DIGITS,),
    "refact": (_DIGITS,),
    "codeshell": (_DIGITS,),
    "command-r": (_DIGITS,),
}
"""`tokenizer.ggml.pre` values the tokenizer builder knows, and the regexes each applies
before GPT-2's byte-level split (e.g. "smollm": every digit on its own first)."""

_CONTROL, _USER_DEFINED = 3, 4  # llama_token_type


def _tokenizer_supported(metadata: Metadata) -> bool:
    model = metadata.get("tokenizer.ggml.model", (None, None))[1]
    pre = metadata.get("tokenizer.ggml.pre", (None, "default"))[1]
    return model == "gpt2" and pre in PRE_TOKENIZERS and "tokenizer.ggml.tokens" in metadata


def _array(
    reader: GGUFReader, file: Path, key: str, etypes: set[int], count: int | None = None
) -> list:
    """A metadata array read through `gguf.GGUFReader`, its element type checked."""
    field = reader.fields.get(key)
    if field is None:
        raise not_gguf(file, key, "missing")
    import gguf

    if field.types[0] != gguf.GGUFValueType.ARRAY or int(field.types[-1]) not in etypes:
        raise not_gguf(
            file,
            key,
            f"value type {[t.name for t in field.types]}, not an array of the expected type",
        )
    values = field.contents()
    if count is not None and len(values) != count:
        raise not_gguf(file, key, f"{len(values)} entries, but the vocabulary has {count}")
    return values


def load_gguf_tokenizer(path: StrPath) -> Tokenizer | None:
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

    metadata, _ = scan(path)
    file = Path(path)
    if not _tokenizer_supported(metadata):
        return None
    try:
        reader = gguf.GGUFReader(file)
    except Exception as err:  # the scan passed, so this is unexpected: still one clear line
        raise not_gguf(
            file,
            "header",
            f"gguf.GGUFReader failed ({type(err).__name__}: {' '.join(str(err).split())})",
        ) from None
    tokens, vocab, merges, types = _read_vocabulary(reader, file)
    tok = _byte_level_bpe(file, metadata, vocab, merges)
    _add_whole_tokens(tok, tokens, types)
    tok.post_processor = _post_processor(file, metadata, tokens)
    return tok


def _read_vocabulary(
    reader: GGUFReader, file: Path
) -> tuple[list[str], dict[str, int], list[tuple[str, str]], list[int]]:
    """`(tokens, vocab, merges, types)`: the token strings in id order, each string's first
    id, the BPE merges as pairs of tokens, and each token's `llama_token_type`."""
    tokens = _array(reader, file, "tokenizer.ggml.tokens", {STRING_TYPE})
    n = len(tokens)
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if len(vocab) != n:
        raise not_gguf(file, "tokenizer.ggml.tokens", f"{n - len(vocab)} tokens appear twice")
    merges = []
    for j, m in enumerate(_array(reader, file, "tokenizer.ggml.merges", {STRING_TYPE})):
        parts = m.split(" ")
        if len(parts) != 2 or parts[0] not in vocab or parts[1] not in vocab:
            raise not_gguf(
                file,
                f"tokenizer.ggml.merges[{j}]",
                f"{m!r} is not two tokens of the vocabulary separated by a space",
            )
        merges.append((parts[0], parts[1]))
    types = (
        _array(reader, file, "tokenizer.ggml.token_type", INT_TYPES, n)
        if "tokenizer.ggml.token_type" in reader.fields
        else [1] * n
    )
    return tokens, vocab, merges, types


def _byte_level_bpe(
    file: Path, metadata: Metadata, vocab: dict[str, int], merges: list[tuple[str, str]]
) -> Tokenizer:
    """The BPE model with the file's pre-tokenizer (`PRE_TOKENIZERS`) and byte-level decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = _get(file, metadata, "tokenizer.ggml.pre", "str", "default")
    space = _get(file, metadata, "tokenizer.ggml.add_space_prefix", "bool", False)
    try:
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    except Exception as err:  # tokenizers raises a bare Exception
        raise not_gguf(file, "tokenizer.ggml.merges", f"tokenizers refused them ({err})") from None
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=space, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_whole_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special tokens, user-defined ones added tokens: both are matched
    whole in text."""
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )


def _post_processor(file: Path, metadata: Metadata, tokens: list[str]) -> PostProcessor:
    """Byte-level offsets, and the BOS (EOS) id added to every encoding when the file asks."""
    from tokenizers import processors

    n = len(tokens)
    bos = _get(file, metadata, "tokenizer.ggml.add_bos_token", "bool", False)
    eos = _get(file, metadata, "tokenizer.ggml.add_eos_token", "bool", False)
    special = [
        (tokens[tid], tid)
        for tid in [_token_id(file, metadata, w, n) for w, on in (("bos", bos), ("eos", eos)) if on]
    ]
    pieces = (
        ([f"{special[0][0]}:0"] if bos else [])
        + ["$A:0"]
        + ([f"{special[-1][0]}:0"] if eos else [])
    )
    return processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=" ".join(pieces), special_tokens=special),
        ]
    )


def _token_id(file: Path, metadata: Metadata, which: str, n: int) -> int:
    """`tokenizer.ggml.{which}_token_id`, checked to lie in the vocabulary."""
    key = f"tokenizer.ggml.{which}_token_id"
    tid = _get(file, metadata, key, "int", minimum=0)
    if tid >= n:
        raise not_gguf(file, key, f"{tid} is outside the vocabulary of {n} tokens")
    return tid


def eos_token_id(info: GGUFInfo) -> int | None:
    """The end-of-sequence id the file names (`tokenizer.ggml.eos_token_id`), or None."""
    tid = info.metadata.get("tokenizer.ggml.eos_token_id")
    return tid if isinstance(tid, int) and 0 <= tid < info.cfg.vocab else None


def _check_messages(messages: Any) -> list[dict]:
    """A chat: a list of `{"role": str, "content": str}` dicts."""
    example = "e.g. [{'role': 'user', 'content': 'Hello'}]"
    if isinstance(messages, str | bytes | dict) or not isinstance(messages, list | tuple):
        raise TypeError(
            f"`messages` must be a list of {{'role', 'content'}} dicts, {example}, "
            f"got {validate.describe(messages)}."
        )
    for i, m in enumerate(messages):
        if not (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
        ):
            raise TypeError(
                f"`messages[{i}]` must be a dict with str 'role' and 'content', "
                f"{example}, got {validate.describe(m)}."
            )
    return [dict(m) for m in messages]


def render_chat(
    info: GGUFInfo,
    messages: Sequence[dict],
    add_generation_prompt: bool = True,
    tokenizer: Tokenizer | None = None,
) -> str:
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
        raise not_gguf(
            info.path,
            "tokenizer.chat_template",
            "missing or not a string, so --chat cannot format the prompt",
        )

    def raise_exception(message):
        raise TemplateError(message)

    names = {}
    for w in ("bos", "eos"):
        tid = info.metadata.get(f"tokenizer.ggml.{w}_token_id")
        if tokenizer is not None and isinstance(tid, int):
            names[w] = tokenizer.id_to_token(tid) or ""
    try:
        return chat_template.render(
            template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=names.get("bos", ""),
            eos_token=names.get("eos", ""),
            raise_exception=raise_exception,
        )
    except Exception as err:  # an untrusted template: any failure of it is the file's
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise not_gguf(
            info.path, "tokenizer.chat_template", f"does not render ({detail})"
        ) from None
