"""No patient identifier reaches a store, its records, the command line's output or its logs.

The attribute table these tests hold the code to is the one in :mod:`medload.deid` (DICOM PS3.15
Annex E, Basic Profile). Two angles: the shipped sample's own raw values, and a copy of the sample whose
identifying attributes carry distinctive canaries (the sample has no birth date or accession number, and
a canary cannot match by chance where a short real value like ``CT4`` could).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pydicom
import pytest
from conftest import PHILIPS
from helpers.identifiers import IDENTIFYING, UIDS, _dicom_files, _pattern, _raw_values
from helpers.misfit_labels import make_misfits

from medload import deid
from medload.config import IngestConfig
from medload.ingest.run import ingest
from medload.storage.records import SeriesRecord
from medload.storage.store import open_store

MEDLOAD = [sys.executable, "-m", "medload.cli"]


def _cli(*args, env: dict[str, str]) -> str:
    proc = subprocess.run([*MEDLOAD, *map(str, args)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"medload {args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def _leaks(secrets: set[str], store: Path, texts: dict[str, str]) -> list[str]:
    """Every (place, secret) where a secret's bytes occur: every file of the store, then each text."""
    patterns = {s: _pattern(s) for s in sorted(secrets)}
    places = {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}
    places.update({place: text.encode() for place, text in texts.items()})
    return [f"{place}: {s!r}" for place, data in places.items() for s, pattern in patterns.items() if pattern.search(data)]


def _check_modes(store: Path) -> None:
    modes = {str(p.relative_to(store)): stat.S_IMODE(p.stat().st_mode) for p in store.rglob("*")}
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o700 if (store / name).is_dir() else 0o600)}
    assert wrong == {}, f"store entries that are not owner-only: {wrong}"


@pytest.fixture
def cli_env(tmp_path) -> dict[str, str]:
    """A key of the test's own, which its first ingest creates (--new-key)."""
    (tmp_path / "key").mkdir(mode=0o700)
    return {**os.environ, "MEDLOAD_KEY_FILE": str(tmp_path / "key" / "pseudonym.key")}


def test_sample_store_and_cli_output_hold_none_of_the_samples_identifiers(tmp_path, cli_env) -> None:
    files = _dicom_files(PHILIPS / "dicom")
    raw = _raw_values(files, IDENTIFYING + UIDS)
    assert {"PatientName", "PatientID", "StudyInstanceUID", "SOPInstanceUID"} <= raw.keys()
    secrets = set().union(*raw.values())
    assert len(raw["SOPInstanceUID"]) == len(files)

    store = tmp_path / "store"
    out = {"ingest": _cli("ingest", PHILIPS / "dicom", store, "--workers", "2", "--windows", "brain",
                          "--new-key", "--no-progress", env=cli_env)}
    out["ls"] = _cli("ls", store, "--json", env=cli_env)
    out["info"] = _cli("info", store, env=cli_env)
    out["rejects"] = _cli("rejects", store, "--all", env=cli_env)
    key = re.search(r'"key": "([^"]+)"', out["ls"]).group(1)
    _cli("export", store, key, tmp_path / "out.nii.gz", env=cli_env)
    out["export"] = (tmp_path / "out.nii.gz").read_bytes().decode("latin-1")
    assert "1 ingested" in out["ingest"]

    assert _leaks(secrets, store, out) == []
    _check_modes(store)
    key_bytes = (tmp_path / "key" / "pseudonym.key").read_text().strip()
    assert _leaks({key_bytes}, store, out) == []  # only a fingerprint of the key is in the store
    assert stat.S_IMODE((tmp_path / "key" / "pseudonym.key").stat().st_mode) == 0o600


def _with_canaries(src: Path, dst: Path) -> dict[str, str]:
    """Copy the sample with every identifying attribute (and a private tag, and the free-text
    descriptions) set to a canary; one file keeps its header but loses half its pixels, so it is
    quarantined and its reason must not quote any of it either."""
    canaries = {
        "PatientName": "Canary^Cordelia^Q", "PatientID": "CANARY-PID-40417", "PatientBirthDate": "19310417",
        "AccessionNumber": "CANARYACC9931", "InstitutionName": "Canary Memorial Hospital",
        "InstitutionAddress": "17 Canary Wharf Road", "StationName": "CANARYSTN1",
        "DeviceSerialNumber": "CANARY-SN-5501", "OperatorsName": "Operator^Canary",
        "ReferringPhysicianName": "Referrer^Canary", "StudyID": "CANARYSTUDY7",
        "StudyDescription": "canary study description", "SeriesDescription": "canary series description",
        "PatientComments": "canary patient comment",
    }
    dst.mkdir()
    for i, path in enumerate(_dicom_files(src)):
        ds = pydicom.dcmread(path)
        for keyword, value in canaries.items():
            setattr(ds, keyword, value)
        block = ds.private_block(0x0009, "CANARY PRIVATE", create=True)
        block.add_new(0x01, "LO", "canary private value")
        out = dst / f"{i:03d}.dcm"
        ds.save_as(out)
        if i == 3:  # a damaged copy: header intact, pixels cut short
            data = out.read_bytes()
            (dst / "damaged.dcm").write_bytes(data[: len(data) - 40000])
    return {**canaries, "private": "canary private value"}


def test_canary_identifiers_never_reach_store_records_rejects_or_logs(tmp_path, caplog) -> None:
    src = tmp_path / "src"
    canaries = _with_canaries(PHILIPS / "dicom", src)
    uids = set().union(*_raw_values(_dicom_files(src), UIDS).values())
    caplog.set_level(logging.DEBUG, logger="medload")
    report = ingest(src, tmp_path / "store", config=IngestConfig(workers=1, windows=("bone",)))
    assert report.counts["ingested"] == 1
    assert any(r.source.endswith("damaged.dcm") for r in report.rejects), "the damaged copy is quarantined"

    store = open_store(tmp_path / "store")
    texts = {"log": caplog.text, "report": repr(report), "rejects": repr(store.rejects()),
             "records": repr(store.series())}
    secrets = {v for v in canaries.values()} | {v.upper() for v in canaries.values()} | uids
    assert _leaks(secrets, store.path, texts) == []
    _check_modes(store.path)


def test_masks_named_by_their_uids_leave_no_uid_in_the_store_or_the_output(tmp_path, cli_env) -> None:
    """Masks named ``<SeriesInstanceUID>.nii.gz`` (as docs/ingest.md suggests) in a folder named after a
    StudyInstanceUID: one fits its series, one is another patient's (rejected), one is cut, one matches no
    series. No UID of the sources or of a mask's name is in any byte of the store (data.mdb included) or in
    what the commands print, also with -v; the records name each mask by its pseudonymised relative path."""
    fit = make_misfits(tmp_path)
    uids = set().union(*_raw_values(_dicom_files(fit.src), UIDS).values())
    stray = "1.2.826.0.1.3680043.8.498.99887766554433"
    folder = tmp_path / "labels" / fit.series[4].study_uid
    fit.write_mask(4, folder / f"{fit.series[4].series_uid}.nii.gz")
    fit.write_mask(4, folder / f"{fit.series[5].series_uid}.nii.gz")  # patient 4's mask under patient 5's UID
    fit.write_mask(6, folder / f"{fit.series[6].series_uid}.nii.gz")
    fit.write_mask(6, folder / f"{stray}.nii.gz")
    assert len(uids) > 30 and {g.series_uid for g in fit.series.values()} <= uids

    out, stores = {}, {"quiet": tmp_path / "store", "verbose": tmp_path / "store-v"}
    for name, store in stores.items():
        verbose = ("-v",) if name == "verbose" else ()
        out[f"ingest {name}"] = _cli(*verbose, "ingest", fit.src, store, "--labels", tmp_path / "labels", "--workers",
                                     "1", "--new-key", "--no-progress", env=cli_env)
        for command in (("ls",), ("ls", "--json"), ("info",), ("rejects", "--all"), ("verify",)):
            out[f"{' '.join(command)} {name}"] = _cli(*verbose, command[0], store, *command[1:], env=cli_env)
    for store in stores.values():
        assert _leaks(uids | {stray}, store, out) == []
    assert "label rejected" in out["ingest quiet"] and "cut: 80%" in out["ingest quiet"]

    st = open_store(stores["quiet"])
    pseudo = deid.Pseudonymizer(deid.load_key(cli_env["MEDLOAD_KEY_FILE"]))
    study = f"uid-{pseudo.uid('series', fit.series[4].study_uid)}"
    sources = sorted(st.labels(r.key_bytes).source for r in st.series() if st.labels(r.key_bytes))
    assert sources == sorted(f"{study}/uid-{pseudo.uid('series', fit.series[p].series_uid)}.nii.gz" for p in (4, 6))
    assert {r.source for r in st.rejects()} == {f"{study}/uid-{pseudo.uid('series', uid)}.nii.gz"
                                                for uid in (fit.series[5].series_uid, stray)}
    for rec in st.series():  # a mask named after its series shows the record's series pseudonym
        label = st.labels(rec.key_bytes)
        assert label is None or rec.series in label.source


#: SeriesRecord fields that are not DICOM attributes at all (layout, checks, provenance, our policies).
_NOT_FROM_DICOM = {"key", "shape", "dtype", "digest", "shard", "space", "windows", "flags", "padding_voxels",
                   "format", "source_fingerprint", "sources"}


def test_every_record_field_from_dicom_is_in_the_deid_table() -> None:
    """A new record field derived from a header must be added to the documented table first."""
    table = deid.__doc__.split("====", 1)[1]
    documented = set(re.findall(r"``(\w+)``", table))
    fields = {f.name for f in dataclasses.fields(SeriesRecord)} - _NOT_FROM_DICOM
    assert fields - documented == set(), "record fields missing from the table in medload/deid.py"
    assert fields >= {"patient", "study", "series", "frame_of_reference", "affine", "modality"}




def _race_for_key(path: str, barrier, results) -> None:
    barrier.wait()  # every process asks for the key at the same moment
    try:
        results.put(("ok", deid.load_key(deid.KeyFile(path, new=True)).hex()))
    except Exception as exc:  # reported to the test, which names it
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def test_first_time_processes_at_once_all_get_the_one_key_created(tmp_path) -> None:
    """Eight processes ask for a key that does not exist yet, at once, twenty times over: each gets the same
    whole key (none reads a half-written file or fails because another created it first), the file is
    private (0600) and no temporary file is left."""
    ctx = multiprocessing.get_context("fork")  # cheap children: the race is in load_key, not in imports
    for round_ in range(20):
        path = tmp_path / f"config{round_}" / "pseudonym.key"
        path.parent.mkdir()
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_race_for_key, args=(str(path), barrier, results)) for _ in range(8)]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert [kind for kind, _ in got] == ["ok"] * 8, got
        assert {key for _, key in got} == {path.read_text().strip()}
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert sorted(p.name for p in path.parent.iterdir()) == ["pseudonym.key"]
