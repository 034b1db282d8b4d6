"""Unit tests of medload.ingest.geometry.plan_geometry on hand-built SliceHeaders (no files)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from conftest import AXIAL
from conftest import slice_header as header
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medload.config import IngestConfig
from medload.errors import InputProblem
from medload.ingest.discover import SourceRef
from medload.ingest.geometry import LPS_TO_RAS, plan_geometry
from medload.ingest.headers import SliceHeader


def normal_of(orientation) -> np.ndarray:
    o = np.asarray(orientation, dtype=float)
    return np.cross(o[:3], o[3:])


def stack(offsets, orientation=AXIAL, origin=(-100.0, -80.0, 50.0), shear=None, **kwargs) -> list[SliceHeader]:
    """Headers at ``origin + offset * normal (+ offset * shear)``; names and instances run against the order."""
    n = normal_of(orientation)
    out = []
    for k, off in enumerate(offsets):
        pos = np.asarray(origin) + off * n + (0 if shear is None else off * np.asarray(shear))
        # names and instance pseudonyms sort in the *reverse* order of the positions
        out.append(header(pos, orientation, name=f"IM{len(offsets) - k:04d}.dcm",
                          instance=f"1.2.{len(offsets) - k:04d}", **kwargs))
    return out


def permuted(headers: list[SliceHeader], seed: int) -> list[SliceHeader]:
    rng = np.random.default_rng(seed)
    return [headers[i] for i in rng.permutation(len(headers))]


def reason_of(headers, cfg=IngestConfig()) -> str:
    with pytest.raises(InputProblem) as info:
        plan_geometry(headers, cfg)
    assert info.value.stage == "geometry"
    return info.value.reason


def oblique_orientation() -> tuple[float, ...]:
    a, b = math.radians(20.0), math.radians(-25.0)
    rx = np.array([[1, 0, 0], [0, math.cos(a), -math.sin(a)], [0, math.sin(a), math.cos(a)]])
    rz = np.array([[math.cos(b), -math.sin(b), 0], [math.sin(b), math.cos(b), 0], [0, 0, 1]])
    rot = rz @ rx
    return tuple(np.concatenate([rot[:, 0], rot[:, 1]]))


def assert_affine_reproduces(geom, headers_in_order) -> None:
    for k, h in enumerate(headers_in_order):
        np.testing.assert_allclose((geom.affine_lps @ [0, 0, k, 1])[:3], h.position, atol=1e-6)
        np.testing.assert_allclose((geom.affine_ras @ [0, 0, k, 1])[:3], (LPS_TO_RAS[:3, :3] @ h.position), atol=1e-6)


# ---- ordering and spacing ------------------------------------------------------------------------
@pytest.mark.parametrize("orientation", [AXIAL, oblique_orientation()], ids=["axial", "oblique"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_order_is_by_projection_on_the_normal(orientation, seed: int) -> None:
    ordered = stack(np.arange(9) * 2.5, orientation)
    geom = plan_geometry(permuted(ordered, seed), IngestConfig())
    assert [s[0] for s in geom.slots] == ordered  # not by name nor by instance, which run backwards
    assert all(len(s) == 1 for s in geom.slots)
    np.testing.assert_allclose(geom.positions, [h.position for h in ordered])
    assert geom.spacing == pytest.approx((0.8, 0.7, 2.5))
    assert geom.flags == []
    assert_affine_reproduces(geom, ordered)
    o = np.asarray(orientation)
    np.testing.assert_allclose(geom.affine_lps[:3, 0], o[:3] * 0.8)  # column index runs along the row cosine
    np.testing.assert_allclose(geom.affine_lps[:3, 1], o[3:] * 0.7)  # row index along the column cosine


def test_instance_and_name_never_order_slices() -> None:
    """Names and instances agree with each other but not with the positions: positions win."""
    ordered = stack(np.arange(6) * 3.0)
    scrambled = [h._replace(instance=f"9.{i}", ref=SourceRef(f"/data/{i:02d}.dcm", None, 1000))
                 for i, h in zip([3, 0, 5, 1, 4, 2], ordered)]
    geom = plan_geometry(sorted(scrambled, key=lambda h: h.instance), IngestConfig())
    assert [s[0].position for s in geom.slots] == [h.position for h in ordered]


def test_spacing_comes_from_positions_not_thickness() -> None:
    headers = stack(np.arange(7) * 2.5, slice_thickness=5.0, spacing_between_slices=7.0)
    geom = plan_geometry(headers, IngestConfig())
    assert geom.spacing[2] == pytest.approx(2.5)
    np.testing.assert_allclose(geom.affine_lps[:3, 2], [0, 0, 2.5])


def test_left_handed_orientation_orders_along_its_own_normal() -> None:
    orientation = (1.0, 0.0, 0.0, 0.0, -1.0, 0.0)  # normal = row x col = (0, 0, -1)
    np.testing.assert_allclose(normal_of(orientation), [0, 0, -1])
    ordered = stack(np.arange(8) * 2.0, orientation, origin=(0.0, 0.0, 40.0))  # z = 40, 38, ..., 26
    geom = plan_geometry(permuted(ordered, 7), IngestConfig())
    assert [s[0] for s in geom.slots] == ordered
    assert [h.position[2] for h in ordered] == sorted((h.position[2] for h in ordered), reverse=True)
    assert geom.spacing[2] == pytest.approx(2.0)
    step = np.subtract(ordered[1].position, ordered[0].position)
    np.testing.assert_allclose(geom.affine_lps[:3, 2], step)
    np.testing.assert_allclose(geom.affine_lps[:3, 2], [0, 0, -2.0])
    assert_affine_reproduces(geom, ordered)


# ---- gaps and irregular spacing ----------------------------------------------------------------
def test_gap_reason() -> None:
    reason = reason_of(permuted(stack([0, 2.5, 5.0, 7.5, 12.5, 15.0, 17.5]), 3))
    assert reason.startswith("irregular spacing (gap)")
    assert "1 slice(s) missing" in reason
    assert "5.000 mm" in reason  # the gap itself


def test_two_missing_slices_are_counted() -> None:
    reason = reason_of(stack([0, 2.5, 5.0, 12.5, 15.0, 17.5, 20.0]))
    assert "(gap)" in reason and "2 slice(s) missing" in reason


def test_irregular_spacing_reason() -> None:
    reason = reason_of(stack([0, 2.5, 5.5, 7.5]))
    assert reason.startswith("irregular spacing:")
    assert "(gap)" not in reason and "missing" not in reason
    assert "2.000" in reason and "3.000" in reason


def test_in_plane_jitter_of_one_slice_is_rejected() -> None:
    headers = stack(np.arange(8) * 2.5)
    moved = np.add(headers[3].position, [0.0, 1.0, 0.0])  # 1 mm along the column cosine, same depth
    headers[3] = headers[3]._replace(position=tuple(moved))
    reason = reason_of(permuted(headers, 4))
    assert "slice 3" in reason and "in-plane" in reason


# ---- gantry tilt ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tilt_deg", [5.0, 15.0, -22.5])
def test_tilt_detected_from_positions(tilt_deg: float) -> None:
    col_cos = np.array(AXIAL[3:])
    headers = stack(np.arange(10) * 2.5, shear=math.tan(math.radians(tilt_deg)) * col_cos)
    reason = reason_of(headers, IngestConfig(tilt_policy="reject"))
    assert "gantry tilt" in reason
    assert f"{abs(tilt_deg):.2f} degrees" in reason

    geom = plan_geometry(permuted(headers, 5), IngestConfig(tilt_policy="shear"))
    (flag,) = [f for f in geom.flags if f.startswith("sheared_")]
    angle = float(re.fullmatch(r"sheared_([0-9.]+)deg", flag).group(1))
    assert angle == pytest.approx(abs(tilt_deg), abs=0.01)
    assert geom.spacing[2] == pytest.approx(2.5)  # along the normal
    assert_affine_reproduces(geom, headers)


def test_tilt_tag_alone_is_not_tilt() -> None:
    """GantryDetectorTilt is not read: an unsheared stack passes whatever the scanner wrote."""
    geom = plan_geometry(stack(np.arange(5) * 2.5), IngestConfig(tilt_policy="reject"))
    assert not any(f.startswith("sheared") for f in geom.flags)


# ---- duplicates ----------------------------------------------------------------------------------
def test_duplicates_at_one_position_share_a_slot() -> None:
    headers = stack(np.arange(5) * 2.5)
    twin = headers[2]._replace(instance="1.2.9999", ref=SourceRef("/data/copy.dcm", None, 1000))
    geom = plan_geometry(permuted(headers + [twin], 1), IngestConfig())
    assert len(geom.slots) == 5
    assert sorted(len(s) for s in geom.slots) == [1, 1, 1, 1, 2]
    assert {h.instance for h in geom.slots[2]} == {headers[2].instance, "1.2.9999"}
    assert "duplicates_collapsed" in geom.flags


def test_duplicates_far_apart_in_plane_are_rejected() -> None:
    headers = stack(np.arange(5) * 2.5)
    other = headers[2]._replace(instance="1.2.9999", position=tuple(np.add(headers[2].position, [5.0, 0.0, 0.0])))
    reason = reason_of(headers + [other])
    assert "overlapping stacks" in reason and "5.00 mm apart" in reason


# ---- tolerances come from IngestConfig ---------------------------------------------------------
def test_wobble_within_default_tolerance_passes_and_fails_when_tightened() -> None:
    headers = stack(np.arange(8) * 2.5)
    n = normal_of(AXIAL)
    headers[4] = headers[4]._replace(position=tuple(np.add(headers[4].position, 0.05 * n)))
    geom = plan_geometry(headers, IngestConfig())  # default 0.1 mm (or 1 % of 2.5 mm)
    assert len(geom.slots) == 8

    reason = reason_of(headers, IngestConfig(spacing_tolerance_mm=0.01))  # max(0.01, 1 % of 2.5) = 0.025 mm
    assert reason.startswith("irregular spacing")
    assert "0.025 mm" in reason
    # the relative tolerance counts too: 5 % of 2.5 mm admits the wobble again
    assert len(plan_geometry(headers, IngestConfig(spacing_tolerance_mm=0.01, spacing_tolerance_rel=0.05)).slots) == 8


def test_in_plane_wobble_tolerance_is_configurable() -> None:
    headers = stack(np.arange(8) * 2.5)
    headers[5] = headers[5]._replace(position=tuple(np.add(headers[5].position, [0.05, 0.0, 0.0])))
    plan_geometry(headers, IngestConfig())
    reason = reason_of(headers, IngestConfig(spacing_tolerance_mm=0.01, spacing_tolerance_rel=0.001))
    assert "slice 5" in reason and "in-plane" in reason


def test_duplicate_tolerance_is_configurable() -> None:
    headers = stack(np.arange(5) * 2.5)
    near = headers[2]._replace(instance="1.2.9999", position=tuple(np.add(headers[2].position, [0.0, 0.0, 0.005])))
    geom = plan_geometry(headers + [near], IngestConfig())  # default 0.01 mm: the same position
    assert len(geom.slots) == 5 and "duplicates_collapsed" in geom.flags
    reason = reason_of(headers + [near], IngestConfig(duplicate_tolerance_mm=0.001))
    assert reason.startswith("irregular spacing")


# ---- a single slice ------------------------------------------------------------------------------
def test_single_slice_spacing_from_thickness() -> None:
    geom = plan_geometry([header((1.0, 2.0, 3.0), slice_thickness=3.0)], IngestConfig())
    assert geom.spacing[2] == 3.0
    assert "single_slice" in geom.flags and "z_spacing_from_slice_thickness" in geom.flags
    np.testing.assert_allclose(geom.affine_lps[:3, 2], [0, 0, 3.0])
    np.testing.assert_allclose(geom.affine_lps[:3, 3], [1.0, 2.0, 3.0])


# ---- property: any rotation, spacing, count and permutation --------------------------------------
@st.composite
def geometries(draw):
    q = np.array([draw(st.floats(-1, 1, allow_nan=False)) for _ in range(4)])
    if np.linalg.norm(q) < 0.1:
        q = np.array([1.0, 0.0, 0.0, 0.0])
    w, x, y, z = q / np.linalg.norm(q)
    rot = np.array([
        [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
        [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
        [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
    ])
    spacing = draw(st.floats(0.3, 10.0, allow_nan=False))
    count = draw(st.integers(2, 40))
    origin = [draw(st.floats(-500, 500, allow_nan=False)) for _ in range(3)]
    perm = draw(st.permutations(range(count)))
    return rot, spacing, count, np.array(origin), perm


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries())
def test_property_any_rotation_spacing_count_permutation(params) -> None:
    rot, spacing, count, origin, perm = params
    orientation = tuple(np.concatenate([rot[:, 0], rot[:, 1]]))
    ordered = stack(np.arange(count) * spacing, orientation, origin=tuple(origin))
    geom = plan_geometry([ordered[i] for i in perm], IngestConfig())
    assert [s[0] for s in geom.slots] == ordered
    assert geom.spacing[2] == pytest.approx(spacing, rel=1e-9)
    assert geom.flags == []
    assert_affine_reproduces(geom, ordered)


def test_a_gap_in_a_short_stack_is_named_as_a_gap():
    """0, 2.5, 7.5 mm: the median step (3.75) fits nothing; the smallest step shows one missing slice."""
    reason = reason_of(stack([0.0, 2.5, 7.5]))
    assert "(gap): 1 slice(s) missing" in reason and "spacing is 2.500 mm" in reason
