"""OpenAI-format checkpoints loaded by clip_weights give the outputs of OpenAI's own model.py.

No release can be downloaded here, so the checkpoints hold random weights in the release's
shapes and dtypes (fp16 where OpenAI's convert_weights puts fp16).
"""
import pytest
import torch
import torch.nn.functional as F

import clip_weights
import tokenizer
from model import CLIPConfig
from openai_reference import build, random_state_dict, save_torchscript

TEXTS = ["a photo of a cat.", "the small red metal cube has been moved to the left of the sphere",
         "there is no change " * 30]  # the last one is cut to the context length
SMALL = CLIPConfig(embed_dim=96, image_size=48, patch_size=16, vision_width=128, vision_layers=3, vision_heads=2,
                   context_length=32, text_width=64, text_layers=2, text_heads=1)


def assert_same_outputs(ours, ref, images, tokens, atol=1e-5):
    with torch.no_grad():
        got_image, want_image = ours.encode_image(images), ref.encode_image(images)
        got_text, want_text = ours.encode_text(tokens), ref.encode_text(tokens)
        got_logits, want_logits = ours(images, tokens)[0], ref(images, tokens)[0]
    torch.testing.assert_close(F.normalize(got_image, dim=-1), F.normalize(want_image, dim=-1), rtol=0, atol=atol)
    torch.testing.assert_close(F.normalize(got_text, dim=-1), F.normalize(want_text, dim=-1), rtol=0, atol=atol)
    # logits are scaled by exp(logit_scale) ~ 7-20, so their tolerance scales with it
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=atol * ref.logit_scale.exp().item())
    assert got_logits.std() > 0.01, "outputs should depend on the inputs"


def test_vit_b32_state_dict_matches_openai(tmp_path):
    sd = random_state_dict(CLIPConfig(), seed=0)
    assert sd["visual.conv1.weight"].dtype == torch.float16  # stored like the release
    path = tmp_path / "vit_b32.pt"
    torch.save(sd, path)

    ours = clip_weights.load(path)
    assert ours.config == CLIPConfig()
    assert not ours.training
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in ours.parameters())

    torch.manual_seed(0)
    images = torch.randn(2, 3, 224, 224)
    assert_same_outputs(ours, build(sd), images, tokenizer.tokenize(TEXTS))


def test_torchscript_archive_matches_openai(tmp_path):
    sd = random_state_dict(SMALL, seed=1)
    torch.manual_seed(1)
    images = torch.randn(2, 3, SMALL.image_size, SMALL.image_size)
    tokens = tokenizer.tokenize(TEXTS, context_length=SMALL.context_length)
    path = tmp_path / "small.pt"
    save_torchscript(sd, path, images, tokens)
    assert clip_weights.read_state_dict(path)["visual.conv1.weight"].dtype == torch.float16

    ours = clip_weights.load(path)
    assert ours.config == SMALL  # every field read off the shapes
    assert_same_outputs(ours, build(sd), images, tokens)


def test_loaded_model_is_not_the_reference_with_other_weights(tmp_path):
    """The parity checks above would be vacuous if any two random checkpoints gave the same outputs."""
    path = tmp_path / "small.pt"
    torch.save(random_state_dict(SMALL, seed=2), path)
    images = torch.randn(2, 3, SMALL.image_size, SMALL.image_size)
    tokens = tokenizer.tokenize(TEXTS, context_length=SMALL.context_length)
    with pytest.raises(AssertionError):
        assert_same_outputs(clip_weights.load(path), build(random_state_dict(SMALL, seed=3)), images, tokens)
