"""--recipe authors trains as the authors' code: their frozen parameters, their loss, their scripts'
epochs and seed; and the README's table says what the code does."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import adapt
import caption
import clip_weights
import synth
import train
from model import EOT, contrastive_loss
from test_authors_checkpoints import IO, authors_state_dict
from tiny import tiny_pair_encoder

README = (Path(__file__).parent.parent / "README.md").read_text()
SMALL = ["--data", "synth", "--max_steps", "2", "--batch_size", "8", "--workers", "0"]


def frozen(model):
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def small_encoder(recipe):
    torch.manual_seed(0)
    return adapt.build_model(adapt.AdaptConfig(preset="small", init="random", n_intra=3, n_inter=1, recipe=recipe))


def test_stage_1_freezes_what_their_script_freezes():
    assert frozen(small_encoder("paper")) == set()
    assert frozen(small_encoder("authors")) == {"clip." + name for name in adapt.AUTHORS_FROZEN}
    assert frozen(small_encoder("authors")) == set(IO["s1_frozen_params"])  # as their freezing loop chose


@pytest.mark.parametrize("data, trains", [("clevr", set()), ("spot", {"encoder.clip.token_embedding.weight"}),
                                         ("birds", {"encoder.clip.token_embedding.weight"})])  # Spot-the-Diff's
def test_stage_2_freezes_per_dataset_and_their_word_embeddings_move_at_clips_rate(tmp_path, data, trains):
    torch.save(authors_state_dict(1), tmp_path / "pytorch_model.bin")
    flags = dict(data=data, init_from=str(tmp_path / "pytorch_model.bin"), n_intra=IO["n_intra"], n_inter=1, layers=1,
                 heads=2, ffn=32)
    cfg = caption.CaptionConfig(**flags, recipe="authors")
    captioner = caption.build_captioner(cfg, "cpu")
    text_tower = {"encoder.clip." + n for n, _ in captioner.encoder.clip.named_parameters()
                  if not n.startswith("visual.") and n not in ("token_embedding.weight", "positional_embedding")}
    authors = {"encoder.clip." + name for name in adapt.AUTHORS_FROZEN}
    assert frozen(captioner) == (authors | text_tower) - trains  # the rest of the text tower: frozen in both recipes
    assert "encoder.clip.token_embedding.weight" not in caption.new_parameter_names(captioner, cfg)
    paper_cfg = caption.CaptionConfig(**flags, recipe="paper")
    paper = caption.build_captioner(paper_cfg, "cpu")
    assert frozen(paper) == text_tower
    assert "encoder.clip.token_embedding.weight" in caption.new_parameter_names(paper, paper_cfg)


def test_stage_1_loss_is_half_the_default_one():
    paper, authors = small_encoder("paper"), small_encoder("authors")
    authors.load_state_dict(paper.state_dict())
    before, after = torch.randint(0, 256, (2, 4, 3, 128, 128), dtype=torch.uint8)
    tokens = torch.tensor([[49406, 320, 1125, EOT] + [0] * 28, [49406, 518, EOT] + [0] * 29] * 2)
    assert authors(before, after, tokens).item() == pytest.approx(paper(before, after, tokens).item() / 2, rel=1e-6)


def settings(stage, *argv):
    return train.parse_config(adapt.AdaptConfig if stage is adapt else caption.CaptionConfig, list(argv))


def test_the_recipe_takes_the_settings_of_their_script_for_each_dataset():
    authors = ["--recipe", "authors"]
    assert [settings(adapt, "--data", d, *authors).epochs for d in ("clevr", "spot")] == [12, 20]
    assert settings(adapt, "--data", "spot").epochs == 12  # the paper's
    assert [settings(caption, "--data", d, *authors).seed for d in ("clevr", "spot", "ier")] == [2021, 42, 42]
    # the sets they have no script for take those of the closest one: Spot-the-Diff's, CLEVR-Change's
    assert [settings(adapt, "--data", d, *authors).epochs for d in ("birds", "clevr_dc")] == [20, 12]
    assert [settings(caption, "--data", d, *authors).seed for d in ("birds", "clevr_dc")] == [42, 2021]
    clevr = settings(caption, "--data", "clevr", *authors)
    assert (clevr.max_len, clevr.patience) == (33, 11)  # their loop ends after 11 epochs without a better CIDEr
    assert settings(caption, "--data", "clevr", *authors, "--seed", "1").seed == 1  # flags win


def test_stage_2_decodes_at_most_32_steps_after_sot_as_appendix_b_and_the_authors():
    authors = settings(caption, "--data", "clevr", "--recipe", "authors")
    assert settings(caption, "--data", "clevr").max_len == authors.max_len == 33  # SOT and 32 steps
    captioner = caption.Captioner(small_encoder("paper"), caption.captioner_config(
        caption.CaptionConfig(layers=1, heads=2, ffn=32)))
    with torch.no_grad():
        captioner.head_bias[EOT] = -1e4  # no caption ends early
    ids = captioner.eval().generate(*torch.randint(0, 256, (2, 2, 3, 128, 128), dtype=torch.uint8))
    assert ids.shape == (2, 33)  # SOT and 32 decoded tokens


@pytest.mark.slow  # whole runs of both stages, scored with Java
def test_runs_print_their_trainable_parameters(tmp_path, capsys):
    root = tmp_path / "synth"
    synth.write_synth(root, 30, seed=4)
    adapt.main([*SMALL, "--data_root", str(root), "--out_dir", str(tmp_path / "a"), "--recipe", "authors"])
    model = small_encoder("authors")
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("trainable parameters: "))
    assert line.endswith(f"; frozen: {n_frozen / 1e6:.2f}M") and "at lr 0.001 weight decay 0.05" in line
    caption.main([*SMALL, "--data_root", str(root), "--out_dir", str(tmp_path / "c"), "--recipe", "authors",
                  "--init_from", str(tmp_path / "a" / "best.pt"), "--layers", "1", "--ffn", "32"])
    out = capsys.readouterr().out
    assert "'recipe': 'authors'" in out and "trainable parameters: " in out and (tmp_path / "c" / "metrics.json").is_file()


def table_row(setting):
    return next(line for line in README.splitlines() if line.startswith(f"| {setting} |"))


def test_readme_table_says_what_the_code_does():
    frozen_row = table_row("frozen CLIP parameters, both stages").split("|")[3]
    assert set(re.findall(r"`([\w.]+)`", frozen_row)) == set(adapt.AUTHORS_FROZEN)
    for config in (adapt.AdaptConfig, caption.CaptionConfig):
        for f in dataclasses.fields(config):
            for data, value in config.meta(f.name)["authors"].items():
                assert f"`--{f.name} {value}`" in README
                assert f"`--{f.name} {getattr(config(data=data), f.name)}`" in README  # beside the default it replaces
    assert "(IP-T + T-IP) / 2" in table_row("stage-1 loss")


def recipe_leaves_as_ours():
    return (Path(__file__).parent.parent / "docs" / "authors-code.md").read_text()


def test_readme_names_the_new_parameters_their_optimiser_decays_and_ours_does_not():
    model = small_encoder("paper")
    theirs, new = clip_weights.authors_names(model), model.new_parameter_names()
    optimizer = train.make_optimizer(model, new, adapt.AdaptConfig(data="clevr"))
    ours = {id(p): group["weight_decay"] > 0 for group in optimizer.param_groups for p in group["params"]}
    # their prep_optimizer decays every parameter whose name holds neither "bias" nor "LayerNorm."
    differ = {n for n, p in model.named_parameters() if n in new and "bias" not in theirs[n] and not ours[id(p)]}
    assert differ == {"e1", "e2", "ln_inter.weight"}  # at --lr, where weight decay moves them
    assert all(re.search(rf"\b{name}\b", recipe_leaves_as_ours()) for name in ("e1", "e2", "ln_inter"))


def test_their_all_gather_halves_the_encoders_gradient_on_their_two_gpus_and_the_readme_says_so():
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    before, after = torch.randn(2, 4, 3, 32, 32)
    tokens = torch.randint(1, 1000, (4, 12))
    tokens[:, 6], tokens[:, 7:] = EOT, 0

    def vectors():
        return model.pool(model.encode_pair(before, after)), model.encode_text(tokens)

    contrastive_loss(*vectors(), model.clip.logit_scale).backward()  # one process on the whole batch
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    v, g = vectors()
    for rank in range(2):  # their AllGather.backward: each process's own two rows get a gradient, the rest none
        own = (torch.arange(4) // 2 == rank)[:, None]
        v_r, g_r = (torch.where(own, x, x.detach()) for x in (v, g))
        (contrastive_loss(v_r, g_r, model.clip.logit_scale) / 2).backward(retain_graph=True)  # DDP averages
    for name, p in model.named_parameters():
        share = 1 if name == "clip.logit_scale" else 0.5
        torch.testing.assert_close(p.grad, share * whole[name], rtol=1e-4, atol=1e-7, msg=name)
    assert "two GPUs the encoders learn from half the gradient" in " ".join(recipe_leaves_as_ours().split())
