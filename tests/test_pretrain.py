"""pretrain.py: descriptions written from scene graphs, hard negatives that are false, the loss and the zero-shot
test as their formulas say, and a run that is deterministic for a seed and learns."""
import json
import math
import random
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import pretrain
import synth
from tokenizer import get_tokenizer, tokenize


PLACED = re.compile(r"a (\w+) (\w+) (\w+) (\w+) (on the left|in the middle|on the right) (at the back|in front)")
BY_ANOTHER = re.compile(r"a (\w+) (\w+) (\w+) (\w+) that is (left of|right of|in front of|behind) the (.*)")


def test_each_swapped_description_differs_in_one_attribute_and_fits_no_object():
    rng, by_another = random.Random(0), 0
    for i in range(300):
        objects = synth.scene(i, seed=7)["objects"]
        true, *false = pretrain.texts(objects, rng, negatives=4, relations=0.5)
        assert len(false) == 4 and len(set(false)) == 4 and true not in false
        said = [pretrain.describe(pretrain.attributes(o), {}) for o in objects]  # with the first synonyms
        form = BY_ANOTHER if " that is " in true else PLACED
        by_another += form is BY_ANOTHER
        for text in false:
            a, b = form.fullmatch(true).groups(), form.fullmatch(text).groups()
            slots = [(a[k], b[k]) for k in range(4)] + [(a[4:], b[4:])]  # size, colour, material, shape, place
            assert sum(x != y for x, y in slots) == 1, (true, text)
            if form is BY_ANOTHER:
                assert a[5] == b[5], (true, text)  # the other object stays
            else:
                assert canonical(text) not in said, (text, objects)
    assert 100 < by_another < 200


def canonical(text):
    """A description with the first synonym of each word, as describe({}) writes it."""
    first = {w: words[0] for words in synth.WORDS.values() for w in words}
    return " ".join(first.get(w, w) for w in text.split())


def test_descriptions_tokenize_as_the_tokenizer_does():
    rng = random.Random(1)
    texts = [t for i in range(200) for t in pretrain.texts(synth.scene(i, 0)["objects"], rng, 3, 0.3)]
    assert torch.equal(pretrain.tokens_of(texts, 32), tokenize(texts, 32))


def test_positions_are_thirds_of_the_floor_across_and_halves_in_depth():
    cells = {(x, y): pretrain.attributes({"x": x, "y": y, "shape": "cube", "color": "red", "material": "metal",
                                           "size": "small"})["position"] for x in (61, 179, 181, 299, 301, 419)
             for y in (81, 184, 186, 289)}
    assert {x for (x, _), (column, _) in cells.items() if column == 0} == {61, 179}
    assert {x for (x, _), (column, _) in cells.items() if column == 2} == {301, 419}
    assert {y for (_, y), (_, row) in cells.items() if row == 0} == {81, 184}


@pytest.mark.parametrize("negatives", [0, 3])
def test_the_loss_is_clips_two_cross_entropies_with_each_images_own_swapped_texts_as_extra_columns(negatives):
    torch.manual_seed(0)
    batch, scale = 5, 10.0
    v, g = torch.randn(batch, 8), torch.randn(batch, 1 + negatives, 8)

    def logit(i, text):  # image i against a text: scale * cosine
        return scale * float(v[i].double() @ text.double() / v[i].double().norm() / text.double().norm())

    def cross_entropy(logits, right):
        return math.log(sum(math.exp(x) for x in logits)) - logits[right]
    image_to_text = [cross_entropy([logit(i, g[j, 0]) for j in range(batch)]  # every image's true text
                                   + [logit(i, g[i, k]) for k in range(1, 1 + negatives)], i)  # its own swapped ones
                     for i in range(batch)]
    text_to_image = [cross_entropy([logit(i, g[j, 0]) for i in range(batch)], j) for j in range(batch)]
    expected = (sum(image_to_text) / batch + sum(text_to_image) / batch) / 2
    assert pretrain.clip_loss(v, g, torch.tensor(math.log(scale))).item() == pytest.approx(expected, rel=1e-5)


class ReadsTheGraphs(torch.nn.Module):
    """A CLIP that reads each scene's graph, blind to colour: a text's vector is the one-hot of its description less
    its colour word, an image's the sum of those of its objects' descriptions, times its scene's sign (-1: it ranks
    the true descriptions below any other)."""
    config = SimpleNamespace(image_size=8)

    def __init__(self, scenes, signs):
        super().__init__()
        self.scenes, self.signs, self.column = scenes, signs, {}

    def one_hot(self, text):
        key = " ".join(word for word in text.split() if word not in synth.COLORS)
        return F.one_hot(torch.tensor(self.column.setdefault(key, len(self.column))), 64).float()

    def encode_image(self, scenes):  # the store gives each scene's index as its image
        return torch.stack([self.signs[i] * sum(self.one_hot(pretrain.describe(pretrain.attributes(o), {}))
                                                for o in self.scenes[i]) for i in scenes.tolist()])

    def encode_text(self, tokens):
        return torch.stack([self.one_hot(get_tokenizer().decode([t for t in row if t])) for row in tokens.tolist()])


def test_zero_shot_is_the_share_of_scenes_whose_true_description_scores_higher_per_attribute_and_their_mean():
    def obj(x, y, size, color, material, shape):
        return dict(x=x, y=y, size=size, color=color, material=material, shape=shape)
    back, front = synth.Y_FAR, synth.Y_NEAR
    scenes = [[obj(100, back, "small", "red", "metal", "cube")],
              [obj(400, front, "large", "blue", "rubber", "sphere")],  # read with sign -1: the true one loses
              # two objects alike but in size, in one cell: no size makes the description false, the scene is left out
              [obj(240, back, "small", "green", "metal", "cylinder"),
               obj(250, back, "large", "green", "metal", "cylinder")],
              [obj(330, front, "small", "yellow", "rubber", "cube"),
               obj(340, front, "large", "yellow", "rubber", "cube")]]
    clip = ReadsTheGraphs(scenes, signs=[1, -1, 1, 1])
    result = pretrain.zero_shot(clip, [(i, {"objects": s}) for i, s in enumerate(scenes)],
                                lambda index, size: torch.tensor(index), torch.device("cpu"))
    # colour: a tie in every scene, no win; size: of scenes 0 and 1, the first; others: scenes 0, 2 and 3 of all 4;
    # the mean of the five shares (over all 18 comparisons pooled, 10 wins would be 55.6)
    assert result == pytest.approx({"shape": 75.0, "color": 0.0, "material": 75.0, "size": 50.0, "position": 75.0,
                                    "mean": 55.0})


def run(tmp_path, out, seed=0):
    argv = ["--data_root", str(tmp_path / "scenes"), "--out_dir", str(tmp_path / out), "--scenes", "64", "--epochs", "4",
            "--batch_size", "16", "--log_every", "1", "--workers", "0", "--device", "cpu", "--seed", str(seed),
            "--warmup", "0.1"]
    pretrain.HELD_OUT, held = 40, pretrain.HELD_OUT
    try:
        pretrain.main(argv)
    finally:
        pretrain.HELD_OUT = held
    return torch.load(tmp_path / out / "last.pt")["model"]


@pytest.mark.slow
def test_a_run_is_deterministic_for_a_seed_and_lowers_its_loss(tmp_path, capsys):
    first = run(tmp_path, "a")
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r" loss (\S+)", out)]
    assert len(losses) == 16 and sum(losses[-4:]) < sum(losses[:4]) - 0.4, losses
    assert "zero-shot, true description over the swapped one: shape" in out
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert set(metrics["zero_shot"]) == {"shape", "color", "material", "size", "position", "mean"}
    again, other = run(tmp_path, "b"), run(tmp_path, "c", seed=1)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["clip.visual.proj"], other["clip.visual.proj"])
    import clip_weights
    clip = clip_weights.load(tmp_path / "a" / "clip.pt")  # OpenAI's layout, fp16: the best epoch's weights
    best = torch.load(tmp_path / "a" / "best.pt")["model"]
    assert all(torch.equal(v, best[f"clip.{k}"].half().float()) for k, v in clip.state_dict().items())
