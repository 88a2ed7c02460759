"""tree_attention_edu: teach, prove and run Tree Attention (arXiv 2408.04093).

Single device: `attention`, `energy`, `attention_from_energy`, `value_covariance`,
`posterior`, `log_likelihood`, `map_estimate`, and the partial-state algebra
(`AttentionState`, `local_state`, `combine`, `finalize`, `tree_reduce`, `sequential_reduce`).

Many devices: `simulate_devices`, `make_mesh`, `tree_decode`, `tree_decode_from_energy`,
`ring_decode`, and `collective_stats` / `memory_stats` to read the compiled program.

Submodules: `kernels` (the streaming local kernel), `costmodel` and `calibrate` (latency
model and its calibration), `model` (a decoder with a sharded KV cache), `hopfield`
(associative memory).
"""

from .attention import attention
from .bayes import log_likelihood, map_estimate, posterior
from .decode import ring_decode, tree_decode, tree_decode_from_energy
from .devices import make_mesh, simulate_devices
from .energy import attention_from_energy, energy, value_covariance, value_covariance_formula
from .introspect import collective_stats, memory_stats
from .states import (
    AttentionState,
    chunk_states,
    combine,
    finalize,
    identity_state,
    local_state,
    sequential_reduce,
    tree_reduce,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionState",
    "attention",
    "attention_from_energy",
    "chunk_states",
    "collective_stats",
    "combine",
    "energy",
    "finalize",
    "identity_state",
    "local_state",
    "log_likelihood",
    "make_mesh",
    "map_estimate",
    "memory_stats",
    "posterior",
    "ring_decode",
    "sequential_reduce",
    "simulate_devices",
    "tree_decode",
    "tree_decode_from_energy",
    "tree_reduce",
    "value_covariance",
    "value_covariance_formula",
]
