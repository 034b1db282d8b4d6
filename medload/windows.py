"""CT display windows (width/level in HU), the one place they are defined.

Presets are the ones the OHIF viewer ships: brain 80/40, soft tissue 400/40, lung 1500/-600,
liver 150/90, bone 2500/480. A custom window is written ``"WIDTH/LEVEL"``, width first as in those
presets (e.g. ``"350/50"``), or with the names spelled out, ``"W350/L50"``. Viewers disagree on the
order (some write level/width), so a bare pair whose width is below the level's magnitude (``"40/400"``:
a 40 HU window around 400 HU?) is refused as probably swapped; a window that is really that narrow
(a stroke window, 8 HU wide at 32 HU) is written with names: ``"W8/L32"``. A store written before that
rule may hold such a window as ``"8/32"``: :func:`stored` and :func:`stored_name` read it.

The mapping is MONAI's ``ScaleIntensityRange(a_min=level - width/2, a_max=level + width/2, b_min=0,
b_max=1, clip=True)``; :func:`to_uint8` scales that to 0..255 and rounds, which is how pre-windowed
planes are stored at ingest (``medload ingest --windows lung,soft_tissue``).

Examples:
    >>> from medload import windows
    >>> windows.get("lung").bounds
    (-1350.0, 150.0)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from medload.errors import ConfigError

__all__ = ["Window", "PRESETS", "get", "stored", "stored_name", "parse_list", "to_uint8", "scale_intensity"]


@dataclass(frozen=True)
class Window:
    """A display window: HU values in ``[level - width/2, level + width/2]`` map to 0..1."""

    name: str
    width: float
    level: float

    @property
    def bounds(self) -> tuple[float, float]:
        """(lowest, highest) HU of the window."""
        return (self.level - self.width / 2, self.level + self.width / 2)


PRESETS: dict[str, Window] = {
    w.name: w
    for w in (
        Window("brain", 80, 40),
        Window("soft_tissue", 400, 40),
        Window("lung", 1500, -600),
        Window("liver", 150, 90),
        Window("bone", 2500, 480),
    )
}

_NUMBER = r"(-?\d+(?:\.\d+)?)"
_BARE = re.compile(rf"^\s*{_NUMBER}\s*/\s*{_NUMBER}\s*$")
_NAMED = re.compile(rf"^\s*W\s*=?\s*{_NUMBER}\s*[/,]\s*L\s*=?\s*{_NUMBER}\s*$", re.I)


def get(spec: str | Window) -> Window:
    """A preset by name, or a custom window from ``"WIDTH/LEVEL"`` or ``"W<width>/L<level>"``.

    Examples:
        >>> get("350/50") == get("W350/L50") == Window("350/50", 350, 50)
        True
        >>> get("W8/L32").name
        'W8/L32'
    """
    if isinstance(spec, Window):
        return spec
    if spec in PRESETS:
        return PRESETS[spec]
    named, bare = _NAMED.match(spec), _BARE.match(spec)
    match = named or bare
    if match is None:
        raise ConfigError(f"unknown window {spec!r}: use one of {', '.join(PRESETS)}, WIDTH/LEVEL such as 400/40, "
                          "or W400/L40")
    width, level = float(match.group(1)), float(match.group(2))
    if width <= 0:
        raise ConfigError(f"window {spec!r} has width {width:g}: the width (first number) must be positive")
    if bare and width < abs(level):
        raise ConfigError(f"window {spec!r} reads as width {width:g}, level {level:g}: a window narrower than its level "
                          f"is usually level/width swapped; write {level:g}/{width:g} (WIDTH/LEVEL), or W{width:g}/"
                          f"L{level:g} if you mean it")
    return Window(_name(width, level), width, level)


def stored(name: str) -> Window:
    """The window a store holds planes of under ``name``, named so: as :func:`get`, but a bare pair narrower
    than its level is taken as written. Before that pair was refused as probably swapped, medload stored a
    window 8 HU wide at 32 HU as ``"8/32"``; such a store's planes stay readable, under either spelling
    (:func:`stored_name`).

    Examples:
        >>> stored("8/32")
        Window(name='8/32', width=8.0, level=32.0)
    """
    if name in PRESETS:
        return PRESETS[name]
    match = _NAMED.match(name) or _BARE.match(name)
    if match is None or float(match.group(1)) <= 0:
        return get(name)  # the error that names what is wrong with it
    return Window(name, float(match.group(1)), float(match.group(2)))


def stored_name(spec: str | Window, names: Sequence[str]) -> str | None:
    """Which of the stored window ``names`` the window ``spec`` is: the name itself, or the stored one of the
    same width and level (``"W8/L32"`` is a store's ``"8/32"``); None where none is."""
    if isinstance(spec, str) and spec in names:
        return spec
    wanted = stored(spec) if isinstance(spec, str) else spec
    for name in names:
        window = stored(name)
        if (window.width, window.level) == (wanted.width, wanted.level):
            return name
    return None


def _name(width: float, level: float) -> str:
    """A custom window's name, which :func:`get` parses back to the same window."""
    return f"{width:g}/{level:g}" if width >= abs(level) else f"W{width:g}/L{level:g}"


def parse_list(text: str | None) -> tuple[Window, ...]:
    """Windows from a comma-separated list such as ``"lung,soft_tissue,350/50"``."""
    if not text:
        return ()
    out = tuple(get(part.strip()) for part in text.split(",") if part.strip())
    names = [w.name for w in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"window list {text!r} names a window twice")
    return out


def to_uint8(hu: np.ndarray, window: str | Window) -> np.ndarray:
    """Window HU values to uint8 0..255 (clip, scale, round half to even); ``window`` is a
    :class:`Window`, a preset name or ``"WIDTH/LEVEL"`` (see :func:`get`).

    Examples:
        >>> to_uint8(np.array([-1350, -600, 150]), "lung").tolist()
        [0, 128, 255]
    """
    lo, hi = get(window).bounds
    scaled = (np.clip(hu.astype(np.float32), lo, hi) - np.float32(lo)) * np.float32(255.0 / (hi - lo))
    return np.rint(scaled).astype(np.uint8)


def scale_intensity(window: str | Window, keys: str | tuple[str, ...] = "image"):
    """The window as a ready MONAI ``ScaleIntensityRanged`` (HU in the window -> 0..1, clipped).

    Examples:
        >>> lung = scale_intensity("lung")
        >>> lung.scaler.a_min, lung.scaler.a_max
        (-1350.0, 150.0)
        >>> lung({"image": np.array([-2000.0, -600.0, 500.0])})["image"].tolist()
        [0.0, 0.5, 1.0]
    """
    from monai.transforms import ScaleIntensityRanged

    lo, hi = get(window).bounds
    return ScaleIntensityRanged(keys=keys, a_min=lo, a_max=hi, b_min=0.0, b_max=1.0, clip=True)
