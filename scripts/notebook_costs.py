"""Run time and peak resident memory of each notebook, for the README's table.

Each notebook is executed on a copy beside it (the committed outputs are not touched) by
`jupyter nbconvert --execute` in a fresh process; its kernel is that process's child, so the
child's peak resident set (`getrusage(RUSAGE_CHILDREN)`) is the kernel's. Run it on an idle
machine, one notebook at a time:

    python scripts/notebook_costs.py            # every notebook
    python scripts/notebook_costs.py 07 09      # the notebooks whose names start so
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import resource, subprocess, sys
subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                "--ExecutePreprocessor.timeout=1800", "--output", sys.argv[2], sys.argv[1]],
               check=True, capture_output=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KiB on Linux
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prefixes", nargs="*", help="notebook name prefixes, e.g. 07")
    args = parser.parse_args()
    notebooks = sorted(
        p
        for p in (ROOT / "notebooks").glob("*.ipynb")
        if not args.prefixes or p.name.startswith(tuple(args.prefixes))
    )
    if not notebooks:
        sys.exit(f"no notebook starts with {args.prefixes}")
    print(f"{'notebook':<40}{'run time':>10}{'peak RSS':>10}")
    for nb in notebooks:
        copy = nb.with_name(f".costs-{nb.name}")  # beside it: relative paths still hold
        shutil.copy(nb, copy)
        try:
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(copy), str(copy)],
                check=True,
                capture_output=True,
                text=True,
                cwd=nb.parent,
            )
            seconds = time.perf_counter() - t0
        finally:
            copy.unlink(missing_ok=True)
        rss_gb = int(out.stdout.split()[-1]) * 1024 / 1e9
        print(f"{nb.name:<40}{seconds:>9.0f}s{rss_gb:>8.1f} GB", flush=True)


if __name__ == "__main__":
    main()
