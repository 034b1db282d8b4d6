"""Test-only: a pydicom decoder plugin for HTJ2K that crashes, hangs or is killed on demand.

No real file makes a maintained decoder segfault or hang on purpose, so the isolation of decoding is
tested through pydicom's own plugin mechanism, outside medload: :func:`install` (called in the
``medload`` process the test starts, before its workers fork) makes HTJ2K frames decode through
:func:`_decode_frame`, which acts on a marker in the frame (:func:`fault_frame`). medload's code path
is the production one, up to the decoder call.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

from pydicom.pixels import get_decoder
from pydicom.uid import HTJ2K

__all__ = ["FAULTS", "install", "fault_frame"]

#: marker -> what the decoder does
FAULTS = {"segv": "reads address 0 (SIGSEGV)", "abort": "calls abort() (SIGABRT)",
          "kill": "is SIGKILLed, as by the OOM killer", "hang": "sleeps for an hour"}
DECODER_DEPENDENCIES = {HTJ2K: ()}
_MARKER = b"medload-fault:"


def is_available(uid: str) -> bool:
    return uid == HTJ2K


def fault_frame(codestream: bytes, fault: str) -> bytes:
    """A valid JPEG 2000 codestream header followed by the marker of ``fault``."""
    return codestream + _MARKER + fault.encode()


def _decode_frame(src: bytes, runner) -> bytearray:
    fault = src[src.find(_MARKER) + len(_MARKER):].rstrip(b"\x00").decode() if _MARKER in src else ""  # even-length pad
    if fault == "segv":
        ctypes.string_at(0)
    elif fault == "abort":
        os.abort()
    elif fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "hang":
        time.sleep(3600)
    raise ValueError("not a fault frame")


def install() -> None:
    """Route HTJ2K decoding in this process (and processes forked from it) through :func:`_decode_frame`."""
    decoder = get_decoder(HTJ2K)
    for label in decoder.available_plugins:
        decoder.remove_plugin(label)
    decoder.add_plugin("medload-faults", ("helpers.decoder_faults", "_decode_frame"))
