"""A training device this machine has, checked when it is asked for rather than at the first batch.

Examples:
    >>> checked_device("cpu")
    device(type='cpu')
    >>> checked_device(f"cuda:{torch.cuda.device_count()}")     # one past the last GPU, or any without one
    Traceback (most recent call last):
    ...
    medload.errors.ConfigError: ...
"""

from __future__ import annotations

import torch

from medload.errors import ConfigError

__all__ = ["checked_device"]


def checked_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; a ConfigError that says what to give where it is not a device
    name, or names a CUDA device this machine does not have (torch would fail at the first batch)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{device!r} is not a torch device: give cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device {str(device)!r}: torch sees no CUDA device here (a CPU build of torch, no "
                              "driver, or CUDA_VISIBLE_DEVICES hides them): give device='cpu', or install a CUDA "
                              "build of torch")
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device {str(device)!r}: this machine has {count} CUDA device(s): give cuda:0 to "
                              f"cuda:{count - 1}")
    return dev
