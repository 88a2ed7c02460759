"""tree_attention_edu: teach, prove and run Tree Attention (arXiv 2408.04093).

Single device: `attention`, `energy`, `attention_from_energy`, `value_covariance`,
`posterior`, `log_likelihood`, `stationary_point`, `conjugate_energy`, `rate_function`,
`hard_attention`, `gamma_hessian`, and the partial-state algebra (`AttentionState`,
`local_state`, `combine`, `finalize`, `tree_reduce`, `sequential_reduce`).

Many devices: `simulate_devices`, `make_mesh`, `pad_cache`, `tree_decode`,
`tree_decode_from_energy`, `tree_energy`, `ring_decode`, `ring_decode_pass_q`, and
`collective_stats` / `memory_stats` to read the compiled program.

Subpackages, by idea (imports flow one way, from `core` out):

* `core`: the algorithm (numerics, masks, reference, states, merges, kernels, decode,
  devices); it imports nothing else of the package;
* `theory`: energy, bayes, symbolic, hopfield;
* `perf`: introspect, costmodel, calibrate, benchmark;
* `llama`: a Llama decoder with a sharded cache, and its checkpoints;
* `cluster`: real processes (`jax.distributed`);
* `cli`: the `tree-attention-edu` command; `plots`: figures from plain data.
"""

from .core.decode import (
    ring_decode,
    ring_decode_pass_q,
    tree_decode,
    tree_decode_from_energy,
    tree_energy,
)
from .core.devices import make_mesh, pad_cache, simulate_devices
from .core.merges import MERGES
from .core.reference import attention
from .core.states import (
    AttentionState,
    chunk_states,
    combine,
    finalize,
    identity_state,
    local_state,
    sequential_reduce,
    tree_reduce,
)
from .perf.introspect import collective_stats, memory_stats
from .theory.bayes import (
    conjugate_energy,
    gamma_hessian,
    hard_attention,
    log_likelihood,
    map_estimate,
    posterior,
    rate_function,
    stationary_point,
)
from .theory.energy import (
    attention_from_energy,
    energy,
    value_covariance,
    value_covariance_formula,
)


def _version() -> str:
    """The installed distribution's version; pyproject.toml's in an uninstalled checkout."""
    from importlib import metadata

    try:
        return metadata.version("tree_attention_edu")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        if not pyproject.is_file():
            return "0+unknown"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()  # defined once, in pyproject.toml

__all__ = [
    "MERGES",
    "AttentionState",
    "attention",
    "attention_from_energy",
    "chunk_states",
    "collective_stats",
    "combine",
    "conjugate_energy",
    "energy",
    "finalize",
    "gamma_hessian",
    "hard_attention",
    "identity_state",
    "local_state",
    "log_likelihood",
    "make_mesh",
    "map_estimate",
    "memory_stats",
    "pad_cache",
    "posterior",
    "rate_function",
    "ring_decode",
    "ring_decode_pass_q",
    "sequential_reduce",
    "simulate_devices",
    "stationary_point",
    "tree_decode",
    "tree_decode_from_energy",
    "tree_energy",
    "tree_reduce",
    "value_covariance",
    "value_covariance_formula",
]
