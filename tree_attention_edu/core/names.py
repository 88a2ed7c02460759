"""The names of every string choice the package takes, typed once as `Literal`s.

`jax.nn.dot_product_attention` types its `implementation` the same way. Each tuple beside a
type is the type's values, read from it (`typing.get_args`), so the two cannot drift; the
registries that map these names to functions (`merges.MERGES`, `kernels.KERNELS`) are
checked against them by the tests.
"""

from __future__ import annotations

from typing import Literal, get_args

Layout = Literal["bthd", "bhtd"]
"""A K/V cache's axis order: `[B, Tk, Hkv, D]` ("bthd", the default) or head-major
`[B, Hkv, Tk, D]` ("bhtd", the layout the xla kernel streams fastest)."""
LAYOUTS: tuple[Layout, ...] = get_args(Layout)

KernelName = Literal["xla", "flash", "cudnn"]
"""A local kernel (`core.kernels.KERNELS`)."""
KernelChoice = Literal["auto", "xla", "flash", "cudnn"]
"""`local_kernel=`: a kernel, or "auto" (the fastest that can take the inputs)."""
KERNEL_CHOICES: tuple[KernelChoice, ...] = get_args(KernelChoice)

MergeName = Literal[
    "allreduce", "allgather", "reduce_scatter", "all_to_all", "one_pass", "butterfly"
]
"""A merge pattern (`core.merges.MERGES`)."""
MergeChoice = Literal[
    "allreduce", "allgather", "reduce_scatter", "all_to_all", "one_pass", "butterfly", "auto"
]
"""`merge=`: a pattern, or "auto" (the registered policy's pick)."""
MERGE_NAMES: tuple[MergeName, ...] = get_args(MergeName)
MERGE_CHOICES: tuple[MergeChoice, ...] = get_args(MergeChoice)

Method = Literal["single", "tree", "tree_energy", "ring", "ring_pass_q"]
"""A way to decode: "single" (one device, the whole cache), "tree" (`tree_decode`),
"tree_energy" (`tree_decode_from_energy`), "ring" (`ring_decode`) and "ring_pass_q"
(`ring_decode_pass_q`). The benchmark, the Llama generator and the cluster each run a
subset of these, named by these strings."""
METHODS: tuple[Method, ...] = get_args(Method)
