"""Optional features and the pip extras that install them.

A core install (``pip install medload``) ingests files, keeps the store and feeds training. Everything else
is an extra, named in ``pyproject.toml``'s ``[project.optional-dependencies]``; a feature whose extra is
missing raises :class:`MissingExtraError`, which gives the pip command that installs the extra into the
running environment (from the checkout, for a source install such as ``make demo``'s).

Examples:
    >>> from medload.extras import EXTRAS, require
    >>> EXTRAS["viz"]
    ('pandas', 'matplotlib')
    >>> require("no_such_module", "viz", "Plots")
    Traceback (most recent call last):
    ...
    medload.extras.MissingExtraError: Plots needs no_such_module, which is not installed: ...pip install ...[viz]...
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from medload.errors import MedloadError

__all__ = ["EXTRAS", "MissingExtraError", "require", "require_all"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "dicomweb": ("httpx",),
    "pacs": ("pynetdicom",),
    "dask": ("dask", "distributed"),
    "slurm": ("dask", "distributed", "dask_jobqueue"),
    "viz": ("pandas", "matplotlib"),
    "lightning": ("lightning",),
    "bench": ("zarr", "h5py", "pandas", "matplotlib", "dask", "distributed"),
    "nnunet": ("nnunetv2",),
}
"""The modules each extra brings, by import name (``pyproject.toml`` holds their distribution names)."""


class MissingExtraError(MedloadError, ImportError):
    """A feature needs an optional dependency this install lacks; the message names the pip extra."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module``, or raise :class:`MissingExtraError` saying that ``feature`` needs
    ``pip install 'medload[extra]'``. An import error *inside* an installed module is not hidden."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or module.split(".")[0] != exc.name.split(".")[0]:
            raise
        raise _missing(exc.name, extra, feature) from exc


def require_all(extra: str, feature: str) -> None:
    """Check that every module of ``extra`` (see :data:`EXTRAS`) is installed, without importing any (a
    process that checks pays no memory for modules it may never use), or raise :class:`MissingExtraError`."""
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            raise _missing(module, extra, feature)


def _missing(module: str, extra: str, feature: str) -> MissingExtraError:
    return MissingExtraError(f"{feature} needs {module}, which is not installed: {_install_command(extra)}")


def _install_command(extra: str) -> str:
    """The pip command that adds ``extra`` to this environment: from the checkout when medload runs from one
    (a source install, as ``make demo`` makes), from the package index otherwise."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "medload"' in pyproject.read_text(errors="replace"):
        return f"{sys.executable} -m pip install -e '{root}[{extra}]'"
    return f"pip install 'medload[{extra}]' (or 'medload[all]')"
