"""Worker processes: how a launcher starts them, watches them and leaves none behind, and how
each worker guards itself. Shared by the local launcher (`launch`) and the cluster's (`run`).

A launcher writes each worker's `WorkerSpec` as JSON and starts
`python -m tree_attention_edu.cli.worker SPEC.json` in a session of its own, with its
stderr in a log file (`start_worker`), then `watch_workers` until all exit 0, one fails, a
signal arrives or time is up; `kill_workers` in a `finally` leaves nothing running:

* a worker that exits non-zero, is killed, or is stopped (SIGSTOP) ends the run at once,
  with that worker's own one-line summary from its log (`worker_summary`);
* SIGTERM, SIGHUP or SIGINT to the launcher are recorded (`signal_flag`) and kill the
  workers;
* if the launcher dies without cleaning up (SIGKILL), the workers die with it: each asks
  the kernel for SIGKILL when its parent exits (Linux `PR_SET_PDEATHSIG`), exits at once if
  its parent is already gone, and runs a watchdog thread that exits as soon as its parent
  changes (`guard_parent`, any POSIX system).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any, Literal

WORKER_MODULE = "tree_attention_edu.cli.worker"  # the entry point: `python -m ... SPEC.json`
PARENT_ENV = "TAE_LAUNCH_PARENT_PID"  # the launcher's pid, set for its workers
TEST_SLEEP_ENV = "TAE_LAUNCH_TEST_SLEEP"  # test hook: "SECONDS" or "ID:SECONDS,ID:SECONDS"
TEST_NO_PDEATHSIG_ENV = "TAE_LAUNCH_TEST_NO_PDEATHSIG"  # test hook: rely on the watchdog alone
WORKER_ERROR = "tae-worker-error:"  # prefix of a worker's one-line failure summary (stderr)
HEARTBEAT_TIMEOUT_S = 20  # the coordination service declares a silent worker dead
SHUTDOWN_TIMEOUT_S = 30
POLL_S = 0.05  # how often the launcher looks at its workers
WATCHDOG_S = 0.25  # how often a worker checks that its launcher is alive
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, n))

Role = Literal["launch", "cluster", "collectives"]
"""What a worker runs: the local launcher's decode check (`launch.local_worker`), one
process of a cluster on this machine (`worker.run_process`), or the timing of tiny
collectives (`collectives.worker_main`)."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is told: its role, its process id and the run's settings (the
    fields of `launch.LocalRun` or `worker.Settings`)."""

    role: Role
    process_id: int
    settings: dict[str, Any]

    def write(self, path: str) -> list[str]:
        """Write the spec to `path` as JSON; returns the command that starts its worker."""
        with open(path + ".tmp", "w") as f:
            json.dump(asdict(self), f)
        os.replace(path + ".tmp", path)
        return [sys.executable, "-m", WORKER_MODULE, path]

    @classmethod
    def read(cls, path: str) -> WorkerSpec:
        with open(path) as f:
            return cls(**json.load(f))


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

    def watch() -> None:
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


def initialize_distributed(
    coordinator: str, processes: int, process_id: int, init_timeout: float
) -> None:
    """`jax.distributed.initialize` with the coordinator at `coordinator` ("ADDR:PORT",
    which process 0 binds), giving up on a missing peer after `init_timeout` seconds and
    with the launcher's heartbeat and shutdown timeouts (where this JAX has them)."""
    import jax

    kwargs: dict[str, Any] = dict(
        coordinator_address=coordinator,
        num_processes=processes,
        process_id=process_id,
        coordinator_bind_address=coordinator,
        initialization_timeout=int(init_timeout),
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
    known = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if k in known})


# ---------------------------------------------------------------------------------------
# Launcher side


def package_root() -> str:
    """The folder that holds this `tree_attention_edu`, for the workers' PYTHONPATH."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_env() -> dict[str, str]:
    """This process's environment for a child process that sets its own device count
    (`simulate_devices`): XLA_FLAGS less `DEVICE_COUNT_FLAG`, every other flag kept (a CPU
    cap such as `--xla_cpu_max_isa`, an optimisation level), and no XLA_FLAGS left empty."""
    env = dict(os.environ)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def worker_env() -> dict[str, str]:
    """A worker's environment: this one without XLA_FLAGS' device count (`child_env`: each
    worker sets its own), unbuffered output, this package first on the path, the launcher's pid (for
    `guard_parent`), and JAX_PLATFORMS=cpu: the workers simulate CPU devices, and on a
    machine with a GPU JAX would pick it (one per machine, shared by every worker: measured
    to fail on an H200, results/gpu/)."""
    env = child_env()
    path = [package_root(), *filter(None, [env.get("PYTHONPATH")])]
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(path))
    env[PARENT_ENV] = str(os.getpid())
    return env


def start_worker(
    cmd: list[str], env: dict[str, str], log: str, out: str | None = None
) -> subprocess.Popen:
    """Start `cmd` in a session of its own (so that its whole group can be killed), its
    stderr in the file `log`, its stdout in the file `out` (None: this process's)."""
    with open(log, "wb") as f, open(out or os.devnull, "wb") as o:
        return subprocess.Popen(
            cmd, env=env, stderr=f, stdout=o if out else None, start_new_session=True
        )


class SignalFlag:
    """A signal handler that only records the first signal; the watch loop acts on it."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum


@contextlib.contextmanager
def signal_flag() -> Iterator[SignalFlag]:
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
_CLI_ERROR = re.compile(r"tree-attention-edu(?: \S+)?: error: (.*)")  # a command's one line


def worker_summary(log: str) -> str:
    """The worker's one-line summary from its log: its own, else JAX's fatal error, else
    the command's one error line (a worker that runs `tree-attention-edu ...` itself, as
    `cluster.slurm`'s do)."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    own = [s[len(WORKER_ERROR) :].strip() for s in lines if s.startswith(WORKER_ERROR)]
    if own:
        return f" ({own[-1]})"
    for line in lines:
        if m := _FATAL.match(line):
            text = m.group(1)
            if "absl::Status:" in text:
                text = "jax.distributed: " + text.split("absl::Status:", 1)[1].strip()
            return f" ({text[:300]})"
    cli = [m.group(1) for s in lines if (m := _CLI_ERROR.match(s))]
    return f" ({cli[-1][:300]})" if cli else ""


class Outcome:
    def __init__(self, code: int, message: str = "", port_taken: bool = False):
        self.code, self.message, self.port_taken = code, message, port_taken


def watch_workers(
    procs: list[subprocess.Popen],
    logs: list[str],
    flag: SignalFlag,
    deadline: float,
    timeout: float,
    check: Callable[[list[int | None]], Outcome | None] | None = None,
) -> Outcome:
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
        if (bad := _failed(procs, codes, logs)) is not None:
            killed = kill_workers(procs)
            return Outcome(
                1,
                f"{bad}; killed the {killed} other running worker(s) after "
                f"{time.monotonic() - start:.1f} s",
            )
        if all(c == 0 for c in codes):
            return Outcome(0)
        if time.monotonic() > deadline:
            running = [i for i, c in enumerate(codes) if c is None]
            killed = kill_workers(procs)
            return Outcome(
                1,
                f"timed out after {timeout:g} s with worker(s) {running} still running; "
                f"killed {killed} (raise --timeout for longer runs)",
            )
        time.sleep(POLL_S)


def _failed(procs: list[subprocess.Popen], codes: list[int | None], logs: list[str]) -> str | None:
    """What the first worker that failed (exited non-zero, died, or is stopped) did."""
    for i, (p, c) in enumerate(zip(procs, codes, strict=True)):
        if c is not None and c != 0:
            return f"worker {i} (pid {p.pid}) {describe_exit(c)}{worker_summary(logs[i])}"
        if c is None and is_stopped(p.pid):
            return f"worker {i} (pid {p.pid}) was stopped (SIGSTOP?); the run cannot go on"
    return None
