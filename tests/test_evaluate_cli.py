"""`python evaluate.py --predictions ...` on a tiny folder in CLEVR-Change's layout: references come
from data.py's readers, the json holds the paper's metrics and the per-type CIDEr of Table 2."""
import json

import pytest
from PIL import Image

import data
import evaluate

OBJECTS = ["red cube", "blue sphere", "green cylinder"]
TEMPLATES = {"color": "the {} changed its color", "material": "the {} changed its material",
             "add": "a {} has been added", "drop": "the {} has disappeared", "move": "the {} moved"}


def write_clevr_change(root):
    """Pairs 0-14 (three of each change type) form the test split; 15 and 16 are train and val."""
    change, no_change, type_mapping = {}, {}, {t: [] for t in TEMPLATES}
    for index in range(17):
        change_type, obj = list(TEMPLATES)[index // 3 % 5], OBJECTS[index % 3]
        name = f"CLEVR_default_{index:06d}.png"
        change[name] = [TEMPLATES[change_type].format(obj) + ".", f"Look, the {obj} is different."]
        no_change[name] = ["Nothing has changed.", f"The {obj} did not change."]
        type_mapping[change_type].append(f"{index:06d}.png")
        for folder, prefix in (("images", "default"), ("sc_images", "semantic"), ("nsc_images", "nonsemantic")):
            (root / folder).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (index, 0, 0)).save(root / folder / f"CLEVR_{prefix}_{index:06d}.png")
    files = {"change_captions.json": change, "no_change_captions.json": no_change,
             "type_mapping.json": type_mapping, "splits.json": {"train": [15], "val": [16], "test": list(range(15))}}
    for file, content in files.items():
        (root / file).write_text(json.dumps(content))


def test_scores_a_predictions_file(tmp_path, capsys):
    root = tmp_path / "clevr"
    write_clevr_change(root)
    items = data.eval_items(data.read_split("clevr", root, "test"))
    assert len(items) == 30  # every change pair has its distractor
    # Right on every type but move. (CIDEr rewards the n-grams that set a pair's references apart, so
    # the distractors, which all share "nothing has changed", score low even when right.)
    preds = {i.id: "zzz qqq xxx" if i.change_type == "move" else i.captions[0] for i in items}
    evaluate.write_predictions(tmp_path / "preds.json", preds)
    assert evaluate.read_predictions(tmp_path / "preds.json") == preds

    evaluate.main(["--predictions", str(tmp_path / "preds.json"), "--data", "clevr", "--data_root", str(root),
                   "--split", "test", "--out", str(tmp_path / "out" / "metrics.json")])
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["test"]
    assert tuple(metrics) == evaluate.CAPTION_METRICS + ("per_type",)
    per_type = metrics["per_type"]
    assert tuple(per_type) == evaluate.CHANGE_TYPES
    assert per_type["move"] == 0 and per_type["color"] > 100 and per_type["texture"] > 100
    types = {i.id: i.change_type for i in items}
    assert per_type == evaluate.per_type_cider({i.id: i.captions for i in items}, preds, types)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "clevr test: 30 image pairs"
    assert printed[1].split() == ["B", "M", "C", "R"] and printed[-2].split() == ["C", "T", "M", "A", "D", "DI"]
    assert printed[-1].split()[2] == "0.0"


def test_duplicate_predictions_are_rejected(tmp_path):
    path = tmp_path / "preds.json"
    path.write_text(json.dumps([{"image_id": "000001.png", "caption": c} for c in ("a", "b")]))
    with pytest.raises(ValueError, match="more than one caption for image_id '000001.png'"):
        evaluate.read_predictions(path)
