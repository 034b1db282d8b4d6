"""A Lightning fit killed mid-epoch (SIGKILL) and resumed with ``Trainer.fit(..., ckpt_path=...)`` trains on
the same remaining batches -- samples and augmented images -- as an uninterrupted fit."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("lightning", reason="PyTorch Lightning is an optional extra (medload[lightning])")

from helpers.labelled_store import make_labelled_store  # noqa: E402

SCRIPT = REPO / "tests" / "helpers" / "lightning_resume_run.py"


def _fit(store, out, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(store), str(out), *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_a_fit_killed_mid_epoch_resumes_from_its_checkpoint_with_the_remaining_batches(tmp_path):
    store = make_labelled_store(tmp_path / "data", patients=3, slices=5)
    reference = tmp_path / "reference"
    assert _fit(store, reference).returncode == 0
    expected = _log(reference)
    per_epoch = sum(line["epoch"] == 0 for line in expected)
    kill_at = random.choice([random.randrange(1, per_epoch), random.randrange(per_epoch + 1, len(expected))])
    run = tmp_path / "run"
    killed = _fit(store, run, "--kill-at", kill_at)
    assert killed.returncode == -9, f"step {kill_at}: exited {killed.returncode}\n{killed.stderr[-2000:]}"
    resumed = _fit(store, run, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    got = _log(run)
    assert [line["index"] for line in got] == [line["index"] for line in expected], f"killed at step {kill_at}"
    assert got == expected, f"killed at step {kill_at}: the same samples, but other augmented images"
