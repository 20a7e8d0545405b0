"""The image store when its build fails, its files are damaged or another run rebuilds it: no temporary file
is left behind, a store cut short or an index that cannot be read is rebuilt, not an error, and a run reads
the store it checked."""
import errno
import pickle
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

import cli
import data
import image_store
from test_data_readers import png, write_clevr


def images(pairs):
    return [q for p in pairs for q in (p.before, p.after, p.distractor)]


def serves_the_files(store, pairs):
    return all(torch.equal(store(q, 16), data.read_pixels(q, 16)) for q in images(pairs))


def test_a_failed_build_leaves_no_temporary_file(tmp_path):
    write_clevr(tmp_path / "d")
    pairs = data.read_split("clevr", tmp_path / "d", "train")
    bad = pairs[1].after
    bad.write_bytes(bad.read_bytes()[:40])  # a truncated PNG
    (tmp_path / "s").mkdir()
    with pytest.raises(cli.InputError, match=f"^{bad}: cannot read image"):
        image_store.ImageStore(pairs, 16, tmp_path / "s")
    assert list((tmp_path / "s").iterdir()) == []


@pytest.mark.parametrize("damage", ["truncated store", "store too long", "index not JSON", "index not UTF-8"])
def test_a_damaged_store_is_rebuilt(tmp_path, damage):
    write_clevr(tmp_path / "d")
    pairs = data.read_split("clevr", tmp_path / "d", "train")
    image_store.ImageStore(pairs, 16, tmp_path / "s")
    store, index = tmp_path / "s" / "store_16px.u8", tmp_path / "s" / "store_16px.json"
    whole = store.read_bytes()
    if damage == "truncated store":
        store.write_bytes(whole[:len(whole) // 2])  # a copy cut short
    elif damage == "store too long":
        store.write_bytes(whole + bytes(100))
    else:
        index.write_bytes(b'{"size": 16, "files": [' if damage == "index not JSON" else b"\xff\xfe{}")
    rebuilt = image_store.ImageStore(pairs, 16, tmp_path / "s")
    assert store.read_bytes() == whole and serves_the_files(rebuilt, pairs)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["store_16px.json", "store_16px.u8"]


def test_a_store_that_cannot_be_written_beside_read_only_data_says_to_pass_no_cache(tmp_path, monkeypatch):
    write_clevr(tmp_path / "d")
    pairs = data.read_split("clevr", tmp_path / "d", "train")

    def read_only(path, missing_ok=False):  # as on a read-only mount, which root cannot write either
        raise OSError(errno.EROFS, "Read-only file system", str(path))
    monkeypatch.setattr(Path, "unlink", read_only)
    store = tmp_path / "d" / "store_16px.u8"
    with pytest.raises(cli.InputError, match=re.escape(f"--cache: cannot write the image store {store} (Read-only "
                                                        "file system): pass --no-cache")):
        image_store.ImageStore(pairs, 16, tmp_path / "d")


def test_the_store_is_built_by_as_many_processes_as_this_process_has_cores(tmp_path, monkeypatch):
    """A job's or a container's share of the cores, not the machine's: 130 images would start 3."""
    files = [tmp_path / f"{i}.png" for i in range(130)]
    for i, path in enumerate(files):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(path)
    monkeypatch.setattr(data.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(data.os, "cpu_count", lambda: 64)
    pools = []
    monkeypatch.setattr(cli, "worker_pool", lambda n, pool=cli.worker_pool: pools.append(n) or pool(n))
    image_store.build_store(tmp_path / "store.u8", files, 8)
    assert pools == [1] and (tmp_path / "store.u8").stat().st_size == 130 * 3 * 8 * 8


def test_a_run_reads_the_store_it_checked_while_another_run_rebuilds_it(tmp_path):
    """Another run that finds the data changed removes the store and writes a new one, of another image list
    here: this run's loader processes, started at each validation, read the file it checked, not a missing
    file nor another list's rows; a copy sent to a spawned process carries no pixels."""
    write_clevr(tmp_path / "d")
    pairs = data.read_split("clevr", tmp_path / "d", "train")
    for i, path in enumerate(images(pairs)):  # each image its own colour, so that a wrong row shows
        png(path, (i, 10, 10))
    store = image_store.ImageStore(pairs, 16, tmp_path / "d")
    assert len(pickle.dumps(store)) < store.path.stat().st_size
    store.path.unlink()  # the other run's build has begun
    assert serves_the_files(store, pairs)
    png(tmp_path / "d" / "images" / "CLEVR_0.png", (0, 0, 255))  # its list holds an image that comes first
    image_store.ImageStore(pairs + [data.Pair("0", *[tmp_path / "d" / "images" / "CLEVR_0.png"] * 2, ["new"])], 16,
                           tmp_path / "d")
    loader = torch.utils.data.DataLoader(data.EvalDataset(pairs, 16, store), batch_size=len(pairs), num_workers=1)
    _, before, after = next(iter(loader))
    assert torch.equal(before, torch.stack([data.read_pixels(p.before, 16) for p in pairs]))
    assert torch.equal(after, torch.stack([data.read_pixels(p.after, 16) for p in pairs]))
