"""SLURM's path, run for real: `srun` simulated on the cluster of namespaces.

`tree-attention-edu launch --cluster` is what `srun` starts on a real cluster: each task
calls `jax.distributed.initialize()` with no arguments, and JAX's own cluster detection
(its SLURM cluster environment) reads the job from SLURM's environment:

* the coordinator's host is the first name of `SLURM_STEP_NODELIST` (SLURM's compressed
  host list, e.g. `tae-cl-42-n[0-1]`), its port `SLURM_JOB_ID mod 4096 + 61440`;
* the process count is `SLURM_NTASKS`, the process id `SLURM_PROCID`, the local id
  `SLURM_LOCALID` (JAX makes it the one visible GPU; on CPU it changes nothing).

No SLURM here, so `run_slurm` plays `srun`'s part: it makes one namespace per node
(`netns`; every node's hosts file resolves each node's name to its address, as a real
cluster's does), then starts each task inside its node's namespace with the environment
srun gives that task (`SlurmStep.task_env`: block distribution, srun's default) and no
coordinator argument at all:

    ip netns exec NODE python -m tree_attention_edu launch --cluster --seq-len N

Each task prints the process index and count `initialize()` gave it, next to SLURM's
variables (`launch.detection_line`); the run succeeds only if every task decoded correctly
and its index and count are its SLURM_PROCID and SLURM_NTASKS (`check_detections`). The
tasks get no coordinator argument and none of another launcher's variables (`FOREIGN`), so
SLURM's environment is the only place those can have come from; and the tasks met, so each
derived the same coordinator from the node list. (JAX has no public API that names the
cluster it detected; `tests/test_cluster.py` checks JAX's SLURM reader against
`SlurmStep.task_env` directly.) Teardown is the cluster
launcher's: tasks in sessions of their own, killed on every way out, dying with the
launcher (`processes.guard_parent`, which `launch --cluster` calls when started by a
launcher), and the namespaces removed (`netns.destroy`; after a SIGKILL, the next start).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from . import netns
from . import processes as ps
from .launch import DETECTED
from .run import ClusterConfig

# Variables of other launchers (and JAX's own overrides) that would change what
# `jax.distributed.initialize()` detects; never passed on from the launcher's environment.
FOREIGN = (
    "SLURM_",
    "SLURMD_",
    "OMPI_",
    "PMIX_",
    "JAX_COORDINATOR_",
    "JAX_LOCAL_DEVICE_IDS",
    "JAX_PARTITION_INDEX",
    "JAX_NUM_CPU_DEVICES",
)
_NUMBERED = re.compile(r"(.*?)(\d+)")


# ---------------------------------------------------------------------------------------
# SLURM's host lists and task environment (pure)


def compress_hostlist(names: Sequence[str]) -> str:
    """SLURM's compressed host list: `["n0", "n1", "n2", "n5", "gpu"]` -> `"n[0-2,5],gpu"`.

    Runs of one prefix whose numbers follow each other become `a-b` ranges inside one
    bracket; zero padding is kept (`n08`, `n09`, `n10` -> `n[08-10]`); a lone name has no
    bracket. Adjacent names only: the order is kept (SLURM's lists come sorted)."""
    if not names:
        raise ValueError("a host list needs one or more names")
    groups: list[tuple[str, list[list[str]]]] = []  # prefix, [[first, last] digits]
    for name in names:
        m = _NUMBERED.fullmatch(name)
        if m is None:
            groups.append((name, []))
            continue
        prefix, digits = m.groups()
        if not (groups and groups[-1][0] == prefix and groups[-1][1]):
            groups.append((prefix, [[digits, digits]]))
            continue
        ranges = groups[-1][1]
        last = ranges[-1]
        if str(int(last[1]) + 1).zfill(len(last[0])) == digits:
            last[1] = digits
        else:
            ranges.append([digits, digits])
    out = []
    for prefix, ranges in groups:
        if not ranges:
            out.append(prefix)
        elif len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            out.append(prefix + ranges[0][0])
        else:
            body = ",".join(a if a == b else f"{a}-{b}" for a, b in ranges)
            out.append(f"{prefix}[{body}]")
    return ",".join(out)


def expand_hostlist(text: str) -> list[str]:
    """The names of a compressed host list (the inverse of `compress_hostlist`, for one
    bracket at the end of each part, as SLURM writes node lists of numbered nodes)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    names = []
    for part in parts:
        prefix, bracket, body = part.partition("[")
        if not bracket:
            names.append(part)
            continue
        for item in body.rstrip("]").split(","):
            first, _, last = item.partition("-")
            for n in range(int(first), int(last or first) + 1):
                names.append(prefix + str(n).zfill(len(first)))
    return names


def tasks_per_node_text(counts: Sequence[int]) -> str:
    """SLURM's `SLURM_TASKS_PER_NODE` form: `[2, 2, 1]` -> `"2(x2),1"`."""
    out: list[list[int]] = []
    for c in counts:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return ",".join(str(c) if n == 1 else f"{c}(x{n})" for c, n in out)


@dataclass(frozen=True)
class SlurmStep:
    """One job step as `srun --nodes=len(nodes) --ntasks-per-node=tasks_per_node` makes it:
    tasks numbered node by node (block distribution, srun's default)."""

    job_id: int
    nodes: tuple[str, ...]  # the nodes' host names, in order
    tasks_per_node: int
    step_id: int = 0
    job_name: str = "tree-attention-edu"

    def __post_init__(self) -> None:
        if not self.nodes or self.tasks_per_node < 1 or self.job_id < 1:
            raise ValueError(f"a job step needs nodes, tasks and a positive job id: {self}")

    @property
    def ntasks(self) -> int:
        return len(self.nodes) * self.tasks_per_node

    @property
    def nodelist(self) -> str:
        return compress_hostlist(self.nodes)

    def node_of(self, task: int) -> int:
        """The node (index into `nodes`) that runs `task`."""
        return task // self.tasks_per_node

    def task_env(self, task: int) -> dict[str, str]:
        """The variables srun sets for `task` that describe the job, the step and the task
        (JAX reads SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID and
        SLURM_LOCALID; the rest is there so that the task sees what it would under srun)."""
        if not 0 <= task < self.ntasks:
            raise ValueError(f"task {task} is not in 0..{self.ntasks - 1}")
        node = self.node_of(task)
        per_node = tasks_per_node_text([self.tasks_per_node] * len(self.nodes))
        first = node * self.tasks_per_node
        return {
            "SLURM_JOB_ID": str(self.job_id),
            "SLURM_JOBID": str(self.job_id),
            "SLURM_JOB_NAME": self.job_name,
            "SLURM_JOB_NODELIST": self.nodelist,
            "SLURM_NODELIST": self.nodelist,
            "SLURM_JOB_NUM_NODES": str(len(self.nodes)),
            "SLURM_NNODES": str(len(self.nodes)),
            "SLURM_TASKS_PER_NODE": per_node,
            "SLURM_NTASKS": str(self.ntasks),
            "SLURM_NPROCS": str(self.ntasks),
            "SLURM_STEP_ID": str(self.step_id),
            "SLURM_STEPID": str(self.step_id),
            "SLURM_STEP_NODELIST": self.nodelist,
            "SLURM_STEP_NUM_NODES": str(len(self.nodes)),
            "SLURM_STEP_NUM_TASKS": str(self.ntasks),
            "SLURM_STEP_TASKS_PER_NODE": per_node,
            "SLURM_DISTRIBUTION": "block",
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task - first),
            "SLURM_NODEID": str(node),
            "SLURM_GTIDS": ",".join(str(t) for t in range(first, first + self.tasks_per_node)),
            "SLURMD_NODENAME": self.nodes[node],
            "SLURM_TOPOLOGY_ADDR": self.nodes[node],
            "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
        }


def task_environment(
    base: Mapping[str, str], step: SlurmStep, task: int, devices_per_process: int
) -> dict[str, str]:
    """A task's whole environment: `base` (the launcher's, as srun passes it on) without
    any other launcher's or JAX coordinator variables (`FOREIGN`), then srun's variables
    for the task and JAX_NUM_CPU_DEVICES (what a user exports to simulate CPU devices)."""
    env = {k: v for k, v in base.items() if not k.startswith(FOREIGN)}
    env.update(step.task_env(task))
    env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    return env


def task_command(seq_len: int) -> list[str]:
    """What srun would run in each task: the package's real entry point, no coordinator."""
    return [
        sys.executable,
        "-m",
        "tree_attention_edu",
        "launch",
        "--cluster",
        "--seq-len",
        str(seq_len),
    ]


def check_detections(step: SlurmStep, outputs: Sequence[str]) -> str | None:
    """Did every task get, from `jax.distributed.initialize()` with no arguments, the
    process index and count of its SLURM_PROCID and SLURM_NTASKS, on its own node? None if
    so, else one line that says which task did not. `outputs[i]`: task i's stdout."""
    for task, text in enumerate(outputs):
        found = [m for line in text.splitlines() if (m := DETECTED.fullmatch(line.strip()))]
        if not found:
            return f"task {task} did not say what jax.distributed.initialize() found"
        d = found[-1]
        want = {
            "index": str(task),
            "procid": str(task),
            "count": str(step.ntasks),
            "ntasks": str(step.ntasks),
            "node": step.nodes[step.node_of(task)],
        }
        got = {k: d[k] for k in want}
        if got != want:
            return f"task {task}: jax.distributed.initialize() gave {got}; expected {want}"
    return None


# ---------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class SlurmReport:
    """What `run_slurm` returns: the step it simulated and each task's stdout."""

    step: SlurmStep
    command: list[str]
    outputs: list[str]
    wall_s: float


def run_slurm(cfg: ClusterConfig, *, job_id: int | None = None) -> tuple[int, SlurmReport | None]:
    """Simulate `srun --nodes=cfg.nodes --ntasks-per-node=cfg.processes_per_node
    tree-attention-edu launch --cluster` on namespaces; returns `(exit status, report)`.

    Uses `cfg`'s nodes, processes per node, devices per process, first link rate, link
    delay, seq_len, timeout and prefix. `job_id` (default: this process's id) sets the
    coordinator's port, as SLURM's job id does. Raises `netns.NoPrivilege` before making
    anything without root, ValueError on bad settings; SIGTERM, SIGHUP and SIGINT tear
    everything down and raise `SystemExit(128 + signal)`. On failure, one line on stderr
    and the tasks' logs are kept.
    """
    cfg.check()
    reason = netns.missing_privileges()
    if reason:
        raise netns.NoPrivilege(reason)
    t0 = time.monotonic()
    removed = netns.clear_leftovers(cfg.prefix)
    if removed:
        print(f"cluster: note: removed a killed run's {', '.join(removed)}", file=sys.stderr)
    logdir = tempfile.mkdtemp(prefix="tae-slurm-")
    failed = False
    try:
        with ps.signal_flag() as flag:
            outcome, step = _build_and_watch(cfg, job_id or os.getpid(), logdir, flag)
        if flag.signum is not None and outcome.code == 128 + flag.signum:
            print(f"cluster: {outcome.message}; removed the namespaces", file=sys.stderr)
            raise SystemExit(outcome.code)
        outputs = [_read(os.path.join(logdir, f"task{i}.out")) for i in range(cfg.processes)]
        if not outcome.code and step is not None:
            bad = check_detections(step, outputs)
            outcome = ps.Outcome(1, bad) if bad else outcome
        if outcome.code or step is None:
            failed = True
            print(f"cluster: error: {outcome.message} (task logs: {logdir})", file=sys.stderr)
            return outcome.code or 1, None
        return 0, SlurmReport(step, task_command(cfg.seq_len), outputs, time.monotonic() - t0)
    finally:
        if not failed:  # the logs of a failed run stay, for its one line names them
            shutil.rmtree(logdir, ignore_errors=True)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _build_and_watch(
    cfg: ClusterConfig, job_id: int, logdir: str, flag: ps.SignalFlag
) -> tuple[ps.Outcome, SlurmStep | None]:
    """Make the network, start every task in its node and watch them to the end; then kill
    every task and remove the network, whatever happened. Returns the outcome and the step
    (None if the network was never made)."""
    procs: list[subprocess.Popen] = []
    logs = [os.path.join(logdir, f"task{i}.log") for i in range(cfg.processes)]
    net, step = None, None
    try:
        net = netns.create(
            cfg.nodes, cfg.link_gbit[0] * 1e9, prefix=cfg.prefix, delay_s=cfg.delay_s
        )
        step = SlurmStep(
            job_id, tuple(net.host(i) for i in range(cfg.nodes)), cfg.processes_per_node
        )
        base = ps.worker_env()  # the launcher's pid in it: each task guards itself
        for i in range(step.ntasks):
            if flag.signum is not None:
                break
            env = task_environment(base, step, i, cfg.devices_per_process)
            cmd = ["ip", "netns", "exec", net.node(step.node_of(i)), *task_command(cfg.seq_len)]
            out = os.path.join(logdir, f"task{i}.out")
            procs.append(ps.start_worker(cmd, env, logs[i], out))
        deadline = time.monotonic() + cfg.timeout
        outcome = ps.watch_workers(procs, logs[: len(procs)], flag, deadline, cfg.timeout)
    except netns.NetworkError as e:
        if flag.signum is None:
            raise
        outcome = ps.Outcome(128 + flag.signum, f"stopped while building the network ({e})")
    finally:
        ps.kill_workers(procs)
        if net is not None:
            netns.destroy(net)
    return outcome, step


def summary(rep: SlurmReport) -> str:
    """Each task's lines, then one line that says what was shown."""
    s = rep.step
    rows = [
        f"cluster --slurm: job {s.job_id} step {s.step_id}: {s.ntasks} task(s) on "
        f"{len(s.nodes)} node(s), SLURM_STEP_NODELIST={s.nodelist}, "
        f"SLURM_TASKS_PER_NODE={s.task_env(0)['SLURM_TASKS_PER_NODE']}; each task ran "
        f"`{' '.join(['python', *rep.command[1:]])}` in its node's namespace"
    ]
    for text in rep.outputs:  # gloo's "[Gloo] Rank r is connected to ..." lines left out
        rows += [line for line in text.splitlines() if line.strip() and "[Gloo]" not in line]
    rows.append(
        f"cluster --slurm: every task's jax.distributed.initialize(), given no arguments, "
        f"took its process id and count from SLURM_PROCID and SLURM_NTASKS; tree and ring "
        f"agree with float64 attention ({rep.wall_s:.1f} s)"
    )
    return "\n".join(rows)
