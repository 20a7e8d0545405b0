"""The training machinery both stages share: flags from a config dataclass, device, precision and
processes, parameter groups, the learning-rate schedule, the order of the data and its loader,
atomic checkpoints, resume, and the loop. adapt.py (stage 1) and caption.py (stage 2) build on it.

Several GPUs, on one machine or many, run through torchrun (NCCL on CUDA, gloo on CPU):

    torchrun --nproc_per_node 8 adapt.py --data clevr --data_root PATH
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --master_port 29500 --nproc_per_node 8 caption.py ...

--batch_size is the global batch, split evenly over the processes, so the paper's settings mean the
same on any number of GPUs. Each process reads its slice of every global batch; rank 0 alone
prints, generates data, builds the image store, validates, and writes checkpoints and metrics.
"""
import argparse
import atexit
import dataclasses
import itertools
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import clip_weights
import data
import synth
from model import distributed


# ---------------------------------------------------------------------------------------------
# Flags, processes, device and precision
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
    """The first steps of both stages: flags, processes, device, seeds. Only rank 0 prints."""
    cfg = parse_config(config_cls, synth_defaults, stage, argv, doc)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = setup_device(cfg)
    if rank() != 0:
        sys.stdout = open(os.devnull, "w")
    print(f"config: {asdict(cfg)}" + (f"\n{world()} processes" if distributed() else ""))
    torch.manual_seed(cfg.seed)  # model initialisation and dropout: all the randomness training draws
    return cfg, device


def setup_device(cfg):
    """The device --device names (auto: cuda if there is one); under torchrun also the process
    group, each process on cuda:LOCAL_RANK."""
    device = torch.device(cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        # A long timeout: the other processes wait while rank 0 builds the image store or validates.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(hours=2),
                                device_id=device if device.type == "cuda" else None)
        atexit.register(dist.destroy_process_group)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return device


def rank():
    return dist.get_rank() if distributed() else 0


def world():
    return dist.get_world_size() if distributed() else 1


def barrier():
    if distributed():
        dist.barrier()


def gather_objects(obj):
    """[obj of rank 0, obj of rank 1, ...], on every process."""
    if not distributed():
        return [obj]
    objs = [None] * world()
    dist.all_gather_object(objs, obj)
    return objs


def mixed_precision(device, amp):
    """Autocast context and grad scaler for `amp`: bf16 needs no scaler, fp16 does."""
    if amp == "auto":
        amp = "off" if device.type != "cuda" else "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if amp == "off":
        return nullcontext(), None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    return torch.autocast(device.type, dtype=dtype), scaler


# ---------------------------------------------------------------------------------------------
# Data: splits, image store, order and loaders
# ---------------------------------------------------------------------------------------------
def prepare_data(cfg, image_size):
    """The three splits and, with --cache, the ImageStore of all their images at the model's input
    size. Rank 0 generates and builds what is missing while the others wait, then they read it."""
    if rank() != 0:
        barrier()
    if cfg.data == "synth":
        synth.ensure_synth(cfg.data_root)
    splits = {split: data.read_split(cfg.data, cfg.data_root, split) for split in ("train", "val", "test")}
    store = data.ImageStore([p for s in splits.values() for p in s], image_size, cfg.data_root) if cfg.cache else None
    if rank() == 0:
        barrier()
    return splits, store


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


def default_workers():
    """Loader processes: the cores of this process's share of the machine, less one for itself, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1))


def make_loader(dataset, batch_size, device, workers=-1, sampler=None, seed=0):
    """Workers never touch the global RNG (own generator), so loading cannot change the training's
    random stream and a resumed run stays bit-exact. workers -1: `default_workers()`."""
    workers = workers if workers >= 0 else default_workers()
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=sampler is not None, num_workers=workers,
        pin_memory=device.type == "cuda", persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Optimiser and schedule
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def save_atomic(obj, path):
    """Write to a temporary file, then rename: a run killed mid-save never leaves a broken file."""
    tmp = Path(f"{path}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state():  # the only global random streams training draws from (dropout)
    return dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# Settings that fix the sequence of batches and learning rates: a resumed run must keep them.
RESUME_FIXED = ("data", "batch_size", "epochs", "max_steps", "seed", "lr", "lr_clip", "warmup")


def resume(path, run, cfg):
    """Restore model, optimiser, schedule, grad scaler and RNG from last.pt; return the loop's state."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    changed = {k: (ckpt["config"][k], getattr(cfg, k)) for k in RESUME_FIXED if ckpt["config"][k] != getattr(cfg, k)}
    if changed:
        raise ValueError(f"{path} was written with other settings (saved, now): {changed}; resume with the same flags")
    for name, obj in run.items():
        if obj is not None:
            obj.load_state_dict(ckpt[name])
    if len(ckpt["rng"]) == world():
        set_rng_state(ckpt["rng"][rank()])
    else:
        print(f"{path} was written by {len(ckpt['rng'])} processes: random streams (dropout) start afresh")
    print(f"resumed from {path} at step {ckpt['state']['step']}")
    return ckpt["state"]


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
def update(model, loss, optimizer, scaler, grad_clip):
    """Backward pass, gradient clipping and the optimiser step, with the fp16 grad scaler if any.
    Nothing here waits for the GPU: the fused optimiser skips a step with inf gradients on the device."""
    optimizer.zero_grad(set_to_none=True)
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def fit(cfg, model, train_set, validate, new_names, decay, patience=0, after_step=None, log_extra=None):
    """The training loop of both stages: model(*batch) is the loss of a batch of `train_set`.

    validate() -> (score, metrics) at each epoch's end, higher is better, run by rank 0 alone: the
    best model goes to best.pt. Resumable from last.pt with --resume. Returns the run's state.
    """
    out, device = Path(cfg.out_dir), next(model.parameters()).device
    autocast, scaler = mixed_precision(device, cfg.amp)
    steps_per_epoch = len(train_set) // cfg.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_set)} training samples are fewer than one batch of {cfg.batch_size}")
    if cfg.batch_size % world():
        raise ValueError(f"--batch_size {cfg.batch_size} does not split evenly over {world()} processes")
    total = min(cfg.max_steps or math.inf, cfg.epochs * steps_per_epoch)
    sampler = EpochSampler(len(train_set), cfg.seed, cfg.batch_size, rank(), world())
    loader = make_loader(train_set, cfg.batch_size // world(), device, cfg.workers, sampler, cfg.seed)
    optimizer = make_optimizer(model, new_names, cfg)
    schedule = make_schedule(optimizer, total, cfg.warmup, decay)
    run = dict(model=model, optimizer=optimizer, schedule=schedule, scaler=scaler)  # all that last.pt restores
    state = dict(step=0, best=-math.inf, best_epoch=0, history=[], stopped=False)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.resume and (out / "last.pt").exists():
        state = resume(out / "last.pt", run, cfg)
    net = DistributedDataParallel(model) if distributed() else model  # gradients averaged over processes
    # On one GPU, CUDA graphs replay each compiled step with one launch instead of hundreds.
    graphs = cfg.compile and device.type == "cuda" and not distributed()
    net = torch.compile(net, mode="reduce-overhead" if graphs else None) if cfg.compile else net
    saved = dict(config=asdict(cfg), model_config=clip_weights.model_config(model))

    def checkpoint():
        rngs = gather_objects(rng_state())  # every process's dropout stream
        if rank() == 0:
            save_atomic(dict(**{k: v.state_dict() for k, v in run.items() if v is not None}, state=state, rng=rngs,
                             **saved), out / "last.pt")

    def train_step(batch):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs may be overwritten
        with autocast:
            loss = net(*batch)
        update(model, loss, optimizer, scaler, cfg.grad_clip)
        schedule.step()
        if after_step:
            after_step()
        return loss

    def end_of_epoch(epoch):
        score, metrics = gather_objects(validate() if rank() == 0 else None)[0]  # every process stops together
        state["history"].append(dict(epoch=epoch, step=state["step"], score=score, val=metrics))
        print(f"epoch {epoch} val score {score:.2f} (best {max(score, state['best']):.2f})", flush=True)
        if score > state["best"]:
            state["best"], state["best_epoch"] = score, epoch
            if rank() == 0:
                save_atomic(dict(model=model.state_dict(), **saved), out / "best.pt")
        if patience and epoch - state["best_epoch"] >= patience:
            print(f"early stop: no better val score for {patience} epochs")
            state["stopped"] = True
        checkpoint()

    while state["step"] < total and not state["stopped"]:
        epoch, done = divmod(state["step"], steps_per_epoch)
        sampler.set_epoch(epoch, skip=done * cfg.batch_size)
        model.train()
        since, pairs, steps = time.time(), 0, 0  # the speed of the steps since the last progress line
        for batch in itertools.islice(loader, min(steps_per_epoch - done, total - state["step"])):
            batch = [t.to(device, non_blocking=True) for t in batch]
            pairs += batch[1].shape[:-3].numel() * world()  # after images [B, (k,) 3, H, W], all processes
            loss = train_step(batch)
            state["step"], steps = state["step"] + 1, steps + 1
            if state["step"] % cfg.log_every == 0 or state["step"] == total:  # the only host syncs: printed values
                extra = "".join(f" {k} {v}" for k, v in (log_extra() if log_extra else {}).items())
                value = loss.item()  # waits for the GPU: the steps since the last line are done
                seconds = time.time() - since
                print(f"epoch {epoch + 1}/{cfg.epochs} step {state['step']}/{total} loss {value:.4f} "
                      f"lr {max(schedule.get_last_lr()):.2e}{extra} pairs/s {pairs / seconds:.1f} "
                      f"eta {data.format_eta((total - state['step']) * seconds / steps)}", flush=True)
                since, pairs, steps = time.time(), 0, 0
            if state["step"] % cfg.save_every == 0 and state["step"] % steps_per_epoch != 0:  # epoch ends save later
                checkpoint()
        end_of_epoch(epoch + 1)
    return state
