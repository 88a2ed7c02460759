"""The paper's experiments, shared by notebooks and tests: its cluster (`DGX_H100`, published
figures with their `sources`), its microbenchmark (`PAPER_MICROBENCHMARK`,
`paper_microbenchmark`), its model (`LLAMA_3_1_8B`, `generation_time`) and its Llama
timings (`PAPER_LLAMA`, Table 1).

Nothing here was tuned to the paper's timings: the cluster's figures are datasheets and
published measurements, and the predictions are `predict.predict_tree` / `predict_ring`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from ..core import inputs, validate
from .checks import check_concrete_sizes, check_size, check_sizes
from .links import Link, Topology
from .predict import Prediction, predict_ring, predict_tree

DGX_H100 = Topology(
    nodes=16,
    devices_per_node=8,
    intra=Link(alpha_s=6e-6, beta_Bps=450e9),
    inter=Link(alpha_s=46e-6, beta_Bps=50e9),
    mem_Bps=3.35e12,
    flops=989e12,
    overhead_s=0.0,
    overlap=True,
    name="DGX H100 (8 GPUs/node, NVLink 4, 400 Gb/s NDR per GPU)",
    sources=(
        "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM5 HBM3 3.35 TB/s; 1,979 TFLOP/s bf16 "
        "with sparsity, so 989 TFLOP/s dense.",
        "NVIDIA DGX H100 user guide: 8 GPUs per node on NVLink 4, 900 GB/s bidirectional per "
        "GPU (450 GB/s per direction); 8 ConnectX-7 ports, 400 Gb/s NDR InfiniBand each "
        "(50 GB/s per GPU).",
        "alpha is the latency of one step of a collective algorithm (one exchange between "
        "partners): a ring allreduce takes 2(p-1) steps, recursive doubling ceil(log2 p). On "
        "2 ranks the model runs recursive doubling (the cheaper of the two: one step for the "
        "same bytes), so a measured 2-rank small-message allreduce is one alpha.",
        "alpha inside a node: a small-message allreduce on 2 H100s with NVLS and CUDA graphs "
        "takes 5.5-6 us (github.com/NVIDIA/nccl/issues/1259), so alpha = 6 us.",
        "alpha across nodes: a small-message allreduce across 2 nodes takes about 46 us "
        "(github.com/NVIDIA/nccl/issues/1244), so alpha = 46 us.",
    ),
)
"""The paper's cluster (Section 6): DGX H100 nodes. Published figures only (`sources`);
nothing here was tuned to the paper's timings."""


class Microbenchmark(TypedDict):
    """The sizes of a microbenchmark, as `predict_tree` and `predict_ring` take them."""

    batch: int
    q_heads: int
    head_dim: int
    itemsize: int


PAPER_MICROBENCHMARK = Microbenchmark(batch=1, q_heads=16, head_dim=128, itemsize=2)
"""The paper's microbenchmark (Section 6.1, Fig. 3): one attention block of 16 heads of
dimension 128 in bf16 (Section 5.3: "All computations are performed in BF16"). The batch is
not stated; 1 here."""


def paper_microbenchmark(seq_len: int, p: int, topo: Topology = DGX_H100) -> dict[str, Prediction]:
    """Predicted latency of one decode step of the paper's microbenchmark on `p` devices of
    `topo` (whole nodes beyond one): `{"tree": Prediction, "ring": Prediction}`."""
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100")
    check_size(p, "p")
    check_concrete_sizes("a latency prediction compares times", seq_len=seq_len)
    if p > seq_len:
        raise ValueError(
            f"`p` = {p} devices for `seq_len` = {seq_len} keys leaves some "
            f"devices without a key; use p <= seq_len."
        )
    topo = topo.with_devices(p)
    return {
        "tree": predict_tree(seq_len, topo, **PAPER_MICROBENCHMARK),
        "ring": predict_ring(seq_len, topo, **PAPER_MICROBENCHMARK),
    }


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that the latency model needs.

    `layers` × [attention: `wq [dim, Hq·D]`, `wk, wv [dim, Hkv·D]`, `wo [Hq·D, dim]`; SwiGLU
    MLP: three `[dim, hidden]` matrices; two RMSNorm gains `[dim]`], a final RMSNorm, and an
    embedding `[vocab, dim]` plus an output projection of the same size unless tied (the
    layout of `tree_attention_edu.llama.model`). `itemsize` is the bytes per weight.
    """

    layers: int
    dim: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    tie_embeddings: bool = False
    itemsize: int = 2
    name: str = ""
    sources: tuple[str, ...] = ()

    def __post_init__(self):
        check_sizes(
            layers=self.layers,
            dim=self.dim,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            hidden=self.hidden,
            vocab=self.vocab,
            itemsize=self.itemsize,
        )
        inputs.check_head_groups(self.q_heads, self.kv_heads)
        validate.check_bool(self.tie_embeddings, "tie_embeddings")

    @property
    def params(self) -> int:
        """Number of weights."""
        attn = self.dim * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        layer = attn + 3 * self.dim * self.hidden + 2 * self.dim
        embed = self.vocab * self.dim * (1 if self.tie_embeddings else 2)
        return self.layers * layer + self.dim + embed

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights, all read once per decoded token."""
        return self.params * self.itemsize


LLAMA_3_1_8B = ModelShape(
    layers=32,
    dim=4096,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    hidden=14336,
    vocab=128256,
    tie_embeddings=False,
    itemsize=2,
    name="Llama 3.1-8B (bf16)",
    sources=(
        "Grattafiori et al., The Llama 3 Herd of Models (arXiv 2407.21783), Table 3: "
        "8B: 32 layers, model dim 4096, FFN dim 14336, 32 attention heads, 8 key/value "
        "heads, vocabulary 128,256.",
    ),
)
"""The model of the paper's Section 6.4: 8,030,261,248 weights (`params`), 16.06 GB in bf16."""


def generation_time(
    seq_len: int, topo: Topology, *, model: ModelShape = LLAMA_3_1_8B, tokens: int = 10
) -> dict[str, float]:
    """Predicted seconds to decode `tokens` tokens after a context of `seq_len`, with the KV
    cache sharded over `topo`'s devices: `{"tree": seconds, "ring": seconds}`.

    Each token runs one attention decode step per layer over the whole context
    (`predict_tree` / `predict_ring`), and the rest of the model, whose weights every
    device reads once per token when only the sequence is sharded: `weight_bytes / mem_Bps`,
    the same for both methods. The prefill is not included.
    """
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100.with_devices(8)")
    validate.check_instance(model, ModelShape, "model", "e.g. LLAMA_3_1_8B")
    check_size(tokens, "tokens")
    shape: dict[str, Any] = dict(
        q_heads=model.q_heads,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        itemsize=model.itemsize,
    )
    weights_s = model.weight_bytes / topo.mem_Bps
    return {
        method: tokens * (model.layers * predict(seq_len, topo, **shape).total_s + weights_s)
        for method, predict in (("tree", predict_tree), ("ring", predict_ring))
    }


PAPER_LLAMA: dict[str, dict[int, tuple[float, float]]] = {
    "8x H100": {
        32768: (0.60, 2.57),
        65536: (1.08, 4.42),
        131072: (2.68, 6.38),
        262144: (2.89, 8.19),
    },
    "4x MI300X": {
        32768: (1.05, 3.57),
        65536: (2.36, 7.33),
        131072: (6.43, 16.40),
        262144: (15.30, 35.12),
    },
}
"""The paper's Table 1 (Section 6.4): Llama 3.1-8B, seconds for a prefill plus 10 decoded
tokens, `(tree, ring)`, mean of 10 runs, per hardware and context length. The paper writes
32k ... 256k; read here as 32·1024 ... 256·1024 tokens."""

PAPER_LLAMA_STDERR: dict[str, dict[int, tuple[float, float]]] = {
    "8x H100": {
        32768: (0.15, 0.35),
        65536: (0.10, 0.38),
        131072: (0.28, 0.58),
        262144: (0.62, 1.07),
    },
    "4x MI300X": {
        32768: (0.01, 0.25),
        65536: (0.01, 0.25),
        131072: (0.25, 0.40),
        262144: (4.93, 5.02),
    },
}
"""The standard errors (±) of `PAPER_LLAMA`, `(tree, ring)`, from the same table."""

PAPER_LLAMA_SPEEDUP: dict[str, dict[int, int]] = {
    "8x H100": {32768: 4, 65536: 4, 131072: 2, 262144: 3},
    "4x MI300X": {32768: 3, 65536: 3, 131072: 3, 262144: 2},
}
"""The table's "Speedup" column (×): ring over tree, rounded to a whole number."""
