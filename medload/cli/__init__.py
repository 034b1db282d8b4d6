"""``medload`` command line: a thin surface over the package (no logic lives only here).

One module per group of commands; importing this package registers them all on :data:`cli`.
"""

from medload.cli import bench, cache, compact, export_nnunet, ingest, inspect_store, integrity, profile, push_seg, share  # noqa: F401  (register the commands)
from medload.cli.app import cli, main

__all__ = ["cli", "main"]
