"""CLIP4IDC's image preprocessing and the stage datasets: samples, distractor swaps, determinism, workers."""
import json

import pytest
import torch
from PIL import Image
from torchvision import transforms

import data

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
    """Which of RED, GREEN, BLUE a normalised image shows."""
    rgb = (image[:, 4, 4] * data.STD[:, 0, 0] + data.MEAN[:, 0, 0]) * 255
    return {RED: "red", GREEN: "green", BLUE: "blue"}[min((RED, GREEN, BLUE), key=lambda c: (rgb - torch.tensor(c)).abs().sum())]


def decode(ids):
    return data.get_tokenizer().decode([i for i in ids.tolist() if i])


@pytest.mark.parametrize("mode, size", [("RGB", 224), ("RGBA", 128), ("P", 64)])
def test_load_image_equals_clip4idc_transform(tmp_path, mode, size):
    pixels = torch.randint(0, 256, (45, 67, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    image = Image.fromarray(pixels.numpy()).convert(mode)
    image.save(tmp_path / "x.png")
    clip4idc = transforms.Compose([  # CLIP4IDC's RawImageExtractor: squash to n x n, no centre crop
        transforms.Resize([size, size], interpolation=transforms.InterpolationMode.BICUBIC),
        lambda im: im.convert("RGB"), transforms.ToTensor(),
        transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))])
    expected = clip4idc(Image.open(tmp_path / "x.png").convert("RGB"))
    assert torch.equal(data.load_image(tmp_path / "x.png", size), expected)


def test_image_cache_equals_load_image_and_follows_the_pairs(tmp_path):
    pairs = write_clevr(tmp_path / "d")
    cache = data.ImageCache(pairs[:2], 32, tmp_path / "cache.pt")
    for p in pairs[:2]:
        for path in (p.before, p.after, p.distractor):
            assert torch.equal(cache(path, 32), data.load_image(path, 32))
    stamp = (tmp_path / "cache.pt").stat().st_mtime_ns
    assert len(data.ImageCache(pairs[:2], 32, tmp_path / "cache.pt").pixels) == 6
    assert (tmp_path / "cache.pt").stat().st_mtime_ns == stamp  # read back, not rebuilt
    assert len(data.ImageCache(pairs, 32, tmp_path / "cache.pt").pixels) == 12  # other pairs: rebuilt
    cache = data.ImageCache(pairs, 16, tmp_path / "cache.pt")
    assert cache.pixels.shape[-1] == 16  # other size: rebuilt
    with pytest.raises(ValueError, match="holds 16 px images, not 32 px"):
        data.AdaptDataset(pairs, 32, cache=cache)[(0, 0)]


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
    picks = [decode(captioning[(e, 3)][2][0]) for e in range(30)]
    assert picks == [decode(data.CaptionDataset(pairs, 16, seed=1)[(e, 3)][2][0]) for e in range(30)]
    assert set(picks) == set(pairs[3].captions)  # which caption varies with the epoch


def test_caption_samples_stack_the_change_and_the_distractor_pair(tmp_path):
    pairs = write_clevr(tmp_path, n=3)
    ds = data.CaptionDataset(pairs, 16, context_length=20)
    assert len(ds) == 3
    before, after, ids = ds[(0, 2)]
    assert before.shape == after.shape == (2, 3, 16, 16) and ids.shape == (2, 20)
    assert [colour_of(b) for b in before] == ["red", "red"] and [colour_of(a) for a in after] == ["green", "blue"]
    assert decode(ids[0]) in pairs[2].captions and decode(ids[1]) in pairs[2].distractor_captions
    spot_like = [data.Pair("x.png", pairs[0].before, pairs[0].after, ["a car left"])]
    before, after, ids = data.CaptionDataset(spot_like, 16)[(0, 0)]
    assert before.shape == after.shape == (1, 3, 16, 16) and decode(ids[0]) == "a car left"
    assert data.AdaptDataset(spot_like, 16)[(0, 0)][0].shape == (3, 16, 16)


def test_eval_dataset_yields_every_item_with_its_index(tmp_path):
    items = data.eval_items(write_clevr(tmp_path, n=2))
    ds = data.EvalDataset(items, 16)
    assert len(ds) == 4
    got = [(i, colour_of(b), colour_of(a)) for i, b, a in (ds[k] for k in range(4))]
    assert got == [(0, "red", "green"), (1, "red", "blue"), (2, "red", "green"), (3, "red", "blue")]


def test_workers_and_cache_do_not_change_batches(tmp_path):
    pairs = write_clevr(tmp_path / "d", n=4)
    keys = [(e, i) for e in range(2) for i in range(7)]

    def batches(workers, cache=None):
        ds = data.AdaptDataset(pairs, 16, seed=3, cache=cache)
        return list(torch.utils.data.DataLoader(ds, batch_size=5, sampler=keys, num_workers=workers))

    reference = batches(0)
    for other in (batches(2), batches(0, data.ImageCache(pairs, 16, tmp_path / "c.pt"))):
        assert all(torch.equal(x, y) for a, b in zip(reference, other) for x, y in zip(a, b))
