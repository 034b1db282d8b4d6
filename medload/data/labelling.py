"""Which series' labels a dataset trains on, and what its label values mean.

A hospital store is partly labelled: ``labels="only"`` keeps the selected series that have a label map
and says how many it left out. Each series numbers its own classes (SEG SegmentNumber, RTSTRUCT ROI
order, a mask's values), so label value 1 may be 'Liver' in one series and a bone mask in the next. A
class map (``classes=``) gives the dataset one numbering: label value k is the k-th class of the map,
made of the stored classes of those names (case-insensitive; :func:`medload.export.classes.dataset_classes`,
the rule nnU-Net export uses), and stored classes the map does not name become background. Merging is
asked for by listing several stored names under one class; without a map, series whose numbering
disagrees are warned about, never merged quietly.

Examples:
    >>> class_map(["liver", "spleen"])
    {'liver': ['liver'], 'spleen': ['spleen']}
    >>> parse_classes("liver,foreground=Liver+bone")       # the pipeline's --classes
    {'liver': ['liver'], 'foreground': ['Liver', 'bone']}
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from medload.errors import ConfigError
from medload.export.classes import dataset_classes
from medload.storage.records import LabelRecord, SeriesRecord

#: a dataset's ``classes=``: class names, or a map of class name to the stored names it merges
ClassMap = str | Sequence[str] | Mapping[str, str | Sequence[str]]

if TYPE_CHECKING:
    from medload.storage.store import Store

__all__ = ["LABEL_CHOICES", "check_labels_choice", "labelled_only", "select_labelled", "returns_labels", "class_map", "parse_classes", "class_tables", "stored_class_names"]

log = logging.getLogger(__name__)

#: What a dataset's ``labels=`` takes: None (labels when every selected series has them, with a warning
#: when only some do), True (every selected series must have them), False (none), "only" (the labelled ones).
LABEL_CHOICES = (None, True, False, "only")


def check_labels_choice(labels: object) -> None:
    """A ConfigError unless ``labels`` is one of :data:`LABEL_CHOICES`."""
    if not any(labels is c or (isinstance(c, str) and labels == c) for c in LABEL_CHOICES):
        raise ConfigError(f"labels must be None, True, False or 'only' (train on the labelled series), got {labels!r}")


def labelled_only(store: Store, records: Sequence[SeriesRecord]) -> tuple[list[SeriesRecord], list[str]]:
    """The records that have a label map, and the keys of those left out (logged with their number);
    a ConfigError where none has one."""
    kept = [r for r in records if store.labels(r.key) is not None]
    left_out = [r.key for r in records if store.labels(r.key) is None]
    if not kept:
        raise ConfigError(f"labels='only' leaves nothing: the {len(records)} selected series of {store.path} have no "
                          "labels: ingest them (medload ingest SRC STORE --labels PATH), or pass labels=False")
    if left_out:
        log.info("labels='only': %d of %d selected series of %s have no labels and are left out; training on the "
                 "other %d", len(left_out), len(records), store.path, len(kept))
    return kept, left_out


def select_labelled(store: Store, labels: bool | str | None, filters: dict[str, Any]) -> tuple[list[SeriesRecord], tuple[str, ...]]:
    """The series a dataset's ``filters`` select (a ConfigError saying what each matched where none does)
    and, with ``labels="only"``, the keys of those left out for having no labels."""
    from medload.storage.selection import require_series

    check_labels_choice(labels)
    records = require_series(store.series(), str(store.path), **filters)
    if labels != "only":
        return records, ()
    kept, left_out = labelled_only(store, records)
    return kept, tuple(left_out)


def returns_labels(store: Store, label_records: Sequence[LabelRecord | None], labels: bool | str | None, *, stacklevel: int = 4) -> bool:
    """Whether a dataset over series with these label records returns labels: ``True`` needs every series
    labelled (else a ConfigError), ``None`` means "when every series is" (with a warning when only some
    are), ``"only"`` kept just the labelled ones (:func:`select_labelled`). ``stacklevel``: of the warning,
    counted from here to the user's call."""
    missing = sum(lab is None for lab in label_records)
    if labels is True and missing:
        raise ConfigError(f"{missing} of {len(label_records)} series have no labels: pass labels='only' to train on "
                          "the labelled ones, filter them out (keys=...) or ingest their labels")
    if labels is None and missing and missing < len(label_records):
        warnings.warn(f"{missing} of {len(label_records)} series of {store.path} have no labels, so the dataset has "
                      "none: pass labels='only' to keep the labelled series, or labels=False to silence this",
                      UserWarning, stacklevel=stacklevel)
    return missing == 0 if labels is None else bool(labels)


def class_map(classes: ClassMap) -> dict[str, list[str]]:
    """A class map in its full form, ``{class: [stored class names]}``: a list of names is one class per
    stored name; a mapping may give one name as a string."""
    if isinstance(classes, str):
        classes = [classes]
    if isinstance(classes, Mapping):
        return {name: [sources] if isinstance(sources, str) else list(sources) for name, sources in classes.items()}
    if not classes or not all(isinstance(c, str) for c in classes):
        raise ConfigError(f"classes is a list of stored class names (['liver', 'spleen']) or a mapping "
                          f"{{'liver': ['Liver', 'LIVER_1']}}, got {classes!r}")
    return {name: [name] for name in classes}


def parse_classes(text: str) -> dict[str, list[str]]:
    """The class map of a command line: ``liver,spleen`` (one class per stored name) or
    ``NAME=STORED+STORED`` for a class made of several stored classes (a merge, asked for)."""
    out: dict[str, list[str]] = {}
    for part in (p.strip() for p in text.split(",")):
        name, merge, sources = part.partition("=")
        stored = [s.strip() for s in sources.split("+")] if merge else [name.strip()]
        if not name.strip() or not all(stored) or name.strip() in out:
            raise ConfigError(f"--classes {text!r}: give comma-separated stored class names (liver,spleen), or "
                              "NAME=STORED+STORED to merge classes into one (foreground=Liver+bone), each name once")
        out[name.strip()] = stored
    return out


def stored_class_names(records: Sequence[LabelRecord]) -> list[str]:
    """The distinct stored class names of label records (one spelling each, compared case-insensitively)."""
    names: dict[str, str] = {}
    for rec in records:
        for cid in sorted(rec.classes, key=int):
            names.setdefault(rec.classes[cid].strip().lower(), rec.classes[cid])
    return sorted(names.values(), key=str.lower)


def class_tables(records: Sequence[LabelRecord], classes: ClassMap | None) -> tuple[dict[int, str] | None, dict[str, np.ndarray] | None]:
    """What a dataset's label values mean (value -> class name, background left out), and per series key
    the table from its stored values to those values (None: values as stored).

    Without a class map the values are as stored; where the series' numberings disagree the meaning is
    None and a warning says how to pass a map. With one, a class of the map that no series holds is
    warned about (a misspelling, or a selection without it)."""
    if classes is None:
        return _stored_meaning(records), None
    labels, luts, _ = dataset_classes(records, class_map(classes))
    held = set().union(*(np.unique(lut).tolist() for lut in luts)) if luts else set()
    if absent := [name for name, value in labels.items() if value and value not in held]:
        warnings.warn(f"classes {absent} match no stored class of the {len(records)} labelled series (stored: "
                      f"{', '.join(stored_class_names(records))}): their label values stay empty", UserWarning,
                      stacklevel=4)
    return {v: name for name, v in labels.items() if v}, {rec.key: lut for rec, lut in zip(records, luts)}


def _stored_meaning(records: Sequence[LabelRecord]) -> dict[int, str] | None:
    """Value -> class name where every series numbers its classes alike; otherwise a warning, and None."""
    series_of: dict[int, dict[str, int]] = {}  # value -> class name (first spelling) -> series count
    spelling: dict[str, str] = {}              # lower-case name -> first spelling
    for rec in records:
        for stored_id, stored_name in rec.classes.items():
            name = spelling.setdefault(stored_name.strip().lower(), stored_name)
            counts = series_of.setdefault(int(stored_id), {})
            counts[name] = counts.get(name, 0) + 1
    ids_of: dict[str, list[int]] = {}
    for value in sorted(series_of):
        for name in series_of[value]:
            ids_of.setdefault(name, []).append(value)
    clash = [f"value {value} is " + " and ".join(f"{n!r} in {k} series" for n, k in sorted(
                 counts.items(), key=lambda nk: (-nk[1], nk[0])))
             for value, counts in sorted(series_of.items()) if len(counts) > 1]
    clash += [f"{name!r} is stored as values {ids}" for name, ids in sorted(ids_of.items()) if len(ids) > 1]
    if clash:
        stored = stored_class_names(records)
        warnings.warn(f"the stored label values of these series mean different classes ({'; '.join(clash)}), so one "
                      f"label value would stand for several classes: pass classes={stored!r} (one value per class), "
                      f"or classes={{'foreground': {stored!r}}} to merge them on purpose", UserWarning, stacklevel=5)
        return None
    return {value: next(iter(counts)) for value, counts in sorted(series_of.items())}
