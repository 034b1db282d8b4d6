"""The pseudonymisation key of a store on disk: the key file (:func:`medload.deid.load_key`) checked
against the fingerprint ``store.json`` records, before a key is ever created for it.

Examples:
    >>> from medload.deid import Pseudonymizer
    >>> key = load_store_key(None, "stores/sample")     # the key stores/sample was built with
    >>> Pseudonymizer(key).fingerprint == store.manifest.key_fingerprint
    True
"""

from __future__ import annotations

import os
from pathlib import Path

from medload.deid import KeyFile, load_key
from medload.storage.manifest import recorded_key_fingerprint

__all__ = ["load_store_key"]


def load_store_key(key_file: str | os.PathLike | KeyFile | None, store: str | os.PathLike, *,
                   create: bool = True) -> bytes:
    """The key for the store at ``store`` (which may not exist yet): a folder that cannot become a store is
    refused, and for an existing store a missing key is an error (never created) and another key refused."""
    root = Path(store)
    return load_key(key_file, store=root, recorded=recorded_key_fingerprint(root), create=create)
