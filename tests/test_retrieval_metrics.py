"""IP-T / T-IP retrieval metrics against rankings worked out by hand, ties included."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

import data
from evaluate import encode_split, format_retrieval, rank_summary, retrieval, retrieval_metrics
from tests.tiny import tiny_pair_encoder

# 4 image pairs, 6 captions; caption j describes pair TEXT_PAIR[j].
TEXT_PAIR = [0, 0, 1, 2, 2, 3]
SIM = np.array([
    # t0   t1   t2   t3   t4   t5
    [0.9, 0.2, 0.5, 0.1, 0.3, 0.0],  # p0
    [0.4, 0.8, 0.7, 0.6, 0.2, 0.0],  # p1
    [0.4, 0.1, 0.7, 0.2, 0.3, 0.5],  # p2
    [0.3, 0.5, 0.7, 0.6, 0.3, 0.5],  # p3
])
# T-IP, each caption's own pair among the 4 pairs (ties with the true score count against it):
#   t0: 0.9 beats all -> 1      t1: 0.2 < p1 0.8, p3 0.5 -> 3    t2: 0.7 tied by p2, p3 -> 3
#   t3: 0.2 < p1, p3 -> 3       t4: 0.3 tied by p0, p3 -> 3      t5: 0.5 tied by p2 -> 2
TEXT_TO_PAIR_RANKS = [1, 3, 3, 3, 3, 2]
# IP-T, a pair's best own caption against every other pair's best caption:
#   p0: own 0.9 vs p1 0.5, p2 0.3, p3 0.0 -> 1          p1: own 0.7 < p0 0.8 (t1) -> 2
#   p2: own 0.3 < p0 0.4, p1 0.7, p3 0.5 -> 4           p3: own 0.5 tied by p0 0.5 (t1), < p1 0.7, p2 0.6 -> 4
PAIR_TO_TEXT_RANKS = [1, 2, 4, 4]


def test_hand_computed_ranks():
    m = retrieval_metrics(SIM, TEXT_PAIR)
    assert m["text_to_pair"] == rank_summary(TEXT_TO_PAIR_RANKS)
    assert m["pair_to_text"] == rank_summary(PAIR_TO_TEXT_RANKS)
    assert m["text_to_pair"] == pytest.approx(
        {"R@1": 100 / 6, "R@5": 100.0, "R@10": 100.0, "R@20": 100.0, "R@50": 100.0, "MdR": 3.0, "MnR": 2.5})
    # Even count: the median is the mean of the middle two ranks, 2 and 4.
    assert m["pair_to_text"] == {"R@1": 25.0, "R@5": 100.0, "R@10": 100.0, "R@20": 100.0, "R@50": 100.0,
                                 "MdR": 3.0, "MnR": 2.75}


def test_torch_input_matches_numpy():
    sim = torch.tensor(SIM, dtype=torch.float32, requires_grad=True)
    expected = retrieval_metrics(SIM.astype(np.float32), TEXT_PAIR)
    assert retrieval_metrics(sim, torch.tensor(TEXT_PAIR)) == expected


def test_constant_scores_get_the_worst_rank():
    n_pairs, text_pair = 4, [0, 0, 1, 2, 2, 3]
    m = retrieval_metrics(np.zeros((n_pairs, len(text_pair))), text_pair)
    assert m["text_to_pair"]["MdR"] == m["text_to_pair"]["MnR"] == n_pairs
    assert m["pair_to_text"]["MdR"] == m["pair_to_text"]["MnR"] == n_pairs
    assert m["pair_to_text"]["R@1"] == m["text_to_pair"]["R@1"] == 0.0


def test_recall_cutoffs_of_tables_6_and_7():
    assert rank_summary([1, 5, 6, 10, 11, 2, 20, 21, 50, 51]) == pytest.approx(
        {"R@1": 10.0, "R@5": 30.0, "R@10": 50.0, "R@20": 70.0, "R@50": 90.0, "MdR": 10.5, "MnR": 17.7})


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="NaN"):
        retrieval_metrics(np.where(SIM > 0.8, np.nan, SIM), TEXT_PAIR)
    with pytest.raises(ValueError, match=r"pairs without any caption: \[3\]"):
        retrieval_metrics(SIM, [0, 0, 1, 2, 2, 2])
    with pytest.raises(ValueError, match="one pair index"):
        retrieval_metrics(SIM, [0, 0, 1, 2, 2, 4])
    with pytest.raises(ValueError, match="one pair index"):
        retrieval_metrics(SIM, [0, 0, 1, 2, 3, -1])


def test_pair_to_text_ranks_pairs_not_captions():
    # Pair 0 has 3 captions that all beat pair 1's only caption for pair 1: one competitor, not three.
    sim = np.array([[0.9, 0.8, 0.7, 0.1], [0.6, 0.6, 0.6, 0.5]])
    m = retrieval_metrics(sim, [0, 0, 0, 1])
    assert m["pair_to_text"]["MnR"] == (1 + 2) / 2


def test_another_pairs_caption_of_the_same_words_is_no_competitor():
    # Pairs 0 and 1 both have caption "A" (t0, t1), which ties for pair 0 at 0.9; t3 ties for pair 2 at 0.7
    # with a caption of other words: the first tie is a right answer for pair 0, the second counts.
    text_pair, text_id = [0, 1, 1, 2, 2], ["A", "A", "B", "C", "D"]
    sim = np.array([
        # t0   t1   t2   t3   t4
        [0.9, 0.9, 0.1, 0.2, 0.3],  # p0: own 0.9; p1's best without its "A" 0.1, p2's 0.3 -> 1
        [0.6, 0.6, 0.4, 0.5, 0.1],  # p1: own 0.6 ("A", both copies); p0's "A" no competitor, p2 0.5 -> 1
        [0.1, 0.7, 0.2, 0.6, 0.7],  # p2: own 0.7 (t4) tied by p1's t1 of other words -> 2
    ])
    assert retrieval_metrics(sim, text_pair, text_id)["pair_to_text"]["MnR"] == (1 + 1 + 2) / 3
    assert retrieval_metrics(sim, text_pair)["pair_to_text"]["MnR"] == (2 + 2 + 2) / 3  # every caption a text of its own
    with pytest.raises(ValueError, match="text_id must hold one id"):
        retrieval_metrics(sim, text_pair, text_id[:4])


def test_text_to_pair_median_is_the_lower_middle_rank_as_the_authors_take_it():
    sim = np.array([
        # t0   t1   t2   t3
        [0.9, 0.1, 0.1, 0.1],  # p0
        [0.1, 0.9, 0.1, 0.8],  # p1
        [0.1, 0.1, 0.5, 0.9],  # p2
        [0.1, 0.1, 0.9, 0.5],  # p3
    ])
    m = retrieval_metrics(sim, [0, 1, 2, 3])  # text -> pair ranks 1, 1, 2, 3: the middle two are 1 and 2
    assert m["text_to_pair"]["MnR"] == (1 + 1 + 2 + 3) / 4 and m["text_to_pair"]["MdR"] == 1.0
    assert rank_summary([1, 1, 2, 3])["MdR"] == 1.5  # pair -> text keeps the mean of the two, as numpy's


def test_captions_of_the_same_tokens_share_a_text_id(tmp_path):
    image = tmp_path / "x.png"
    Image.new("RGB", (40, 30), "gray").save(image)
    pairs = [data.Pair("0", image, image, ["The cube moved.", "a ball left"]),
             data.Pair("1", image, image, ["the cube  moved.", "the cube is gone"])]  # CLIP's tokenizer folds case, spaces
    *_, text_pair, text_id = encode_split(tiny_pair_encoder().eval(), pairs, torch.device("cpu"), workers=0)
    assert text_pair.tolist() == [0, 0, 1, 1]
    assert text_id[0] == text_id[2] and len(set(text_id.tolist())) == 3


def test_format_retrieval_prints_both_directions():
    lines = format_retrieval(retrieval_metrics(SIM, TEXT_PAIR)).splitlines()
    assert lines[0].split() == ["R@1", "R@5", "R@10", "R@20", "R@50", "MdR", "MnR"]
    assert lines[1].split()[-7:] == ["25.0", "100.0", "100.0", "100.0", "100.0", "3.0", "2.8"]
    assert lines[2].startswith("Text => Image Pair")
    assert lines[2].split()[-7:] == ["16.7", "100.0", "100.0", "100.0", "100.0", "3.0", "2.5"]


def test_pairs_of_the_same_two_images_do_not_compete():
    """Image-Editing-Request's test repeats 46 image pairs under other uids, with other captions: such
    pairs have one vector, so each would tie with the other and lose, were they counted apart."""
    sim = np.array([[0.9, 0.5, 0.1],
                    [0.9, 0.5, 0.1],  # pair 1: the images of pair 0
                    [0.2, 0.6, 0.8]])
    apart, one = retrieval_metrics(sim, [0, 1, 2]), retrieval_metrics(sim, [0, 1, 2], pair_id=["x", "x", "y"])
    assert apart["text_to_pair"]["MnR"] == (2 + 3 + 1) / 3 and apart["pair_to_text"]["MnR"] == (1 + 2 + 1) / 3
    assert one["text_to_pair"]["MnR"] == (1 + 2 + 1) / 3 and one["pair_to_text"]["MnR"] == (1 + 1 + 1) / 3
    with pytest.raises(ValueError, match="pair_id must hold one id"):
        retrieval_metrics(sim, [0, 1, 2], pair_id=[0, 0])


def ier_test_split(root, entries):
    """Image-Editing-Request's layout holding entries (before colour, after colour, sentence); its test pairs."""
    (root / "images").mkdir()
    (root / "dataset" / "adobe").mkdir(parents=True)
    for colour in {c for entry in entries for c in entry[:2]}:
        Image.new("RGB", (40, 30), colour).save(root / "images" / f"{colour}.jpg")
    (root / "dataset" / "adobe" / "test.json").write_text(json.dumps(
        [{"img0": f"{b}.jpg", "img1": f"{a}.jpg", "sents": [s], "uid": f"Reddit_{n}"}
         for n, (b, a, s) in enumerate(entries)]))
    return data.read_split("ier", root, "test")


def test_retrieval_knows_pairs_of_the_same_image_files(tmp_path):
    pairs = ier_test_split(tmp_path, [("red", "blue", "make it blue"), ("red", "blue", "turn the red to blue")])
    torch.manual_seed(0)
    m = retrieval(tiny_pair_encoder(), pairs, torch.device("cpu"), workers=0)
    assert m["text_to_pair"]["R@1"] == m["pair_to_text"]["R@1"] == 100.0  # counted apart: 0 and 50


def test_retrieval_knows_captions_of_the_same_words(tmp_path):
    pairs = ier_test_split(tmp_path, [("red", "blue", "make it blue"), ("green", "white", "make it blue")])
    torch.manual_seed(0)
    m = retrieval(tiny_pair_encoder(), pairs, torch.device("cpu"), workers=0)
    assert m["pair_to_text"]["R@1"] == 100.0  # counted apart, each pair ties with the other's caption and loses: 0
