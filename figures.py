"""Figures of CLIP4IDC: the vision encoder's attention over a pair of images, in the spirit of the
paper's Figure 3 (`evaluate.py --ckpt CKPT --pair B A --attention out.png`), and examples.png, test
pairs with the generated caption and a reference under them (the end of caption.py).
"""
import io
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

import data
from data import CHANGE_TYPES, PAPER_TYPE_NAME

TILE, GAP, MARGIN, HEADER = 224, 4, 64, 24  # figure layout in pixels: image tiles, gaps, label space
HEAT = np.array([[0, 0, 130], [0, 150, 255], [255, 230, 0], [220, 0, 0]], dtype=float)  # heatmap colours, low -> high


@torch.no_grad()
def attention_maps(captioner, before, after):
    """{"intra": [2, g, g], "inter": [2, g, g]}: the class tokens' attention, mean over heads, to the
    g x g patches of the before and the after image, in the last intra and the last inter layer."""
    encoder = captioner.encoder
    blocks, n_intra = encoder.clip.visual.transformer.resblocks, encoder.config.n_intra
    layers = {}
    if n_intra:
        layers["intra"] = blocks[n_intra - 1].attn
    if encoder.config.n_inter:
        layers["inter"] = blocks[-1].attn
    for attn in layers.values():
        attn.keep_map = True
    try:
        encoder.encode_pair(before, after)
        maps = {name: attn.map for name, attn in layers.items()}
    finally:
        for attn in layers.values():
            attn.keep_map, attn.map = False, None
    n1 = encoder.clip.visual.positional_embedding.shape[0]  # n + 1 tokens per image
    grid = encoder.config.clip.image_size // encoder.config.clip.patch_size
    if "intra" in maps:  # the batch holds [before; after]: each class token sees its own image only
        maps["intra"] = maps["intra"][:, :, 0, 1:].mean(1)
    if "inter" in maps:  # one sequence [cls1, patches1, cls2, patches2]: both class tokens see both images
        maps["inter"] = maps["inter"][0, :, [0, n1]].mean((0, 1)).view(2, n1)[:, 1:]
    return {name: m.view(2, grid, grid).cpu() for name, m in maps.items()}


def heatmap(weights, size):
    """weights [g, g] in [0, 1] as a size x size RGB image, dark blue (low) through yellow to red."""
    x = np.asarray(Image.fromarray(weights.float().numpy()).resize((size, size), Image.BILINEAR))
    rgb = np.stack([np.interp(x, np.linspace(0, 1, len(HEAT)), HEAT[:, c]) for c in range(3)], axis=-1)
    return Image.fromarray(rgb.round().astype(np.uint8))


def attention_figure(images, maps):
    """Columns before / after; rows the images, then each map of attention_maps overlaid on them.

    Both images of a row share one scale, the row's largest weight, so the figure shows how the
    attention splits between the images, and a uniform map stays uniform rather than stretched."""
    rows, step = ["images", *maps], TILE + GAP
    figure = Image.new("RGB", (MARGIN + 2 * step, HEADER + len(rows) * step), "white")
    draw, font = ImageDraw.Draw(figure), ImageFont.load_default(size=16)
    for c, label in enumerate(("before", "after")):
        draw.text((MARGIN + c * step + 4, 4), label, fill="black", font=font)
    for r, name in enumerate(rows):
        y = HEADER + r * step
        draw.text((4, y + TILE // 2 - 8), name, fill="black", font=font)
        for c, image in enumerate(images):
            if name != "images":
                image = Image.blend(image, heatmap(maps[name][c] / maps[name].max(), TILE), 0.5)
            figure.paste(image, (MARGIN + c * step, y))
    return figure


EXAMPLE = (240, 160, 6, 13, 5)  # examples.png: image box width and height, gap, font size, text lines a pair


def example_items(items):
    """A fixed handful of evaluation items: on CLEVR-Change the first of each change type (Table 2's
    order), a distractor among them; elsewhere the first six."""
    firsts = [next((i for i in items if PAPER_TYPE_NAME.get(i.change_type, i.change_type) == t), None)
              for t in CHANGE_TYPES]
    return [i for i in firsts if i] or items[:6]


def examples_figure(items, preds):
    """For each item, before and after side by side (at their own aspect), and under them the
    generated caption and the first reference, in a grid of two columns."""
    width, height, gap, font_size, lines = EXAMPLE
    cell_w, cell_h = 2 * width + gap, height + gap + lines * (font_size + 3)
    rows = (len(items) + 1) // 2
    figure = Image.new("RGB", (2 * cell_w + 3 * gap * 4, rows * (cell_h + 4 * gap) + 2 * gap), "white")
    draw, font = ImageDraw.Draw(figure), ImageFont.load_default(size=font_size)
    chars = int(2 * width / (font_size * 0.55))  # what a line under the pair holds, at a glyph's mean width
    for n, item in enumerate(items):
        x, y = 4 * gap + (n % 2) * (cell_w + 4 * gap), 2 * gap + (n // 2) * (cell_h + 4 * gap)
        for k, path in enumerate((item.before, item.after)):
            with Image.open(path) as image:
                image = data.to_rgb(image)
            image.thumbnail((width, height))
            figure.paste(image, (x + k * (width + gap) + (width - image.width) // 2, y + (height - image.height) // 2))
        kind = PAPER_TYPE_NAME.get(item.change_type, item.change_type)
        text = [(f"{kind + ': ' if kind else ''}model: {preds[item.id]}", "navy"), (f"reference: {item.captions[0]}", "dimgray")]
        wrapped = [(line, color) for caption, color in text for line in textwrap.wrap(caption, chars)]
        for k, (line, color) in enumerate(wrapped[:lines]):
            draw.text((x, y + height + gap + k * (font_size + 3)), line, fill=color, font=font)
    return figure


def examples_png(items, preds):
    """examples.png (see examples_figure), as the bytes of the file."""
    return encoded(examples_figure(example_items(items), preds), "examples.png")


def attention_file(captioner, before, after, paths, out):
    """Figure 3 for preprocessed images before, after read from the files `paths`, as the bytes of a
    file in the format that the name `out` asks for."""
    images = [Image.fromarray(data.read_pixels(p, TILE).permute(1, 2, 0).numpy()) for p in paths]
    return encoded(attention_figure(images, attention_maps(captioner, before, after)), out)


def encoded(image, path):
    """`image` as the bytes of a file in the format of the file name `path`, for the caller to write whole."""
    buffer = io.BytesIO()
    image.save(buffer, format=Image.registered_extensions()[Path(path).suffix.lower()])
    return buffer.getvalue()


def pillow_writes(path):
    """Whether Pillow writes a colour image in the format of the file name `path`: it reads more than it writes."""
    try:
        encoded(Image.new("RGB", (1, 1)), path)
    except (KeyError, OSError, ValueError):
        return False
    return True
