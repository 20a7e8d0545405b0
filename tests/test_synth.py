"""The synthetic CLEVR-Change: its layout, determinism, and captions that say what the scene graphs changed."""
import contextlib
import json
import re
import types

import numpy as np
import pytest
from PIL import Image

import cli
import data
import synth

N = 20
SIZE_WORDS = {"small": {"small", "tiny"}, "large": {"large", "big"}}
MATERIAL_WORDS = {"rubber": {"rubber", "matte"}, "metal": {"metal", "metallic", "shiny"}}
SHAPE_WORDS = {"cube": {"cube", "block"}, "sphere": {"sphere", "ball"}, "cylinder": {"cylinder"}}
RELATION = re.compile(r" that is (left of|right of|in front of|behind) the (\w+) (\w+)")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth") / "d"
    synth.write_synth(root, N, seed=3)
    files = {name: json.loads((root / f"{name}.json").read_text())
             for name in ("splits", "change_captions", "no_change_captions", "type_mapping", "scenes")}
    return root, files


def test_layout_and_schemas_are_clevr_changes(dataset):
    root, f = dataset
    assert f["splits"] == {"train": list(range(16)), "val": [16, 17], "test": [18, 19]}
    defaults = {f"CLEVR_default_{i:06d}.png" for i in range(N)}
    assert set(f["change_captions"]) == set(f["no_change_captions"]) == defaults
    assert sorted(f["type_mapping"]) == ["add", "color", "drop", "material", "move"]
    assert sorted(sum(f["type_mapping"].values(), [])) == [f"{i:06d}.png" for i in range(N)]
    for i in range(N):
        for folder, prefix in (("images", "default"), ("sc_images", "semantic"), ("nsc_images", "nonsemantic")):
            with Image.open(root / folder / f"CLEVR_{prefix}_{i:06d}.png") as image:
                assert (image.size, image.mode) == ((480, 320), "RGB")
    for captions in list(f["change_captions"].values()) + list(f["no_change_captions"].values()):
        assert len(captions) == len(set(captions)) == 5
        assert all(c == c.lower() and not c.endswith(".") for c in captions)
    assert [p.name for p in root.parent.iterdir()] == [root.name]  # no half-drawn folder beside it
    pairs = data.read_split("synth", root, "test")
    assert [p.change_type for p in pairs] == [f["scenes"][p.id]["change_type"] for p in pairs]


def test_same_seed_same_bytes_other_seed_other_scenes(tmp_path):
    for name, seed, workers in (("a", 5, 1), ("b", 5, 2), ("c", 6, 1)):  # one process or two draw the same
        synth.write_synth(tmp_path / name, 10, seed, workers)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 10 * 3 + 5
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert (tmp_path / "a" / "scenes.json").read_text() != (tmp_path / "c" / "scenes.json").read_text()
    with pytest.raises(FileExistsError, match="exists"):
        synth.write_synth(tmp_path / "a", 10, 5)


def the_change(kind, before, after):
    """(object before, object after) of the one object the scene graphs change; None on the missing side."""
    if kind == "add":
        extra = [o for o in after if o not in before]
        assert len(after) == len(before) + 1 and len(extra) == 1
        return None, extra[0]
    if kind == "drop":
        gone = [o for o in before if o not in after]
        assert len(before) == len(after) + 1 and len(gone) == 1
        return gone[0], None
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    assert len(before) == len(after) and len(changed) == 1
    b, a = changed[0]
    assert {k for k in b if b[k] != a[k]} == ({"x", "y"} if kind == "move" else {kind})
    return b, a


def names(obj, words):
    """Whether a noun phrase names obj's size and colour, and its shape or 'thing'/'object'."""
    return (obj["color"] in words and SIZE_WORDS[obj["size"]] & words
            and (SHAPE_WORDS[obj["shape"]] | {"thing", "object"}) & words)


def relation_holds(where, subject, other):
    dx, dy = subject["x"] - other["x"], subject["y"] - other["y"]
    return {"left of": dx < 0, "right of": dx > 0, "in front of": dy > 0, "behind": dy < 0}[where]


def test_captions_describe_the_change_in_the_scene_graphs(dataset):
    _, f = dataset
    kinds = set()
    for name, scene in f["scenes"].items():
        kind, before, after = scene["change_type"], scene["before"], scene["after"]
        kinds.add(kind)
        assert 3 <= len(before) <= 6
        old, new = the_change(kind, before, after)
        subject, context = (new, after) if kind == "add" else (old, before)
        for caption in f["change_captions"][f"CLEVR_default_{name}"]:
            words = set(caption.split(" that is ")[0].split())
            assert names(subject, words), (caption, subject)
            if kind == "color":
                assert caption.split()[-1] == new["color"] != old["color"]
            if kind == "material":
                assert caption.split()[-1] in MATERIAL_WORDS[new["material"]]
            relation = RELATION.search(caption)
            if relation:  # "that is left of the big cyan ...": some big cyan object of the scene is to the right
                where, size, color = relation.groups()
                assert any(relation_holds(where, subject, o) for o in context
                           if o["color"] == color and size in SIZE_WORDS[o["size"]] and o != subject), caption
        no_change = " ".join(f["no_change_captions"][f"CLEVR_default_{name}"]).split()
        assert not set(no_change) & set(synth.COLORS)
    assert kinds == set(synth.CHANGES)


def test_images_change_only_around_the_changed_object(dataset):
    root, f = dataset
    for name, scene in f["scenes"].items():
        before, after, distractor = (np.asarray(Image.open(root / d / f"CLEVR_{p}_{name}"), dtype=int) for d, p in
                                     (("images", "default"), ("sc_images", "semantic"), ("nsc_images", "nonsemantic")))
        ys, xs = np.nonzero(np.abs(before - after).sum(-1))
        assert len(xs) > 100, name
        old, new = the_change(scene["change_type"], scene["before"], scene["after"])
        boxes = [(o["x"] - 1.6 * r, o["x"] + 1.6 * r, o["y"] - 2.2 * r, o["y"] + 0.6 * r)
                 for o in (old, new) if o for r in [synth.radius(o)]]
        inside = np.zeros(len(xs), bool)
        for x0, x1, y0, y1 in boxes:
            inside |= (xs >= x0) & (xs <= x1) & (ys >= y0) & (ys <= y1)
        assert inside.all(), name
        assert np.abs(before - distractor).mean() > 1  # viewpoint / light differ over the whole image
        camera = scene["distractor_camera"]
        assert abs(camera["dx"]) <= 10 and abs(camera["dy"]) <= 6 and abs(camera["zoom"] - 1) <= 0.06
        assert 0.08 <= abs(camera["light"] - 1) <= 0.2


def test_distractor_camera_shifts_and_zooms_the_objects():
    cube = {"shape": "cube", "color": "red", "material": "rubber", "size": "large", "x": 300.0, "y": 200.0}

    def red_box(**camera):
        image = np.asarray(synth.render([cube], {**synth.SAME_CAMERA, **camera}), dtype=int)
        ys, xs = np.nonzero(image[..., 0] - image[..., 2] > 40)
        return np.array([xs.min(), xs.max(), ys.min(), ys.max()])

    box = red_box()
    assert np.abs(red_box(dx=10, dy=-5) - box - [10, 10, -5, -5]).max() <= 1
    zoomed = red_box(zoom=1.06)
    assert abs((zoomed[1] - zoomed[0]) / (box[1] - box[0]) - 1.06) < 0.03
    assert zoomed[0] > box[0] and zoomed[3] > box[3]  # right of and below the centre: pushed outwards
    assert np.array_equal(red_box(light=0.85), box)


def test_distractor_cameras_move_zoom_and_light_either_way_within_their_ranges():
    cameras = [synth.synth_pair(i, seed=0)[0]["distractor_camera"] for i in range(200)]
    assert all(abs(c["dx"]) <= 10 and abs(c["dy"]) <= 6 and 0.94 <= c["zoom"] <= 1.06 for c in cameras)
    assert all(0.08 <= round(abs(c["light"] - 1), 3) <= 0.2 for c in cameras)
    assert min(c["light"] for c in cameras) < 1 < max(c["light"] for c in cameras)
    assert min(c["dx"] for c in cameras) < 0 < max(c["dx"] for c in cameras)


def test_ensure_synth_generates_only_when_missing(tmp_path, caplog):
    root = synth.ensure_synth(tmp_path / "s", pairs=10, seed=1)
    assert len(data.read_split("synth", root, "train")) == 8
    stamp = (root / "scenes.json").stat().st_mtime_ns
    synth.ensure_synth(root, pairs=10, seed=1)
    assert (root / "scenes.json").stat().st_mtime_ns == stamp and "holds" not in caplog.text
    synth.ensure_synth(root, pairs=12, seed=1)  # a dataset of another size is used as it is, and said so
    assert (root / "scenes.json").stat().st_mtime_ns == stamp
    assert f"{root} holds 10 pairs, not the 12 asked for: delete it to generate those" in caplog.text
    (root / "scenes.json").write_text((root / "scenes.json").read_text()[:100])  # a copy cut short
    with pytest.raises(cli.InputError, match=r"scenes.json: malformed JSON at line 1 "):
        synth.ensure_synth(root, pairs=10, seed=1)


DRAW_PAIR = synth.draw_pair


def draw_or_fail(i, seed, folder):  # at module level: the pool's workers receive it by name
    if i == 7:
        raise OSError("disk full")
    return DRAW_PAIR(i, seed, folder)


def test_a_drawing_that_fails_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "draw_pair", draw_or_fail)
    with pytest.raises(OSError, match="disk full"):
        synth.write_synth(tmp_path / "s", 10, seed=1)
    assert list(tmp_path.iterdir()) == []


def test_val_and_test_hold_a_tenth_of_the_pairs_each_and_at_most_200(tmp_path, monkeypatch):
    @contextlib.contextmanager
    def in_process(workers):
        yield types.SimpleNamespace(imap=lambda draw, items, chunksize: map(draw, items))
    monkeypatch.setattr(synth, "worker_pool", in_process)
    monkeypatch.setattr(synth, "draw_pair", lambda i, seed, folder: (f"{i:06d}.png", {"change_type": "add"}, [], []))
    for pairs, held_out in ((100, 10), (2500, 200)):
        synth.write_synth(tmp_path / str(pairs), pairs, seed=0)
        splits = json.loads((tmp_path / str(pairs) / "splits.json").read_text())
        assert [len(splits[s]) for s in ("train", "val", "test")] == [pairs - 2 * held_out, held_out, held_out]
        assert sorted(i for s in splits.values() for i in s) == list(range(pairs))


def test_grades_count_what_captions_say_of_the_scene_graph():
    pairs = [synth.synth_pair(i, 0) for i in range(100)]  # 20 of each change type
    items = [data.Pair(str(i), None, None, captions, scene["change_type"], scene=scene)
             for i, (scene, captions, _) in enumerate(pairs)]
    items += [data.Pair(f"{i}_n", None, None, no_change, "distractor") for i, (_, _, no_change) in enumerate(pairs)]
    references = {item.id: item.captions[0] for item in items}
    grades = synth.grade(items, references)
    assert (grades["change"], grades["move"], grades["distractor"]) == (100, 100, 100)
    shapes = [synth.named_shape(item.captions[0]) for item in items if item.scene]
    assert grades["shape"] == sum(s is not None for s in shapes)  # of 100: where a reference names it, rightly

    def caption(scene, verb_of, value):
        old, new = synth.changed_object(scene)
        obj = old or new
        return f"the {obj['size']} {obj['color']} {obj['shape']} {verb_of[scene['change_type']]}{value(old, new)}"
    right = {"move": "moved", "add": "has been added", "drop": "is missing", "color": "turned ", "material": "is now "}
    new_value = lambda old, new: new["color"] if old and new and old["color"] != new["color"] else (
        new["material"] if old and new and old["material"] != new["material"] else "")
    old_value = lambda old, new: old["color"] if old and new and old["color"] != new["color"] else (
        old["material"] if old and new and old["material"] != new["material"] else "")
    changes = [item for item in items if item.scene]
    told = {i.id: caption(i.scene, right, new_value) for i in changes}
    assert synth.grade(changes, told) == {"change": 100, "shape": 100, "move": 100, "distractor": None}
    stale = {i.id: caption(i.scene, right, old_value) for i in changes}  # the old colour or material: wrong
    assert synth.grade(changes, stale)["change"] == 60  # move, add and drop alone
    wrong_verb = {i.id: caption(i.scene, {**right, "move": "became ", "add": "is gone"}, new_value) for i in changes}
    assert synth.grade(changes, wrong_verb)["change"] == 60 and synth.grade(changes, wrong_verb)["move"] == 0
    other_shape = {k: c.replace("cube", "ball").replace("sphere", "block").replace("cylinder", "cube")
                   for k, c in told.items()}
    assert synth.grade(changes, other_shape)["shape"] == 0
    assert synth.named_shape("the small red thing that is left of the big blue ball") is None
    distractors = [item for item in items if not item.scene][:2]
    assert synth.grade(distractors, {distractors[0].id: "Nothing has changed.", distractors[1].id: "the cube moved"}
                       )["distractor"] == 50
