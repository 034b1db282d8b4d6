"""Deprecated: pseudonymisation moved to :mod:`medload.deid`, the package's base, since PACS ingest,
write-back and verification use it as much as ingest does. This alias goes in the next release.
"""

import warnings

from medload.deid import KeyFile, Pseudonymizer, create_key, default_key_path, load_key

__all__ = ["KeyFile", "Pseudonymizer", "load_key", "create_key", "default_key_path"]

warnings.warn("medload.ingest.deid moved to medload.deid: import it from there (the old name goes in the next "
              "release)", DeprecationWarning, stacklevel=2)
