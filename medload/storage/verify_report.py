"""What ``medload verify`` found: one :class:`Damage` per finding, gathered in a :class:`VerifyReport`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["KINDS", "RESTORE", "Damage", "VerifyReport", "reingest_hint", "ranges"]

#: what a finding can be about
KINDS = ("manifest", "shard", "slice", "series", "index", "label", "orphan", "source")
#: what to do about a shard that cannot be read or changed after it was published
RESTORE = ("restore the shard from a backup, or ingest its series again (`medload repair STORE --sources DIR` "
           "retires the shard once they are)")


def reingest_hint(key: str) -> str:
    """What to do about a damaged series."""
    return (f"re-ingest it from its sources (`medload repair STORE --sources DIR`, or "
            f"`medload ingest DIR STORE --force {key[:12]}`)")


@dataclass(frozen=True)
class Damage:
    """One finding: its kind (see :data:`KINDS`), which thing (shard, series key, ``"KEY z=Z"``...),
    and one line saying what is wrong and what to do. ``series`` is the key of the stored series it
    damages, when there is one (re-ingesting that series repairs it); ``shard`` the shard it is in;
    ``unreadable`` when readers cannot use that shard at all (``medload repair`` retires it once its
    series are stored again)."""

    kind: str
    where: str
    detail: str
    series: str | None = None
    shard: str | None = None
    unreadable: bool = False

    def __str__(self) -> str:
        return f"{self.kind:8} {self.where}: {self.detail}"


@dataclass
class VerifyReport:
    """What :func:`~medload.storage.verify.verify_store` read and found; ``ok`` when it found no damage
    (notes do not count). ``changed``: shards whose ``data.mdb`` has the size ``store.json`` records but
    other bytes; ``unreadable``: shards readers cannot use at all (missing, another size, not LMDB, a
    damaged B-tree, other records than ``store.json`` lists); ``labels_lost``: series whose live copy has no
    labels although an earlier copy had (a note each: ``medload repair --labels`` stores them again)."""

    store: str
    shards: int = 0
    series: int = 0
    slices: int = 0
    labels: int = 0
    damage: list[Damage] = field(default_factory=list)
    notes: list[Damage] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    labels_lost: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.damage

    @property
    def resealable(self) -> list[str]:
        """Changed shards with no other damage: every live value in them verified, so the change lies in
        superseded or free pages, and ``store.json`` may record their bytes again (``medload repair``)."""
        return [s for s in self.changed if s not in self.unreadable and sum(d.shard == s for d in self.damage) == 1]

    @property
    def unreadable(self) -> list[str]:
        return sorted({d.shard for d in self.damage if d.unreadable and d.shard is not None})  # add_unreadable names it

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "unreadable": self.unreadable}

    def add(self, kind: str, where: str, detail: str, *, series: str | None = None, shard: str | None = None) -> None:
        self.damage.append(Damage(kind, where, detail, series, shard))

    def add_unreadable(self, shard: str, detail: str) -> None:
        """Damage that makes ``shard`` unusable by readers."""
        self.damage.append(Damage("shard", shard, detail, shard=shard, unreadable=True))


def ranges(zs: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out, start = [], None
    for i, z in enumerate(zs):
        start = z if start is None else start
        if i + 1 == len(zs) or zs[i + 1] != z + 1:
            out.append(str(start) if start == z else f"{start}-{z}")
            start = None
    return ", ".join(out)
