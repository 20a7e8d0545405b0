"""Evaluation for CLIP4IDC: IP-T / T-IP retrieval (stage 1) and captions (stage 2) over a split, and their metrics
as Sec. 3.1 scores them: BLEU-1..4, METEOR, ROUGE-L and CIDEr-D of pycocoevalcap on PTB-tokenized captions, x100
(the tokenizer and METEOR run on Java), with CLEVR-Change's CIDEr by type. Its command line:

    python evaluate.py --predictions out/preds.json --data clevr --data_root data/clevr_change --out m.json
    python evaluate.py --ckpt out/caption-clevr/best.pt --data clevr --data_root data/clevr_change --split test --beam 3
    python evaluate.py --ckpt out/caption-synth/best.pt --pair before.png after.jpg --attention att.png
    python evaluate.py --ckpt out/caption-synth/best.pt --pairs pairs.txt --out captions.jsonl

A stage-1 checkpoint gives the retrieval table; --attention draws the class tokens' attention, as Figure 3.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

import cli
import clip_weights
import data
import figures
import synth
from cli import InputError
from data import CHANGE_TYPES, PAPER_TYPE_NAME
from model import Captioner
from tokenizer import EOT, get_tokenizer, tokenize

# ---- Retrieval: image pair -> text (IP-T) and text -> image pair (T-IP), Tables 6 and 7 ---------
RECALL_AT = (1, 5, 10, 20, 50)  # Table 7 and CLEVR-Change / IER in Table 6: 1, 5, 10; Spot-the-Diff: 10, 20, 50
EVAL_BATCH = 64
CAPTION_METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr")


@torch.no_grad()
def encode_split(model, pairs, device, store=None, amp="auto", workers=-1):
    """Pooled pair vectors v (Eq. 5) of every pair, caption vectors g of every reference caption,
    both normalised, and for each caption the index of its pair; under the training's autocast."""
    model.eval()
    autocast, _ = cli.mixed_precision(device, amp)
    loader = data.make_loader(data.EvalDataset(pairs, model.config.clip.image_size, store), EVAL_BATCH, device, workers)
    captions = [(i, c) for i, p in enumerate(pairs) for c in p.captions]
    tokens = tokenize([c for _, c in captions], model.config.context_length)
    with autocast:
        pair_vecs = [model.pool(model.encode_pair(b.to(device), a.to(device))).float() for _, b, a in loader]
        text_vecs = [model.encode_text(t.to(device)).float() for t in tokens.split(256)]
    text_pair = torch.tensor([i for i, _ in captions])
    text_id = torch.unique(tokens, dim=0, return_inverse=True)[1]  # tokens, not strings: what the model reads
    return F.normalize(torch.cat(pair_vecs), dim=-1), F.normalize(torch.cat(text_vecs), dim=-1), text_pair, text_id


def retrieval(model, pairs, device, store=None, amp="auto", workers=-1):
    """IP-T and T-IP retrieval over all reference captions (Tables 6 and 7), on the change pairs."""
    v, g, text_pair, text_id = encode_split(model, pairs, device, store, amp, workers)
    same = {}  # Image-Editing-Request's test repeats 46 image pairs under other uids, with other captions
    pair_id = [same.setdefault((p.before, p.after), len(same)) for p in pairs]
    return retrieval_metrics((v @ g.t()).cpu(), text_pair, text_id, pair_id)


def rank_summary(ranks, lower_median=False):
    """R@K (percent), median rank and mean rank of 1-based ranks. Of two middle ranks the median is
    their mean, or with `lower_median` the lower one, as torch.median takes it."""
    ranks = np.asarray(ranks)
    summary = {f"R@{k}": 100.0 * float(np.mean(ranks <= k)) for k in RECALL_AT}
    summary["MdR"] = float(np.sort(ranks)[(len(ranks) - 1) // 2] if lower_median else np.median(ranks))
    summary["MnR"] = float(np.mean(ranks))
    return summary


def retrieval_metrics(sim, text_pair, text_id=None, pair_id=None):
    """IP-T and T-IP scores from sim [n_pairs, n_texts] (tensor or array); text_pair[j] is the pair that caption j
    describes, captions of equal text_id[j] read the same, and pairs of equal pair_id[i] show the same two images,
    so are one to the model: neither competes with the other (default: all differ).

    T-IP ranks every caption's own pair among all pairs; its median rank is the lower middle one, as in the authors'
    code. IP-T, as the authors' code scores it, ranks each pair's best own caption against the best caption of every
    other pair: a pair has several correct captions and retrieving any of them is a hit, so is retrieving another
    pair's caption that reads the same as one of them."""
    sim = sim.detach().float().cpu().numpy() if hasattr(sim, "detach") else np.asarray(sim)
    text_pair = np.asarray(text_pair)
    text_id = np.unique(np.arange(len(text_pair)) if text_id is None else text_id, return_inverse=True)[1]  # 0, 1, ...
    n_pairs, n_texts = sim.shape
    pair_id = np.unique(np.arange(n_pairs) if pair_id is None else pair_id, return_inverse=True)[1]  # 0, 1, ...
    if text_pair.shape != (n_texts,) or text_pair.min() < 0 or text_pair.max() >= n_pairs:
        raise ValueError(f"text_pair must hold one pair index in [0, {n_pairs}) for each of the "
                         f"{n_texts} texts, got shape {text_pair.shape}")
    if text_id.shape != (n_texts,):
        raise ValueError(f"text_id must hold one id for each of the {n_texts} texts, got shape {text_id.shape}")
    if pair_id.shape != (n_pairs,):
        raise ValueError(f"pair_id must hold one id for each of the {n_pairs} pairs, got shape {pair_id.shape}")
    # A diverged model's NaNs would compare False everywhere and earn rank 1.
    if not np.isfinite(sim).all():
        raise InputError("the similarities hold NaN or inf: the pair encoder's weights are not finite (a training that "
                         "diverged)")
    uncaptioned = np.flatnonzero(np.bincount(text_pair, minlength=n_pairs) == 0)
    if len(uncaptioned):
        raise ValueError(f"pairs without any caption: {uncaptioned[:5].tolist()}")
    # Ties count against the model, else a constant score ranks first: rank = 1 + competitors scoring >= the true match.
    true_score = sim[text_pair, np.arange(n_texts)]
    images = pair_id[text_pair]  # each caption's two images: pairs of the same ones are one
    text_to_pair = 1 + ((sim >= true_score[None, :]) & (pair_id[:, None] != images[None, :])).sum(axis=0)
    # For pair -> text, every caption of the pair's images is its own, and another's caption of the same
    # words as one of them is no competitor: its vector is the same, and it is right for both.
    order, n_images = np.argsort(images, kind="stable"), pair_id.max() + 1
    owns = np.zeros((n_images, text_id.max() + 1), dtype=bool)  # owns[k, t]: image pair k has a caption t
    owns[images, text_id] = True
    hidden = owns[:, text_id[order]] & (np.arange(n_images)[:, None] != images[order])  # another's caption of k's words
    competing = np.where(hidden[pair_id], -np.inf, sim[:, order])
    starts = np.searchsorted(images[order], np.arange(n_images))
    best = np.maximum.reduceat(competing, starts, axis=1)  # best[i, k]: pair i and image pair k's closest caption
    pair_to_text = (best >= best[np.arange(n_pairs), pair_id][:, None]).sum(axis=1)
    return {"pair_to_text": rank_summary(pair_to_text), "text_to_pair": rank_summary(text_to_pair, lower_median=True)}


def format_retrieval(metrics):
    """The retrieval figures laid out like Table 7, with Table 6's R@20 and R@50: a row per direction."""
    columns = [f"R@{k}" for k in RECALL_AT] + ["MdR", "MnR"]
    rows = [f"{'':<20}" + "".join(f"{c:>8}" for c in columns)]
    for name, key in (("Image Pair => Text", "pair_to_text"), ("Text => Image Pair", "text_to_pair")):
        rows.append(f"{name:<20}" + "".join(f"{metrics[key][c]:>8.1f}" for c in columns))
    return "\n".join(rows)


# ---- Captioning: captions, BLEU, METEOR, ROUGE-L, CIDEr-D (Tables 1, 3, 4), CIDEr by type (Table 2)
def ids_to_text(ids):
    """Caption text of each generated row: the tokens between SOT and EOT."""
    bpe, rows = get_tokenizer(), [row[1:] for row in ids.tolist()]
    return [bpe.decode(row[:row.index(EOT)] if EOT in row else row) for row in rows]


@torch.no_grad()
def predict(captioner, items, device, store=None, amp="auto", workers=-1, progress=False, beam=1, length_penalty=1.0):
    """{item id: caption} of every item, greedy (beam 1) or by beam search, under the training's autocast."""
    captioner.eval()
    autocast, _ = cli.mixed_precision(device, amp)
    size = captioner.encoder.config.clip.image_size
    preds, start = {}, time.time()
    try:
        for index, before, after in data.make_loader(data.EvalDataset(items, size, store), EVAL_BATCH, device, workers):
            with autocast:
                ids = captioner.generate(before.to(device), after.to(device), beam=beam, length_penalty=length_penalty)
            preds.update((items[i].id, text) for i, text in zip(index.tolist(), ids_to_text(ids)))
            if progress:
                eta = cli.format_eta((len(items) - len(preds)) * (time.time() - start) / len(preds))
                print(f"\rcaptioned {len(preds)}/{len(items)} pairs, eta {eta}", end="", file=sys.stderr, flush=True)
    finally:
        if progress and preds:  # the progress line ends before what follows, an error too
            print(file=sys.stderr)
    return preds


def require_java():
    """Scoring captions runs Java: callers check once their inputs pass and before the work, so that
    bad input is named as such on any machine, and no run trains or predicts for nothing."""
    try:  # a `java` that only says there is none (macOS's, without a JDK) is refused too
        run = subprocess.run(["java", "-version"], capture_output=True, text=True, errors="replace")
        said = java_said(run.stderr) or f"exit status {run.returncode}"
        fault = f"`java -version` fails ({said})" if run.returncode else ""
    except OSError as e:
        fault = "`java` is not on PATH" if isinstance(e, FileNotFoundError) else f"`java` cannot run ({e})"
    if fault:
        raise InputError("scoring captions needs a Java runtime (METEOR and the PTB tokenizer of pycocoevalcap run in "
                         f"it), but {fault}: install one, e.g. `apt-get install default-jre-headless` (Debian/Ubuntu) "
                         "or `conda install openjdk`")


def java_said(output):
    """Java's own words from its output: the lines of a failure but not the stack trace under them."""
    return "; ".join(line.strip() for line in output.splitlines() if line.strip() and not line[0].isspace())[:300]


def id_mismatch(refs, preds):
    """How the ids of preds differ from those of refs, or "" where they match."""
    missing, extra = refs.keys() - preds.keys(), preds.keys() - refs.keys()
    return (f"{len(missing)} without a prediction (e.g. {sorted(map(str, missing))[:5]}), {len(extra)} "
            f"without references (e.g. {sorted(map(str, extra))[:5]})" if missing or extra else "")


def check_ids(refs, preds):
    """Scores are only comparable over the full split, so every reference needs a prediction."""
    if mismatch := id_mismatch(refs, preds):
        raise ValueError(f"prediction ids do not match the reference ids: {mismatch}")
    if empty := [k for k, captions in refs.items() if not captions]:
        raise ValueError(f"ids without reference captions: {sorted(map(str, empty))[:5]}")


def ptb_tokenize(refs, preds):
    """Lower-case, PTB-tokenize and strip punctuation, in one Java call for refs and preds alike.
    The tokenizer reads one caption a line: a line break inside one (a carriage return, U+2028, ...)
    would shift every later caption onto another pair's, so all whitespace becomes single spaces first."""
    require_java()
    captions = {("ref", k): [{"caption": " ".join(c.split())} for c in v] for k, v in refs.items()}
    captions.update({("pred", k): [{"caption": " ".join(c.split())}] for k, c in preds.items()})
    with tempfile.TemporaryFile() as stderr:  # Java writes why it failed there: it goes into our one line
        sys.stderr.flush()
        ours = os.dup(2)
        os.dup2(stderr.fileno(), 2)
        try:
            tokens = PTBTokenizer().tokenize(captions)
        finally:
            os.dup2(ours, 2)
            os.close(ours)
        if sum(map(len, tokens.values())) != sum(map(len, captions.values())):
            stderr.seek(0)
            said = java_said(stderr.read().decode(errors="replace")) or "it ended without a word"
            raise InputError(f"the PTB tokenizer of pycocoevalcap (run in Java) did not give back a line for each "
                             f"caption: {said}")
    return {k: tokens[("ref", k)] for k in refs}, {k: tokens[("pred", k)] for k in refs}


def meteor(gts, res):
    """pycocoevalcap's METEOR x100. Interrupted (Ctrl-C), its compute_score keeps a lock that the
    scorer's clean-up, which stops Java, would then wait on forever: the lock is let go here."""
    scorer = Meteor()
    try:
        return 100.0 * float(scorer.compute_score(gts, res)[0])
    except (ValueError, OSError):  # no score came, or its pipe closed: the Java program has ended
        scorer.meteor_p.kill()  # communicate() closes its pipes, a broken one too: the clean-up then skips them
        said = java_said(scorer.meteor_p.communicate()[1].decode(errors="replace")) or "it ended without a word"
        raise InputError(f"METEOR (pycocoevalcap's meteor-1.5.jar, run in Java) stopped: {said}") from None
    finally:
        if scorer.lock.locked():
            scorer.lock.release()


def caption_metrics(refs, preds, only=CAPTION_METRICS):
    """BLEU-1..4, METEOR, ROUGE-L and CIDEr (CIDEr-D) x100 of preds {id: caption} against
    refs {id: [captions]}. `only` picks a subset, e.g. ("CIDEr",) skips METEOR's slow Java start."""
    if unknown := set(only) - set(CAPTION_METRICS):
        raise ValueError(f"unknown metrics {sorted(unknown)}; choose from {CAPTION_METRICS}")
    check_ids(refs, preds)
    gts, res = ptb_tokenize(refs, preds)
    metrics = {}
    if any(m.startswith("BLEU") for m in only):
        bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        metrics |= {f"BLEU-{n}": 100.0 * float(b) for n, b in enumerate(bleu, start=1)}
    if "METEOR" in only:
        metrics["METEOR"] = meteor(gts, res)
    if "ROUGE-L" in only:
        metrics["ROUGE-L"] = 100.0 * float(Rouge().compute_score(gts, res)[0])
    if "CIDEr" in only:
        metrics["CIDEr"] = 100.0 * float(Cider().compute_score(gts, res)[0])
    return {m: v for m, v in metrics.items() if m in only}


def per_type_cider(refs, preds, types):
    """CIDEr x100 on each CLEVR-Change change type (Table 2), keyed by the paper's type names; types {id: change type}
    may leave ids out. Each type is a corpus of its own, as in CLEVR-Change's evaluation: CIDEr's document
    frequencies come from that type's references only."""
    check_ids(refs, preds)
    ids_of = {t: [] for t in CHANGE_TYPES}
    for k, t in types.items():
        t = PAPER_TYPE_NAME.get(t, t)
        if t not in ids_of or k not in refs:
            raise ValueError(f"id {k!r} of change type {t!r}: the id must have references and the "
                             f"type be one of {CHANGE_TYPES}")
        ids_of[t].append(k)
    gts, res = ptb_tokenize(refs, preds)
    return {t: 100.0 * float(Cider().compute_score({k: gts[k] for k in ids}, {k: res[k] for k in ids})[0])
            for t, ids in ids_of.items() if ids}


def score_items(items, preds):
    """caption_metrics of preds on data.eval_items(...), with CIDEr by change type where the items have types."""
    refs = {item.id: list(item.captions) for item in items}
    metrics = caption_metrics(refs, preds)
    if types := {item.id: item.change_type for item in items if item.change_type}:
        metrics["per_type"] = per_type_cider(refs, preds, types)
    if any(item.scene for item in items):  # the synthetic data: what the captions say, against the scene graphs
        metrics["grades"] = synth.grade(items, preds)
    return metrics


def format_table(metrics):
    """Caption metrics as in Table 1 (B = BLEU-4, M, C, R), and Table 2's CIDEr by type and the grades if present."""
    columns = {"B": "BLEU-4", "M": "METEOR", "C": "CIDEr", "R": "ROUGE-L"}
    lines = ["".join(f"{c:>8}" for c in columns), "".join(f"{metrics[m]:>8.1f}" for m in columns.values())]
    if per_type := metrics.get("per_type"):
        lines += ["", "CIDEr by change type", "".join(f"{h:>8}" for h in ("C", "T", "M", "A", "D", "DI")),
                  "".join(f"{per_type[t]:>8.1f}" if t in per_type else f"{'-':>8}" for t in CHANGE_TYPES)]
    if grades := metrics.get("grades"):
        said = {"change": "name the change", "shape": "the changed object's shape",
                "move": "moved objects said to move", "distractor": "distractors said unchanged"}
        lines += ["", "Graded against the scene graphs (% of captions): " + ", ".join(
            f"{what} {grades[k]:.1f}" for k, what in said.items() if grades[k] is not None)]
    return "\n".join(lines)


# ---- Prediction files (COCO results format), a checkpoint over a split, and the command line ----
def write_predictions(path, preds):
    cli.write_file(path, json.dumps([{"image_id": k, "caption": c} for k, c in preds.items()], indent=1))


def read_predictions(path):
    """{image_id: caption} of a COCO results file; what is not one is named with its first bad entry."""
    text = cli.read_text(path, "a COCO results json")
    try:
        results = json.loads(text)
    except (ValueError, RecursionError) as e:  # malformed; or an integer of over 4,300 digits, arrays nested deep
        raise InputError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(results, list):
        raise InputError(f'{path}: expected a list of {{"image_id", "caption"}} objects, not a '
                         f'{type(results).__name__}')
    preds = {}
    for n, r in enumerate(results):
        if not (isinstance(r, dict) and type(r.get("image_id")) in (str, int) and isinstance(r.get("caption"), str)):
            raise InputError(f"{path}: entry {n} is not an object with an image_id and a caption string: "
                             f"{json.dumps(r):.80}")
        data.caption_list([r["caption"]], path, f"entry {n}")  # a lone surrogate (valid JSON) breaks the scorers
        image_id = str(r["image_id"])  # ids are strings here; IER's uids are numbers in its own files
        if image_id in preds:
            raise InputError(f"{path}: more than one caption for image_id {r['image_id']!r}")
        preds[image_id] = r["caption"]
    return preds


def blind_baseline(train_pairs, items):
    """Ignore the images: write the most frequent training caption for every pair."""
    caption = Counter(c for p in train_pairs for c in p.captions + p.distractor_captions).most_common(1)[0][0]
    return {item.id: caption for item in items}


def score_captions(captioner, items, train_pairs, split, device, store=None, amp="auto", workers=-1, beam=1,
                   length_penalty=1.0):
    """Captions of a split's items (see predict) and their metrics, beside a blind baseline's; printed as in
    Tables 1 and 2, and recorded with how they were decoded."""
    preds = predict(captioner, items, device, store, amp, workers, progress=True, beam=beam,
                    length_penalty=length_penalty)
    results = {split: score_items(items, preds),
               "blind_baseline": {split: score_items(items, blind_baseline(train_pairs, items))},
               "decoding": {"beam": beam, "length_penalty": length_penalty}}
    decoding = "greedy" if beam == 1 else f"beam search, beam {beam}, length penalty {length_penalty:g}"
    print(f"{split} split, this model ({decoding}):\n{format_table(results[split])}")
    print(f"{split} split, blind baseline (most frequent training caption for every pair):\n"
          f"{format_table(results['blind_baseline'][split])}")
    return preds, results


def save_results(out, results, split=None, preds=None):
    cli.write_file(Path(out) / "metrics.json", json.dumps(results, indent=2))
    if preds is not None:
        write_predictions(Path(out) / f"{split}_predictions.json", preds)
    print(f"wrote {out}/metrics.json" + (f" and {out}/{split}_predictions.json" if preds is not None else ""))


def load_model(args, device):
    """--ckpt's model; args.amp, unless given, the --amp its run was scored under ("auto" for the authors'). The
    authors' files do not record the layer split or the captioner's heads: --n_intra and --heads give them
    (their released models: 9 and 8); ours do, and a flag that disagrees with the file is an error."""
    model = clip_weights.load_checkpoint(args.ckpt, device, 9 if args.n_intra is None else args.n_intra,
                                         8 if args.heads is None else args.heads)
    config = clip_weights.read_checkpoint(args.ckpt, mmap=True).get("config")  # ours; the authors' files have none
    args.amp = args.amp or (config.get("amp", "auto") if isinstance(config, dict) else "auto")  # else other captions
    encoder = model.encoder if isinstance(model, Captioner) else model
    held = dict(n_intra=encoder.config.n_intra, heads=model.config.heads if isinstance(model, Captioner) else None)
    for flag, value in held.items():
        given = getattr(args, flag)
        if given is not None and value is None:
            raise InputError(f"--heads {given}: {args.ckpt} holds a stage-1 pair encoder, which has no captioner heads")
        if given not in (None, value):
            raise InputError(f"--{flag} {given}: {args.ckpt} records its own {flag}, {value} (the flag is for the "
                             "authors' files, which do not)")
    return model


def score_checkpoint(args, device):
    """A checkpoint over a split: a captioner's metrics (Tables 1-4), a pair encoder's retrieval (Table 7)."""
    model = load_model(args, device)
    if args.beam > 1 and not isinstance(model, Captioner):
        raise InputError(f"--beam {args.beam}: {args.ckpt} holds a stage-1 pair encoder, which writes no captions")
    written = ["metrics.json"] + [f"{args.split}_predictions.json"] * isinstance(model, Captioner)
    cli.check_outputs([("--out_dir", Path(args.out_dir) / name) for name in written if args.out_dir], args.overwrite)
    pairs = data.read_split(args.data, args.data_root, args.split)
    if isinstance(model, Captioner):
        train_pairs = data.read_split(args.data, args.data_root, "train", images=False)  # the blind baseline's captions
        require_java()
        preds, results = score_captions(model, data.eval_items(pairs), train_pairs, args.split, device, amp=args.amp,
                                        beam=args.beam, length_penalty=args.length_penalty)
    else:
        preds, results = None, {args.split: retrieval(model, pairs, device, amp=args.amp)}
        print(f"{args.data} {args.split}: {len(pairs)} image pairs\n{format_retrieval(results[args.split])}")
    if args.out_dir:
        save_results(args.out_dir, results, args.split, preds)


def score_predictions(args):
    items = data.eval_items(data.read_split(args.data, args.data_root, args.split, images=False))  # text only
    preds = read_predictions(args.predictions)
    if mismatch := id_mismatch({item.id: item.captions for item in items}, preds):
        raise InputError(f"{args.predictions}: its ids are not those of the {args.split} split of {args.data_root}: "
                         f"{mismatch}; expected one caption for each of its {len(items)} ids")
    require_java()
    metrics = score_items(items, preds)
    print(f"{args.data} {args.split}: {len(items)} image pairs\n{format_table(metrics)}")
    if args.out:
        cli.write_file(args.out, json.dumps({args.split: metrics}, indent=2))


def caption_pairs(captioner, args, device):
    """One JSON object a line, to --out or the standard output."""
    pairs = data.read_pair_list(args.pairs)
    items = [data.Pair(str(n), before, after, []) for n, (before, after) in enumerate(pairs)]
    preds = predict(captioner, items, device, amp=args.amp, workers=0, progress=True, beam=args.beam,
                    length_penalty=args.length_penalty)
    lines = [json.dumps({"before": str(p.before), "after": str(p.after), "caption": preds[p.id]}) for p in items]
    if args.out:
        cli.write_file(args.out, "\n".join(lines) + "\n")
        if cli.standard_stream(args.out) is not sys.stdout:  # else it would end the captions' JSON lines
            print(f"wrote {len(lines)} captions to {args.out}")
    else:
        print("\n".join(lines))


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--predictions", help='score this COCO results json: [{"image_id", "caption"}, ...]')
    parser.add_argument("--ckpt", help="run this checkpoint: best.pt or last.pt of adapt.py or caption.py, "
                        "or the authors' pytorch_model.bin.*")
    parser.add_argument("--data", choices=(*data.SOURCES, "synth"), help="with --data_root (default: clevr)")
    parser.add_argument("--data_root", help="dataset folder: score --predictions, or --ckpt over --split")
    parser.add_argument("--split", help="with --data_root: the split to score (default: test)")
    parser.add_argument("--pair", nargs=2, metavar=("BEFORE", "AFTER"), help="with --ckpt: caption these two images")
    parser.add_argument("--attention", metavar="PNG", help="with --pair: also save the attention figure here")
    parser.add_argument("--pairs", metavar="TXT", help="with --ckpt: caption the two image paths of each line")
    parser.add_argument("--out", help="write here the metrics json (--predictions) or the captions (--pairs)")
    parser.add_argument("--out_dir", help="with --ckpt --data_root: write metrics.json, <split>_predictions.json here")
    parser.add_argument("--overwrite", action="store_true", help="replace existing --out, --out_dir, --attention files")
    parser.add_argument("--device", help="with --ckpt: auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--amp", choices=("auto", "bf16", "fp16", "off"), help="with --ckpt: autocast (default: the "
                        "--amp its run recorded, auto for the authors' files; auto is off on a CPU)")
    parser.add_argument("--n_intra", type=int, help="with an authors' --ckpt: layers that see one image (default: 9)")
    parser.add_argument("--heads", type=int, help="with an authors' stage-2 --ckpt: the captioner's heads (default: 8)")
    parser.add_argument("--beam", type=int, help="with a stage-2 --ckpt: the beam search's width (default: 1, greedy)")
    parser.add_argument("--length_penalty", type=float, help="with --beam above 1: captions score their sum of log "
                        "probabilities / length ** this, length: the tokens after SOT, EOT included (default: 1.0)")
    args = parser.parse_args(argv)

    modes = [f"--{name}" for name in ("predictions", "pair", "pairs") if getattr(args, name)]
    if args.ckpt and args.data_root and not (args.pair or args.pairs):
        modes.append("--ckpt --data_root")
    if len(modes) != 1 or (args.predictions is None) == (args.ckpt is None):
        parser.error("give --predictions with --data_root, or --ckpt with one of --pair, --pairs, --data_root")
    if args.predictions and not args.data_root:
        parser.error("--predictions needs --data_root, the dataset it scores against")
    ckpt = ("device", "amp", "n_intra", "heads", "beam", "length_penalty")
    takes = {"--predictions": ("data", "data_root", "split", "out"), "--pair": ("attention", *ckpt),
             "--pairs": ("out", *ckpt), "--ckpt --data_root": ("data", "data_root", "split", "out_dir", *ckpt)}
    for flag in ("data", "data_root", "split", "out", "out_dir", "attention", *ckpt):
        if getattr(args, flag) is not None and flag not in takes[modes[0]]:
            raise InputError(f"--{flag} has no use with {modes[0]}, which takes "
                             + ", ".join(f"--{f}" for f in takes[modes[0]]))
    if args.beam is not None and args.beam < 1:
        parser.error(f"--beam {args.beam}: expected a value >= 1")
    if args.length_penalty is not None and not 0 <= args.length_penalty < math.inf:
        parser.error(f"--length_penalty {args.length_penalty}: expected a finite value >= 0")
    if args.length_penalty is not None and (args.beam or 1) == 1:
        parser.error(f"--length_penalty {args.length_penalty}: read only with --beam above 1 (greedy decoding weighs "
                     "no lengths)")
    defaults = dict(data="clevr", split="test", device="auto", beam=1, length_penalty=1.0)
    vars(args).update({k: v for k, v in defaults.items() if getattr(args, k) is None})
    if args.attention and not figures.pillow_writes(args.attention):
        parser.error(f"--attention {args.attention}: expected the name of an image file Pillow writes, such as "
                     "attention.png")
    cli.check_outputs([("--out", args.out), ("--attention", args.attention)], args.overwrite)
    if absent := [p for p in args.pair or () if not Path(p).is_file()]:
        parser.error(f"--pair: {absent[0]} is not a file; expected the two images, before and after")
    if args.predictions:
        return score_predictions(args)
    device = cli.setup_device(args)
    if args.data_root:
        return score_checkpoint(args, device)
    captioner = load_model(args, device)
    if not isinstance(captioner, Captioner):
        parser.error(f"{args.ckpt} holds a stage-1 pair encoder: captions need a stage-2 checkpoint "
                     "(caption.py's best.pt, or the authors' trained pytorch_model.bin)")
    if args.pairs:
        return caption_pairs(captioner, args, device)
    before, after = (data.read_pixels(p, captioner.encoder.config.clip.image_size)[None].to(device) for p in args.pair)
    with cli.mixed_precision(device, args.amp)[0]:
        print(ids_to_text(captioner.generate(before, after, beam=args.beam, length_penalty=args.length_penalty))[0])
    if args.attention:
        cli.write_file(args.attention, figures.attention_file(captioner, before, after, args.pair, args.attention))
        print(f"wrote {args.attention}")


if __name__ == "__main__":
    cli.main(main)
