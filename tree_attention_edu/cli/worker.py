"""`python -m tree_attention_edu.cli.worker SPEC.json`: one worker process of a local launch
or of a cluster on this machine, as its launcher starts it (`cluster.processes.WorkerSpec`
says what it runs: `cluster.launch.local_worker` or `cluster.worker.run_process`).

Not a command for people: it first guards itself against outliving its launcher, then runs,
and on failure prints one line that starts with `processes.WORKER_ERROR` (the launcher
quotes it) and exits with status 1, or `launch.EX_PORT` when worker 0 cannot bind the
coordinator's port (the launcher then retries with another).
"""

from __future__ import annotations

import os
import sys

from ..cluster import launch
from ..cluster import processes as ps
from .plumbing import report_worker_failure

USAGE = "usage: python -m tree_attention_edu.cli.worker SPEC.json (started by a launcher)"


def run(spec: ps.WorkerSpec) -> int:
    """Run what `spec` says; its exit status."""
    ps.test_sleep(spec.process_id)
    if spec.role == "launch":
        return launch.local_worker(launch.LocalRun(**spec.settings), spec.process_id)
    if spec.role == "cluster":
        from ..cluster import worker
        from ..cluster.context import Settings

        return worker.run_process(Settings(**spec.settings), spec.process_id)
    if spec.role == "collectives":
        from ..cluster import collectives

        return collectives.worker_main(spec.settings, spec.process_id)
    raise ValueError(f"unknown worker role {spec.role!r}")


def main(argv: list[str] | None = None) -> int:
    parent = os.environ.get(ps.PARENT_ENV)
    if parent:
        ps.guard_parent(int(parent))  # die with the launcher, even by SIGKILL
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        return run(ps.WorkerSpec.read(argv[0]))
    except launch.PortInUse as e:
        print(f"{ps.WORKER_ERROR} {e}", file=sys.stderr, flush=True)
        return launch.EX_PORT
    except Exception as e:
        return report_worker_failure(e, ps.WORKER_ERROR)


if __name__ == "__main__":
    sys.exit(main())
