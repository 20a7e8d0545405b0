"""The authors' checkpoints load into our models and compute what their code computes.

The fixture in tests/authors_fixture holds a tiny CLIP4IDC of each stage in the authors' own key
names and dtypes, with inputs and the outputs of their code (see its README)."""
import gzip
import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import caption
import clip_weights
import data
import evaluate
import synth
from cli import InputError
from model import CLIP4IDC, Captioner

FIXTURE = Path(__file__).parent / "authors_fixture"
IO = torch.load(FIXTURE / "io.pt", weights_only=True)
TOL = 1e-5


def authors_state_dict(stage):
    return torch.load(io.BytesIO(gzip.decompress((FIXTURE / f"stage{stage}.bin.gz").read_bytes())), weights_only=True)


def load(tmp_path, sd, **kw):
    torch.save(sd, tmp_path / "pytorch_model.bin")
    return clip_weights.load_checkpoint(tmp_path / "pytorch_model.bin", n_intra=IO["n_intra"], heads=IO["cap_heads"], **kw)


@pytest.fixture(scope="module")
def stage1(tmp_path_factory):
    return load(tmp_path_factory.mktemp("s1"), authors_state_dict(1))


@pytest.fixture(scope="module")
def stage2(tmp_path_factory):
    return load(tmp_path_factory.mktemp("s2"), authors_state_dict(2))


def close(ours, theirs):
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < TOL * max(1.0, theirs.abs().max().item())


def test_stage_1_file_becomes_our_pair_encoder(stage1):
    assert isinstance(stage1, CLIP4IDC) and stage1.config.n_intra == IO["n_intra"]
    assert sum(p.numel() for p in stage1.parameters()) == sum(v.numel() for v in authors_state_dict(1).values())


@torch.no_grad()
def test_stage_1_matches_their_pair_and_text_vectors_and_similarities(stage1):
    tokens = stage1.encode_pair(IO["before"], IO["after"])
    close(tokens[:, IO["s1_token_index"]], IO["s1_pair_tokens"])
    v, g = stage1.pool(tokens), stage1.encode_text(IO["caption_ids"])
    close(v, IO["s1_pair_vec"])
    close(g, IO["s1_text_vec"])
    sim = stage1.clip.logit_scale.exp() * torch.nn.functional.normalize(g, dim=-1) @ torch.nn.functional.normalize(v, dim=-1).t()
    close(sim, IO["s1_sim"])


@torch.no_grad()
def test_stage_1_loss_is_twice_theirs(stage1):
    # Eq. 8 sums IP-T and T-IP; their code averages them
    close(stage1(IO["before"], IO["after"], IO["caption_ids"]) / 2, IO["s1_loss"])


def test_stage_2_file_becomes_our_captioner(stage2):
    assert isinstance(stage2, Captioner)
    assert len(stage2.enc_layers) == IO["cap_layers"] and stage2.config.ffn == IO["cap_intermediate"]
    their_count = sum(v.numel() for k, v in authors_state_dict(2).items() if k not in clip_weights.AUTHORS_ALIASES)
    assert sum(p.numel() for p in stage2.parameters()) == their_count


@torch.no_grad()
def test_stage_2_matches_their_teacher_forced_logits_and_loss(stage2):
    close(stage2.encoder.encode_pair(IO["before"], IO["after"])[:, IO["s2_token_index"]], IO["s2_pair_tokens"])
    n = IO["s2_tf_len"]
    logits = stage2.logits(stage2.decode(IO["decoder_input_ids"][:, :n], stage2.visual_memory(IO["before"], IO["after"])))
    real = IO["decoder_mask"][:, :n].bool()  # their states at padded inputs see no padding, ours do: unused either way
    close(logits[:, :, IO["s2_vocab_subset"]][real], IO["s2_tf_logits_subset"][real])
    close(torch.logsumexp(logits, -1)[real], IO["s2_tf_lse"][real])
    close(stage2(IO["before"], IO["after"], IO["caption_ids"]), IO["s2_tf_loss"])


@torch.no_grad()
def test_stage_2_greedy_captions_equal_theirs_token_for_token(stage2):
    steps = IO["s2_greedy_ids"].shape[1]
    ours = stage2.generate(IO["before"], IO["after"], max_len=steps + 1)[:, 1:]
    for mine, theirs in zip(ours.tolist(), IO["s2_greedy_ids"].tolist()):
        upto = theirs.index(IO["eot"]) + 1 if IO["eot"] in theirs else steps  # we stop at EOT, they run on
        assert mine[:upto] == theirs[:upto] and all(t == 0 for t in mine[upto:])
    assert any(IO["eot"] in row for row in IO["s2_greedy_ids"].tolist())  # the fixture exercises stopping


def test_module_prefix_and_fp16_load_the_same_model(tmp_path, stage2):
    sd = {"module." + k: v.half() for k, v in authors_state_dict(2).items()}
    model = load(tmp_path, sd)
    for (name, ours), theirs in zip(model.state_dict().items(), stage2.state_dict().values()):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs.half().float(), msg=name)


def test_missing_key_is_named(tmp_path):
    sd = authors_state_dict(2)
    del sd["decoder.decoder.layer.1.enc_attn.att.value.bias"]
    with pytest.raises(InputError, match=r"missing keys \['decoder.decoder.layer.1.enc_attn.att.value.bias'\]"):
        load(tmp_path, sd)


def test_unknown_key_is_named(tmp_path):
    sd = authors_state_dict(1)
    sd["clip.visual.extra_embedding"] = torch.zeros(3)
    with pytest.raises(InputError, match=r"unknown keys \['clip.visual.extra_embedding'\]"):
        load(tmp_path, sd)


def test_tied_alias_that_differs_is_refused(tmp_path):
    sd = authors_state_dict(2)
    sd["decoder.embeddings.word_embeddings.weight"] = sd["decoder.embeddings.word_embeddings.weight"] + 1
    with pytest.raises(InputError, match="word_embeddings.weight differs from clip.token_embedding.weight"):
        load(tmp_path, sd)


def test_layer_split_beyond_the_vision_layers_is_refused(tmp_path):
    torch.save(authors_state_dict(1), tmp_path / "pytorch_model.bin")
    with pytest.raises(InputError, match="--n_intra 5: .* has 4 vision layers"):
        clip_weights.load_checkpoint(tmp_path / "pytorch_model.bin", n_intra=5)
    assert clip_weights.load_checkpoint(tmp_path / "pytorch_model.bin", n_intra=4).config.n_inter == 0


@pytest.mark.parametrize("heads", [0, -1, 5])
def test_heads_that_do_not_divide_the_captioner_width_are_refused(tmp_path, heads):
    torch.save(authors_state_dict(2), tmp_path / "pytorch_model.bin")
    with pytest.raises(InputError, match=f"--heads {heads}: expected a divisor of .*pytorch_model.bin's captioner width"):
        clip_weights.load_checkpoint(tmp_path / "pytorch_model.bin", n_intra=IO["n_intra"], heads=heads)


@pytest.mark.parametrize("stage", [1, 2])
def test_an_authors_file_missing_a_tensor_is_named(tmp_path, stage):
    sd = authors_state_dict(stage)
    del sd["clip.visual.proj"]
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(InputError, match=r"pytorch_model.bin: not a CLIP ViT checkpoint: missing keys \['clip.visual.proj'\]"):
        clip_weights.load_checkpoint(tmp_path / "pytorch_model.bin", n_intra=IO["n_intra"], heads=IO["cap_heads"])


def test_a_file_of_neither_kind_is_refused(tmp_path):
    torch.save({"weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(InputError, match="other.pt: expected a best.pt or last.pt .* or a pytorch_model.bin"):
        clip_weights.load_checkpoint(tmp_path / "other.pt")


def test_caption_their_pair_from_the_command_line(tmp_path, capsys):
    torch.save(authors_state_dict(2), tmp_path / "pytorch_model.bin.clevr")
    size = IO["image_size"]
    for name in ("before", "after"):
        pixels = torch.randint(0, 256, (size, size, 3), dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(tmp_path / f"{name}.png")
    evaluate.main(["--ckpt", str(tmp_path / "pytorch_model.bin.clevr"), "--n_intra", str(IO["n_intra"]),
                   "--heads", str(IO["cap_heads"]), "--pair", str(tmp_path / "before.png"), str(tmp_path / "after.png"),
                   "--attention", str(tmp_path / "attention.png"), "--device", "cpu"])
    assert capsys.readouterr().out.strip().splitlines()[0]
    assert (tmp_path / "attention.png").stat().st_size > 0


@pytest.mark.slow
def test_their_stage_1_starts_caption_training_and_their_stage_2_scores_a_split(tmp_path, capsys):
    root = tmp_path / "synth"
    synth.write_synth(root, 30, seed=3)
    torch.save(authors_state_dict(1), tmp_path / "pytorch_model.bin.pretrained")
    caption.main(["--data", "synth", "--data_root", str(root), "--out_dir", str(tmp_path / "run"), "--max_steps", "2",
                  "--batch_size", "8", "--workers", "0", "--layers", "1", "--heads", "2", "--ffn", "32",
                  "--init_from", str(tmp_path / "pytorch_model.bin.pretrained"), "--n_intra", "3", "--n_inter", "1",
                  "--beam", "2", "--length_penalty", "0.5"])  # the test captions' decoding; validation stays greedy
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["decoding"] == {"beam": 2, "length_penalty": 0.5}

    torch.save(authors_state_dict(2), tmp_path / "pytorch_model.bin.trained")
    evaluate.main(["--ckpt", str(tmp_path / "pytorch_model.bin.trained"), "--n_intra", "3", "--heads", "2",
                   "--data", "synth", "--data_root", str(root), "--split", "test", "--out_dir", str(tmp_path / "scored"),
                   "--device", "cpu", "--beam", "3"])
    metrics = json.loads((tmp_path / "scored" / "metrics.json").read_text())
    assert set(metrics["test"]["per_type"]) <= {"color", "texture", "move", "add", "drop", "distractor"}
    assert metrics["decoding"] == {"beam": 3, "length_penalty": 1.0}
    items = data.eval_items(data.read_split("synth", root, "test"))
    model = clip_weights.load_checkpoint(tmp_path / "pytorch_model.bin.trained", n_intra=3, heads=2)
    assert evaluate.read_predictions(tmp_path / "scored" / "test_predictions.json") == evaluate.predict(
        model, items, torch.device("cpu"), workers=0, beam=3)
    out = capsys.readouterr().out
    assert "CIDEr by change type" in out and "test split, this model (beam search, beam 3, length penalty 1):" in out
