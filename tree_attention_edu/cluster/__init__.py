"""Real processes and a cluster on one machine. Library functions only: the commands are
`tree-attention-edu launch` and `tree-attention-edu cluster` (`cli/`), and every worker
process is started as `python -m tree_attention_edu.cli.worker SPEC.json`.

* `processes`: what both launchers share: worker specs (JSON), starting and watching the
  workers, teardown on every way out, and each worker's guard against outliving its launcher;
* `launch`: `jax.distributed` workers on localhost (or one process of a SLURM run) decoding
  one problem with tree and ring, checked against a float64 reference;
* `netns`: network namespaces as nodes and a switch, veth links shaped by `tc ... tbf`,
  teardown and the clearing of what killed runs left behind (by name prefix only);
* `delay`: links with a set one-way delay (this kernel has no `netem`): a TUN device per
  node and a forwarder process that holds each packet; `probe` measures a link's round
  trip and rate (`tree-attention-edu cluster --probe`); `collectives` times tiny XLA:CPU
  collectives at several delays, for the one-way delays each pays per call
  (`scripts/latency_collectives.py`);
* `context`, `levels`, `methods`, `worker`: one `jax.distributed` process (gloo) inside a
  node: its settings and the `("node", "gpu")` and flat meshes; each level's α and β and the
  local work; every decode method on the same cache, bytes per level from the compiled
  program, the cost model's prediction; the rates, phases and crossover sweep in turn;
* `run`: the cluster launcher (`tree-attention-edu cluster`): builds the network, starts and
  watches the workers, tears everything down on every way out, writes the report.
* `slurm`: SLURM's path run for real (`tree-attention-edu cluster --slurm`): the variables
  srun gives each task, and `launch --cluster` started with them in each node's namespace,
  so that JAX's own SLURM detection finds the job.

Uses `core` and `perf`; the namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN);
`netns.missing_privileges` says what is missing.
"""
