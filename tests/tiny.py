"""Tiny model configurations shared by the tests."""
from model import CLIP4IDC, CLIP4IDCConfig, CLIPConfig


def tiny_clip_config(image_size=32, patch_size=8, layers=3):
    return CLIPConfig(embed_dim=32, image_size=image_size, patch_size=patch_size, vision_width=48,
                      vision_layers=layers, vision_heads=4, context_length=16, vocab_size=49408,
                      text_width=32, text_layers=2, text_heads=4)


def tiny_pair_encoder(n_intra=2, context_length=12, **kw):
    return CLIP4IDC(CLIP4IDCConfig(clip=tiny_clip_config(**kw), n_intra=n_intra, context_length=context_length))
