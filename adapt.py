"""Stage 1 of CLIP4IDC: adapt CLIP to image pairs with IP-T and T-IP retrieval (section 2.3).

    python adapt.py --data synth                        # offline default: synthetic data, small model
    python adapt.py --data clevr --data_root PATH       # the paper: ViT-B/32 from OpenAI's weights, 9+3 layers
    python adapt.py --data clevr --data_root PATH --recipe authors   # as the authors' code trains (README)

Any field of AdaptConfig is a flag (--epochs 3, --n_intra 8 --n_inter 4, --compile, --amp bf16);
several GPUs through torchrun (see train.py). The training loop is train.fit, shared with caption.py.
"""
import math
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import cli
import clip_weights
import data
import evaluate
import tokenizer
import train
from cli import InputError
from model import SMALL_CLIP, CLIP4IDC, CLIP4IDCConfig, CLIPConfig
from train import arg


@dataclass
class AdaptConfig(train.RunConfig):
    """Appendix B and the authors' code. `--data synth`, the offline default (docs/offline-default.md says why),
    adapts the small CLIP that pretrain.py made of synthetic scenes; the parameters it lacks learn at four times its
    rate, which suits random weights of its shape (--init random) as well."""
    stage = "adapt"
    data: Literal["synth", "clevr", "spot", "ier", "birds", "clevr_dc"] = arg(
        "synth", "synth: the offline CLEVR-Change look-alike")
    recipe: Literal["paper", "authors"] = arg("paper", "paper: the paper and our choices; authors: as their code trains")
    preset: Literal["vit-b/32", "small"] = arg(
        "vit-b/32", "with --init random, CLIP's shape: the paper's, or small enough for a CPU", synth="small")
    init: Literal["openai", "random"] = arg("openai", "start from OpenAI's weights or from scratch")
    clip: str = arg("ViT-B/32", "with --init openai: OpenAI's model name or a checkpoint path",
                    synth="assets/clip_synth.pt", free=True)
    n_intra: int = arg(9, "layers that see one image (Table 7)", synth=2, low=0)
    n_inter: int = arg(3, "layers that see the pair; n_intra + n_inter = CLIP's vision layers", synth=2, low=0)
    # Their script adapts 20 epochs on Spot-the-Diff (12 on CLEVR-Change, as the paper says); they have none for
    # Birds-to-Words, which takes Spot-the-Diff's (README), and CLEVR-DC, which takes CLEVR-Change's.
    epochs: int = arg(12, synth=5, authors={"spot": 20, "birds": 20})
    batch_size: int = arg(128, synth=48)
    lr: float = arg(1e-4, "the new parameters (e1, e2, pair position embedding, LayerNorm)", synth=4e-3)
    lr_clip: float = arg(1e-7, "CLIP's weights", synth=1e-3, low=0)
    weight_decay: float = arg(0.2, synth=0.05)
    cache: bool = arg(False, "decode and resize every image once, into a uint8 file beside the data", synth=True, free=True)
    hard_negatives: int = arg(0, "rewritten false captions per sample as IP-T's extra columns (IDC-PCL's FDA; 0: the "
                              "paper's)", low=0, high=64)
    rewrites: str = arg("retrieve,replace,confuse", "with --hard_negatives: the kinds of rewrite, shared out evenly")

    def check(self):
        if not set(self.rewrites.split(",")) <= set(KINDS):
            raise InputError(f"--rewrites {self.rewrites}: expected some of {','.join(KINDS)}, comma-separated")
        if "preset" in self.given and self.init == "openai":
            raise InputError(f"--preset {self.preset}: the shape of a CLIP from random weights (--init random); with "
                             "--init openai, the --clip file gives it")
        if "clip" in self.given and self.init == "random":
            raise InputError(f"--clip {self.clip}: read only with --init openai, and this run starts from random weights")


# The CLIP parameters that the authors' scripts freeze in both stages (their --freeze_layer_num 0):
# the image tower's patch, class and position embeddings and ln_pre, the text tower's embeddings.
AUTHORS_FROZEN = ("visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding", "visual.ln_pre.weight",
                  "visual.ln_pre.bias", "positional_embedding", "token_embedding.weight")


def freeze_as_authors(clip, keep=()):
    """--recipe authors: CLIP's embeddings and ln_pre stay as loaded (AUTHORS_FROZEN, but `keep`)."""
    for name, p in clip.named_parameters():
        if name in AUTHORS_FROZEN and name not in keep:
            p.requires_grad_(False)


# ---- Hard negatives: IDC-PCL's Fine-grained Difference Aligning, beyond CLIP4IDC (the README's method table)
# Replace's word classes, each a tuple of values and each value a tuple of synonyms: a word is swapped for another
# value of its class, never for a synonym (cube / block). Only the values the training captions use are drawn.
WORD_CLASSES = ((("gray", "grey"), ("red",), ("blue",), ("green",), ("brown",), ("purple",), ("cyan",), ("yellow",),
                 ("black",), ("white",), ("orange",), ("pink",)),
                (("rubber", "matte"), ("metal", "metallic", "shiny")), (("cube", "block"), ("sphere", "ball"), ("cylinder",)),
                (("small", "tiny", "little"), ("large", "big")), (("added",), ("removed",), ("moved",)),
                (("appeared",), ("disappeared",)), (("left",), ("right",)), (("top",), ("bottom",)), (("above",), ("below",)),
                (("one",), ("two",), ("three",), ("four",), ("five",)))
KINDS = ("retrieve", "replace", "confuse")


class HardNegatives:
    """Each (pair, caption) sample's `n` captions that are false in one detail, shared out evenly over `kinds`
    (IDC-PCL's 2:2:2 for n = 6), as BPE ids [n, context_length]. They are IP-T's extra columns (Eq. 6, see
    model.contrastive_loss). A rewrite equal to one of the pair's own captions is drawn again.

    retrieve: the training captions most similar to this one by TF-IDF, but the pair's own;
    replace: one word of a class in WORD_CLASSES becomes another value of its class; a caption with none swaps
      one of its words seen in at least 10 training captions (the 30 most frequent aside) for another such word;
    confuse: two words of one class that name different values trade places ("the red cube turned blue" ->
      "the blue cube turned red"); a caption with no such pair has its words shuffled."""

    def __init__(self, pairs, n, kinds, context_length):
        self.plan = [kinds[i * len(kinds) // n] for i in range(n)]
        self.context_length, tok = context_length, tokenizer.get_tokenizer()
        self.words = {c: tuple(tokenizer.TOKEN_PATTERN.findall(tokenizer.clean(c))) for p in pairs for c in p.captions}
        self.unique = list(dict.fromkeys(self.words.values()))
        frequency = Counter(w for words in self.unique for w in set(words))  # in how many captions a word stands
        self.ids = {w: tok.encode(w) for w in frequency}
        classes = [[kept for v in values if (kept := tuple(w for w in v if w in frequency))] for values in WORD_CLASSES]
        classes = [c for c in classes if len(c) > 1]
        self.value_of = {w: (c, v) for c in classes for v in c for w in v}
        self.fallback = dict.fromkeys(w for w, k in frequency.most_common()[30:]
                                      if k >= 10 and w.isalpha() and w not in self.value_of)  # an ordered set
        self.similar = self.most_similar(self.unique, frequency, k=n + max(len(p.captions) for p in pairs))
        self.row = {words: i for i, words in enumerate(self.unique)}

    @staticmethod
    def most_similar(unique, frequency, k):
        """For each caption (a tuple of words), the rows of the k most similar by TF-IDF cosine, itself among them."""
        column = {w: i for i, w in enumerate(frequency)}
        tf = torch.zeros(len(unique), len(column))
        for row, words in enumerate(unique):
            for w in words:
                tf[row, column[w]] += 1
        x = F.normalize(tf * torch.tensor([math.log(len(unique) / f) for f in frequency.values()]), dim=1)
        return torch.cat([(part @ x.t()).topk(min(k, len(unique)), dim=1).indices for part in x.split(4096)]).tolist()

    def replace(self, words, rng):
        spots = [i for i, w in enumerate(words) if w in self.value_of] or [i for i, w in enumerate(words) if w in self.fallback]
        if not spots:
            return None
        i = rng.choice(spots)
        if words[i] in self.value_of:
            values, value = self.value_of[words[i]]
            others = [w for v in values if v != value for w in v]
        else:
            others = [w for w in self.fallback if w != words[i]]
        return words[:i] + (rng.choice(others),) + words[i + 1:] if others else None

    def confuse(self, words, rng):
        swaps = [(i, j) for i, a in enumerate(words) for j, b in enumerate(words[:i])
                 if a in self.value_of and b in self.value_of and self.value_of[a][0] is self.value_of[b][0]
                 and self.value_of[a][1] != self.value_of[b][1]]
        if not swaps:
            return tuple(rng.sample(words, len(words)))
        i, j = rng.choice(swaps)
        out = list(words)
        out[i], out[j] = words[j], words[i]
        return tuple(out)

    def canonical(self, words):
        """The words with each synonym as the first of its value: "a tiny block" is "a small cube"."""
        return tuple(self.value_of[w][1][0] if w in self.value_of else w for w in words)

    def __call__(self, pair, caption, rng):
        taken, words = {self.canonical(self.words[c]) for c in pair.captions}, self.words[caption]
        retrieved = (self.unique[j] for j in self.similar[self.row[words]])
        draws = {"retrieve": lambda: next(retrieved, None), "replace": lambda: self.replace(words, rng),
                 "confuse": lambda: self.confuse(words, rng)}
        out = []
        for kind in self.plan:  # a kind that cannot make a new false caption of this one leaves it to the others
            tries = (draw() for k in (kind, *KINDS)
                     for draw in [draws[k]] * (len(self.similar[0]) if k == "retrieve" else 10))
            found = next((t for t in tries if t is not None and self.canonical(t) not in taken), None)
            if found is None:
                raise InputError(f"--hard_negatives: no false rewrite of the caption '{caption}' of pair {pair.id}")
            taken.add(self.canonical(found))
            out.append(found)
        return tokenizer.to_tensor([[i for w in words for i in self.ids[w]] for words in out], self.context_length)


def build_model(cfg):
    clip = None
    if cfg.init == "openai":
        with train.in_turns():  # under torchrun one process a machine downloads it; the others find it cached
            clip = clip_weights.load(cfg.clip)
    clip_config = clip.config if clip is not None else SMALL_CLIP if cfg.preset == "small" else CLIPConfig()
    if clip_config.context_length < CLIP4IDCConfig.context_length:  # a --clip file's
        raise InputError(f"--clip {cfg.clip}: {clip_config.context_length} text positions; expected at least "
                         f"{CLIP4IDCConfig.context_length}, the length of a caption in tokens")
    if cfg.n_intra + cfg.n_inter != clip_config.vision_layers:
        name = cfg.clip if clip is not None else cfg.preset
        raise InputError(f"--n_intra {cfg.n_intra} + --n_inter {cfg.n_inter} must equal the "
                         f"{clip_config.vision_layers} vision layers of the '{name}' model")
    model = CLIP4IDC(CLIP4IDCConfig(clip=clip_config, n_intra=cfg.n_intra, average_directions=cfg.recipe == "authors"), clip)
    if cfg.recipe == "authors":
        freeze_as_authors(model.clip)
    return model


def rsum(metrics):
    """Model selection score: R@1 + R@5 + R@10 in both directions."""
    return sum(metrics[d][k] for d in ("pair_to_text", "text_to_pair") for k in ("R@1", "R@5", "R@10"))


def main(argv=None):
    cfg, device = train.start_run(AdaptConfig, argv, __doc__)
    model = build_model(cfg).to(device)
    print(f"pair encoder: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{model.config.n_intra} intra + {model.config.n_inter} inter layers")
    splits, store = train.prepare_data(cfg, model.config.clip.image_size,
                                       lambda pairs: sum(len(p.captions) for p in pairs))  # a sample per caption
    negatives = HardNegatives(splits["train"], cfg.hard_negatives, cfg.rewrites.split(","),
                              model.config.context_length) if cfg.hard_negatives else None
    train_set = data.AdaptDataset(splits["train"], model.config.clip.image_size, model.config.context_length,
                                  cfg.seed, store, negatives)

    def retrieval(split):
        return evaluate.retrieval(model, splits[split], device, store, cfg.amp, cfg.workers)

    def validate():
        metrics = retrieval("val")
        return rsum(metrics), metrics

    def clamp_temperature():
        # tau >= 1/100, as in CLIP. OpenAI's ViT-B/32 starts at that bound, and AdamW moves log(1/tau) by
        # about lr_clip a step at most: under the paper's 1e-7, tau stays near 0.01. From scratch it learns.
        with torch.no_grad():
            model.clip.logit_scale.clamp_(max=math.log(100))

    step0 = retrieval("test") if not cfg.resume and cli.rank() == 0 else None
    state = train.fit(cfg, model, train_set, validate, model.new_parameter_names(), "cosine", before=step0,
                      after_step=clamp_temperature,
                      log_extra=lambda: {"temp": f"{(-model.clip.logit_scale).exp().item():.4f}"})
    if cli.rank() != 0:
        return
    results = {"val": retrieval("val"), "test": retrieval("test"), "test_step0": state["before"]}
    print(evaluate.format_retrieval(results["test"]))
    print(f"text -> pair R@1 on test: {results['test']['text_to_pair']['R@1']:.1f} after adaptation, "
          f"{results['test_step0']['text_to_pair']['R@1']:.1f} with zero adaptation steps, "
          f"chance {100 / len(splits['test']):.1f}")
    evaluate.save_results(cfg.out_dir, results)


if __name__ == "__main__":
    cli.main(main)
