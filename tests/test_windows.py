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
