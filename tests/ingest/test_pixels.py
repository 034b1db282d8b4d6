"""Stored values to modality values (medload.ingest.pixels), on hand-built headers and raw pixel bytes."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import slice_header
from hypothesis import given, settings
from hypothesis import strategies as st

from medload.errors import InputProblem
from medload.ingest.pixels import LoadedFile, decode_plane

ROWS, COLS = 4, 5


def plane(raw: np.ndarray, **fields):
    """A header for a native little-endian plane whose pixel bytes start at offset 0, and the file."""
    h = slice_header((0, 0, 0))._replace(rows=ROWS, cols=COLS, pixel_offset=0, **fields)
    return h, LoadedFile(raw.astype(raw.dtype.newbyteorder("<")).tobytes())


def test_unsigned_12_bit_in_16_masks_overlay_bits_above_high_bit():
    stored = np.arange(ROWS * COLS, dtype=np.uint16).reshape(ROWS, COLS) * 200
    h, f = plane(stored | 0xF000, bits_stored=12, high_bit=11, pixel_representation=0)  # junk in bits 12-15
    values, _ = decode_plane(f, h, "CT", "int16")
    assert np.array_equal(values, stored.astype(np.int32) - 1024)


def test_values_stored_below_a_high_bit_are_shifted_down():
    stored = np.arange(ROWS * COLS, dtype=np.uint16).reshape(ROWS, COLS) * 100
    h, f = plane(stored << 4, bits_stored=12, high_bit=15, pixel_representation=0)
    values, _ = decode_plane(f, h, "CT", "int16")
    assert np.array_equal(values, stored.astype(np.int32) - 1024)


def test_signed_12_bit_is_sign_extended_from_bit_11():
    hu = np.linspace(-2048, 2047, ROWS * COLS).astype(np.int16).reshape(ROWS, COLS)
    raw = hu.view(np.uint16) & 0x0FFF  # 12-bit two's complement, upper bits zero
    h, f = plane(raw, bits_stored=12, high_bit=11, pixel_representation=1, intercept=0.0)
    values, _ = decode_plane(f, h, "CT", "int16")
    assert np.array_equal(values, hu)


def test_big_endian_bytes_are_swapped():
    stored = np.arange(ROWS * COLS, dtype=np.uint16).reshape(ROWS, COLS) * 150
    h = slice_header((0, 0, 0))._replace(rows=ROWS, cols=COLS, pixel_offset=0, transfer_syntax="1.2.840.10008.1.2.2")
    values, _ = decode_plane(LoadedFile(stored.astype(">u2").tobytes()), h, "CT", "int16")
    assert np.array_equal(values, stored.astype(np.int32) - 1024)


def test_eight_bit_pixels():
    stored = np.arange(ROWS * COLS, dtype=np.uint8).reshape(ROWS, COLS) * 12
    h, f = plane(stored, bits_allocated=8, bits_stored=8, high_bit=7, intercept=-100.0)
    values, _ = decode_plane(f, h, "CT", "int16")
    assert np.array_equal(values, stored.astype(np.int32) - 100)


def test_padding_value_and_range_limit_become_air_and_are_counted():
    stored = np.full((ROWS, COLS), 1500, dtype=np.uint16)
    stored[0, :3] = [0, 5, 10]
    h, f = plane(stored, padding_value=0, padding_limit=5)
    values, count = decode_plane(f, h, "CT", "int16")
    assert count == 2 and list(values[0, :3]) == [-1024, -1024, 10 - 1024]
    h_mr, f_mr = plane(stored, padding_value=0, padding_limit=5, has_rescale=False, slope=1.0, intercept=0.0)
    assert list(decode_plane(f_mr, h_mr, "MR", "int16")[0][0, :3]) == [0, 0, 10]


def test_signed_padding_value_read_as_unsigned_still_matches():
    """GE writes PixelPaddingValue -2000 for signed pixels; an implicit-VR reader may see 63536."""
    stored = np.full((ROWS, COLS), 40, dtype=np.int16)
    stored[1, 1] = -2000
    h, f = plane(stored.view(np.uint16), bits_stored=16, high_bit=15, pixel_representation=1, padding_value=63536)
    values, count = decode_plane(f, h, "CT", "int16")
    assert count == 1 and values[1, 1] == -1024 and values[0, 0] == 40 - 1024


def test_monochrome1_inverts_only_values_without_a_modality_rescale():
    stored = np.arange(ROWS * COLS, dtype=np.uint16).reshape(ROWS, COLS) * 100
    h_mr, f = plane(stored, photometric="MONOCHROME1", has_rescale=False, slope=1.0, intercept=0.0)
    assert np.array_equal(decode_plane(f, h_mr, "MR", "int16")[0], 4095 - stored.astype(np.int32))
    h_ct, f = plane(stored, photometric="MONOCHROME1")
    assert np.array_equal(decode_plane(f, h_ct, "CT", "int16")[0], stored.astype(np.int32) - 1024)


def test_non_integral_rescale_is_float32_and_never_rounded():
    stored = np.arange(ROWS * COLS, dtype=np.uint16).reshape(ROWS, COLS)
    h, f = plane(stored, slope=0.25, intercept=-3.5)
    values, _ = decode_plane(f, h, "PT", "float32")
    assert values.dtype == np.float32 and np.array_equal(values, stored * 0.25 - 3.5)


def test_values_beyond_int16_are_refused_not_wrapped():
    stored = np.full((ROWS, COLS), 60000, dtype=np.uint16)
    h, f = plane(stored, bits_stored=16, high_bit=15, slope=1.0, intercept=0.0)
    with pytest.raises(InputProblem, match="do not fit int16"):
        decode_plane(f, h, "CT", "int16")


@settings(max_examples=80, deadline=None)
@given(bits=st.integers(8, 16), signed=st.booleans(), slope=st.sampled_from([1, 2, 3]),
       intercept=st.integers(-2048, 2048), seed=st.integers(0, 2**16))
def test_int16_fast_path_equals_the_exact_computation(bits, signed, slope, intercept, seed):
    """Whatever path decode_plane takes, int16 results equal stored * slope + intercept computed in int64."""
    rng = np.random.default_rng(seed)
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    stored = rng.integers(lo, hi + 1, (ROWS, COLS))
    raw = (stored & ((1 << bits) - 1)).astype(np.uint16)  # two's complement in `bits`, zero above
    h, f = plane(raw, bits_stored=bits, high_bit=bits - 1, pixel_representation=int(signed),
                 slope=float(slope), intercept=float(intercept))
    exact = stored.astype(np.int64) * slope + intercept
    if exact.min() < -32768 or exact.max() > 32767:
        with pytest.raises(InputProblem):
            decode_plane(f, h, "CT", "int16")
    else:
        values, _ = decode_plane(f, h, "CT", "int16")
        assert values.dtype == np.int16 and np.array_equal(values, exact)
