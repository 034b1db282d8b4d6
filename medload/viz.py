"""Pictures of a store for notebooks and ``medload view``: slices and 2.5D samples in a window, label
overlays, series montages, HU histograms (matplotlib).

Every picture goes through :func:`render`: grey levels are exactly :func:`medload.windows.to_uint8` of
the HU (a PNG from :func:`write_png` has one pixel per voxel and those values), and label classes are
blended over them in colour (class c gets colour c-1 of matplotlib's ``tab10``). The plotting functions
draw on a given matplotlib ``ax`` or make a new figure, and return what they drew on.

Examples:
    >>> from medload import viz
    >>> viz.show_slice(store, key, 14, window="bone", label=True)   # doctest: +SKIP
    >>> viz.montage(store, key, window="brain")                     # doctest: +SKIP
    >>> viz.hu_histogram(store, key)                                # doctest: +SKIP
    >>> viz.write_png(store, key, "slice.png", z=14, window="lung")  # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from medload import windows as win
from medload.errors import ConfigError
from medload.extras import require

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from medload.storage.store import Store

__all__ = ["render", "tile", "write_png", "show_slice", "show_sample", "montage", "hu_histogram"]

_HISTOGRAM_WINDOWS = ("lung", "soft_tissue", "bone")


def _numpy(x) -> np.ndarray:
    """An array from a numpy array or a (CPU or GPU) torch tensor."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    return np.asarray(x)


def _need_matplotlib() -> None:
    require("matplotlib", "viz", "Drawing with medload.viz")


def _class_colour(class_id: int) -> tuple[float, float, float]:
    """The RGB (0..1) of a label class: colour ``class_id - 1`` of matplotlib's ``tab10``, cycling."""
    _need_matplotlib()
    from matplotlib import colormaps

    tab10 = colormaps["tab10"]
    r, g, b, _ = tab10((class_id - 1) % tab10.N)  # an int picks that colour of the list (N = 10)
    return float(r), float(g), float(b)


def render(image, window: str | win.Window | None = "soft_tissue", label=None, *, alpha: float = 0.4) -> np.ndarray:
    """A 2D image as ``(H, W, 3)`` uint8 RGB: grey levels of the window, label classes tinted over them.

    Args:
        image: ``(H, W)`` HU (numpy array or torch tensor).
        window: a preset name, ``"WIDTH/LEVEL"`` or :class:`~medload.windows.Window`; ``None`` when the
            image is already windowed (uint8 0..255, or float 0..1 as batches from ``make_loader``).
        label: ``(H, W)`` class ids (0 = background; floats are rounded), or None.
        alpha: opacity of the label colours.

    Examples:
        >>> render(np.array([[-1000, 40, 1000]]), "soft_tissue")[..., 0]
        array([[  0, 128, 255]], dtype=uint8)
    """
    image = _numpy(image)
    if image.ndim != 2:
        raise ConfigError(f"render takes one (H, W) image, got shape {image.shape}: pick a slice or channel")
    if window is not None:
        grey = win.to_uint8(image, win.get(window))
    elif image.dtype == np.uint8:
        grey = image
    else:
        grey = np.rint(np.clip(image.astype(np.float32), 0.0, 1.0) * 255.0).astype(np.uint8)
    rgb = np.repeat(grey[..., None], 3, axis=2)
    if label is None:
        return rgb
    label = _numpy(label)
    if label.dtype.kind not in "iu":  # a float target or a bool mask: class ids by rounding
        label = np.rint(label).astype(np.int64)
    if label.shape != image.shape:
        raise ConfigError(f"label shape {label.shape} differs from image shape {image.shape}")
    ids = np.unique(label[label > 0])
    if not len(ids):
        return rgb
    out = rgb.astype(np.float32)
    for c in ids.tolist():
        mask = label == c
        out[mask] = (1.0 - alpha) * out[mask] + alpha * 255.0 * np.asarray(_class_colour(c), dtype=np.float32)
    return np.rint(out).astype(np.uint8)


def _slices(store: Store, key: str, zs: list[int], window, label: bool, alpha: float) -> list[np.ndarray]:
    """Rendered slices ``zs`` of a series (one read per slice)."""
    labels = [store.read_label(key, z, z + 1)[0] for z in zs] if label else [None] * len(zs)
    return [render(store.read(key, z, z + 1)[0], window, lab, alpha=alpha) for z, lab in zip(zs, labels)]


def tile(images: list[np.ndarray], columns: int) -> np.ndarray:
    """RGB images of one size in a grid, row by row, ``columns`` wide (empty cells black)."""
    if not images:
        raise ConfigError("nothing to tile: give at least one image")
    h, w = images[0].shape[:2]
    rows = math.ceil(len(images) / columns)
    out = np.zeros((rows * h, min(columns, len(images)) * w, 3), dtype=np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, columns)
        out[r * h : (r + 1) * h, c * w : (c + 1) * w] = img
    return out


def _montage_slices(depth: int, count: int) -> list[int]:
    """At most ``count`` slice indices spread evenly over a series of ``depth`` slices."""
    return np.unique(np.linspace(0, depth - 1, min(count, depth)).round().astype(int)).tolist()


def write_png(store: Store, key: str, out: str | Path, z: int | None = None, *, window="soft_tissue",
              label: bool = False, count: int | None = None, columns: int = 6, alpha: float = 0.4) -> Path:
    """Write slice ``z`` (default: the middle one) of a series as a PNG, one pixel per voxel (what
    ``medload view`` does); with ``count=N``, a montage of N slices spread over the series instead.

    Examples:
        >>> write_png(store, key, "slice.png", z=10, window="lung", label=True)   # doctest: +SKIP
        PosixPath('slice.png')
    """
    _need_matplotlib()
    from matplotlib.image import imsave

    rec = store.record(key)
    if count is not None:
        image = tile(_slices(store, rec.key, _montage_slices(rec.shape[0], count), window, label, alpha), columns)
    else:
        image = _slices(store, rec.key, [rec.shape[0] // 2 if z is None else z], window, label, alpha)[0]
    out = Path(out)
    imsave(out, image)
    return out


def _axes(ax: Axes | None, figsize: tuple[float, float] = (6, 6)) -> Axes:
    if ax is not None:
        return ax
    _need_matplotlib()
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)[1]


def _legend(ax: Axes, store: Store, key: str) -> None:
    _need_matplotlib()
    from matplotlib.patches import Patch

    label = store.labels(key)
    if label is None:
        raise ConfigError(f"series {key[:12]} has no labels: ingest them with `medload ingest ... --labels`")
    classes = label.classes
    ax.legend(handles=[Patch(color=_class_colour(int(c)), label=name) for c, name in classes.items()],
              loc="lower right", fontsize="small")


def _window_title(window) -> str:
    if window is None:
        return "windowed input"
    w = win.get(window)
    return f"{w.name} ({w.width:g}/{w.level:g})"


def show_slice(store: Store, key: str, z: int, window="soft_tissue", *, label: bool = False, alpha: float = 0.4,
               ax: Axes | None = None) -> Axes:
    """Draw slice ``z`` of a series in a window, with its label classes over it (``label=True``),
    at the voxels' true aspect ratio.

    Examples:
        >>> show_slice(store, key, 14, window="lung", label=True)   # doctest: +SKIP
        <Axes: title={'center': '3f2a9c01d4e7 z=14 lung (1500/-600)'}>
    """
    rec = store.record(key)
    ax = _axes(ax)
    ax.imshow(_slices(store, rec.key, [z], window, label, alpha)[0], aspect=rec.spacing[1] / rec.spacing[0],
              interpolation="nearest")
    ax.set_title(f"{rec.key[:12]} z={z} {_window_title(window)}")
    ax.set_axis_off()
    if label:
        _legend(ax, store, rec.key)
    return ax


def show_sample(sample: Mapping, window="soft_tissue", *, alpha: float = 0.4, axes=None) -> Figure:
    """Draw a dataset sample, one panel per channel: a 2.5D stack ``(2k+1, H, W)`` (its label, the
    centre slice's, over the centre panel) or a 3D slab ``(1, D, H, W)`` (one panel per slice).

    ``sample`` is a :class:`~medload.SliceDataset`/:class:`~medload.SlabDataset` item, or any mapping
    with ``"image"`` (and ``"label"``), e.g. one sample of a batch with ``window=None``.

    Examples:
        >>> show_sample(SliceDataset(store, context=2)[14], window="bone")   # doctest: +SKIP
        >>> show_sample({"image": batch["image"][0], "label": batch["label"][0]}, window=None)  # doctest: +SKIP
    """
    image = _numpy(sample["image"])
    slab = image.ndim == 4
    image = image[0] if slab else image
    if image.ndim != 3:
        raise ConfigError(f"a sample image is (C, H, W) or (1, D, H, W), got shape {image.shape}")
    n, centre = image.shape[0], image.shape[0] // 2
    labels = [None] * n
    if sample.get("label") is not None:
        label = _numpy(sample["label"])
        label = label[0] if label.ndim == 4 else label
        if label.shape[0] == n:
            labels = list(label)
        elif label.shape[0] == 1:
            labels[centre] = label[0]
        else:
            raise ConfigError(f"label has {label.shape[0]} slices for an image of {n}: give (1, H, W) or ({n}, H, W)")
    if axes is None:
        _need_matplotlib()
        import matplotlib.pyplot as plt

        axes = plt.subplots(1, n, figsize=(3 * n, 3.2), squeeze=False)[1][0]
    for c, ax in enumerate(axes):
        ax.imshow(render(image[c], window, labels[c], alpha=alpha), interpolation="nearest")
        title = f"+{c}" if slab else "centre" if c == centre else f"{c - centre:+d}"
        ax.set_title(title, fontsize="small")
        ax.set_axis_off()
    where = f"{sample['key'][:12]} z={sample['z']} " if "key" in sample and "z" in sample else ""
    axes[0].figure.suptitle(f"{where}{_window_title(window)}")
    return axes[0].figure


def montage(store: Store, key: str, window="soft_tissue", *, count: int = 16, columns: int = 4,
            label: bool = False, alpha: float = 0.4, ax: Axes | None = None) -> Axes:
    """Draw ``count`` slices spread evenly over a series in a grid, each marked with its index.

    Examples:
        >>> montage(store, key, window="brain", count=12, columns=4)   # doctest: +SKIP
    """
    rec = store.record(key)
    zs = _montage_slices(rec.shape[0], count)
    grid = tile(_slices(store, rec.key, zs, window, label, alpha), columns)
    ax = _axes(ax, (2.5 * min(columns, len(zs)), 2.5 * math.ceil(len(zs) / columns)))
    ax.imshow(grid, aspect=rec.spacing[1] / rec.spacing[0], interpolation="antialiased")
    h, w = rec.shape[1:]
    for i, z in enumerate(zs):
        r, c = divmod(i, columns)
        ax.text(c * w + 0.03 * w, r * h + 0.03 * h, f"z={z}", color="yellow", fontsize="small", va="top")
    ax.set_title(f"{rec.key[:12]}: {len(zs)} of {rec.shape[0]} slices, {_window_title(window)}")
    ax.set_axis_off()
    if label:
        _legend(ax, store, rec.key)
    return ax


def hu_histogram(store: Store, key: str, *, bins: int = 256, hu_range: tuple[float, float] = (-1100.0, 2000.0),
                 windows=_HISTOGRAM_WINDOWS, max_slices: int = 64, ax: Axes | None = None) -> Axes:
    """Draw the HU histogram of a series (log counts; at most ``max_slices`` slices spread over it), with
    the ranges of ``windows`` shaded.

    Examples:
        >>> hu_histogram(store, key, windows=("brain", "bone"))   # doctest: +SKIP
    """
    rec = store.record(key)
    zs = _montage_slices(rec.shape[0], max_slices)
    counts = np.zeros(bins, dtype=np.int64)
    for z in zs:
        counts += np.histogram(store.read(rec.key, z, z + 1), bins=bins, range=hu_range)[0]
    edges = np.linspace(*hu_range, bins + 1)
    ax = _axes(ax, (8, 4))
    ax.stairs(counts, edges, fill=True, color="0.3")
    ax.set_yscale("log")
    for i, name in enumerate(windows):
        lo, hi = win.stored(name).bounds
        ax.axvspan(lo, hi, color=_class_colour(i + 1), alpha=0.15, label=_window_title(name))
    ax.set_xlim(*hu_range)
    ax.set_xlabel("HU")
    ax.set_ylabel("voxels")
    ax.set_title(f"{rec.key[:12]}: HU of {len(zs)} of {rec.shape[0]} slices")
    if windows:
        ax.legend(loc="upper right", fontsize="small")
    return ax
