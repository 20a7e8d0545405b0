"""The CLEVR-Change, Spot-the-Diff, Image-Editing-Request, Birds-to-Words and CLEVR-DC readers on tiny folders in
each published layout."""
import json
import logging
import os

import pytest
import torch
from PIL import Image

import cli
import data
import evaluate


def png(path, color=(200, 10, 10), size=(12, 8)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def write_clevr(root, ids=(1, 2, 3), uncaptioned=()):
    for i in ids:
        png(root / "images" / f"CLEVR_default_{i:06d}.png")
        png(root / "sc_images" / f"CLEVR_semantic_{i:06d}.png")
        png(root / "nsc_images" / f"CLEVR_nonsemantic_{i:06d}.png")
    captioned = [i for i in ids if i not in uncaptioned]
    change = {f"CLEVR_default_{i:06d}.png": [f"change {i} a", f"change {i} b"] for i in captioned}
    no_change = {f"CLEVR_default_{i:06d}.png": ["no change", "nothing has changed"] for i in ids}
    files = {"splits": {"train": list(ids), "val": [], "test": []}, "change_captions": change,
             "no_change_captions": no_change, "type_mapping": {"color": ["000001.png"], "move": ["000002.png"]}}
    for name, content in files.items():
        (root / f"{name}.json").write_text(json.dumps(content))


def test_clevr_pairs_follow_the_published_layout(tmp_path):
    write_clevr(tmp_path)
    pairs = data.read_split("clevr", tmp_path, "train")
    assert [p.id for p in pairs] == ["000001.png", "000002.png", "000003.png"]
    p = pairs[0]
    assert p.before == tmp_path / "images" / "CLEVR_default_000001.png"
    assert p.after == tmp_path / "sc_images" / "CLEVR_semantic_000001.png"
    assert p.distractor == tmp_path / "nsc_images" / "CLEVR_nonsemantic_000001.png"
    assert p.captions == ["change 1 a", "change 1 b"] and p.distractor_captions == ["no change", "nothing has changed"]
    assert [p.change_type for p in pairs] == ["color", "move", None]
    assert data.read_split("synth", tmp_path, "train") == pairs


def test_clevr_eval_items_add_each_distractor_as_a_no_change_pair(tmp_path):
    write_clevr(tmp_path, ids=(1, 2))
    items = data.eval_items(data.read_split("clevr", tmp_path, "train"))
    assert [i.id for i in items] == ["000001.png", "000001.png_n", "000002.png", "000002.png_n"]
    n = items[1]
    assert (n.before, n.after) == (items[0].before, items[0].distractor)
    assert n.captions == ["no change", "nothing has changed"] and n.change_type == "distractor"


def test_clevr_ids_without_captions_are_skipped_and_counted(tmp_path, caplog):
    write_clevr(tmp_path, ids=(1, 2, 3, 4), uncaptioned=(2,))
    no_change = json.loads((tmp_path / "no_change_captions.json").read_text())
    del no_change["CLEVR_default_000004.png"]
    (tmp_path / "no_change_captions.json").write_text(json.dumps(no_change))
    with caplog.at_level(logging.WARNING):
        pairs = data.read_split("clevr", tmp_path, "train")
    assert [p.id for p in pairs] == ["000001.png", "000003.png"]
    assert "skipped 2 of 4 ids" in caplog.text and "2, 4" in caplog.text


def test_clevr_unknown_split_is_named(tmp_path):
    write_clevr(tmp_path)
    with pytest.raises(ValueError, match="no split 'dev'.*train, val, test"):
        data.read_split("clevr", tmp_path, "dev")


@pytest.mark.parametrize("dataset, url", [("clevr", "Seth-Park/RobustChangeCaptioning"),
                                          ("spot", "harsh19/spot-the-diff"), ("ier", "airsplay/VisualRelationships"),
                                          ("birds", "google-research-datasets/birds-to-words"),
                                          ("clevr_dc", "hsgkim/clevr-dc")])
def test_missing_root_names_path_layout_and_source(tmp_path, dataset, url):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nowhere'}: no such folder; expected .* layout .*{url}"):
        data.read_split(dataset, tmp_path / "nowhere", "train")


def test_missing_json_names_the_file(tmp_path):
    write_clevr(tmp_path)
    (tmp_path / "type_mapping.json").unlink()
    with pytest.raises(FileNotFoundError, match="type_mapping.json: not found; expected CLEVR-Change's layout"):
        data.read_split("clevr", tmp_path, "train")


def test_malformed_json_names_file_and_position(tmp_path):
    write_clevr(tmp_path)
    (tmp_path / "splits.json").write_text('{"train": [1, 2,\n  3 "val": []}')
    with pytest.raises(ValueError, match=r"splits.json: malformed JSON at line 2 column 5 \(char 21\)"):
        data.read_split("clevr", tmp_path, "train")


def test_json_that_python_does_not_read_is_named(tmp_path):
    write_clevr(tmp_path)
    (tmp_path / "splits.json").write_text("[" * 100_000 + "]" * 100_000)  # valid JSON, too deep for Python's parser
    with pytest.raises(ValueError, match=r"splits.json: JSON that Python does not read \(maximum recursion depth"):
        data.read_split("clevr", tmp_path, "train")


def test_missing_images_report_first_ids_and_count(tmp_path):
    write_clevr(tmp_path, ids=tuple(range(1, 9)))
    for i in range(2, 9):
        (tmp_path / "sc_images" / f"CLEVR_semantic_{i:06d}.png").unlink()
    with pytest.raises(FileNotFoundError) as e:
        data.read_split("clevr", tmp_path, "train")
    message = str(e.value)
    assert "CLEVR_semantic_000002.png: not found" in message and "7 of 8 train pairs lack image files" in message
    assert "ids 000002.png, 000003.png, 000004.png, 000005.png, 000006.png, ...)" in message


def test_a_folder_or_pipe_where_an_image_belongs_is_no_file(tmp_path):
    write_clevr(tmp_path)
    image = tmp_path / "sc_images" / "CLEVR_semantic_000002.png"
    image.unlink()
    image.mkdir()
    with pytest.raises(FileNotFoundError, match="CLEVR_semantic_000002.png: not a file, and 1 of 3 train pairs lack"):
        data.read_split("clevr", tmp_path, "train")
    image.rmdir()
    os.mkfifo(image)
    with pytest.raises(FileNotFoundError, match="CLEVR_semantic_000002.png: not a file, and 1 of 3 train pairs lack"):
        data.read_split("clevr", tmp_path, "train")


def test_missing_image_folder_is_reported(tmp_path):
    write_clevr(tmp_path)
    for f in (tmp_path / "nsc_images").iterdir():
        f.unlink()
    (tmp_path / "nsc_images").rmdir()
    with pytest.raises(FileNotFoundError, match="nsc_images/CLEVR_nonsemantic_000001.png: not found, and 3 of 3"):
        data.read_split("clevr", tmp_path, "train")


def test_corrupt_image_names_the_file(tmp_path):
    write_clevr(tmp_path)
    bad = tmp_path / "images" / "CLEVR_default_000002.png"
    bad.write_bytes(bad.read_bytes()[:40])  # a truncated PNG
    pairs = data.read_split("clevr", tmp_path, "train")
    data.read_pixels(pairs[0].before, 16)
    with pytest.raises(ValueError, match=f"{bad}: cannot read image"):
        data.read_pixels(pairs[1].before, 16)
    (tmp_path / "junk.png").write_text("not an image")
    with pytest.raises(ValueError, match="junk.png: cannot read image"):
        data.read_pixels(tmp_path / "junk.png", 16)


def write_spot(root, folder="resized_images", annotations="annotations"):
    entries = {"train": [{"img_id": "400", "sentences": ["a car is gone"]}, {"img_id": "7", "sentences": ["x", "y"]},
                         {"img_id": "400", "sentences": ["the person moved", "nothing else"]}],
               "val": [{"img_id": "9", "sentences": ["z"]}], "test": []}
    (root / annotations).mkdir(parents=True, exist_ok=True)
    for split, content in entries.items():
        (root / annotations / f"{split}.json").write_text(json.dumps(content))
    for i in ("400", "7", "9"):
        png(root / folder / f"{i}.png")
        png(root / folder / f"{i}_2.png")


def test_spot_merges_entries_of_one_image_pair(tmp_path):
    write_spot(tmp_path)
    pairs = data.read_split("spot", tmp_path, "train")
    assert [p.id for p in pairs] == ["400.png", "7.png"]
    assert pairs[0].captions == ["a car is gone", "the person moved", "nothing else"]
    assert pairs[0].before == tmp_path / "resized_images" / "400.png"
    assert pairs[0].after == tmp_path / "resized_images" / "400_2.png"
    assert pairs[0].change_type is None and pairs[0].distractor is None
    assert data.eval_items(pairs) == pairs


def test_spot_also_reads_jsons_at_the_root_and_an_images_folder(tmp_path):
    write_spot(tmp_path, folder="images", annotations=".")
    assert [p.after.name for p in data.read_split("spot", tmp_path, "val")] == ["9_2.png"]


def test_spot_entry_without_sentences_is_named(tmp_path):
    write_spot(tmp_path)
    (tmp_path / "annotations" / "val.json").write_text(json.dumps([{"img_id": "9", "sentences": []}, {"img_id": "3"}]))
    with pytest.raises(ValueError, match="val.json: entry 1 is not an object with keys img_id, sentences"):
        data.read_split("spot", tmp_path, "val")


@pytest.mark.parametrize("img_id, shown", [(None, "null"), (36.0, "36.0"), (True, "true")])
def test_spot_img_id_that_cannot_name_images_is_refused(tmp_path, img_id, shown):
    write_spot(tmp_path)
    (tmp_path / "annotations" / "val.json").write_text(json.dumps([{"img_id": 9, "sentences": ["z"]},
                                                                   {"img_id": img_id, "sentences": ["z"]}]))
    with pytest.raises(cli.InputError, match=f"val.json: entry 1: img_id {shown}; expected a string or an integer$"):
        data.read_split("spot", tmp_path, "val")


def test_spot_missing_after_image(tmp_path):
    write_spot(tmp_path)
    (tmp_path / "resized_images" / "7_2.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"7_2.png: not found, and 1 of 2 train pairs lack image files \(ids 7.png\)"
                                                r".*harsh19/spot-the-diff"):
        data.read_split("spot", tmp_path, "train")


def test_scored_splits_keep_empty_references_as_the_authors_score_them(tmp_path):
    """Spot-the-Diff's published test.json has 7 pairs whose one sentence is "": the authors' references
    (gt/spot_total_change_captions_reformat.json) hold all 1,270 pairs, those 7 too, and so does their test loader."""
    write_spot(tmp_path)
    entries = [{"img_id": "400", "sentences": ["a car is gone"]}, {"img_id": "7", "sentences": [""]},
               {"img_id": "9", "sentences": ["z", " ... "]}]
    for split in ("train", "val", "test"):
        (tmp_path / "annotations" / f"{split}.json").write_text(json.dumps(entries))
    for split in ("val", "test"):
        assert [(p.id, p.captions) for p in data.read_split("spot", tmp_path, split)] == [
            ("400.png", ["a car is gone"]), ("7.png", [""]), ("9.png", ["z", " ... "])]
    assert [(p.id, p.captions) for p in data.read_split("spot", tmp_path, "train")] == [
        ("400.png", ["a car is gone"]), ("9.png", ["z"])]  # nothing to learn from a caption without words


def write_ier(root):
    names = {"a.jpg": "JPEG", "b.PNG": "PNG", "c.JPG": "JPEG", "d.gif": "GIF", "e.jpeg": "JPEG"}
    (root / "images").mkdir(parents=True)
    for name, fmt in names.items():
        Image.new("RGB", (10, 6), (30, 200, 30)).save(root / "images" / name, format=fmt)
    test = [{"img0": "a.jpg", "img1": "b.PNG", "sents": ["s1", "s2", "s3"], "uid": "Reddit_1"},
            {"img0": "c.JPG", "img1": "d.gif", "sents": ["t1", "t2", "t3"], "uid": "Reddit_2"}]
    valid = [{"img0": "e.jpeg", "img1": "a.jpg", "sents": ["brighten it"], "uid": "Reddit_3"}]
    (root / "dataset" / "adobe").mkdir(parents=True)
    (root / "dataset" / "adobe" / "test.json").write_text(json.dumps(test))
    (root / "dataset" / "adobe" / "valid.json").write_text(json.dumps(valid))


def test_ier_reads_mixed_image_formats(tmp_path):
    write_ier(tmp_path)
    pairs = data.read_split("ier", tmp_path, "test")
    assert [p.id for p in pairs] == ["Reddit_1", "Reddit_2"]
    assert all(len(p.captions) == 3 for p in pairs)
    assert pairs[1].after == tmp_path / "images" / "d.gif"
    for p in pairs:
        for path in (p.before, p.after):
            image = data.read_pixels(path, 8)
            assert image.shape == (3, 8, 8) and image.dtype == torch.uint8
            assert (image[:, 4, 4].int() - torch.tensor([30, 200, 30])).abs().max() <= 8  # jpeg is lossy


def test_ier_accepts_val_for_valid(tmp_path):
    write_ier(tmp_path)
    assert [p.id for p in data.read_split("ier", tmp_path, "val")] == ["Reddit_3"]


def test_ier_missing_split_json(tmp_path):
    write_ier(tmp_path)
    with pytest.raises(FileNotFoundError, match="train.json: not found; expected Image-Editing-Request's layout"):
        data.read_split("ier", tmp_path, "train")


def test_unknown_dataset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'coco'"):
        data.read_split("coco", tmp_path, "train")


# ---------------------------------------------------------------------------------------------
# malformed files: one InputError naming the file and what was expected
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, content, message", [
    ("splits", [1, 2, 3], "splits.json: top level is a list; expected a JSON object"),
    ("splits", {"train": 3}, "splits.json: split 'train': expected a list of integer image ids"),
    ("splits", {"train": [0, True]}, "splits.json: split 'train': expected a list of integer image ids"),  # JSON true is not id 1
    ("change_captions", [["change 1 a"]], "change_captions.json: top level is a list; expected a JSON object"),
    ("type_mapping", ["000001.png"], "type_mapping.json: top level is a list; expected a JSON object"),
    ("type_mapping", {"color": 1}, "type_mapping.json: 'color': expected a list of image names such as "
                                   "\"000001.png\", got 1"),
    ("type_mapping", {"color": "000001.png"}, "type_mapping.json: 'color': expected a list of image names"),
    ("type_mapping", {"added": ["000001.png"]}, "type_mapping.json: change type 'added'; expected CLEVR-Change's "
                                                "color, material, add, drop, move"),
])
def test_clevr_json_of_the_wrong_shape_is_named(tmp_path, name, content, message):
    write_clevr(tmp_path)
    (tmp_path / f"{name}.json").write_text(json.dumps(content))
    with pytest.raises(cli.InputError) as e:
        data.read_split("clevr", tmp_path, "train")
    assert str(e.value).startswith(f"{tmp_path / name}.json: ") and message in str(e.value)


def test_spot_json_of_the_wrong_shape_is_named(tmp_path):
    write_spot(tmp_path)
    (tmp_path / "annotations" / "val.json").write_text(json.dumps({"img_id": "9", "sentences": ["z"]}))
    with pytest.raises(cli.InputError, match="val.json: top level is a dict; expected a list of objects with keys "
                                              "img_id, sentences"):
        data.read_split("spot", tmp_path, "val")


@pytest.mark.parametrize("content, message", [
    (b'{"train": [1], "val": "caf\xe9"}', r"byte 26 is not UTF-8 \(invalid continuation byte\); expected JSON in UTF-8"),
    ('{"train": [1]}'.encode("utf-16"), r"byte 0 is not UTF-8 \(invalid start byte\); expected JSON in UTF-8"),
])
def test_json_not_in_utf8_is_named(tmp_path, content, message):
    write_clevr(tmp_path)
    (tmp_path / "splits.json").write_bytes(content)
    with pytest.raises(cli.InputError, match=f"{tmp_path / 'splits.json'}: {message}"):
        data.read_split("clevr", tmp_path, "train")


def test_a_lone_surrogate_in_a_caption_is_named_with_file_and_id(tmp_path):
    write_clevr(tmp_path)
    change = json.loads((tmp_path / "change_captions.json").read_text())
    change["CLEVR_default_000002.png"][1] = "the cube \ud800 moved"
    (tmp_path / "change_captions.json").write_text(json.dumps(change))  # valid JSON: "\ud800" is escaped
    with pytest.raises(cli.InputError, match=r"change_captions.json: CLEVR_default_000002.png: a caption holds the "
                                              r'lone surrogate "\\ud800"; expected text that UTF-8 can encode'):
        data.read_split("clevr", tmp_path, "train")


def test_ier_uids_and_image_names_of_other_types(tmp_path):
    write_ier(tmp_path)
    path = tmp_path / "dataset" / "adobe" / "test.json"
    entries = json.loads(path.read_text())
    entries[0]["uid"], entries[1]["uid"], entries[1]["img1"] = 5, 6, "gone.png"
    path.write_text(json.dumps(entries))
    assert [p.id for p in data.read_split("ier", tmp_path, "val")] == ["Reddit_3"]
    with pytest.raises(FileNotFoundError, match=r"gone.png: not found, and 1 of 2 test pairs lack image files \(ids 6\)"):
        data.read_split("ier", tmp_path, "test")  # an integer uid names its pair as a string
    entries[1]["img1"] = "d.gif"
    path.write_text(json.dumps(entries))
    assert [p.id for p in data.read_split("ier", tmp_path, "test")] == ["5", "6"]
    entries[1]["uid"] = ["Reddit", 2]
    path.write_text(json.dumps(entries))
    with pytest.raises(cli.InputError, match=r'test.json: entry 1: uid \["Reddit", 2\]; expected a string or an integer'):
        data.read_split("ier", tmp_path, "test")
    entries[1]["uid"], entries[1]["img0"] = "Reddit_2", 3
    path.write_text(json.dumps(entries))
    with pytest.raises(cli.InputError, match=r"test.json: entry 1 \(uid 'Reddit_2'\): img0 3, img1 \"d.gif\"; "
                                              "expected image file names"):
        data.read_split("ier", tmp_path, "test")


def test_an_empty_split_is_refused(tmp_path, caplog):
    write_clevr(tmp_path)
    with pytest.raises(cli.InputError, match=f"^{tmp_path} test: no pairs; each split needs at least one$"):
        data.read_split("clevr", tmp_path, "test")
    write_spot(tmp_path / "spot")
    with pytest.raises(cli.InputError, match=f"^{tmp_path / 'spot'} test: no pairs; each split needs at least one$"):
        data.read_split("spot", tmp_path / "spot", "test")
    (tmp_path / "spot" / "annotations" / "train.json").write_text(json.dumps([{"img_id": "9", "sentences": ["..."]}]))
    with pytest.raises(cli.InputError, match="train: no pairs; each split needs at least one"):
        data.read_split("spot", tmp_path / "spot", "train")  # no pair is left with a worded caption


# ---------------------------------------------------------------------------------------------
# Birds-to-Words: one tsv of image URLs, the photos fetched into images/<photo id>.jpg
# ---------------------------------------------------------------------------------------------
BIRDS_HEADER = ["img1ObservationURL", "img1ImgURL", "img1Species", "img1Selection", "img2ObservationURL", "img2ImgURL",
                "img2Species", "img2Selection", "split", "annN", "description"]  # the published README's eleven columns


def birds_row(a, b, split, n, description):
    photo = "https://static.inaturalist.org/photos/{}/medium.jpg?14871{}".format
    return [f"https://www.inaturalist.org/observations/9{a}", photo(a, n), "Larus occidentalis", "base",
            f"https://www.inaturalist.org/observations/9{b}", photo(b, n), "Larus argentatus", "sameGenus", split, str(n),
            description]


def write_birds(root, rows=None):
    rows = rows or [birds_row(647514, 5595152, "train", 1, "Animal1 is brown and white. Animal2 has a blue face."),
                    birds_row(11, 12, "train", 1, "animal1 is smaller"),
                    birds_row(647514, 5595152, "train", 2, "Animal2 has a longer tail."),
                    birds_row(13, 647514, "test", 1, "animal2 has a spotted breast")]
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "birds-to-words-v1.0.tsv").write_text("\n".join("\t".join(r) for r in [BIRDS_HEADER, *rows]) + "\n")
    for photo in (647514, 5595152, 11, 12, 13):
        Image.new("RGB", (12, 8), (photo % 250, 90, 20)).save(root / "images" / f"{photo}.jpg")


def test_birds_pairs_follow_the_published_layout(tmp_path):
    write_birds(tmp_path)
    pairs = data.read_split("birds", tmp_path, "train")
    assert [(p.id, p.captions) for p in pairs] == [
        ("647514_5595152", ["Animal1 is brown and white. Animal2 has a blue face.", "Animal2 has a longer tail."]),
        ("11_12", ["animal1 is smaller"])]
    assert (pairs[0].before, pairs[0].after) == (tmp_path / "images" / "647514.jpg", tmp_path / "images" / "5595152.jpg")
    assert pairs[0].change_type is None and pairs[0].distractor is None and data.eval_items(pairs) == pairs
    assert [p.id for p in data.read_split("birds", tmp_path, "test")] == ["13_647514"]
    assert data.read_pixels(pairs[0].before, 8).shape == (3, 8, 8)


@pytest.mark.parametrize("change, message", [
    (lambda rows: [r[:10] for r in rows], r"no column description in its header row; expected img1ImgURL, img2ImgURL, "
                                          r"split, description among them"),
    (lambda rows: rows[:2] + [rows[2][:9]], r"line 3 has 9 tab-separated fields; expected 11, as its header"),
    (lambda rows: rows[:2] + [rows[2][:5] + ["https://example.org/bird.jpg"] + rows[2][6:]],
     r"line 3: img2ImgURL 'https://example.org/bird.jpg'; expected an iNaturalist photo URL such as "),
])
def test_birds_rows_without_a_column_or_photo_id_are_named(tmp_path, change, message):
    write_birds(tmp_path)
    rows = [line.split("\t") for line in (tmp_path / "birds-to-words-v1.0.tsv").read_text().splitlines()]
    (tmp_path / "birds-to-words-v1.0.tsv").write_text("\n".join("\t".join(r) for r in change(rows)))
    with pytest.raises(cli.InputError, match=f"^{tmp_path / 'birds-to-words-v1.0.tsv'}: {message}"):
        data.read_split("birds", tmp_path, "train")


def test_birds_missing_tsv_and_photo_are_named(tmp_path):
    write_birds(tmp_path)
    (tmp_path / "images" / "12.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"images/12.jpg: not found, and 1 of 2 train pairs lack image files "
                                                r"\(ids 11_12\); expected Birds-to-Words's layout .*images/<photo id>.jpg"):
        data.read_split("birds", tmp_path, "train")
    (tmp_path / "birds-to-words-v1.0.tsv").unlink()
    with pytest.raises(FileNotFoundError, match="birds-to-words-v1.0.tsv: not found; expected Birds-to-Words's layout"):
        data.read_split("birds", tmp_path, "train")


# ---------------------------------------------------------------------------------------------
# CLEVR-DC: split.json, captions.json, bef/ and aft/; the change type read off the captions' wording
# ---------------------------------------------------------------------------------------------
DC_CAPTIONS = [  # worded as CLEVR-Change's templates word each type, and a pair worded as none
    ("color", ["the small red rubber cube changed to yellow", "the red cube behind the gray sphere turned yellow",
               "the tiny matte block became yellow", "the red cube is in a different location"]),  # most say colour
    ("texture", ["the large blue rubber sphere became metallic", "the blue ball turned shiny"]),
    ("move", ["the green cylinder changed its location", "someone moved the green cylinder"]),
    ("add", ["a small purple cube has been added", "the tiny purple thing has been newly placed"]),
    ("drop", ["the brown sphere has disappeared", "the large brown ball is missing", "the ball is no longer there"]),
    ("distractor", ["no change was made", "the scene remains the same", "the two scenes seem identical"]),
    (None, ["look closely at both pictures"]),
]


def write_clevr_dc(root, ids=range(7), numbered=False):
    for folder in ("bef", "aft"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for i in ids:
            png(root / folder / f"{i}.png", (10 * i, 200 if folder == "aft" else 0, 0))
    (root / "split.json").write_text(json.dumps({"train": list(ids)[:-1], "val": [], "test": list(ids)[-1:]}))
    captions = {str(i): [f"{c} in scene {i}" if numbered else c for c in DC_CAPTIONS[i % 7][1]] for i in ids}
    (root / "captions.json").write_text(json.dumps(captions))


def test_clevr_dc_pairs_follow_the_published_layout_and_their_wording_gives_the_change_type(tmp_path):
    write_clevr_dc(tmp_path)
    pairs = data.read_split("clevr_dc", tmp_path, "train") + data.read_split("clevr_dc", tmp_path, "test")
    assert [p.id for p in pairs] == ["0", "1", "2", "3", "4", "5", "6"]
    assert [p.change_type for p in pairs] == [kind for kind, _ in DC_CAPTIONS]
    assert (pairs[3].before, pairs[3].after) == (tmp_path / "bef" / "3.png", tmp_path / "aft" / "3.png")
    assert pairs[5].captions == DC_CAPTIONS[5][1] and pairs[5].distractor is None
    assert data.eval_items(pairs) == pairs  # a no-change pair is a pair of its own, not a second after image


def test_clevr_dc_missing_captions_and_images_are_named(tmp_path):
    write_clevr_dc(tmp_path)
    (tmp_path / "aft" / "3.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"aft/3.png: not found, and 1 of 6 train pairs lack image files "
                                                r"\(ids 3\); expected CLEVR-DC's layout"):
        data.read_split("clevr_dc", tmp_path, "train")
    captions = json.loads((tmp_path / "captions.json").read_text())
    del captions["2"], captions["4"]
    (tmp_path / "captions.json").write_text(json.dumps(captions))
    with pytest.raises(cli.InputError, match=r"captions.json: no captions for 2 of the 6 train ids in split.json "
                                              r"\(first: 2, 4\)$"):
        data.read_split("clevr_dc", tmp_path, "train")
    (tmp_path / "split.json").unlink()
    with pytest.raises(FileNotFoundError, match="split.json: not found; expected CLEVR-DC's layout .*hsgkim/clevr-dc"):
        data.read_split("clevr_dc", tmp_path, "train")


@pytest.mark.slow
def test_clevr_dc_predictions_get_cider_by_the_change_type_of_their_wording(tmp_path, capsys):
    write_clevr_dc(tmp_path, ids=range(14), numbered=True)  # CIDEr rewards what sets a pair's references apart
    items = data.eval_items(data.read_split("clevr_dc", tmp_path, "train"))  # ids 0-12: 1-2 of each type
    preds = {i.id: "zzz qqq" if i.change_type == "move" else i.captions[0] for i in items}  # right but on moves
    evaluate.write_predictions(tmp_path / "preds.json", preds)
    evaluate.main(["--predictions", str(tmp_path / "preds.json"), "--data", "clevr_dc", "--data_root", str(tmp_path),
                   "--split", "train"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "clevr_dc train: 13 image pairs" and printed[-2].split() == ["C", "T", "M", "A", "D", "DI"]
    per_type = dict(zip(evaluate.CHANGE_TYPES, map(float, printed[-1].split())))
    assert per_type["move"] == 0 and min(v for t, v in per_type.items() if t != "move") > 100
