"""Stage 1's hard negatives (adapt.HardNegatives: IDC-PCL's Retrieve, Replace and Confuse): captions false in
one detail, never a true caption of their pair, scored as extra IP-T columns of Eq. 6 that only their pair sees."""
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import adapt
import data
import synth
from cli import InputError
from model import contrastive_loss
from tiny import tiny_pair_encoder
from tokenizer import EOT, get_tokenizer, tokenize

SAME = {word: value for value, words in synth.WORDS.items() for word in words}  # a synonym -> its value
CLASSES = [set(synth.COLORS), {"cube", "block", "sphere", "ball", "cylinder"}, {"rubber", "matte", "metal", "metallic", "shiny"},
           {"small", "tiny", "large", "big"}, {"added", "removed", "moved"}, {"appeared", "disappeared"}, {"left", "right"}]


@pytest.fixture(scope="module")
def pairs():
    """The synthetic data's captions, five a pair, without images: the rewriting reads captions alone."""
    return [data.Pair(str(i), Path("before.png"), Path("after.png"), synth.synth_pair(i, seed=0)[1]) for i in range(300)]


def texts(negatives, pair, caption, seed=0):
    ids = negatives(pair, caption, random.Random(seed))
    return [get_tokenizer().decode(row[1:(row == EOT).nonzero()[0, 0]].tolist()) for row in ids]


def canonical(text):
    return tuple(SAME.get(w, w) for w in text.split())


def test_a_rewrite_is_never_a_true_caption_of_its_pair_nor_another_rewrite(pairs):
    negatives = adapt.HardNegatives(pairs, 6, adapt.KINDS, 32)
    for pair in pairs[:100]:
        true = {canonical(c) for c in pair.captions}
        for caption in pair.captions:
            rewritten = [canonical(t) for t in texts(negatives, pair, caption)]
            assert len(rewritten) == 6 and not true & set(rewritten) and len(set(rewritten)) == 6, (caption, rewritten)


def test_each_kind_rewrites_as_it_says(pairs):
    kinds = {kind: adapt.HardNegatives(pairs, 1, [kind], 32) for kind in adapt.KINDS}
    others = {c for pair in pairs for c in pair.captions}
    for pair in pairs[:60]:
        caption = pair.captions[0]
        retrieved, = texts(kinds["retrieve"], pair, caption)
        assert retrieved in others - set(pair.captions)
        replaced, = texts(kinds["replace"], pair, caption)  # one word, for another value of its class
        changed = [(a, b) for a, b in zip(caption.split(), replaced.split()) if a != b]
        assert len(replaced.split()) == len(caption.split()) and len(changed) == 1, (caption, replaced)
        (a, b), = changed
        assert any({a, b} <= c for c in CLASSES) and SAME.get(a, a) != SAME.get(b, b), (caption, replaced)
        confused, = texts(kinds["confuse"], pair, caption)  # the same words in another order
        assert sorted(confused.split()) == sorted(caption.split()) and confused != caption


def test_confuse_swaps_two_values_of_a_class_where_the_caption_has_them(pairs):
    pair = data.Pair("x", Path("b"), Path("a"), ["the small red cube turned blue"])
    negatives = adapt.HardNegatives(pairs + [pair], 1, ["confuse"], 32)
    assert texts(negatives, pair, pair.captions[0]) == ["the small blue cube turned red"]


def test_the_ids_are_the_tokenizers_of_the_rewritten_text(pairs):
    negatives = adapt.HardNegatives(pairs, 6, adapt.KINDS, 32)
    for pair in pairs[:20]:
        ids = negatives(pair, pair.captions[1], random.Random(3))
        assert torch.equal(ids, tokenize(texts(negatives, pair, pair.captions[1], seed=3), 32))


def test_kinds_are_shared_out_evenly(pairs):
    assert adapt.HardNegatives(pairs, 6, adapt.KINDS, 32).plan == ["retrieve"] * 2 + ["replace"] * 2 + ["confuse"] * 2
    assert adapt.HardNegatives(pairs, 4, adapt.KINDS, 32).plan == ["retrieve", "retrieve", "replace", "confuse"]


def test_a_caption_that_cannot_be_made_false_is_named_in_one_line():
    pairs = [data.Pair("7", Path("b"), Path("a"), ["changed"])]  # one word, no class, no other pair's caption
    with pytest.raises(InputError, match="no false rewrite of the caption 'changed' of pair 7"):
        adapt.HardNegatives(pairs, 1, adapt.KINDS, 32)(pairs[0], "changed", random.Random(0))


def test_hard_negatives_are_extra_ip_t_columns_of_their_own_pair():
    torch.manual_seed(0)
    b, n = 4, 3
    v, g, h, logit_scale = torch.randn(b, 16), torch.randn(b, 16), torch.randn(b, n, 16), torch.tensor(2.3)
    tau = 1 / math.exp(logit_scale.item())
    s = lambda x, y: F.cosine_similarity(x, y, dim=0).item() / tau  # noqa: E731
    l_i2t = -sum(s(v[i], g[i]) - math.log(sum(math.exp(s(v[i], g[j])) for j in range(b))
                                          + sum(math.exp(s(v[i], h[i, k])) for k in range(n))) for i in range(b)) / b
    l_t2i = -sum(s(v[i], g[i]) - math.log(sum(math.exp(s(v[j], g[i])) for j in range(b))) for i in range(b)) / b
    assert contrastive_loss(v, g, logit_scale, h).item() == pytest.approx(l_i2t + l_t2i, rel=1e-5)


def test_the_model_scores_its_hard_negatives_with_the_text_encoder_of_its_captions():
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    before, after = torch.randn(2, 4, 3, 32, 32)
    tokens = torch.randint(1, 1000, (4, 3, 12))
    tokens[..., 6], tokens[..., 7:] = EOT, 0
    v = model.pool(model.encode_pair(before, after))
    expected = contrastive_loss(v, model.encode_text(tokens[:, 0]), model.clip.logit_scale,
                                model.encode_text(tokens[:, 1:].flatten(0, 1)).unflatten(0, (4, 2)))
    torch.testing.assert_close(model(before, after, tokens[:, 0], tokens[:, 1:]), expected)
    assert model(before, after, tokens[:, 0], tokens[:, 1:]) > model(before, after, tokens[:, 0])


def test_adapt_samples_carry_their_hard_negatives_fixed_by_the_key(pairs):
    negatives = adapt.HardNegatives(pairs, 6, adapt.KINDS, 32)
    dataset = data.AdaptDataset(pairs[:3], 16, seed=1, store=lambda path, size: torch.zeros(3, size, size), negatives=negatives)
    assert dataset[(0, 4)][3].shape == (6, 32)
    assert torch.equal(dataset[(2, 4)][3], dataset[(2, 4)][3]) and not torch.equal(dataset[(0, 4)][3], dataset[(1, 4)][3])
    assert len(data.AdaptDataset(pairs[:3], 16, store=lambda path, size: torch.zeros(3, size, size))[(0, 4)]) == 3
