"""Speed checks: our CLIP against OpenAI's model.py, and the captioner's key/value cache.

    python bench.py                  # fp32 on CPU, about a minute
    python bench.py --images 16 --texts 32 --repeats 9
    python bench.py --data_root data/synth --data synth

1. The median time of encode_image and encode_text for our CLIP and OpenAI's, on the same random
   ViT-B/32 weights, inputs and threads, and the ratio reference / ours (above 1: ours is faster).
   The two models are timed alternately, so load from other processes slows both alike. OpenAI's
   code comes from requirements-dev.txt.
2. Greedy decoding of 32 steps, 64 pairs at once, by the full-size captioner (3 + 3 layers, width 512), with the
   key/value cache and by recomputing the whole prefix at each step: both times, the speed-up,
   and whether the two give identical captions.
3. With --data_root DIR (e.g. data/synth): the image pairs per second one loader worker delivers
   (decode, resize, normalise both images) at 224 and 128 px, from the files and from an ImageCache.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import clip_weights
import data
from model import CLIP4IDC, CLIP4IDCConfig, Captioner, CLIPConfig
from tests.openai_reference import build, random_state_dict

CAPTIONS = ["the small red metal cube has moved", "there is no change", "a photo of a cat.",
            "the large cyan rubber cylinder that was behind the sphere is missing",
            "someone added a yellow matte ball to the left of the purple block"]


def seconds(fn, x):
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


def compare(name, ours, ref, x, repeats):
    for fn in (ours, ref):  # warmup: allocator, thread pool and kernel selection
        fn(x)
    times = {"ours": [], "reference": []}
    for _ in range(repeats):
        times["ours"].append(seconds(ours, x))
        times["reference"].append(seconds(ref, x))
    t_ours, t_ref = statistics.median(times["ours"]), statistics.median(times["reference"])
    print(f"{name:<12} {tuple(x.shape)!s:<18} ours {1e3 * t_ours:8.1f} ms   reference {1e3 * t_ref:8.1f} ms"
          f"   ratio {t_ref / t_ours:.2f}")


def decoding(pairs, repeats):
    torch.manual_seed(0)
    captioner = Captioner(CLIP4IDC(CLIP4IDCConfig())).eval()
    # Random pair tokens stand in for the pair encoder's output: decoding cost does not depend on them.
    tokens = torch.randn(pairs, captioner.encoder.pair_pos.shape[0], captioner.encoder.config.clip.embed_dim)
    memories = captioner.encode_visual(tokens)
    cached, recomputed = captioner.greedy(memories, 32, use_cache=True), captioner.greedy(memories, 32, use_cache=False)
    times = {True: [], False: []}
    for _ in range(repeats):
        for use_cache in (True, False):
            start = time.perf_counter()
            captioner.greedy(memories, 32, use_cache)
            times[use_cache].append(time.perf_counter() - start)
    t_cache, t_full = statistics.median(times[True]), statistics.median(times[False])
    print(f"greedy decoding, {pairs} pairs, {cached.shape[1] - 1} steps: cached {1e3 * t_cache:.1f} ms   "
          f"recomputed {1e3 * t_full:.1f} ms   speed-up {t_full / t_cache:.2f}   "
          f"identical captions: {torch.equal(cached, recomputed)}")


def loading(dataset, root, sizes=(224, 128), n=300):
    torch.set_num_threads(1)  # as in a DataLoader worker
    pairs = data.read_split(dataset, root, "train")[:n]
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            cache = data.ImageCache(pairs, size, Path(tmp) / "cache.pt")
            for name, load in (("from files", data.load_image), ("from ImageCache", cache)):
                start = time.perf_counter()
                for p in pairs:
                    load(p.before, size), load(p.after, size)
                print(f"loading {size} px {name}: {len(pairs) / (time.perf_counter() - start):.0f} pairs/s per worker")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=64, help="decoding batch (64 in evaluation)")
    parser.add_argument("--data_root", help="also time the image loading of this dataset folder")
    parser.add_argument("--data", default="synth", help="its dataset name, as data.read_split takes it")
    args = parser.parse_args()

    sd = random_state_dict(CLIPConfig(), seed=0)
    with tempfile.TemporaryDirectory() as tmp:  # ours goes through the real loading path
        torch.save(sd, Path(tmp) / "vit_b32.pt")
        ours = clip_weights.load(Path(tmp) / "vit_b32.pt")
    ref = build(sd)

    torch.manual_seed(0)
    images = torch.randn(args.images, 3, 224, 224)
    tokens = data.tokenize([CAPTIONS[i % len(CAPTIONS)] for i in range(args.texts)])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, median of {args.repeats}")
    with torch.inference_mode():
        compare("encode_image", ours.encode_image, ref.encode_image, images, args.repeats)
        compare("encode_text", ours.encode_text, ref.encode_text, tokens, args.repeats)
        decoding(args.pairs, args.repeats)
    if args.data_root:
        loading(args.data, args.data_root)


if __name__ == "__main__":
    main()
