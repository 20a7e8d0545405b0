"""The training machinery every stage shares: the run config and its flags, the run folder, parameter groups,
the learning-rate schedule, atomic checkpoints, resume, and the loop (the order of the data and its loader:
data.py; processes, device and precision: cli.py). adapt.py (stage 1) and caption.py (stage 2) build on it.

Several GPUs, on one machine or many, run through torchrun (NCCL on CUDA, gloo on CPU):

    torchrun --nproc_per_node 8 adapt.py --data clevr --data_root PATH
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 caption.py ...

--batch_size is the global batch, split evenly over the processes, so the paper's settings mean the
same on any number of GPUs. Each process reads its slice of every global batch; rank 0 alone
prints, validates, and writes checkpoints and metrics. Rank 0, then the first process of each other
machine, generates data, builds the image store and downloads OpenAI's CLIP where they are missing.
"""
import argparse
import itertools
import logging
import math
import os
import sys
import time
import typing
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

import torch
from torch.nn.parallel import DistributedDataParallel

import cli
import clip_weights
import data
import image_store
import synth
from cli import InputError
from model import CaptionerConfig, CLIP4IDCConfig

RUN_FILES = ("last.pt", "best.pt", "metrics.json", "test_predictions.json", "examples.png")  # what a run writes


# ---- Flags: each field of a stage's config ------------------------------------------------------
def arg(default, help=None, synth=None, authors=None, low=None, high=None, free=False):
    """A config field and its flag: the default on the paper's datasets, on `--data synth` (the offline default) and
    under `--recipe authors` ({data: value}); its help; the values it may take, `low` to `high`; `free`: a resumed
    run may change it. A stage that declares a shared field again gives it its own default, and keeps the rest."""
    kept = {k: v for k, v in dict(help=help, low=low, high=high, free=free or None).items() if v is not None}
    return field(default=None, metadata=dict(default=default, synth=synth, authors=authors or {}, **kept))


@dataclass
class RunConfig:
    """What a run of every stage is set by; a stage's config adds its own fields. A field left None takes its
    default for the run's --data and --recipe, so that `AdaptConfig()` is what `python adapt.py` runs; `given`
    names the fields that were set, and a check that depends on it need not guess from a field's value."""
    data_root: str = arg("", "dataset folder (default: data/<data>)", free=True)
    out_dir: str = arg("", "run folder for checkpoints and metrics (default: out/<stage>-<data>)", free=True)
    epochs: int = arg(None, "passes over the training set", low=1)
    batch_size: int = arg(None, "the global batch, over all processes", low=1)
    lr: float = arg(None, "the learning rate of what the stage adds to CLIP", low=0)
    weight_decay: float = arg(None, "AdamW's, on matrices only", low=0)
    beta2: float = arg(0.98, "AdamW's second-moment decay, as CLIP was trained", low=0, high=0.9999)
    warmup: float = arg(0.1, "fraction of the steps with a rising rate; then the stage's decay", low=0, high=1)
    grad_clip: float = arg(1.0, "largest gradient norm (0: no clipping)", low=0)
    seed: int = arg(42, "model initialisation, data order, dropout, all that is drawn", low=0, high=2**32 - 1)
    max_steps: int = arg(0, "stop after this many steps (0: all epochs)", low=0)
    amp: Literal["auto", "bf16", "fp16", "off"] = arg("auto", "mixed precision; auto: bf16 (else fp16) on CUDA, off on CPU")
    compile: bool = arg(False, "torch.compile the training step", free=True)
    device: str = arg("auto", "auto, cpu, cuda or cuda:N (under torchrun: cuda:LOCAL_RANK)", free=True)
    workers: int = arg(-1, "loader processes (-1: from the machine's cores, see data.loader_workers)", low=-1,
                       high=data.MAX_WORKERS, free=True)
    log_every: int = arg(20, "steps between progress lines", low=1, free=True)
    save_every: int = arg(500, "steps between resumable checkpoints (also at each epoch's end)", low=1, free=True)
    resume: bool = arg(False, "continue the run in --out_dir from its last.pt", free=True)
    overwrite: bool = arg(False, "replace the run in --out_dir with a new one", free=True)

    def __post_init__(self):
        self.given = frozenset(f.name for f in fields(self) if getattr(self, f.name) is not None)
        for f in sorted(fields(self), key=lambda f: f.name not in ("data", "recipe")):  # the others' defaults follow them
            if getattr(self, f.name) is None:
                setattr(self, f.name, self.default(f.name))
        self.data_root = self.data_root or f"data/{self.data}"
        self.out_dir = self.out_dir or f"out/{self.stage}-{self.data}"
        for name, value in asdict(self).items():
            low, high = (self.meta(name).get(end) for end in ("low", "high"))
            finite = not isinstance(value, float) or math.isfinite(value)  # ints of any size are finite
            if low is not None and not (finite and low <= value and (high is None or value <= high)):
                expected = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise InputError(f"--{name} {value}: expected a {'value' if finite else 'finite value'} {expected}")
            if isinstance(value, int) and value >= 2**63:  # beyond torch's 64-bit sizes and counts: deep in torch
                raise InputError(f"--{name} {value}: expected a value below 2**63, as torch's sizes and counts are 64-bit")
        if self.resume and self.overwrite:
            raise InputError("--resume continues the run in --out_dir and --overwrite starts it anew: give one")
        if self.lr == getattr(self, "lr_clip", None) == 0:  # a rate of 0 freezes (make_optimizer)
            raise InputError("--lr 0 and --lr_clip 0: nothing would train; expected a rate above 0 for one of them")
        self.check()

    def check(self):
        """A stage's checks of flags that depend on one another."""

    @classmethod
    def meta(cls, name):
        """Field `name`'s arg(), with the help and limits of its first declaration."""
        first = next(c.__dataclass_fields__[name] for c in reversed(cls.__mro__) if name in vars(c).get(
            "__dataclass_fields__", {}))
        return {**first.metadata, **cls.__dataclass_fields__[name].metadata}

    def default(self, name):
        meta, data_set = self.meta(name), getattr(self, "data", None)
        if getattr(self, "recipe", None) == "authors" and data_set in meta["authors"]:
            return meta["authors"][data_set]
        return meta["synth"] if data_set == "synth" and meta["synth"] is not None else meta["default"]


def defaults_and_limits(meta):
    """The end of a flag's help: "(default: 12; --data synth: 5; --recipe authors --data spot or birds: 20; at least 1)"."""
    said = [f"default: {meta['default']}"] if meta["default"] != "" else []
    said += [f"--data synth: {meta['synth']}"] if meta["synth"] is not None else []
    for value in dict.fromkeys(meta["authors"].values()):
        said.append(f"--recipe authors --data {' or '.join(d for d, v in meta['authors'].items() if v == value)}: {value}")
    if meta.get("low") is not None:
        said.append(f"{meta['low']} to {meta['high']}" if meta.get("high") is not None else f"at least {meta['low']}")
    return f" ({'; '.join(said)})" if said else ""


def parse_config(config_cls, argv=None, doc=None):
    """The config of a command line: each field of `config_cls` is a flag, the stage's own listed first."""
    parser = cli.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in sorted(fields(config_cls), key=lambda f: f.name in RunConfig.__dataclass_fields__):
        meta = config_cls.meta(f.name)
        kind = dict(help=meta["help"].replace("<stage>", config_cls.stage) + defaults_and_limits(meta), default=None)
        if f.type is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, **kind)
        else:
            choices = typing.get_args(f.type) if typing.get_origin(f.type) is typing.Literal else None
            parser.add_argument(f"--{f.name}", type=type(meta["default"]), choices=choices, **kind)
    return config_cls(**{k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None})


def start_run(config_cls, argv=None, doc=None):
    """The first steps of every stage: flags, checks of the data and run folders, processes, device,
    seeds. Only rank 0 prints. Nothing is built, downloaded or written before the checks pass."""
    cfg = parse_config(config_cls, argv, doc)
    processes = int(os.environ.get("WORLD_SIZE", 1))
    if cfg.batch_size % processes:
        raise InputError(f"--batch_size {cfg.batch_size} does not split evenly over {processes} processes")
    if getattr(cfg, "data", "synth") == "synth":
        synth.check_root(cfg.data_root)
    elif not Path(cfg.data_root).is_dir():
        raise data.missing(cfg.data, Path(cfg.data_root), "no such folder (--data_root)")
    check_run_folder(cfg)
    device = cli.setup_device(cfg)
    logging.basicConfig(level=logging.INFO if cli.rank() == 0 else logging.ERROR, format="%(message)s")
    if cli.rank() != 0:
        sys.stdout = open(os.devnull, "w")
    print(f"config: {asdict(cfg)}" + (f"\n{cli.world()} processes" if cli.distributed() else ""))
    torch.manual_seed(cfg.seed)  # model initialisation and dropout: all the randomness training draws
    return cfg, device


def differences(saved, now, defaults, prefix=""):
    """{name: (saved, now)} of the values in `now` that `saved` holds otherwise; nested dicts name theirs
    "encoder.n_intra". A field `saved` lacks, written before it existed, holds its value in `defaults`."""
    changed = {}
    for k, value in now.items():
        if isinstance(value, dict) and isinstance(saved.get(k), dict):
            changed |= differences(saved[k], value, defaults.get(k, {}), f"{prefix}{k}.")
        elif saved.get(k, defaults.get(k)) != value:
            changed[prefix + k] = (saved.get(k), value)
    return changed


def check_run_folder(cfg, held=False):
    """--out_dir may hold an earlier run only with --resume (same settings, not finished) or --overwrite, and
    none that is training. `held`: checked again once this run holds the lock, as another may have written since."""
    out = Path(cfg.out_dir)
    cli.check_writable(out, "--out_dir")
    if folders := [out / name for name in (*RUN_FILES, ".lock") if (out / name).is_dir()]:  # a run cannot write there
        raise InputError(f"{folders[0]} is a folder: expected the run's file of that name, or none; move it away")
    earlier = [name for name in RUN_FILES if (out / name).exists()]
    if not held and (out / ".lock").is_file() and os.environ.get("RANK", "0") == "0":  # a run trains there
        with open(out / ".lock", "a") as lock:  # closing it lets go (of this process's lock too, were it held)
            cli.take_lock(lock, out)
    if cfg.resume and not (out / "last.pt").is_file():
        raise InputError(f"--resume: there is no {out / 'last.pt'} to resume from")
    if cfg.resume and (out / "metrics.json").is_file():
        raise InputError(f"--resume: {out} holds a finished run ({out / 'metrics.json'}), nothing is left to train: "
                         "score its best.pt with evaluate.py, or pass --overwrite to train it anew")
    if cfg.resume:
        saved = clip_weights.read_checkpoint(out / "last.pt", mmap=True)  # no tensor of a sound file is read
        keys = {"config", "state", "rng", "model", "model_config", "optimizer", "schedule"}
        if not (isinstance(saved, dict) and keys <= set(saved) and isinstance(saved["config"], dict)
                and isinstance(saved["state"], dict) and "step" in saved["state"]):
            raise InputError(f"--resume: {out / 'last.pt'} is not a last.pt of adapt.py or caption.py")
        saved = saved["config"]
        if set(saved) - set(cfg.__dataclass_fields__):  # settings of another stage
            other = next((f"{c.stage}.py" for c in RunConfig.__subclasses__() if set(saved) <= set(c.__dataclass_fields__)),
                         "")
            raise InputError(f"--resume: {out / 'last.pt'} is a run of {other}: resume it with {other}")
        changed = differences(saved, asdict(cfg), asdict(type(cfg)()))
        if changed := {k: v for k, v in changed.items() if not cfg.meta(k).get("free")}:
            raise InputError(f"--resume: {out / 'last.pt'} was trained with other settings, (saved, now): "
                             f"{changed}; resume with the same ones")
    elif earlier and not cfg.overwrite:
        resume = "--resume to continue it, " * ("last.pt" in earlier and "metrics.json" not in earlier)  # unfinished
        raise InputError(f"{out} holds an earlier run ({', '.join(earlier)}): pass {resume}--overwrite to start it "
                         "anew, or another --out_dir")


@contextmanager
def locked(out):
    """Hold out/.lock while training, so that a second run on the folder is refused rather than racing on its
    files, and remove what a killed checkpoint write left (.tmp). Folders it made are removed if the run ends
    before writing anything into them."""
    with cli.new_folders(out), open(out / ".lock", "w") as lock:
        cli.take_lock(lock, out)
        for name in ("last.pt", "best.pt"):  # what clip_weights.save_atomic leaves; the user's own *.tmp stay
            (out / f"{name}.tmp").unlink(missing_ok=True)
        try:
            yield
        finally:
            (out / ".lock").unlink(missing_ok=True)


# ---- Data: splits and image store (their order and loaders: data.py) ----------------------------
def prepare_data(cfg, image_size, samples=len):
    """The three splits and, with --cache, the ImageStore of all their images at the model's input size,
    generated and built in turns where missing. samples(train pairs): the stage's training samples, which
    --resume compares before any image is stored."""
    with in_turns() as turn:
        if cfg.data == "synth" and turn < 2:
            synth.ensure_synth(cfg.data_root)
        splits = {split: data.read_split(cfg.data, cfg.data_root, split) for split in ("train", "val", "test")}
        last, now = Path(cfg.out_dir) / "last.pt", samples(splits["train"])
        saved = clip_weights.read_checkpoint(last, mmap=True)["state"].get("samples") if cfg.resume else None
        if saved not in (None, now):  # --data_root may move, but the data order needs the run's number of samples
            raise InputError(f"--resume: {last} trained on {saved} samples, the data now holds {now}: resume on the "
                             "same data")
        require_batch(cfg.batch_size, now)  # before any image is stored
        pairs = [p for s in splits.values() for p in s]
        store = image_store.ImageStore(pairs, image_size, cfg.data_root) if cfg.cache else None
    return splits, store


@contextmanager
def in_turns():
    """Rank 0 first, then the first process of each other machine (whose disk may be its own), then the others:
    what a turn makes where it is missing, the next finds. Yields the turn. A turn that fails stops every process
    at its end with the failure's line, said once a machine as bad input is, not with a connection lost."""
    turn, failure = 0 if cli.rank() == 0 else 1 if cli.first_of_machine() else 2, None
    for now in range(3):
        if now == turn:
            try:
                yield turn
            except Exception as e:
                failure = e
        line = failure and (cli.error_line(failure) or f"process {cli.rank()} stopped ({type(failure).__name__})")
        said = [s for s in cli.gather_objects(line) if s]
        if failure:
            raise failure
        if said:
            raise InputError(said[0])


def require_batch(batch_size, samples):
    if batch_size > samples:
        raise InputError(f"--batch_size {batch_size}: expected at most the {samples} training samples")


# ---- Optimiser and schedule ---------------------------------------------------------------------
def make_optimizer(model, new_names, cfg):
    """AdamW with two learning rates (new parameters vs CLIP's). Weight decay applies to matrices
    (embeddings included) but not to biases, LayerNorm gains or single vectors such as e1 and e2.
    A rate of 0 freezes: no gradient is computed (Table 7 captions with the image encoder frozen)."""
    groups, frozen = {}, 0
    for name, p in model.named_parameters():
        if (lr := cfg.lr if name in new_names else cfg.lr_clip) == 0:
            p.requires_grad_(False)
        if not p.requires_grad:
            frozen += p.numel()
            continue
        decay = cfg.weight_decay if p.ndim >= 2 else 0.0
        groups.setdefault((lr, decay), []).append(p)
    param_groups = [dict(params=ps, lr=lr, weight_decay=wd) for (lr, wd), ps in groups.items()]
    print("trainable parameters: " + ", ".join(f"{sum(p.numel() for p in ps) / 1e6:.2f}M at lr {lr:g} weight decay {wd:g}"
                                                for (lr, wd), ps in groups.items()) + f"; frozen: {frozen / 1e6:.2f}M")
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


# ---- Checkpoints --------------------------------------------------------------------------------
def rng_state(device):
    """The global random streams training draws from (dropout): the CPU's and the training GPU's, which on
    resume goes to the GPU that trains then, whatever its index (--device and the visible GPUs may change)."""
    return dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]
    if isinstance(cuda, list):  # a last.pt of an earlier version: the streams of all GPUs then visible, by index
        cuda = cuda[device.index] if device.type == "cuda" and device.index < len(cuda) else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def resume(path, run, shape):
    """Restore model, optimiser, schedule, grad scaler and RNG from last.pt (whose settings
    check_run_folder compared); return the loop's state."""
    ckpt = clip_weights.read_checkpoint(path)
    defaults = {"encoder": asdict(CLIP4IDCConfig()), "captioner": asdict(CaptionerConfig())}
    if changed := differences(ckpt["model_config"], shape, defaults):  # the same weights fit another layer split
        if "captioner.vocab" in changed:  # --vocab train: the token ids of the captions' words, too many to print
            saved, now = (set(ids or ()) for ids in changed["captioner.vocab"])
            changed["captioner.vocab"] = (f"{len(saved)} words", f"{len(now)} words, {len(now - saved)} of them new")
        raise InputError(f"--resume: {path} holds a model of another shape than the one built now, (saved, now): "
                         f"{changed}; resume as the run started")
    clip_weights.load_weights(run["model"], ckpt["model"], f"--resume: {path}")  # names what does not fit or is not finite
    for name, obj in run.items():
        if name != "model" and obj is not None and (name in ckpt or name != "scaler"):  # fp16 from a run without: a new scaler
            obj.load_state_dict(ckpt[name])
    if len(ckpt["rng"]) == cli.world():
        set_rng_state(ckpt["rng"][cli.rank()], next(run["model"].parameters()).device)
    else:
        print(f"{path} was written by {len(ckpt['rng'])} processes: random streams (dropout) start afresh")
    print(f"resumed from {path} at step {ckpt['state']['step']}")
    return ckpt["state"]


# ---- The loop -----------------------------------------------------------------------------------
def update(model, loss, optimizer, scaler, grad_clip):
    """Backward pass, gradient clipping and the optimiser step, with the fp16 grad scaler if any.
    Nothing here waits for the GPU: under fp16 the fused optimiser skips a step with inf gradients on
    the device."""
    optimizer.zero_grad(set_to_none=True)
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def fit(cfg, model, train_set, validate, new_names, decay, patience=0, after_step=None, log_extra=None, before=None):
    """The training loop of both stages: model(*batch) is the loss of a batch of `train_set`.

    validate() -> (score, metrics) at each epoch's end, higher is better, run by rank 0 alone: the best
    model goes to best.pt, and is rank 0's `model` at the end. Resumable from last.pt with --resume.
    `before` (metrics measured before the first step) is kept in the run's state, which fit returns.
    """
    out, device = Path(cfg.out_dir), next(model.parameters()).device
    autocast, scaler = cli.mixed_precision(device, cfg.amp)
    require_batch(cfg.batch_size, len(train_set))
    steps_per_epoch = len(train_set) // cfg.batch_size
    total = min(cfg.max_steps or math.inf, cfg.epochs * steps_per_epoch)
    sampler = data.EpochSampler(len(train_set), cfg.seed, cfg.batch_size, cli.rank(), cli.world())
    loader = data.make_loader(train_set, cfg.batch_size // cli.world(), device, cfg.workers, sampler, cfg.seed)
    optimizer = make_optimizer(model, new_names, cfg)
    schedule = make_schedule(optimizer, total, cfg.warmup, decay)
    run = dict(model=model, optimizer=optimizer, schedule=schedule, scaler=scaler)  # all that last.pt restores
    state = dict(step=0, best=-math.inf, best_epoch=0, history=[], stopped=False, before=before, samples=len(train_set))
    if cli.distributed():  # the processes built the same model; their dropout masks must differ, as within one batch
        torch.manual_seed(cfg.seed + cli.rank())
    net = DistributedDataParallel(model) if cli.distributed() else model  # gradients averaged over processes
    # On one GPU, CUDA graphs replay each compiled step with one launch instead of hundreds.
    graphs = cfg.compile and device.type == "cuda" and not cli.distributed()
    net = torch.compile(net, mode="reduce-overhead" if graphs else None) if cfg.compile else net
    saved = dict(config=asdict(cfg), model_config=clip_weights.model_config(model))
    replaced = [out / name for name in RUN_FILES if cfg.overwrite]  # kept until this run has something to save

    def save(obj, name):
        while replaced:
            replaced.pop().unlink(missing_ok=True)
        clip_weights.save_atomic(obj, out / name)

    def diverged(what):
        return InputError(f"step {state['step']}: {what}, training diverged: lower --lr or --lr_clip")

    def require_finite():  # alike in every process; the last good last.pt and best.pt stay
        if not torch.stack([p.isfinite().all() for p in model.parameters()]).all():
            raise diverged("the weights are not finite")

    def checkpoint():  # of weights that require_finite passed
        rngs = cli.gather_objects(rng_state(device))  # every process's dropout stream
        if cli.rank() == 0:
            save(dict(**{k: v.state_dict() for k, v in run.items() if v is not None}, state=state, rng=rngs, **saved),
                 "last.pt")

    def end_of_epoch(epoch):
        require_finite()  # before validating: else a diverged model's score could make it best.pt
        score, metrics = cli.gather_objects(validate() if cli.rank() == 0 else None)[0]  # every process stops together
        state["history"].append(dict(epoch=epoch, step=state["step"], score=score, val=metrics))
        print(f"epoch {epoch} val score {score:.2f} (best {max(score, state['best']):.2f})", flush=True)
        if score > state["best"]:
            state["best"], state["best_epoch"] = score, epoch
            if cli.rank() == 0:
                save(dict(model=model.state_dict(), **saved), "best.pt")
        if patience and epoch - state["best_epoch"] >= patience:
            print(f"early stop: no better val score for {patience} epochs")
            state["stopped"] = True
        checkpoint()

    with locked(out) if cli.rank() == 0 else nullcontext():
        with in_turns() as turn:  # another run may have written here since this one started: all refuse alike
            if turn == 0:
                check_run_folder(cfg, held=True)
        if cfg.resume:
            state = resume(out / "last.pt", run, saved["model_config"])
        cli.training_begun = True  # from here a process may fail its own way (on its slice of the data): each says it
        while state["step"] < total and not state["stopped"]:
            epoch, done = divmod(state["step"], steps_per_epoch)
            sampler.set_epoch(epoch, skip=done * cfg.batch_size)
            model.train()
            since, pairs, steps = time.time(), 0, 0  # the speed of the steps since the last progress line
            for batch in itertools.islice(loader, min(steps_per_epoch - done, total - state["step"])):
                batch = [t.to(device, non_blocking=True) for t in batch]
                pairs += batch[1].shape[:-3].numel() * cli.world()  # after images [B, (k,) 3, H, W], all processes
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs may be overwritten
                with autocast:
                    loss = net(*batch)
                update(model, loss, optimizer, scaler, cfg.grad_clip)
                lr = max(schedule.get_last_lr())  # the rate of this step, which a progress line reports
                schedule.step()
                if after_step:
                    after_step()
                state["step"], steps = state["step"] + 1, steps + 1
                if state["step"] % cfg.log_every == 0 or state["step"] == total:  # host syncs: printed values, saves
                    value = sum(cli.gather_objects(loss.item())) / cli.world()  # the global batch's: all stop at a NaN together
                    if not math.isfinite(value):
                        raise diverged(f"the loss is {value}")
                    extra = "".join(f" {k} {v}" for k, v in (log_extra() if log_extra else {}).items())
                    seconds = time.time() - since
                    print(f"epoch {epoch + 1}/{cfg.epochs} step {state['step']}/{total} loss {value:.4f} "
                          f"lr {lr:.2e}{extra} pairs/s {pairs / seconds:.1f} "
                          f"eta {cli.format_eta((total - state['step']) * seconds / steps)}", flush=True)
                    since, pairs, steps = time.time(), 0, 0
                # An epoch's end and the run's end save after validating: killed while validating, a run
                # resumes from before them and validates again.
                validates_next = state["step"] % steps_per_epoch == 0 or state["step"] == total
                if state["step"] % cfg.save_every == 0 and not validates_next:
                    require_finite()
                    checkpoint()
            end_of_epoch(epoch + 1)
    if cli.rank() == 0:  # what the run scores
        model.load_state_dict(clip_weights.read_checkpoint(out / "best.pt")["model"])
    return state


if __name__ == "__main__":  # the loop has no command line of its own: each stage's runs it
    parser = cli.ArgumentParser(description=__doc__ + "\nIts flags are each stage's: python adapt.py --help, python "
                                "caption.py --help, python pretrain.py --help.", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    parser.print_help()
