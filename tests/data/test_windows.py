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
