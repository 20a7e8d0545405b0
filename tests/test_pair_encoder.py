import math

import pytest
import torch
import torch.nn.functional as F

from model import contrastive_loss
from tiny import tiny_pair_encoder


@pytest.mark.parametrize("image_size,patch_size,n_intra,layers", [(32, 8, 2, 3), (48, 16, 1, 3), (32, 4, 3, 3), (40, 8, 0, 2)])
def test_pair_encoder_returns_projected_tokens_of_both_images(image_size, patch_size, n_intra, layers):
    torch.manual_seed(0)
    model = tiny_pair_encoder(n_intra=n_intra, image_size=image_size, patch_size=patch_size, layers=layers)
    n = (image_size // patch_size) ** 2
    before, after = torch.randn(2, 2, 3, image_size, image_size)
    tokens = model.encode_pair(before, after)
    assert tokens.shape == (2, 2 * (n + 1), 32)
    assert model.pair_pos.shape == (2 * (n + 1), 48)
    assert model.config.n_inter == layers - n_intra


def test_k_after_images_each_pair_with_their_own_before_image():
    torch.manual_seed(0)
    model = tiny_pair_encoder().eval()
    before, after = torch.randn(3, 3, 32, 32), torch.randn(3, 2, 3, 32, 32)
    expected = torch.stack([model.encode_pair(before, after[:, j]) for j in range(2)], 1).flatten(0, 1)
    torch.testing.assert_close(model.encode_pair(before, after), expected, rtol=1e-5, atol=1e-5)


def test_pool_is_the_mean_of_the_two_class_tokens():
    tokens = torch.randn(3, 10, 8)  # n + 1 = 5 tokens per image
    assert torch.equal(tiny_pair_encoder().pool(tokens), (tokens[:, 0] + tokens[:, 5]) / 2)


def test_intra_layers_see_one_image_and_inter_layers_see_both():
    torch.manual_seed(0)
    before, after, other = torch.randn(3, 2, 3, 32, 32)
    intra_only = tiny_pair_encoder(n_intra=3).eval()
    a, b = intra_only.encode_pair(before, after), intra_only.encode_pair(before, other)
    half = a.shape[1] // 2
    torch.testing.assert_close(a[:, :half], b[:, :half])  # with N_inter = 0 the first image ignores the second
    mixed = tiny_pair_encoder(n_intra=2).eval()
    a, b = mixed.encode_pair(before, after), mixed.encode_pair(before, other)
    assert (a[:, :half] - b[:, :half]).abs().max() > 1e-4


def test_pair_encoder_follows_eq_2_to_4_step_by_step():
    torch.manual_seed(0)
    model = tiny_pair_encoder(n_intra=2).eval()
    visual = model.clip.visual
    before, after = torch.randn(2, 2, 3, 32, 32)

    def intra(images):  # Eq. 2-3, then the first N_intra layers
        x = visual.conv1(images).flatten(2).transpose(1, 2)
        x = torch.cat([visual.class_embedding.expand(len(x), 1, -1), x], 1) + visual.positional_embedding
        x = visual.ln_pre(x)
        for block in visual.transformer.resblocks[:2]:
            x = block(x)
        return x

    x = torch.cat([intra(before) + model.e1, intra(after) + model.e2], 1) + model.pair_pos  # Eq. 4
    x = visual.transformer.resblocks[2](model.ln_inter(x))
    expected = visual.ln_post(x) @ visual.proj
    torch.testing.assert_close(model.encode_pair(before, after), expected, rtol=1e-5, atol=1e-5)


def test_contrastive_loss_matches_eq_6_to_8():
    torch.manual_seed(0)
    v, g, logit_scale = torch.randn(5, 16), torch.randn(5, 16), torch.tensor(2.3)
    tau = 1 / math.exp(logit_scale.item())
    s = torch.tensor([[F.cosine_similarity(v[i], g[j], dim=0).item() for j in range(5)] for i in range(5)])
    l_i2t = -sum(math.log(math.exp(s[i, i] / tau) / sum(math.exp(s[i, j] / tau) for j in range(5))) for i in range(5)) / 5
    l_t2i = -sum(math.log(math.exp(s[i, i] / tau) / sum(math.exp(s[j, i] / tau) for j in range(5))) for i in range(5)) / 5
    assert contrastive_loss(v, g, logit_scale).item() == pytest.approx(l_i2t + l_t2i, rel=1e-5)


def test_a_few_adaptation_steps_lower_the_loss():
    torch.manual_seed(0)
    model = tiny_pair_encoder()
    before, after = torch.randn(2, 8, 3, 32, 32)
    tokens = torch.randint(1, 1000, (8, 12))
    tokens[:, 6], tokens[:, 7:] = 49407, 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = model(before, after, tokens).item()
    for _ in range(15):
        loss = model(before, after, tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert model(before, after, tokens).item() < 0.5 * first


def test_bad_layer_split_is_refused():
    with pytest.raises(ValueError, match="n_intra=4"):
        tiny_pair_encoder(n_intra=4)


def test_openai_init_puts_the_released_weights_under_the_pair_encoder(tmp_path):
    from adapt import AdaptConfig, build_model
    from model import CLIPConfig
    from openai_reference import random_state_dict

    config = CLIPConfig(embed_dim=32, image_size=32, patch_size=8, vision_width=64, vision_layers=4,
                        vision_heads=1, text_width=64, text_layers=1, text_heads=1)  # OpenAI's heads are 64 wide
    sd = random_state_dict(config, seed=1)
    torch.save(sd, tmp_path / "clip.pt")
    model = build_model(AdaptConfig(init="openai", clip=str(tmp_path / "clip.pt"), n_intra=3, n_inter=1))
    assert model.config.n_intra == 3 and model.config.context_length == 32
    ours = model.clip.state_dict()
    for key in ("visual.conv1.weight", "visual.transformer.resblocks.3.attn.in_proj_weight", "token_embedding.weight"):
        assert torch.equal(ours[key], sd[key].float())
    with pytest.raises(ValueError, match="must equal the 4 vision layers"):
        build_model(AdaptConfig(init="openai", clip=str(tmp_path / "clip.pt"), n_intra=9, n_inter=3))
