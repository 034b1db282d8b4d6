"""Quarantine records stay current: a file rejected by one ingest and stored by a later one (fixed in place) is
no longer listed by ``medload rejects``, and is listed again if a later ingest rejects it again."""

from __future__ import annotations

import json
import subprocess
import sys

from medload.config import IngestConfig
from medload.ingest.run import ingest
from medload.storage.compact import compact_store
from medload.storage.store import open_store
from medload.synthetic import SeriesSpec, make_series

CFG = IngestConfig(workers=1)


def rejects(store) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "medload.cli", "rejects", str(store), "--json"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_rejected_file_fixed_and_ingested_is_no_longer_listed(tmp_path):
    make_series(tmp_path / "src" / "a", SeriesSpec(n_slices=4, rows=16, cols=12), seed=1, series_number=1)
    gen = make_series(tmp_path / "src" / "b", SeriesSpec(n_slices=5, rows=16, cols=12), seed=2, series_number=2)
    victim, good = gen.paths[2], gen.paths[2].read_bytes()
    victim.write_bytes(good[:300])  # cut short: rejected, and its series with a gap
    store = tmp_path / "store"
    first = ingest(tmp_path / "src", store, config=CFG)
    assert first.counts["ingested"] == 1 and first.counts["rejected"] == 1
    before = rejects(store)
    assert [(r["stage"], r["source"]) for r in before if r["stage"] == "header"] == [("header", str(victim))]
    series_record = next(r for r in before if r["stage"] == "geometry")
    assert "gap" in series_record["reason"]

    victim.write_bytes(good)  # fixed in place
    second = ingest(tmp_path / "src", store, config=CFG)
    assert second.counts["ingested"] == 1 and series_record["series"] in {r.key for r in open_store(store).series()}
    assert rejects(store) == []  # the file and its series are stored: neither record is current
    compact_store(store)
    assert rejects(store) == []

    victim.write_bytes(good[:300])  # broken again: rejected again, and listed again
    ingest(tmp_path / "src", store, config=CFG)
    assert [(r["stage"], r["source"]) for r in rejects(store)] == [("header", str(victim))]
