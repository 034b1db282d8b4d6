"""Window presets and HU -> uint8 by name, custom spec or Window."""

from __future__ import annotations

import numpy as np
import pytest

from medload import windows as win
from medload.errors import ConfigError


@pytest.mark.parametrize("spec", [*sorted(win.PRESETS), "350/50"])
def test_to_uint8_takes_a_name_or_spec_as_its_window(spec):
    hu = np.arange(-2000, 3001, 7, dtype=np.int16).reshape(13, -1)
    by_name = win.to_uint8(hu, spec)
    assert by_name.dtype == np.uint8 and np.array_equal(by_name, win.to_uint8(hu, win.get(spec)))
    assert by_name.min() == 0 and by_name.max() == 255


def test_to_uint8_refuses_an_unknown_window_name():
    with pytest.raises(ConfigError, match="unknown window 'lungs'"):
        win.to_uint8(np.zeros((2, 2), np.int16), "lungs")


@pytest.mark.parametrize("spec", ["40/400", "40/-600", "80/120"])
def test_a_bare_window_narrower_than_its_level_is_refused_as_probably_swapped(spec):
    width, level = spec.split("/")
    with pytest.raises(ConfigError, match=f"write {level}/{width} .WIDTH/LEVEL., or W{width}/L{level}"):
        win.get(spec)


@pytest.mark.parametrize(("spec", "width", "level"), [
    ("W8/L32", 8, 32), ("w=40, l=400", 40, 400), ("W350/L50", 350, 50), (" 350 / 50 ", 350, 50), ("80/-80", 80, -80),
])
def test_named_windows_say_which_number_is_which_and_names_parse_back(spec, width, level):
    window = win.get(spec)
    assert (window.width, window.level) == (width, level)
    assert win.get(window.name) == window


@pytest.mark.parametrize("spec", ["0/40", "-400/40", "W0/L40", "400", "L40/W400"])
def test_malformed_windows_are_refused(spec):
    with pytest.raises(ConfigError):
        win.get(spec)


def test_a_store_holding_a_narrow_window_under_its_old_bare_name_stays_readable_and_grows(run_ingest, tmp_path,
                                                                                           monkeypatch):
    """Before a bare pair narrower than its level was refused, medload stored a stroke window (8 HU wide at
    32 HU) as "8/32". Such a store (written here with that older rule) reads its planes under either
    spelling, in a dataset too, and a later ingest asking for W8/L32 adds series into the same planes."""
    import medload
    from medload.data import SliceDataset
    from medload.synthetic import SeriesSpec, make_series

    src = tmp_path / "src"
    make_series(src / "a", SeriesSpec(n_slices=6, rows=24, cols=24), seed=1)
    make_series(src / "b", SeriesSpec(n_slices=5, rows=24, cols=24), seed=2, series_number=2)
    with monkeypatch.context() as older:  # the rule of an earlier medload: any positive WIDTH/LEVEL, named as written
        older.setattr(win, "get", lambda spec: spec if isinstance(spec, win.Window) else win.stored(spec))
        _, store = run_ingest(src / "a", store_path=tmp_path / "s", windows=("8/32",))
    (first,) = store.series()
    assert first.windows == ("8/32",) and store.manifest.windows == ("8/32",)
    hu = store.read(first.key)
    expected = win.to_uint8(hu, win.Window("8/32", 8, 32))
    for spelling in ("8/32", "W8/L32"):
        assert np.array_equal(store.read(first.key, plane=spelling), expected)
    assert SliceDataset(store, plane="W8/L32")[0]["image"].shape[0] == 3
    with pytest.raises(ConfigError, match="probably swapped|level/width swapped"):
        win.get("8/32")  # what a user types is still held to the rule
    with pytest.raises(ConfigError, match="level/width swapped; write 400/40"):
        store.read(first.key, plane="40/400")  # a plane the store does not hold: the rule's own message
    report, _ = run_ingest(src / "b", store_path=tmp_path / "s", windows=("W8/L32",))
    assert report.counts["ingested"] == 1
    store = medload.open_store(tmp_path / "s")
    assert store.manifest.windows == ("8/32",) and {r.windows for r in store.series()} == {("8/32",)}
    second = next(r for r in store.series() if r.key != first.key)
    assert np.array_equal(store.read(second.key, plane="W8/L32"),
                          win.to_uint8(store.read(second.key), win.Window("W8/L32", 8, 32)))
