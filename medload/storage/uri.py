"""``medload:`` URIs: a text address for a slab or a 2.5D stack of a store, for MONAI's LoadImaged.

Format: ``medload:/abs/path/to/store?key=<series key>&z0=<first>&z1=<end>`` for a slab, or
``...?key=<key>&z=<centre>&context=<k>`` for a 2.5D stack, plus ``&label=1`` for the label map and
``&plane=<window>`` for a stored uint8 plane. MONAI turns file names into ``pathlib`` paths (which
collapse ``//``), so one slash after the scheme is the canonical form and more are accepted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlencode

from medload.errors import ConfigError

__all__ = ["ItemRef", "item_uri", "parse_item_uri", "is_item_uri", "monai_items"]

_URI = re.compile(r"^medload:/+(?P<path>[^?]*)\?(?P<query>.+)$")


@dataclass(frozen=True)
class ItemRef:
    """What a URI names: slices ``z0 <= z < z1`` of a series (``context`` set: the 2.5D stack of
    2*context+1 slices centred on ``z0``, edges replicated), HU or a plane, image or label."""

    store: Path
    key: str
    z0: int
    z1: int | None = None
    context: int | None = None
    label: bool = False
    plane: str | None = None


def is_item_uri(text: str | os.PathLike) -> bool:
    return str(text).startswith("medload:")


def item_uri(store: str | os.PathLike, key: str, z0: int, z1: int | None = None, *, context: int | None = None,
             label: bool = False, plane: str | None = None) -> str:
    """The URI of a slab (``z0``, ``z1``) or of a 2.5D stack (centre ``z0``, ``context``)."""
    query: dict[str, str | int | None] = {"key": key}
    query.update({"z": z0, "context": context} if context is not None else {"z0": z0, "z1": z1})
    if label:
        query["label"] = 1
    if plane:
        query["plane"] = plane
    return f"medload:{quote(str(Path(store).absolute()))}?{urlencode(query)}"


def monai_items(store: str | os.PathLike, starts: Sequence[tuple[str, Iterable[int]]], *, context: int | None,
                depth: int | None, plane: str | None, labels: bool) -> list[dict[str, str | int]]:
    """The items of :meth:`medload.Store.items`: for each ``(series key, first slices)``, one dict per start."""
    out: list[dict[str, str | int]] = []
    for key, zs in starts:
        for z in map(int, zs):
            z1 = None if depth is None else z + depth  # a slab ends at z1; a stack has context instead
            item: dict[str, str | int] = {"image": item_uri(store, key, z, z1, context=context, plane=plane)}
            if labels:
                item["label"] = item_uri(store, key, z, z1, context=context, label=True)
            item.update(key=key, z=z, index=len(out))
            out.append(item)
    return out


def parse_item_uri(text: str | os.PathLike) -> ItemRef:
    m = _URI.match(str(text))
    if not m:
        raise ConfigError(f"{text!r} is not a medload item URI (medload:/STORE?key=...&z0=...&z1=...)")
    q = {k: v[-1] for k, v in parse_qs(m.group("query")).items()}
    try:
        common = dict(store=Path("/" + unquote(m.group("path")).lstrip("/")), key=q["key"], label=q.get("label") == "1",
                      plane=q.get("plane"))
        if "context" in q:
            return ItemRef(z0=int(q["z"]), context=int(q["context"]), **common)
        return ItemRef(z0=int(q["z0"]), z1=int(q["z1"]), **common)
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{text!r} lacks or mangles {exc}: expected key and z0/z1 (or z and context)") from None
