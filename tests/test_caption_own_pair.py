"""`python evaluate.py --ckpt CKPT --pair BEFORE AFTER [--attention PNG]` on a tiny stage-2 checkpoint:
the printed caption is the captioner's own, and the attention figure follows Figure 3."""
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import cli
import clip_weights
import data
import evaluate
import figures
from evaluate import ids_to_text
from model import Captioner, CaptionerConfig
from tiny import tiny_pair_encoder


def tiny_captioner(n_intra=2):
    torch.manual_seed(0)
    encoder = tiny_pair_encoder(n_intra=n_intra)
    return Captioner(encoder, CaptionerConfig(layers=1, heads=4, ffn=64, max_len=12)).eval()


def save_checkpoint(captioner, path):
    """caption.py's checkpoint format, so that clip_weights.load_checkpoint rebuilds this architecture."""
    torch.save({"model": captioner.state_dict(), "model_config": clip_weights.model_config(captioner)}, path)


def write_pair(folder):
    """A 50x40 PNG and a 64x64 JPEG: sizes and formats other than the model's."""
    rng = np.random.default_rng(0)
    before, after = folder / "before.png", folder / "after.jpg"
    Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(before)
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(after)
    return before, after


def test_prints_the_captioners_caption_of_ones_own_pair(tmp_path, capsys):
    captioner = tiny_captioner()
    save_checkpoint(captioner, tmp_path / "best.pt")
    before, after = write_pair(tmp_path)
    images = [data.read_pixels(p, 32)[None] for p in (before, after)]
    expected = ids_to_text(captioner.generate(*images))[0]
    assert expected  # a caption with words, so that the comparison says something

    # On the CPU, where `expected` was made: on a GPU, --device auto would caption under bf16, with other words
    evaluate.main(["--ckpt", str(tmp_path / "best.pt"), "--pair", str(before), str(after), "--device", "cpu"])
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("n_intra, rows", [(2, ("intra", "inter")), (0, ("inter",)), (3, ("intra",))])
def test_attention_figure_has_a_row_per_encoder_part(tmp_path, capsys, n_intra, rows):
    save_checkpoint(tiny_captioner(n_intra), tmp_path / "best.pt")
    before, after = write_pair(tmp_path)
    out = tmp_path / "figures" / "attention.png"
    evaluate.main(["--ckpt", str(tmp_path / "best.pt"), "--pair", str(before), str(after), "--attention", str(out)])
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out}"

    step = figures.TILE + figures.GAP
    with Image.open(out) as figure:
        assert figure.size == (figures.MARGIN + 2 * step, figures.HEADER + (1 + len(rows)) * step)
        pixels = np.asarray(figure.convert("RGB")).astype(int)
    tiles = [pixels[figures.HEADER + r * step:][:figures.TILE, figures.MARGIN:][:, :2 * step] for r in range(1 + len(rows))]
    photos = np.asarray(Image.open(before).convert("RGB").resize((figures.TILE,) * 2, Image.BICUBIC)).astype(int)
    assert np.abs(tiles[0][:, :figures.TILE] - photos).max() <= 1  # the first row shows the images themselves
    for overlay in tiles[1:]:
        assert np.abs(overlay - tiles[0]).mean() > 10
    if len(rows) == 2:
        assert np.abs(tiles[1] - tiles[2]).mean() > 1  # intra and inter attend differently


def test_intra_maps_see_one_image_and_inter_maps_see_both():
    captioner = tiny_captioner()
    before, after, other = torch.randn(3, 1, 3, 32, 32)
    maps = figures.attention_maps(captioner, before, after)
    assert {k: v.shape for k, v in maps.items()} == {"intra": (2, 4, 4), "inter": (2, 4, 4)}
    changed = figures.attention_maps(captioner, before, other)
    torch.testing.assert_close(changed["intra"][0], maps["intra"][0])  # the before image's own class token
    assert (changed["intra"][1] - maps["intra"][1]).abs().max() > 1e-4
    assert (changed["inter"][0] - maps["inter"][0]).abs().max() > 1e-4  # the pair's class tokens see the change
    attns = [block.attn for block in captioner.encoder.clip.visual.transformer.resblocks]
    assert not any(a.keep_map or a.map is not None for a in attns)  # no maps kept after the figure


def test_maps_are_the_class_token_rows_without_class_token_columns():
    captioner = tiny_captioner()
    before, after = torch.randn(2, 1, 3, 32, 32)
    blocks = captioner.encoder.clip.visual.transformer.resblocks
    for i in (1, 2):
        blocks[i].attn.keep_map = True
    with torch.no_grad():
        captioner.encoder.encode_pair(before, after)
    intra, inter = blocks[1].attn.map, blocks[2].attn.map  # [2, 4, 17, 17] and [1, 4, 34, 34]
    for i in (1, 2):
        blocks[i].attn.keep_map = False
    patches = [j for j in range(34) if j not in (0, 17)]
    expected = {"intra": intra[:, :, 0, 1:].mean(1).reshape(2, 4, 4),
                "inter": inter[0, :, (0, 17)][:, :, patches].mean((0, 1)).reshape(2, 4, 4)}
    maps = figures.attention_maps(captioner, before, after)
    for name in expected:
        torch.testing.assert_close(maps[name], expected[name])


def test_uniform_attention_gives_flat_maps():
    captioner = tiny_captioner()
    with torch.no_grad():  # zero queries: every token attends equally to all tokens it can see
        for block in captioner.encoder.clip.visual.transformer.resblocks:
            block.attn.in_proj_weight[:48].zero_()
            block.attn.in_proj_bias[:48].zero_()
    maps = figures.attention_maps(captioner, *torch.randn(2, 1, 3, 32, 32))
    torch.testing.assert_close(maps["intra"], torch.full((2, 4, 4), 1 / 17))  # n + 1 = 17 tokens per image
    torch.testing.assert_close(maps["inter"], torch.full((2, 4, 4), 1 / 34))  # 2(n + 1) tokens per pair


def test_both_images_of_an_attention_row_share_its_scale():
    tile, images = figures.TILE, [Image.new("RGB", (figures.TILE, figures.TILE), "gray")] * 2
    figure = figures.attention_figure(images, {"inter": torch.stack([torch.full((4, 4), 0.1), torch.full((4, 4), 0.2)])})
    y = figures.HEADER + tile + figures.GAP + tile // 2
    shown = [figure.getpixel((figures.MARGIN + c * (tile + figures.GAP) + tile // 2, y)) for c in (0, 1)]
    assert shown == [Image.blend(images[0], figures.heatmap(torch.full((4, 4), w), tile), 0.5).getpixel((0, 0))
                     for w in (0.5, 1.0)]


def test_examples_figure_breaks_a_word_longer_than_a_line(tmp_path):
    before, after = write_pair(tmp_path)
    figure = figures.examples_figure([data.Pair("0", before, after, ["a" * 200], "move")], {"0": "b" * 200})
    width, height, gap, font_size, lines = figures.EXAMPLE
    assert figure.size == (2 * (2 * width + gap) + 12 * gap, height + gap + lines * (font_size + 3) + 6 * gap)


def test_examples_are_the_first_of_each_change_type_in_table_2s_order_or_else_the_first_six():
    types = ["move", "move", "material", "distractor", "color", "color", "drop", "add"]
    items = [data.Pair(str(n), Path("b.png"), Path("a.png"), ["c"], t) for n, t in enumerate(types)]
    assert [i.id for i in figures.example_items(items)] == ["4", "2", "0", "7", "6", "3"]
    untyped = [data.Pair(str(n), Path("b.png"), Path("a.png"), ["c"]) for n in range(8)]
    assert [i.id for i in figures.example_items(untyped)] == ["0", "1", "2", "3", "4", "5"]


def cli_error(capsys, *argv):
    """The one-line error that `python evaluate.py ARGV` ends with (exit status 2, no traceback)."""
    with pytest.raises(SystemExit) as exit:
        cli.main(evaluate.main, [str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("missing", ["ckpt", "image"])
def test_missing_files_are_named(tmp_path, capsys, missing):
    save_checkpoint(tiny_captioner(), tmp_path / "best.pt")
    before, after = write_pair(tmp_path)
    ckpt = tmp_path / ("nope.pt" if missing == "ckpt" else "best.pt")
    after = tmp_path / "nope.png" if missing == "image" else after
    error = cli_error(capsys, "--ckpt", ckpt, "--pair", before, after)
    assert str(tmp_path / "nope") in error
    if missing == "image":
        assert error.endswith(f"--pair: {after} is not a file; expected the two images, before and after")


def test_unreadable_image_is_named(tmp_path, capsys):
    save_checkpoint(tiny_captioner(), tmp_path / "best.pt")
    before, _ = write_pair(tmp_path)
    (tmp_path / "notes.png").write_text("not an image")
    error = cli_error(capsys, "--ckpt", tmp_path / "best.pt", "--pair", before, tmp_path / "notes.png")
    assert f"{tmp_path / 'notes.png'}: cannot read image" in error


def test_a_file_of_pairs_naming_a_file_that_is_no_image_is_refused_before_captioning(tmp_path, capsys):
    save_checkpoint(tiny_captioner(), tmp_path / "best.pt")
    before, after = write_pair(tmp_path)
    (tmp_path / "notes.png").write_text("not an image")
    lines = [f"{before.name} {after.name}"] * evaluate.EVAL_BATCH + [f"{before.name} notes.png"]
    (tmp_path / "pairs.txt").write_text("\n".join(lines))
    error = cli_error(capsys, "--ckpt", tmp_path / "best.pt", "--pairs", tmp_path / "pairs.txt")
    assert "captioned" not in error
    assert error.split(": error: ")[1].startswith(f"{tmp_path / 'pairs.txt'}: {tmp_path / 'notes.png'}: cannot read image")


def test_an_image_found_unreadable_while_captioning_comes_after_the_progress_line(tmp_path, capsys):
    save_checkpoint(tiny_captioner(), tmp_path / "best.pt")
    before, after = write_pair(tmp_path)
    whole = before.read_bytes()
    (tmp_path / "cut.png").write_bytes(whole[:len(whole) // 2])  # its header read, its pixels cut short
    lines = [f"{before.name} {after.name}"] * evaluate.EVAL_BATCH + [f"{before.name} cut.png"]
    (tmp_path / "pairs.txt").write_text("\n".join(lines))
    with pytest.raises(SystemExit):
        cli.main(evaluate.main, ["--ckpt", str(tmp_path / "best.pt"), "--pairs", str(tmp_path / "pairs.txt")])
    progress, error, end = capsys.readouterr().err.split("\n")
    assert progress.startswith("\rcaptioned 64/65 pairs, eta ") and end == ""
    assert error.split(": error: ")[1].startswith(f"{tmp_path / 'cut.png'}: cannot read image")


def test_pair_needs_a_checkpoint(capsys):
    assert "--ckpt with one of --pair, --pairs, --data_root" in cli_error(capsys, "--pair", "a.png", "b.png")
