"""The journal of ``medload compact`` and the recovery of a compaction that was killed.

``medload compact`` (:mod:`medload.storage.compact`) replaces a shard OLD by NEW, a copy of OLD's live
data, in six steps:

1. build ``staging/NEW.compact`` and sync it (a directory that no reader or writer looks at);
2. write ``STORE/compact.json`` = ``{"old": OLD, "new": NEW}`` atomically;
3. rename the build to ``shards/NEW.lmdb``;
4. replace OLD by NEW in ``store.json``, at OLD's place in the publish order (one atomic rewrite);
5. remove ``shards/OLD.lmdb``;
6. remove ``compact.json``.

NEW is None when nothing in OLD is live: steps 1 and 3 are skipped and step 4 drops OLD's entry.
Readers see OLD until step 4 and NEW from then on, so the store verifies in every state in between.
What a kill leaves is tidied by :func:`finish_interrupted`, which every writer runs (under
``writer.lock``) before it adopts unlisted shards: an ingest must not publish NEW as a shard of its
own, since it would hold a second copy of OLD's series.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from medload.errors import StoreFormatError
from medload.storage.manifest import Manifest, fsync_dir, shard_path, write_file_atomic
from medload.storage.sharing import Sharing

__all__ = ["build_path", "write_journal", "remove_journal", "finish_interrupted"]

log = logging.getLogger(__name__)

_JOURNAL = "compact.json"
_BUILD_SUFFIX = ".compact"


def build_path(root: Path, name: str) -> Path:
    """Where compact builds shard ``name`` before it is published (step 1)."""
    return root / "staging" / f"{name}{_BUILD_SUFFIX}"


def write_journal(root: Path, old: str, new: str | None, sharing: Sharing) -> None:
    """Step 2: record that shard ``old`` is being replaced by ``new`` (None: removed)."""
    write_file_atomic(root / _JOURNAL, json.dumps({"old": old, "new": new}).encode(), sharing)


def remove_journal(root: Path) -> None:
    """Step 6: the replacement is complete."""
    (root / _JOURNAL).unlink(missing_ok=True)
    fsync_dir(root)


def finish_interrupted(root: Path, manifest: Manifest) -> None:
    """Tidy what a killed compaction left, by what ``store.json`` lists: if it does not list NEW yet, NEW
    (a copy of live data OLD still holds) is removed; if it does, OLD is. Builds of step 1 are removed."""
    journal = root / _JOURNAL
    if journal.exists():
        try:
            doc = json.loads(journal.read_text())
            old, new = doc["old"], doc["new"]
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreFormatError(f"{journal} is damaged ({exc}): compare its shards with store.json by hand, "
                                   "or remove it if no shard it names is unlisted") from None
        listed = {e.name for e in manifest.shards}
        if new is not None and new not in listed:
            _remove(shard_path(root, new), "the unpublished copy of an interrupted compaction")
        elif old not in listed:
            _remove(shard_path(root, old), "a shard an interrupted compaction had replaced")
        remove_journal(root)
    for build in sorted((root / "staging").glob(f"*{_BUILD_SUFFIX}")):
        _remove(build, "the unfinished build of an interrupted compaction")


def _remove(path: Path, what: str) -> None:
    if path.exists():
        log.warning("removing %s: %s", path, what)
        shutil.rmtree(path)
        fsync_dir(path.parent)
