"""Weights into the models of model.py: CLIP ViTs as OpenAI, transformers and open_clip save them, and our checkpoints.

    model = clip_weights.load("ViT-B/32")          # downloads once into ~/.cache/clip
    model = clip_weights.load("path/to/ViT-B-32.pt")  # OpenAI's TorchScript archive, or a state dict (.safetensors too)
    model = clip_weights.load("openai/clip-vit-base-patch32")  # a model id in the local Hugging Face cache, or its folder
    model = clip_weights.load("open_clip_pytorch_model.bin")  # open_clip's, with open_clip_config.json beside it
    model = clip_weights.load_checkpoint("out/caption-clevr/best.pt")  # a run of adapt.py or caption.py
    model = clip_weights.load_checkpoint("pytorch_model.bin.clevr")   # the authors' released stage 1 or 2

Our CLIP parameter names are OpenAI's, and so are open_clip's; transformers' (`HF_NAMES`) and the authors' (pair
encoder and captioner, `authors_names`) are mapped key by key. The architecture is read off the tensor shapes (so
ViT-B/16 and ViT-L/14 load as well), the heads and the MLPs' activation off the source where it records them.
"""
import errno
import hashlib
import http.client
import json
import os
import pickle
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
import zipfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from cli import InputError, format_eta, new_folders, out_of_memory
from model import ACTIVATIONS, CLIP, CLIP4IDC, Captioner, CaptionerConfig, CLIP4IDCConfig, CLIPConfig

MODELS = {  # the SHA-256 of each file is the path component before its name
    "ViT-B/32": "https://openaipublic.azureedge.net/clip/models/40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af/ViT-B-32.pt",
    "ViT-B/16": "https://openaipublic.azureedge.net/clip/models/5806e77cd80f8b59890b7e101eabd078d9fb84e6937f9e85e4ecb61988df416f/ViT-B-16.pt",
    "ViT-L/14": "https://openaipublic.azureedge.net/clip/models/b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836/ViT-L-14.pt",
    "ViT-L/14@336px": "https://openaipublic.azureedge.net/clip/models/3035c92b350959924f9f00213499208652fc7ea050643e8b385c2dac08641f02/ViT-L-14-336px.pt",
}
# The small CLIP that pretrain.py made of synthetic scenes, shipped for the offline default: its SHA-256
# (assets/README.md says how it was made). A file there that differs is refused, not taken for it.
SHIPPED = {"clip_synth.pt": "e8e2f0f0b8f86dab9b807929c55047bfd9dc97b26b29e6bbc1be85b1d678cd74"}
ASSETS = Path(__file__).resolve().parent / "assets"
CACHE_DIR = Path("~/.cache/clip").expanduser()
METADATA_KEYS = ("input_resolution", "context_length", "vocab_size")  # in OpenAI's files, not parameters
CHUNK = 1 << 20


def load(name_or_path, device="cpu", root=CACHE_DIR):
    """A model.CLIP holding CLIP weights: OpenAI's by release name, a local file or folder (`read_source`), or a
    Hugging Face model id found in the local cache. Where the source does not record the MLPs' activation,
    QuickGELU is assumed, as OpenAI's CLIPs use, and a line says so."""
    path = download(MODELS[name_or_path], root) if name_or_path in MODELS else Path(name_or_path)
    if not path.exists() and HF_ID.fullmatch(str(name_or_path)):
        path = hf_cached(str(name_or_path))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file; expected a checkpoint file or folder, or one of {', '.join(MODELS)}")
    shipped = path.resolve().parent == ASSETS and path.name in SHIPPED
    if shipped and (digest := sha256(path)) != SHIPPED[path.name]:
        raise InputError(f"{path}: SHA-256 {digest}, not that of the file shipped there ({SHIPPED[path.name]}); restore "
                         "it with `git checkout` or remake it as assets/README.md says")
    sd, recorded = read_source(path)
    config = config_from_state_dict(sd, path)
    if name_or_path in MODELS or shipped:  # OpenAI's releases, and pretrain.py's CLIP
        recorded["activation"] = "quick_gelu"
    if "activation" not in recorded:  # LAION's and OpenAI's state dicts have the same names and shapes
        print(f"{path}: records no activation; QuickGELU assumed, as OpenAI's CLIPs use (LAION's open_clip models use GELU: "
              f"put their {OPEN_CLIP_CONFIG} beside the file)")
    model = CLIP(replace(config, **recorded))
    load_weights(model, sd, path)
    return model.to(device).eval()


# ---- this project's checkpoints: best.pt and last.pt of adapt.py and caption.py -----------------
def model_config(model):
    """What rebuilds `model`'s architecture (a CLIP4IDC, or a Captioner on one), saved beside its weights."""
    if isinstance(model, Captioner):
        return {"encoder": asdict(model.encoder.config), "captioner": asdict(model.config)}
    return {"encoder": asdict(model.config)}


def model_from_config(config, name="checkpoint"):
    try:
        encoder = dict(config["encoder"])
        encoder = CLIP4IDC(CLIP4IDCConfig(clip=CLIPConfig(**encoder.pop("clip")), **encoder))
        return Captioner(encoder, CaptionerConfig(**config["captioner"])) if "captioner" in config else encoder
    except (KeyError, TypeError, ValueError) as e:  # a config written by something else, or edited by hand
        raise InputError(f"{name}: its model_config describes no model of ours ({type(e).__name__}: {first_line(e)})") from None


def load_checkpoint(path, device="cpu", n_intra=9, heads=8):
    """The model of a checkpoint, in eval mode: a CLIP4IDC (stage 1) or a Captioner (stage 2), of a best.pt or last.pt
    of ours or a file of the authors' code. Theirs do not record the pair encoder's layer split or the captioner's
    heads: `n_intra` and `heads` give them (their released models: 9 + 3 layers, 8 heads)."""
    ckpt = read_checkpoint(path)
    if isinstance(ckpt, dict) and {"model", "model_config"} <= ckpt.keys():
        model = model_from_config(ckpt["model_config"], path)
        load_weights(model, ckpt["model"], path)
    elif isinstance(ckpt, dict) and any(k.removeprefix("module.").startswith("clip.visual.") for k in ckpt):
        model = from_authors(ckpt, n_intra, heads, path)
    else:
        raise InputError(f"{path}: expected a best.pt or last.pt of adapt.py or caption.py, or a "
                         "pytorch_model.bin of the authors' CLIP4IDC code")
    return model.to(device).eval()


def read_checkpoint(path, mmap=False):
    """torch.load of a checkpoint, tensors and plain data only; a file it cannot read is named. mmap: tensors are read
    only when used."""
    if Path(path).is_dir():
        raise InputError(f"{path} is a folder: expected a checkpoint file, such as {Path(path) / 'best.pt'}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    if Path(path).stat().st_size == 0:
        raise InputError(f"{path}: an empty file; expected a checkpoint")
    if is_torchscript(path):  # torch.load refuses it with advice to load it unsafely: not advice to pass on
        raise InputError(f"{path}: a TorchScript archive, as OpenAI's CLIP release is, not a checkpoint of ours or the "
                         "authors' (OpenAI's CLIP is read by --clip, with adapt.py's --init openai or caption.py's "
                         "--init_from openai)")
    try:
        with warnings.catch_warnings():  # torch's notes on pickle protocols: the error says what matters
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # torch's message advises loading it unsafely: not advice to pass on
        raise InputError(f"{path}: cannot read it as a checkpoint (not torch's format, or it holds objects "
                         "besides tensors and plain data)") from None
    except Exception as e:  # truncated, or not a zip file: a bad file, not a bug
        if out_of_memory(e):  # memory, not the file
            raise
        if mmap:  # torch then only says that mmap needs its zip format: read it whole for the real fault
            return read_checkpoint(path)
        raise InputError(f"{path}: cannot read it as a checkpoint ({type(e).__name__}: {first_line(e)})") from None


def save_atomic(obj, path):
    """Write to a temporary file, then rename: a run killed mid-save never leaves a broken file."""
    tmp = Path(f"{path}.tmp")
    try:
        torch.save(obj, tmp)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "unexpected pos" in str(e)  # torch's words
        if not (full or isinstance(e, OSError)):  # anything else (a CUDA error, say) keeps its traceback
            raise
        raise InputError(f"{path}: cannot write it ({first_line(e)}){'; is the disk full?' if full else ''}") from None
    os.replace(tmp, path)


def first_line(error):
    return (str(error).splitlines() or [type(error).__name__])[0]


# ---- the authors' checkpoints (github.com/sushizixin/CLIP4IDC): pytorch_model.bin.clevr, .spot --
AUTHORS_PAIR = {"e1": "visual.bef_embedding", "e2": "visual.aft_embedding", "pair_pos": "visual.joint_positional_embedding",
                "ln_inter.weight": "visual.ln_mid.weight", "ln_inter.bias": "visual.ln_mid.bias"}
# Their captioner's word and position embeddings and output layer are CLIP's own tensors, saved under a second name.
AUTHORS_ALIASES = {"decoder.embeddings.word_embeddings.weight": "clip.token_embedding.weight",
                   "decoder.embeddings.position_embeddings.weight": "clip.positional_embedding",
                   "decoder.classifier.cls.predictions.decoder.weight": "clip.token_embedding.weight"}
AUTHORS_HEAD = {"ln_embed": "embeddings.LayerNorm", "head.0": "classifier.cls.predictions.transform.dense",
                "head.2": "classifier.cls.predictions.transform.LayerNorm"}
AUTHORS_ENCODER_LAYER = {"attn": "slf_attn.att", "attn.out_proj": "slf_attn.output.dense", "ln_1": "slf_attn.output.LayerNorm",
                         "mlp.0": "intermediate.dense", "mlp.2": "output.dense", "ln_2": "output.LayerNorm"}
AUTHORS_DECODER_LAYER = {"self_attn": "slf_attn.att", "self_attn.out_proj": "slf_attn.output.dense",
                         "ln_1": "slf_attn.output.LayerNorm", "cross_attn": "enc_attn.att",
                         "cross_attn.out_proj": "enc_attn.output.dense", "ln_2": "enc_attn.output.LayerNorm",
                         "mlp.0": "intermediate.dense", "mlp.2": "output.dense", "ln_3": "output.LayerNorm"}


def authors_names(model):
    """Our state-dict key -> the authors' key (a tuple: see `renamed`), for every key of `model`."""
    stage2, names = isinstance(model, Captioner), {}
    for ours in model.state_dict():
        encoder_key = ours.removeprefix("encoder.") if stage2 else ours
        if stage2 and encoder_key == ours:
            names[ours] = authors_captioner_name(ours)
        else:  # CLIP itself is clip.<OpenAI's name> in both
            names[ours] = "clip." + AUTHORS_PAIR[encoder_key] if encoder_key in AUTHORS_PAIR else encoder_key
    return names


def authors_captioner_name(ours):
    if ours == "head_bias":
        return "decoder.classifier.cls.predictions.bias"
    module, param = ours.rsplit(".", 1)
    if module in AUTHORS_HEAD:
        return f"decoder.{AUTHORS_HEAD[module]}.{param}"
    stack, i, part = module.split(".", 2)  # enc_layers.0.attn -> enc_layers, 0, attn
    theirs = f"decoder.{'encoder' if stack == 'enc_layers' else 'decoder'}.layer.{i}."
    theirs += (AUTHORS_ENCODER_LAYER if stack == "enc_layers" else AUTHORS_DECODER_LAYER)[part]
    if param.startswith("in_proj_"):
        return tuple(f"{theirs}.{x}.{param.removeprefix('in_proj_')}" for x in ("query", "key", "value"))
    return f"{theirs}.{param}"


def from_authors(sd, n_intra=9, heads=8, name="checkpoint"):
    """Our CLIP4IDC (their stage 1, "pretrained") or Captioner (their stage 2, "trained") holding the weights of a state
    dict saved by the authors' code, fp16 or fp32, with or without DDP's `module.`. Strict: a missing or unknown key, a
    mis-shaped tensor or a tied alias that differs is an error."""
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    clip_sd = {k.removeprefix("clip."): v for k, v in sd.items()
               if k.startswith("clip.") and k.removeprefix("clip.") not in AUTHORS_PAIR.values()}
    clip_config = config_from_state_dict(clip_sd, name, "clip.")
    if not 0 <= n_intra <= clip_config.vision_layers:
        raise InputError(f"--n_intra {n_intra}: {name} has {clip_config.vision_layers} vision layers")
    model = CLIP4IDC(CLIP4IDCConfig(clip=clip_config, n_intra=n_intra))
    aliases = AUTHORS_ALIASES if any(k.startswith("decoder.") for k in sd) else {}
    if aliases:  # their stage 2
        ffn = sd.get("decoder.encoder.layer.0.intermediate.dense.bias")  # when absent, reported below
        if heads < 1 or clip_config.embed_dim % heads:
            raise InputError(f"--heads {heads}: expected a divisor of {name}'s captioner width {clip_config.embed_dim}")
        model = Captioner(model, CaptionerConfig(layers=count_blocks(sd, "decoder.encoder.layer.", name), heads=heads,
                                                 ffn=CaptionerConfig.ffn if ffn is None else len(ffn)))
        for alias, target in aliases.items():
            if alias in sd and target in sd and not torch.equal(sd[alias], sd[target]):
                raise InputError(f"{name}: {alias} differs from {target}; in the authors' model they are one tensor")
    expected = f"a CLIP4IDC state dict of the authors' code as expected ({'stage 2' if aliases else 'stage 1'})"
    load_weights(model, renamed(sd, authors_names(model), name, expected, aliases), name)
    return model


def renamed(sd, names, name, expected, ignored=()):
    """`sd` under our names: `names` gives each of ours its key in `sd`, or a tuple of keys whose tensors are joined
    (their query, key and value projections, the thirds of our in_proj). Strict: each key of `sd` is one of these or
    of `ignored`, which are left out, and each of them is in `sd`."""
    used = {k for theirs in names.values() for k in (theirs if isinstance(theirs, tuple) else (theirs,))}
    missing, unknown = sorted((used | set(ignored)) - sd.keys()), sorted(sd.keys() - used - set(ignored))
    if missing or unknown:
        raise InputError(f"{name}: not {expected}: missing keys {missing[:5]}, unknown keys {unknown[:5]}")
    return {ours: torch.cat([sd[k] for k in theirs]) if isinstance(theirs, tuple) else sd[theirs]
            for ours, theirs in names.items()}


# ---- reading a checkpoint -----------------------------------------------------------------------
def read_state_dict(path):
    """Key -> tensor of a TorchScript archive, a .safetensors file or a torch state dict (bare, or under "state_dict"
    as open_clip's training checkpoints keep it; DDP's `module.` dropped), without OpenAI's metadata keys. A state dict
    is read with weights_only=True, so no arbitrary object is unpickled; torch.jit.load, which reads OpenAI's release,
    restores TorchScript modules, not Python objects."""
    torchscript = is_torchscript(path)
    if torchscript or Path(path).suffix == ".safetensors":
        try:
            with warnings.catch_warnings():  # torch.jit is deprecated, but OpenAI's files need it
                warnings.simplefilter("ignore", FutureWarning)
                sd = torch.jit.load(path, map_location="cpu").state_dict() if torchscript else load_file(path)
        except Exception as e:  # damaged (safetensors raises its own error class): a bad file, not a bug
            kind = "a TorchScript archive" if torchscript else "a .safetensors file"
            raise InputError(f"{path}: cannot read it as {kind} ({first_line(e)})") from None
    else:
        sd = read_checkpoint(path)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise InputError(f"{path}: expected a state dict (OpenAI key names), got {type(sd).__name__}")
    return {k.removeprefix("module."): v for k, v in sd.items() if k not in METADATA_KEYS}


# ---- other libraries' CLIPs: Hugging Face transformers' CLIPModel and open_clip -------------------
HF_ID = re.compile(r"[\w.-]+/[\w.-]+")  # a Hugging Face model id: openai/clip-vit-base-patch32
HF_CONFIG, OPEN_CLIP_CONFIG = "config.json", "open_clip_config.json"
# OpenAI's name -> transformers' CLIPModel name ({p}: weight and bias; a tuple: see `renamed`). Its visual_projection
# and text_projection are Linear weights, the transposes of OpenAI's visual.proj and text_projection (TRANSPOSED).
HF_NAMES = {"visual.class_embedding": "vision_model.embeddings.class_embedding",
            "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
            "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
            "visual.ln_pre.{p}": "vision_model.pre_layrnorm.{p}",  # sic
            "visual.ln_post.{p}": "vision_model.post_layernorm.{p}",
            "visual.proj": "visual_projection.weight",
            "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
            "positional_embedding": "text_model.embeddings.position_embedding.weight",
            "ln_final.{p}": "text_model.final_layer_norm.{p}",
            "text_projection": "text_projection.weight",
            "logit_scale": "logit_scale"}
HF_BLOCK = {"attn.in_proj_{p}": ("self_attn.q_proj.{p}", "self_attn.k_proj.{p}", "self_attn.v_proj.{p}"),
            "attn.out_proj.{p}": "self_attn.out_proj.{p}", "ln_1.{p}": "layer_norm1.{p}", "mlp.c_fc.{p}": "mlp.fc1.{p}",
            "mlp.c_proj.{p}": "mlp.fc2.{p}", "ln_2.{p}": "layer_norm2.{p}"}  # each layer of both towers
HF_TOWERS = {"visual.transformer.resblocks.": "vision_model.encoder.layers.", "transformer.resblocks.": "text_model.encoder.layers."}
TRANSPOSED = ("visual.proj", "text_projection")


def read_source(path):
    """(state dict in OpenAI's names, the CLIPConfig fields the source records) of a file, or of the folder of a
    CLIPModel that transformers' save_pretrained wrote, or open_clip's save_for_hf. transformers' names come with a
    config.json beside them, OpenAI's and open_clip's with an open_clip_config.json."""
    files = [path]
    if path.is_dir():
        files = (sorted(path.glob("model*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
                 if (path / HF_CONFIG).is_file() else
                 [f for f in (path / "open_clip_model.safetensors", path / "open_clip_pytorch_model.bin") if f.is_file()][:1])
    if not files:
        raise InputError(f"{path}: a folder without CLIP weights; expected what transformers' save_pretrained writes ("
                         f"{HF_CONFIG}, model.safetensors or pytorch_model.bin) or open_clip's ({OPEN_CLIP_CONFIG}, "
                         "open_clip_model.safetensors or open_clip_pytorch_model.bin)")
    sd = {k: v for f in files for k, v in read_state_dict(f).items()}
    folder = path if path.is_dir() else path.parent
    if any(k.startswith("vision_model.") for k in sd):
        return from_transformers(sd, path), transformers_config(folder / HF_CONFIG)
    return sd, {"activation": "quick_gelu"} if is_torchscript(files[0]) else open_clip_config(folder / OPEN_CLIP_CONFIG)


def from_transformers(sd, name="checkpoint"):
    names = dict(HF_NAMES)
    for ours, theirs in HF_TOWERS.items():
        for i in range(count_blocks(sd, theirs, name)):
            names |= {f"{ours}{i}.{k}": tuple(f"{theirs}{i}.{t}" for t in v) if isinstance(v, tuple) else f"{theirs}{i}.{v}"
                      for k, v in HF_BLOCK.items()}
    names = {k.format(p=p): tuple(t.format(p=p) for t in v) if isinstance(v, tuple) else v.format(p=p)
             for k, v in names.items() for p in (("weight", "bias") if "{p}" in k else ("",))}
    position_ids = [k for k in sd if k.endswith("position_ids")]  # a buffer that older transformers saved
    sd = renamed(sd, names, name, "a transformers CLIPModel's state dict", ignored=position_ids)
    return sd | {k: sd[k].t() for k in TRANSPOSED}


def transformers_config(path):
    """The activation and heads a CLIPModel's config.json records, transformers' defaults where it leaves them out."""
    if not path.is_file():
        return {}
    config = json_object(path)
    if config.get("model_type") != "clip":
        raise InputError(f"{path}: model_type {config.get('model_type')!r}; expected a transformers CLIPModel's 'clip'")
    text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
    act = text.get("hidden_act", "quick_gelu"), vision.get("hidden_act", "quick_gelu")
    if act[0] != act[1] or act[0] not in ACTIVATIONS:
        raise InputError(f"{path}: hidden_act {act[0]!r} (text), {act[1]!r} (vision); expected 'quick_gelu' or 'gelu' in both")
    return {"activation": act[0], "text_heads": text.get("num_attention_heads", 8),
            "vision_heads": vision.get("num_attention_heads", 12)}


def open_clip_config(path):
    """The activation and heads open_clip_config.json records, open_clip's defaults where it leaves them out (GELU;
    heads of 64 wide in the image tower, 8 in the text tower)."""
    if not path.is_file():
        return {}
    config = json_object(path).get("model_cfg")
    if not isinstance(config, dict):
        raise InputError(f"{path}: no model_cfg object; expected open_clip's {OPEN_CLIP_CONFIG}")
    vision, text = config.get("vision_cfg") or {}, config.get("text_cfg") or {}
    return {"activation": "quick_gelu" if config.get("quick_gelu") else "gelu", "text_heads": text.get("heads", 8),
            "vision_heads": vision.get("width", 768) // vision.get("head_width", 64)}


def json_object(path):
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:  # malformed, or not UTF-8
        raise InputError(f"{path}: cannot read it as JSON ({first_line(e)})") from None
    if not isinstance(content, dict):
        raise InputError(f"{path}: top level is a {type(content).__name__}; expected a JSON object")
    return content


def hf_cached(model_id):
    """The folder of `model_id` in the local Hugging Face cache, as huggingface_hub lays it out: the revision
    refs/main names, else the newest. Nothing is downloaded."""
    hub = os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME") or "~/.cache/huggingface") / "hub"
    repo = Path(hub).expanduser() / f"models--{model_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    snapshots = ([repo / "snapshots" / ref.read_text().strip()] if ref.is_file() else
                 sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime))
    if not snapshots or not snapshots[-1].is_dir():
        raise FileNotFoundError(f"{model_id}: no such file, nor a model in the Hugging Face cache (no {repo / 'snapshots'}); "
                                f"expected a checkpoint file or folder, a model id there, or one of {', '.join(MODELS)}")
    return snapshots[-1]


def is_torchscript(path):
    # torch.jit.save and torch.save both write zip files; only TorchScript stores constants.pkl.
    try:
        with zipfile.ZipFile(path) as z:
            return any(name.endswith("/constants.pkl") for name in z.namelist())
    except zipfile.BadZipFile:  # not a zip file, or its directory is damaged: torch.load then names the fault
        return False


def config_from_state_dict(sd, name="checkpoint", prefix=""):
    """The CLIPConfig of an OpenAI ViT checkpoint, read off its tensor shapes (as OpenAI's build_model does).
    `prefix`: what the file's keys had before the ones in `sd` (the authors' "clip."), for the errors."""
    if "visual.proj" not in sd and any(k.startswith("visual.layer1.") for k in sd):
        raise InputError(f"{name}: a ResNet CLIP checkpoint (OpenAI's RN50, RN101, ..., open_clip's ModifiedResNet); only "
                         "ViT checkpoints are supported")
    if any(k.startswith("visual.trunk.") for k in sd):
        raise InputError(f"{name}: a CLIP whose image tower is a timm model (visual.trunk.*, such as ConvNeXt); only ViT "
                         "checkpoints are supported")
    required = ["visual.conv1.weight", "visual.positional_embedding", "visual.proj", "positional_embedding",
                "token_embedding.weight", "ln_final.weight", "text_projection"]
    if missing := [prefix + k for k in required if k not in sd]:
        raise InputError(f"{name}: not a CLIP ViT checkpoint: missing keys {missing}")
    vision_width, _, patch_size, _ = sd["visual.conv1.weight"].shape
    grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    text_width = sd["ln_final.weight"].shape[0]
    if min(vision_width, text_width) < 64:  # OpenAI's ViTs all use 64-dim heads
        raise InputError(f"{name}: vision width {vision_width}, text width {text_width}: expected at least 64 each, "
                         "as CLIP's 64-wide attention heads need")
    if (vocab_size := sd["token_embedding.weight"].shape[0]) != CLIPConfig.vocab_size:
        raise InputError(f"{name}: a vocabulary of {vocab_size} tokens; expected CLIP's {CLIPConfig.vocab_size}, the ids "
                         "its BPE tokenizer writes")
    return CLIPConfig(embed_dim=sd["text_projection"].shape[1], image_size=patch_size * grid, patch_size=patch_size,
                      vision_width=vision_width, vision_heads=vision_width // 64,
                      vision_layers=count_blocks(sd, "visual.transformer.resblocks.", name, prefix),
                      context_length=sd["positional_embedding"].shape[0], vocab_size=vocab_size,
                      text_width=text_width, text_heads=text_width // 64,
                      text_layers=count_blocks(sd, "transformer.resblocks.", name, prefix))


def count_blocks(sd, prefix, name="checkpoint", file_prefix=""):
    # The highest index, not the number of indices: a block missing in the middle is then
    # reported as missing keys rather than shifting the last block into "unexpected".
    indices = [int(k[len(prefix):].split(".")[0]) for k in sd if k.startswith(prefix)]
    if not indices:
        raise InputError(f"{name}: not a CLIP ViT checkpoint: no keys start with {file_prefix + prefix!r}")
    return 1 + max(indices)


def load_weights(model, sd, name="checkpoint"):
    """Copy `sd` into `model` key by key; any missing, unexpected or mis-shaped key is an error, and so is a
    weight that is not finite or not a dense real tensor with values."""
    if not isinstance(sd, dict):
        raise InputError(f"{name}: expected a state dict of tensors, got {type(sd).__name__}")
    ours = model.state_dict()
    def few(keys):  # a foreign file can differ in every one of hundreds of keys
        return f"{keys[:5]}" + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    def holds_values(v, like):  # a meta tensor has a shape only, which a model on the meta device takes
        return torch.is_tensor(v) and v.layout == torch.strided and not v.is_complex() and v.is_meta <= like.is_meta
    if odd := sorted(k for k in ours.keys() & sd.keys() if not holds_values(sd[k], ours[k])):
        raise InputError(f"{name}: expected a dense real tensor with values for every weight, not a sparse, complex or "
                         f"meta tensor or something else: {few(odd)}")
    missing, unexpected = sorted(ours.keys() - sd.keys()), sorted(sd.keys() - ours.keys())
    misshaped = [f"{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(ours[k].shape)}"
                 for k in ours.keys() & sd.keys() if sd[k].shape != ours[k].shape]
    if missing or unexpected or misshaped:
        raise InputError(f"{name} does not match {type(model).__name__}: missing keys: {few(missing)}; unexpected "
                         f"keys: {few(unexpected)}; mis-shaped keys: {few(sorted(misshaped))}")
    if not all(w.isfinite().all() for w in sd.values() if w.is_floating_point() and not w.is_meta):  # meta: shapes only
        raise InputError(f"{name}: its weights are not all finite, as a diverged training leaves them")
    with torch.no_grad():
        for k, v in sd.items():
            ours[k].copy_(v)  # the release stores most weights in fp16; copy_ casts to our fp32


# ---- downloading a release ----------------------------------------------------------------------
def download(url, root=CACHE_DIR):
    """Fetch `url` into `root` once and return its path. The bytes go to a temporary file, renamed only when it has the
    SHA-256 in the URL: the cache never holds a partial or corrupt checkpoint."""
    root = Path(root).expanduser()
    expected, file = url.rsplit("/", 2)[1:]
    target = root / file
    if target.is_file() and sha256(target) == expected:
        return target
    with new_folders(root):  # the folders it makes go again if nothing comes into them
        fd, tmp = tempfile.mkstemp(dir=root, prefix=target.name + ".", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                digest = fetch(url, out, target)
            if digest != expected:
                raise ConnectionError(f"{url}: the downloaded file has SHA-256 {digest}, expected {expected}; "
                                      "nothing was cached, try again")
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return target


def fetch(url, out, target):
    """Stream `url` into the open file `out` with a progress line on stderr; return the SHA-256."""
    digest, start, done = hashlib.sha256(), time.time(), 0
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            total = int(response.headers.get("Content-Length") or 0)
            while chunk := response.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                progress(target.name, done, total, start)
    # HTTPException: a chunked response cut off (IncompleteRead), which urllib does not wrap in a URLError
    except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
        there = ", in place of the file there, whose SHA-256 differs" if target.is_file() else ""
        raise ConnectionError(f"cannot download {url} ({e}). No network? Download the file elsewhere "
                              f"and put it at {target}{there}, or give its path as --clip") from e
    finally:
        if done:  # the progress line ends before what follows, an error too
            print(file=sys.stderr)
    return digest.hexdigest()


def progress(name, done, total, start):
    percent = f"{100 * done / total:3.0f}% " if total else ""
    size = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB" if total else f"{done / 1e6:.1f} MB"
    eta = f", eta {format_eta((total - done) * (time.time() - start) / done)}" if total else ""
    print(f"\rdownloading {name}: {percent}({size}{eta})", end="", file=sys.stderr, flush=True)


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
