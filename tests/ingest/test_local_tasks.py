"""Local ingest writes series in task processes, each into a shard of its own that the ingest publishes
(medload.ingest.local_engine): the store's logical content does not depend on the worker count."""

from __future__ import annotations

from conftest import store_dump

from medload.config import IngestConfig
from medload.deid import create_key
from medload.ingest import local_engine
from medload.ingest.run import ingest
from medload.storage import writer as store_writer
from medload.storage.manifest import file_digest
from medload.storage.store import open_store
from medload.storage.verify import verify_store
from medload.synthetic import SeriesSpec, make_study


def test_one_and_three_workers_store_the_same_content(tmp_path, monkeypatch):
    monkeypatch.setattr(local_engine, "_MIN_TASK_BYTES", 0)  # these tiny series: one task each, as a large ingest
    src = tmp_path / "src"
    make_study(src, [SeriesSpec(n_slices=4 + i % 3, rows=32, cols=32, orientation="oblique" if i % 2 else "axial")
                     for i in range(7)], seed=5)
    (src / "notes.txt").write_text("not DICOM\n")
    hashed: list[str] = []  # shards whose bytes the publishing process read to digest them
    monkeypatch.setattr(store_writer, "file_digest", lambda p: hashed.append(str(p)) or file_digest(p))
    reports = {3: ingest(src, tmp_path / "w3", config=IngestConfig(workers=3, windows=("lung",)))}
    assert len(hashed) == 1  # its own shard, with the ignored file's record; each task digests its own shard
    monkeypatch.setattr(store_writer, "file_digest", file_digest)
    reports[1] = ingest(src, tmp_path / "w1", config=IngestConfig(workers=1, windows=("lung",)))
    assert reports[1].counts == reports[3].counts and reports[1].counts["ingested"] == 7
    assert [s.key for s in reports[1].series] == [s.key for s in reports[3].series]  # plan order, not finish order
    assert store_dump(open_store(tmp_path / "w1")) == store_dump(open_store(tmp_path / "w3"))
    assert len(open_store(tmp_path / "w3").manifest.shards) > 2  # written by several tasks, published apart
    for w in (1, 3):
        assert verify_store(tmp_path / f"w{w}").ok  # the digests the tasks recorded are their shards' own
        assert not list((tmp_path / f"w{w}" / "staging").iterdir())
    again = ingest(src, tmp_path / "w3", config=IngestConfig(workers=3, windows=("lung",)))
    assert again.counts["present"] == 7 and again.counts["ingested"] == 0
    monkeypatch.undo()  # at the default floor, an ingest this small is written by one task, into one shard
    small = ingest(src, tmp_path / "small", config=IngestConfig(workers=3, windows=("lung",)))
    shards = open_store(tmp_path / "small").manifest.shards  # and the writer's own, with the ignored file's record
    assert small.counts["ingested"] == 7 and [s.series for s in shards if s.series] == [7]
    assert store_dump(open_store(tmp_path / "small")) == store_dump(open_store(tmp_path / "w1"))


def test_the_ingest_freezes_what_it_holds_while_writing_and_unfreezes_it(tmp_path, monkeypatch):
    """The headers and plans are out of the collector's way while task shards are adopted (gc.freeze), and
    nothing stays frozen after the ingest; what a caller froze itself it still holds frozen after."""
    import gc

    monkeypatch.setattr(local_engine, "_MIN_TASK_BYTES", 0)
    src = tmp_path / "src"
    make_study(src, [SeriesSpec(n_slices=3, rows=16, cols=16) for _ in range(3)], seed=9)
    frozen_at_adopt: list[int] = []
    adopt = store_writer.StoreWriter.adopt
    monkeypatch.setattr(store_writer.StoreWriter, "adopt",
                        lambda self, *a, **k: frozen_at_adopt.append(gc.get_freeze_count()) or adopt(self, *a, **k))
    assert gc.get_freeze_count() == 0
    report = ingest(src, tmp_path / "store", config=IngestConfig(workers=2))
    assert report.counts["ingested"] == 3 and len(frozen_at_adopt) >= 2 and min(frozen_at_adopt) > 0
    assert gc.get_freeze_count() == 0
    held = [[]]  # a caller's own frozen object: in no generation the collector walks (gc.get_objects)
    gc.freeze()
    try:
        again = ingest(src, tmp_path / "again", config=IngestConfig(workers=2))
        assert again.counts["ingested"] == 3 and gc.get_freeze_count() > 0
        assert not any(o is held for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is held for o in gc.get_objects()) and gc.get_freeze_count() == 0


def test_a_slice_header_pickles_to_an_equal_header():
    """SliceHeader pickles by its field values in order (its own __reduce__): every field comes back."""
    import pickle

    from medload.ingest.discover import SourceRef
    from medload.ingest.headers import SliceHeader

    values = {}
    for n, name in enumerate(SliceHeader._fields):  # every field a value of its own, none its default
        values[name] = f"v{n}"
    values["ref"] = SourceRef("/a/b.dcm", "member", 123, "origin")
    header = SliceHeader(**values)
    back = pickle.loads(pickle.dumps(header))
    assert back == header and type(back) is SliceHeader
    assert [getattr(back, name) for name in SliceHeader._fields] == list(values.values())


def test_a_source_reference_pickles_to_an_equal_reference():
    """SourceRef pickles by its four values (its own __reduce__), members and spooled origins included."""
    import pickle

    from medload.ingest.discover import SourceRef

    for ref in (SourceRef("/a/b.dcm", None, 12), SourceRef("/a/c.zip", "x/y.dcm", 3), SourceRef("/s/1", None, 4, "t.tgz!y")):
        back = pickle.loads(pickle.dumps(ref))
        assert back == ref and type(back) is SourceRef and back.display == ref.display


def test_the_ingest_process_imports_the_codec_once_and_its_workers_inherit_it(tmp_path):
    """The ingest process imports blosc2 before it forks (86 ms of CPU, once), so that no task process or
    decoding process imports it again (86 ms each: 5.5 CPU-s at 64 workers): a task process holds the very
    module object of its parent, at the same address. One worker or several, the store is the same."""
    import subprocess
    import sys

    src = tmp_path / "src"
    make_study(src, [SeriesSpec(n_slices=3, rows=16, cols=16) for _ in range(2)], seed=3)
    key = create_key(tmp_path / "k.key")
    script = ("import sys\n"
              "from medload.config import IngestConfig\n"
              "from medload.deid import Pseudonymizer, load_key\n"
              "from medload.ingest.local_engine import LocalEngine\n"
              "def module_id():\n"
              "    return id(sys.modules['blosc2'])\n"
              "before = 'blosc2' in sys.modules\n"
              "engine = LocalEngine(IngestConfig(workers=2), Pseudonymizer(load_key(sys.argv[1])))\n"
              "child = engine.runner.submit('probe', module_id).result()\n"
              "engine.__exit__(None, None, None)\n"
              "print(before, child == id(sys.modules['blosc2']))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(key)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"]
    script = ("import sys; from medload.config import IngestConfig; from medload.ingest.run import ingest; "
              "r = ingest(sys.argv[1], sys.argv[2], config=IngestConfig(workers=int(sys.argv[3])), key_file=sys.argv[4]); "
              "print(r.counts['ingested'])")
    for workers in (1, 2):
        proc = subprocess.run([sys.executable, "-c", script, str(src), str(tmp_path / f"w{workers}"), str(workers), str(key)],
                              capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.split() == ["2"], proc.stderr
    assert store_dump(open_store(tmp_path / "w1")) == store_dump(open_store(tmp_path / "w2"))


def test_a_task_process_keeps_its_decoder_and_ring_across_its_tasks(tmp_path, monkeypatch):
    """Each task process forks one decoding process and creates one ring for all its tasks (not one per
    task), and removes its ring when it exits; the store is the one one worker writes."""
    import glob
    import os

    from medload.ingest import shard_tasks
    from medload.ingest.ring import SliceRing

    monkeypatch.setattr(local_engine, "_MIN_TASK_BYTES", 0)  # 6 equal series: a task each
    src = tmp_path / "src"
    make_study(src, [SeriesSpec(n_slices=8, rows=32, cols=32) for _ in range(6)], seed=11)
    log = tmp_path / "events"  # written by the task processes, forked with these patches

    def logged(event, fn):
        def wrapper(*args, **kwargs):
            with open(log, "a") as f:
                f.write(f"{event} {os.getpid()}\n")
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(shard_tasks, "isolated_pool", logged("decoder", shard_tasks.isolated_pool))
    monkeypatch.setattr(SliceRing, "create", classmethod(logged("ring", SliceRing.create.__func__)))
    report = ingest(src, tmp_path / "w2", config=IngestConfig(workers=2))
    events = [line.split() for line in log.read_text().splitlines()]
    decoders, rings = ([pid for e, pid in events if e == kind] for kind in ("decoder", "ring"))
    tasks = [s for s in open_store(tmp_path / "w2").manifest.shards if s.series]  # one shard a task
    assert report.counts["ingested"] == 6 and len(tasks) == 6
    assert len(decoders) == len(set(decoders)) <= 2 and sorted(rings) == sorted(decoders)  # one each per process
    assert not [p for pid in decoders for p in glob.glob(f"/dev/shm/medload-ring-{pid}-*")]  # removed at exit
    monkeypatch.undo()
    ingest(src, tmp_path / "w1", config=IngestConfig(workers=1))
    assert store_dump(open_store(tmp_path / "w1")) == store_dump(open_store(tmp_path / "w2"))


def test_a_task_that_fails_leaves_no_decoder_or_ring_for_the_next(tmp_path, monkeypatch):
    """A kept decoding process may still hold chunks of a task that stopped half way: it is closed with the
    ring, and the next task forks a new one."""
    import os

    import pytest

    from medload.deid import Pseudonymizer
    from medload.ingest import shard_tasks

    monkeypatch.setattr(shard_tasks, "_kept", None)
    shard_tasks.keep_across_tasks()
    kept = shard_tasks._kept
    taken = []

    def fails(pool, writer, plans, cfg, report, progress, labels, rings):
        taken.append((pool, rings.take(2, 1024), [w.process for w in pool._workers]))
        raise OSError("the disk went away")

    monkeypatch.setattr(shard_tasks, "decode_and_write", fails)
    setup = (Pseudonymizer(b"k" * 32), IngestConfig())
    with pytest.raises(OSError, match="went away"):
        shard_tasks.series_task([], str(tmp_path / "task"), setup)
    (pool, ring, decoders), = taken
    assert kept.pool is None and not os.path.exists(ring.path)
    assert decoders and not any(p.is_alive() for p in decoders)
    with pytest.raises(OSError, match="went away"):
        shard_tasks.series_task([], str(tmp_path / "task"), setup)
    assert taken[1][0] is not pool  # a new decoding process
    kept.drop()


def test_a_kept_decoder_serves_only_the_setup_it_was_forked_for(monkeypatch):
    """A decoder pseudonymises with the key it was started with: tasks of another ingest (another key, other
    settings) get a decoder of their own, and the old one is closed."""
    from medload.deid import Pseudonymizer
    from medload.ingest import shard_tasks

    monkeypatch.setattr(shard_tasks, "_kept", None)
    shard_tasks.keep_across_tasks()
    kept = shard_tasks._kept
    try:
        first = kept.pool_for((Pseudonymizer(b"a" * 32), IngestConfig()))
        assert kept.pool_for((Pseudonymizer(b"a" * 32), IngestConfig())) is first  # equal setup, unpickled anew
        decoders = [w.process for w in first._workers]
        other_key = kept.pool_for((Pseudonymizer(b"b" * 32), IngestConfig()))
        assert other_key is not first and not any(p.is_alive() for p in decoders)
        assert kept.pool_for((Pseudonymizer(b"b" * 32), IngestConfig(windows=("lung",)))) is not other_key
        shard_tasks.release_kept()
        assert kept.pool is None and not kept.on
    finally:
        kept.drop()


def test_a_release_during_a_task_waits_for_its_end(monkeypatch):
    """A Dask worker shared by two ingests: the end of one releases the kept decoder while a task of the
    other uses it; that task finishes with it, and it is closed then."""
    from medload.deid import Pseudonymizer
    from medload.ingest import shard_tasks

    monkeypatch.setattr(shard_tasks, "_kept", None)
    shard_tasks.keep_across_tasks()
    kept = shard_tasks._kept
    setup = (Pseudonymizer(b"a" * 32), IngestConfig())
    try:
        with shard_tasks.task_pool(setup) as (pool, rings):
            assert rings is kept.rings  # the kept ones
            shard_tasks.release_kept()
            assert kept.pool is pool and pool._workers and pool._workers[0].process.is_alive()
            decoder = pool._workers[0].process
        assert kept.pool is None and not decoder.is_alive()
        with shard_tasks.task_pool(setup) as (own, rings):  # released: a task forks its own decoder
            assert rings is None and own is not pool
    finally:
        kept.drop()


def _keep_a_ring_and_stay(note: str) -> None:
    """A task that takes its process's kept ring, says where it is, and runs on until it is killed."""
    import time
    from pathlib import Path

    from medload.ingest import shard_tasks

    ring = shard_tasks._kept.rings.take(1, 4096)
    Path(note).write_text(ring.path)
    time.sleep(600)


def test_an_ingest_that_stops_its_task_processes_removes_their_rings(tmp_path):
    """Ctrl-C or an error kills the task processes on the spot (their exit handlers do not run): the ingest
    removes the shared-memory rings they kept, which would hold up to about 100 MB each until the next
    ingest on the machine."""
    import os
    import time

    runner = local_engine._ProcessRunner(1)
    note = tmp_path / "ring"
    runner.submit("task", _keep_a_ring_and_stay, str(note))
    deadline = time.monotonic() + 60
    while not note.exists() or not note.read_text():
        assert time.monotonic() < deadline, "the task did not start"
        time.sleep(0.05)
    ring = note.read_text()
    assert os.path.exists(ring)
    runner.close(stopping=True)
    assert not os.path.exists(ring)


_DYING_TASK_PROCESS = '''
import os, signal, sys, time
from pathlib import Path

from medload.ingest import local_engine


def die_on(trigger, note):
    Path(note).write_text("started")
    while not Path(trigger).exists():
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer ends a process


def size(payload):
    return len(payload)


if __name__ == "__main__":
    trigger, note = sys.argv[1], sys.argv[2]
    runner = local_engine._ProcessRunner(1)
    first = runner.submit("t0", die_on, trigger, note)
    while not Path(note).exists():
        time.sleep(0.01)
    rest = [runner.submit(f"t{i}", size, b"x" * (1 << 20)) for i in range(1, 5)]  # more than the task pipe holds
    while not (rest[0].running() and rest[1].running()):  # two in the pool's queue, two still waiting
        time.sleep(0.01)
    runner.cancel([first, *rest])  # as write_in_tasks does when an error stops the ingest
    Path(trigger).touch()
    for future in [first, *rest]:
        try:
            runner.result(future)
        except Exception as exc:
            print(type(exc).__name__, exc)
    runner.close(stopping=True)
    print("closed")
'''


def test_a_task_process_killed_mid_task_fails_its_tasks_with_the_reason_and_the_ingest_exits(tmp_path):
    """A task process killed (SIGKILL, the out-of-memory killer's signal) while the ingest had tasks queued:
    every task fails with an error naming the signal, and the process exits. Cancelling the queued tasks
    raced with the pool's own handling of the death, and the interpreter then hung at exit for ever (seen
    in a 350 MB cgroup with 2 workers)."""
    import subprocess
    import sys

    script = tmp_path / "dying.py"
    script.write_text(_DYING_TASK_PROCESS)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "trigger"), str(tmp_path / "note")],
                         capture_output=True, text=True, timeout=300)  # a hang, not a slow machine, reaches it
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "closed" and len(lines) == 6, out.stdout
    assert all(line.startswith("WorkerDiedError a task process killed by signal 9 (SIGKILL") for line in lines[:5]), lines
    assert "run again with fewer --workers" in lines[0] and "InvalidStateError" not in out.stderr


def test_series_a_killed_task_committed_are_stored_reported_ingested_and_a_rerun_stores_the_rest(tmp_path,
                                                                                                   monkeypatch):
    """The first task to close its shard dies there (SIGKILL, as the out-of-memory killer ends a process): its
    series are committed and published from its shard, so the report calls them ingested, not failed; the
    store holds exactly the series the report says it ingested; the same ingest again stores the rest (the
    tasks that failed with it, if the other task process had not finished them all)."""
    import os
    import signal

    from medload.ingest import shard_tasks
    from medload.storage.task_shard import TaskShardWriter

    marker = tmp_path / "died"

    class DyingAfterItsShard(TaskShardWriter):
        def close(self) -> bool:
            held = super().close()
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return held
            os.kill(os.getpid(), signal.SIGKILL)
            return held

    monkeypatch.setattr(local_engine, "_MIN_TASK_BYTES", 0)  # one task per series
    monkeypatch.setattr(shard_tasks, "TaskShardWriter", DyingAfterItsShard)  # the task processes fork with it
    src = tmp_path / "src"
    make_study(src, [SeriesSpec(n_slices=4, rows=32, cols=32) for _ in range(6)], seed=9)
    key = create_key(tmp_path / "k.key")
    report = ingest(src, tmp_path / "s", config=IngestConfig(workers=2), key_file=key)
    assert marker.exists()
    statuses = {s.key: s.status for s in report.series}
    # which of the other tasks fail with it depends on how far the other task process got (none, under load)
    assert set(statuses.values()) <= {"ingested", "failed"}, statuses
    stored = {r.key_bytes.hex() for r in open_store(tmp_path / "s").series()}
    assert stored == {k for k, status in statuses.items() if status == "ingested"}  # the report does not lie
    recovered = [s for s in report.series if s.reason and "failed after committing it" in s.reason]
    assert recovered and all(s.status == "ingested" for s in recovered)  # the killed task's own series
    assert report.slices_written == 4 * len(stored)
    failed = [s for s in report.series if s.status == "failed"]
    assert all("killed by signal 9 (SIGKILL" in s.reason for s in failed), failed[0].reason
    assert not list((tmp_path / "s" / "staging").iterdir())
    monkeypatch.undo()
    again = ingest(src, tmp_path / "s", config=IngestConfig(workers=2), key_file=key)
    assert again.counts["present"] == len(stored) and again.counts["ingested"] == 6 - len(stored)
    assert verify_store(tmp_path / "s").ok and len(list(open_store(tmp_path / "s").series())) == 6
