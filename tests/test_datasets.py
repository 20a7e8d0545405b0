"""CLIP4IDC's image preprocessing, the image store, and the stage datasets: samples, distractor
swaps, determinism, workers."""
import errno
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from PIL import Image
from torchvision import transforms

import cli
import data
import image_store
import synth
import tokenizer
from tiny import tiny_clip_config
from model import VisionTransformer

RED, GREEN, BLUE = (220, 20, 20), (20, 220, 20), (20, 20, 220)


def write_clevr(root, n=4):
    """Before images red, after green, distractors blue, so a sample shows which files it was made of."""
    for i in range(n):
        for folder, prefix, color in (("images", "default", RED), ("sc_images", "semantic", GREEN),
                                      ("nsc_images", "nonsemantic", BLUE)):
            (root / folder).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (30, 20), color).save(root / folder / f"CLEVR_{prefix}_{i:06d}.png")
    change = {f"CLEVR_default_{i:06d}.png": [f"the red cube {i} turned green", f"a green ball {i} appeared",
                                             f"something {i} changed"][:1 + i % 3] for i in range(n)}
    no_change = {k: ["nothing has changed", "the scene remains the same"] for k in change}
    files = {"splits": {"train": list(range(n))}, "change_captions": change, "no_change_captions": no_change,
             "type_mapping": {"color": [f"{i:06d}.png" for i in range(n)]}}
    for name, content in files.items():
        (root / f"{name}.json").write_text(json.dumps(content))
    return data.read_split("clevr", root, "train")


def colour_of(image):
    """Which of RED, GREEN, BLUE a uint8 image shows."""
    rgb = image[:, 4, 4].int()
    return {RED: "red", GREEN: "green", BLUE: "blue"}[min((RED, GREEN, BLUE), key=lambda c: (rgb - torch.tensor(c)).abs().sum())]


def decode(ids):
    return tokenizer.get_tokenizer().decode([i for i in ids.tolist() if i])


@pytest.mark.parametrize("mode, size", [("RGB", 32), ("RGBA", 48), ("P", 64)])
def test_pixels_normalised_by_the_model_equal_clip4idc_transform(tmp_path, mode, size):
    pixels = torch.randint(0, 256, (45, 67, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    image = Image.fromarray(pixels.numpy()).convert(mode)
    image.save(tmp_path / "x.png")
    clip4idc = transforms.Compose([  # CLIP4IDC's RawImageExtractor: squash to n x n, no centre crop
        transforms.Resize([size, size], interpolation=transforms.InterpolationMode.BICUBIC),
        lambda im: im.convert("RGB"), transforms.ToTensor(),
        transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
    expected = clip4idc(Image.open(tmp_path / "x.png").convert("RGB"))
    visual = VisionTransformer(tiny_clip_config(image_size=size, patch_size=16))
    ours = data.read_pixels(tmp_path / "x.png", size)
    assert ours.dtype == torch.uint8
    torch.testing.assert_close(visual.embed(ours[None]), visual.embed(expected[None]), rtol=0, atol=1e-5)


def store_files(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("store_"))


def test_image_store_equals_the_files_and_follows_them(tmp_path):
    pairs = write_clevr(tmp_path / "d")
    store = image_store.ImageStore(pairs[:2], 32, tmp_path / "s")
    assert store_files(tmp_path / "s") == ["store_32px.json", "store_32px.u8"]  # no temporary file left
    assert (tmp_path / "s" / "store_32px.u8").stat().st_size == 6 * 3 * 32 * 32
    for p in pairs[:2]:
        for path in (p.before, p.after, p.distractor):
            assert torch.equal(store(path, 32), data.read_pixels(path, 32))
    stamp = (tmp_path / "s" / "store_32px.u8").stat().st_mtime_ns
    image_store.ImageStore(pairs[:2], 32, tmp_path / "s")
    assert (tmp_path / "s" / "store_32px.u8").stat().st_mtime_ns == stamp  # read back, not rebuilt
    assert (tmp_path / "s" / "store_32px.u8").stat().st_size == 6 * 3 * 32 * 32
    assert len(image_store.ImageStore(pairs, 32, tmp_path / "s").row) == 12  # other pairs: rebuilt
    assert (tmp_path / "s" / "store_32px.u8").stat().st_size == 12 * 3 * 32 * 32
    store = image_store.ImageStore(pairs, 16, tmp_path / "s")
    assert torch.equal(store(pairs[0].after, 16), data.read_pixels(pairs[0].after, 16))  # other size: its own file
    with pytest.raises(ValueError, match="holds 16 px images, not 32 px"):
        data.AdaptDataset(pairs, 32, store=store)[(0, 0)]


@pytest.mark.parametrize("mtime", [1, 0], ids=["modified-1-ns-later", "modification-time-kept-as-cp-p-does"])
def test_image_store_serves_a_replaced_file_anew(tmp_path, mtime):
    pairs = write_clevr(tmp_path / "d")
    path = pairs[1].after
    assert colour_of(image_store.ImageStore(pairs, 16, tmp_path / "s")(path, 16)) == "green"
    stat = os.stat(path)
    Image.new("RGB", (30, 20), BLUE).save(path)  # same path and byte size
    assert os.stat(path).st_size == stat.st_size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + mtime))
    assert colour_of(image_store.ImageStore(pairs, 16, tmp_path / "s")(path, 16)) == "blue"


def test_what_killed_writers_left_is_removed_by_the_next_one(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()  # its pid now names no process: a writer killed before its clean-up ran
    host, folder = socket.gethostname(), tmp_path / "s"
    folder.mkdir()
    killed, live, *elsewhere = (folder / f"store_16px.u8.{tag}.tmp" for tag in (
        f"{host}-{ended.pid}", f"{host}-{os.getppid()}", f"{host}x-{ended.pid}", f"{host}-2-{ended.pid}"))
    for leftover in (killed, live, *elsewhere):
        leftover.write_bytes(b"half an image store")
    image_store.ImageStore(write_clevr(tmp_path / "d"), 16, folder)
    assert not killed.exists() and live.exists() and all(f.exists() for f in elsewhere)  # their writers may run
    drawing = tmp_path / f"synth.{host}-{ended.pid}.partial"
    (drawing / "images").mkdir(parents=True)
    synth.write_synth(tmp_path / "synth", 10, seed=0)
    assert sorted(p.name for p in tmp_path.glob("synth*")) == ["synth"]


def test_on_windows_no_process_is_asked_whether_it_runs(monkeypatch):
    """There os.kill(pid, 0) would end the process: a leftover's writer counts as running, its file stays."""
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    killed = []
    with monkeypatch.context() as patch:  # undone before pytest, which reads os.name, reports
        patch.setattr(cli.os, "kill", lambda pid, sig: killed.append(pid))
        patch.setattr(cli.os, "name", "nt")
        said = cli.running(ended.pid)
    assert said and killed == []


READ_ARRAY = data.read_array


def fails_on_one_image(path, size):  # at module level: the store's worker processes look it up by name
    if path.endswith("CLEVR_semantic_000001.png"):
        raise OSError("disk full")
    return READ_ARRAY(path, size)


def test_an_interrupted_rebuild_leaves_no_index_to_trust(tmp_path, monkeypatch):
    pairs = write_clevr(tmp_path / "d")
    image_store.ImageStore(pairs[:2], 16, tmp_path / "s")
    monkeypatch.setattr(data, "read_array", fails_on_one_image)
    with pytest.raises(OSError, match="disk full"):
        image_store.ImageStore(pairs, 16, tmp_path / "s")  # other pairs: a rebuild, which fails half way
    assert not (tmp_path / "s" / "store_16px.json").exists()  # the old index no longer vouches for the file
    monkeypatch.undo()
    store = image_store.ImageStore(pairs, 16, tmp_path / "s")
    assert all(torch.equal(store(p.after, 16), data.read_pixels(p.after, 16)) for p in pairs)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EOPNOTSUPP])
def test_a_store_the_disk_has_no_room_for_is_refused_before_any_image_is_read(tmp_path, monkeypatch, error):
    pairs = write_clevr(tmp_path / "d")

    def cannot(fd, offset, length):  # a full disk; or a file system that does not allocate ahead, left sparse
        raise OSError(error, os.strerror(error))
    monkeypatch.setattr(os, "posix_fallocate", cannot, raising=False)
    megabytes = len({q for p in pairs for q in (p.before, p.after, p.distractor)}) * 3 * 224 * 224 / 1e6
    if error == errno.EOPNOTSUPP:
        assert torch.equal(image_store.ImageStore(pairs, 224, tmp_path / "s")(pairs[0].after, 224),
                           data.read_pixels(pairs[0].after, 224))
        return
    with pytest.raises(cli.InputError, match=rf"--cache: cannot write the image store .*store_224px.u8 of {megabytes:.1f} "
                                              r"MB \(No space left on device\): make room there, or pass --no-cache"):
        image_store.ImageStore(pairs, 224, tmp_path / "s")
    assert list((tmp_path / "s").iterdir()) == []


def test_adapt_samples_every_caption_and_swaps_in_the_distractor_half_the_time(tmp_path):
    pairs = write_clevr(tmp_path, n=4)
    ds = data.AdaptDataset(pairs, 16, context_length=12, seed=0)
    assert len(ds) == 1 + 2 + 3 + 1
    expected = [c for p in pairs for c in p.captions]
    swaps = 0
    for epoch in range(40):
        for index in range(len(ds)):
            before, after, ids = ds[(epoch, index)]
            assert ids.shape == (12,) and decode(ids) == expected[index]
            assert colour_of(after) == "green" and colour_of(before) in ("red", "blue")
            swaps += colour_of(before) == "blue"
    assert 0.4 < swaps / (40 * len(ds)) < 0.6


def test_same_key_same_sample_whatever_the_order(tmp_path):
    pairs = write_clevr(tmp_path, n=4)
    keys = [(e, i) for e in range(3) for i in range(7)]
    first = [colour_of(data.AdaptDataset(pairs, 16, seed=1)[k][0]) for k in keys]
    again = data.AdaptDataset(pairs, 16, seed=1)
    assert [colour_of(again[k][0]) for k in reversed(keys)][::-1] == first
    assert [colour_of(data.AdaptDataset(pairs, 16, seed=2)[k][0]) for k in keys] != first
    captioning = data.CaptionDataset(pairs, 16, seed=1)
    picks = [tuple(map(decode, captioning[(e, 2)][2])) for e in range(30)]
    assert picks == [tuple(map(decode, data.CaptionDataset(pairs, 16, seed=1)[(e, 2)][2])) for e in range(30)]
    assert len(pairs[2].captions) == 3 and len(pairs[2].distractor_captions) == 2
    assert {c for c, _ in picks} == set(pairs[2].captions)  # which caption varies with the epoch
    assert {c for _, c in picks} == set(pairs[2].distractor_captions)


def test_caption_samples_stack_the_change_and_the_distractor_pair(tmp_path):
    pairs = write_clevr(tmp_path, n=3)
    ds = data.CaptionDataset(pairs, 16, context_length=20)
    assert len(ds) == 3
    before, after, ids = ds[(0, 2)]
    assert before.shape == (3, 16, 16) and after.shape == (2, 3, 16, 16) and ids.shape == (2, 20)
    assert colour_of(before) == "red" and [colour_of(a) for a in after] == ["green", "blue"]
    assert decode(ids[0]) in pairs[2].captions and decode(ids[1]) in pairs[2].distractor_captions
    spot_like = [data.Pair("x.png", pairs[0].before, pairs[0].after, ["a car left"])]
    before, after, ids = data.CaptionDataset(spot_like, 16)[(0, 0)]
    assert before.shape == (3, 16, 16) and after.shape == (1, 3, 16, 16) and decode(ids[0]) == "a car left"
    assert data.AdaptDataset(spot_like, 16)[(0, 0)][0].shape == (3, 16, 16)


@pytest.mark.parametrize("dataset", ["birds", "clevr_dc"])
def test_birds_and_clevr_dc_samples_hold_their_pairs_images_and_captions_and_no_distractor(tmp_path, dataset):
    from test_data_readers import write_birds, write_clevr_dc
    (write_birds if dataset == "birds" else write_clevr_dc)(tmp_path)
    pairs = data.read_split(dataset, tmp_path, "train")
    images = {p.id: (data.read_pixels(p.before, 16), data.read_pixels(p.after, 16)) for p in pairs}
    adapting = data.AdaptDataset(pairs, 16, context_length=32, seed=0)
    assert len(adapting) == sum(len(p.captions) for p in pairs)
    for epoch in range(3):
        for index, (pair, caption) in enumerate(adapting.samples):
            before, after, ids = adapting[(epoch, index)]
            assert all(map(torch.equal, (before, after), images[pair.id]))  # never a distractor's image
            assert decode(ids).replace(" ", "") == caption.lower().replace(" ", "")
    captioning = data.CaptionDataset(pairs, 16, context_length=32)
    for index, pair in enumerate(pairs):
        before, after, ids = captioning[(0, index)]
        assert torch.equal(before, images[pair.id][0]) and after.shape == (1, 3, 16, 16) and ids.shape == (1, 32)
        assert torch.equal(after[0], images[pair.id][1])
    assert [i for i, _, _ in data.EvalDataset(data.eval_items(pairs), 16)] == list(range(len(pairs)))


def test_eval_dataset_yields_every_item_with_its_index(tmp_path):
    items = data.eval_items(write_clevr(tmp_path, n=2))
    ds = data.EvalDataset(items, 16)
    assert len(ds) == 4
    got = [(i, colour_of(b), colour_of(a)) for i, b, a in (ds[k] for k in range(4))]
    assert got == [(0, "red", "green"), (1, "red", "blue"), (2, "red", "green"), (3, "red", "blue")]


def test_workers_and_cache_do_not_change_batches(tmp_path):
    pairs = write_clevr(tmp_path / "d", n=4)
    keys = [(e, i) for e in range(2) for i in range(7)]

    def batches(workers, store=None):
        ds = data.AdaptDataset(pairs, 16, seed=3, store=store)
        return list(torch.utils.data.DataLoader(ds, batch_size=5, sampler=keys, num_workers=workers))

    reference = batches(0)
    for other in (batches(2), batches(2, image_store.ImageStore(pairs, 16, tmp_path / "s"))):
        assert all(torch.equal(x, y) for a, b in zip(reference, other) for x, y in zip(a, b))


def test_epoch_sampler_draws_a_new_order_each_epoch_and_splits_each_batch_over_the_processes():
    def keys(epoch, rank=0, world=1, skip=0):
        sampler = data.EpochSampler(13, 3, 4, rank, world)
        sampler.set_epoch(epoch, skip)
        return list(sampler)

    first, second = keys(0), keys(1)
    assert len(first) == len(second) == 12 and len({i for _, i in first}) == 12
    assert {e for e, _ in second} == {1} and [i for _, i in first] != [i for _, i in second]
    assert keys(1) == second and keys(1, skip=4) == second[4:]
    ranks = [keys(1, rank, 2) for rank in (0, 1)]
    assert [k for b in range(3) for r in ranks for k in r[2 * b:2 * b + 2]] == second
