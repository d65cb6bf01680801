"""A store that does not hold what the pipeline was told it holds, or holds it corrupt.

Wrong prefix, missing bucket, geometries read from another store: the pipeline raises at
construction, naming the array and the store (before, every chunk read as missing, i.e. as the
fill value: all-NaN batches and no error). A metadata document that is not valid zarr metadata
raises naming the document and its array, not a bare ``JSONDecodeError``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zarr
from helpers import write_era5, write_microscopy

from insitubatch_nodes import insitu_pipeline, open_geometries, open_store, split_by_chunk
from insitubatch_nodes.errors import ArrayNotFoundError, CorruptMetadataError, InSituError


@pytest.fixture(scope="module")
def era5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_era5(tmp_path_factory.mktemp("contents") / "era5.zarr", n_time=32)


def _pipeline(store: Any, geoms: dict[str, Any]) -> Any:
    views = {"x": geoms["t2m"], "y": geoms["t2m"].shift(1)}
    return insitu_pipeline(store, split_by_chunk(geoms["t2m"]), views, batch_size=4)


# ---------------------------------------------------------------------------------------------
# Nothing at the given location
# ---------------------------------------------------------------------------------------------


def test_geometries_from_another_store_raise_at_construction_naming_array_and_store(
    era5: Path, tmp_path: Path
) -> None:
    other = write_microscopy(tmp_path / "micro.zarr")  # a zarr group without t2m
    geoms = open_geometries(era5)
    with pytest.raises(FileNotFoundError) as info:
        _pipeline(other, geoms)
    message = str(info.value)
    assert "'t2m'" in message and str(other) in message
    assert "t2m/zarr.json" in message
    # and what is there instead
    assert "arrays there:" in message and repr(sorted(open_geometries(other))[0]) in message


def test_a_local_prefix_one_level_up_raises_naming_the_store_and_the_paths_that_exist(
    era5: Path,
) -> None:
    parent = era5.parent  # an existing folder, but the group is one level down
    geoms = open_geometries(era5)
    with pytest.raises(FileNotFoundError) as info:
        _pipeline(parent, geoms)
    assert "'t2m'" in str(info.value) and str(parent) in str(info.value)
    assert "'era5.zarr/t2m'" in str(info.value)  # the same array, one folder down
    # naming the array: what was looked for, where, and the paths zarr opens there instead
    with pytest.raises(KeyError) as key_info:
        open_geometries(parent, ["t2m"])
    message = str(key_info.value)
    assert "'t2m/zarr.json'" in message and str(parent) in message
    assert "'era5.zarr/t2m'" in message
    # zarr opens the arrays there by their longer path, and so does open_geometries
    assert "era5.zarr/t2m" in open_geometries(parent)
    assert zarr.open_array(parent, path="era5.zarr/t2m", mode="r").shape == geoms["t2m"].shape


def test_a_missing_array_is_one_exception_type_caught_as_keyerror_and_filenotfounderror(
    era5: Path, tmp_path: Path
) -> None:
    other = write_microscopy(tmp_path / "micro.zarr")
    (tmp_path / "empty").mkdir()
    raisers = [
        lambda: open_geometries(era5, ["t2m_typo"]),  # a name the store does not hold
        lambda: open_geometries(era5, sample_axis={"t2m_typo": 0}),
        lambda: open_geometries(tmp_path / "empty"),  # a store that holds no array at all
        lambda: _pipeline(other, open_geometries(era5)),  # geometries of another store
    ]
    for raiser in raisers:
        for caught in (KeyError, FileNotFoundError, InSituError):
            with pytest.raises(caught) as info:
                raiser()
            assert isinstance(info.value, ArrayNotFoundError)
            assert not str(info.value).startswith(("'", '"'))  # the message, not KeyError's repr


def test_a_folder_that_holds_no_zarr_metadata_raises_naming_the_store(tmp_path: Path) -> None:
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("not zarr")
    with pytest.raises(FileNotFoundError) as info:
        open_geometries(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(info.value) and "prefix" in str(info.value)
    with pytest.raises(FileNotFoundError) as info:
        open_geometries(tmp_path / "empty", ["t2m"])
    message = str(info.value)
    assert str(tmp_path / "empty") in message and "'t2m/zarr.json'" in message


def test_an_array_with_another_layout_at_the_same_path_raises_naming_what_differs(
    era5: Path, tmp_path: Path
) -> None:
    other = write_era5(tmp_path / "other.zarr", n_time=48)  # same names, other shape
    with pytest.raises(ValueError, match=r"'t2m'.*shape \(48, 8, 16\) in the store"):
        _pipeline(other, open_geometries(era5))


def test_geometries_read_from_the_same_store_pass_the_check(era5: Path) -> None:
    pipe = _pipeline(era5, open_geometries(era5))
    assert next(pipe) is not None
    pipe.close()


@pytest.mark.xdist_group("s3")
def test_an_s3_prefix_or_bucket_that_holds_nothing_raises_naming_array_and_store(
    era5: Path, s3_upload: Callable[[Path, str], str], s3_options: dict[str, Any]
) -> None:
    url = s3_upload(era5, "data/era5.zarr")
    geoms = open_geometries(open_store(url, **s3_options))
    for wrong in (url + "-typo", url.replace("s3://", "s3://missing-", 1)):
        store = open_store(wrong, **s3_options)
        with pytest.raises(FileNotFoundError) as info:
            _pipeline(store, geoms)
        assert "'t2m'" in str(info.value) and wrong in str(info.value)
        with pytest.raises(FileNotFoundError) as info:
            open_geometries(store)  # first use of the store on its own
        assert wrong in str(info.value) and "bucket" in str(info.value)


# ---------------------------------------------------------------------------------------------
# Corrupt metadata documents
# ---------------------------------------------------------------------------------------------

CORRUPT = [
    (3, "zarr.json", b"{not json"),
    (3, "t2m/zarr.json", b"{not json"),
    (3, "t2m/zarr.json", b'{"zarr_format": 3}'),  # JSON, but no node_type
    (2, ".zgroup", b"\x00\xff garbage"),
    (2, "t2m/.zarray", b"{not json"),
    (2, "t2m/.zattrs", b"[1, 2"),
]


@pytest.mark.parametrize(("zarr_format", "key", "content"), CORRUPT)
def test_a_corrupt_metadata_document_raises_naming_the_document_and_its_array(
    tmp_path: Path, zarr_format: int, key: str, content: bytes
) -> None:
    root = write_era5(tmp_path / "era5.zarr", n_time=16, zarr_format=zarr_format)
    (root / key).write_bytes(content)
    with pytest.raises(CorruptMetadataError) as info:
        open_geometries(root)
    message = str(info.value)
    assert repr(key) in message and str(root) in message
    node = key.rpartition("/")[0]
    assert (repr(node) if node else "root group") in message
    assert [k for k, _ in info.value.documents] == [key]
    assert not isinstance(info.value, json.JSONDecodeError)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_array_document_corrupted_after_the_geometries_were_read_fails_construction(
    tmp_path: Path, zarr_format: int
) -> None:
    root = write_era5(tmp_path / "era5.zarr", n_time=16, zarr_format=zarr_format)
    geoms = open_geometries(root)
    key = "t2m/zarr.json" if zarr_format == 3 else "t2m/.zarray"
    (root / key).write_bytes(b"{truncated")
    with pytest.raises(CorruptMetadataError, match=re.escape(f"'{key}'") + ".*'t2m'"):
        _pipeline(root, geoms)


def test_a_corrupt_document_in_a_zarr_store_that_is_not_obstore_is_named_too(
    tmp_path: Path,
) -> None:
    root = write_era5(tmp_path / "era5.zarr", n_time=16)
    (root / "z" / "zarr.json").write_bytes(b"")
    with pytest.raises(CorruptMetadataError, match=re.escape("'z/zarr.json'")):
        open_geometries(zarr.storage.LocalStore(root, read_only=True))
    shutil.rmtree(root)


UNSUPPORTED = [  # (zarr format, edit of the array's metadata document, what it names)
    (2, lambda m: m.update(compressor={"id": "nosuchcodec"}), "nosuchcodec"),
    (2, lambda m: m.update(filters=[{"id": "imagecodecs_jpeg2k"}]), "imagecodecs_jpeg2k"),
    (
        3,
        lambda m: m["codecs"].append({"name": "nosuch.codec", "configuration": {}}),
        "nosuch.codec",
    ),
    (3, lambda m: m.update(data_type="bfloat16"), "bfloat16"),
]


@pytest.mark.parametrize(("zarr_format", "edit", "named"), UNSUPPORTED)
def test_a_codec_or_data_type_not_installed_says_to_install_it_not_that_metadata_is_corrupt(
    tmp_path: Path, zarr_format: int, edit: Callable[[dict[str, Any]], None], named: str
) -> None:
    from insitubatch_nodes.errors import UnsupportedMetadataError

    root = write_era5(tmp_path / "era5.zarr", n_time=16, zarr_format=zarr_format)
    geoms = open_geometries(root)  # read before the edit: the pipeline's own check
    key = "t2m/zarr.json" if zarr_format == 3 else "t2m/.zarray"
    document = json.loads((root / key).read_text())
    edit(document)
    (root / key).write_text(json.dumps(document))
    for attempt in (lambda: open_geometries(root), lambda: _pipeline(root, geoms)):
        with pytest.raises(UnsupportedMetadataError) as info:
            attempt()
        message = str(info.value)
        assert isinstance(info.value, CorruptMetadataError)  # caught as before
        assert repr(key) in message and named in message and "'t2m'" in message
        assert re.search(
            r"not installed.*Install the package that provides it and import it", message
        )
        assert "corrupt" not in message and "Restore" not in message
