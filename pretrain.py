"""Pretrain a small CLIP on synthetic scenes, as OpenAI pretrained theirs on web images (Radford et al. 2021):
the offline default's stand-in for OpenAI's ViT-B/32, so that stage 1 adapts a CLIP that already knows what
objects look like, as the paper's does. Each single scene (never a pair, a change or a change caption) comes
with a description of one of its objects, written from its scene graph; CLIP's symmetric cross-entropy with a
learnable temperature ranks it against the other scenes' descriptions, and also against the same description
with one attribute swapped so that it fits no object of the scene (hard negative texts, as NegCLIP).

    python pretrain.py                            # 50 min of training on 2 CPU cores: out/pretrain/clip.pt
    python pretrain.py --scenes 2000 --epochs 2   # a quick try

clip.pt holds the CLIP of the best epoch by zero-shot accuracy, in OpenAI's layout (fp16), which
`adapt.py --init openai --clip FILE` and `caption.py --init_from openai --clip FILE` read; assets/ ships one.
"""
import functools
import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import cli
import clip_weights
import data
import image_store
import synth
import train
from cli import InputError
from model import CLIP, SMALL_CLIP
from train import arg
from tokenizer import get_tokenizer, to_tensor


@dataclass
class PretrainConfig(train.RunConfig):
    stage = "pretrain"
    data_root: str = arg("data/scenes", "where the scenes are drawn on first use, and their image store")
    out_dir: str = arg("out/pretrain", "run folder: checkpoints, metrics.json and clip.pt")
    scenes: int = arg(50000, "training scenes; 500 more are held out for the zero-shot test", low=1)
    negatives: int = arg(3, "texts per image with one attribute swapped (0: CLIP's loss alone)", low=0, high=5)
    relations: float = arg(0.3, "share of descriptions that place the object by another one, not on the floor", low=0,
                           high=1)
    width: int = arg(64, "of both towers and the embedding: a multiple of 64, OpenAI's head width, which its files "
                     "imply", low=64)
    vision_layers: int = arg(4, "layers of the image tower", low=1)
    text_layers: int = arg(2, "layers of the text tower", low=1)
    epochs: int = arg(40, "passes over the training scenes, each with new descriptions")
    batch_size: int = arg(128, "images (and their true descriptions) a step, over all processes")
    lr: float = arg(1e-3, "of every parameter")
    weight_decay: float = arg(0.1)
    warmup: float = arg(0.02)
    seed: int = arg(0, "model initialisation, data order, descriptions")
    log_every: int = arg(50)
    save_every: int = arg(1000)

    def check(self):
        if self.width % 64:
            raise InputError(f"--width {self.width}: expected a multiple of 64, OpenAI's head width, which its files imply")


HELD_OUT = 500  # scenes after the training ones, for the zero-shot test
ATTRIBUTES = ("shape", "color", "material", "size", "position")
VALUES = {"shape": synth.SHAPES, "color": tuple(synth.COLORS), "material": synth.MATERIALS, "size": tuple(synth.SIZES),
          "position": tuple((column, row) for column in range(3) for row in range(2))}
COLUMNS, ROWS = ("on the left", "in the middle", "on the right"), ("at the back", "in front")


# ---- Descriptions from a scene graph ------------------------------------------------------------
def attributes(obj):
    """What a description says of an object; its position is the floor cell it stands on (thirds of the
    floor's width, halves of its depth)."""
    column = min(2, max(0, int((obj["x"] - 60) // 120)))  # objects stand at x in [60, 420]
    row = int(obj["y"] >= (synth.Y_FAR + synth.Y_NEAR) / 2)
    return {"shape": obj["shape"], "color": obj["color"], "material": obj["material"], "size": obj["size"],
            "position": (column, row)}


def words(a, pick):
    """The noun phrase of attributes `a`; pick[k] in [0, 1) picks the synonym of slot k (WORDS of synth.py), the
    first where it is missing."""
    def word(slot):
        options = synth.WORDS.get(a[slot], (a[slot],))
        return options[int(pick.get(slot, 0) * len(options))]
    return " ".join(word(slot) for slot in ("size", "color", "material", "shape"))


def relation(obj, other):
    """Where `obj` stands from `other`, along the axis that parts them most (as synth.describe says it)."""
    dx, dy = obj["x"] - other["x"], obj["y"] - other["y"]
    return ("left of" if dx < 0 else "right of") if abs(dx) > abs(dy) else ("in front of" if dy > 0 else "behind")


OPPOSITE = {"left of": "right of", "right of": "left of", "in front of": "behind", "behind": "in front of"}


def describe(a, pick, where=None):
    """"a small red metal cube on the left at the back", or with `where` = (relation, other's attributes)
    "a small red metal cube that is left of the big blue rubber sphere"."""
    if where is None:
        column, row = a["position"]
        return f"a {words(a, pick)} {COLUMNS[column]} {ROWS[row]}"
    return f"a {words(a, pick)} that is {where[0]} the {words(where[1], pick)}"


def fits_none(a, scene, said=ATTRIBUTES):
    """Whether attributes `a` describe no object of the scene by what a description says of it (`said`): a
    swapped description must be false."""
    return all(any(a[k] != attributes(o)[k] for k in said) for o in scene)


def swapped(a, attribute, scene, rng, said=ATTRIBUTES):
    """`a` with `attribute` changed to a value that makes it fit no object of the scene, or None if none does."""
    values = [v for v in VALUES[attribute] if v != a[attribute] and fits_none({**a, attribute: v}, scene, said)]
    return {**a, attribute: rng.choice(values)} if values else None


def texts(scene, rng, negatives, relations):
    """A description of a random object of the scene, then `negatives` descriptions of it with one attribute
    swapped each (different attributes), all with the same synonyms: only the swapped word tells them apart."""
    obj = rng.choice(scene)
    a, pick = attributes(obj), {slot: rng.random() for slot in ("size", "color", "material", "shape")}
    others = [o for o in scene if o is not obj]
    if others and rng.random() < relations:
        other = rng.choice(others)
        where = (relation(obj, other), attributes(other))
    else:
        where = None
    out = [describe(a, pick, where)]
    for attribute in rng.sample(ATTRIBUTES, len(ATTRIBUTES)):
        if len(out) > negatives:
            break
        if where is not None and attribute == "position":  # placed by another object: the other way round
            out.append(describe(a, pick, (OPPOSITE[where[0]], where[1])))
        elif (b := swapped(a, attribute, scene, rng, ATTRIBUTES[:4] if where else ATTRIBUTES)) is not None:
            out.append(describe(b, pick, where))
    return out + [out[-1]] * (negatives + 1 - len(out))  # never short in practice: colours alone give seven


@functools.lru_cache(maxsize=None)
def word_ids(word):
    return get_tokenizer().encode(word)


def tokens_of(sentences, context_length):
    """tokenizer.tokenize of descriptions, whose words the tokenizer reads one by one: 50 times faster, by word."""
    return to_tensor([[i for word in sentence.split() for i in word_ids(word)] for sentence in sentences], context_length)


# ---- Data, model and loss -----------------------------------------------------------------------
class SceneTexts(torch.utils.data.Dataset):
    """key (epoch, index) -> image uint8 [3, S, S], tokens [1 + negatives, L]: the true description first."""

    def __init__(self, scenes, store, size, negatives, relations, context_length, seed):
        self.scenes, self.store, self.size = scenes, store, size
        self.negatives, self.relations, self.context_length, self.seed = negatives, relations, context_length, seed

    def __len__(self):
        return len(self.scenes)

    def __getitem__(self, key):
        path, graph = self.scenes[key[1]]
        rng = data.sample_rng(self.seed, *key)
        tokens = tokens_of(texts(graph["objects"], rng, self.negatives, self.relations), self.context_length)
        return tokens, self.store(path, self.size)


class Pretraining(nn.Module):
    """CLIP and its pretraining loss: model(tokens, images) is the loss of a batch."""

    def __init__(self, clip: CLIP):
        super().__init__()
        self.clip, self.config = clip, clip.config

    def forward(self, tokens, images):
        v = self.clip.encode_image(images)
        g = self.clip.encode_text(tokens.flatten(0, 1)).unflatten(0, tokens.shape[:2])
        return clip_loss(v, g, self.clip.logit_scale)


def clip_loss(v, g, logit_scale):
    """CLIP's symmetric cross-entropy over the global batch of images v [B, D] and their texts g[:, 0], where an
    image also ranks its true text above its own swapped ones g[:, 1:] (NegCLIP); the mean of both directions."""
    with torch.autocast(v.device.type, enabled=False):
        v, g = F.normalize(v.float(), dim=-1), F.normalize(g.float(), dim=-1)
        scale = logit_scale.exp()
        logits = scale * cli.gather_batch(v) @ cli.gather_batch(g[:, 0]).t()  # [B, B], all processes' images and texts
        own = torch.arange(len(v), device=v.device) + len(v) * cli.rank()  # this process's rows
        hard = scale * (v[:, None] * g[:, 1:]).sum(-1)  # [B, negatives]: each image with its own swapped texts
        image_to_text = F.cross_entropy(torch.cat([logits[own], hard], dim=1), own)
        text_to_image = F.cross_entropy(logits.t()[own], own)
    return (image_to_text + text_to_image) / 2


# ---- Zero-shot: a true description against the same with one attribute swapped -----------------
@torch.no_grad()
def zero_shot(clip, scenes, store, device, context_length=32):
    """For each held-out scene, a random object's description (the first synonyms, its floor cell) against the
    same with one attribute swapped (a value that fits no object of the scene): the share, in percent, where the
    true one scores higher, per attribute (chance 50)."""
    clip.eval()
    images, true, false = [], [], {attribute: [] for attribute in ATTRIBUTES}
    for i, (path, graph) in enumerate(scenes):
        rng, objects = random.Random(f"zero-shot:{i}"), graph["objects"]
        a = attributes(rng.choice(objects))
        images.append(store(path, clip.config.image_size))
        true.append(describe(a, {}))
        for attribute in ATTRIBUTES:
            b = swapped(a, attribute, objects, rng)
            false[attribute].append(describe(b, {}) if b else None)
    v = torch.cat([F.normalize(clip.encode_image(x.to(device)), dim=-1) for x in torch.stack(images).split(100)])

    def similarity(sentences, rows):
        g = F.normalize(clip.encode_text(tokens_of(sentences, context_length).to(device)), dim=-1)
        return (v[rows] * g).sum(-1).cpu()
    result = {}
    for attribute, sentences in false.items():
        rows = [i for i, s in enumerate(sentences) if s]
        right, wrong = similarity([true[i] for i in rows], rows), similarity([sentences[i] for i in rows], rows)
        result[attribute] = 100.0 * float((right > wrong).float().mean())
    result["mean"] = sum(result.values()) / len(ATTRIBUTES)
    return result


# ---- The run ------------------------------------------------------------------------------------
def prepare_scenes(cfg, size):
    """(training scenes, held-out scenes) as (image path, scene graph), drawn where missing, and their image store."""
    root = Path(cfg.data_root)
    with train.in_turns() as turn:
        if turn < 2 and not root.exists():
            synth.write_scenes(root, cfg.scenes + HELD_OUT, seed=0)
        if not (path := root / "scenes.json").is_file():
            raise InputError(f"--data_root {root}: no scenes.json; expected the scenes pretrain.py draws there")
        graphs = json.loads(path.read_text())
        if len(graphs) != cfg.scenes + HELD_OUT:
            raise InputError(f"{path}: {len(graphs)} scenes, not the {cfg.scenes} + {HELD_OUT} of --scenes "
                             f"{cfg.scenes}: delete {root} to draw them, or give another --data_root")
        scenes = [(root / f"scene_{i:06d}.png", g) for i, g in enumerate(graphs)]
        store = image_store.ImageStore([data.Pair(str(p), p, p, []) for p, _ in scenes], size, root)
    return scenes[:cfg.scenes], scenes[cfg.scenes:], store


def small_clip(cfg):
    """The small CLIP of the offline default, in the width and depth the flags give."""
    w = cfg.width
    return replace(SMALL_CLIP, embed_dim=w, vision_width=w, text_width=w, vision_heads=w // 64, text_heads=w // 64,
                   vision_layers=cfg.vision_layers, text_layers=cfg.text_layers)


def main(argv=None):
    cfg, device = train.start_run(PretrainConfig, argv, __doc__)
    clip = CLIP(small_clip(cfg))
    model = Pretraining(clip).to(device)
    print(f"CLIP: {sum(p.numel() for p in clip.parameters()) / 1e6:.2f}M parameters ({clip.config})")
    training, held_out, store = prepare_scenes(cfg, clip.config.image_size)
    train_set = SceneTexts(training, store, clip.config.image_size, cfg.negatives, cfg.relations,
                           clip.config.context_length, cfg.seed)

    def validate():
        result = zero_shot(clip, held_out, store, device, clip.config.context_length)
        print("zero-shot, true description over the swapped one: " + ", ".join(f"{k} {v:.1f}%" for k, v in result.items()))
        return result["mean"], result

    def clamp_temperature():  # tau >= 1/100, as CLIP
        with torch.no_grad():
            clip.logit_scale.clamp_(max=math.log(100))

    state = train.fit(cfg, model, train_set, validate, {name for name, _ in model.named_parameters()}, "cosine",
                      after_step=clamp_temperature,
                      log_extra=lambda: {"temp": f"{(-clip.logit_scale).exp().item():.4f}"})
    if cli.rank() != 0:
        return
    export = Path(cfg.out_dir) / "clip.pt"
    clip_weights.save_atomic({k: v.half() for k, v in clip.state_dict().items()}, export)
    shipped = clip_weights.load(export, device)  # what is scored is what the file holds
    results = {"zero_shot": zero_shot(shipped, held_out, store, device, clip.config.context_length),
               "best_epoch": state["best_epoch"]}
    cli.write_file(Path(cfg.out_dir) / "metrics.json", json.dumps(results, indent=2))
    print("zero-shot of the best epoch: " + ", ".join(f"{k} {v:.1f}%" for k, v in results["zero_shot"].items()))
    print(f"wrote {export} (OpenAI's layout, fp16), SHA-256 {clip_weights.sha256(export)}")


if __name__ == "__main__":
    cli.main(main)
