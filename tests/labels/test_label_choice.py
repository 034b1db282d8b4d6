"""Several label objects for one series: one is kept by a documented rule, the others are skipped."""

from __future__ import annotations

import shutil

import highdicom as hd
import numpy as np
import pydicom
from pydicom.sr.codedict import codes

from medload.ingest.discover import SourceRef
from medload.ingest.labels import LabelInput, label_fingerprint
from medload.synthetic import SeriesSpec, make_rtstruct, make_series

SQUARE = np.array([[9.5, 7.5], [20.5, 7.5], [20.5, 15.5], [9.5, 15.5]])
SMALL = np.array([[3.5, 3.5], [8.5, 3.5], [8.5, 8.5], [3.5, 8.5]])


def _series(tmp_path):
    src = tmp_path / "src"
    gen = make_series(src, SeriesSpec(n_slices=6, rows=32, cols=40), seed=31)
    return src, gen


def _fingerprint(path) -> str:
    return label_fingerprint(LabelInput(SourceRef(str(path), None, path.stat().st_size), "rtstruct"), None)


def test_two_rtstructs_keep_one_by_content_not_by_file_name(tmp_path, run_ingest):
    src, gen = _series(tmp_path)
    a = make_rtstruct(gen, {"Liver": [(z, [SQUARE]) for z in (1, 2, 3)]}, tmp_path / "a.dcm")
    b = make_rtstruct(gen, {"Lesion": [(4, [SMALL])]}, tmp_path / "b.dcm")
    kept_path = min((a, b), key=_fingerprint)
    kept_rois = "Liver" if kept_path == a else "Lesion"
    chosen = []
    for first, second in (("1.dcm", "2.dcm"), ("2.dcm", "1.dcm")):  # the same files under swapped names
        run = tmp_path / f"run_{first}"
        shutil.copytree(src, run)
        shutil.copy(a, run / first)
        shutil.copy(b, run / second)
        report, store = run_ingest(run)
        (rec,) = store.series()
        label = store.labels(rec.key_bytes)
        chosen.append(tuple(label.classes.values()))
        outcomes = sorted((o.status, o.kind) for o in report.labels)
        assert outcomes == [("ingested", "rtstruct"), ("skipped", "rtstruct")]
        (skipped,) = [o for o in report.labels if o.status == "skipped"]
        assert skipped.key == rec.key and "keeps one" in skipped.reason and "content hash" in skipped.reason
        assert not [r for r in store.rejects(include_skipped=False) if r.stage == "labels"]  # not a rejection
        assert [r.status for r in store.rejects(include_skipped=True) if r.stage == "labels"] == ["skipped"]
        assert report.counts["rejected"] == 0
    assert chosen[0] == chosen[1] == (kept_rois,)


def test_a_seg_is_kept_before_an_rtstruct(tmp_path, run_ingest):
    src, gen = _series(tmp_path)
    make_rtstruct(gen, {"Liver": [(z, [SQUARE]) for z in (1, 2)]}, src / "rtstruct.dcm")
    sources = [pydicom.dcmread(p) for p in gen.paths]
    mask = np.zeros((6, 32, 40, 1), bool)
    mask[2:5, 10:20, 5:15, 0] = True
    description = hd.seg.SegmentDescription(1, "Spleen", codes.SCT.Tissue, codes.SCT.Spleen,
                                            hd.seg.SegmentAlgorithmTypeValues.MANUAL)
    hd.seg.Segmentation(sources, mask, "BINARY", [description], hd.UID(), 99, hd.UID(), 1, "medload", "test", "0",
                        "0").save_as(src / "seg.dcm", enforce_file_format=True)
    report, store = run_ingest(src)
    (rec,) = store.series()
    assert store.labels(rec.key_bytes).kind == "seg"
    assert np.array_equal(store.read_label(rec.key), mask[..., 0].astype(np.uint8))
    assert sorted((o.status, o.kind) for o in report.labels) == [("ingested", "seg"), ("skipped", "rtstruct")]
