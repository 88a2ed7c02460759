"""Real processes: `launch` starts `jax.distributed` workers on this machine or reads
SLURM's environment on a cluster. Uses `core` and `perf`."""
