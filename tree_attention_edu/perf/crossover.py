"""Which merge pattern wins where: `best_merge` (the fastest predicted), `auto_merge` (the
policy behind `tree_decode(merge="auto")`) and `crossover_map` (the winner over device
counts and batch × heads).

Each compares `predict.predict_merge`'s totals, so it needs numbers, never symbols. The
defaults are the paper's cluster (`paper.DGX_H100`, published figures only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..core import merges, validate
from ..core.names import MERGE_NAMES, MergeName
from .checks import check_patterns, check_size, check_sizes
from .links import Topology
from .paper import DGX_H100
from .predict import predict_merge


def best_merge(
    seq_len: int,
    topo: Topology,
    *,
    batch: int = 1,
    q_heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    v_dim: int | None = None,
    itemsize: int = 2,
    q_len: int = 1,
    stat_itemsize: int = 4,
    patterns: Sequence[MergeName] = MERGE_NAMES,
) -> MergeName:
    """The merge pattern `predict_merge` finds fastest (`total_s`) among `patterns`; a tie
    goes to "allreduce" (the paper's), then to the earlier pattern in `MERGE_NAMES`.

    "one_pass" is priced by its fast path: it never loses to "allreduce" (one all-reduce
    fewer), so leave it out of `patterns` where the fallback would run often.
    """
    names = check_patterns(patterns)
    shape: dict[str, Any] = dict(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        itemsize=itemsize,
        q_len=q_len,
        stat_itemsize=stat_itemsize,
    )
    order = sorted(set(names), key=lambda m: (m != "allreduce", MERGE_NAMES.index(m)))
    times = {m: predict_merge(m, seq_len, topo, **shape).total_s for m in order}
    best = order[0]
    for m in order[1:]:
        if times[m] < times[best] * (1 - 1e-12):
            best = m
    return best


def auto_merge(problem: merges.MergeProblem) -> MergeName:
    """The policy behind `tree_decode(merge="auto")` (the one `core.merges.DEFAULT_POLICY`
    names, unless the caller passes another): the pattern `best_merge`
    predicts fastest among `core.merges.AUTO_MERGES`, on DGX H100 links shaped like the
    mesh: the innermost sequence axis inside a node, the others across nodes.

    An empty problem (`batch`, `q_len` or `q_heads` 0) has nothing to merge; it gets
    "allreduce"."""
    validate.check_instance(
        problem,
        merges.MergeProblem,
        "problem",
        "tree_decode(merge='auto') builds one; pass a core.merges.MergeProblem",
    )
    for name in ("batch", "q_len", "q_heads"):
        validate.check_int(getattr(problem, name), f"problem.{name}", minimum=0)
    for name in ("kv_heads", "head_dim", "v_dim", "kv_len"):
        check_size(getattr(problem, name), f"problem.{name}")
    sizes = validate.check_sizes_list(problem.axis_sizes, "problem.axis_sizes", "(2, 4)")
    validate.check_float_dtype(problem.dtype, "problem.dtype")
    if 0 in (problem.batch, problem.q_len, problem.q_heads):
        return "allreduce"
    per_node = sizes[-1]
    topo = replace(DGX_H100, nodes=math.prod(sizes) // per_node, devices_per_node=per_node)
    itemsize = int(np.dtype(problem.dtype).itemsize)
    return best_merge(
        problem.kv_len,
        topo,
        batch=problem.batch,
        q_heads=problem.q_heads,
        kv_heads=problem.kv_heads,
        head_dim=problem.head_dim,
        v_dim=problem.v_dim,
        itemsize=itemsize,
        q_len=problem.q_len,
        stat_itemsize=8 if itemsize == 8 else 4,
        patterns=merges.AUTO_MERGES,
    )


def crossover_map(
    topo: Topology | None = None,
    *,
    ps: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128),
    batch_heads: tuple[int, ...] = (16, 64, 256, 1024, 4096, 16384, 65536),
    seq_len: int = 1_048_576,
    q_heads: int = 16,
    kv_heads: int | None = None,
    head_dim: int = 128,
    itemsize: int = 2,
    q_len: int = 1,
    stat_itemsize: int = 4,
    patterns: Sequence[MergeName] = MERGE_NAMES,
) -> dict:
    """Which merge pattern wins as a function of the device count p and of batch × heads.

    For each `p` in `ps` (whole nodes of `topo` beyond one, `Topology.with_devices`) and each
    `B·Hq` in `batch_heads` (multiples of `q_heads`: the batch is `B·Hq / q_heads`), the
    predicted latency of every pattern. Defaults: `DGX_H100` (published figures, see its
    `sources`) and the paper's microbenchmark (16 heads × 128, bf16) at 1M keys.

    The sequence length changes only the local kernel, which every pattern shares, so it
    moves no boundary between merge patterns.

    Returns plain data: `{"ps": [...], "batch_heads": [...], "patterns": [...],
    "winner": [[name per p] per batch_heads], "seconds": {pattern: [[...]]},
    "speedup": [[allreduce / winner]], "topology": name}`.
    """
    topo = DGX_H100 if topo is None else topo
    validate.check_instance(topo, Topology, "topo", "e.g. DGX_H100")
    ps_list = validate.check_sizes_list(ps, "ps", "(8, 16, 32)")
    bhs = validate.check_sizes_list(batch_heads, "batch_heads", "(16, 256, 4096)")
    check_sizes(q_heads=q_heads)
    for i, bh in enumerate(bhs):
        validate.check_multiple_of(bh, f"batch_heads[{i}]", q_heads, "q_heads")
    names = check_patterns(patterns)
    seconds = {m: [[0.0] * len(ps_list) for _ in bhs] for m in names}
    winner: list[list[str]] = [[""] * len(ps_list) for _ in bhs]
    speedup = [[1.0] * len(ps_list) for _ in bhs]
    shape: dict[str, Any] = dict(
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        itemsize=itemsize,
        q_len=q_len,
        stat_itemsize=stat_itemsize,
    )
    for j, p in enumerate(ps_list):
        t = topo.with_devices(p)
        for i, bh in enumerate(bhs):
            for m in names:
                seconds[m][i][j] = predict_merge(
                    m, seq_len, t, batch=bh // q_heads, **shape
                ).total_s
            best = best_merge(seq_len, t, batch=bh // q_heads, patterns=tuple(names), **shape)
            winner[i][j] = best
            ref = seconds["allreduce"][i][j] if "allreduce" in seconds else seconds[best][i][j]
            speedup[i][j] = ref / seconds[best][i][j]
    return {
        "ps": ps_list,
        "batch_heads": bhs,
        "patterns": list(names),
        "winner": winner,
        "seconds": seconds,
        "speedup": speedup,
        "seq_len": seq_len,
        "topology": topo.name,
    }
