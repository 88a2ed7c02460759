"""Real multi-process runs on localhost with `jax.distributed` (one process per "node").

`run_local(processes=2, devices_per_process=4)` starts the processes; each one calls
`jax.distributed.initialize`, sees its own CPU devices plus everyone else's, builds a global
`("node", "gpu")` mesh with one node per process, runs tree and ring decoding across the
processes (CPU collectives go through gloo), and checks both against single-device attention.

On a GPU cluster the same worker code runs unchanged: under SLURM, `srun` starts one process
per node (or per GPU) and `jax.distributed.initialize()` with no arguments reads the
coordinator, process count and process id from SLURM's environment; collectives use NCCL.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

TOLERANCE = 2e-5  # float32 decode vs float64 reference, outputs of size O(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(process_id: int, processes: int, devices_per_process: int, port: int,
           seq_len: int, coordinator: str | None = None) -> int:
    """One process of the run. Returns 0 if tree and ring match the reference, else 1."""
    import jax

    jax.config.update("jax_enable_x64", True)  # for the float64 reference; decode is float32
    if coordinator is None:  # localhost: simulate this process's devices
        jax.config.update("jax_num_cpu_devices", devices_per_process)
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                                   num_processes=processes, process_id=process_id)
    else:  # a cluster: let JAX read SLURM / the coordinator address
        jax.distributed.initialize()

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from .attention import attention
    from .benchmark import Problem, make_inputs
    from .decode import ring_decode, tree_decode
    from .devices import make_mesh

    nodes, per_node = jax.process_count(), jax.local_device_count()
    mesh = make_mesh((nodes, per_node), ("node", "gpu"))
    # Every process makes the same inputs from the same seed, then keeps its own shards.
    problem = Problem(seq_len=seq_len, batch=2, q_len=2, q_heads=8, kv_heads=2, head_dim=64)
    q, k, v = make_inputs(problem, seed=0)
    lengths = np.array([seq_len, seq_len // 3], np.int32)

    def global_array(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    kv_spec = P(None, ("node", "gpu"))
    gq, gk, gv = global_array(q, P()), global_array(k, kv_spec), global_array(v, kv_spec)
    gl = global_array(lengths, P())
    want = np.asarray(attention(q.astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64), causal=True, kv_lengths=lengths))
    status = 0
    for name, fn in (("tree", tree_decode), ("ring", ring_decode)):
        out = jax.jit(lambda q, k, v, l, fn=fn: fn(q, k, v, mesh=mesh, causal=True,
                                                   kv_lengths=l))(gq, gk, gv, gl)
        local = np.asarray(out.addressable_data(0), np.float64)
        err = float(np.abs(local - want).max())
        ok = err <= TOLERANCE
        status |= not ok
        print(f"[process {jax.process_index()}/{nodes}] {name:<4} on mesh node={nodes} x "
              f"gpu={per_node}: max |err| = {err:.2e} {'OK' if ok else 'MISMATCH'}", flush=True)
    jax.distributed.shutdown()
    return status


def run_local(processes: int = 2, devices_per_process: int = 4, seq_len: int = 4096,
              timeout: float = 300.0) -> int:
    """Start `processes` workers on localhost, wait, and return 0 only if all succeed.

    Workers are killed on the first failure, on timeout and on Ctrl-C.
    """
    if processes < 1 or devices_per_process < 1:
        raise ValueError("`processes` and `devices_per_process` must be >= 1.")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each worker sets its own
    env["PYTHONUNBUFFERED"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tree_attention_edu.launch", "--worker",
             "--process-id", str(i), "--processes", str(processes),
             "--devices-per-process", str(devices_per_process), "--port", str(port),
             "--seq-len", str(seq_len)],
            env=env, start_new_session=True,
        )
        for i in range(processes)
    ]

    def kill_all():
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()

    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                print(f"launch: a worker failed (exit codes {codes}); stopping the others",
                      file=sys.stderr)
                kill_all()
                return 1
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"launch: timed out after {timeout:.0f} s; stopping workers", file=sys.stderr)
                kill_all()
                return 1
            time.sleep(0.1)
    except KeyboardInterrupt:
        kill_all()
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="tree_attention_edu multi-process worker")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cluster", action="store_true",
                        help="use jax.distributed.initialize() auto-detection (SLURM)")
    args = parser.parse_args(argv)
    if args.worker or args.cluster:
        return worker(args.process_id, args.processes, args.devices_per_process, args.port,
                      args.seq_len, coordinator="auto" if args.cluster else None)
    return run_local(args.processes, args.devices_per_process, args.seq_len)


if __name__ == "__main__":
    sys.exit(main())
