"""A label lands on its series only if its foreground does: another patient's mask is rejected with the
figure, a mask partly outside its series is stored and flagged with the fraction it kept (label records,
``ls``, ``info``, the catalog, ``verify``), and mapping files resolve paths against their own folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.misfit_labels import make_misfits

from medload.config import IngestConfig
from medload.deid import Pseudonymizer, load_key
from medload.errors import ConfigError
from medload.ingest import ingest
from medload.ingest.labels import label_inputs_from_path
from medload.storage.store import open_store
from medload.storage.verify import verify_store

MEDLOAD = [sys.executable, "-m", "medload.cli"]


def _medload(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*MEDLOAD, *map(str, args)], capture_output=True, text=True, env=os.environ.copy())


@pytest.fixture(scope="module")
def misfits(tmp_path_factory):
    return make_misfits(tmp_path_factory.mktemp("misfits"))


def test_another_patients_mask_is_rejected_with_the_figure_and_a_cut_mask_is_flagged(misfits, tmp_path):
    """map.csv points patient 5's series at patient 4's mask (12.5% of it inside): rejected, naming the
    percentage, exit status as for any reject; patient 6's mask, 80% inside, is stored and flagged."""
    labels = tmp_path / "labels"
    misfits.write_mask(4, labels / "masks" / "p4.nii.gz")
    misfits.write_mask(6, labels / "masks" / "p6.nii.gz")
    uid = {p: gen.series_uid for p, gen in misfits.series.items()}
    (labels / "map.csv").write_text(f"series,label\n{uid[4]},masks/p4.nii.gz\n{uid[5]},masks/p4.nii.gz\n"
                                    f"{uid[6]},masks/p6.nii.gz\n")
    store = tmp_path / "store"
    proc = _medload("ingest", misfits.src, store, "--labels", labels / "map.csv", "--workers", 1, "--no-progress")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = open_store(store)
    key = {p: next(r.key for r in st.series() if r.series == Pseudonymizer(load_key()).uid("series", uid[p]))
           for p in uid}
    out = " ".join(proc.stdout.split())  # rich wraps long lines
    assert (f"label rejected: masks/p4.nii.gz (nifti) -> no series: 12.5% of the mask's foreground lies inside "
            f"series {key[5][:12]} (40 of 320 voxels") in out and "wrong series?" in out
    assert "[e.g. masks/p4.nii.gz]" in out
    assert f"label ingested: masks/p6.nii.gz (mask) -> series {key[6][:12]}: class_1 (cut: 80% of its" in out
    (reject,) = st.rejects()
    assert reject.stage == "labels" and reject.source == "masks/p4.nii.gz" and reject.reason.startswith("12.5% of")
    assert "less than 50%" in reject.reason
    strict = _medload("ingest", misfits.src, tmp_path / "strict", "--labels", labels / "map.csv", "--workers", 1,
                      "--no-progress", "--strict")
    assert strict.returncode == 1 and "12.5% of the mask's foreground" in " ".join(strict.stdout.split())

    assert st.labels(key[5]) is None
    assert st.labels(key[4]).kept == 1.0 and np.array_equal(st.read_label(key[4]), misfits.expected_on(4))
    cut = st.labels(key[6])
    assert cut.kept == 0.8 and cut.source == "masks/p6.nii.gz"
    assert np.array_equal(st.read_label(key[6]), misfits.expected_on(6))
    assert any("160 of the mask's 200 foreground voxels (80%)" in n for n in cut.notes)

    listed = {r["key"]: r for r in json.loads(_medload("ls", store, "--json").stdout)}
    assert [listed[key[p]]["label_kept"] for p in (4, 5, 6)] == [1.0, None, 0.8]
    lines = {line.split()[0]: line for line in _medload("ls", store).stdout.splitlines()}
    assert lines[key[6]].endswith("label cut: 80% kept") and "label" not in lines[key[4]]
    assert "mask, cut: 80% kept" in _medload("info", store).stdout
    cat = st.catalog().set_index("key")
    assert cat.label_kept[key[4]] == 1.0 and cat.label_kept[key[6]] == 0.8 and np.isnan(cat.label_kept[key[5]])
    report = verify_store(store)
    assert report.ok
    (note,) = [n for n in report.notes if n.kind == "label"]
    assert note.where == key[6] and "keeps 80% of its foreground" in note.detail


def test_the_threshold_is_a_setting(misfits, tmp_path):
    """label_min_kept 0.9 refuses patient 6's mask (80% inside); 0.1 takes patient 4's mask on patient 5's
    series (12.5%), flagged."""
    masks = tmp_path / "masks"
    misfits.write_mask(6, masks / f"{misfits.series[6].series_uid}.nii.gz")
    misfits.write_mask(4, masks / f"{misfits.series[5].series_uid}.nii.gz")
    report = ingest([misfits.src / "p5", misfits.src / "p6"], tmp_path / "strict", labels=[masks],
                    config=IngestConfig(workers=1, label_min_kept=0.9))
    rejected = sorted(o.reason for o in report.labels if o.status == "rejected")
    assert len(rejected) == 2 and rejected[0].startswith("12.5% of") and rejected[1].startswith("80% of")
    assert "less than 90%" in rejected[1]
    report = ingest([misfits.src / "p5", misfits.src / "p6"], tmp_path / "lenient", labels=[masks],
                    config=IngestConfig(workers=1, label_min_kept=0.1))
    assert sorted(o.kept for o in report.labels if o.status == "ingested") == [0.125, 0.8]
    with pytest.raises(ConfigError, match="label_min_kept must be a fraction from 0 to 1"):
        IngestConfig(label_min_kept=50)


def test_a_missing_mapped_file_says_where_it_was_looked_for(tmp_path):
    """Paths in a mapping file are relative to its folder; the error says so, names the row, and quotes no
    UID (the file is named after one)."""
    uid = "1.2.826.0.1.3680043.8.498.4242.7"
    labels = tmp_path / "labels"
    labels.mkdir()
    (labels / "present.nii.gz").write_bytes(b"")
    (labels / "map.csv").write_text(f"series,label\n3f2a,present.nii.gz\n{uid},masks/{uid}.nii.gz\n")
    pseudo = Pseudonymizer(load_key())
    with pytest.raises(ConfigError) as err:
        label_inputs_from_path(labels / "map.csv", pseudo)
    message = str(err.value)
    hidden = f"uid-{pseudo.uid('series', uid)}"
    assert f"line 3: label file masks/{hidden}.nii.gz not found" in message
    assert f"looked for {labels}/masks/{hidden}.nii.gz, relative to the mapping file's folder {labels}" in message
    assert uid not in message
    with pytest.raises(ConfigError, match="line 3: label file"):  # before a store is made
        ingest(labels, tmp_path / "store", labels=[labels / "map.csv"], config=IngestConfig(workers=1))
    assert not (tmp_path / "store").exists()
