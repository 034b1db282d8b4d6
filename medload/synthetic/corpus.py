"""A corpus of bad inputs mixed with good series: what an ingester must quarantine, one by one, while
still ingesting everything else.

:func:`write_bad_corpus` writes, under ``root/src``, more than 200 broken inputs -- truncations at
many offsets, bit flips in the header and in the pixels, Rows/Columns/NumberOfFrames bombs, Pixel
Data longer than the file, wrong VRs, encapsulated data whose codestreams lie about their size,
non-DICOM and empty files, zip/tar members with ``..`` and absolute paths, links, special members,
zip and tar.gz bombs, a deflate bomb, series with one corrupt slice -- among good series in every
transfer syntax the generator writes, plain and inside a zip and a tar.gz. ``root/outside`` holds what
links out of the source point at. Each bad input is described by a :class:`BadInput` (the name a
quarantine record gives it); :attr:`BadCorpus.fuzzed` lists files with random bit flips anywhere,
which may stay valid. Everything is drawn from ``seed``.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pydicom
from pydicom.uid import ExplicitVRBigEndian, ImplicitVRLittleEndian, JPEG2000Lossless, JPEGLSLossless, RLELossless

from medload.synthetic import broken
from medload.synthetic.series import make_series
from medload.synthetic.spec import GeneratedSeries, SeriesSpec

__all__ = ["BadInput", "BadCorpus", "write_bad_corpus"]

_SMALL = dict(rows=16, cols=16)
_ENCAPSULATED: dict[str, Any] = dict(rows=32, cols=32)  # JPEG 2000 needs 32 pixels a side


@dataclass(frozen=True)
class BadInput:
    """One input an ingester must quarantine: ``name`` is the file path, or ``archive!member``, as a
    quarantine record names it; ``sha256`` is that of its bytes where they can be read (None for links
    and for archive members refused unread); ``status`` that of its record: ``rejected``, or ``ignored``
    for a file that is plainly not DICOM (text, a PDF, a PNG...)."""

    name: str
    kind: str
    sha256: str | None
    status: str = "rejected"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class BadCorpus:
    """What :func:`write_bad_corpus` wrote."""

    source: Path
    outside: Path
    good: list[GeneratedSeries] = field(default_factory=list)
    bad: list[BadInput] = field(default_factory=list)
    fuzzed: list[Path] = field(default_factory=list)


class _Writer:
    """Writes files into the corpus and records them."""

    def __init__(self, root: Path, rng: np.random.Generator) -> None:
        self.corpus = BadCorpus(root / "src", root / "outside")
        self.rng = rng
        self.scratch = root / "scratch"
        self._n = 0

    def template(self, **spec) -> tuple[pydicom.Dataset, bytes]:
        """A valid one-slice file (dataset, and bytes with UIDs of its own)."""
        self._n += 1
        gen = make_series(self.scratch / f"t{self._n}", SeriesSpec(n_slices=1, **spec), seed=1000 + self._n)
        ds = pydicom.dcmread(gen.paths[0])
        return ds, gen.paths[0].read_bytes()

    def unique(self, ds: pydicom.Dataset) -> bytes:
        self._n += 1
        return broken.with_uids(ds, f"{self._n}")

    def bad(self, rel: str, data: bytes, kind: str, status: str = "rejected") -> Path:
        path = self.corpus.source / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.corpus.bad.append(BadInput(str(path), kind, _sha256(data), status))
        return path


def write_bad_corpus(root: Path, *, seed: int = 0) -> BadCorpus:
    """Write the corpus under ``root`` (``src``, ``outside``; a ``scratch`` folder is removed) and
    describe it."""
    root = Path(root)
    w = _Writer(root, np.random.default_rng(seed))
    _good(w)
    _file_damage(w)
    _encapsulated_damage(w)
    _corrupt_slices(w)
    _not_dicom(w)
    _archives(w)
    _links(w)
    shutil.rmtree(w.scratch)
    return w.corpus


def _good(w: _Writer) -> None:
    """Series that must be ingested: every syntax the generator writes, an Enhanced CT, in archives."""
    good = w.corpus.source / "good"
    specs = [SeriesSpec(n_slices=12, rows=32, cols=40), SeriesSpec(n_slices=8, transfer_syntax=ImplicitVRLittleEndian),
             SeriesSpec(n_slices=8, transfer_syntax=ExplicitVRBigEndian, signed=True, bits_stored=16),
             SeriesSpec(n_slices=8, transfer_syntax=RLELossless), SeriesSpec(n_slices=6, transfer_syntax=JPEG2000Lossless,
                                                                            **_ENCAPSULATED),
             SeriesSpec(n_slices=6, transfer_syntax=JPEGLSLossless, **_ENCAPSULATED),
             SeriesSpec(n_slices=10, multiframe=True, orientation="oblique")]
    for i, spec in enumerate(specs):
        w.corpus.good.append(make_series(good / f"series{i}", spec, seed=500 + i, series_number=i + 1))
    for i, kind in enumerate(("zip", "tar.gz")):
        folder = w.scratch / f"packed{i}"
        gen = make_series(folder, SeriesSpec(n_slices=8), seed=600 + i, series_number=20 + i)
        archive = good / f"packed{i}.{kind}"
        if kind == "zip":
            with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
                for p in gen.paths:
                    z.write(p, p.name)
        else:
            with tarfile.open(archive, "w:gz") as t:
                for p in gen.paths:
                    t.add(p, p.name)
        w.corpus.good.append(gen)


def _file_damage(w: _Writer) -> None:
    """Truncations, header bit flips, sign-bit flips in pixels, size bombs, overlong Pixel Data, wrong
    VRs, a deflate bomb, and the fuzzed files."""
    ds, _ = w.template(**_SMALL)
    signed = [w.template(**_SMALL, signed=True, bits_stored=16, rescale_intercept=i)[0] for i in (0, -1024)]
    size = len(w.unique(ds))
    for n, cut in enumerate(sorted(w.rng.choice(np.arange(1, size), 64, replace=False))):
        w.bad(f"damaged/truncated/cut{n:02d}_{cut}.dcm", broken.truncate(w.unique(ds), int(cut)), "truncated")
    for n in range(42):
        target = broken.HEADER_TARGETS[n % len(broken.HEADER_TARGETS)]
        bit = int(w.rng.integers(8))
        w.bad(f"damaged/header_flip/flip{n:02d}.dcm", broken.flip_header(w.unique(ds), target, bit), "header flip")
    for n in range(15):
        pixels = w.rng.choice(16 * 16, int(w.rng.integers(4, 40)), replace=False)
        w.bad(f"damaged/pixel_flip/flip{n:02d}.dcm", broken.flip_sign_bits(w.unique(signed[n % 2]), pixels),
              "pixel flip")
    bombs: dict[str, dict[str, object]] = {
        "rows_cols_65535": dict(Rows=65535, Columns=65535), "rows_40000": dict(Rows=40000),
        "frames_2g": dict(NumberOfFrames="2147483647"), "frames_99999": dict(NumberOfFrames="99999"),
        "frames_0": dict(NumberOfFrames="0"), "rows_0": dict(Rows=0), "columns_1": dict(Columns=1, Rows=65535)}
    for name, values in bombs.items():
        bomb = pydicom.dcmread(io.BytesIO(w.unique(ds)))
        for keyword, value in values.items():
            setattr(bomb, keyword, value)
        out = io.BytesIO()
        bomb.save_as(out, enforce_file_format=True)
        w.bad(f"damaged/bombs/{name}.dcm", out.getvalue(), "size bomb")
    for n, extra in enumerate((2, 1000, 1 << 20, 0x7FFFFFF0, 0xFFFFFFFF)):
        data = w.unique(ds)
        length = extra if extra >= 0x7FFFFFF0 else 16 * 16 * 2 + extra
        w.bad(f"damaged/overlong/pixel_data_{n}.dcm", broken.set_pixel_data_length(data, length), "pixel data past the end")
    for n, (tag, vr, new_vr, value) in enumerate(broken.WRONG_VRS):
        w.bad(f"damaged/wrong_vr/vr{n}.dcm", broken.wrong_vr(w.unique(ds), tag, vr, new_vr, value), "wrong VR")
    w.bad("damaged/deflate_bomb.dcm", broken.deflate_bomb(ds, "deflate-bomb", 4 * 10**9), "deflate bomb")
    w.bad("damaged/deflate_bomb_trailing.dcm", broken.deflate_bomb(ds, "deflate-bomb-trailing", 2 * 10**9,
                                                                    trailing=True), "deflate bomb")
    for n in range(20):
        path = w.corpus.source / "damaged" / "fuzzed" / f"fuzz{n:02d}.dcm"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(broken.random_flips(w.unique(ds), w.rng, int(w.rng.integers(1, 4))))
        w.corpus.fuzzed.append(path)


def _encapsulated_damage(w: _Writer) -> None:
    """Compressed files whose codestreams declare another size, whose RLE header or fragments lie, whose
    codestreams are cut short (some closed again with their end marker), and a 16000 x 16000 image
    whose Rows and Columns agree with its codestream (a decoder-side bomb)."""
    j2k, _ = w.template(**_ENCAPSULATED, transfer_syntax=JPEG2000Lossless)
    jls, _ = w.template(**_ENCAPSULATED, transfer_syntax=JPEGLSLossless)
    rle, _ = w.template(**_ENCAPSULATED, transfer_syntax=RLELossless)
    folder = "damaged/encapsulated"
    w.bad(f"{folder}/j2k_40000.dcm", broken.codestream_size(w.unique(j2k), 40000, 40000), "codestream size")
    w.bad(f"{folder}/j2k_33x32.dcm", broken.codestream_size(w.unique(j2k), 33, 32), "codestream size")
    w.bad(f"{folder}/jpegls_60000.dcm", broken.codestream_size(w.unique(jls), 32, 60000), "codestream size")
    w.bad(f"{folder}/rle_segments.dcm", broken.rle_segments(w.unique(rle), 5), "RLE header")
    for name, template, fraction, end in (("jpegls", jls, 0.9, b"\xff\xd9"), ("jpegls", jls, 0.75, b""),
                                          ("j2k", j2k, 0.9, b"\xff\xd9"), ("rle", rle, 0.95, b"")):
        w.bad(f"{folder}/{name}_cut{int(fraction * 100)}{'_end' if end else ''}.dcm",
              broken.cut_codestream(w.unique(template), fraction, end), "codestream cut short")
    for name, template in (("rle", rle), ("j2k", j2k)):
        w.bad(f"{folder}/{name}_fragment_overrun.dcm", broken.fragment_overrun(w.unique(template), 4096),
              "fragment past the end")
        w.bad(f"{folder}/{name}_bad_item.dcm", broken.bad_item(w.unique(template)), "damaged item")
        data = w.unique(template)
        w.bad(f"{folder}/{name}_no_delimiter.dcm", data[:-8], "truncated")
    big = pydicom.dcmread(io.BytesIO(broken.codestream_size(w.unique(j2k), 16000, 16000)))
    big.Rows = big.Columns = 16000
    out = io.BytesIO()
    big.save_as(out, enforce_file_format=True)
    w.bad(f"{folder}/j2k_16000_decode_bomb.dcm", out.getvalue(), "decode bomb")


def _corrupt_slices(w: _Writer) -> None:
    """Series of good files but one, whose pixels decode yet are random bytes or zeros."""
    for n, (z, kind) in enumerate(((5, "random"), (7, "zeros"), (0, "random"))):
        gen = make_series(w.corpus.source / "damaged" / f"corrupt_slice{n}", SeriesSpec(n_slices=12, rows=32, cols=32),
                          seed=700 + n, series_number=40 + n)
        path = gen.paths[z]
        data = path.read_bytes()
        first = broken.element_offset(data, 0x7FE00010, b"OW") + 12
        pixels = w.rng.bytes(32 * 32 * 2) if kind == "random" else bytes(32 * 32 * 2)
        damaged = data[:first] + pixels + data[first + len(pixels) :]
        path.write_bytes(damaged)
        w.corpus.bad.append(BadInput(str(path), f"corrupt slice ({kind})", _sha256(damaged)))


def _not_dicom(w: _Writer) -> None:
    """Notes, documents, images, random bytes, a fake preamble, empty files, damaged archives."""
    folder = "other"
    texts = {"notes.txt": b"Scanned on the new CT, see PACS.\n", "report.pdf": b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n",
             "page.html": b"<!doctype html><title>export</title>", "table.csv": b"series,slices\n1,12\n",
             "meta.json": b'{"Modality": "CT"}', "image.png": b"\x89PNG\r\n\x1a\n" + bytes(64),
             "photo.jpg": b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(64)}
    for name, data in texts.items():
        w.bad(f"{folder}/{name}", data, "not DICOM", "ignored")
    for n, size in enumerate((1, 100, 4096, 70000)):  # binary (a control byte first): never taken for text
        w.bad(f"{folder}/random{n}.dcm", b"\x01" + w.rng.bytes(size)[1:], "not DICOM")
    w.bad(f"{folder}/fake_preamble.dcm", bytes(128) + b"DICM" + w.rng.bytes(300), "not DICOM")
    for rel in ("empty.dcm", ".hidden_empty", "deep/er/empty.dcm", "IM0001", "zero.bin"):
        w.bad(f"{folder}/empty/{rel}", b"", "empty")
    w.bad(f"{folder}/damaged.zip", b"PK\x03\x04" + w.rng.bytes(200), "damaged archive")
    ds, data = w.template(**_SMALL)
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as t:
        info = tarfile.TarInfo("slice.dcm")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    w.bad(f"{folder}/cut.tar", tar.getvalue()[: 512 + len(data) // 2], "damaged archive")


def _archives(w: _Writer) -> None:
    """Zip/tar members with '..' and absolute names, links and special members, and bombs."""
    ds, _ = w.template(**_SMALL)
    folder = w.corpus.source / "archives"
    folder.mkdir(parents=True)
    unsafe = ["../evil.dcm", "/abs/evil.dcm", "a/../../evil.dcm", "C:/evil.dcm", "..\\evil.dcm"]
    zip_path = folder / "unsafe.zip"
    with zipfile.ZipFile(zip_path, "w") as z:
        for name in unsafe:
            z.writestr(name, w.unique(ds))
        for name, mode, data in (("link.dcm", 0o120777, b"/etc/passwd"), ("fifo.dcm", 0o010600, b"")):
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            z.writestr(info, data)
        z.writestr("empty.dcm", b"")
    names = unsafe + ["link.dcm", "fifo.dcm"]
    w.corpus.bad += [BadInput(f"{zip_path}!{n}", "unsafe member", None) for n in names]
    w.corpus.bad.append(BadInput(f"{zip_path}!empty.dcm", "empty", _sha256(b"")))
    for suffix in ("tar", "tar.gz"):
        path = folder / f"unsafe.{suffix}"
        names = ["../evil.dcm", "/evil.dcm", "a/../../evil.dcm", "sym.dcm", "hard.dcm", "dev.dcm", "pipe.dcm"]
        with tarfile.open(path, "w:gz" if suffix == "tar.gz" else "w") as t:
            for name in names[:3]:
                data = w.unique(ds)
                member = tarfile.TarInfo(name)
                member.size = len(data)
                t.addfile(member, io.BytesIO(data))
            for name, kind in zip(names[3:], (tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.FIFOTYPE)):
                member = tarfile.TarInfo(name)
                member.type, member.linkname = kind, "/etc/passwd"
                t.addfile(member)
        w.corpus.bad += [BadInput(f"{path}!{n}", "unsafe member", None) for n in names]
    bomb = folder / "bomb.zip"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("zeros.dcm", bytes(16 << 20))
    w.corpus.bad.append(BadInput(f"{bomb}!zeros.dcm", "zip bomb", None))
    tar_bomb = folder / "bomb.tar.gz"
    with tarfile.open(tar_bomb, "w:gz", compresslevel=9) as t:
        member = tarfile.TarInfo("zeros.dcm")
        member.size = 16 << 20
        t.addfile(member, io.BytesIO(bytes(member.size)))
    w.corpus.bad.append(BadInput(str(tar_bomb), "tar.gz bomb", _sha256(tar_bomb.read_bytes())))


def _links(w: _Writer) -> None:
    """Links out of the source (to a valid DICOM file, a folder, a device), dangling, and in a loop."""
    _, data = w.template(**_SMALL)
    outside = w.corpus.outside
    outside.mkdir(parents=True)
    (outside / "secret.dcm").write_bytes(data)
    links = w.corpus.source / "links"
    links.mkdir(parents=True)
    targets: dict[str, str | Path] = {
        "to_outside_file.dcm": outside / "secret.dcm", "to_outside_folder": outside, "to_device": "/dev/zero",
        "dangling.dcm": outside / "missing.dcm", "loop_a.dcm": links / "loop_b.dcm",
        "loop_b.dcm": links / "loop_a.dcm"}
    for name, target in targets.items():
        os.symlink(target, links / name)
        w.corpus.bad.append(BadInput(str(links / name), "symbolic link", None))
