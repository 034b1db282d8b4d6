"""Discovery of DICOM inputs in folders and archives (medload.ingest.discover), on real files."""

from __future__ import annotations

import gzip
import hashlib
import io
import multiprocessing
import os
import pickle
import random
import stat
import tarfile
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medload.errors import ConfigError, InputProblem
from medload.ingest.archives import tar_header
from medload.ingest.discover import (
    ArchiveLimits,
    DiscoveryProblem,
    SourceRef,
    discover,
    expand_archive,
    open_source,
    problem_sha256,
    read_source,
    sniff_plain,
)


def dcm(tag: str, extra: bytes = b"") -> bytes:
    """A fake DICOM file: 128-byte preamble, the DICM magic, a payload naming it."""
    return bytes(128) + b"DICM" + tag.encode() + extra


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def make_zip(path: Path, members: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", method) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def tar_add(archive: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE,
            link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    archive.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def make_tar(path: Path, members: dict[str, bytes], compression: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, f"w:{compression}") as archive:
        for name, data in members.items():
            tar_add(archive, name, data)
    return path


def run(*args, **kwargs) -> tuple[list[SourceRef], list[DiscoveryProblem]]:
    found = list(discover(*args, **kwargs))
    return ([f for f in found if isinstance(f, SourceRef)], [f for f in found if isinstance(f, DiscoveryProblem)])


def by_member(problems: list[DiscoveryProblem]) -> dict[str | None, str]:
    return {p.member: p.reason for p in problems}


# xz data named .tgz on purpose: archives are told apart by content, not by suffix
SUFFIXES = {"zip": ".zip", "": ".tar", "gz": ".tar.gz", "bz2": ".tar.bz2", "xz": ".tgz"}


def make_archive(path_stem: Path, kind: str, members: dict[str, bytes]) -> Path:
    path = path_stem.with_name(path_stem.name + SUFFIXES[kind])
    return make_zip(path, members) if kind == "zip" else make_tar(path, members, kind)


def test_folder_walk_is_recursive_sorted_and_repeatable(tmp_path: Path) -> None:
    root = tmp_path / "export"
    for rel in ["b/2.dcm", "b/a/1.dcm", "a.dcm", ".hidden", "c/d/e/deep", "B.dcm"]:
        write(root / rel, dcm(rel))
    for junk in [".DS_Store", "b/Thumbs.db", "__MACOSX/._a.dcm"]:
        write(root / junk, b"junk")
    refs, problems = run(root)
    assert problems == []
    assert [Path(r.path).relative_to(root).as_posix() for r in refs] == [
        ".hidden", "B.dcm", "a.dcm", "b/2.dcm", "b/a/1.dcm", "c/d/e/deep"]
    assert all(r.member is None and r.size == len(dcm(r.path[len(str(root)) + 1:])) for r in refs)
    assert list(discover(root)) == list(discover(str(root))) == list(discover([root]))


def test_unsniffed_discovery_reads_no_file_and_its_readers_sniff_what_discovery_would(tmp_path: Path) -> None:
    """``sniff=False`` yields every regular, non-empty file unread; :func:`sniff_plain` on each, and
    :func:`expand_archive` on the archives, then give what sniffing discovery gives, in the same order."""
    root = tmp_path / "export"
    write(root / "a.dcm", dcm("A"))
    write(root / "b.txt", b"plain text, not DICOM")
    write(root / "c.dcm", bytes(600))
    write(root / "d.bin", b"\x01\x02 no preamble, nothing known")
    write(root / "empty.dcm", b"")
    make_zip(root / "e.zip", {"x/1.dcm": dcm("X"), "x/notes.txt": b"text"})
    make_tar(root / "f.tar.gz", {"y/2.dcm": dcm("Y")}, "gz")
    spool = tmp_path / "spool"
    unsniffed = list(discover(root, sniff=False))
    assert [f.display for f in unsniffed] == [str(root / n) for n in ("a.dcm", "b.txt", "c.dcm", "d.bin", "e.zip",
                                                                     "empty.dcm", "f.tar.gz")]
    assert isinstance(unsniffed[5], DiscoveryProblem) and unsniffed[5].reason == "empty file"  # told by its size
    assert all(isinstance(f, SourceRef) for f in unsniffed[:5] + unsniffed[6:])

    def key(item: SourceRef | DiscoveryProblem) -> tuple:
        return (type(item).__name__, item.display, item.reason if isinstance(item, DiscoveryProblem) else item.size)

    sniffed_later = []
    for item in unsniffed:
        verdict = sniff_plain(item.path, item.size) if isinstance(item, SourceRef) else item
        sniffed_later += (expand_archive(item.path, verdict, spool_dir=spool) if isinstance(verdict, str)
                          else [verdict])
    assert [key(f) for f in sniffed_later] == [key(f) for f in discover(root, spool_dir=tmp_path / "spool2")]


def test_several_sources_and_missing_source(tmp_path: Path) -> None:
    one = write(tmp_path / "one.dcm", dcm("one"))
    refs, problems = run([one, tmp_path / "missing", tmp_path])
    assert [r.path for r in refs] == [str(one)]  # the folder holds one.dcm again: not yielded twice
    assert problems[0].path == str(tmp_path / "missing") and "cannot open source" in problems[0].reason


@pytest.mark.parametrize("kind", ["zip", "", "gz", "bz2", "xz"])
def test_archive_members_found_and_read(tmp_path: Path, kind: str) -> None:
    members = {"s1/b.dcm": dcm("b", os.urandom(3000)), "s1/a.dcm": dcm("a"), "c": dcm("c", bytes(2000)),
               "__MACOSX/s1/._a.dcm": b"resource fork", "s1/.DS_Store": b"junk"}
    archive = make_archive(tmp_path / "in" / "arch", kind, members)
    spool = tmp_path / "spool"
    refs, problems = run(tmp_path / "in", spool_dir=spool)
    assert problems == []
    assert [r.display for r in refs] == [f"{archive}!{name}" for name in ["c", "s1/a.dcm", "s1/b.dcm"]]
    for ref, name in zip(refs, ["c", "s1/a.dcm", "s1/b.dcm"]):
        data = members[name]
        assert ref.size == len(data)
        assert read_source(ref) == data
        assert read_source(ref, max_bytes=132) == data[:132]
        with open_source(ref) as file:
            assert file.seekable()
            file.seek(128)
            assert file.read(4) == b"DICM"
            assert file.seek(-5, io.SEEK_END) == len(data) - 5
            assert file.read() == data[-5:]
            file.seek(0)
            assert file.read() == data
        if kind in ("gz", "bz2", "xz"):
            assert ref.member is None and Path(ref.path).parent == spool and ref.origin == ref.display
        else:
            assert (ref.path, ref.member) == (str(archive), name)


def test_dicom_with_archive_like_content_is_not_an_archive(tmp_path: Path) -> None:
    inner = make_zip(tmp_path / "inner.zip", {"x.dcm": dcm("x")}).read_bytes()
    path = write(tmp_path / "src" / "scan.zip", dcm("outer") + inner)
    assert run(tmp_path / "src") == ([SourceRef(str(path), None, path.stat().st_size)], [])


def test_file_without_preamble_is_a_candidate(tmp_path: Path) -> None:
    path = write(tmp_path / "raw", b"\x08\x00\x05\x00CS\x0a\x00ISO_IR 100")
    assert run(path) == ([SourceRef(str(path), None, path.stat().st_size)], [])


def test_unsafe_and_special_zip_members(tmp_path: Path) -> None:
    before = sorted(os.listdir(tmp_path.parent))
    path = tmp_path / "evil.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for name in ["../evil", "/abs", "C:/win", "a/../../up", "\\back", "ok.dcm"]:
            archive.writestr(name, dcm(name))
        link = zipfile.ZipInfo("link")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(link, "/etc/passwd")
        fifo = zipfile.ZipInfo("fifo")
        fifo.external_attr = (stat.S_IFIFO | 0o600) << 16
        archive.writestr(fifo, b"")
    refs, problems = run(path)
    assert [r.member for r in refs] == ["ok.dcm"]
    reasons = by_member(problems)
    assert "'..' component" in reasons["../evil"] and "'..' component" in reasons["a/../../up"]
    assert "absolute" in reasons["/abs"] and "absolute" in reasons["\\back"]
    assert "drive letter" in reasons["C:/win"]
    assert all(reasons[n].startswith("unsafe member path") for n in ["../evil", "/abs", "C:/win", "\\back"])
    assert reasons["link"] == "symbolic link member not followed"
    assert "not a regular file" in reasons["fifo"]
    assert not any(p.skipped for p in problems)
    assert sorted(os.listdir(tmp_path.parent)) == before and os.listdir(tmp_path) == ["evil.zip"]
    assert not os.path.lexists("/abs")


@pytest.mark.parametrize("compression", ["", "gz"])
def test_unsafe_and_special_tar_members(tmp_path: Path, compression: str) -> None:
    before = sorted(os.listdir(tmp_path.parent))
    src = tmp_path / "src"
    spool = tmp_path / "spool"
    path = src / ("evil.tar" + (f".{compression}" if compression else ""))
    src.mkdir()
    with tarfile.open(path, f"w:{compression}") as archive:
        for name in ["../evil", "/abs", "ok.dcm"]:
            tar_add(archive, name, dcm(name))
        tar_add(archive, "sym", kind=tarfile.SYMTYPE, link="/etc/passwd")
        tar_add(archive, "hard", kind=tarfile.LNKTYPE, link="ok.dcm")
        tar_add(archive, "dev", kind=tarfile.CHRTYPE)
        tar_add(archive, "pipe", kind=tarfile.FIFOTYPE)
    refs, problems = run(src, spool_dir=spool)
    assert [r.display for r in refs] == [f"{path}!ok.dcm"]
    reasons = by_member(problems)
    assert reasons["../evil"].startswith("unsafe member path '../evil'")
    assert reasons["/abs"].startswith("unsafe member path '/abs'")
    assert reasons["sym"] == "symbolic link member not followed"
    assert reasons["hard"] == "hard link member not followed"
    assert "device" in reasons["dev"] and "fifo" in reasons["pipe"]
    assert sorted(os.listdir(tmp_path.parent)) == before
    assert os.listdir(src) == [path.name] and not os.path.lexists("/abs")
    assert len(os.listdir(spool)) == 1 if compression else not spool.exists()


def test_zip_bomb_is_reported_by_ratio_without_reading_it(tmp_path: Path, monkeypatch) -> None:
    path = make_zip(tmp_path / "bomb.zip", {"bomb.dcm": bytes(50 << 20), "ok.dcm": dcm("ok")})
    opened: list[str] = []
    real_open = zipfile.ZipFile.open

    def spy(self, name, *args, **kwargs):
        opened.append(name if isinstance(name, str) else name.filename)
        return real_open(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    refs, problems = run(path)
    assert [r.member for r in refs] == ["ok.dcm"]
    [bomb] = problems
    assert bomb.member == "bomb.dcm" and not bomb.skipped
    assert bomb.reason.startswith("compression ratio ") and bomb.reason.endswith(":1 above the cap 200:1")
    assert int(bomb.reason.split()[2].split(":")[0]) > 200
    assert opened == ["ok.dcm"]


def test_compressed_tar_bomb_stops_the_stream_and_cleans_the_spool(tmp_path: Path) -> None:
    path = make_tar(tmp_path / "bomb.tar.gz", {"a.dcm": dcm("a"), "b.dcm": bytes(20 << 20)}, "gz")
    spool = tmp_path / "spool"
    refs, problems = run(path, spool_dir=spool)
    assert refs == []
    [problem] = problems
    assert problem.member is None and "compression ratio" in problem.reason and "above the cap 200:1" in problem.reason
    assert os.listdir(spool) == []


def test_archive_limits(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "three.zip", {n: dcm(n) for n in ["a", "b", "c"]})
    size = len(dcm("a"))
    assert by_member(run(path, limits=ArchiveLimits(max_members=2))[1]) == {
        None: "member count reached 3, above the cap 2"}
    assert by_member(run(path, limits=ArchiveLimits(max_total_bytes=2 * size))[1]) == {
        None: f"total uncompressed size reached {3 * size} bytes, above the cap {2 * size} bytes"}
    refs, problems = run(path, limits=ArchiveLimits(max_member_bytes=size - 1))
    assert refs == []
    assert set(by_member(problems).values()) == {f"member size {size} bytes above the cap {size - 1} bytes"}
    tar = make_tar(tmp_path / "three.tar.xz", {n: dcm(n) for n in ["a", "b", "c"]}, "xz")
    assert by_member(run(tar, limits=ArchiveLimits(max_members=2), spool_dir=tmp_path / "sp")[1]) == {
        None: "member count reached 3, above the cap 2"}
    assert os.listdir(tmp_path / "sp") == []
    with pytest.raises(ConfigError):
        ArchiveLimits(max_ratio=0)


def test_a_ratio_just_above_the_cap_is_not_shown_equal_to_it(tmp_path: Path) -> None:
    """A member whose ratio is the cap plus less than one half: no "200:1 above the cap 200:1"."""
    for extra in range(0, 64 << 10, 997):  # a member of zeros whose ratio has a fraction under one half
        path = make_zip(tmp_path / "near.zip", {"near.dcm": bytes((2 << 20) + extra)})
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo("near.dcm")
        ratio = info.file_size / info.compress_size
        if 0 < ratio - int(ratio) < 0.5:
            break
    [problem] = run(path, limits=ArchiveLimits(max_ratio=int(ratio)))[1]
    shown, cap = (float(word.split(":")[0]) for word in problem.reason.split() if word.endswith(":1"))
    assert cap == int(ratio) and shown > cap and abs(shown - ratio) < 0.1, problem.reason


def test_nested_archives_are_skipped(tmp_path: Path) -> None:
    inner_zip = make_zip(tmp_path / "inner.zip", {"x.dcm": dcm("x")}).read_bytes()
    inner_tgz = make_tar(tmp_path / "inner.tgz", {"y.dcm": dcm("y")}, "gz").read_bytes()
    inner_tar = make_tar(tmp_path / "inner.tar", {"z.dcm": dcm("z")}).read_bytes()
    members = {"a.zip": inner_zip, "b.bin": inner_tgz, "c.tar": inner_tar, "d.dcm": dcm("d")}
    src = tmp_path / "src"
    for kind in ["zip", "", "bz2"]:
        make_archive(src / f"outer-{kind or 'tar'}", kind, members)
    refs, problems = run(src, spool_dir=tmp_path / "spool")
    assert [r.display.rsplit("!", 1)[1] for r in refs] == ["d.dcm"] * 3
    assert len(problems) == 9 and all(p.skipped for p in problems)
    assert all(p.reason.startswith("nested archive not expanded: ") for p in problems)
    assert {p.reason.rsplit(": ", 1)[1] for p in problems} == {"zip data", "gz data", "tar data"}


def test_empty_file_and_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    real = write(root / "real.dcm", dcm("real"))
    write(root / "empty.dcm", b"")
    outside = write(tmp_path / "outside.dcm", dcm("outside"))
    (root / "alias.dcm").symlink_to(real)
    (root / "sub").mkdir()
    (root / "sub" / "up.dcm").symlink_to("../real.dcm")
    (root / "dead").symlink_to(root / "missing")
    (root / "escape").symlink_to(outside)
    (root / "sub" / "loop").symlink_to("..")
    (root / "self").symlink_to("self")
    refs, problems = run(root)
    assert refs == [SourceRef(os.path.realpath(real), None, real.stat().st_size)]
    assert all(p.member is None and not p.skipped for p in problems)
    reasons = {Path(p.path).relative_to(root).as_posix(): p.reason for p in problems}
    assert reasons == {"dead": "dangling symbolic link", "empty.dcm": "empty file",
                       "escape": "symbolic link points outside the source root",
                       "self": reasons["self"], "sub/loop": "symbolic link to a folder not followed"}
    assert reasons["self"].startswith("unresolvable symbolic link")


def test_symlinked_archive_is_listed_once(tmp_path: Path) -> None:
    archive = make_zip(tmp_path / "root" / "a.zip", {"x.dcm": dcm("x")})
    (tmp_path / "root" / "b.zip").symlink_to(archive)
    refs, problems = run(tmp_path / "root")
    assert [r.display for r in refs] == [f"{archive}!x.dcm"] and problems == []


def test_damaged_archives_do_not_raise(tmp_path: Path) -> None:
    src, spool = tmp_path / "src", tmp_path / "spool"
    rng = random.Random(7)
    members = {f"m{i}.dcm": dcm(str(i), rng.randbytes(100_000)) for i in range(4)}
    whole_zip = make_zip(src / "whole.zip", members).read_bytes()
    write(src / "cut.zip", whole_zip[: len(whole_zip) // 2])
    with tarfile.open(tmp_path / "whole.tgz", "w:gz", compresslevel=0) as archive:
        for name, data in members.items():
            tar_add(archive, name, data)
    whole_tgz = (tmp_path / "whole.tgz").read_bytes()
    write(src / "cut.tgz", whole_tgz[: len(whole_tgz) // 2])
    flipped = bytearray(whole_tgz)
    flipped[len(flipped) // 2: len(flipped) // 2 + 64] = bytes(64)  # inside stored data: only the CRC tells
    write(src / "flipped.tgz", bytes(flipped))
    whole_tar = make_tar(tmp_path / "whole.tar", members).read_bytes()
    write(src / "cut.tar", whole_tar[: len(whole_tar) * 3 // 8])
    write(src / "notar.gz", gzip.compress(b"")[:10] + b"\xff" * 50)  # deflate block of the reserved type
    write(src / "nifti.nii.gz", gzip.compress(b"\x5c\x01\x00\x00" + bytes(400)))
    write(src / "image.gz", gzip.compress(b"\x5c\x01\x00\x00" + bytes(400)))
    refs, problems = run(src, spool_dir=spool)
    archive_problems = {Path(p.path).name: p.reason for p in problems if p.member is None}
    assert archive_problems["cut.zip"].startswith("damaged zip archive")
    for name in ["cut.tgz", "flipped.tgz", "notar.gz"]:  # compressed tars are rejected as a whole
        assert archive_problems[name].startswith("damaged tar.gz archive: ")
    assert "CRC" in archive_problems["flipped.tgz"]
    assert archive_problems["nifti.nii.gz"] == "not DICOM: a .nii.gz file"  # told by its name: not decompressed
    assert archive_problems["image.gz"] == "gz data that is not a tar archive"
    cut_tar = {p.member: p.reason for p in problems if Path(p.path).name == "cut.tar"}
    assert cut_tar == {"m1.dcm": "member data truncated (archive cut short)",
                       None: "damaged tar archive: unexpected end of data"}
    assert sorted(r.display.split(str(src) + "/")[1] for r in refs) == (
        ["cut.tar!m0.dcm"] + [f"whole.zip!m{i}.dcm" for i in range(4)])
    for ref in refs:
        assert read_source(ref) == members[ref.display.rsplit("!", 1)[1]]
    assert os.listdir(spool) == []


def test_spool_permissions(tmp_path: Path) -> None:
    path = make_tar(tmp_path / "a.tar.gz", {"x.dcm": dcm("x"), "y.dcm": dcm("y")}, "gz")
    refs, _ = run(path)
    spool = Path(refs[0].path).parent
    try:
        assert stat.S_IMODE(spool.stat().st_mode) == 0o700
        assert {stat.S_IMODE(Path(r.path).stat().st_mode) for r in refs} == {0o600}
        assert sorted(os.listdir(spool)) == sorted(Path(r.path).name for r in refs)
    finally:
        for ref in refs:
            os.unlink(ref.path)
        spool.rmdir()
    given = tmp_path / "given" / "spool"
    refs, _ = run(path, spool_dir=given)
    assert stat.S_IMODE(given.stat().st_mode) == 0o700 and all(Path(r.path).parent == given for r in refs)


def test_refs_pickle_and_read_in_a_forked_worker(tmp_path: Path) -> None:
    members = {"a.dcm": dcm("a"), "b.dcm": dcm("b")}
    src = tmp_path / "src"
    make_zip(src / "z.zip", members)
    make_tar(src / "t.tar", members)
    make_tar(src / "t.tar.bz2", members, "bz2")
    refs, _ = run(src, spool_dir=tmp_path / "spool")
    assert len(refs) == 6
    assert pickle.loads(pickle.dumps(refs)) == refs
    problem = DiscoveryProblem("/x.zip", "m", "why", True)
    assert pickle.loads(pickle.dumps(problem)) == problem and problem.display == "/x.zip!m"
    expected = [read_source(r) for r in refs]  # parent caches open handles first
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map(read_source, refs) == expected


def test_read_errors_are_input_problems(tmp_path: Path) -> None:
    plain = write(tmp_path / "gone.dcm", dcm("gone"))
    [ref] = run(plain)[0]
    plain.unlink()
    with pytest.raises(InputProblem) as caught:
        read_source(ref)
    assert caught.value.stage == "discover" and "No such file" in caught.value.reason
    with pytest.raises(InputProblem):
        open_source(ref)

    data = dcm("big", os.urandom(64 << 10))
    path = make_zip(tmp_path / "crc.zip", {"big.dcm": data}, zipfile.ZIP_STORED)
    raw = bytearray(path.read_bytes())
    at = raw.find(data) + 40_000
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    [ref] = run(path)[0]
    assert read_source(ref, max_bytes=200) == data[:200]
    with pytest.raises(InputProblem, match="CRC"):
        read_source(ref)
    with pytest.raises(InputProblem, match="not found"):
        read_source(SourceRef(str(path), "other.dcm", 10))


def test_encrypted_zip_member(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "enc.zip", {"secret.dcm": dcm("s")}, zipfile.ZIP_STORED)
    raw = bytearray(path.read_bytes())
    for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        raw[raw.find(signature) + flag_at] |= 0x1
    path.write_bytes(bytes(raw))
    assert by_member(run(path)[1]) == {"secret.dcm": "encrypted member"}


COMPONENT = st.text(alphabet="abXY09._- ", min_size=1, max_size=6).filter(lambda c: c not in (".", ".."))
SAFE = st.lists(COMPONENT, min_size=1, max_size=3).map("/".join)
UNSAFE = st.one_of(SAFE.map(lambda n: "/" + n), SAFE.map(lambda n: "../" + n), SAFE.map(lambda n: n + "/../x"),
                   SAFE.map(lambda n: "C:" + n), SAFE.map(lambda n: "\\" + n))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=st.lists(st.one_of(SAFE, UNSAFE), unique=True, max_size=15), as_zip=st.booleans())
def test_every_safe_member_once_every_unsafe_member_reported_once(names: list[str], as_zip: bool) -> None:
    unsafe = {n for n in names if n.startswith(("/", "\\", "C:")) or ".." in n.split("/")}
    with tempfile.TemporaryDirectory() as folder:
        path = make_archive(Path(folder) / "prop", "zip" if as_zip else "", {n: dcm(n) for n in names})
        refs, problems = run(path)
        if not names:  # an empty archive is reported (an empty tar is nothing but zero bytes)
            assert refs == [] and [p.reason.split(":")[0] for p in problems] == [
                "zip archive without files" if as_zip else "zero-filled"]
            return
        assert Counter(r.member for r in refs) == Counter(set(names) - unsafe)
        assert Counter(p.member for p in problems) == Counter(unsafe)
        assert all(p.reason.startswith("unsafe member path") for p in problems)
        assert [r.member for r in refs] == sorted(r.member for r in refs)
        assert all(read_source(r) == dcm(r.member) for r in refs)


def test_spool_failure_is_reported_not_raised(tmp_path: Path) -> None:
    path = make_tar(tmp_path / "a.tar.gz", {"x.dcm": dcm("x")}, "gz")
    blocker = write(tmp_path / "file", b"not a folder")
    [problem] = list(discover(path, spool_dir=blocker / "spool"))
    assert isinstance(problem, DiscoveryProblem) and problem.reason.startswith("cannot create a spool file: ")


def test_replaced_archive_is_reopened(tmp_path: Path) -> None:
    path = make_zip(tmp_path / "a.zip", {"x.dcm": dcm("first")})
    [ref] = run(path)[0]
    assert read_source(ref) == dcm("first")
    replacement = make_zip(tmp_path / "b.zip", {"pad": b"p" * 100, "x.dcm": dcm("second")})
    os.replace(replacement, path)
    assert read_source(ref) == dcm("second")


def nifti1(size: int = 400) -> bytes:
    """A NIfTI-1 single file: sizeof_hdr 348, magic "n+1" at 344, data from 352."""
    head = bytearray(352)
    head[0:4] = (348).to_bytes(4, "little")
    head[344:348] = b"n+1\0"
    return bytes(head) + bytes(size)


def test_files_plainly_not_dicom_are_ignored_apart_from_damaged_dicom(tmp_path: Path) -> None:
    src = tmp_path / "src"
    ignored = {"README.md": b"# Export\nSee the PACS.\n", "LICENSE": "Licence \u00e9t\u00e9\n".encode() * 40,
               "meta.json": b'{"Modality": "CT"}', "scan.nii": nifti1(), "shot.png": b"\x89PNG\r\n\x1a\n" + bytes(64),
               "photo.jpg": b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(64), "report.pdf": b"%PDF-1.4\n%\xe2\xe3\n",
               "notes.txt": "\ufeffnotes".encode("utf-16"), "weights.npy": b"\x05\x01\x02" + os.urandom(300)}
    for name, data in ignored.items():
        write(src / name, data)
    make_zip(src / "slides.pptx", {"ppt/slide1.xml": b"<p/>"})  # an office document is a zip: told by its name
    candidates = {"cut.dcm": dcm("cut")[:130],               # damaged DICOM: cut inside "DICM", not text
                  "raw.txt": b"\x08\x00\x05\x00CS\x0a\x00ISO_IR 100",  # a dataset without preamble, whatever its name
                  "noise.dcm": b"\x01\x02" + os.urandom(500)}
    for name, data in candidates.items():
        write(src / name, data)
    make_zip(src / "export.zip", {"a.dcm": dcm("a"), "README.txt": b"exported by the PACS\n", "img.nii": nifti1()})
    refs, problems = run(src)
    assert sorted(r.display.split(str(src) + "/")[1] for r in refs) == ["cut.dcm", "export.zip!a.dcm", "noise.dcm",
                                                                       "raw.txt"]
    found = {p.display.split(str(src) + "/")[1]: p for p in problems}
    assert set(found) == {*ignored, "slides.pptx", "export.zip!README.txt", "export.zip!img.nii"}
    assert all(p.ignored and p.status == "ignored" and p.reason.startswith("not DICOM: ") for p in found.values())
    assert {name: found[name].reason for name in ("README.md", "LICENSE", "notes.txt", "scan.nii", "shot.png",
                                                  "slides.pptx", "weights.npy")} == {
        "README.md": "not DICOM: text", "LICENSE": "not DICOM: text", "notes.txt": "not DICOM: text",
        "scan.nii": "not DICOM: NIfTI-1 image", "shot.png": "not DICOM: PNG image",
        "slides.pptx": "not DICOM: a .pptx file", "weights.npy": "not DICOM: a .npy file"}
    assert problem_sha256(found["meta.json"]) == hashlib.sha256(ignored["meta.json"]).hexdigest()


def _bytes_read() -> int:
    """Bytes this process has read through read(2)-like calls (``rchar`` of /proc/self/io): holes count too."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts bytes read with Linux's /proc/self/io")
def test_zero_filled_files_are_rejected_without_reading_them_all(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "zeros_1mib.dcm", bytes(1 << 20))
    write(src / "zeros_100.dcm", bytes(100))
    sparse = src / "sparse_2gib.dcm"
    with open(sparse, "wb") as file:  # a 2 GiB hole: no disk used
        file.truncate(2 << 30)
    late = src / "late_data.dcm"
    with open(late, "wb") as file:
        file.truncate(64 << 20)
        file.seek(32 << 20)
        file.write(b"data after 32 MiB of hole")
    slice_ = bytearray(dcm("ct", os.urandom(4000)))
    slice_[:512] = bytes(512)  # the preamble, "DICM" and the start of the header zeroed
    write(src / "zeroed_header.dcm", bytes(slice_))
    before = _bytes_read()
    refs, problems = run(src)
    assert _bytes_read() - before < 8 << 20  # at most 1 MiB of each
    assert refs == []
    reasons = {Path(p.path).name: p.reason for p in problems}
    assert reasons == {
        "zeros_1mib.dcm": f"zero-filled: all {1 << 20} bytes are zero",
        "zeros_100.dcm": "zero-filled: all 100 bytes are zero",
        "sparse_2gib.dcm": f"zero-filled: all {2 << 30} bytes are zero",
        "late_data.dcm": "zero-filled: the first 1 MiB are zero (no DICOM preamble, no archive header; the rest was "
                         "not read)",
        "zeroed_header.dcm": "damaged: the first 512 bytes are zero (DICOM preamble and header zeroed)"}
    assert all(p.status == "rejected" for p in problems)
    hashes = {Path(p.path).name: problem_sha256(p) for p in problems}  # small ones only: the others are not read
    assert hashes == {"zeros_1mib.dcm": hashlib.sha256(bytes(1 << 20)).hexdigest(), "sparse_2gib.dcm": None,
                      "zeros_100.dcm": hashlib.sha256(bytes(100)).hexdigest(), "late_data.dcm": None,
                      "zeroed_header.dcm": hashlib.sha256(slice_).hexdigest()}


def test_tar_without_ustar_magic_is_found_by_its_header_checksum(tmp_path: Path) -> None:
    """Pre-POSIX tars have no "ustar" magic: the header checksum tells them, as tarfile.is_tarfile did."""
    raw = bytearray(make_tar(tmp_path / "gnu.tar", {"x.dcm": dcm("x")}).read_bytes())
    raw[257:265] = bytes(8)                                      # no magic, no version: a V7 header
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw[:512])
    path = write(tmp_path / "src" / "old.tar", bytes(raw))
    assert tar_header(bytes(raw[:512])) and not tar_header(bytes(512)) and not tar_header(dcm("x", bytes(400)))
    refs, problems = run(path)
    assert [r.display for r in refs] == [f"{path}!x.dcm"] and problems == []
    assert read_source(refs[0]) == dcm("x")


def test_archives_without_files_are_reported(tmp_path: Path) -> None:
    path = tmp_path / "src" / "folders.zip"
    make_zip(path, {"a/": b"", "__MACOSX/._a": b"junk"})
    assert run(path) == ([], [DiscoveryProblem(str(path), None, "zip archive without files", ignored=True)])
