"""IP-T / T-IP retrieval metrics against rankings worked out by hand, ties included."""
import numpy as np
import pytest
import torch

from evaluate import format_retrieval, rank_summary, retrieval_metrics

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


def test_pair_to_text_ranks_pairs_not_captions():
    # Pair 0 has 3 captions that all beat pair 1's only caption for pair 1: one competitor, not three.
    sim = np.array([[0.9, 0.8, 0.7, 0.1], [0.6, 0.6, 0.6, 0.5]])
    m = retrieval_metrics(sim, [0, 0, 0, 1])
    assert m["pair_to_text"]["MnR"] == (1 + 2) / 2


def test_format_retrieval_prints_both_directions():
    lines = format_retrieval(retrieval_metrics(SIM, TEXT_PAIR)).splitlines()
    assert lines[0].split() == ["R@1", "R@5", "R@10", "R@20", "R@50", "MdR", "MnR"]
    assert lines[1].split()[-7:] == ["25.0", "100.0", "100.0", "100.0", "100.0", "3.0", "2.8"]
    assert lines[2].startswith("Text => Image Pair")
    assert lines[2].split()[-7:] == ["16.7", "100.0", "100.0", "100.0", "100.0", "3.0", "2.5"]
