"""The types the layers of the loader share, below them all (:mod:`medload.data.loader` tells the layers).

:class:`LoaderDataset` is what :func:`~medload.data.make_loader` and
:func:`~medload.data.build.build_loader` need of a dataset: :class:`~medload.data.SliceDataset` and
:class:`~medload.data.SlabDataset` are such datasets; the protocol names what the loader's layers
(:mod:`medload.data.slots`, :mod:`medload.data.buckets`, :mod:`medload.data.readahead`,
:mod:`medload.data.batch_meta`, :mod:`medload.data.autotune`) read of one, so that a type checker can tell
whether another class would do. :class:`LoaderBatch` and :class:`BatchReader` are what the read-ahead and
the profiler's observer see of a batch and of the slot dataset that reads it; :class:`LoaderTuning`, what
``num_workers="auto"`` chose (:mod:`medload.data.autotune`).
"""

from __future__ import annotations

import multiprocessing.context
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from medload.data.index import SampleIndex
    from medload.lineage.record import LineageRecord
    from medload.storage.records import SeriesRecord
    from medload.storage.store import Store

__all__ = ["LoaderDataset", "LoaderBatch", "BatchReader", "LoaderTuning", "StageClock", "Augment", "MPContext"]

#: an augmentation of batches on the device: ``(image, label) -> (image, label)``, as
#: :class:`medload.data.augment.BatchAugment` (whose ``bind`` the loader calls)
Augment = Callable[..., Any]
#: the ``multiprocessing_context`` of the loader's workers, as torch's DataLoader takes it
MPContext = str | multiprocessing.context.BaseContext


class LoaderDataset(Protocol):
    """A map-style dataset of samples of a store that the fast loader reads a batch at a time."""

    @property
    def store(self) -> Store:
        """The store read (its L1 cache budget is shared among the loader's workers)."""
        ...

    @property
    def index(self) -> SampleIndex:
        """Which series and slice each sample is (:mod:`medload.data.index`)."""
        ...

    @property
    def records(self) -> tuple[SeriesRecord, ...]:
        """The series records, in ``index.keys`` order."""
        ...

    @property
    def spatial_dims(self) -> int:
        """Of a sample: 2 (2.5D stacks) or 3 (slabs)."""
        ...

    @property
    def plane(self) -> str | None:
        """The stored (already windowed) uint8 plane read, or None for HU."""
        ...

    @property
    def dtype(self) -> np.dtype:
        """The stored dtype of the image samples."""
        ...

    @property
    def labels(self) -> bool:
        """Whether samples come with a label."""
        ...

    @property
    def label_dtype(self) -> np.dtype | None:
        """The dtype of the label samples; None without labels."""
        ...

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Any]: ...

    def batch_shapes(self, indices: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """Shapes of the image and label arrays of a batch of these samples."""
        ...

    def max_batch_bytes(self, batch_size: int) -> int:
        """Bytes of the largest batch (image and label) the dataset can produce."""
        ...

    def read_batch(self, indices: Sequence[int], image: np.ndarray, label: np.ndarray | None) -> None:
        """Fill ``image`` and ``label`` with the samples ``indices``."""
        ...

    def prefetch(self, indices: Sequence[int]) -> None:
        """Have the disk start reading these samples now, without waiting."""
        ...

    def item_affine(self, i: int) -> np.ndarray:
        """Sample ``i``'s array indices to RAS mm."""
        ...

    def sample_meta(self, i: int) -> dict:
        """What sample ``i``'s MetaTensors carry besides the affine."""
        ...

    def lineage(self, **inputs: Any) -> LineageRecord:
        """The dataset's lineage record (:mod:`medload.lineage`), ``inputs`` added to its inputs."""
        ...


class LoaderBatch(Protocol):
    """The sample indices of one batch, the slot its arrays go into, its number in the epoch and the
    ``(number, indices)`` of the batches its reader reads after it (:class:`medload.data.slots._Batch`)."""

    slot: int
    number: int
    ahead: list[tuple[int, list[int]]]

    def __iter__(self) -> Iterator[int]: ...

    def __len__(self) -> int: ...


class BatchReader(Protocol):
    """A loader's slot dataset (:class:`medload.data.slots._SlotDataset`) as the profiler's observer
    (:mod:`medload.data.read_probe`) drives it: ``control[0]`` set while a profile runs, ``probed`` while
    this process reads through the observer."""

    control: torch.Tensor
    probed: bool

    @property
    def dataset(self) -> LoaderDataset: ...

    def fill(self, batch: Any) -> dict:  # Any: the reader's own LoaderBatch type
        """Read ``batch`` into its slot; the meta dict that crosses to the trainer."""
        ...


class StageClock(Protocol):
    """The profiler's clock of a loader's stages (:class:`medload.data.stage_times.Profile`), which the
    loader marks as each batch goes through it."""

    def mark(self, stage: str | None, meta: dict | None = None) -> None:
        """Charge the time since the previous mark to ``stage``."""
        ...


@dataclass(frozen=True)
class LoaderTuning:
    """What ``num_workers="auto"`` chose (``loader.tuning``), the figures it rests on, and why.

    Examples:
        >>> loader = make_loader(SliceDataset(store), batch_size=8, num_workers="auto", memory_budget="1GB")
        >>> t = loader.tuning; (t.pin_memory, t.memory_bytes <= t.memory_budget)   # no pinning on a CPU
        (False, True)
    """

    num_workers: int
    prefetch_factor: int
    pin_memory: bool
    memory_bytes: int
    memory_budget: int
    read_s: float
    trainer_s: float
    cores: int
    estimated_batches_per_s: float
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)
