"""Stage 1 of CLIP4IDC: adapt CLIP to image pairs with IP-T and T-IP retrieval (section 2.3).

    python adapt.py --data synth                        # offline default: synthetic data, small model
    python adapt.py --data clevr --data_root PATH       # the paper: ViT-B/32 from OpenAI's weights, 9+3 layers

Any field of AdaptConfig is a flag (--epochs 3, --n_intra 8 --n_inter 4, --compile, --amp bf16).
This file also holds the training machinery that caption.py reuses: flags, device and mixed
precision, parameter groups, the learning-rate schedule, atomic checkpoints, resume and the loop.
"""
import argparse
import dataclasses
import itertools
import json
import logging
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import clip_weights
import data
import evaluate
from model import CLIP4IDC, CLIP4IDCConfig, CLIPConfig

# A CLIP small enough to train from scratch on a laptop CPU in minutes (128 px, patch 16).
SMALL_CLIP = CLIPConfig(embed_dim=128, image_size=128, patch_size=16, vision_width=128, vision_layers=4,
                        vision_heads=4, context_length=32, text_width=128, text_layers=2, text_heads=4)


@dataclass
class AdaptConfig:  # defaults: Appendix B and the authors' code
    data: str = "synth"  # clevr | spot | ier | synth
    data_root: str = ""  # default: data/<data>
    out_dir: str = ""  # default: out/adapt-<data>
    preset: str = "vit-b/32"  # vit-b/32 | small
    init: str = "openai"  # openai | random
    clip: str = "ViT-B/32"  # OpenAI model name or checkpoint path, for --init openai
    n_intra: int = 9
    n_inter: int = 3
    epochs: int = 12
    batch_size: int = 128
    lr: float = 1e-4  # the new parameters (e1, e2, pair position embedding, LayerNorm)
    lr_clip: float = 1e-7  # CLIP's weights
    weight_decay: float = 0.2  # matrices only
    beta2: float = 0.98  # AdamW's second-moment decay, as CLIP was trained
    warmup: float = 0.1  # fraction of the steps; then cosine decay
    grad_clip: float = 1.0
    seed: int = 42
    max_steps: int = 0  # stop after this many steps (0: all epochs)
    cache: bool = False  # keep all images resized in one file (data.ImageCache): for small datasets
    amp: str = "auto"  # auto (bf16, else fp16 on CUDA; off on CPU) | bf16 | fp16 | off
    compile: bool = False
    device: str = "auto"
    workers: int = 4
    log_every: int = 20
    save_every: int = 500  # steps between resumable checkpoints (also at each epoch's end)
    resume: bool = False


# The offline default: what `--data synth` changes unless a flag says otherwise.
SYNTH_DEFAULTS = dict(preset="small", init="random", n_intra=3, n_inter=1, epochs=4, batch_size=64,
                      lr=5e-4, lr_clip=5e-4, weight_decay=0.05, workers=1, cache=True)


# ---------------------------------------------------------------------------------------------
# Shared training machinery (caption.py uses these too)
# ---------------------------------------------------------------------------------------------
def parse_config(config_cls, synth_defaults, stage, argv=None, doc=None):
    """Every dataclass field becomes a flag; `--data synth` first applies `synth_defaults`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(config_cls):
        if f.type is bool or f.type == "bool":
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(f"--{f.name}", type=type(f.default), default=None)
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    cfg = config_cls(**given)
    if cfg.data == "synth":
        cfg = dataclasses.replace(cfg, **{**synth_defaults, **given})
    if not cfg.data_root:
        cfg.data_root = f"data/{cfg.data}"
    if not cfg.out_dir:
        cfg.out_dir = f"out/{stage}-{cfg.data}"
    return cfg


def start_run(config_cls, synth_defaults, stage, argv=None, doc=None):
    """The first steps of both stages: flags, log format, seeds, device."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = parse_config(config_cls, synth_defaults, stage, argv, doc)
    print(f"config: {asdict(cfg)}")
    seed_everything(cfg.seed)
    return cfg, setup_device(cfg)


def prepare_data(cfg, image_size):
    """The three splits and, with --cache, one ImageCache of all their images at the model's input size."""
    if cfg.data == "synth":
        data.ensure_synth(cfg.data_root)
    splits = {split: data.read_split(cfg.data, cfg.data_root, split) for split in ("train", "val", "test")}
    if not cfg.cache:
        return splits, None
    pairs = [p for split in splits.values() for p in split]
    return splits, data.ImageCache(pairs, image_size, Path(cfg.data_root) / f"cache_{image_size}px.pt")


def setup_device(cfg):
    device = torch.device(cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return device


def mixed_precision(device, amp):
    """Autocast context and grad scaler for `amp`: bf16 needs no scaler, fp16 does."""
    if amp == "auto":
        amp = "off" if device.type != "cuda" else "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if amp == "off":
        return nullcontext(), None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    return torch.autocast(device.type, dtype=dtype), scaler


def make_optimizer(model, new_names, cfg):
    """AdamW with two learning rates (new parameters vs CLIP's). Weight decay applies to matrices
    (embeddings included) but not to biases, LayerNorm gains or single vectors such as e1 and e2."""
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lr = cfg.lr if name in new_names else cfg.lr_clip
        decay = cfg.weight_decay if p.ndim >= 2 else 0.0
        groups.setdefault((lr, decay), []).append(p)
    param_groups = [dict(params=ps, lr=lr, weight_decay=wd) for (lr, wd), ps in groups.items()]
    return torch.optim.AdamW(param_groups, betas=(0.9, cfg.beta2), eps=1e-6, fused=True)


def make_schedule(optimizer, total_steps, warmup, decay):
    """Linear warm-up over the first `warmup` fraction, then cosine or linear decay to zero."""
    warmup_steps = max(1, int(warmup * total_steps))

    def factor(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else max(0.0, 1 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class EpochSampler(torch.utils.data.Sampler):
    """Yields (epoch, index) keys in an order fixed by (seed, epoch), so a resumed run sees the same
    batches; the datasets derive their own random choices from the same key."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch, self.skip = n, seed, 0, 0

    def set_epoch(self, epoch, skip=0):
        self.epoch, self.skip = epoch, skip

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        return iter([(self.epoch, int(i)) for i in order[self.skip:]])

    def __len__(self):
        return self.n - self.skip


def make_loader(dataset, cfg, device, sampler=None, batch_size=None):
    """Workers never touch the global RNG (own generator), so loading cannot change the training's
    random stream and a resumed run stays bit-exact."""
    workers = min(cfg.workers, os.cpu_count() or 1)
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size or cfg.batch_size, sampler=sampler, drop_last=sampler is not None,
        num_workers=workers, pin_memory=device.type == "cuda", persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(cfg.seed))


def save_atomic(obj, path):
    """Write to a temporary file, then rename: a run killed mid-save never leaves a broken file."""
    tmp = Path(f"{path}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state():
    return dict(torch=torch.get_rng_state(), python=random.getstate(), numpy=np.random.get_state(),
                cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def format_eta(seconds):
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


def fit(cfg, model, loss_fn, train_set, validate, new_names, decay, patience=0, after_step=None, log_extra=None):
    """The training loop of both stages.

    loss_fn(batch) -> loss; validate() -> (score, metrics) at each epoch's end, higher is better:
    the best model goes to best.pt. Resumable from last.pt with --resume. Returns the run's state.
    """
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = next(model.parameters()).device
    autocast, scaler = mixed_precision(device, cfg.amp)
    steps_per_epoch = len(train_set) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_set)} training samples are fewer than one batch of {cfg.batch_size}")
    total = min(cfg.max_steps or math.inf, cfg.epochs * steps_per_epoch)
    sampler = EpochSampler(len(train_set), cfg.seed)
    loader = make_loader(train_set, cfg, device, sampler)
    optimizer = make_optimizer(model, new_names, cfg)
    schedule = make_schedule(optimizer, total, cfg.warmup, decay)
    run = dict(model=model, optimizer=optimizer, schedule=schedule, scaler=scaler)  # all that last.pt restores
    state = dict(step=0, best=-math.inf, best_epoch=0, history=[], stopped=False)
    if cfg.resume and (out / "last.pt").exists():
        state = resume(out / "last.pt", run, cfg)

    def checkpoint():
        save_atomic(dict(**{k: v.state_dict() for k, v in run.items() if v is not None}, state=state, rng=rng_state(),
                         config=asdict(cfg), model_config=asdict(model_config_of(model))), out / "last.pt")

    def train_step(batch):
        with autocast:
            loss = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        schedule.step()
        if after_step:
            after_step()
        return loss

    def end_of_epoch(epoch):
        score, metrics = validate()
        state["history"].append(dict(epoch=epoch, step=state["step"], score=score, val=metrics))
        print(f"epoch {epoch} val score {score:.2f} (best {max(score, state['best']):.2f})", flush=True)
        if score > state["best"]:
            state["best"], state["best_epoch"] = score, epoch
            save_atomic(dict(model=model.state_dict(), config=asdict(cfg),
                             model_config=asdict(model_config_of(model))), out / "best.pt")
        if patience and epoch - state["best_epoch"] >= patience:
            print(f"early stop: no better val score for {patience} epochs")
            state["stopped"] = True
        checkpoint()

    first_step, t0, pairs_seen = state["step"], time.time(), 0
    while state["step"] < total and not state["stopped"]:
        epoch, done = divmod(state["step"], steps_per_epoch)
        sampler.set_epoch(epoch, skip=done * cfg.batch_size)
        model.train()
        for batch in itertools.islice(loader, min(steps_per_epoch - done, total - state["step"])):
            batch = [t.to(device, non_blocking=True) for t in batch]
            pairs_seen += batch[0].shape[:-3].numel()  # images are [..., 3, H, W]
            loss = train_step(batch)
            state["step"] += 1
            step, elapsed = state["step"], time.time() - t0
            if step % cfg.log_every == 0 or step == total:
                extra = "".join(f" {k} {v}" for k, v in (log_extra() if log_extra else {}).items())
                print(f"epoch {epoch + 1}/{cfg.epochs} step {step}/{total} loss {loss.item():.4f} "
                      f"lr {max(schedule.get_last_lr()):.2e}{extra} pairs/s {pairs_seen / elapsed:.1f} "
                      f"eta {format_eta((total - step) * elapsed / (step - first_step))}", flush=True)
            if step % cfg.save_every == 0 and step % steps_per_epoch != 0:  # epoch ends save after validating
                checkpoint()
        end_of_epoch(epoch + 1)
    return state


# Settings that fix the sequence of batches and learning rates: a resumed run must keep them.
RESUME_FIXED = ("data", "batch_size", "epochs", "max_steps", "seed", "lr", "lr_clip", "warmup")


def resume(path, run, cfg):
    """Restore model, optimiser, schedule, grad scaler and RNG from last.pt; return the loop's state."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)  # our own file, with Python RNG state
    changed = {k: (ckpt["config"][k], getattr(cfg, k)) for k in RESUME_FIXED if ckpt["config"][k] != getattr(cfg, k)}
    if changed:
        raise ValueError(f"{path} was written with other settings (saved, now): {changed}; resume with the same flags")
    for name, obj in run.items():
        if obj is not None:
            obj.load_state_dict(ckpt[name])
    set_rng_state(ckpt["rng"])
    print(f"resumed from {path} at step {ckpt['state']['step']}")
    return ckpt["state"]


def model_config_of(model):
    return model.config if isinstance(model, CLIP4IDC) else model.encoder.config


def pair_encoder_from_config(model_config):
    """An untrained CLIP4IDC pair encoder shaped as a checkpoint's `model_config` says."""
    mc = dict(model_config)
    return CLIP4IDC(CLIP4IDCConfig(clip=CLIPConfig(**mc.pop("clip")), **mc))


def load_pair_encoder(path, device="cpu"):
    """The CLIP4IDC pair encoder in a stage-1 run's best.pt."""
    ckpt = torch.load(path, map_location=device, weights_only=True)
    if "n_intra" not in ckpt.get("config", {}):
        raise ValueError(f"{path} is not a stage-1 checkpoint: pass the best.pt of an adapt.py run")
    model = pair_encoder_from_config(ckpt["model_config"])
    model.load_state_dict(ckpt["model"])
    return model.to(device)


# ---------------------------------------------------------------------------------------------
# Stage 1
# ---------------------------------------------------------------------------------------------
def build_model(cfg):
    if cfg.preset == "small" and cfg.init == "openai":
        raise ValueError("the small preset trains from scratch: add --init random, or use --preset vit-b/32")
    if cfg.preset == "small":
        clip_config, clip = SMALL_CLIP, None
    elif cfg.init == "openai":
        clip = clip_weights.load(cfg.clip)
        clip_config = clip.config
    else:
        clip_config, clip = CLIPConfig(), None
    if cfg.n_intra + cfg.n_inter != clip_config.vision_layers:
        raise ValueError(f"--n_intra {cfg.n_intra} + --n_inter {cfg.n_inter} must equal the "
                         f"{clip_config.vision_layers} vision layers of the '{cfg.preset}' model")
    return CLIP4IDC(CLIP4IDCConfig(clip=clip_config, n_intra=cfg.n_intra), clip)


@torch.no_grad()
def encode_split(model, pairs, cfg, device, cache):
    """Pooled pair vectors v (Eq. 5) of every pair, caption vectors g of every reference caption,
    and for each caption the index of its pair."""
    model.eval()
    size = model.config.clip.image_size
    loader = make_loader(data.EvalDataset(pairs, size, cache), cfg, device, batch_size=64)
    pair_vecs = [model.pool(model.encode_pair(b.to(device), a.to(device))) for _, b, a in loader]
    captions = [(i, c) for i, p in enumerate(pairs) for c in p.captions]
    tokens = data.tokenize([c for _, c in captions], model.config.context_length)
    text_vecs = [model.encode_text(t.to(device)) for t in tokens.split(256)]
    text_pair = torch.tensor([i for i, _ in captions])
    return F.normalize(torch.cat(pair_vecs), dim=-1), F.normalize(torch.cat(text_vecs), dim=-1), text_pair


def retrieval(model, pairs, cfg, device, cache=None):
    """IP-T and T-IP retrieval over all reference captions (Tables 6 and 7), on the change pairs."""
    v, g, text_pair = encode_split(model, pairs, cfg, device, cache)
    return evaluate.retrieval_metrics((v @ g.t()).float().cpu(), text_pair)


def rsum(metrics):
    """Model selection score: R@1 + R@5 + R@10 in both directions."""
    return sum(metrics[d][k] for d in ("pair_to_text", "text_to_pair") for k in ("R@1", "R@5", "R@10"))


def main(argv=None):
    cfg, device = start_run(AdaptConfig, SYNTH_DEFAULTS, "adapt", argv, __doc__)
    model = build_model(cfg).to(device)
    print(f"pair encoder: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{model.config.n_intra} intra + {model.config.n_inter} inter layers")
    splits, cache = prepare_data(cfg, model.config.clip.image_size)
    train_set = data.AdaptDataset(splits["train"], model.config.clip.image_size, model.config.context_length,
                                  cfg.seed, cache)
    step0 = retrieval(model, splits["test"], cfg, device, cache) if not cfg.resume else None
    train_model = torch.compile(model) if cfg.compile else model

    def loss_fn(batch):
        return train_model(*batch)

    def clamp_temperature():
        with torch.no_grad():  # tau >= 1/100, as in CLIP
            model.clip.logit_scale.clamp_(max=math.log(100))

    def validate():
        metrics = retrieval(model, splits["val"], cfg, device, cache)
        return rsum(metrics), metrics

    fit(cfg, model, loss_fn, train_set, validate, model.new_parameter_names(), "cosine",
        after_step=clamp_temperature, log_extra=lambda: {"temp": f"{1 / model.clip.logit_scale.exp().item():.4f}"})
    model.load_state_dict(torch.load(Path(cfg.out_dir) / "best.pt", map_location=device, weights_only=True)["model"])
    results = {split: retrieval(model, splits[split], cfg, device, cache) for split in ("val", "test")}
    if step0 is not None:
        results["test_step0"] = step0
    with open(Path(cfg.out_dir) / "metrics.json", "w") as f:
        json.dump(results, f, indent=2)
    chance = 100 / len(splits["test"])
    print(evaluate.format_retrieval(results["test"]))
    if step0 is not None:
        print(f"text -> pair R@1 on test: {results['test']['text_to_pair']['R@1']:.1f} after adaptation, "
              f"{step0['text_to_pair']['R@1']:.1f} with zero adaptation steps, chance {chance:.1f}")
    print(f"wrote {Path(cfg.out_dir) / 'metrics.json'}")


if __name__ == "__main__":
    main()
