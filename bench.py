"""Speed checks; a flag that the chosen check does not read is refused rather than ignored.

    python bench.py clip                      # our CLIP against OpenAI's model.py (fp32, CPU threads)
    python bench.py decode --beams 1 3 5      # greedy decoding with and without the key/value cache, and beam search
    python bench.py train --stage 1           # a training step at full ViT-B/32 size: pairs/s, FLOPs, MFU
    python bench.py train --stage 2 --data_root data/synth --fit_steps 300   # ... and the whole loop on real data
    python bench.py train --stage 1 --preset small --batch 48 --hard_negatives 0 6 --amp off --modes eager  # their cost
    python bench.py loader --data_root data/synth   # loader pairs/s by workers, from PNG files and the ImageStore

clip: the median times of encode_image and encode_text, ours and OpenAI's on the same random ViT-B/32 weights, inputs
and threads, timed alternately so that load from other processes slows both alike, and the ratio reference / ours
(above 1: ours is faster); needs requirements-dev.txt.
decode: the full-size captioner (3 + 3 layers, width 512), all 32 steps at every beam width on its random weights.
train: a step of adapt.py or caption.py (its batch of 16: 16 change + 16 distractor pairs) on random data on the
device, eager and compiled, fp32 and bf16; its FLOPs counted by torch.utils.flop_counter (matrix products and attention,
forward and backward) and MFU against a CUDA device's dense bf16 peak; with --data_root, also train.fit, loader and all.
"""
import argparse
import functools
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import flop_counter

import adapt
import caption
import cli
import clip_weights
import data
import image_store
import train
from model import SMALL_CLIP, CLIP4IDC, Captioner, CaptionerConfig, CLIP4IDCConfig, CLIPConfig
from tokenizer import EOT, tokenize

CAPTIONS = ["the small red metal cube has moved", "there is no change", "a photo of a cat.",
            "the large cyan rubber cylinder that was behind the sphere is missing",
            "someone added a yellow matte ball to the left of the purple block"]
BF16_PEAK = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, vendor datasheets
# The CPU's attention kernel, which torch's FLOP counter leaves out (it counts the GPU's), by the GPU's formulas
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *_, **__: flop_counter.sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *_, **__: flop_counter.sdpa_backward_flop_count(grad, q, k, v)}


def seconds(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# ---- clip, decode -------------------------------------------------------------------------------
def bench_clip(args):
    from tests.openai_reference import build, random_state_dict  # OpenAI's code: a development requirement
    sd = random_state_dict(CLIPConfig(), seed=0)
    with tempfile.TemporaryDirectory() as tmp:  # ours goes through the real loading path
        torch.save(sd, Path(tmp) / "vit_b32.pt")
        ours = clip_weights.load(Path(tmp) / "vit_b32.pt")
    ref = build(sd)
    torch.manual_seed(0)
    images = torch.randn(args.images, 3, 224, 224)
    tokens = tokenize([CAPTIONS[i % len(CAPTIONS)] for i in range(args.texts)])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, median of {args.repeats}")
    with torch.inference_mode():
        for name, x in (("encode_image", images), ("encode_text", tokens)):
            encoders = getattr(ours, name), getattr(ref, name)
            for encode in encoders:  # warm-up: allocator, thread pool and kernel selection
                encode(x)
            times = [[seconds(encode, x) for encode in encoders] for _ in range(args.repeats)]  # alternately
            t_ours, t_ref = map(statistics.median, zip(*times))
            print(f"{name:<12} {tuple(x.shape)!s:<18} ours {1e3 * t_ours:8.1f} ms   reference {1e3 * t_ref:8.1f} ms"
                  f"   ratio {t_ref / t_ours:.2f}")


def bench_decode(args):
    torch.manual_seed(0)
    captioner = Captioner(CLIP4IDC(CLIP4IDCConfig())).eval()
    # Random pair tokens stand in for the pair encoder's output: decoding cost does not depend on them.
    tokens = torch.randn(args.pairs, captioner.encoder.pair_pos.shape[0], captioner.encoder.config.clip.embed_dim)
    memories = captioner.encode_visual(tokens)
    greedy = [functools.partial(captioner.greedy, use_cache=use_cache) for use_cache in (True, False)]
    cached, recomputed = (decode(memories) for decode in greedy)
    times = [[seconds(decode, memories) for decode in greedy] for _ in range(args.repeats)]
    t_cache, t_full = map(statistics.median, zip(*times))
    print(f"greedy decoding, {args.pairs} pairs, {cached.shape[1] - 1} steps: cached {1e3 * t_cache:.1f} ms   "
          f"recomputed {1e3 * t_full:.1f} ms   speed-up {t_full / t_cache:.2f}   "
          f"identical captions: {torch.equal(cached, recomputed)}")
    for beam in args.beams or ():
        search = functools.partial(captioner.beam_search, beam=beam) if beam > 1 else captioner.greedy
        t = statistics.median(seconds(search, memories) for _ in range(args.repeats))
        print(f"beam {beam}: {1e3 * t / args.pairs:.2f} ms a pair")


# ---- train, loader ------------------------------------------------------------------------------
def stage_model(args, negatives=0):
    """The stage's model (--preset) and a random batch for it, in stage 1 with `negatives` hard negatives a pair."""
    clip, n_intra = (SMALL_CLIP, adapt.AdaptConfig().n_intra) if args.preset == "small" else (CLIPConfig(), 9)
    encoder = CLIP4IDC(CLIP4IDCConfig(clip=clip, n_intra=n_intra))
    size, b = clip.image_size, args.batch
    lengths = torch.randint(6, 20, (b * (2 if args.stage == 2 else 1 + negatives),))  # where EOT sits: CLEVR-Change-like
    words = range(1, 74) if args.preset == "small" else range(1, 40000)  # the offline captioner: 73 words + EOT
    ids = torch.randint(words.start, words.stop, (len(lengths), 32))
    ids[torch.arange(len(lengths)), lengths] = EOT
    ids[torch.arange(32) > lengths[:, None]] = 0
    pixels = torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8)
    if args.stage == 1:
        batch = pixels, torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8), ids[:b]
        return encoder, batch + ((ids[b:].view(b, negatives, 32),) if negatives else ())
    small = {k: getattr(caption.CaptionConfig(), k) for k in ("heads", "ffn", "dropout", "attn_dropout")}
    config = CaptionerConfig(**small, vocab=(*words, EOT)) if args.preset == "small" else CaptionerConfig()
    captioner = Captioner(encoder, config)
    return captioner, (pixels, torch.randint(0, 256, (b, 2, 3, size, size), dtype=torch.uint8), ids.view(b, 2, 32))


def step_flops(model, batch):
    """FLOPs of matrix products and attention in one eager fp32 forward and backward (any precision's alike)."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        model(*batch).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def step_rate(model, batch, device, amp, mode, steps):
    """Steps per second of forward + backward + AdamW update, after warm-up (and compilation)."""
    autocast, scaler = cli.mixed_precision(device, amp)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-7, fused=True)
    net = torch.compile(model, mode=mode) if mode != "eager" else model

    def run(n):
        for _ in range(n):
            if mode in ("reduce-overhead", "max-autotune"):  # CUDA graphs: the last step's outputs get overwritten
                torch.compiler.cudagraph_mark_step_begin()
            with autocast:
                loss = net(*batch)
            train.update(model, loss, optimizer, scaler, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize()

    run(3)
    return steps / seconds(run, steps)


def bench_train(args):
    device = cli.setup_device(args)  # TF32 matrix products on, as in the runs
    # train.fit's data first: a dataset it cannot read is told before the minutes of timing, not after them
    fit_data = train_pairs_and_store(args) if args.data_root else None
    for negatives in args.hard_negatives:
        torch.manual_seed(0)
        model, batch = stage_model(args, negatives)
        model, batch = model.to(device).train(), [t.to(device) for t in batch]
        flops, pairs = step_flops(model, batch), batch[1].shape[:-3].numel()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = args.peak_tflops * 1e12 if args.peak_tflops else next((v for k, v in BF16_PEAK.items() if k in name), None)
        print(f"stage {args.stage}, {args.preset}, batch {args.batch} ({pairs} pairs), {negatives} hard negatives a "
              f"pair, {flops / 1e12:.3g} TFLOP per step, on {name}, torch {torch.__version__}")
        for amp in args.amp:
            for mode in args.modes:
                rate = step_rate(model, batch, device, amp, mode, args.steps)
                mfu = f"   MFU {100 * flops * rate / peak:.1f}% of {peak / 1e12:.0f} TFLOP/s" if peak and amp == "bf16" else ""
                print(f"  {mode:<15} {amp:<4}  {rate * pairs:9.1f} pairs/s   {flops * rate / 1e12:7.3g} TFLOP/s{mfu}",
                      flush=True)
        if fit_data:
            fit_rate(args, device, *fit_data, negatives)


def fit_rate(args, device, pairs, size, store, negatives):
    """train.fit on real data, read through the runs' ImageStore, validation left out: the printed pairs/s."""
    torch.manual_seed(0)
    model = stage_model(args)[0].to(device)
    if args.stage == 1:
        rewrite = adapt.HardNegatives(pairs, negatives, adapt.KINDS, 32) if negatives else None
        config_cls, dataset = adapt.AdaptConfig, data.AdaptDataset(pairs, size, 32, 0, store, rewrite)
    else:
        config_cls, dataset = caption.CaptionConfig, data.CaptionDataset(pairs, size, 32, 0, store)
    dataset = Repeat(dataset, args.fit_steps * args.batch)  # one epoch: fit writes last.pt at each epoch's end
    with tempfile.TemporaryDirectory() as out:
        cfg = config_cls(data=args.data, out_dir=out, batch_size=args.batch, amp=args.amp[-1],
                         compile=args.modes[-1] != "eager", workers=args.workers, log_every=max(1, args.fit_steps // 5),
                         max_steps=args.fit_steps, save_every=10 ** 9, epochs=1)
        print(f"train.fit, {args.fit_steps} steps of {args.batch}, {cfg.amp}, compiled {cfg.compile}, workers "
              f"{data.loader_workers(cfg.workers, device)}{' (the first lines include compiling)' * cfg.compile}:")
        train.fit(cfg, model, dataset, lambda: (0.0, {}), model.new_parameter_names(), "cosine")


class Repeat(torch.utils.data.Dataset):
    def __init__(self, dataset, n):
        self.dataset, self.n = dataset, n

    def __len__(self):
        return self.n

    def __getitem__(self, key):
        return self.dataset[(key[0], key[1] % len(self.dataset))]


def train_pairs_and_store(args):
    """The training pairs, their image size, and the runs' own image store of all three splits (built once for both)."""
    splits = [data.read_split(args.data, args.data_root, split) for split in ("train", "val", "test")]
    size = SMALL_CLIP.image_size if args.preset == "small" else 224
    try:
        return splits[0], size, image_store.ImageStore([p for pairs in splits for p in pairs], size, args.data_root)
    except cli.InputError as e:
        if not str(e).endswith("pass --no-cache"):  # an unreadable image, say
            raise
        reason = str(e).rsplit(": ", 1)[0]  # less the advice, which is no way out here: this times the store
        raise cli.InputError(f"{reason}: bench.py times the store, so it must be written there") from None


def bench_loader(args):
    pairs, size, store = train_pairs_and_store(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for source, load in (("PNG files", None), ("ImageStore", store)):
        dataset = (data.AdaptDataset if args.stage == 1 else data.CaptionDataset)(pairs, size, 32, 0, load)
        if 2 * args.batch > len(dataset):  # the first batch starts the workers, untimed
            raise cli.InputError(f"--batch {args.batch}: expected at most half the {len(dataset)} training samples, "
                                  "for at least one timed batch")
        for workers in args.workers_list:
            sampler = data.EpochSampler(len(dataset), 0, args.batch)
            batches = iter(data.make_loader(dataset, args.batch, device, workers, sampler))
            next(batches)  # workers started
            start, n = time.perf_counter(), 0
            for batch in batches:
                n += batch[1].shape[:-3].numel()
                if time.perf_counter() - start > args.seconds:
                    break
            print(f"loader, stage {args.stage}, {size} px, {source:<10} {workers:2d} workers: "
                  f"{n / (time.perf_counter() - start):8.0f} pairs/s", flush=True)


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # metavar: without a usage block, an error names the choices, not the word "what"
    parser.add_argument("what", choices=("clip", "decode", "train", "loader"), metavar="{clip,decode,train,loader}",
                        help="the check to run, as described above")
    parser.add_argument("--images", type=int, default=4, help="clip: images per encode_image call")
    parser.add_argument("--texts", type=int, default=8, help="clip: texts per encode_text call")
    parser.add_argument("--repeats", type=int, default=5, help="clip, decode: timed repeats (median)")
    parser.add_argument("--pairs", type=int, default=64, help="decode: batch (64 in evaluation)")
    parser.add_argument("--beams", type=int, nargs="+", help="decode: also time beam search of these widths (1: greedy)")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=1,
                        help="train, loader: stage 1 (adapt.py's step) or 2 (caption.py's) (default: 1)")
    parser.add_argument("--preset", choices=("vit-b/32", "small"), default="vit-b/32",
                        help="train, loader: the paper's ViT-B/32 (default) or the offline default's small model")
    parser.add_argument("--batch", type=int, help="train, loader: batch (default: the stage's, 128 or 16)")
    parser.add_argument("--device", default="auto", help="train: auto, cpu, cuda or cuda:N")
    parser.add_argument("--amp", nargs="+", choices=("off", "bf16", "fp16"), help="train: precisions (default: off bf16)")
    parser.add_argument("--modes", nargs="+", default=["eager", "default"], help="train: eager, or torch.compile modes",
                        choices=("eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
    parser.add_argument("--steps", type=int, default=20, help="train: timed steps")
    parser.add_argument("--hard_negatives", type=int, nargs="+", default=[0],
                        help="train, stage 1: time the step with each of these numbers of hard negatives a pair")
    parser.add_argument("--peak_tflops", type=float, help="train: the device's dense bf16 peak, for MFU")
    parser.add_argument("--data", default="synth", choices=("synth", "clevr", "spot", "ier", "birds", "clevr_dc"),
                        help="train with --data_root, loader: the dataset's kind (default: synth)")
    parser.add_argument("--data_root", help="train: also time train.fit on this dataset; loader: the dataset")
    parser.add_argument("--fit_steps", type=int, default=200,
                        help="train with --data_root: steps of train.fit to time (default: 200)")
    parser.add_argument("--workers", type=int, default=-1, help="train: loader processes of train.fit")
    parser.add_argument("--workers_list", type=int, nargs="+", default=[1, 2, 4, 8], help="loader: worker counts (0: none)")
    parser.add_argument("--seconds", type=float, default=10, help="loader: time per measurement")
    args = parser.parse_args(argv)
    for name in ("images", "texts", "repeats", "pairs", "batch", "steps", "fit_steps", "seconds", "peak_tflops"):
        if (value := getattr(args, name)) is not None and not 0 < value < math.inf:
            parser.error(f"--{name} {value}: expected a finite value above 0")
        parser.require_64_bit(name, value)
    if not -1 <= args.workers <= data.MAX_WORKERS:
        parser.error(f"--workers {args.workers}: expected -1 (from the machine's cores) or 0 to {data.MAX_WORKERS}")
    if bad := [n for n in args.workers_list if not 0 <= n <= data.MAX_WORKERS]:
        parser.error(f"--workers_list {bad[0]}: expected worker counts of 0 to {data.MAX_WORKERS}")
    if bad := [n for n in args.hard_negatives if not 0 <= n <= 64]:
        parser.error(f"--hard_negatives {bad[0]}: expected 0 to 64 a pair")
    if args.stage == 2 and args.hard_negatives != [0]:
        parser.error("--hard_negatives has no use in stage 2: they are stage 1's extra captions")
    if bad := [n for n in args.beams or () if n < 1]:
        parser.error(f"--beams {bad[0]}: expected beam widths of 1 or more")
    if args.what == "loader" and not args.data_root:
        parser.error("loader times a dataset's loading: give its folder as --data_root")
    fit = ("data", "fit_steps", "workers")  # train reads them only to time train.fit on --data_root
    uses = {"clip": ("images", "texts", "repeats"), "decode": ("pairs", "repeats", "beams"),
            "train": ("stage", "preset", "batch", "device", "amp", "modes", "steps", "peak_tflops", "data_root", "hard_negatives",
                      *(fit if args.data_root else ())),
            "loader": ("stage", "preset", "batch", "data", "data_root", "workers_list", "seconds")}[args.what]
    if unused := [f for f in vars(args) if f not in ("what", *uses) and getattr(args, f) != parser.get_default(f)]:
        without = " without --data_root" if args.what == "train" and unused[0] in fit else ""
        parser.error(f"--{unused[0]} has no use in the {args.what} check{without}, which takes "
                     + ", ".join(f"--{f}" for f in uses))
    if args.data_root and not Path(args.data_root).is_dir():
        parser.error(f"--data_root {args.data_root}: expected a dataset folder")
    args.batch = args.batch or (128 if args.stage == 1 else 16)
    args.amp = args.amp or ["off", "bf16"]
    if args.peak_tflops and "bf16" not in args.amp:  # MFU is measured against the bf16 peak, under bf16 alone
        parser.error("--peak_tflops has no use without --amp bf16, the precision whose MFU it gives")
    {"clip": bench_clip, "decode": bench_decode, "train": bench_train, "loader": bench_loader}[args.what](args)


if __name__ == "__main__":
    cli.main(main)  # bad input, a full disk or Ctrl-C: one line
