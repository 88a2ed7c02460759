"""Real multi-process runs with `jax.distributed`: on localhost, one process per "node".

`run_local(processes=2, devices_per_process=4)` starts the processes (`local_worker`); each
one calls `jax.distributed.initialize`, sees its own CPU devices plus everyone else's,
builds a global `("node", "gpu")` mesh with one node per process, runs tree and ring
decoding of `launch_problem` across the processes (CPU collectives go through gloo), and
checks both against single-device attention (`decode_across_processes`).

On a GPU cluster the same check runs unchanged (`slurm_worker`, which
`tree-attention-edu launch --cluster` calls): under SLURM, `srun` starts one process per
node (or per GPU) and `jax.distributed.initialize()` with no arguments reads the
coordinator, process count and process id from SLURM's environment; collectives use NCCL.

The local launcher leaves nothing running, whatever happens (`processes` says how):

* a worker that exits non-zero, is killed, or is stopped (SIGSTOP) makes the launcher kill
  every worker's process group within a fraction of a second and return 1;
* `timeout` bounds the whole run, and the workers' own `jax.distributed` start-up gives up
  on a missing peer after `init_timeout` seconds (not JAX's default 300);
* SIGTERM, SIGHUP or SIGINT to the launcher kill the workers, then exit with 128 + signal;
* if the launcher dies without cleaning up (SIGKILL), the workers die with it;
* the coordinator's port is held by the launcher until the workers start; if it is taken
  in between, worker 0 says so (`PortInUse`, exit status `EX_PORT`) and the launcher
  retries with another port (an explicit `port` that is taken is an error that names it).

Each failure ends in one line on stderr that says what happened; the workers' specs
(`worker{i}.json`) and logs (stderr) are kept in a temporary folder named in that line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from . import processes as ps

if TYPE_CHECKING:
    from jax import Array
    from jax.sharding import Mesh

    from ..perf.benchmark import Problem

TOLERANCE = 2e-5  # float32 decode vs float64 reference, outputs of size O(1)
HOST = "127.0.0.1"
EX_PORT = 75  # worker 0's exit status when the coordinator cannot bind its port (EX_TEMPFAIL)
PORT_ATTEMPTS = 3  # ports tried when the launcher picks them
INIT_TIMEOUT_S = 30  # jax.distributed start-up: give up on a missing peer after this long


# ---------------------------------------------------------------------------------------
# Ports


def _bind(port: int) -> socket.socket:
    """A socket bound to HOST:port (0: a free port the kernel picks); OSError if taken.

    SO_REUSEADDR as gRPC sets it, so that a port in TIME_WAIT counts as free; a port that
    another socket is bound to or listens on still fails.
    """
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, port))
    except OSError:
        s.close()
        raise
    return s


def port_in_use_message(port: int) -> str:
    return f"port {port} on {HOST} is in use, so the jax.distributed coordinator cannot bind it"


class PortInUse(Exception):
    """Worker 0 could not bind the coordinator's port (its exit status is `EX_PORT`)."""

    def __init__(self, port: int):
        super().__init__(port_in_use_message(port))
        self.port = port


# ---------------------------------------------------------------------------------------
# Worker side: the problem, and decoding it across the processes


def launch_problem(seq_len: int) -> Problem:
    """What every launch decodes: 2 sequences (of `seq_len` and `seq_len // 3` keys, causal)
    of 2 queries, 8 query heads sharing 2 K/V heads of 64, float32. The memory check of
    `tree-attention-edu launch` reads its sizes here too."""
    from ..perf.benchmark import Problem

    return Problem(seq_len=seq_len, batch=2, q_len=2, q_heads=8, kv_heads=2, head_dim=64)


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """The settings of a local run, as each worker's spec carries them."""

    processes: int
    devices_per_process: int
    port: int
    seq_len: int
    init_timeout: int


def local_worker(run: LocalRun, process_id: int) -> int:
    """One process of a local run: simulate its devices, join the others on localhost, and
    decode. Returns 0 if tree and ring match the reference, else 1; raises `PortInUse` if
    process 0 cannot bind the coordinator's port."""
    import jax

    jax.config.update("jax_enable_x64", True)  # for the float64 reference; decode is float32
    jax.config.update("jax_num_cpu_devices", run.devices_per_process)
    if process_id == 0:  # the coordinator binds the port: check that it still can
        try:
            _bind(run.port).close()
        except OSError as e:
            raise PortInUse(run.port) from e
    try:
        ps.initialize_distributed(f"{HOST}:{run.port}", run.processes, process_id, run.init_timeout)
    except Exception as e:
        if process_id == 0 and "Failed to start RPC server" in str(e):
            raise PortInUse(run.port) from e
        raise
    return decode_across_processes(run.seq_len)


def slurm_worker(seq_len: int) -> int:
    """One process of a cluster run (under srun): `jax.distributed.initialize()` reads the
    coordinator, process count and id from SLURM's environment; it says what it found
    (`detection_line`, so that a launcher or a person can check that SLURM's environment,
    not some other, was read), then decodes."""
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.distributed.initialize()
    print(detection_line(), flush=True)
    return decode_across_processes(seq_len)


DETECTED = re.compile(
    r"\[process (?P<index>\d+)/(?P<count>\d+)\] jax\.distributed\.initialize\(\) with no "
    r"arguments; SLURM_PROCID=(?P<procid>\S+) SLURM_NTASKS=(?P<ntasks>\S+) "
    r"SLURMD_NODENAME=(?P<node>\S+)"
)
"""`detection_line`'s format: what `cluster.slurm` reads back from each task."""


def detection_line() -> str:
    """What `jax.distributed.initialize()` made of the environment, in one line: the
    process index and count it got, next to SLURM's own variables (`-` where unset).
    Matches `DETECTED`. (JAX has no public API that names the cluster it detected; with no
    arguments and no other launcher's variables, SLURM's are where the index and count can
    have come from: `cluster.slurm` checks that they agree.)"""
    import jax

    env = os.environ
    return (
        f"[process {jax.process_index()}/{jax.process_count()}] jax.distributed.initialize() "
        f"with no arguments; SLURM_PROCID={env.get('SLURM_PROCID', '-')} "
        f"SLURM_NTASKS={env.get('SLURM_NTASKS', '-')} "
        f"SLURMD_NODENAME={env.get('SLURMD_NODENAME', '-')}"
    )


def decode_across_processes(seq_len: int) -> int:
    """Tree and ring decoding of `launch_problem(seq_len)` on the `("node", "gpu")` mesh of
    every process's devices, each checked here against float64 attention; one line per
    method. Returns 0 if both match, else 1; ends `jax.distributed`."""
    import jax

    from ..core.decode import ring_decode, tree_decode
    from ..core.devices import make_mesh

    nodes, per_node = jax.process_count(), jax.local_device_count()
    mesh = make_mesh((nodes, per_node), ("node", "gpu"))
    inputs, want = _inputs(mesh, seq_len)
    status = 0
    for name, fn in (("tree", tree_decode), ("ring", ring_decode)):
        err = _decode_error(mesh, fn, inputs, want)
        ok = err <= TOLERANCE
        status |= not ok
        print(
            f"[process {jax.process_index()}/{nodes}] {name:<4} on mesh node={nodes} x "
            f"gpu={per_node}: max |err| = {err:.2e} {'OK' if ok else 'MISMATCH'}",
            flush=True,
        )
    jax.distributed.shutdown()
    return status


def _inputs(mesh: Mesh, seq_len: int) -> tuple[tuple[Array, ...], np.ndarray]:
    """The global `(q, K, V, lengths)` on `mesh` (K/V sharded along the sequence, padded to
    a multiple of the device count; the pad is masked) and the float64 answer. Every
    process makes the same inputs from the same seed, then keeps its own shards."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..core.reference import attention
    from ..perf.benchmark import make_inputs

    q, k, v = make_inputs(launch_problem(seq_len), seed=0)
    lengths = np.array([seq_len, seq_len // 3], np.int32)
    pad = (-seq_len) % mesh.size
    kp, vp = (np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))

    def global_array(x: np.ndarray, spec: P) -> Array:
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    kv = P(None, ("node", "gpu"))
    inputs = (global_array(q, P()), global_array(kp, kv), global_array(vp, kv))
    f64 = (jax.numpy.asarray(x, np.float64) for x in (q, k, v))
    want = attention(*f64, causal=True, kv_lengths=jax.numpy.asarray(lengths))
    return (*inputs, global_array(lengths, P())), np.asarray(want)


def _decode_error(
    mesh: Mesh, fn: Callable[..., Array], inputs: tuple[Array, ...], want: np.ndarray
) -> float:
    """Max |error| of `fn` (tree or ring decoding) on this process's first device."""
    import jax

    def decode(q: Array, k: Array, v: Array, lengths: Array) -> Array:
        return fn(q, k, v, mesh=mesh, causal=True, kv_lengths=lengths)

    out = jax.jit(decode)(*inputs)
    local = np.asarray(out.addressable_data(0), np.float64)
    return float(np.abs(local - want).max())


# ---------------------------------------------------------------------------------------
# Launcher side


def run_local(
    processes: int = 2,
    devices_per_process: int = 4,
    seq_len: int = 4096,
    timeout: float = 120.0,
    *,
    port: int | None = None,
    init_timeout: float | None = None,
) -> int:
    """Start `processes` workers on localhost, wait, and return 0 only if all succeed.

    Args:
      processes: worker processes, one mesh "node" each.
      devices_per_process: simulated CPU devices per worker: the mesh is
        `(processes, devices_per_process)`.
      seq_len: KV length of the decoded problem.
      timeout: seconds for the whole run, after which the workers are killed.
      port: the coordinator's port; `None` or 0 picks a free one (and retries if another
        process takes it before the coordinator binds it).
      init_timeout: seconds `jax.distributed.initialize` waits for the other workers
        (default `min(30, timeout)`).

    On failure (a worker exits non-zero, dies or is stopped, or the run times out) every
    worker is killed, one line on stderr says why, and the result is 1. SIGTERM, SIGHUP and
    SIGINT kill the workers too and raise `SystemExit(128 + signal)`.
    """
    init_timeout = _check_local(
        processes, devices_per_process, seq_len, timeout, port, init_timeout
    )
    held = _hold(port) if port else None
    if port and held is None:
        return 1
    run = LocalRun(processes, devices_per_process, 0, seq_len, max(1, math.ceil(init_timeout)))
    logdir = tempfile.mkdtemp(prefix="tae-launch-")
    failed = False
    try:
        with ps.signal_flag() as flag:
            out = _attempts(run, held, time.monotonic() + timeout, timeout, logdir, flag)
        failed = _tell(out, flag, explicit=bool(port), logdir=logdir)
        return out.code
    finally:
        if not failed:  # the logs of a failed run stay, for its one line names them
            shutil.rmtree(logdir, ignore_errors=True)


def _check_local(
    processes: int,
    devices_per_process: int,
    seq_len: int,
    timeout: float,
    port: int | None,
    init_timeout: float | None,
) -> float:
    """ValueError naming a bad argument of `run_local`; returns the init timeout to use."""
    for name, value in (
        ("processes", processes),
        ("devices_per_process", devices_per_process),
        ("seq_len", seq_len),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value!r}.")
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"`timeout` must be a positive number of seconds, got {timeout!r}.")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
    ):
        raise ValueError(f"`port` must be an int in 0..65535 (0: pick one), got {port!r}.")
    init_timeout = min(INIT_TIMEOUT_S, timeout) if init_timeout is None else init_timeout
    if not (isinstance(init_timeout, int | float) and init_timeout > 0):
        raise ValueError(f"`init_timeout` must be a positive number, got {init_timeout!r}.")
    return init_timeout


def _hold(port: int) -> socket.socket | None:
    """The explicit `port`, bound until the workers start; None (and one line) if taken."""
    try:
        return _bind(port)
    except OSError as e:
        print(
            f"launch: error: {port_in_use_message(port)} ({e.strerror}); pass another "
            "--port, or none to pick a free one",
            file=sys.stderr,
        )
        return None


def _attempts(
    run: LocalRun,
    held: socket.socket | None,
    deadline: float,
    timeout: float,
    logdir: str,
    flag: ps.SignalFlag,
) -> ps.Outcome:
    """Run the workers; while worker 0 finds a port that was picked here taken, again with
    another, `PORT_ATTEMPTS` times in all. `held`: the explicit port (never retried)."""
    explicit = held is not None
    for attempt in range(1, PORT_ATTEMPTS + 1):
        sock = held if held is not None else _bind(0)
        held = None
        out = _attempt(run, sock, deadline, timeout, logdir, flag)
        if not out.port_taken or explicit or attempt == PORT_ATTEMPTS:
            break
        print(f"launch: note: {out.message}; retrying with another port", file=sys.stderr)
    return out


def _attempt(
    run: LocalRun,
    held: socket.socket,
    deadline: float,
    timeout: float,
    logdir: str,
    flag: ps.SignalFlag,
) -> ps.Outcome:
    """Start the workers once (releasing `held` just before) and watch them to the end."""
    port = held.getsockname()[1]
    run = dataclasses.replace(run, port=port)
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(logdir, f"worker{i}.log") for i in range(run.processes)]
    env = ps.worker_env()

    def port_taken(codes: list[int | None]) -> ps.Outcome | None:  # worker 0 could not bind
        if codes[0] == EX_PORT:
            return ps.Outcome(1, port_in_use_message(port), port_taken=True)
        return None

    try:
        held.close()  # the coordinator (worker 0) binds it now
        for i in range(run.processes):
            spec = ps.WorkerSpec("launch", i, dataclasses.asdict(run))
            cmd = spec.write(os.path.join(logdir, f"worker{i}.json"))
            procs.append(ps.start_worker(cmd, env, logs[i]))
        return ps.watch_workers(procs, logs, flag, deadline, timeout, check=port_taken)
    finally:
        ps.kill_workers(procs)  # on any way out (a signal, an error): nothing stays running


def _tell(out: ps.Outcome, flag: ps.SignalFlag, *, explicit: bool, logdir: str) -> bool:
    """Print the run's one line, if it failed (True); a signal raises SystemExit."""
    if flag.signum is not None and out.code == 128 + flag.signum:  # not after the end
        print(f"launch: {out.message}", file=sys.stderr)
        raise SystemExit(out.code)
    if not out.code:
        return False
    hint = (
        "; pass another --port, or none to pick a free one" if out.port_taken and explicit else ""
    )
    print(f"launch: error: {out.message}{hint} (worker logs: {logdir})", file=sys.stderr)
    return True
