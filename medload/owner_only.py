"""Secret files only their owner may read: a DICOMweb credentials file, the pseudonymisation key.

A secret in a file that others can read (a home folder on a shared server, a default umask of 022) is a
secret shared with every user of the machine, so medload refuses such a file and says how to fix it.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from medload.errors import ConfigError

__all__ = ["check_owner_only"]

log = logging.getLogger(__name__)


def check_owner_only(path: Path, what: str, *, shared_option: str = "", allow_shared: bool = False) -> None:
    """Refuse ``path`` (``what`` names it in the message) unless it is a regular file of this user that no one
    else may read or write (mode 0600 or 0400). ``shared_option`` is the option that accepts a shared file
    (the refusal names it); ``allow_shared`` (that option given) turns the refusal into a warning."""
    try:
        info = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file")
    if info.st_uid != os.getuid():
        problem, fix = "belongs to another user", "use a file of your own (mode 0600)"
    elif info.st_mode & 0o077:
        problem = f"is readable or writable by other users (mode {stat.S_IMODE(info.st_mode):04o})"
        fix = f"run `chmod 600 {path}`"
    else:
        return
    if allow_shared:
        log.warning("%s %s %s: using it, as %s asks", what, path, problem, shared_option)
        return
    shared = f", or pass {shared_option} if it is shared on purpose" if shared_option else ""
    raise ConfigError(f"{what} {path} {problem}: {fix}{shared}")
