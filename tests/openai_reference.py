"""OpenAI's own CLIP code (the `openai-clip` package), imported file by file as a test reference.

The package's __init__ needs pkg_resources and tqdm, so only model.py and simple_tokenizer.py are
loaded, straight from the installed package directory.
"""
import importlib.util
import warnings
from pathlib import Path

import torch

PACKAGE_DIR = Path(importlib.util.find_spec("clip").submodule_search_locations[0])


def _import(name):
    spec = importlib.util.spec_from_file_location(f"openai_clip_{name}", PACKAGE_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model = _import("model")
simple_tokenizer = _import("simple_tokenizer")


def random_state_dict(config, seed=0):
    """An OpenAI-format checkpoint with random weights, stored in fp16 like the release.

    Every tensor is random, LayerNorm affine parameters and logit_scale included, so no
    parameter can be silently mapped to the wrong place and still match.
    """
    c = config
    with torch.device("meta"):  # only the parameter shapes are needed; they are all filled below
        ref = model.CLIP(c.embed_dim, c.image_size, c.vision_layers, c.vision_width, c.patch_size,
                         c.context_length, c.vocab_size, c.text_width, c.text_heads, c.text_layers)
    ref.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".ln_" in f".{name}":
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2, generator=g)
            elif name == "logit_scale":
                p.uniform_(2.0, 3.0, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.convert_weights(ref)
    sd = ref.state_dict()
    sd.update(input_resolution=torch.tensor(c.image_size), context_length=torch.tensor(c.context_length),
              vocab_size=torch.tensor(c.vocab_size))
    return sd


def build(state_dict):
    """OpenAI's fp32 reference model for `state_dict` (its build_model mutates the dict, so copy it)."""
    return model.build_model(dict(state_dict)).float().eval()


def save_torchscript(state_dict, path, images, tokens):
    """Write `state_dict` the way OpenAI released it: a traced fp16 model in a TorchScript archive.

    The release's archive also carries the three metadata entries as tensors; OpenAI's model keeps
    two of them as plain ints, so those are swapped for buffers before tracing.
    """
    ref = model.build_model(dict(state_dict))
    for key in ("input_resolution", "context_length", "vocab_size"):
        if hasattr(ref, key):
            delattr(ref, key)
        ref.register_buffer(key, state_dict[key])
    with warnings.catch_warnings():  # torch.jit is deprecated; the release format still needs it
        warnings.simplefilter("ignore")
        # check_trace=False: OpenAI's blocks store their mask cast to fp16 on the first call, so the
        # tracer's check run sees a constant of another dtype than the traced run did.
        traced = torch.jit.trace(ref, (images, tokens), check_trace=False)
        torch.jit.save(traced, str(path))
