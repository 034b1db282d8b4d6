"""Tensors that a loader's worker processes write and the trainer reads: where their memory comes from.

``Tensor.share_memory_()`` puts a tensor in a file of ``/dev/shm``. A container's ``/dev/shm`` is 64 MB
unless it is given more (Docker's and Kubernetes' default), while the fast loader's slots hold
``num_workers * prefetch_factor + 1`` batches (:mod:`medload.data.slots`): 63 MB for 2 workers of 2.5D
batches of 8 x 3 x 512 x 512 int16, 113 MB for 4. torch then fails as the loader is made ("unable to
allocate shared memory(shm) ... No space left on device").

Workers started by ``fork`` (Linux's default up to Python 3.13) inherit the trainer's memory: an anonymous
shared mapping (``mmap`` with ``MAP_SHARED | MAP_ANONYMOUS``) made before they start is the same pages in
every process, and no mount's size bounds it (it counts against the machine's or the cgroup's memory, as
``/dev/shm`` does). Workers started by ``spawn`` or ``forkserver`` receive the tensor pickled, which takes
torch's ``/dev/shm`` file: for them the free space is checked first, and a shortage is a
:class:`~medload.errors.ConfigError` that gives the figures and what to change.

The patch loader's workers hand over each batch as new tensors, which torch puts in ``/dev/shm`` files
whatever the start method, and a worker that cannot send a batch does not fail the loader: torch waits
for it for ever. :func:`batches_in_flight_fit` checks the batches in flight before the loader is made;
where they do not fit, the workers send arrays through their pipes instead.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
from math import prod

import torch

from medload.config import format_size
from medload.errors import ConfigError

__all__ = ["batches_in_flight_fit", "shared_empty", "start_method"]

log = logging.getLogger(__name__)

_SHM = "/dev/shm"


def start_method(context: str | multiprocessing.context.BaseContext | None) -> str:
    """How a DataLoader given ``multiprocessing_context=context`` starts its workers (None: this
    interpreter's default, as torch's DataLoader takes it)."""
    if isinstance(context, str):
        return context
    return (context or multiprocessing.get_context()).get_start_method()


def shared_empty(shape: tuple[int, ...], dtype: torch.dtype,
                 context: str | multiprocessing.context.BaseContext | None) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` that workers started with ``context`` write and this process
    reads: an anonymous shared mapping for forked workers, a ``/dev/shm`` file otherwise (module docstring).
    Page-aligned either way (``cudaHostRegister`` needs it)."""
    nbytes = prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if start_method(context) == "fork":
        region = mmap.mmap(-1, nbytes)  # MAP_SHARED | MAP_ANONYMOUS; the tensor keeps it alive
        return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    _check_room(nbytes, start_method(context))
    return torch.empty(shape, dtype=dtype).share_memory_()


def batches_in_flight_fit(batch_bytes: int, batches: int) -> bool:
    """Whether ``batches`` batches of ``batch_bytes`` that workers hand over as tensors (torch puts each in
    a new ``/dev/shm`` file: the patch loader's) fit in ``/dev/shm``. A worker that cannot send a batch
    does not fail: torch's DataLoader waits for it for ever. Where they do not fit, a warning with the
    figures and the fix: the caller then sends arrays through the workers' pipes instead."""
    free = _shm_free()
    need = batch_bytes * batches
    if free is None or need <= free:
        return True
    log.warning("the loader's workers hand each batch to the trainer through %s: %d batches of about %s in "
                "flight want %s, and %s has %s free (a container's is 64 MiB unless it is given more), so they "
                "go through pipes instead, which costs the trainer a copy of each; give it more (docker run "
                "--shm-size=2g, or a memory-backed emptyDir on /dev/shm in Kubernetes)", _SHM, batches,
                format_size(batch_bytes), format_size(need), _SHM, format_size(free))
    return False


def _shm_free() -> int | None:
    try:
        info = os.statvfs(_SHM)
    except OSError:
        return None  # no /dev/shm (not Linux): torch shares memory its own way there
    return info.f_bavail * info.f_frsize


def _check_room(nbytes: int, method: str) -> None:
    free = _shm_free()
    if free is not None and nbytes > free:
        raise ConfigError(
            f"the loader's buffers take {format_size(nbytes)} of shared memory, and {_SHM} has {format_size(free)} "
            f"free ({method}-started workers receive them through it): give the container more (docker run "
            "--shm-size=2g, or a memory-backed emptyDir on /dev/shm in Kubernetes), or use fewer num_workers, a "
            "smaller batch_size or prefetch_factor, or multiprocessing_context='fork', whose workers need none")
