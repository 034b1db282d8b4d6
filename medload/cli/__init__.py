"""``medload`` command line: a thin surface over the package (no logic lives only here).

One module per group of commands; importing this package registers them all on :data:`cli`.
"""

from medload.cli import (  # noqa: F401  (register the commands)
    bench,
    cache,
    compact,
    export_nnunet,
    ingest,
    inspect_store,
    integrity,
    lineage,
    profile,
    push_seg,
    share,
)
from medload.cli.app import cli, main

__all__ = ["cli", "main"]
