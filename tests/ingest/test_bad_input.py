"""Bad input, end to end: ``medload ingest`` (a real process, 2 workers) over more than 200 broken
inputs mixed with good series (:mod:`medload.synthetic.corpus`), plus files whose decoder crashes,
aborts, is killed or hangs (:mod:`decoder_faults`, a test-only pydicom plugin).

The run must exit 0; every bad input must be in ``medload rejects --json --all`` with its path, stage,
reason and (where its bytes can be read) sha256; every good series must be stored with exactly its
slices and pixels; the peak resident memory of the writer and of every decoding process stays under
the configured cap; nothing is written outside the store but the key file named by ``--key-file``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pydicom
import pytest
from helpers.decoder_faults import FAULTS, fault_frame
from pydicom.encaps import encapsulate, generate_frames
from pydicom.uid import HTJ2K, JPEG2000Lossless

from medload.storage.digest import series_digest, slice_digest
from medload.synthetic import BadInput, SeriesSpec, make_series, write_bad_corpus
from medload.synthetic.broken import with_uids

TESTS = Path(__file__).resolve().parents[1]
CAP = 512 * 10**6
# long enough that no real input of the corpus meets it on a loaded machine (at 3 s the deflate bomb's decode
# check did once, under load); only the hanging decoder, which sleeps an hour, should
TIMEOUT_S = 20
STAGES = {"discover", "header", "series", "geometry", "decode", "plausibility"}
# The medload command, with the fault decoder installed first; it reports its pid and peak memory on the
# way out. Started from a small wrapper process: Linux carries a process's peak RSS across exec, so a
# command started straight from pytest would report pytest's own (with torch loaded by earlier tests).
WRAPPER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
RUNNER = """
import json, os, resource, sys
from helpers import decoder_faults
decoder_faults.install()
from medload.cli import main
try:
    main()
finally:
    if "MEDLOAD_TEST_RUSAGE" in os.environ:
        with open(os.environ["MEDLOAD_TEST_RUSAGE"], "w") as out:
            json.dump({"pid": os.getpid(), **{w: resource.getrusage(getattr(resource, w)).ru_maxrss * 1024
                                              for w in ("RUSAGE_SELF", "RUSAGE_CHILDREN")}}, out)
"""


def _write_faults(src: Path, scratch: Path) -> list[BadInput]:
    """One HTJ2K file per fault, each its own series, with a real JPEG 2000 codestream header."""
    gen = make_series(scratch, SeriesSpec(n_slices=1, rows=32, cols=32, transfer_syntax=JPEG2000Lossless), seed=90)
    template = pydicom.dcmread(gen.paths[0])
    (frame,) = generate_frames(template.PixelData, number_of_frames=1)
    out = []
    for fault in FAULTS:
        ds = pydicom.dcmread(pydicom.filebase.DicomBytesIO(with_uids(template, f"fault-{fault}")))
        ds.PixelData = encapsulate([fault_frame(frame, fault)])
        ds.file_meta.TransferSyntaxUID = HTJ2K
        path = src / "faults" / f"{fault}.dcm"
        path.parent.mkdir(parents=True, exist_ok=True)
        ds.save_as(path, enforce_file_format=True)
        out.append(BadInput(str(path), f"decoder {fault}", hashlib.sha256(path.read_bytes()).hexdigest()))
    return out


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: kind, mode and content hash (or link target)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            info = os.lstat(path)
            if os.path.islink(path):
                out[path] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                out[path] = ("file", info.st_mode, hashlib.sha256(Path(path).read_bytes()).hexdigest())
            else:
                out[path] = ("dir", info.st_mode)
    return out


def _medload(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUNNER, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The corpus, the ingest of it through the command line, and what the run left behind."""
    root = tmp_path_factory.mktemp("bad_input")
    world = root / "world"           # everything the run may see; only the store and the key may change
    corpus = write_bad_corpus(world)
    faults = _write_faults(corpus.source, root / "scratch")
    for folder in ("tmp", "home"):
        (world / folder).mkdir()
    store, key = world / "store", world / "keys" / "pseudonym.key"
    key.parent.mkdir(mode=0o700)  # --new-key creates a key in a folder that exists, never the folder
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(world / "tmp"), HOME=str(world / "home"))
    env.pop("MEDLOAD_KEY_FILE", None)
    before = _snapshot(world)
    command = ["ingest", corpus.source, store, "--workers", "2", "--worker-memory", CAP, "--decode-timeout", TIMEOUT_S,
               "--key-file", key, "--new-key", "--no-progress"]
    proc = subprocess.run([sys.executable, "-c", WRAPPER, sys.executable, "-c", RUNNER, *map(str, command)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(env, MEDLOAD_TEST_RUSAGE=str(root / "rusage.json")))
    usage = json.loads((root / "rusage.json").read_text())
    after = _snapshot(world)
    rejects = json.loads(_medload("rejects", store, "--json", "--all", env=env).stdout)
    stored = json.loads(_medload("ls", store, "--json", env=env).stdout)
    return dict(corpus=corpus, bad=corpus.bad + faults, proc=proc, usage=usage, before=before, after=after,
                world=world, store=store, key=key, rejects=rejects, stored=stored)


def _records_of(name: str, rejects: list[dict]) -> list[dict]:
    """Quarantine records naming ``name``: the input itself, a member of it (an archive), or a series it is in."""
    return [r for r in rejects if r["source"] == name or r["source"].startswith(name + "!") or name in r["sources"]]


def test_the_run_survives_and_exits_0(run):
    assert run["proc"].returncode == 0, run["proc"].stdout[-3000:] + run["proc"].stderr[-3000:]
    assert len(run["corpus"].bad) >= 200


def test_every_bad_input_is_quarantined_with_path_hash_stage_and_reason(run):
    missing = []
    for bad in run["bad"]:
        records = [r for r in _records_of(bad.name, run["rejects"]) if r["source"].startswith(bad.name)]
        if not records:
            missing.append(f"{bad.kind}: {bad.name}")
            continue
        for r in records:
            assert r["status"] == bad.status and r["stage"] in STAGES and r["reason"], (bad, r)
        if bad.sha256 is not None:
            assert any(r["sha256"] == bad.sha256 for r in records), (bad, records)
    assert not missing, "\n".join(missing)


def test_decoder_crashes_hangs_and_memory_bombs_are_named(run):
    reasons = {Path(r["source"]).name: r for r in run["rejects"]}
    assert "killed by signal 11 (SIGSEGV)" in reasons["segv.dcm"]["reason"]
    assert "killed by signal 6 (SIGABRT)" in reasons["abort.dcm"]["reason"]
    assert "killed by signal 9 (SIGKILL" in reasons["kill.dcm"]["reason"]
    assert f"took longer than {TIMEOUT_S} s" in reasons["hang.dcm"]["reason"]
    assert {reasons[f"{f}.dcm"]["stage"] for f in FAULTS} == {"decode"}
    bomb = reasons["j2k_16000_decode_bomb.dcm"]
    assert bomb["stage"] == "decode" and "exceeded the 512 MB worker memory cap" in bomb["reason"]
    # deflate bombs are refused from what the file declares, before they are inflated (medload.ingest.deflated)
    assert reasons["deflate_bomb.dcm"]["stage"] == "header"
    assert "refused before inflating it" in reasons["deflate_bomb.dcm"]["reason"]
    assert reasons["deflate_bomb_trailing.dcm"]["stage"] == "header"
    assert "the deflated dataset inflates past" in reasons["deflate_bomb_trailing.dcm"]["reason"]


def test_every_good_series_is_stored_exactly(run):
    """Each good series is stored with exactly its slices and pixels (the digest covers both); besides
    them, only fuzzed files (random bit flips that left a valid one-slice image) may be stored."""
    by_digest = {r["digest"]: r for r in run["stored"]}
    good = {series_digest([slice_digest(p) for p in gen.hu], gen.hu.shape, "int16"): gen for gen in run["corpus"].good}
    for digest, gen in good.items():
        assert digest in by_digest, f"good series {gen.paths[0].parent.name} ({gen.hu.shape}) not stored"
        assert by_digest[digest]["shape"] == list(gen.hu.shape)
    fuzzed_kept = [p for p in run["corpus"].fuzzed if not _records_of(str(p), run["rejects"])]
    others = [r for r in run["stored"] if r["digest"] not in good]
    assert len(others) == len(fuzzed_kept) and all(r["shape"][0] == 1 for r in others)


def test_peak_memory_stays_under_the_cap(run):
    usage = run["usage"]
    assert 0 < usage["RUSAGE_CHILDREN"] < CAP, usage  # the largest decoding process, bombs included
    assert 0 < usage["RUSAGE_SELF"] < CAP, usage      # the writer


def test_nothing_is_written_outside_the_store(run):
    world, store = str(run["world"]), str(run["store"])
    changed = {p for p in run["before"].keys() | run["after"].keys() if run["before"].get(p) != run["after"].get(p)}
    outside = {p for p in changed if not (p == store or p.startswith(store + os.sep))}
    assert outside == {str(run["key"])}, sorted(outside)
    assert all(p.startswith(world) for p in changed)
    assert not glob.glob(f"/dev/shm/medload-ring-{run['usage']['pid']}-*")


def test_zero_filled_files_each_get_a_record_and_a_count(tmp_path):
    """Files of zeros (one sparse, 2 GiB: a hole that costs no disk) and a CT slice whose first 512 bytes
    are zero were taken for empty tar archives and vanished: each is now rejected with a reason and counted."""
    src = tmp_path / "src"
    shutil.copytree(TESTS / "scans" / "ge_ct_3slice_seg" / "ct-3slice", src / "ct")
    (src / "zeros.dcm").write_bytes(bytes(1 << 20))
    with open(src / "sparse.dcm", "wb") as file:
        file.truncate(2 << 30)
    slice_ = bytearray((src / "ct" / "02.dcm").read_bytes())
    slice_[:512] = bytes(512)
    (src / "zeroed.dcm").write_bytes(bytes(slice_))
    store = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-m", "medload.cli", "ingest", src, store, "--workers", "1", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "series: 1 ingested" in proc.stdout and "files: 0 skipped, 3 rejected, 0 ignored" in proc.stdout
    rejects = json.loads(subprocess.run([sys.executable, "-m", "medload.cli", "rejects", store, "--json"],
                                        capture_output=True, text=True, check=True).stdout)
    assert {Path(r["source"]).name: (r["status"], r["stage"], r["reason"], r["sha256"]) for r in rejects} == {
        "zeros.dcm": ("rejected", "discover", f"zero-filled: all {1 << 20} bytes are zero",
                      hashlib.sha256(bytes(1 << 20)).hexdigest()),
        "sparse.dcm": ("rejected", "discover", f"zero-filled: all {2 << 30} bytes are zero", None),  # not read
        "zeroed.dcm": ("rejected", "discover", "damaged: the first 512 bytes are zero (DICOM preamble and header "
                                               "zeroed)", hashlib.sha256(slice_).hexdigest())}
