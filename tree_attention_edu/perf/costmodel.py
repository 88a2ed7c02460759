"""Closed-form costs of tree and ring decoding: steps, bytes on the wire, memory, latency.

The cost model, in one namespace (`from tree_attention_edu.perf import costmodel as cm`).
Its parts live in their own modules, in the order they build on each other:

* `formulas`: steps, bytes, flops and memory in closed form (`reduction_steps`,
  `ring_payload_bytes`, the paper's volumes and memories, the roofline's `kv_read_bytes`,
  `decode_flops` and `decode_intensity`);
* `links`: the alpha-beta model of a topology (`Link`, `Topology`) and the latency of one
  collective over it (`allreduce_time`, ..., `collective_time`);
* `patterns`: the collectives each merge pattern and ring runs (`merge_collectives`,
  `ring_collectives`, `pass_q_collectives`), bytes as `introspect.collective_stats` counts
  them, and what each device sends (`wire_bytes`, `sent_bytes`, `pass_q_crossover`);
* `predict`: the predicted latency of each pattern and ring (`Prediction`, `predict_tree`,
  `predict_ring`, `predict_merge`, `predict_pass_q_ring`, `predict_all`);
* `paper`: the paper's cluster (`DGX_H100`, published figures with their `sources`), its
  microbenchmark, its model (`LLAMA_3_1_8B`, `generation_time`) and its Llama timings
  (`PAPER_LLAMA`, Table 1);
* `crossover`: which merge wins where (`best_merge`, `auto_merge`, `crossover_map`);
* `checks`: the arguments' checks, sympy-aware.

Plain Python arithmetic (no JAX arrays), so it can be read and used without a device. The
byte formulas are checked against what `introspect.collective_stats` measures in the
compiled program, and the latency model is calibrated on the simulated devices by
`calibrate.calibrate` before it is used to extrapolate to `DGX_H100`.

Notation follows the paper: b batch, t = N/p keys per device, n_h heads, d_h head dim,
d = n_h·d_h, p devices.

Every size is a positive int and every rate a positive number; anything else raises a
ValueError or TypeError that names the argument. Sizes may also be sympy symbols in the
byte, flop, step and memory formulas and in the single-algorithm collective times, so that
they can be checked symbolically (`tests/test_costmodel.py`); the functions that compare
times (the cheaper algorithm, a roofline's max, every latency prediction) need numbers, and
name the symbol they were given.
"""

from __future__ import annotations

from ..core.names import MERGE_NAMES
from .checks import MAX_SIZE
from .crossover import auto_merge, best_merge, crossover_map
from .formulas import (
    butterfly_rounds,
    decode_flops,
    decode_intensity,
    kv_read_bytes,
    paper_memory_ring,
    paper_memory_tree,
    paper_volume_ring,
    paper_volume_tree,
    peak_memory_ring,
    peak_memory_tree,
    reduction_steps,
    ring_payload_bytes,
    tree_depth,
    tree_payload_bytes,
)
from .links import (
    COLLECTIVE_KINDS,
    GLOO_ITEMSIZE,
    Collective,
    CollectiveKind,
    Link,
    Topology,
    all_to_all_time,
    allgather_time,
    allreduce_time,
    butterfly_time,
    collective_time,
    collectives_time,
    gloo_ring_time,
    gloo_segments,
    hierarchical_allreduce_time,
    read_curve,
    reduce_scatter_time,
    ring_allreduce_time,
    ring_step_link,
    slowest_link,
    tree_allreduce_time,
)
from .paper import (
    DGX_H100,
    LLAMA_3_1_8B,
    PAPER_LLAMA,
    PAPER_LLAMA_SPEEDUP,
    PAPER_LLAMA_STDERR,
    PAPER_MICROBENCHMARK,
    Microbenchmark,
    ModelShape,
    generation_time,
    paper_microbenchmark,
)
from .patterns import (
    RINGS,
    RingName,
    collective_bytes,
    merge_collectives,
    merge_read_bytes,
    padded_heads,
    pass_q_collectives,
    pass_q_crossover,
    pass_q_heads,
    ring_collectives,
    sent_bytes,
    wire_bytes,
)
from .predict import (
    Prediction,
    fold_time,
    local_decode_time,
    predict_all,
    predict_merge,
    predict_pass_q_ring,
    predict_ring,
    predict_tree,
)

MERGES = MERGE_NAMES
"""The merge patterns, by name: `core.names.MERGE_NAMES` itself (the one definition; the
same names as `core.merges.MERGES`, the registry of their functions), kept here so that
`costmodel.MERGES` reads as before."""

__all__ = [
    "COLLECTIVE_KINDS",
    "DGX_H100",
    "GLOO_ITEMSIZE",
    "LLAMA_3_1_8B",
    "MAX_SIZE",
    "MERGES",
    "PAPER_LLAMA",
    "PAPER_LLAMA_SPEEDUP",
    "PAPER_LLAMA_STDERR",
    "PAPER_MICROBENCHMARK",
    "RINGS",
    "Collective",
    "CollectiveKind",
    "Link",
    "Microbenchmark",
    "ModelShape",
    "Prediction",
    "RingName",
    "Topology",
    "all_to_all_time",
    "allgather_time",
    "allreduce_time",
    "auto_merge",
    "best_merge",
    "butterfly_rounds",
    "butterfly_time",
    "collective_bytes",
    "collective_time",
    "collectives_time",
    "crossover_map",
    "decode_flops",
    "decode_intensity",
    "fold_time",
    "generation_time",
    "gloo_ring_time",
    "gloo_segments",
    "hierarchical_allreduce_time",
    "kv_read_bytes",
    "local_decode_time",
    "merge_collectives",
    "merge_read_bytes",
    "padded_heads",
    "paper_memory_ring",
    "paper_memory_tree",
    "paper_microbenchmark",
    "paper_volume_ring",
    "paper_volume_tree",
    "pass_q_collectives",
    "pass_q_crossover",
    "pass_q_heads",
    "peak_memory_ring",
    "peak_memory_tree",
    "predict_all",
    "predict_merge",
    "predict_pass_q_ring",
    "predict_ring",
    "predict_tree",
    "read_curve",
    "reduce_scatter_time",
    "reduction_steps",
    "ring_allreduce_time",
    "ring_collectives",
    "ring_payload_bytes",
    "ring_step_link",
    "sent_bytes",
    "slowest_link",
    "tree_allreduce_time",
    "tree_depth",
    "tree_payload_bytes",
    "wire_bytes",
]
