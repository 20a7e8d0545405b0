"""Data for CLIP4IDC: readers for the three benchmarks, Birds-to-Words and CLEVR-DC in their published layouts and
for lists of one's own pairs, CLIP4IDC's preprocessing, and the datasets of both stages, their order and their loaders
(captions are tokenized by tokenizer.py; with --cache, images are read from image_store.py's file instead)."""
import contextlib
import json
import logging
import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cli import InputError, ctrl_c_kept_here, read_text
from tokenizer import tokenize


# ---- The datasets in the layouts their authors publish, and lists of one's own pairs -------------
log = logging.getLogger("data")
UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)  # truncated, unknown, too large
CHANGE_TYPES = ("color", "texture", "move", "add", "drop", "distractor")  # Table 2's column order
PAPER_TYPE_NAME = {"material": "texture"}  # CLEVR-Change calls the texture change "material"
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
    "birds": ("Birds-to-Words", "birds-to-words-v1.0.tsv (a header row, then a row per description with its pair's "
              "img1ImgURL, img2ImgURL, split and description), images/<photo id>.jpg (the number in each image URL)",
              "https://github.com/google-research-datasets/birds-to-words"),
    "clevr_dc": ("CLEVR-DC", "split.json, captions.json of {\"<id>\": captions}, bef/<id>.png, aft/<id>.png",
                 "https://github.com/hsgkim/clevr-dc"),
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
    scene: dict | None = None  # the synthetic data's scene graphs of the pair (its scenes.json), which grade captions


def missing(dataset, path, what="not found"):
    name, layout, url = SOURCES[dataset]
    return FileNotFoundError(f"{path}: {what}; expected {name}'s layout ({layout}), published at {url}")


def not_a_file(path):  # nothing is there, or something else is (a folder, a pipe)
    return "not a file" if path.exists() else "not found"


def read_json(dataset, *candidates, keys=()):
    """(JSON, path) of the first existing candidate file: with `keys`, a list of objects having them, else an object."""
    path = next((p for p in candidates if p.is_file()), candidates[0])
    if not path.is_file():
        raise missing(dataset, path)
    try:
        content = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: malformed JSON at line {e.lineno} column {e.colno} (char {e.pos}): {e.msg}") from None
    except UnicodeDecodeError as e:  # another encoding (UTF-16, Latin-1) or damaged bytes
        raise InputError(f"{path}: byte {e.start} is not UTF-8 ({e.reason}); expected JSON in UTF-8") from None
    except (ValueError, RecursionError) as e:  # an integer of over 4,300 digits; arrays nested thousands deep
        raise InputError(f"{path}: JSON that Python does not read ({e})") from None
    expected = f"a list of objects with keys {', '.join(keys)}" if keys else "a JSON object"
    if not isinstance(content, list if keys else dict):
        raise InputError(f"{path}: top level is a {type(content).__name__}; expected {expected}")
    for n, entry in enumerate(content if keys else []):
        if not (isinstance(entry, dict) and all(k in entry for k in keys)):
            raise InputError(f"{path}: entry {n} is not an object with keys {', '.join(keys)}")
    return content, path


def file_id(value, path, where):
    """An id as the string that names its files and json keys: a string or an integer (not JSON's true)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{path}: {where} {json.dumps(value):.80}; expected a string or an integer")
    return str(value)


def caption_list(value, path, where):
    """`value` if it is a non-empty list of caption strings: a bare string would become one caption a letter.
    A lone surrogate ("\\ud800" is valid JSON) is refused here, not when the tokenizer meets it while scoring."""
    if not (value and isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise InputError(f"{path}: {where}: expected a non-empty list of caption strings, got {json.dumps(value):.80}")
    if lone := re.search(r"[\ud800-\udfff]", "".join(value)):
        raise InputError(f"{path}: {where}: a caption holds the lone surrogate {json.dumps(lone[0])}; "
                         "expected text that UTF-8 can encode")
    return value


def split_ids(dataset, path, split):
    splits, path = read_json(dataset, path)
    if split not in splits:
        raise InputError(f"{path}: no split {split!r} (it has {', '.join(splits)})")
    if not (isinstance(splits[split], list) and all(type(i) is int for i in splits[split])):
        raise InputError(f"{path}: split {split!r}: expected a list of integer image ids")
    return splits[split]


def read_clevr(root, split):
    ids = split_ids("clevr", root / "splits.json", split)
    (change, change_path), (no_change, no_change_path), (types, types_path) = (
        read_json("clevr", root / f"{name}.json") for name in ("change_captions", "no_change_captions", "type_mapping"))
    for kind, names in types.items():
        if PAPER_TYPE_NAME.get(kind, kind) not in CHANGE_TYPES[:5]:
            raise InputError(f"{types_path}: change type {kind!r}; expected CLEVR-Change's color, material, add, "
                             "drop, move")
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise InputError(f"{types_path}: {kind!r}: expected a list of image names such as \"000001.png\", "
                             f"got {json.dumps(names):.80}")
    type_of = {name: kind for kind, names in types.items() for name in names}
    pairs, uncaptioned = [], []
    for i in ids:
        name, default = f"{i:06d}.png", f"CLEVR_default_{i:06d}.png"
        if not (change.get(default) and no_change.get(default)):
            uncaptioned.append(i)
            continue
        pairs.append(Pair(name, root / "images" / default, root / "sc_images" / f"CLEVR_semantic_{name}",
                          caption_list(change[default], change_path, default), type_of.get(name),
                          root / "nsc_images" / f"CLEVR_nonsemantic_{name}",
                          caption_list(no_change[default], no_change_path, default)))
    if uncaptioned:  # the published data has a few such ids; the reference loaders cannot use them either
        log.warning("%s %s: skipped %d of %d ids without change or no-change captions (first: %s)", root, split,
                    len(uncaptioned), len(ids), ", ".join(map(str, uncaptioned[:5])))
    return pairs


def read_spot(root, split):
    entries, path = read_json("spot", root / f"{split}.json", root / "annotations" / f"{split}.json",
                              keys=("img_id", "sentences"))
    images = root / "resized_images" if (root / "resized_images").is_dir() else root / "images"
    sentences = {}  # one img_id may be annotated in several entries: merge them into one pair
    for n, entry in enumerate(entries):
        img_id = file_id(entry["img_id"], path, f"entry {n}: img_id")
        sentences.setdefault(img_id, []).extend(caption_list(entry["sentences"], path, f"entry {n}"))
    return [Pair(f"{i}.png", images / f"{i}.png", images / f"{i}_2.png", sents) for i, sents in sentences.items()]


def read_ier(root, split):
    split = {"val": "valid"}.get(split, split)
    entries, path = read_json("ier", root / f"{split}.json", root / "dataset" / "adobe" / f"{split}.json",
                              keys=("img0", "img1", "sents", "uid"))
    for n, e in enumerate(entries):
        file_id(e["uid"], path, f"entry {n}: uid")
        if not all(isinstance(e[k], str) for k in ("img0", "img1")):
            raise InputError(f"{path}: entry {n} (uid {e['uid']!r}): img0 {json.dumps(e['img0']):.80}, img1 "
                             f"{json.dumps(e['img1']):.80}; expected image file names")
    return [Pair(str(e["uid"]), root / "images" / e["img0"], root / "images" / e["img1"],
                 caption_list(e["sents"], path, f"entry {n} (uid {e['uid']!r})")) for n, e in enumerate(entries)]


# Birds-to-Words' tsv (its README.md, "Data Format") holds no images: each is images/<photo id>.jpg, where its README's
# command puts them, the id the number in its URL (.../photos/647514/medium.jpg?...); a pair's id joins its two photos'
# ids, as IDC-PCL's code names its pairs (yaolinli/IDC, bird/data/dataset_finetune_bird.py).
BIRDS_COLUMNS = ("img1ImgURL", "img2ImgURL", "split", "description")
PHOTO_ID = re.compile(r"/photos/(\d+)/")


def read_birds(root, split):
    if not (path := root / "birds-to-words-v1.0.tsv").is_file():
        raise missing("birds", path)
    lines = read_text(path, "Birds-to-Words' tab-separated rows").splitlines()
    header = lines[0].split("\t") if lines else []
    if absent := [c for c in BIRDS_COLUMNS if c not in header]:
        raise InputError(f"{path}: no column {absent[0]} in its header row; expected {', '.join(BIRDS_COLUMNS)} among them")
    at, pairs = {c: header.index(c) for c in BIRDS_COLUMNS}, {}
    for n, row in ((n, line.split("\t")) for n, line in enumerate(lines[1:], 2) if line.strip()):
        if len(row) != len(header):
            raise InputError(f"{path}: line {n} has {len(row)} tab-separated fields; expected {len(header)}, as its header")
        if row[at["split"]] == split:
            photos = [PHOTO_ID.search(row[at[c]]) for c in BIRDS_COLUMNS[:2]]
            if None in photos:
                column = BIRDS_COLUMNS[photos.index(None)]
                raise InputError(f"{path}: line {n}: {column} {row[at[column]]!r}; expected an iNaturalist photo URL "
                                 "such as https://static.inaturalist.org/photos/647514/medium.jpg")
            pairs.setdefault(tuple(m[1] for m in photos), []).append(row[at["description"]])
    return [Pair(f"{a}_{b}", root / "images" / f"{a}.jpg", root / "images" / f"{b}.jpg", captions)
            for (a, b), captions in pairs.items()]


# CLEVR-DC's files are read as BLIP2IDC's reader opens them (gautierevn/BLIP2IDC, code_release/IDC_datasets.py). No
# file says which change a pair holds (a sixth of them none): its captions are worded as CLEVR-Change's templates word
# each type, and CHANGE_WORDS reads it off them.
CHANGE_WORDS = {"distractor": ("no change", "nothing", "same", "identical", "no difference"),
                "move": ("moved", "location", "position"), "add": ("added", "appeared", "new", "newly"),
                "drop": ("disappeared", "missing", "gone", "removed", "no longer")}
BECAME = "changed to|turned|became|is now|painted"  # then the new colour or material
COLORS = ("gray", "red", "blue", "green", "brown", "purple", "cyan", "yellow")
MATERIALS = ("rubber", "matte", "metal", "metallic", "shiny")


def read_clevr_dc(root, split):
    ids = split_ids("clevr_dc", root / "split.json", split)
    captions, path = read_json("clevr_dc", root / "captions.json")
    if uncaptioned := [i for i in ids if str(i) not in captions]:
        raise InputError(f"{path}: no captions for {len(uncaptioned)} of the {len(ids)} {split} ids in split.json "
                         f"(first: {', '.join(map(str, uncaptioned[:5]))})")
    return [Pair(str(i), root / "bef" / f"{i}.png", root / "aft" / f"{i}.png", caps, change_type(caps))
            for i in ids for caps in [caption_list(captions[str(i)], path, str(i))]]


def change_type(captions):
    """The change type (CHANGE_TYPES) that most of a pair's captions word, or None if none is worded as CLEVR-Change's."""
    def worded_as(caption):
        value = re.search(rf"\b({BECAME}) (\w+)", caption)
        became = value and ("color" if value[2] in COLORS else "texture" if value[2] in MATERIALS else None)
        return next((k for k, words in CHANGE_WORDS.items() if re.search(rf"\b({'|'.join(words)})\b", caption)), became)
    kinds = Counter(kind for c in captions if (kind := worded_as(c.lower())))
    return kinds.most_common(1)[0][0] if kinds else None


def worded(caption):
    return any(c.isalnum() for c in caption)


def read_split(dataset, root, split, images=True):
    """The pairs of one split; "synth", the CLEVR-Change look-alike that synth.py writes, shares its reader."""
    synthetic, dataset = dataset == "synth", "clevr" if dataset == "synth" else dataset
    if dataset not in SOURCES:
        raise InputError(f"unknown dataset {dataset!r}; expected one of {', '.join(SOURCES)}, synth")
    if not (root := Path(root)).is_dir():
        raise missing(dataset, root, "no such folder")
    pairs = {"clevr": read_clevr, "spot": read_spot, "ier": read_ier, "birds": read_birds,
             "clevr_dc": read_clevr_dc}[dataset](root, split)
    if synthetic and (root / "scenes.json").is_file():  # synth.py writes it; a copy without it is graded by no one
        scenes = read_json("clevr", root / "scenes.json")[0]
        for p in pairs:
            p.scene = scenes.get(p.id)
    if repeated := [i for i, n in Counter(p.id for p in pairs).items() if n > 1]:
        raise InputError(f"{root} {split}: ids {repeated[:5]} name more than one pair; each pair needs its own id")
    # Only training leaves out captions without a letter or digit, and the pairs they leave without any: the scored
    # splits stay as published, as the authors score them (Spot-the-Diff's test has 7 pairs whose one reference is "")
    blank = [p.id for p in pairs if not all(map(worded, p.captions + p.distractor_captions))]
    if split == "train" and blank:
        for p in pairs:
            p.captions = [c for c in p.captions if worded(c)]
            p.distractor_captions = [c for c in p.distractor_captions if worded(c)]
        kept = [p for p in pairs if p.captions and (p.distractor is None or p.distractor_captions)]
        log.warning("%s %s: %d pairs have empty or punctuation-only captions, left out (first: %s); %d pairs are left "
                    "without any caption and are left out", root, split, len(blank), ", ".join(map(str, blank[:5])),
                    len(pairs) - len(kept))
        pairs = kept
    if not pairs:  # an empty split would hang METEOR's java process or fail deep in the model
        raise InputError(f"{root} {split}: no pairs; each split needs at least one")
    if images and (lacking := [(p.id, q) for p in pairs for q in (p.before, p.after, p.distractor) if q and not q.is_file()]):
        ids, first = list(dict.fromkeys(i for i, _ in lacking)), lacking[0][1]
        raise missing(dataset, first, f"{not_a_file(first)}, and {len(ids)} of {len(pairs)} {split} pairs lack image "
                                      f"files (ids {', '.join(ids[:5])}{', ...' * (len(ids) > 5)})")
    return pairs


def eval_items(pairs):
    """Every change pair, and on CLEVR-Change each distractor as its own no-change pair "<id>_n"."""
    items = []
    for p in pairs:
        items.append(p)
        if p.distractor:
            items.append(Pair(p.id + "_n", p.before, p.distractor, p.distractor_captions, "distractor"))
    return items


def read_pair_list(path):
    """(before, after) image paths, a line each (evaluate.py --pairs), split at a tab if any: paths may hold spaces."""
    pairs = []
    for n, line in enumerate(read_text(path, "two image paths a line").splitlines(), 1):
        if line.strip():
            fields = line.strip().split("\t") if "\t" in line else line.split()
            if len(fields) != 2:
                raise InputError(f"{path}: line {n}: expected two image paths (before, after), found {len(fields)}")
            pairs.append(tuple(Path(path).parent / f for f in fields))  # relative paths: from the file's folder
    if not pairs:
        raise InputError(f"{path}: no pairs; expected two image paths (before, after) a line")
    if absent := [q for pair in pairs for q in pair if not q.is_file()]:
        raise InputError(f"{path}: {len(absent)} images missing, e.g. {absent[0]}: {not_a_file(absent[0])}")
    for image in dict.fromkeys(q for pair in pairs for q in pair):  # headers only: a file that is no image
        try:  # stops here, not after minutes of captioning
            Image.open(image).close()
        except UNREADABLE as e:
            raise InputError(f"{path}: {image}: cannot read image ({e})") from None
    return pairs


# ---- Preprocessing as CLIP4IDC does it, and the datasets of the two stages ----------------------
def read_pixels(path, size):
    """uint8 [3,size,size]: RGB (a gif's first frame), the whole image resized bicubic, no crop; the model normalises
    them (model.VisionTransformer.embed). read_array reads them in Pillow and numpy only: the image store's worker
    processes are forked, and torch's thread pool does not survive a fork."""
    return torch.from_numpy(read_array(path, size))


def read_array(path, size):
    try:
        with Image.open(path) as image:
            image = to_rgb(image).resize((size, size), Image.BICUBIC)
    except FileNotFoundError:
        raise
    except UNREADABLE as e:
        raise InputError(f"{path}: cannot read image ({e})") from None
    return np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1))


def to_rgb(image):
    """8-bit RGB by the image's real value range: Pillow's own conversion clips 16-bit images (0-65535)
    to white and float images (0-1) to black. Float images holding values above 1 are taken as 0-255."""
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        values = np.nan_to_num(np.asarray(image, dtype=np.float32))
        scale = 1 / 257 if image.mode != "F" else 255 if values.max() <= 1 else 1
        image = Image.fromarray((values * scale).clip(0, 255).round().astype(np.uint8))
    return image.convert("RGB")


class Loader(torch.utils.data.DataLoader):
    """A DataLoader whose processes leave Ctrl-C to this one (they start as it is iterated)."""

    def __iter__(self):
        with ctrl_c_kept_here() if self.num_workers else contextlib.nullcontext():
            return super().__iter__()


def sample_rng(seed, epoch, index):
    """Randomness fixed by (seed, epoch, index): samples do not depend on workers or order."""
    return random.Random(f"{seed}:{epoch}:{index}")  # str seeds are hashed with SHA-512, not hash()


class AdaptDataset(torch.utils.data.Dataset):
    """Stage 1: one sample per (pair, caption); key (epoch, index) -> before, after, caption_ids [L]. On CLEVR-Change
    the before image is the distractor with probability 0.5 and the caption stays, so the pair encoder learns to tell a
    scene change from a change of viewpoint or light. `store` (an image_store.ImageStore) reads images in place of
    their files; `negatives(pair, caption, rng)` adds the sample's hard negatives' ids [N, L] (adapt.HardNegatives)."""

    def __init__(self, pairs, image_size, context_length=32, seed=42, store=None, negatives=None):
        self.samples = [(pair, caption) for pair in pairs for caption in pair.captions]
        self.tokens = tokenize([caption for _, caption in self.samples], context_length)  # once, not per epoch
        self.size, self.seed, self.load, self.negatives = image_size, seed, store or read_pixels, negatives

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, key):
        (pair, caption), rng = self.samples[key[1]], sample_rng(self.seed, *key)
        before = pair.distractor if pair.distractor is not None and rng.random() < 0.5 else pair.before
        sample = self.load(before, self.size), self.load(pair.after, self.size), self.tokens[key[1]]
        return sample + (self.negatives(pair, caption, rng),) if self.negatives else sample


class CaptionDataset(torch.utils.data.Dataset):
    """Stage 2: one sample per pair; key (epoch, index) -> before [3,H,W], after [k,3,H,W], ids [k,L]. k = 2 where the
    pair has a distractor: the change pair and its no-change pair (see `eval_items`), sharing the before image, each
    with one of its captions, as CLIP4IDC trains; else k = 1."""

    def __init__(self, pairs, image_size, context_length=32, seed=42, store=None):
        self.items = [eval_items([pair]) for pair in pairs]
        captions = [c for items in self.items for item in items for c in item.captions]
        row = iter(range(len(captions)))  # rows[i][j]: the rows of self.tokens that hold item j of pair i's captions
        self.rows = [[[next(row) for _ in item.captions] for item in items] for items in self.items]
        self.tokens = tokenize(captions, context_length)  # once, not at every epoch
        self.size, self.seed, self.load = image_size, seed, store or read_pixels

    def __len__(self):
        return len(self.items)

    def __getitem__(self, key):
        items, rng = self.items[key[1]], sample_rng(self.seed, *key)
        after = torch.stack([self.load(item.after, self.size) for item in items])
        return self.load(items[0].before, self.size), after, self.tokens[[rng.choice(r) for r in self.rows[key[1]]]]


class EvalDataset(torch.utils.data.Dataset):
    """Pairs or evaluation items (see `eval_items`) -> (index, before, after): only their two images are read."""

    def __init__(self, items, image_size, store=None):
        self.items, self.size, self.load = items, image_size, store or read_pixels

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        item = self.items[index]
        return index, self.load(item.before, self.size), self.load(item.after, self.size)


# ---- The order of the data and its loaders ------------------------------------------------------
class EpochSampler(torch.utils.data.Sampler):
    """Yields (epoch, index) keys in an order fixed by (seed, epoch), so a resumed run sees the same
    batches; the datasets derive their own random choices from the same key. The order is cut into
    global batches of `batch` samples, of which process `rank` reads the rank-th slice."""

    def __init__(self, n, seed, batch, rank=0, world=1):
        self.n, self.seed, self.batch, self.rank, self.world = n, seed, batch, rank, world
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch, skip=0):
        self.epoch, self.skip = epoch, skip  # skip: samples of this epoch already trained on

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        order = order[self.skip:][:len(self) * self.world]
        return iter([(self.epoch, int(i)) for i in order.view(-1, self.world, self.batch // self.world)[:, self.rank].flatten()])

    def __len__(self):
        return (self.n - self.skip) // self.batch * (self.batch // self.world)


def cores():
    """The cores this process may run on: its CPU affinity (taskset, Slurm, a container's --cpuset-cpus), not the
    machine's count; a CPU quota (a container's --cpus) is not seen."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


MAX_WORKERS = 256  # more than any machine's loading needs; a typo's thousands of processes would stall it


def loader_workers(workers, device):
    """Loader processes for --workers; for -1, none for CPU training on two cores or fewer, whose threads keep both
    busy: a loader process only takes turns with them (300 steps in 70-73 s, not 79-80: docs/offline-default.md)."""
    if workers >= 0:
        return workers
    share = cores() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return 0 if device.type == "cpu" and share <= 2 else max(1, min(8, share - 1))


def make_loader(dataset, batch_size, device, workers=-1, sampler=None, seed=0):
    """Workers never touch the global RNG (own generator), so loading cannot change the training's random stream and a
    resumed run stays bit-exact. A training loader (one with a sampler) keeps its processes from epoch to epoch; an
    evaluation's end as its one pass does, not later in a __del__, where a Ctrl-C would be ignored."""
    workers, training = loader_workers(workers, device), sampler is not None
    return Loader(dataset, batch_size=batch_size, sampler=sampler, drop_last=training, num_workers=workers,
                  pin_memory=device.type == "cuda", persistent_workers=workers > 0 and training,
                  generator=torch.Generator().manual_seed(seed))
