"""`python -m tree_attention_edu.cli.forwarder SPEC`: the delay forwarder of a cluster whose
links have a set one-way delay, as `cluster.delay.start` runs it (inside the switch
namespace; SPEC is JSON: the nodes' namespaces and addresses, the delay).

Not a command for people: it first guards itself against outliving its launcher, then
forwards until it is killed; on failure it prints one line that starts with
`processes.WORKER_ERROR` (the launcher quotes it) and exits with status 1.
"""

from __future__ import annotations

import json
import os
import sys

from ..cluster import delay
from ..cluster import processes as ps
from .plumbing import report_worker_failure

USAGE = "usage: python -m tree_attention_edu.cli.forwarder SPEC_JSON (started by a launcher)"


def main(argv: list[str] | None = None) -> int:
    parent = os.environ.get(ps.PARENT_ENV)
    if parent:
        ps.guard_parent(int(parent))  # die with the launcher, even by SIGKILL
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        return delay.forwarder_main(json.loads(argv[0]))
    except Exception as e:
        return report_worker_failure(e, ps.WORKER_ERROR)


if __name__ == "__main__":
    sys.exit(main())
