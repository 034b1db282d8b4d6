"""Who may read a store: its owner only (the default), or a group too.

Sharing is a property of the store, recorded in ``store.json`` (``share``) and applied by every writer
(``ingest``, ``compact``, ``repair``, ``medload share``) to every file and folder it creates or rewrites,
so the owner's next write never takes a shared store back. The settings:

- ``private``: files 0600, folders 0700 (the owner only).
- ``group``: files 0640, folders 0750: readable by the group that owns the store's folder (an administrator
  gives the store to a team with ``chgrp -R TEAM STORE``).
- ``group:NAME``: the same, and every file and folder is given group NAME (the writer must be a member).

Group members read (``open_store``, training, ``ls``, ``verify``); only the owner writes. Permissions
changed by hand are not silently undone: a writer that finds ``store.json`` group-readable -- an
administrator ran ``chmod -R g+rX STORE`` -- keeps the store shared with its group (``group``), and one that
finds it owner-only keeps the store private, whatever ``store.json`` recorded (or a store made by an
earlier medload, which records nothing); it records the setting it keeps and logs the change (see
:func:`reconciled_setting`). Modes are set explicitly, whatever the umask.
"""

from __future__ import annotations

import grp
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from medload.config import SHARE_GROUP as GROUP
from medload.config import SHARE_PRIVATE as PRIVATE
from medload.config import check_share_setting as check_setting
from medload.errors import ConfigError

__all__ = ["PRIVATE", "GROUP", "Sharing", "check_setting", "reconciled_setting", "sharing_of", "sharing_like",
           "share_command"]

log = logging.getLogger(__name__)



def share_command(root: Path) -> str:
    """What the owner of the store at ``root`` runs to let a group read it."""
    return f"`medload share {root} --group GROUP`"


@dataclass(frozen=True)
class Sharing:
    """A share setting resolved on this machine: the modes of files and folders, and the group id that
    files are given (None: private, the group is left as it is; or a group the writer cannot give)."""

    setting: str
    gid: int | None

    @property
    def shared(self) -> bool:
        return self.setting != PRIVATE

    @property
    def file_mode(self) -> int:
        return 0o640 if self.shared else 0o600

    @property
    def dir_mode(self) -> int:
        return 0o750 if self.shared else 0o700

    def fix_fd(self, fd: int) -> None:
        """Give the open file ``fd`` its mode and group (before it is renamed into place)."""
        os.fchmod(fd, self.file_mode)
        if self.gid is not None and os.fstat(fd).st_gid != self.gid:
            os.fchown(fd, -1, self.gid)

    def apply(self, path: Path) -> None:
        """Give ``path`` -- a file or a folder and everything under it -- the modes and group of this setting.
        Symbolic links are left alone; so are files this process may not change (not the owner's)."""
        self._fix(path)
        if path.is_dir() and not path.is_symlink():
            for top, dirs, files in os.walk(path):
                for name in dirs + files:
                    self._fix(Path(top) / name)

    def _fix(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # removed meanwhile (a writer's lock file, a staging shard)
        if stat.S_ISLNK(st.st_mode):
            return
        mode = self.dir_mode if stat.S_ISDIR(st.st_mode) else self.file_mode
        try:
            if stat.S_IMODE(st.st_mode) != mode:
                os.chmod(path, mode)
            if self.gid is not None and st.st_gid != self.gid:
                os.chown(path, -1, self.gid)
        except PermissionError:
            log.warning("cannot give %s the modes of share setting %r (it is not yours): ask its owner to run "
                        "`chmod` on it", path, self.setting)


def _may_give(gid: int) -> bool:
    """Whether this process may give its files group ``gid`` (it is root, or a member)."""
    return os.geteuid() == 0 or gid == os.getegid() or gid in os.getgroups()


def sharing_of(root: Path, setting: str) -> Sharing:
    """Resolve ``setting`` for the store at ``root`` on this machine (``group``: the group of ``root``)."""
    check_setting(setting)
    if setting == PRIVATE:
        return Sharing(setting, None)
    _, _, name = setting.partition(":")
    if name:
        try:
            gid = grp.getgrnam(name).gr_gid
        except KeyError:
            raise ConfigError(f"share setting {setting!r}: there is no group {name!r} on this machine (`getent group` "
                              "lists them)") from None
        if not _may_give(gid):
            raise ConfigError(f"share setting {setting!r}: you are not a member of group {name!r}, so the store's files "
                              "cannot be given to it (`id` lists your groups)")
        return Sharing(setting, gid)
    gid = root.stat().st_gid
    if not _may_give(gid):
        log.warning("the folder of %s belongs to group %s, which you are not a member of: new files keep your own "
                    "group; run `medload share %s --group NAME` with a group you are in", root, gid, root)
        return Sharing(setting, None)
    return Sharing(setting, gid)


def sharing_like(info: os.stat_result) -> Sharing:
    """The sharing of a file of a store, from its ``stat``: what a copy of it gets (a hot-shard copy is as
    readable as the shard it copies)."""
    if info.st_mode & stat.S_IRGRP:
        return Sharing(GROUP, info.st_gid if _may_give(info.st_gid) else None)
    return Sharing(PRIVATE, None)


def reconciled_setting(recorded: str | None, store_json: Path) -> str:
    """The setting a writer keeps: the one ``store_json`` records, unless the file's own modes say otherwise --
    someone changed them by hand, on purpose, and a writer does not silently undo that. A group-readable
    ``store.json`` (``chmod -R g+rX``) keeps the store shared with its group; an owner-only one (``chmod -R
    go-rwx``, or a rewrite by a medload that predates sharing) keeps it private. A change is logged."""
    try:
        info = store_json.stat()
    except FileNotFoundError:
        return recorded or PRIVATE
    readable = bool(info.st_mode & stat.S_IRGRP)
    if recorded is not None and readable == (recorded != PRIVATE):
        return recorded
    root = store_json.parent
    if readable:
        others = " (others lose their access: medload shares a store with a group only)" if (
            info.st_mode & stat.S_IROTH) else ""
        log.warning("%s is group-readable, and the store records share setting %r: someone shared it by hand; it "
                    "stays shared with its group, as store.json now records%s (`medload share %s --private` makes "
                    "it private)", store_json, recorded or "none", others, root)
        return GROUP
    if recorded is not None:
        log.warning("%s is its owner's only, and the store records share setting %r: someone made it private by "
                    "hand (or a medload that predates sharing rewrote it); it stays private, as store.json now "
                    "records (`medload share %s` shares it again)", store_json, recorded, root)
    return PRIVATE
