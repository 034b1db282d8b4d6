"""The ingest scaling curve (issue 32): which worker counts a machine measures, each point read from its rows
(a failed row leaves a gap, never a number), and the plot panel drawing exactly those points."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from medload.bench.ingest_scaling import (
    PINNED,
    medload_row,
    plot_ingest_scaling,
    pydicom_row,
    scaling_curve,
    scaling_table,
    worker_counts,
)


def test_worker_counts_are_powers_of_two_up_to_every_core():
    assert worker_counts(1) == [1]
    assert worker_counts(2) == [1, 2]
    assert worker_counts(6) == [1, 2, 4, 6]
    assert worker_counts(16) == [1, 2, 4, 8, 16]
    assert worker_counts(64) == [1, 2, 4, 8, 16, 32, 64]


def rows(rates: dict[str, float | None]) -> list[dict]:
    return [{"contender": name, "status": "ok", "files_per_s": rate, "cores_busy": 1.0,
             "ingest_process_files_per_cpu_s": 20_000.0} if rate else {"contender": name, "status": "failed"}
            for name, rate in rates.items()]


@pytest.fixture
def section():
    measured = rows({pydicom_row(1): 500.0, pydicom_row(2): 950.0, pydicom_row(4): 1800.0,
                     medload_row(1): 800.0, PINNED: 600.0, medload_row(2): 1200.0, medload_row(4): None})
    return {"files": 2048, "cores": 4, "scaling": scaling_curve(measured, worker_counts(4))}


def test_each_point_is_read_from_its_rows_and_a_failed_row_leaves_a_gap(section):
    one, two, four = section["scaling"]
    assert one["medload_x_1"] == 1.0 and one["medload_x_pinned"] == pytest.approx(800 / 600)
    assert two["medload_x_1"] == pytest.approx(1.5) and two["medload_x_pinned"] == pytest.approx(2.0)
    assert two["pydicom_x_1"] == pytest.approx(1.9) and two["medload_x_pydicom"] == pytest.approx(1200 / 950)
    assert four["medload_files_per_s"] is None and four["medload_x_1"] is None and four["medload_x_pydicom"] is None
    assert four["pydicom_x_1"] == pytest.approx(3.6)
    table = scaling_table(section)
    assert table.rows[1][:4] == ["2", "1200", "1.50", "2.00"] and table.rows[2][1:3] == ["-", "-"]


def test_the_plot_draws_the_measured_points_and_one_pinned_core_per_worker(section):
    fig, ax = plt.subplots()
    plot_ingest_scaling(section, ax)
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    plt.close(fig)
    assert lines["medload ingest"] == ([1, 2], [800.0, 1200.0])  # the failed 4-worker row is not drawn
    assert lines["pydicom read+decode"] == ([1, 2, 4], [500.0, 950.0, 1800.0])
    assert lines["one pinned core per worker"] == ([1, 2, 4], [pytest.approx(600.0), pytest.approx(1200.0),
                                                               pytest.approx(2400.0)])


def test_series_written_in_parallel_are_the_files_written_one_by_one(tmp_path):
    from conftest import file_hashes

    from medload.bench.ingest_data import make_data
    from medload.bench.loading_data import make_synthetic, write_synthetic

    write_synthetic(tmp_path / "parallel", series=3, slices=2, rows=32, cols=32, seed=7)
    make_synthetic(tmp_path / "serial", series=3, slices=2, rows=32, cols=32, seed=7)
    written = file_hashes(tmp_path / "parallel")
    assert len(written) == 6 and written == file_hashes(tmp_path / "serial")
    mixed = make_data(tmp_path / "mixed", series=2, slices=2)  # an axial and an oblique series, 512 x 512
    assert len(list(mixed.iterdir())) == 4
