"""A synthetic CLEVR-Change for offline runs: scenes of 3-6 objects drawn with Pillow, one of five
changes (color, material, add, drop, move) per pair, a distractor of the before scene under another
viewpoint and light, and captions in CLEVR-Change's style, written in CLEVR-Change's layout
(data.read_split reads it as "synth"), with the scene graphs the images were drawn from in scenes.json.

    python synth.py --out data/synth --pairs 5600 --seed 0
"""
import contextlib
import functools
import json
import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

import cli
from cli import DISK_ERRNOS, ArgumentParser, InputError, check_writable, new_folders, scratch, worker_pool
from data import cores, read_json

log = logging.getLogger("synth")

PAIRS = 5600  # the offline default: train 5,200, val 200, test 200 (docs/offline-default.md says why so many)
MIN_PAIRS = 10  # a tenth of them for val and a tenth for test: at least one pair each
W, H, Y_FAR, Y_NEAR = 480, 320, 80, 290  # image size; ground rows of the farthest and nearest objects
COLORS = {"gray": (87, 87, 87), "red": (173, 35, 35), "blue": (42, 75, 215), "green": (29, 105, 20),
          "brown": (129, 74, 25), "purple": (129, 38, 192), "cyan": (41, 208, 208), "yellow": (255, 238, 51)}
SHAPES, MATERIALS, SIZES = ("cube", "sphere", "cylinder"), ("rubber", "metal"), {"small": 18, "large": 30}
CHANGES = ("color", "material", "add", "drop", "move")
SAME_CAMERA = {"dx": 0.0, "dy": 0.0, "zoom": 1.0, "light": 1.0}
WORDS = {"small": ("small", "tiny"), "large": ("large", "big"), "rubber": ("rubber", "matte"),
         "metal": ("metal", "metallic", "shiny"), "sphere": ("sphere", "ball"), "cube": ("cube", "block"),
         "cylinder": ("cylinder",)}
BECAME = ("the {o} changed to {new}", "the {o} turned {new}", "the {o} became {new}", "the {o} is now {new}")
TEMPLATES = {"color": BECAME + ("the {o} was painted {new}",), "material": BECAME,
             "add": ("a {o} has been added", "someone added a {o}", "a {o} appeared", "there is a new {o}",
                     "a {o} has appeared"),
             "drop": ("the {o} has disappeared", "the {o} is missing", "the {o} is gone", "someone removed the {o}"),
             "move": ("the {o} changed its location", "the {o} has been moved", "the {o} is in a different location",
                      "the {o} moved", "someone moved the {o}")}
NO_CHANGE = ("the scene remains the same", "nothing has changed", "no change was made", "the two scenes seem identical",
             "there is no difference", "no change has occurred", "the scene is the same as before",
             "nothing was modified")


def radius(obj):
    return SIZES[obj["size"]] * (0.9 + 0.25 * (obj["y"] - Y_FAR) / (Y_NEAR - Y_FAR))  # mild perspective


def place(obj, others, rng, away_from=None):
    """Put `obj` on a free spot of the floor (at least 80 px from `away_from`); False if none was found."""
    for _ in range(200):
        obj["x"], obj["y"] = round(rng.uniform(60, 420), 1), round(rng.uniform(Y_FAR, Y_NEAR), 1)
        x, y, r = obj["x"], obj["y"] - radius(obj), radius(obj)  # the body's disc, centred a radius above the floor
        free = all(np.hypot(x - o["x"], y - o["y"] + radius(o)) > r + radius(o) + 8 for o in others)
        if free and (away_from is None or np.hypot(obj["x"] - away_from[0], obj["y"] - away_from[1]) > 80):
            return True
    return False


def new_object(rng):
    return {"shape": rng.choice(SHAPES), "color": rng.choice(list(COLORS)), "material": rng.choice(MATERIALS),
            "size": rng.choice(list(SIZES))}


def make_scene(rng):
    """3 to 6 objects, drawn again from the first where one finds no free spot."""
    while True:
        n, objects = rng.randint(3, 6), []
        while len(objects) < n and place(obj := new_object(rng), objects, rng):
            objects.append(obj)
        if len(objects) == n:
            return objects


def change_scene(objects, kind, rng):
    """(after, the changed object before and after the change), or None where the change does not fit."""
    after = [dict(o) for o in objects]
    if kind == "add":
        obj = new_object(rng)
        return (after + [obj], None, obj) if place(obj, after, rng) else None
    i = rng.randrange(len(after))
    obj = after[i]
    if kind == "drop":
        return after[:i] + after[i + 1:], objects[i], None
    if kind == "color":
        obj["color"] = rng.choice([c for c in COLORS if c != obj["color"]])
    elif kind == "material":
        obj["material"] = "metal" if obj["material"] == "rubber" else "rubber"
    elif not place(obj, after[:i] + after[i + 1:], rng, away_from=(obj["x"], obj["y"])):
        return None
    return after, objects[i], obj


def project(obj, cam):
    """Ground point and radius of `obj` in the image, after the camera's shift and zoom about the centre."""
    zoom = cam["zoom"]
    x, y = W / 2 + (obj["x"] - W / 2) * zoom + cam["dx"], H / 2 + (obj["y"] - H / 2) * zoom + cam["dy"]
    return x, y, radius(obj) * zoom


def draw_object(draw, obj, cam):
    x, y, r = project(obj, cam)
    lo, hi = (0.3, 1.6) if obj["material"] == "metal" else (0.55, 1.15)  # metal: harder light and dark

    def tone(k, white=0.0):  # the object's colour under light k, mixed with a `white` share of specular light
        return tuple(int(min(255, (c * k * (1 - white) + 255 * white) * cam["light"])) for c in COLORS[obj["color"]])

    if obj["shape"] == "sphere":  # concentric discs drifting towards the light at the upper left
        for t in np.linspace(0, 1, 9):
            cx, cy, rr = x - 0.4 * r * t, y - r - 0.4 * r * t, r * (1 - 0.85 * t)
            draw.ellipse([cx - rr, cy - rr, cx + rr, cy + rr], fill=tone(lo + (hi - lo) * t ** 1.5))
    elif obj["shape"] == "cube":  # front, top and side faces in an oblique view
        s, d = 1.45 * r, 0.4 * r
        x0 = x - (s + d) / 2
        draw.polygon([(x0, y), (x0 + s, y), (x0 + s, y - s), (x0, y - s)], fill=tone((lo + hi) / 2))
        draw.polygon([(x0, y - s), (x0 + s, y - s), (x0 + s + d, y - s - d), (x0 + d, y - s - d)], fill=tone(hi))
        draw.polygon([(x0 + s, y), (x0 + s + d, y - d), (x0 + s + d, y - s - d), (x0 + s, y - s)], fill=tone(lo))
    else:  # cylinder: vertical strips, brightest towards the light, between a dark base and a lit top
        rc, h, e = 0.85 * r, 1.5 * r, 0.3 * r
        draw.ellipse([x - rc, y - e, x + rc, y + e], fill=tone(lo))
        for j, t in enumerate(np.linspace(0, 1, 10)):
            draw.rectangle([x - rc + 0.2 * rc * j, y - h, x - rc + 0.2 * rc * (j + 1), y],
                           fill=tone(hi - (hi - lo) * abs(t - 0.3) / 0.7))
        draw.ellipse([x - rc, y - h - e, x + rc, y - h + e], fill=tone(hi))
    if obj["material"] == "metal":  # a specular highlight
        hx, hy = (x - 0.45 * r, y - 1.45 * r) if obj["shape"] == "sphere" else (x - 0.35 * r, y - 1.6 * r)
        draw.ellipse([hx - 0.2 * r, hy - 0.12 * r, hx + 0.2 * r, hy + 0.12 * r], fill=tone(1, white=0.85))


def render(objects, cam=SAME_CAMERA):
    floor = (np.linspace(178, 122, H) * cam["light"]).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(np.ascontiguousarray(np.broadcast_to(floor[:, None, None], (H, W, 3))))
    draw = ImageDraw.Draw(image)
    objects = sorted(objects, key=lambda o: o["y"])  # far to near, so nearer objects occlude
    for x, y, r in (project(o, cam) for o in objects):  # contact shadows, cast away from the light
        shadow = int(floor[min(int(y), H - 1)] * 0.7)
        draw.ellipse([x - 0.8 * r, y - 0.35 * r, x + 1.4 * r, y + 0.35 * r], fill=(shadow,) * 3)
    for o in objects:
        draw_object(draw, o, cam)
    return image


def describe(obj, scene, rng):
    """A noun phrase for `obj`, sometimes with a spatial relation to another object of `scene`."""
    words = [rng.choice(WORDS[obj["size"]]), obj["color"]]
    if rng.random() < 0.5:
        words.append(rng.choice(WORDS[obj["material"]]))
    words.append(rng.choice(WORDS[obj["shape"]]) if rng.random() < 0.8 else rng.choice(("thing", "object")))
    others = [o for o in scene if (o["x"], o["y"]) != (obj["x"], obj["y"])]
    if others and rng.random() < 0.3:
        other = rng.choice(others)
        dx, dy = obj["x"] - other["x"], obj["y"] - other["y"]
        where = ("left of" if dx < 0 else "right of") if abs(dx) > abs(dy) else ("in front of" if dy > 0 else "behind")
        words += ["that is", where, "the", describe(other, [], rng)]
    return " ".join(words)


def random_camera(rng):
    """A distractor's viewpoint and light: a shift, a zoom, and 8-20% darker or brighter."""
    return {"dx": round(rng.uniform(-10, 10), 1), "dy": round(rng.uniform(-6, 6), 1),
            "zoom": round(rng.uniform(0.94, 1.06), 3),
            "light": round(1 + rng.choice((-1, 1)) * rng.uniform(0.08, 0.2), 3)}


def synth_pair(i, seed):
    """The scene graphs, 5 change captions and 5 no-change captions of pair `i`, fixed by (seed, i)."""
    rng = random.Random(f"synth:{seed}:{i}")
    kind, change = CHANGES[i % len(CHANGES)], None  # types cycle, so every split is balanced
    while change is None:
        before = make_scene(rng)
        change = change_scene(before, kind, rng)
    after, old, new = change
    scene = {"change_type": kind, "before": before, "after": after, "distractor_camera": random_camera(rng)}
    subject, objects = (new, after) if kind == "add" else (old, before)
    captions = {}  # a dict keeps the drawing order, so the output is deterministic
    while len(captions) < 5:
        value = new["color"] if kind == "color" else rng.choice(WORDS[new["material"]]) if kind == "material" else ""
        captions[rng.choice(TEMPLATES[kind]).format(o=describe(subject, objects, rng), new=value)] = None
    return scene, list(captions), rng.sample(NO_CHANGE, 5)


def draw_pair(i, seed, folder):
    """Draw pair `i` into `folder`'s three image folders; its file name, scene graphs and captions."""
    scene, captions, no_change = synth_pair(i, seed)
    name = f"{i:06d}.png"
    for sub, prefix, objects, camera in (("images", "default", scene["before"], SAME_CAMERA),
                                         ("sc_images", "semantic", scene["after"], SAME_CAMERA),
                                         ("nsc_images", "nonsemantic", scene["before"], scene["distractor_camera"])):
        render(objects, camera).save(folder / sub / f"CLEVR_{prefix}_{name}", compress_level=1)
    return name, scene, captions, no_change


def write_synth(out, n_pairs, seed, workers=None):
    """`n_pairs` pairs in `out`, drawn by `workers` processes (default: one per core, for large sets only)."""
    if n_pairs < MIN_PAIRS:
        raise InputError(f"--pairs {n_pairs}: expected at least {MIN_PAIRS}, for non-empty val and test splits")
    files = {"change_captions": {}, "no_change_captions": {}, "type_mapping": {k: [] for k in CHANGES}, "scenes": {}}
    with drawn_whole(out, "the synthetic dataset") as tmp:
        for folder in ("images", "sc_images", "nsc_images"):
            (tmp / folder).mkdir(parents=True)
        with worker_pool(workers or min(cores(), 1 + n_pairs // 500)) as pool:
            for name, scene, captions, no_change in pool.imap(functools.partial(draw_pair, seed=seed, folder=tmp),
                                                               range(n_pairs), chunksize=25):
                files["change_captions"][f"CLEVR_default_{name}"] = captions
                files["no_change_captions"][f"CLEVR_default_{name}"] = no_change
                files["type_mapping"][scene["change_type"]].append(name)
                files["scenes"][name] = scene
        n_eval = min(200, n_pairs // 10)
        ends = (0, n_pairs - 2 * n_eval, n_pairs - n_eval, n_pairs)
        files["splits"] = {split: list(range(a, b)) for split, a, b in zip(("train", "val", "test"), ends, ends[1:])}
        for name, content in files.items():
            (tmp / f"{name}.json").write_text(json.dumps(content))


@contextlib.contextmanager
def drawn_whole(out, what):
    """A scratch folder for the block to draw `what` into, renamed `out` once whole: a killed or failed drawing
    leaves no dataset behind, nor the parents made for it."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new folder for {what}")
    with new_folders(out.parent):
        tmp = scratch(out, "partial")
        try:
            yield tmp
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in DISK_ERRNOS:  # a full disk: name the folder, as PIL's may not
                raise OSError(e.errno, e.strerror, str(out)) from None
            raise
        try:
            tmp.rename(out)
        except OSError:  # another process wrote the same dataset first
            shutil.rmtree(tmp)
            if not out.is_dir():
                raise


# ---- Single scenes, for pretraining a CLIP (pretrain.py) -----------------------------------------
def scene(i, seed):
    """Scene `i` of pretrain.py's single scenes, fixed by (seed, i): objects, and a camera and light that
    vary as the distractors' do for half of them. Their random stream is not the IDC pairs' (synth_pair)."""
    rng = random.Random(f"scene:{seed}:{i}")
    return {"objects": make_scene(rng), "camera": random_camera(rng) if rng.random() < 0.5 else SAME_CAMERA}


def draw_scene(i, seed, folder):
    graph = scene(i, seed)
    render(graph["objects"], graph["camera"]).save(folder / f"scene_{i:06d}.png", compress_level=1)
    return graph


def write_scenes(out, n, seed=0):
    """`n` single scenes as out/scene_%06d.png, and their graphs in out/scenes.json, on every core."""
    with drawn_whole(out, "the scenes") as tmp:
        tmp.mkdir(parents=True)
        with worker_pool(min(cores(), 1 + n // 500)) as pool:
            graphs = list(pool.imap(functools.partial(draw_scene, seed=seed, folder=tmp), range(n), chunksize=25))
        (tmp / "scenes.json").write_text(json.dumps(graphs))


# ---- Captions graded against the scene graph ----------------------------------------------------
SAYS = {"move": ("moved", "location"), "add": ("added", "appeared", "new"), "drop": ("disappeared", "missing", "gone",
        "removed"), "color": ("changed to", "turned", "became", "is now", "painted")}
SHAPE_OF = {word: shape for shape in SHAPES for word in WORDS[shape]}


def changed_object(scene):
    """(the object a pair's change is about, as before the change, or as added; the same after the change)."""
    before, after = scene["before"], scene["after"]
    if scene["change_type"] == "add":
        return None, after[-1]
    if scene["change_type"] == "drop":
        return next(o for o in before if o not in after), None
    return next((b, a) for b, a in zip(before, after) if b != a)


def says_change(caption, scene):
    """Whether a caption names the pair's change: its verb, and for a new colour or material the new value
    after it ("the red cube turned blue")."""
    kind, (old, new) = scene["change_type"], changed_object(scene)
    if kind in ("move", "add", "drop"):
        return any(verb in caption for verb in SAYS[kind])
    verb = next((v for v in SAYS["color"] if v in caption), None)
    value = (new["color"],) if kind == "color" else WORDS[new["material"]]
    return verb is not None and any(word in value for word in caption.split(verb, 1)[1].split())


def named_shape(caption):
    """The shape its subject's shape word names ("thing" names none; a clause after "that" is another object's)."""
    return next((SHAPE_OF[word] for word in caption.split(" that ")[0].split() if word in SHAPE_OF), None)


def grade(items, preds):
    """Percent of the change captions that name the change (says_change) and the changed object's shape, of the
    moved objects said to move, and of the distractors given a no-change sentence: preds {id: caption} of
    data.eval_items of the synthetic data, whose change pairs hold their scene graphs."""
    changes = [(preds[i.id].lower(), i.scene) for i in items if i.scene]
    def share(hits):
        hits = list(hits)
        return 100.0 * sum(hits) / len(hits) if hits else None
    return {"change": share(says_change(c, scene) for c, scene in changes),
            "shape": share(named_shape(c) == next(o for o in changed_object(scene) if o)["shape"]
                           for c, scene in changes),
            "move": share(says_change(c, scene) for c, scene in changes if scene["change_type"] == "move"),
            "distractor": share(preds[i.id].lower().strip(" .") in NO_CHANGE
                                for i in items if i.change_type == "distractor")}


def check_root(root):
    """--data_root of --data synth: a folder that can be made, to draw into on first use, or one drawn before."""
    if not Path(root).is_dir():
        check_writable(root, "--data_root")
    elif not any(Path(root).iterdir()):  # made by hand for the data, say: drawing would not replace it
        raise InputError(f"--data_root {root}: an empty folder; the synthetic data is drawn into a folder that does "
                         "not exist yet: remove it, or give another --data_root")


def ensure_synth(root, pairs=PAIRS, seed=0):
    """Draw the synthetic dataset into `root` unless it exists; one of another size is used as it is, with a warning."""
    root = Path(root)
    if not root.exists():
        log.warning("generating %d synthetic CLEVR-Change pairs in %s", pairs, root)
        write_synth(root, pairs, seed)
    elif (root / "scenes.json").is_file() and (held := len(read_json("clevr", root / "scenes.json")[0])) != pairs:
        log.warning("%s holds %d pairs, not the %d asked for: delete it to generate those", root, held, pairs)
    return root


def main(argv=None):
    parser = ArgumentParser(description="Write the synthetic CLEVR-Change.")
    parser.add_argument("--out", required=True, help="the folder to create")
    parser.add_argument("--pairs", type=int, default=PAIRS,
                        help=f"how many pairs to draw, at least {MIN_PAIRS} (default: {PAIRS})")
    parser.add_argument("--seed", type=int, default=0, help="the seed that fixes every scene and caption (default: 0)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    check_writable(args.out, "--out")
    write_synth(args.out, args.pairs, args.seed)  # a failure, Ctrl-C too, leaves nothing behind
    print(f"wrote {args.pairs} pairs to {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    cli.main(main)  # bad input, a full or read-only disk or Ctrl-C: one line
