"""One set of label classes for a whole exported dataset, and per series the table that maps its stored
class ids onto it.

nnU-Net v2 wants every case's labels in one numbering: ``"labels": {"background": 0, "liver": 1, ...}``
in ``dataset.json``, the ids consecutive from 0 (nnU-Net's documentation, "dataset.json"). The stored
label maps number their classes per series (SEG SegmentNumber, RTSTRUCT ROI order or ``--roi-map``, a
mask's values), so either they already agree, and are exported as stored, or a label map says which
stored class names make each exported class.

Example:
    >>> from medload.storage.records import LabelRecord
    >>> def rec(classes):
    ...     return LabelRecord("k", "uint8", classes, (), "mask", "m.nii.gz", "f", "d")
    >>> labels, luts, notes = dataset_classes([rec({"1": "Liver"}), rec({"1": "class_1"})],
    ...                                       {"liver": ["liver"], "bone": ["class_1"]})
    >>> labels
    {'background': 0, 'liver': 1, 'bone': 2}
    >>> luts[1][:3].tolist()           # the second series' stored class 1 becomes class 2
    [0, 2, 0]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np

from medload.errors import ConfigError
from medload.storage.records import LabelRecord

__all__ = ["dataset_classes"]

_BACKGROUND = "background"


def dataset_classes(records: Sequence[LabelRecord], label_map: Mapping[str, Sequence[str]] | None = None,
                    ) -> tuple[dict[str, int], list[np.ndarray], list[str]]:
    """nnU-Net's ``labels`` (name -> id, background 0 first), a lookup table per label record (stored
    voxel value -> exported value, indexable by any value of the stored dtype) and notes on classes left
    out.

    Without ``label_map`` the stored classes are kept as they are, which needs every series to give each
    class id the same name and the ids to run 1..N. ``label_map`` (``{"liver": ["Liver", "LIVER_1"]}``,
    the form of ``--roi-map``) makes exported class k the k-th key, from the stored classes of those names
    (matched case-insensitively); stored classes it does not name are exported as background, with a note.

    Raises:
        ConfigError: the stored classes disagree (without a map), or the map is malformed.
    """
    if label_map is None:
        labels = _stored_classes(records)
        alias = {name.lower(): cid for name, cid in labels.items() if cid}
    else:
        labels, alias = _mapped_classes(label_map)
    out_dtype = np.uint8 if len(labels) <= 256 else np.uint16
    luts, notes, found = [], [], set()
    for rec in records:
        lut = np.zeros(np.iinfo(np.dtype(rec.dtype)).max + 1, dtype=out_dtype)
        for cid, name in rec.classes.items():
            target = alias.get(name.strip().lower())
            if target is None:
                notes.append(f"series {rec.key[:12]}: class {cid} {name!r} is not in the label map: exported as "
                             "background")
                continue
            lut[int(cid)] = target
            found.add(target)
        luts.append(lut)
    notes += [f"label {name!r} ({cid}): no exported series has any of its classes"
              for name, cid in labels.items() if cid and cid not in found]
    return labels, luts, notes


def _stored_classes(records: Sequence[LabelRecord]) -> dict[str, int]:
    """The classes the series share, when they agree; otherwise a ConfigError that says how to map them."""
    name_of: dict[int, str] = {}
    for rec in records:
        for cid, name in rec.classes.items():
            if name_of.setdefault(int(cid), name) != name:
                raise ConfigError(f"stored classes disagree: class {cid} is {name_of[int(cid)]!r} in some series and "
                                  f"{name!r} in series {rec.key[:12]}: give a label map (--label-map map.json) "
                                  f"such as {_suggestion(records)}")
    by_name: dict[str, int] = {}
    for class_id, name in sorted(name_of.items()):
        if by_name.setdefault(name.lower(), class_id) != class_id:
            raise ConfigError(f"class name {name!r} has ids {by_name[name.lower()]} and {class_id} in different series: "
                              f"give a label map (--label-map map.json) such as {_suggestion(records)}")
    if sorted(name_of) != list(range(1, len(name_of) + 1)):
        raise ConfigError(f"stored class ids {sorted(name_of)} are not consecutive from 1, as nnU-Net needs: give a "
                          f"label map (--label-map map.json) such as {_suggestion(records)}")
    if _BACKGROUND in by_name:
        raise ConfigError(f"a stored class is named {_BACKGROUND!r}, nnU-Net's name for label 0: rename it with a "
                          f"label map (--label-map map.json) such as {_suggestion(records)}")
    return {_BACKGROUND: 0, **{name_of[cid]: cid for cid in sorted(name_of)}}


def _mapped_classes(label_map: Mapping[str, Sequence[str]]) -> tuple[dict[str, int], dict[str, int]]:
    """nnU-Net's labels from a label map, and stored name (lower case) -> exported id."""
    if not isinstance(label_map, Mapping) or not label_map:
        raise ConfigError('a label map is a non-empty {"exported class": ["stored class name", ...]} mapping, '
                          f"got {label_map!r}")
    labels: dict[str, int] = {_BACKGROUND: 0}
    alias: dict[str, int] = {}  # stored class name, lower case -> exported id
    for cid, (name, sources) in enumerate(label_map.items(), start=1):
        if not isinstance(name, str) or not name.strip() or name.strip().lower() == _BACKGROUND:
            raise ConfigError(f"label map class {name!r}: use a non-empty name other than {_BACKGROUND!r} "
                              "(nnU-Net's label 0)")
        if isinstance(sources, str) or not all(isinstance(s, str) for s in sources):
            raise ConfigError(f"label map[{name!r}] must be a list of stored class names, got {sources!r}")
        labels[name] = cid
        for source in sources:
            if alias.setdefault(source.strip().lower(), cid) != cid:
                raise ConfigError(f"stored class {source!r} is listed under two classes of the label map: keep it "
                                  "under one")
    return labels, alias


def _suggestion(records: Sequence[LabelRecord]) -> str:
    """A label map (JSON) with one class per stored class name (its spellings together), a starting point."""
    spellings: dict[str, set[str]] = {}
    for rec in records:
        for name in rec.classes.values():
            spellings.setdefault(name.strip().lower(), set()).add(name)
    rename = {_BACKGROUND: f"stored_{_BACKGROUND}"}  # the one name the map may not use
    return json.dumps({rename.get(low, low): sorted(spellings[low]) for low in sorted(spellings)})
