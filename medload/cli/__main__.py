"""``python -m medload.cli``: the same as the ``medload`` command."""

from medload.cli import main

main()
