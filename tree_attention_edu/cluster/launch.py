"""Real multi-process runs on localhost with `jax.distributed` (one process per "node").

`run_local(processes=2, devices_per_process=4)` starts the processes; each one calls
`jax.distributed.initialize`, sees its own CPU devices plus everyone else's, builds a global
`("node", "gpu")` mesh with one node per process, runs tree and ring decoding across the
processes (CPU collectives go through gloo), and checks both against single-device attention.

On a GPU cluster the same worker code runs unchanged: under SLURM, `srun` starts one process
per node (or per GPU) and `jax.distributed.initialize()` with no arguments reads the
coordinator, process count and process id from SLURM's environment; collectives use NCCL.

The local launcher leaves nothing running, whatever happens:

* a worker that exits non-zero, is killed, or is stopped (SIGSTOP) makes the launcher kill
  every worker's process group within a fraction of a second and return 1;
* `timeout` bounds the whole run, and the workers' own `jax.distributed` start-up gives up
  on a missing peer after `init_timeout` seconds (not JAX's default 300);
* SIGTERM, SIGHUP or SIGINT to the launcher kill the workers, then exit with 128 + signal;
* if the launcher dies without cleaning up (SIGKILL), the workers die with it: as it starts,
  each asks the kernel for SIGKILL when its parent exits (Linux `PR_SET_PDEATHSIG`), exits
  at once if its parent is already gone, and runs a watchdog thread that exits the worker
  as soon as its parent process changes (any POSIX system);
* the coordinator's port is held by the launcher until the workers start; if it is taken
  in between, worker 0 says so and the launcher retries with another port (an explicit
  `port` that is taken is an error that names it).

Each failure ends in one line on stderr that says what happened; the workers' own logs
(stderr) are kept in a temporary folder named in that line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import inspect
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from .. import commandline as cl

TOLERANCE = 2e-5  # float32 decode vs float64 reference, outputs of size O(1)

HOST = "127.0.0.1"
EX_PORT = 75  # worker 0's exit status when the coordinator cannot bind its port (EX_TEMPFAIL)
PORT_ATTEMPTS = 3  # ports tried when the launcher picks them
INIT_TIMEOUT_S = 30  # jax.distributed start-up: give up on a missing peer after this long
HEARTBEAT_TIMEOUT_S = 20  # the coordination service declares a silent worker dead
SHUTDOWN_TIMEOUT_S = 30
POLL_S = 0.05  # how often the launcher looks at its workers
WATCHDOG_S = 0.25  # how often a worker checks that its launcher is alive
PARENT_ENV = "TAE_LAUNCH_PARENT_PID"  # the launcher's pid, set for its workers
TEST_SLEEP_ENV = "TAE_LAUNCH_TEST_SLEEP"  # test hook: "SECONDS" or "ID:SECONDS,ID:SECONDS"
TEST_NO_PDEATHSIG_ENV = "TAE_LAUNCH_TEST_NO_PDEATHSIG"  # test hook: rely on the watchdog alone
WORKER_ERROR = "tae-worker-error:"  # prefix of a worker's one-line failure summary (stderr)
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, n))


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


def free_port() -> int:
    """A port that was free a moment ago (another process may take it before you bind it)."""
    with _bind(0) as s:
        return s.getsockname()[1]


def port_in_use_message(port: int) -> str:
    return f"port {port} on {HOST} is in use, so the jax.distributed coordinator cannot bind it"


# ---------------------------------------------------------------------------------------
# Worker side


def _prctl_pdeathsig() -> None:
    """Linux: ask the kernel to SIGKILL this process when its parent exits (else no-op)."""
    if not sys.platform.startswith("linux") or os.environ.get(TEST_NO_PDEATHSIG_ENV):
        return
    PR_SET_PDEATHSIG = 1
    _libc().prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # this process's symbols, libc's among them


def guard_parent(parent_pid: int) -> None:
    """Die with the launcher: PR_SET_PDEATHSIG, then a watchdog thread on `os.getppid()`.

    Runs first thing in the worker; if the launcher died while the worker was starting,
    the parent check right after `prctl` catches it.
    """
    _prctl_pdeathsig()
    if os.getppid() != parent_pid:  # the launcher died before the line above took effect
        os._exit(1)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_S)
        os._exit(1)

    threading.Thread(target=watch, name="tae-launch-watchdog", daemon=True).start()


def test_sleep(process_id: int) -> None:
    """Test hook: `TAE_LAUNCH_TEST_SLEEP` makes workers sleep before `jax.distributed` starts.

    "5" makes every worker sleep 5 s; "1:5,2:3" only workers 1 and 2.
    """
    spec = os.environ.get(TEST_SLEEP_ENV, "").strip()
    if not spec:
        return
    seconds = 0.0
    for part in spec.split(","):
        who, _, s = part.rpartition(":")
        if who == "" or int(who) == process_id:
            seconds = float(s)
    if seconds > 0:
        print(f"[process {process_id}] test hook: sleeping {seconds:g} s", flush=True)
        time.sleep(seconds)


def initialize_distributed(coordinator: str, processes: int, process_id: int,
                           init_timeout: float) -> None:
    """`jax.distributed.initialize` with the coordinator at `coordinator` ("ADDR:PORT",
    which process 0 binds), giving up on a missing peer after `init_timeout` seconds and
    with the launcher's heartbeat and shutdown timeouts (where this JAX has them)."""
    import jax

    kwargs: dict[str, Any] = dict(coordinator_address=coordinator, num_processes=processes,
                  process_id=process_id, coordinator_bind_address=coordinator,
                  initialization_timeout=int(init_timeout),
                  heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                  shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    known = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if k in known})


def _initialize(process_id: int, processes: int, port: int, init_timeout: int) -> None:
    """`jax.distributed.initialize` on localhost, with short timeouts where JAX has them."""
    if process_id == 0:  # the coordinator binds the port: check that it still can
        try:
            _bind(port).close()
        except OSError as e:
            raise _PortInUse(port) from e
    try:
        initialize_distributed(f"{HOST}:{port}", processes, process_id, init_timeout)
    except Exception as e:
        if process_id == 0 and "Failed to start RPC server" in str(e):
            raise _PortInUse(port) from e
        raise


class _PortInUse(Exception):
    def __init__(self, port: int):
        super().__init__(port_in_use_message(port))
        self.port = port


def worker(process_id: int, processes: int, devices_per_process: int, port: int,
           seq_len: int, coordinator: str | None = None,
           init_timeout: int = INIT_TIMEOUT_S) -> int:
    """One process of the run. Returns 0 if tree and ring match the reference, else 1."""
    import jax

    jax.config.update("jax_enable_x64", True)  # for the float64 reference; decode is float32
    if coordinator is None:  # localhost: simulate this process's devices
        jax.config.update("jax_num_cpu_devices", devices_per_process)
        _initialize(process_id, processes, port, init_timeout)
    else:  # a cluster: let JAX read SLURM / the coordinator address
        jax.distributed.initialize()

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..core.decode import ring_decode, tree_decode
    from ..core.devices import make_mesh
    from ..core.reference import attention
    from ..perf.benchmark import Problem, make_inputs

    nodes, per_node = jax.process_count(), jax.local_device_count()
    mesh = make_mesh((nodes, per_node), ("node", "gpu"))
    # Every process makes the same inputs from the same seed, then keeps its own shards.
    problem = Problem(seq_len=seq_len, batch=2, q_len=2, q_heads=8, kv_heads=2, head_dim=64)
    q, k, v = make_inputs(problem, seed=0)
    lengths = np.array([seq_len, seq_len // 3], np.int32)
    # The global K/V are padded to a multiple of the device count; the pad is masked.
    pad = (-seq_len) % mesh.size
    kp, vp = (np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (k, v))

    def global_array(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    kv_spec = P(None, ("node", "gpu"))
    gq, gk, gv = global_array(q, P()), global_array(kp, kv_spec), global_array(vp, kv_spec)
    gl = global_array(lengths, P())
    want = np.asarray(attention(*(jax.numpy.asarray(x, np.float64) for x in (q, k, v)),
                                causal=True, kv_lengths=jax.numpy.asarray(lengths)))
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


def _worker_main(args) -> int:
    """A worker started by `run_local` (or by srun with --cluster): one summary line on error."""
    parent = os.environ.get(PARENT_ENV)
    if parent and not args.cluster:
        guard_parent(int(parent))
    try:
        test_sleep(args.process_id)
        return worker(args.process_id, args.processes, args.devices_per_process, args.port,
                      args.seq_len, coordinator="auto" if args.cluster else None,
                      init_timeout=args.init_timeout)
    except _PortInUse as e:
        print(f"{WORKER_ERROR} {e}", file=sys.stderr, flush=True)
        return EX_PORT
    except Exception as e:
        line = next((s for s in str(e).splitlines() if s.strip()), "")
        print(f"{WORKER_ERROR} {type(e).__name__}: {line}", file=sys.stderr, flush=True)
        return 1


# ---------------------------------------------------------------------------------------
# Launcher side


class SignalFlag:
    """A signal handler that only records the first signal; the watch loop acts on it."""

    def __init__(self):
        self.signum: int | None = None

    def __call__(self, signum, frame):
        if self.signum is None:
            self.signum = signum


@contextlib.contextmanager
def signal_flag():
    """Record SIGTERM / SIGHUP / SIGINT instead of dying (main thread only)."""
    flag = SignalFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    old = {s: signal.signal(s, flag) for s in _SIGNALS}
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def is_stopped(pid: int) -> bool:
    """True if `pid` is stopped (SIGSTOP / SIGTSTP / traced), from /proc where there is one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def kill_workers(procs: list[subprocess.Popen]) -> int:
    """SIGKILL every running worker's process group and reap it; returns how many were killed."""
    killed = 0
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            killed += 1
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
    return killed


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


_FATAL = re.compile(r"F\d{4} \S+\s+\d+ \S+\] (.*)")  # absl's fatal log line (JAX's C++)


def worker_summary(log: str) -> str:
    """The worker's one-line summary from its log: its own, else JAX's fatal error."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    own = [s[len(WORKER_ERROR):].strip() for s in lines if s.startswith(WORKER_ERROR)]
    if own:
        return f" ({own[-1]})"
    for line in lines:
        if m := _FATAL.match(line):
            text = m.group(1)
            if "absl::Status:" in text:
                text = "jax.distributed: " + text.split("absl::Status:", 1)[1].strip()
            return f" ({text[:300]})"
    return ""


class Outcome:
    def __init__(self, code: int, message: str = "", port_taken: bool = False):
        self.code, self.message, self.port_taken = code, message, port_taken


def watch_workers(procs: list[subprocess.Popen], logs: list[str], flag: SignalFlag,
                  deadline: float, timeout: float, check=None) -> Outcome:
    """Watch running workers until they all exit 0, one fails, a signal arrives or time is up.

    A worker that exits non-zero, dies or is stopped (SIGSTOP) ends the run: the others are
    killed and the outcome is 1 with a one-line message (the failed worker's own summary
    from its log `logs[i]`). A signal recorded in `flag` kills every worker (128 + signal).
    `check(codes)`, called at every poll with the workers' exit codes (None: running), may
    end the watch early by returning an `Outcome`, or serve a request and return None.
    The caller kills the workers on any other way out (`kill_workers` in a `finally`).
    """
    start = time.monotonic()
    while True:
        if flag.signum is not None:
            killed = kill_workers(procs)
            name = signal.Signals(flag.signum).name
            return Outcome(128 + flag.signum, f"stopped by {name}; killed {killed} worker(s)")
        codes = [p.poll() for p in procs]
        if check is not None and (early := check(codes)) is not None:
            kill_workers(procs)
            return early
        for i, (p, c) in enumerate(zip(procs, codes, strict=True)):
            if c not in (None, 0):
                bad = f"worker {i} (pid {p.pid}) {describe_exit(c)}{worker_summary(logs[i])}"
            elif c is None and is_stopped(p.pid):
                bad = f"worker {i} (pid {p.pid}) was stopped (SIGSTOP?); the run cannot go on"
            else:
                continue
            killed = kill_workers(procs)
            return Outcome(1, f"{bad}; killed the {killed} other running worker(s) after "
                              f"{time.monotonic() - start:.1f} s")
        if all(c == 0 for c in codes):
            return Outcome(0)
        if time.monotonic() > deadline:
            running = [i for i, c in enumerate(codes) if c is None]
            killed = kill_workers(procs)
            return Outcome(1, f"timed out after {timeout:g} s with worker(s) {running} still "
                              f"running; killed {killed} (raise --timeout for longer runs)")
        time.sleep(POLL_S)


def _attempt(cmd: list[str], processes: int, env: dict, held: socket.socket, port: int,
             deadline: float, timeout: float, logdir: str, flag: SignalFlag) -> Outcome:
    """Start the workers once (releasing `held` just before) and watch them to the end."""
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(logdir, f"worker{i}.log") for i in range(processes)]

    def port_taken(codes):  # worker 0 could not bind the coordinator's port
        return (Outcome(1, port_in_use_message(port), port_taken=True)
                if codes[0] == EX_PORT else None)

    try:
        held.close()  # the coordinator (worker 0) binds it now
        for i in range(processes):
            with open(logs[i], "wb") as log:
                procs.append(subprocess.Popen(
                    [*cmd, "--process-id", str(i), "--port", str(port)], env=env,
                    stderr=log, start_new_session=True))
        return watch_workers(procs, logs, flag, deadline, timeout, check=port_taken)
    finally:
        kill_workers(procs)  # on any way out (a signal, an error): nothing stays running


def run_local(processes: int = 2, devices_per_process: int = 4, seq_len: int = 4096,
              timeout: float = 120.0, *, port: int | None = None,
              init_timeout: float | None = None) -> int:
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
    for name, value in (("processes", processes), ("devices_per_process", devices_per_process),
                        ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value!r}.")
    if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"`timeout` must be a positive number of seconds, got {timeout!r}.")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 0 <= port <= 65535):
        raise ValueError(f"`port` must be an int in 0..65535 (0: pick one), got {port!r}.")
    init_timeout = min(INIT_TIMEOUT_S, timeout) if init_timeout is None else init_timeout
    if not (isinstance(init_timeout, int | float) and init_timeout > 0):
        raise ValueError(f"`init_timeout` must be a positive number, got {init_timeout!r}.")
    explicit = bool(port)
    if port:
        try:
            held = _bind(port)
        except OSError as e:
            print(f"launch: error: {port_in_use_message(port)} ({e.strerror}); pass another "
                  "--port, or none to pick a free one", file=sys.stderr)
            return 1
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each worker sets its own
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_ENV] = str(os.getpid())
    # The workers simulate CPU devices; on a machine with a GPU, JAX would pick the GPU (one
    # per machine, shared by every worker: measured to fail on an H200, results/gpu/).
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "tree_attention_edu.cluster.launch", "--worker",
           "--processes", str(processes), "--devices-per-process", str(devices_per_process),
           "--seq-len", str(seq_len), "--init-timeout", str(max(1, math.ceil(init_timeout)))]
    deadline = time.monotonic() + timeout
    logdir = tempfile.mkdtemp(prefix="tae-launch-")
    keep_logs = False
    try:
        with signal_flag() as flag:
            attempt = 1
            if not explicit:
                held = _bind(0)
            out = _attempt(cmd, processes, env, held, held.getsockname()[1], deadline,
                           timeout, logdir, flag)
            while out.port_taken and not explicit and attempt < PORT_ATTEMPTS:
                print(f"launch: note: {out.message}; retrying with another port",
                      file=sys.stderr)
                attempt += 1
                held = _bind(0)
                out = _attempt(cmd, processes, env, held, held.getsockname()[1], deadline,
                               timeout, logdir, flag)
        if flag.signum is not None and out.code == 128 + flag.signum:  # not after the end
            print(f"launch: {out.message}", file=sys.stderr)
            raise SystemExit(out.code)
        if out.code:
            keep_logs = True
            hint = ("; pass another --port, or none to pick a free one"
                    if out.port_taken and explicit else "")
            print(f"launch: error: {out.message}{hint} (worker logs: {logdir})",
                  file=sys.stderr)
        return out.code
    finally:
        if not keep_logs:
            shutil.rmtree(logdir, ignore_errors=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a multi-process run, shared by `launch` and `python -m ...launch`."""
    p.add_argument("--processes", type=cl.positive, default=2,
                   help="local processes, one mesh 'node' each")
    p.add_argument("--devices-per-process", type=cl.positive, default=4,
                   help="simulated CPU devices per process")
    p.add_argument("--seq-len", type=cl.positive, default=4096, help="KV length Tk")
    p.add_argument("--timeout", type=cl.seconds, default=120.0,
                   help="seconds for the whole run; then every worker is killed")
    p.add_argument("--init-timeout", type=cl.positive, default=None,
                   help=f"seconds jax.distributed start-up waits for the other workers "
                        f"(default: {INIT_TIMEOUT_S}, or --timeout if shorter)")
    p.add_argument("--port", type=cl.port, default=0,
                   help="coordinator port on 127.0.0.1 (0: pick a free one)")
    p.add_argument("--cluster", action="store_true",
                   help="be one process of a cluster run (e.g. under srun): "
                        "jax.distributed.initialize() reads SLURM's environment; "
                        "--processes, --devices-per-process, --port and the timeouts "
                        "are not used")



def main(argv: list[str] | None = None) -> int:
    """`python -m tree_attention_edu.cluster.launch`: a local run, a worker, or a cluster
    process."""
    parser = cl.Parser(
        prog="python -m tree_attention_edu.cluster.launch",
        description="tree_attention_edu multi-process run (localhost, or one process per node "
                    "under SLURM with --cluster)",
        formatter_class=cl.HelpFormatter)
    parser.add_argument("--worker", action="store_true",
                        help="internal: run as one worker of a local launch")
    parser.add_argument("--process-id", type=int, default=0, help="internal: this worker's id")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.init_timeout is None:
        args.init_timeout = min(INIT_TIMEOUT_S, math.ceil(args.timeout))
    if args.worker or args.cluster:
        return _worker_main(args)
    try:
        return run_local(args.processes, args.devices_per_process, args.seq_len, args.timeout,
                         port=args.port, init_timeout=args.init_timeout)
    except Exception as e:  # e.g. no free port, no temporary folder: one line, no traceback
        line = next((s for s in str(e).splitlines() if s.strip()), "")
        print(f"launch: error: {type(e).__name__}: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
