"""The version stamp of every training-input state (loaders, samplers, augmentation, data modules).

A state is a small dict of seeds and counters (never index lists) that restores its object mid-epoch
(:mod:`medload.data.loader_state`). Each carries ``version``; a state saved by a newer medload, in a
version this one does not read, is refused with an error that says so, rather than misread.

Examples:
    >>> state = stamp({"sampler": "UniformSampler", "seed": 0, "epoch": 2, "position": 40})
    >>> checked(state, "sampler", "UniformSampler")["epoch"]
    2
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from medload.errors import ConfigError

__all__ = ["STATE_VERSION", "stamp", "checked"]

#: the version of the states this medload writes (and the newest it reads)
STATE_VERSION = 1


def stamp(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with this medload's ``version``."""
    return {"version": STATE_VERSION, **state}


def checked(state: Mapping[str, Any], kind: str, name: str) -> dict[str, Any]:
    """``state`` as a dict once its version is one this medload reads and its ``kind`` entry is ``name``
    (a state of another kind of object would restore nonsense); a ConfigError saying what to do otherwise."""
    if not isinstance(state, Mapping) or "version" not in state:
        raise ConfigError(f"not a medload state (no 'version'): pass what {name}.state_dict() returned")
    version = state["version"]
    if not isinstance(version, int) or version < 1:
        raise ConfigError(f"state version {version!r} is not one medload writes: pass what {name}.state_dict() returned")
    if version > STATE_VERSION:
        raise ConfigError(f"this state was saved by a newer medload (state version {version}; this one reads up to "
                          f"{STATE_VERSION}): upgrade medload to resume from it")
    if state.get(kind) != name:
        raise ConfigError(f"the state is of a {kind} {state.get(kind)!r}, not of a {name}: restore each object from "
                          "its own state")
    return dict(state)
