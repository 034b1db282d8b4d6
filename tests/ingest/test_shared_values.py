"""The ingest process keeps one object per distinct value of the header fields that repeat from plane to
plane (medload.ingest.shared_values)."""

from __future__ import annotations

import pickle

from medload.ingest import shared_values
from medload.ingest.discover import SourceRef
from medload.ingest.headers import SliceHeader
from medload.ingest.shared_values import SharedValues


def _header(**changes) -> SliceHeader:
    values = {name: f"v{n}" for n, name in enumerate(SliceHeader._fields)}
    values.update(ref=SourceRef("/a/b.dcm", "", 10, None), rows=512, cols=512, slope=1.0, intercept=-1024.0,
                  orientation=(1.0, 0.0, 0.0, 0.0, 1.0, 0.0), position=(0.0, 0.0, 1.5), times=("1", ""))
    values.update(changes)
    return pickle.loads(pickle.dumps(SliceHeader(**values)))  # objects of its own, as the ingest process receives it


def test_equal_values_become_one_object_and_the_rest_stay_each_headers_own():
    shared = SharedValues()
    first, second = shared.share(_header()), shared.share(_header(position=(0.0, 0.0, 3.0), instance="other"))
    for name in ("series", "study", "patient", "orientation", "times", "transfer_syntax", "rows", "intercept"):
        assert getattr(first, name) is getattr(second, name), name
    assert first.position != second.position and first.instance != second.instance
    assert first.ref is not second.ref  # each plane's file is its own
    assert second == _header(position=(0.0, 0.0, 3.0), instance="other")  # same values: only objects are shared


def test_equal_values_of_another_type_are_not_shared():
    shared = SharedValues()
    shared.share(_header(slope=1.0))
    as_int = shared.share(_header(slope=1))
    assert type(as_int.slope) is int


def test_every_shared_name_is_a_header_field():
    assert set(shared_values._SHARED) <= set(SliceHeader._fields)
    assert not {"ref", "instance", "position", "frame"} & set(shared_values._SHARED)
