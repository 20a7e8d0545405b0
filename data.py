"""Data for CLIP4IDC: CLIP's BPE tokenizer, readers for the three benchmarks, CLIP4IDC's preprocessing,
the datasets of both stages, and a synthetic CLEVR-Change for offline runs.

    python data.py synth --out data/synth --pairs 2400 --seed 0   # write the offline dataset

The tokenizer is OpenAI's byte-level BPE, rewritten here; `tokenize` matches `clip.tokenize`.
"""
import argparse
import functools
import gzip
import hashlib
import html
import json
import logging
import multiprocessing
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import ftfy
import numpy as np
import regex as re
import torch
from PIL import Image, ImageDraw

# ---------------------------------------------------------------------------------------------
# CLIP's byte-level BPE tokenizer
# ---------------------------------------------------------------------------------------------
BPE_PATH = Path(__file__).parent / "assets" / "bpe_simple_vocab_16e6.txt.gz"
BPE_SHA256 = "924691ac288e54409236115652ad4aa250f48203de50a9e4722a6ecd48d6804a"
N_MERGES = 49152 - 256 - 2  # vocab 49408 = 256 bytes * 2 (+ '</w>' forms) + merges + SOT + EOT
SOT, EOT = 49406, 49407  # the start- and end-of-text ids
SPECIAL = ("<|startoftext|>", "<|endoftext|>")
TOKEN_PATTERN = re.compile(
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    re.IGNORECASE)


def bytes_to_unicode():
    """Map every byte to a printable unicode character, so BPE never sees whitespace or control codes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # moved past 255, in order
    return dict(zip(printable + others, map(chr, printable + list(range(256, 256 + len(others))))))


def clean(text):
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip().lower()


class Tokenizer:
    def __init__(self, bpe_path=BPE_PATH):
        raw = Path(bpe_path).read_bytes()
        digest = hashlib.sha256(raw).hexdigest()
        if digest != BPE_SHA256:
            raise ValueError(f"{bpe_path}: SHA-256 {digest} is not that of OpenAI's merges file ({BPE_SHA256})")
        lines = gzip.decompress(raw).decode("utf-8").split("\n")
        merges = [tuple(line.split()) for line in lines[1:N_MERGES + 1]]  # line 0 is a version header
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        vocab = list(self.byte_encoder.values())
        vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + list(SPECIAL)
        self.encoder = {tok: i for i, tok in enumerate(vocab)}
        self.decoder = {i: tok for tok, i in self.encoder.items()}
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}

    @functools.lru_cache(maxsize=100_000)
    def bpe(self, word):
        """Merge the symbols of one word, lowest-ranked pair first, until no known pair is left."""
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        while len(symbols) > 1:
            pairs = {(a, b) for a, b in zip(symbols, symbols[1:])}
            best = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i < len(symbols) - 1 and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return tuple(symbols)

    def encode(self, text):
        ids = []
        for word in TOKEN_PATTERN.findall(clean(text)):
            if word in SPECIAL:
                ids.append(self.encoder[word])
                continue
            word = "".join(self.byte_encoder[b] for b in word.encode("utf-8"))
            ids.extend(self.encoder[s] for s in self.bpe(word))
        return ids

    def decode(self, ids):
        text = "".join(self.decoder[i] for i in ids if i not in (SOT, EOT))
        text = bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
        return text.replace("</w>", " ").strip()


@functools.lru_cache(maxsize=1)
def get_tokenizer():
    return Tokenizer()


def tokenize(texts, context_length=77):
    """SOT + BPE ids + EOT, zero padded to `context_length`; overlong texts are cut and still end in EOT."""
    if isinstance(texts, str):
        texts = [texts]
    tok = get_tokenizer()
    out = torch.zeros(len(texts), context_length, dtype=torch.long)
    for row, text in enumerate(texts):
        ids = [SOT] + tok.encode(text)[:context_length - 2] + [EOT]
        out[row, :len(ids)] = torch.tensor(ids)
    return out


# ---------------------------------------------------------------------------------------------
# The three benchmarks, read in the layouts their authors publish
# ---------------------------------------------------------------------------------------------
log = logging.getLogger("data")
SOURCES = {  # name, expected layout, where it is published
    "clevr": ("CLEVR-Change", "images/CLEVR_default_%06d.png, sc_images/CLEVR_semantic_%06d.png, "
              "nsc_images/CLEVR_nonsemantic_%06d.png, change_captions.json, no_change_captions.json, "
              "splits.json, type_mapping.json", "https://github.com/Seth-Park/RobustChangeCaptioning"),
    "spot": ("Spot-the-Diff", "{train,val,test}.json (or annotations/{split}.json) of {img_id, sentences}, "
             "resized_images/ (or images/) holding <img_id>.png and <img_id>_2.png",
             "https://github.com/harsh19/spot-the-diff"),
    "ier": ("Image-Editing-Request", "{train,valid,test}.json (or dataset/adobe/{split}.json) of "
            "{img0, img1, sents, uid}, images/ holding the files they name",
            "https://github.com/airsplay/VisualRelationships"),
}


@dataclass
class Pair:
    id: str
    before: Path
    after: Path
    captions: list[str]
    change_type: str | None = None  # a CLEVR-Change type_mapping key, "distractor", or None
    distractor: Path | None = None  # the before scene under another viewpoint / light only (CLEVR-Change)
    distractor_captions: list[str] = field(default_factory=list)


def missing(dataset, path, what="not found"):
    name, layout, url = SOURCES[dataset]
    return FileNotFoundError(f"{path}: {what}; expected {name}'s layout ({layout}), published at {url}")


def read_json(dataset, *candidates, keys=()):
    """The JSON of the first existing candidate file; with `keys`, a list of objects that must have them."""
    path = next((p for p in candidates if p.is_file()), candidates[0])
    if not path.is_file():
        raise missing(dataset, path)
    try:
        content = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno} (char {e.pos})"
        raise ValueError(f"{path}: malformed JSON at {where}: {e.msg}") from None
    if keys:
        for n, entry in enumerate(content if isinstance(content, list) else [None]):
            if not (isinstance(entry, dict) and all(k in entry for k in keys)):
                raise ValueError(f"{path}: entry {n} is not an object with keys {', '.join(keys)}")
    return content


def read_clevr(root, split):
    splits = read_json("clevr", root / "splits.json")
    if split not in splits:
        raise ValueError(f"{root / 'splits.json'}: no split {split!r} (it has {', '.join(splits)})")
    change, no_change, types = (read_json("clevr", root / f"{name}.json")
                                for name in ("change_captions", "no_change_captions", "type_mapping"))
    type_of = {name: kind for kind, names in types.items() for name in names}
    pairs, uncaptioned = [], []
    for i in splits[split]:
        name, default = f"{i:06d}.png", f"CLEVR_default_{i:06d}.png"
        if not (change.get(default) and no_change.get(default)):
            uncaptioned.append(i)
            continue
        pairs.append(Pair(name, root / "images" / default, root / "sc_images" / f"CLEVR_semantic_{name}",
                          change[default], type_of.get(name), root / "nsc_images" / f"CLEVR_nonsemantic_{name}",
                          no_change[default]))
    if uncaptioned:  # the published data has a few such ids; the reference loaders cannot use them either
        log.warning("%s %s: skipped %d of %d ids without change or no-change captions (first: %s)", root, split,
                    len(uncaptioned), len(splits[split]), ", ".join(map(str, uncaptioned[:5])))
    return pairs


def read_spot(root, split):
    entries = read_json("spot", root / f"{split}.json", root / "annotations" / f"{split}.json",
                        keys=("img_id", "sentences"))
    images = root / "resized_images" if (root / "resized_images").is_dir() else root / "images"
    sentences = {}  # one img_id may be annotated in several entries: merge them into one pair
    for entry in entries:
        sentences.setdefault(str(entry["img_id"]), []).extend(entry["sentences"])
    return [Pair(f"{i}.png", images / f"{i}.png", images / f"{i}_2.png", sents) for i, sents in sentences.items()]


def read_ier(root, split):
    split = {"val": "valid"}.get(split, split)
    entries = read_json("ier", root / f"{split}.json", root / "dataset" / "adobe" / f"{split}.json",
                        keys=("img0", "img1", "sents", "uid"))
    return [Pair(e["uid"], root / "images" / e["img0"], root / "images" / e["img1"], e["sents"]) for e in entries]


def read_split(dataset, root, split):
    """The pairs of one split; "synth" is our CLEVR-Change look-alike and shares its reader."""
    dataset = "clevr" if dataset == "synth" else dataset
    if dataset not in SOURCES:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of clevr, spot, ier, synth")
    root = Path(root)
    if not root.is_dir():
        raise missing(dataset, root, "no such folder")
    pairs = {"clevr": read_clevr, "spot": read_spot, "ier": read_ier}[dataset](root, split)
    lacking = [(p.id, q) for p in pairs for q in (p.before, p.after, p.distractor) if q and not q.is_file()]
    if lacking:
        ids = list(dict.fromkeys(i for i, _ in lacking))
        raise missing(dataset, lacking[0][1], f"not found, and {len(ids)} of {len(pairs)} {split} pairs lack "
                                              f"image files (ids {', '.join(ids[:5])}{', ...' * (len(ids) > 5)})")
    return pairs


def eval_items(pairs):
    """Every change pair, and on CLEVR-Change each distractor as its own no-change pair "<id>_n"."""
    items = []
    for p in pairs:
        items.append(p)
        if p.distractor:
            items.append(Pair(p.id + "_n", p.before, p.distractor, p.distractor_captions, "distractor"))
    return items


# ---------------------------------------------------------------------------------------------
# Preprocessing as CLIP4IDC does it, and the datasets of the two stages
# ---------------------------------------------------------------------------------------------
def read_pixels(path, size):
    """uint8 [3,size,size]: RGB (a gif's first frame), the whole image resized bicubic, no crop.
    The model normalises them (model.VisionTransformer.embed)."""
    return torch.from_numpy(read_array(path, size))


def read_array(path, size):
    """read_pixels as a numpy array. Pillow and numpy only: the image store's worker processes are
    forked, and torch's thread pool does not survive a fork."""
    try:
        with Image.open(path) as image:
            image = image.convert("RGB").resize((size, size), Image.BICUBIC)
    except FileNotFoundError:
        raise
    except (OSError, SyntaxError, ValueError) as e:  # PIL's errors for truncated or unrecognised files
        raise ValueError(f"{path}: cannot read image ({e})") from None
    return np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1))


def format_eta(seconds):
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


class ImageStore:
    """Every image of `pairs` resized once to `size` px and kept as uint8 in one memory-mapped file,
    `<folder>/store_<size>px.u8` (3 * size * size bytes an image: 150 KB at 224 px); called like
    `read_pixels`. Decoding and resizing a PNG costs ~30x more than reading stored pixels (see
    bench.py), and pages come from disk as they are read, so memory use does not grow with the
    dataset. The index beside it (`.json`) records each file's size and modification time: another
    image list, size, or a replaced file rebuilds the store."""

    def __init__(self, pairs, size, folder):
        files = sorted({os.path.abspath(q) for p in pairs for q in (p.before, p.after, p.distractor) if q})
        self.path, self.size, self.pixels = Path(folder) / f"store_{size}px.u8", size, None
        self.row = {f: i for i, f in enumerate(files)}
        index, index_path = {"size": size, "files": [[f, *stamp(f)] for f in files]}, self.path.with_suffix(".json")
        if not (index_path.is_file() and self.path.is_file() and json.loads(index_path.read_text()) == index):
            index_path.unlink(missing_ok=True)  # the index goes last: it vouches for the pixels
            build_store(self.path, files, size)
            index_path.with_suffix(".tmp").write_text(json.dumps(index))
            os.replace(index_path.with_suffix(".tmp"), index_path)

    def __call__(self, path, size):
        if size != self.size:
            raise ValueError(f"{self.path} holds {self.size} px images, not {size} px")
        if self.pixels is None:  # mapped in each process that reads, DataLoader workers included
            self.pixels = np.memmap(self.path, np.uint8, "r", shape=(len(self.row), 3, size, size))
        return torch.from_numpy(np.array(self.pixels[self.row[os.path.abspath(path)]]))


def stamp(path):
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def build_store(path, files, size):
    """Decode and resize `files` on every core into the uint8 file `path`, written whole or not at all."""
    tmp, start = Path(f"{path}.tmp"), time.time()
    tmp.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.memmap(tmp, np.uint8, "w+", shape=(len(files), 3, size, size))
    with multiprocessing.Pool(min(os.cpu_count() or 1, 1 + len(files) // 64)) as pool:
        for i, image in enumerate(pool.imap(functools.partial(read_array, size=size), files, chunksize=16), 1):
            pixels[i - 1] = image
            if i % 2000 == 0 or i == len(files):
                rate = i / (time.time() - start)
                log.info("image store %s: %d/%d images, %.0f/s, eta %s", path, i, len(files), rate,
                         format_eta((len(files) - i) / rate))
    pixels.flush()
    del pixels
    os.replace(tmp, path)


def sample_rng(seed, epoch, index):
    """Randomness fixed by (seed, epoch, index): samples do not depend on workers or order."""
    return random.Random(f"{seed}:{epoch}:{index}")  # str seeds are hashed with SHA-512, not hash()


class AdaptDataset(torch.utils.data.Dataset):
    """Stage 1: one sample per (pair, caption); key (epoch, index) -> before, after, caption_ids [L].

    On CLEVR-Change the before image is the distractor with probability 0.5 and the caption stays,
    so the pair encoder learns to tell a scene change from a change of viewpoint or light. Images
    are uint8; `store` (an ImageStore) serves them instead of the files.
    """

    def __init__(self, pairs, image_size, context_length=32, seed=42, store=None):
        self.samples = [(pair, caption) for pair in pairs for caption in pair.captions]
        self.tokens = tokenize([caption for _, caption in self.samples], context_length)  # once, not per epoch
        self.size, self.seed, self.load = image_size, seed, store or read_pixels

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, key):
        pair = self.samples[key[1]][0]
        swap = pair.distractor is not None and sample_rng(self.seed, *key).random() < 0.5
        before = self.load(pair.distractor if swap else pair.before, self.size)
        return before, self.load(pair.after, self.size), self.tokens[key[1]]


class CaptionDataset(torch.utils.data.Dataset):
    """Stage 2: one sample per pair; key (epoch, index) -> before [3,H,W], after [k,3,H,W], ids [k,L].

    k = 2 where the pair has a distractor: the change pair and its no-change pair (see `eval_items`),
    sharing the before image, each with one of its captions, as CLIP4IDC trains; else k = 1.
    """

    def __init__(self, pairs, image_size, context_length=32, seed=42, store=None):
        self.items, self.rows, captions = [eval_items([pair]) for pair in pairs], [], []
        for items in self.items:  # rows[i][j]: the rows of self.tokens that hold item j of pair i's captions
            self.rows.append([])
            for item in items:
                self.rows[-1].append(range(len(captions), len(captions) + len(item.captions)))
                captions += item.captions
        self.tokens = tokenize(captions, context_length)  # once, not at every epoch
        self.size, self.seed, self.load = image_size, seed, store or read_pixels

    def __len__(self):
        return len(self.items)

    def __getitem__(self, key):
        items, rng = self.items[key[1]], sample_rng(self.seed, *key)
        after = torch.stack([self.load(item.after, self.size) for item in items])
        return self.load(items[0].before, self.size), after, self.tokens[[rng.choice(r) for r in self.rows[key[1]]]]


class EvalDataset(torch.utils.data.Dataset):
    """Evaluation items (see `eval_items`) -> (index, before, after); the references are items[index].captions."""

    def __init__(self, items, image_size, store=None):
        self.items, self.size, self.load = items, image_size, store or read_pixels

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        item = self.items[index]
        return index, self.load(item.before, self.size), self.load(item.after, self.size)


# ---------------------------------------------------------------------------------------------
# A synthetic CLEVR-Change, drawn with Pillow and written in CLEVR-Change's layout
# ---------------------------------------------------------------------------------------------
W, H, Y_FAR, Y_NEAR = 480, 320, 80, 290  # image size; ground rows of the farthest and nearest objects
COLORS = {"gray": (87, 87, 87), "red": (173, 35, 35), "blue": (42, 75, 215), "green": (29, 105, 20),
          "brown": (129, 74, 25), "purple": (129, 38, 192), "cyan": (41, 208, 208), "yellow": (255, 238, 51)}
SHAPES, MATERIALS, SIZES = ("cube", "sphere", "cylinder"), ("rubber", "metal"), {"small": 18, "large": 30}
CHANGES = ("color", "material", "add", "drop", "move")
SAME_CAMERA = {"dx": 0.0, "dy": 0.0, "zoom": 1.0, "light": 1.0}
WORDS = {"small": ("small", "tiny"), "large": ("large", "big"), "rubber": ("rubber", "matte"),
         "metal": ("metal", "metallic", "shiny"), "sphere": ("sphere", "ball"), "cube": ("cube", "block"),
         "cylinder": ("cylinder",)}
BECAME = ("the {o} changed to {new}", "the {o} turned {new}", "the {o} became {new}", "the {o} is now {new}")
TEMPLATES = {
    "color": BECAME + ("the {o} was painted {new}",), "material": BECAME,
    "add": ("a {o} has been added", "someone added a {o}", "a {o} appeared", "there is a new {o}",
            "a {o} has appeared"),
    "drop": ("the {o} has disappeared", "the {o} is missing", "the {o} is gone", "someone removed the {o}"),
    "move": ("the {o} changed its location", "the {o} has been moved", "the {o} is in a different location",
             "the {o} moved", "someone moved the {o}"),
}
NO_CHANGE = ("the scene remains the same", "nothing has changed", "no change was made", "the two scenes seem identical",
             "there is no difference", "no change has occurred", "the scene is the same as before",
             "nothing was modified")


def radius(obj):
    return SIZES[obj["size"]] * (0.9 + 0.25 * (obj["y"] - Y_FAR) / (Y_NEAR - Y_FAR))  # mild perspective


def place(obj, others, rng, away_from=None):
    """Put `obj` on a free spot of the floor (at least 80 px from `away_from`); False if none was found."""
    for _ in range(200):
        obj["x"], obj["y"] = round(rng.uniform(60, 420), 1), round(rng.uniform(Y_FAR, Y_NEAR), 1)
        x, y, r = obj["x"], obj["y"] - radius(obj), radius(obj)  # the body's disc, centred a radius above the floor
        free = all(np.hypot(x - o["x"], y - o["y"] + radius(o)) > r + radius(o) + 8 for o in others)
        if free and (away_from is None or np.hypot(obj["x"] - away_from[0], obj["y"] - away_from[1]) > 80):
            return True
    return False


def new_object(rng):
    return {"shape": rng.choice(SHAPES), "color": rng.choice(list(COLORS)), "material": rng.choice(MATERIALS),
            "size": rng.choice(list(SIZES))}


def make_scene(rng):
    objects = []
    for _ in range(rng.randint(3, 6)):
        objects.append(new_object(rng))
        if not place(objects[-1], objects[:-1], rng):
            return None
    return objects


def change_scene(objects, kind, rng):
    """(after, the changed object before and after the change), or None where the change does not fit."""
    after = [dict(o) for o in objects]
    if kind == "add":
        obj = new_object(rng)
        return (after + [obj], None, obj) if place(obj, after, rng) else None
    i = rng.randrange(len(after))
    obj = after[i]
    if kind == "drop":
        return after[:i] + after[i + 1:], objects[i], None
    if kind == "color":
        obj["color"] = rng.choice([c for c in COLORS if c != obj["color"]])
    elif kind == "material":
        obj["material"] = "metal" if obj["material"] == "rubber" else "rubber"
    elif not place(obj, after[:i] + after[i + 1:], rng, away_from=(obj["x"], obj["y"])):
        return None
    return after, objects[i], obj


def project(obj, cam):
    """Ground point and radius of `obj` in the image, after the camera's shift and zoom about the centre."""
    zoom = cam["zoom"]
    x, y = W / 2 + (obj["x"] - W / 2) * zoom + cam["dx"], H / 2 + (obj["y"] - H / 2) * zoom + cam["dy"]
    return x, y, radius(obj) * zoom


def draw_object(draw, obj, cam):
    x, y, r = project(obj, cam)
    lo, hi = (0.3, 1.6) if obj["material"] == "metal" else (0.55, 1.15)  # metal: harder light and dark

    def tone(k, white=0.0):  # the object's colour under light k, mixed with a `white` share of specular light
        return tuple(int(min(255, (c * k * (1 - white) + 255 * white) * cam["light"])) for c in COLORS[obj["color"]])

    if obj["shape"] == "sphere":  # concentric discs drifting towards the light at the upper left
        for t in np.linspace(0, 1, 9):
            cx, cy, rr = x - 0.4 * r * t, y - r - 0.4 * r * t, r * (1 - 0.85 * t)
            draw.ellipse([cx - rr, cy - rr, cx + rr, cy + rr], fill=tone(lo + (hi - lo) * t ** 1.5))
    elif obj["shape"] == "cube":  # front, top and side faces in an oblique view
        s, d = 1.45 * r, 0.4 * r
        x0 = x - (s + d) / 2
        draw.polygon([(x0, y), (x0 + s, y), (x0 + s, y - s), (x0, y - s)], fill=tone((lo + hi) / 2))
        draw.polygon([(x0, y - s), (x0 + s, y - s), (x0 + s + d, y - s - d), (x0 + d, y - s - d)], fill=tone(hi))
        draw.polygon([(x0 + s, y), (x0 + s + d, y - d), (x0 + s + d, y - s - d), (x0 + s, y - s)], fill=tone(lo))
    else:  # cylinder: vertical strips, brightest towards the light, between a dark base and a lit top
        rc, h, e = 0.85 * r, 1.5 * r, 0.3 * r
        draw.ellipse([x - rc, y - e, x + rc, y + e], fill=tone(lo))
        for j, t in enumerate(np.linspace(0, 1, 10)):
            draw.rectangle([x - rc + 0.2 * rc * j, y - h, x - rc + 0.2 * rc * (j + 1), y],
                           fill=tone(hi - (hi - lo) * abs(t - 0.3) / 0.7))
        draw.ellipse([x - rc, y - h - e, x + rc, y - h + e], fill=tone(hi))
    if obj["material"] == "metal":  # a specular highlight
        hx, hy = (x - 0.45 * r, y - 1.45 * r) if obj["shape"] == "sphere" else (x - 0.35 * r, y - 1.6 * r)
        draw.ellipse([hx - 0.2 * r, hy - 0.12 * r, hx + 0.2 * r, hy + 0.12 * r], fill=tone(1, white=0.85))


def render(objects, cam=SAME_CAMERA):
    floor = (np.linspace(178, 122, H) * cam["light"]).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(np.ascontiguousarray(np.broadcast_to(floor[:, None, None], (H, W, 3))))
    draw = ImageDraw.Draw(image)
    objects = sorted(objects, key=lambda o: o["y"])  # far to near, so nearer objects occlude
    for x, y, r in (project(o, cam) for o in objects):  # contact shadows, cast away from the light
        shadow = int(floor[min(int(y), H - 1)] * 0.7)
        draw.ellipse([x - 0.8 * r, y - 0.35 * r, x + 1.4 * r, y + 0.35 * r], fill=(shadow,) * 3)
    for o in objects:
        draw_object(draw, o, cam)
    return image


def describe(obj, scene, rng):
    """A noun phrase for `obj`, sometimes with a spatial relation to another object of `scene`."""
    words = [rng.choice(WORDS[obj["size"]]), obj["color"]]
    if rng.random() < 0.5:
        words.append(rng.choice(WORDS[obj["material"]]))
    words.append(rng.choice(WORDS[obj["shape"]]) if rng.random() < 0.8 else rng.choice(("thing", "object")))
    others = [o for o in scene if (o["x"], o["y"]) != (obj["x"], obj["y"])]
    if others and rng.random() < 0.3:
        other = rng.choice(others)
        dx, dy = obj["x"] - other["x"], obj["y"] - other["y"]
        where = ("left of" if dx < 0 else "right of") if abs(dx) > abs(dy) else ("in front of" if dy > 0 else "behind")
        words += ["that is", where, "the", describe(other, [], rng)]
    return " ".join(words)


def change_captions(kind, before, after, old, new, rng, n=5):
    """`n` distinct references for one change, in the style of CLEVR-Change's templates."""
    subject, scene = (new, after) if kind == "add" else (old, before)
    captions = {}  # a dict keeps the drawing order, so the output is deterministic
    while len(captions) < n:
        value = new["color"] if kind == "color" else rng.choice(WORDS[new["material"]]) if kind == "material" else ""
        captions[rng.choice(TEMPLATES[kind]).format(o=describe(subject, scene, rng), new=value)] = None
    return list(captions)


def synth_pair(i, seed):
    """The scene graphs, change captions and no-change captions of pair `i`, fixed by (seed, i)."""
    rng = random.Random(f"synth:{seed}:{i}")
    kind, change = CHANGES[i % len(CHANGES)], None  # types cycle, so every split is balanced
    while change is None:
        before = make_scene(rng)
        change = before and change_scene(before, kind, rng)
    after, old, new = change
    camera = {"dx": round(rng.uniform(-10, 10), 1), "dy": round(rng.uniform(-6, 6), 1),
              "zoom": round(rng.uniform(0.94, 1.06), 3),
              "light": round(1 + rng.choice((-1, 1)) * rng.uniform(0.08, 0.2), 3)}  # 8-20% darker or brighter
    scene = {"change_type": kind, "before": before, "after": after, "distractor_camera": camera}
    return scene, change_captions(kind, before, after, old, new, rng), rng.sample(NO_CHANGE, 5)


def write_synth(out, n_pairs, seed):
    """Write `n_pairs` pairs to `out` in CLEVR-Change's layout, plus scenes.json with the scene graphs drawn."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new folder for the synthetic dataset")
    tmp = out.with_name(out.name + ".partial")  # renamed when complete: an interrupted run leaves no dataset
    shutil.rmtree(tmp, ignore_errors=True)
    files = {"change_captions": {}, "no_change_captions": {}, "type_mapping": {k: [] for k in CHANGES}, "scenes": {}}
    for folder in ("images", "sc_images", "nsc_images"):
        (tmp / folder).mkdir(parents=True)
    for i in range(n_pairs):
        scene, captions, no_change = synth_pair(i, seed)
        distractor_camera = scene["distractor_camera"]
        name = f"{i:06d}.png"
        for folder, prefix, objects, camera in (("images", "default", scene["before"], SAME_CAMERA),
                                                ("sc_images", "semantic", scene["after"], SAME_CAMERA),
                                                ("nsc_images", "nonsemantic", scene["before"], distractor_camera)):
            render(objects, camera).save(tmp / folder / f"CLEVR_{prefix}_{name}", compress_level=1)
        files["change_captions"][f"CLEVR_default_{name}"] = captions
        files["no_change_captions"][f"CLEVR_default_{name}"] = no_change
        files["type_mapping"][scene["change_type"]].append(name)
        files["scenes"][name] = scene
    n_eval = min(200, n_pairs // 10)
    ends = (0, n_pairs - 2 * n_eval, n_pairs - n_eval, n_pairs)
    files["splits"] = {split: list(range(a, b)) for split, a, b in zip(("train", "val", "test"), ends, ends[1:])}
    for name, content in files.items():
        (tmp / f"{name}.json").write_text(json.dumps(content))
    tmp.rename(out)


def ensure_synth(root, pairs=2400, seed=0):
    """Generate the synthetic dataset at `root` unless it exists (2,400 pairs: train 2,000, val 200, test 200)."""
    if not Path(root).exists():
        log.warning("generating %d synthetic CLEVR-Change pairs in %s", pairs, root)
        write_synth(root, pairs, seed)
    return Path(root)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the synthetic CLEVR-Change.")
    parser.add_argument("command", choices=("synth",))
    parser.add_argument("--out", required=True, help="the folder to create")
    parser.add_argument("--pairs", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    write_synth(args.out, args.pairs, args.seed)
    print(f"wrote {args.pairs} pairs to {args.out} in {time.perf_counter() - start:.0f} s")
