"""Where dptune reads and writes: the cache folder, names, locations, write probes and atomic
writes, on this machine's file system."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from dptune import paths
from dptune.paths import LocationError


def test_the_cache_folder_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "cache"))
    assert paths.cache_dir("features", "x") == tmp_path / "cache" / "features" / "x"
    assert (tmp_path / "cache" / "features" / "x").is_dir()  # created
    monkeypatch.delenv(paths.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "dptune"


def test_a_name_is_one_folder() -> None:
    assert paths.check_name("tiny-2.search_v1") == "tiny-2.search_v1"
    assert paths.check_name("x" * paths.MAX_NAME_CHARS)
    for bad, why in (
        ("a/b", "use letters"),
        ("..", "names the folder itself or its parent"),
        (".", "names the folder itself"),
        ("", "use letters"),
        ("é", "use letters"),
        ("x" * (paths.MAX_NAME_CHARS + 1), "101 characters is too long"),
    ):
        with pytest.raises(LocationError, match=why):
            paths.check_name(bad, "--name")


def test_a_location_is_a_path_or_a_known_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    fs, path = paths.filesystem("results")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path / "results")
    fs, path = paths.filesystem(f"file://{tmp_path}")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path)
    with pytest.raises(LocationError, match=r"--storage 'ftp://h/x': unknown URI scheme 'ftp' \(allowed: a local"):
        paths.filesystem("ftp://h/x", "--storage")
    with pytest.raises(LocationError, match="--storage: an empty location"):
        paths.filesystem("  ", "--storage")


def test_a_write_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    paths.probe_writable(str(tmp_path / "a" / "b" / "c"), "--storage")
    assert list(tmp_path.iterdir()) == []  # the folders it created are removed again
    (tmp_path / "kept").mkdir()
    paths.probe_writable(str(tmp_path / "kept"))
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and list((tmp_path / "kept").iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(LocationError, match=f"--storage: '{tmp_path / 'file'}' exists and is not a folder"):
        paths.probe_writable(str(tmp_path / "file" / "results"), "--storage")
    with pytest.raises(LocationError, match="--report-dir '/proc/dptune': not writable"):
        paths.probe_writable("/proc/dptune", "--report-dir")


def test_a_write_probe_never_deletes_what_another_process_wrote_meanwhile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two searches start on one new folder: one's probe created it, the other took its lease in it
    before the probe cleaned up (injected between the probe's write and its cleanup): the lease stays."""
    folder = tmp_path / "st" / "tiny"
    real = paths.filesystem

    class Racing:
        def __init__(self, fs: pafs.FileSystem) -> None:
            self.fs = fs

        def __getattr__(self, name: str) -> object:
            return getattr(self.fs, name)

        def delete_file(self, path: str) -> None:
            self.fs.delete_file(path)
            (folder / ".lease").write_text("pid 1")  # the other search, between the probe and its cleanup

    monkeypatch.setattr(paths, "filesystem", lambda *args: (Racing(real(*args)[0]), real(*args)[1]))
    paths.probe_writable(str(folder), "--storage")
    assert (folder / ".lease").read_text() == "pid 1"


def test_an_atomic_write_is_whole_and_replaces(tmp_path: Path) -> None:
    folder = str(tmp_path / "new")
    assert paths.read_file(folder, "k.json") is None
    assert paths.write_file_atomic(folder, "k.json", b"one") == f"{folder}/k.json"
    assert paths.write_file_atomic(folder, "k.json", b"two", durable=True) == f"{folder}/k.json"
    assert paths.read_file(folder, "k.json") == b"two"
    assert os.listdir(folder) == ["k.json"]  # no temporary left
    with pytest.raises(IsADirectoryError):  # the target is a folder: the write fails, and leaves nothing
        paths.write_file_atomic(str(tmp_path), "new", b"three", durable=True)
    assert sorted(os.listdir(tmp_path)) == ["new"]
