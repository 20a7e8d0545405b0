"""pretrain.py: descriptions written from scene graphs, hard negatives that are false, and a run that is
deterministic for a seed and learns."""
import json
import random
import re

import torch

import pretrain
import synth
from tokenizer import tokenize


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
