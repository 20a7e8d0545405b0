"""Stage 2 of CLIP4IDC: learn to describe what changed in an image pair (section 2.4).

    python caption.py                                    # offline default, after `python adapt.py --data synth`
    python caption.py --data clevr --data_root PATH      # the paper: from stage 1's best checkpoint
    python caption.py --data clevr --init_from openai    # no adaptation stage (Table 5, without L)
    python caption.py --data clevr --recipe authors      # as the authors' code trains (README)

The pair encoder comes from stage 1 (--init_from, default out/adapt-<data>/best.pt); a Transformer
encoder-decoder learns the captions with word-level cross-entropy. With --init_from openai the new
pair parameters (e1, e2, pair position embedding) start random and move at --lr_clip only, as in
the authors' code. The best epoch on val CIDEr is scored once on test, next to a blind baseline
that writes the most frequent training caption; the test captions are greedy, or with --beam by beam
search. Several GPUs through torchrun (see train.py).
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import cli
import clip_weights
import data
import evaluate
import figures
import train
from adapt import AdaptConfig, build_model, freeze_as_authors
from cli import InputError
from model import CLIP4IDC, Captioner, CaptionerConfig
from tokenizer import IGNORE, next_tokens
from train import arg


@dataclass
class CaptionConfig(train.RunConfig):
    """Appendix B and the authors' code. `--data synth`, the offline default (docs/offline-default.md says why): a small
    captioner without dropout, which slows a short run, writing only the training captions' words (40% off a step),
    on stage 1's small pair encoder, which trains at the captioner's rate (at a tenth of it, every seed scored lower)."""
    stage = "caption"
    data: Literal["synth", "clevr", "spot", "ier", "birds", "clevr_dc"] = arg(
        "synth", "synth: the offline CLEVR-Change look-alike")
    recipe: Literal["paper", "authors"] = arg("paper", "paper: the paper and our choices; authors: as their code trains")
    init_from: str = arg("", "the pair encoder: a stage-1 checkpoint, ours or the authors' (default: "
                         "out/adapt-<data>/best.pt), or openai", free=True)
    clip: str = arg("ViT-B/32", "with --init_from openai: OpenAI's model name or a checkpoint path",
                    synth="assets/clip_synth.pt", free=True)
    n_intra: int = arg(9, "with --init_from openai or an authors' file: layers that see one image", synth=2, low=0, free=True)
    n_inter: int = arg(3, "with --init_from openai: layers that see the pair (an authors' file: its layers after "
                       "n_intra)", synth=2, low=0, free=True)
    layers: int = arg(3, "captioning encoder layers, and as many decoder layers", low=1)
    heads: int = arg(8, "attention heads of the captioner", synth=4, low=1)
    ffn: int = arg(2048, "hidden units of the captioner's feed-forward layers", synth=512, low=1)
    dropout: float = arg(0.1, "the captioner's dropout", synth=0.0, low=0, high=0.99)
    attn_dropout: float = arg(0.1, "the captioner's dropout on attention weights", synth=0.0, low=0, high=0.99)
    max_len: int = arg(33, "caption tokens, SOT and EOT included, in training and decoding: 32 steps after SOT", low=2)
    vocab: Literal["clip", "train"] = arg("clip", "the words the captioner may write: all of CLIP's, or its training "
                                          "captions'", synth="train")
    beam: int = arg(1, "the test captions' beam width (1: greedy); validation, which picks the best epoch, stays greedy",
                    low=1, free=True)
    length_penalty: float = arg(1.0, "with --beam above 1: a caption scores its sum of log probabilities / length ** "
                                "this", low=0, free=True)
    epochs: int = arg(50, "at most: early stopping may end sooner", synth=6)
    batch_size: int = arg(16)
    lr: float = arg(1e-4, "the captioning model, with the word embeddings it shares with CLIP", synth=1e-3)
    lr_clip: float = arg(1e-7, "the pair encoder", synth=1e-3, low=0)
    weight_decay: float = arg(0.01)
    beta2: float = arg(0.999, "AdamW's second-moment decay, as the authors' BertAdam", synth=0.98)
    patience: int = arg(11, "stop after this many epochs without a better val CIDEr, as the authors' loop (0: never)",
                        low=0, free=True)
    seed: int = arg(42, authors={"clevr": 2021, "clevr_dc": 2021})  # their CLEVR-Change script's; CLEVR-DC takes it
    cache: bool = arg(False, "decode and resize every image once, into a uint8 file beside the data", synth=True, free=True)
    log_every: int = arg(50)
    save_every: int = arg(1000)

    def check(self):
        if "length_penalty" in self.given and self.beam == 1:
            raise InputError(f"--length_penalty {self.length_penalty}: read only with --beam above 1 (greedy decoding "
                             "weighs no lengths)")
        if "clip" in self.given and self.init_from != "openai":
            raise InputError(f"--clip {self.clip}: read only with --init_from openai, and the pair encoder comes from "
                             f"{self.init_from or f'out/adapt-{self.data}/best.pt'}")
        if self.init_from == "openai" and self.lr_clip == 0:
            raise InputError("--lr_clip 0 with --init_from openai would leave e1, e2 and p as drawn: freeze a pair "
                             "encoder that stage 1 trained")


def build_captioner(cfg, device):
    if cfg.resume:  # last.pt holds the whole model: the stage-1 file may have moved or gone
        last = Path(cfg.out_dir) / "last.pt"
        saved = clip_weights.read_checkpoint(last, mmap=True)
        cfg.init_from, cfg.clip = saved["config"]["init_from"], saved["config"]["clip"]  # where the run started, on record
        encoder = clip_weights.model_from_config({"encoder": saved["model_config"].get("encoder")}, last)
        record_split(cfg, encoder, last)
    elif cfg.init_from == "openai":
        encoder = build_model(AdaptConfig(data=cfg.data, init="openai", clip=cfg.clip, n_intra=cfg.n_intra,
                                          n_inter=cfg.n_inter))
    else:
        path = cfg.init_from or f"out/adapt-{cfg.data}/best.pt"
        if not Path(path).exists():
            raise FileNotFoundError(f"no stage-1 checkpoint at {path}: run `python adapt.py --data {cfg.data}` "
                                    "first, or pass --init_from PATH (or --init_from openai to skip adaptation)")
        read = Path(path).resolve()  # a link: the file it names
        if cfg.overwrite and read.parent == Path(cfg.out_dir).resolve() and read.name in train.RUN_FILES:
            raise InputError(f"--init_from {path}: a file of the run in --out_dir, which --overwrite replaces; copy it "
                             "elsewhere first, or pick another --out_dir")
        encoder = clip_weights.load_checkpoint(path, n_intra=cfg.n_intra)
        if not isinstance(encoder, CLIP4IDC):
            raise InputError(f"{path} holds a captioner: --init_from takes a stage-1 checkpoint (adapt.py's best.pt, "
                             "or the authors' pretrained pytorch_model.bin)")
        record_split(cfg, encoder, path)
    try:
        captioner = Captioner(encoder, captioner_config(cfg)).to(device)
    except ValueError as e:  # flags the pair encoder cannot take, such as a --max_len beyond its text positions
        flag = "--" if str(e).startswith(("heads ", "max_len ")) else ""  # the model's words name a field, not its flag
        raise InputError(flag + str(e)) from None
    if cfg.recipe == "authors":  # their Spot-the-Diff stage 2 trains the token embedding at CLIP's rate; Birds-to-Words too
        freeze_as_authors(encoder.clip, keep=("token_embedding.weight",) if cfg.data in ("spot", "birds") else ())
    return captioner


def record_split(cfg, encoder, path):
    """--n_intra and --n_inter as the pair encoder read from `path` has them, so that the run records its
    model's split: a flag may only repeat it (ours record both; the authors' files take them from the flags)."""
    for flag in ("n_intra", "n_inter"):
        given, held = getattr(cfg, flag), getattr(encoder.config, flag)
        if flag in cfg.given and given != held:
            raise InputError(f"--{flag} {given}: the pair encoder in {path} has {flag} {held}; expected that or no "
                             "flag (an authors' file is split by --n_intra)")
        setattr(cfg, flag, held)


def new_parameter_names(captioner, cfg):
    """The captioner's own parameters, at --lr; under --recipe authors the word embeddings move (if
    at all) at CLIP's rate, as in their code, where they are CLIP's tensors."""
    names = captioner.new_parameter_names()
    return names - {"encoder.clip.token_embedding.weight"} if cfg.recipe == "authors" else names


def captioner_config(cfg):
    return CaptionerConfig(layers=cfg.layers, heads=cfg.heads, ffn=cfg.ffn, dropout=cfg.dropout,
                           attn_dropout=cfg.attn_dropout, max_len=cfg.max_len)


def train_words(tokens):
    """The token ids that tokenized captions [N, L] teach the captioner to write: after SOT, up to and with EOT."""
    targets = next_tokens(tokens)
    return tuple(targets[targets != IGNORE].unique().tolist())


def main(argv=None):
    cfg, device = train.start_run(CaptionConfig, argv, __doc__)
    captioner = build_captioner(cfg, device)  # before the data: flags it cannot take leave nothing on disk
    evaluate.require_java()  # validation scores with it: refuse now, not after the first epoch
    encoder = captioner.encoder.config  # its split is printed below: the config line shows the flags as given
    image_size = encoder.clip.image_size
    splits, store = train.prepare_data(cfg, image_size)
    train_set = data.CaptionDataset(splits["train"], image_size, cfg.max_len, cfg.seed, store)
    if cfg.vocab == "train":
        captioner.write_only(train_words(train_set.tokens))
    vocab = f"{len(captioner.config.vocab):,} words" if cfg.vocab == "train" else "CLIP's vocabulary"
    print(f"captioner: {sum(p.numel() for p in captioner.parameters()) / 1e6:.2f}M parameters over a pair encoder of "
          f"{encoder.n_intra} intra + {encoder.n_inter} inter layers, writing {vocab}")
    val_items, test_items = data.eval_items(splits["val"]), data.eval_items(splits["test"])

    def predict(items):
        return evaluate.predict(captioner, items, device, store, cfg.amp, cfg.workers)

    def validate():
        cider = evaluate.caption_metrics({i.id: i.captions for i in val_items}, predict(val_items), only=("CIDEr",))
        return cider["CIDEr"], cider

    train.fit(cfg, captioner, train_set, validate, new_parameter_names(captioner, cfg), "linear", patience=cfg.patience)
    if cli.rank() != 0:
        return
    # The scoring may fail where the training did not (a test image read for the first time without --cache,
    # Java's METEOR gone, memory short): best.pt is kept, and the error says how to finish the run.
    try:
        preds, results = evaluate.score_captions(captioner, test_items, splits["train"], "test", device, store,
                                                 cfg.amp, cfg.workers, cfg.beam, cfg.length_penalty)
    except cli.ONE_LINE_ERRORS as e:
        if (message := cli.error_line(e)) is None:  # any other failure keeps its traceback
            raise
        raise InputError(f"{message}; the trained model is in {cfg.out_dir}/best.pt: once mended, run the same "
                         "command with --resume, which trains no further and scores it") from None
    evaluate.save_results(cfg.out_dir, results, "test", preds)
    examples = Path(cfg.out_dir) / "examples.png"
    cli.write_file(examples, figures.examples_png(test_items, preds))
    print(f"wrote {examples}: test pairs and their captions, the model's over a reference")


if __name__ == "__main__":
    cli.main(main)
