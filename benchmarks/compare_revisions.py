"""Before/after: the loading benchmark run alternately on a git revision and on the working tree.

Usage: python benchmarks/compare_revisions.py REV [--rounds 3] [-- loading.py options]
e.g.   python benchmarks/compare_revisions.py HEAD --rounds 3 -- --kind 2.5d --workers 0 --repeats 5 \
           --contenders npy_memmap,medload

Run-to-run noise on a small VM is about +-20%, so a change is judged by alternating runs of the two
versions, each in fresh processes (``benchmarks/loading.py``), rather than by two runs an hour apart.
REV is checked out into a temporary git worktree and imported from there; each round prints, per
version, every contender's samples/s and its ratio to the npy memmap loader.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(tree: Path, options: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, str(tree / "benchmarks" / "loading.py"), *options, "--json", str(out)],
                   cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["loading"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="git revision to compare the working tree with (e.g. HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, options = parser.parse_args(argv[:cut]), argv[cut + 1 :]  # after --: options of benchmarks/loading.py
    with tempfile.TemporaryDirectory(prefix="medload-compare-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.rev], check=True)
        try:
            for r in range(args.rounds):
                for name, tree in ((args.rev, before), ("working tree", ROOT)):
                    for kind, sec in _run(tree, options, Path(tmp) / "out.json").items():
                        cells = [f"{row['contender']}@{row['num_workers']}: {row.get('samples_per_s') or 0:.0f}"
                                 + (f" ({row['x_npy_memmap']:.2f}x)" if row.get("x_npy_memmap") else "")
                                 for row in sec.get("rows", [])]
                        print(f"round {r + 1} {name:>12} {kind}: " + ", ".join(cells), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)


if __name__ == "__main__":
    main()
