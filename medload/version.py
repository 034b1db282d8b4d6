"""The installed release of medload, from the package metadata (PEP 566), for the records and headers that
name their writer (``store.json``'s ``created_by``, a SEG's software version, the PACS clients' user agent).

Examples:
    >>> from medload.version import __version__
    >>> __version__ == medload.__version__
    True
"""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("medload")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
