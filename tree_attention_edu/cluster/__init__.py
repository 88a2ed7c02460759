"""Real processes and a cluster on one machine.

* `launch`: `jax.distributed` workers on localhost (or one process of a SLURM run), with
  teardown on every way out;
* `netns`: network namespaces as nodes and a switch, veth links shaped by `tc ... tbf`,
  teardown and the clearing of what killed runs left behind (by name prefix only);
* `worker`: one `jax.distributed` process (gloo) inside a node: the `("node", "gpu")` and flat
  meshes, each level's α and β, every decode method on the same cache, bytes per level from
  the compiled program, the cost model's prediction;
* `run`: the launcher (`tree-attention-edu cluster`): builds the network, starts and watches
  the workers, tears everything down on every way out, writes the report.

Uses `core` and `perf`; the namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN);
`netns.missing_privileges` says what is missing.
"""
