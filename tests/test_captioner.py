import dataclasses

import torch

import caption
import clip_weights
import tokenizer
from evaluate import ids_to_text
from model import EOT, IGNORE, SOT, Captioner, CaptionerConfig, WordCrossEntropy
from tiny import tiny_pair_encoder


def tiny_captioner(max_len=12):
    torch.manual_seed(0)
    return Captioner(tiny_pair_encoder(), CaptionerConfig(layers=2, heads=4, ffn=64, max_len=max_len)).eval()


def next_token_logits(model, before, after, ids):
    return model.logits(model.decode(ids, model.visual_memory(before, after)))


def test_decoder_gives_next_token_logits_for_every_position():
    model = tiny_captioner()
    before, after = torch.randn(2, 3, 3, 32, 32)
    ids = torch.randint(0, 49408, (3, 12))
    assert next_token_logits(model, before, after, ids).shape == (3, 12, 49408)
    assert len(model.visual_memory(before, after)) == 2  # one memory per encoder layer, read by decoder layer i


def test_decoder_is_causal():
    model = tiny_captioner()
    before, after = torch.randn(2, 2, 3, 32, 32)
    ids = torch.randint(0, 49408, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(0, 49408, (2, 5))
    a, b = next_token_logits(model, before, after, ids), next_token_logits(model, before, after, changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3


def test_cached_and_uncached_greedy_decoding_agree():
    model = tiny_captioner(max_len=12)
    before, after = torch.randn(2, 4, 3, 32, 32)
    cached, uncached = model.generate(before, after, use_cache=True), model.generate(before, after, use_cache=False)
    assert torch.equal(cached, uncached)
    assert cached.shape[1] <= 12 and (cached[:, 0] == SOT).all()
    memories = model.visual_memory(before, after)
    caches = [{"self": {}, "cross": {}} for _ in model.dec_layers]
    step_by_step = torch.cat([model.decode(cached[:, i:i + 1], memories, caches, start=i) for i in range(cached.shape[1])], 1)
    torch.testing.assert_close(step_by_step, model.decode(cached, memories), rtol=1e-5, atol=1e-5)


def test_generation_stops_each_row_at_eot():
    model = tiny_captioner(max_len=10)
    with torch.no_grad():
        model.head_bias[EOT] = 1e4  # EOT becomes the best next token after any input
    ids = model.generate(*torch.randn(2, 2, 3, 32, 32))
    assert ids.tolist() == [[SOT, EOT], [SOT, EOT]]


def test_a_row_that_has_ended_is_padded_while_the_others_go_on():
    model = tiny_captioner(max_len=10)
    choices = iter([[EOT, 320], [320, 518], [EOT, EOT]])
    model.logits = lambda y: torch.nn.functional.one_hot(torch.tensor(next(choices)), 49408).float()
    ids = model.generate(*torch.randn(2, 2, 3, 32, 32))
    assert ids.tolist() == [[SOT, EOT, 0, 0], [SOT, 320, 518, EOT]]


def test_caption_loss_is_the_cross_entropy_of_real_tokens_only():
    model = tiny_captioner()
    before, after = torch.randn(2, 2, 3, 32, 32)
    ids = torch.tensor([[SOT, 320, 1125, EOT, 0, 0, 0], [SOT, 518, 2442, 11331, 1069, EOT, 0]])
    logits = next_token_logits(model, before, after, ids[:, :-1])
    expected = torch.nn.functional.cross_entropy(torch.cat([logits[0, :3], logits[1, :5]]),
                                                 torch.cat([ids[0, 1:4], ids[1, 1:6]]))
    torch.testing.assert_close(model(before, after, ids), expected, rtol=1e-5, atol=1e-5)
    padded = torch.cat([ids, torch.zeros(2, 5, dtype=torch.long)], dim=1)  # padding changes nothing
    torch.testing.assert_close(model(before, after, padded), expected, rtol=1e-5, atol=1e-5)


def test_word_cross_entropy_equals_torch_cross_entropy_in_value_and_gradient():
    torch.manual_seed(0)
    targets = torch.tensor([5, IGNORE, 0, 49407, IGNORE, 77])
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        logits = (3 * torch.randn(6, 49408)).to(dtype).requires_grad_()
        reference = logits.detach().clone().requires_grad_()
        ours = WordCrossEntropy.apply(logits, targets)
        expected = torch.nn.functional.cross_entropy(reference.float(), targets, ignore_index=IGNORE, reduction="sum")
        (2.5 * ours).backward()
        (2.5 * expected).backward()
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-4)
        assert logits.grad.dtype == dtype
        torch.testing.assert_close(logits.grad, reference.grad, rtol=tolerance, atol=tolerance)
        assert (logits.grad[targets == IGNORE] == 0).all() and (logits.grad[targets != IGNORE] != 0).any()


def test_generated_ids_decode_to_the_caption_text():
    ids = tokenizer.tokenize(["the big cube has moved", "nothing has changed"], 12)
    assert ids_to_text(ids) == ["the big cube has moved", "nothing has changed"]


def test_a_captioner_of_fewer_words_scores_and_writes_as_the_full_one_with_the_other_words_masked(tmp_path):
    words = (320, 518, 1125, 2442, 11331, EOT)
    full = tiny_captioner()
    few = Captioner(full.encoder, dataclasses.replace(full.config, vocab=words)).eval()
    few.load_state_dict(full.state_dict())
    before, after = torch.randn(2, 2, 3, 32, 32)
    ids = torch.tensor([[SOT, 320, 1125, EOT, 0, 0], [SOT, 518, 2442, 11331, 320, EOT]])
    logits = next_token_logits(full, before, after, ids[:, :-1])[..., list(words)]
    torch.testing.assert_close(next_token_logits(few, before, after, ids[:, :-1]), logits)
    rows = torch.tensor([[0, 2, 5, 0, 0], [1, 3, 4, 0, 5]])  # each target's place in `words`
    expected = torch.nn.functional.cross_entropy(torch.cat([logits[0, :3], logits[1]]), torch.cat([rows[0, :3], rows[1]]))
    torch.testing.assert_close(few(before, after, ids), expected, rtol=1e-5, atol=1e-5)
    ids[1, 4] = 1069  # a word it cannot write does not count
    logits = next_token_logits(full, before, after, ids[:, :-1])[..., list(words)]
    expected = torch.nn.functional.cross_entropy(torch.cat([logits[0, :3], logits[1, [0, 1, 2, 4]]]),
                                                 torch.cat([rows[0, :3], rows[1, [0, 1, 2, 4]]]))
    torch.testing.assert_close(few(before, after, ids), expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        full.head_bias[[i for i in range(49408) if i not in words]] = -1e4
    written = few.generate(before, after)
    assert torch.equal(written, full.generate(before, after)) and set(written[:, 1:].flatten().tolist()) <= {0, *words}
    path = tmp_path / "best.pt"  # the vocabulary travels in the checkpoint's model_config
    torch.save({"model": few.state_dict(), "model_config": clip_weights.model_config(few)}, path)
    loaded = clip_weights.load_checkpoint(path)
    assert loaded.config.vocab == words and torch.equal(loaded.generate(before, after), written)


def test_the_training_words_are_the_tokens_after_sot_up_to_and_with_eot():
    encode = tokenizer.Tokenizer().encode
    assert caption.train_words(tokenizer.tokenize(["the cube moved", "a cube appeared"], 12)) == tuple(
        sorted({*encode("the cube moved"), *encode("a cube appeared"), EOT}))  # not SOT, nor the padding's 0
    assert 0 in caption.train_words(tokenizer.tokenize(["it moved!—"], 12))  # "!" before a dash is token 0, as the padding


def test_every_captioner_flag_reaches_its_config():
    cfg = caption.CaptionConfig(layers=2, heads=4, ffn=64, dropout=0.2, attn_dropout=0.3, max_len=20)
    assert caption.captioner_config(cfg) == CaptionerConfig(layers=2, heads=4, ffn=64, dropout=0.2, attn_dropout=0.3,
                                                            max_len=20)
