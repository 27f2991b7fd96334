"""The Storage operations a checkpoint root needs, on LocalStorage: sub-locations, stat, exclusive
create, whole-tree delete and move."""

from __future__ import annotations

import os

import pytest

from zerostall.storage import LocalStorage, storage_for


@pytest.fixture
def store(tmp_path) -> LocalStorage:
    (tmp_path / "b_dir").mkdir()
    (tmp_path / "a_dir" / "deep").mkdir(parents=True)
    (tmp_path / "a_dir" / "deep" / "f").write_bytes(b"x")
    (tmp_path / "z_file").write_bytes(b"12345")
    (tmp_path / "c_file").write_bytes(b"")
    return LocalStorage(str(tmp_path), fsync=False)


def test_sub_locations_are_listed(store, tmp_path):
    assert store.children() == ["a_dir", "b_dir"]
    assert {"c_file", "z_file"} <= set(store.list())
    assert store.child("a_dir").children() == ["deep"] and store.child("a_dir").child("deep").children() == []
    missing = store.child("nope")
    assert missing.list() == [] and missing.children() == [] and not missing.exists()


def test_a_child_is_the_subdirectory_with_the_same_settings(store, tmp_path):
    child = store.child("a_dir")
    assert isinstance(child, LocalStorage) and child.location == str(tmp_path / "a_dir") and child.fsync is False
    assert LocalStorage(str(tmp_path)).child("x").fsync is True
    assert storage_for(child) is child


def test_stat_gives_size_time_and_a_version_that_changes_on_replace(store):
    st = store.stat("z_file")
    assert st.size == 5 and st.modified == os.stat(os.path.join(store.location, "z_file")).st_mtime
    assert store.stat("z_file") == st
    store.publish("z_file", "z_file.tmp", b"54321")  # same size, new file
    assert store.stat("z_file").version != st.version
    with pytest.raises(FileNotFoundError):
        store.stat("nope")


def test_create_exclusive_creates_once_whole_and_leaves_no_temp_file(store):
    assert store.create_exclusive("lease", b'{"who": 1}')
    assert not store.create_exclusive("lease", b'{"who": 2}')
    assert store.read_bytes("lease") == b'{"who": 1}'
    assert [n for n in store.list() if n.endswith(".tmp")] == []


def test_delete_tree_removes_everything_under_a_sub_location(store):
    store.delete_tree("a_dir")
    assert store.children() == ["b_dir"]
    store.delete_tree("a_dir")  # already gone: not an error


def test_move_renames_a_sub_location_into_a_deeper_one(store):
    store.child("aside").create()
    store.move("a_dir", "aside/a_dir")
    assert store.children() == ["aside", "b_dir"]
    assert store.child("aside").child("a_dir").child("deep").read_bytes("f") == b"x"
    with pytest.raises(FileNotFoundError):
        store.move("a_dir", "elsewhere")


def test_move_fences_off_a_writer_of_the_old_location(store):
    old = store.child("b_dir")
    store.move("b_dir", "b_moved")
    with pytest.raises(OSError):
        old.publish("manifest.json", "manifest.json.tmp", b"{}")
    assert store.child("b_moved").list() == [] and not old.exists()
