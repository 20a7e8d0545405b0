"""Beam search (Captioner.generate with beam > 1, `--beam`): beam 1 is greedy decoding token for token; a beam as
wide as the search space finds the caption of the best length-normalised score that the exhaustive search finds;
the scores it reports are its captions' own; a pair gets the same caption in any batch; the command lines refuse
bad values in one line and record the decoding in metrics.json."""
import itertools
import json
import math
from dataclasses import asdict

import pytest
import torch

import bench
import caption
import cli
import data
import evaluate
import train
from model import EOT, SOT, Captioner, CaptionerConfig
from test_authors_checkpoints import IO, authors_state_dict, load
from test_caption_own_pair import save_checkpoint, write_pair
from test_captioner import tiny_captioner
from tiny import tiny_pair_encoder

WORDS = (320, 518, 1125)


@torch.no_grad()
def log_probability(model, memories, captions):
    """[pairs, captions]: the sum of log-probabilities of each caption (its ids after SOT) for every pair, the decoder
    reading the whole caption at once, as in training."""
    sums = []
    for ids in captions:
        tokens = torch.tensor([SOT, *ids]).expand(len(memories[0]), -1)
        logp = model.logits(model.decode(tokens[:, :-1], memories)).float().log_softmax(-1)
        columns = [model.config.vocab.index(t) if model.config.vocab else t for t in ids]
        sums.append(logp[:, range(len(ids)), columns].sum(1))
    return torch.stack(sums, 1)


def few_words_captioner():
    """Three words and EOT, captions of at most 4 tokens (max_len 5). Its scores are sharper and vary more than a fresh
    model's near-even ones, so that the best caption changes with the length penalty."""
    torch.manual_seed(0)
    model = Captioner(tiny_pair_encoder(), CaptionerConfig(layers=2, heads=4, ffn=64, max_len=5, vocab=(*WORDS, EOT)))
    with torch.no_grad():
        model.encoder.clip.token_embedding.weight[list(model.config.vocab)] *= 3
        model.head_bias[EOT] = -1
    return model.eval()


def varied_captioner():
    """A tiny captioner of all of CLIP's words whose captions end after a few tokens, not all after as many."""
    model = tiny_captioner(max_len=12)
    with torch.no_grad():
        model.encoder.clip.token_embedding.weight.mul_(5)
        model.head_bias[EOT] = 2
    return model


def caption_of(row):
    """The ids after SOT, up to and with EOT."""
    return row[1:row.index(EOT) + 1] if EOT in row else row[1:]


def test_beam_1_is_greedy_decoding_token_for_token():
    model = varied_captioner()
    before, after = torch.randn(2, 5, 3, 32, 32)
    greedy = model.greedy(model.visual_memory(before, after))
    assert torch.equal(model.generate(before, after), greedy)
    assert torch.equal(model.generate(before, after, beam=1, length_penalty=0.3, use_cache=False), greedy)
    assert torch.equal(model.generate(before, after, beam=1, return_scores=True)[0], greedy)
    assert not torch.equal(model.generate(before, after, beam=3), greedy)  # else this test would tell nothing


def test_beam_1_still_writes_the_authors_greedy_captions(tmp_path):
    stage2 = load(tmp_path, authors_state_dict(2))  # as test_authors_checkpoints checks greedy decoding
    steps = IO["s2_greedy_ids"].shape[1]
    ours = stage2.generate(IO["before"], IO["after"], max_len=steps + 1, beam=1, length_penalty=2.0)[:, 1:]
    for mine, theirs in zip(ours.tolist(), IO["s2_greedy_ids"].tolist()):
        upto = theirs.index(IO["eot"]) + 1 if IO["eot"] in theirs else steps  # we stop at EOT, they run on
        assert mine[:upto] == theirs[:upto] and all(t == 0 for t in mine[upto:])


def test_a_beam_as_wide_as_the_search_space_finds_the_exhaustive_searchs_best_caption():
    model = few_words_captioner()
    before, after = torch.randn(2, 4, 3, 32, 32)
    memories = model.visual_memory(before, after)
    finished = [(*words, EOT) for n in range(4) for words in itertools.product(WORDS, repeat=n)]  # 1 to 4 tokens
    sums, length = log_probability(model, memories, finished), torch.tensor([len(c) for c in finished])
    greedy, lengths = [caption_of(row) for row in model.generate(before, after).tolist()], set()
    for length_penalty in (0.0, 0.5, 1.0, 2.0):
        top = (sums / length ** length_penalty).topk(2, dim=1)
        assert (top.values[:, 0] - top.values[:, 1]).min() > 1e-4  # no near-tie that rounding could decide
        best = [list(finished[i]) for i in top.indices[:, 0]]
        # 27 = 3 ** 3: every unfinished caption of 3 words stays in the beam
        ids, scores = model.generate(before, after, beam=27, length_penalty=length_penalty, return_scores=True)
        assert [caption_of(row) for row in ids.tolist()] == best
        torch.testing.assert_close(scores, top.values[:, 0], rtol=1e-5, atol=1e-6)
        lengths |= {len(c) for c in best}
        assert best != greedy  # a search that pays
    assert lengths == {1, 2, 3, 4}  # the length penalty decides: each length wins under one


def test_when_no_caption_ends_in_time_the_best_unfinished_one_wins():
    model = few_words_captioner()
    logits = model.logits
    model.logits = lambda y: logits(y).index_fill(-1, torch.tensor([len(WORDS)]), -math.inf)  # EOT, the last column
    before, after = torch.randn(2, 4, 3, 32, 32)
    unfinished = list(itertools.product(WORDS, repeat=4))
    top = (log_probability(model, model.visual_memory(before, after), unfinished) / 4).max(dim=1)
    ids, scores = model.generate(before, after, beam=27, return_scores=True)
    assert ids.tolist() == [[SOT, *unfinished[i]] for i in top.indices]
    torch.testing.assert_close(scores, top.values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beam", [1, 3])
def test_the_scores_reported_are_those_of_the_captions_by_teacher_forcing(beam):
    model = varied_captioner()
    before, after = torch.randn(2, 5, 3, 32, 32)
    memories = model.visual_memory(before, after)
    for length_penalty in (0.0, 0.7, 1.0):
        ids, scores = model.generate(before, after, beam=beam, length_penalty=length_penalty, return_scores=True)
        captions = [caption_of(row) for row in ids.tolist()]
        expected = [log_probability(model, [m[i:i + 1] for m in memories], [c])[0, 0] / len(c) ** length_penalty
                    for i, c in enumerate(captions)]
        torch.testing.assert_close(scores, torch.stack(expected), rtol=1e-5, atol=1e-5)


def test_pairs_in_a_batch_get_the_captions_they_get_alone():
    model = varied_captioner()
    before, after = torch.randn(2, 5, 3, 32, 32)
    ids, scores = model.generate(before, after, beam=3, return_scores=True)
    assert len({len(caption_of(row)) for row in ids.tolist()}) > 1  # the shorter ones are padded in the batch
    for i in range(len(ids)):
        alone, score = model.generate(before[i:i + 1], after[i:i + 1], beam=3, return_scores=True)
        assert torch.equal(ids[i, :alone.shape[1]], alone[0]) and not ids[i, alone.shape[1]:].any()
        torch.testing.assert_close(scores[i], score[0])


def error_of(capsys, run, *argv):
    """The one stderr line, less its "prog: error: " head, of the command line `run` refusing argv."""
    with pytest.raises(SystemExit) as exit:
        cli.main(run, [str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip().split(": error: ", 1)[1]


def test_bad_beams_and_length_penalties_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # caption.py's data/ and out/ are relative to here
    save_checkpoint(tiny_captioner(max_len=12), tmp_path / "best.pt")
    save_checkpoint(tiny_captioner().encoder, tmp_path / "stage1.pt")
    (tmp_path / "preds.json").write_text("[]")
    pair = ["--ckpt", tmp_path / "best.pt", "--pair", *write_pair(tmp_path)]
    assert error_of(capsys, evaluate.main, *pair, "--beam", 0) == "--beam 0: expected a value >= 1"
    for value in (-1, "nan", "inf"):
        assert error_of(capsys, evaluate.main, *pair, "--beam", 2, "--length_penalty", value) == (
            f"--length_penalty {float(value)}: expected a finite value >= 0")
    assert error_of(capsys, evaluate.main, *pair, "--length_penalty", 0.5) == (
        "--length_penalty 0.5: read only with --beam above 1 (greedy decoding weighs no lengths)")
    assert error_of(capsys, evaluate.main, "--predictions", tmp_path / "preds.json", "--data_root", tmp_path, "--beam",
                    3) == "--beam has no use with --predictions, which takes --data, --data_root, --split, --out"
    assert error_of(capsys, evaluate.main, "--ckpt", tmp_path / "stage1.pt", "--data_root", tmp_path, "--beam", 3) == (
        f"--beam 3: {tmp_path / 'stage1.pt'} holds a stage-1 pair encoder, which writes no captions")
    assert error_of(capsys, caption.main, "--beam", 0) == "--beam 0: expected a value >= 1"
    assert error_of(capsys, caption.main, "--beam", 2, "--length_penalty=-1") == (
        "--length_penalty -1.0: expected a value >= 0")
    assert error_of(capsys, caption.main, "--length_penalty", 2) == (
        "--length_penalty 2.0: read only with --beam above 1 (greedy decoding weighs no lengths)")
    assert error_of(capsys, bench.main, "decode", "--beams", 1, 0) == "--beams 0: expected beam widths of 1 or more"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after.jpg", "before.png", "best.pt", "preds.json",
                                                          "stage1.pt"]  # nothing written


def test_a_resumed_run_may_decode_its_test_captions_otherwise(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    saved = caption.CaptionConfig(out_dir=str(out), lr=1e-4)  # greedy: beam 1, length_penalty 1.0
    torch.save(dict(config=asdict(saved), state=dict(step=0), rng=[], model={}, model_config={}, optimizer={},
                    schedule={}), out / "last.pt")
    resumed = caption.CaptionConfig(out_dir=str(out), resume=True, beam=5, length_penalty=0.0, lr=1e-4)
    train.check_run_folder(resumed)  # accepted, and the run decodes as asked now
    assert (resumed.beam, resumed.length_penalty) == (5, 0.0)
    with pytest.raises(cli.InputError, match=r"other settings, \(saved, now\): \{'lr': \(0\.0001, 0\.001\)\}; resume"):
        train.check_run_folder(caption.CaptionConfig(out_dir=str(out), resume=True, beam=5, length_penalty=0.0,
                                                     lr=1e-3))  # where a setting of the training changes


def test_ones_own_pairs_are_captioned_with_the_beam_asked_for(tmp_path, capsys):
    """metrics.json's record of the decoding: test_authors_checkpoints and test_pipeline, which score splits anyway."""
    captioner = varied_captioner()
    save_checkpoint(captioner, tmp_path / "best.pt")
    before, after = write_pair(tmp_path)
    images = [data.read_pixels(p, 32)[None] for p in (before, after)]
    expected = evaluate.ids_to_text(captioner.generate(*images, beam=3, length_penalty=0.5))[0]
    assert expected != evaluate.ids_to_text(captioner.generate(*images))[0]  # else this test could not tell them apart
    flags = ["--ckpt", tmp_path / "best.pt", "--beam", 3, "--length_penalty", 0.5, "--device", "cpu"]
    evaluate.main([str(a) for a in flags + ["--pair", before, after]])
    assert capsys.readouterr().out == expected + "\n"
    (tmp_path / "pairs.txt").write_text(f"{before} {after}\n")
    evaluate.main([str(a) for a in flags + ["--pairs", tmp_path / "pairs.txt"]])
    assert json.loads(capsys.readouterr().out)["caption"] == expected
