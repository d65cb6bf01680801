"""The benchmark datasets are written once and reused while their layout matches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr

from benchmarks.datasets import SUITES, DatasetSpec, ensure_dataset


def test_a_renamed_spec_reuses_the_folder_written_for_its_layout(tmp_path: Path) -> None:
    first, written = ensure_dataset(DatasetSpec("old-name", 8, 4, 6, 2, 4), tmp_path)
    assert written
    before = zarr.open_group(first, mode="r")["z"][...]
    again, written = ensure_dataset(DatasetSpec("new-name", 8, 4, 6, 2, 4), tmp_path)
    assert again == first and not written
    np.testing.assert_array_equal(zarr.open_group(again, mode="r")["z"][...], before)


def test_the_full_suite_starts_with_the_reference_shape() -> None:
    ref = SUITES["full"][0]
    assert ref.name == "reference"
    assert (ref.n_time, ref.n_lat, ref.n_lon, ref.n_level) == (2048, 181, 360, 4)
    assert ref.samples_per_chunk == 16 and ref.compressor == "zstd"
    assert ref.folder == "era5_t2048_181x360_l4_spc16_zstd.zarr"


def test_the_report_overhead_benchmark_times_the_hooks_the_pipeline_calls() -> None:
    # benchmarks/report_overhead.hook_cost called hooks the recorder no longer has
    # (on_decode_submit, timed, on_decode_end, on_admit) and failed at once; it times the
    # current ones, and the hand-over counts each batch
    from benchmarks.report_overhead import hook_cost

    cost = hook_cost(50)
    assert 0 < cost["per_object_s"] < 1e-3 and 0 < cost["per_batch_s"] < 1e-2
