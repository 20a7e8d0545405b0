"""clip_weights.load against the libraries that save CLIPs too: small random models built with Hugging Face
transformers and open_clip, saved in each of their formats, read back, and their features compared with the
library's own (fp32, within 1e-5); what no source records, and what is not a ViT CLIP."""
import json
import shutil
import subprocess
import sys

import open_clip
import pytest
import torch
import transformers
from open_clip.push_to_hf_hub import save_config_for_hf
from safetensors.torch import save_file

import clip_weights
from tokenizer import tokenize

TEXTS = ["the small red metal cube moved", "a bird with a longer beak and a white breast than the other one", "x"]
LARGEST = {}  # the largest difference measured, by library: printed at the end (pytest -s)


@pytest.fixture(scope="module", autouse=True)
def report_largest_differences():
    yield
    print(f"\nlargest difference from the library's own features: {LARGEST}")


def randomize(model, seed):
    """Every parameter random, LayerNorms and logit scale too: no tensor can land in the wrong place and still match."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def assert_same_features(ours, image_features, text_features, library):
    images, tokens = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1)), tokenize(TEXTS, 32)
    with torch.no_grad():
        pairs = [(ours.encode_image(images), image_features(images)), (ours.encode_text(tokens), text_features(tokens))]
    for mine, theirs in pairs:
        theirs = getattr(theirs, "pooler_output", theirs)  # transformers 5 returns the output object
        assert mine.shape == theirs.shape and theirs.abs().max() > 0.1
        LARGEST[library] = max(LARGEST.get(library, 0.0), (mine - theirs).abs().max().item())
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def hf_model(act, eos_token_id=49407, seed=0):
    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         max_position_embeddings=32, hidden_act=act, eos_token_id=eos_token_id),
        vision_config=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=16, hidden_act=act), projection_dim=48)
    return randomize(transformers.CLIPModel(config), seed)


def open_clip_model(tmp_path, quick_gelu, seed=0, vision=None, text_heads=2):
    """open_clip's own CLIP for a small config of ours, as create_model builds it, and that config."""
    config = dict(embed_dim=48, quick_gelu=quick_gelu, text_cfg=dict(context_length=32, width=64, heads=text_heads, layers=2),
                  vision_cfg=vision or dict(layers=2, width=128, head_width=32, patch_size=16, image_size=32))
    (tmp_path / "configs").mkdir(exist_ok=True)
    (tmp_path / "configs" / f"tiny-{seed}.json").write_text(json.dumps(config))
    open_clip.add_model_config(tmp_path / "configs" / f"tiny-{seed}.json")
    return randomize(open_clip.create_model(f"tiny-{seed}"), seed), config


def hf_features(model):
    return lambda images: model.get_image_features(pixel_values=images), lambda t: model.get_text_features(input_ids=t)


# ---------------------------------------------------------------------------------------------
# transformers' CLIPModel
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("act, eos_token_id, layout", [
    ("gelu", 49407, "safetensors"),  # LAION's conversions; the tokenizer's EOT, pooled where it first occurs
    ("quick_gelu", 2, "bin"),  # OpenAI's, as their hub configs read: eos 2, pooled at the largest id
    ("quick_gelu", 49407, "shards"),
])
def test_a_transformers_folder_gives_transformers_features(tmp_path, act, eos_token_id, layout):
    model = hf_model(act, eos_token_id)
    if layout == "bin":  # what transformers before 5 wrote without safetensors
        model.config.save_pretrained(tmp_path)
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    else:
        model.save_pretrained(tmp_path, max_shard_size="1MB" if layout == "shards" else "5GB")
    assert layout != "shards" or len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = clip_weights.load(tmp_path)
    assert (ours.config.activation, ours.config.vision_heads, ours.config.text_heads) == (act, 2, 2)
    assert_same_features(ours, *hf_features(model), "transformers")


def test_a_model_id_is_read_from_the_hugging_face_cache_and_its_absence_says_where(tmp_path, monkeypatch):
    model = hf_model("gelu", seed=3)
    snapshot = tmp_path / "hub" / "models--laion--tiny-clip" / "snapshots" / "f00d"
    model.save_pretrained(snapshot)
    (tmp_path / "hub" / "models--laion--tiny-clip" / "refs").mkdir()
    (tmp_path / "hub" / "models--laion--tiny-clip" / "refs" / "main").write_text("f00d")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert_same_features(clip_weights.load("laion/tiny-clip"), *hf_features(model), "transformers")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match=f"^laion/tiny-clip: no such file, nor a model in the Hugging Face cache "
                                                f"\\(no {tmp_path / 'elsewhere' / 'models--laion--tiny-clip' / 'snapshots'}\\)"):
        clip_weights.load("laion/tiny-clip")


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="siglip"), r"config.json: model_type 'siglip'; expected a transformers CLIPModel's"),
    (lambda c: c["vision_config"].update(hidden_act="relu"),
     r"config.json: hidden_act 'gelu' \(text\), 'relu' \(vision\); expected 'quick_gelu' or 'gelu' in both"),
])
def test_a_transformers_config_of_another_model_is_refused(tmp_path, change, message):
    hf_model("gelu").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    change(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(clip_weights.InputError, match=message):
        clip_weights.load(tmp_path)


# ---------------------------------------------------------------------------------------------
# open_clip
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quick_gelu", [False, True])
@pytest.mark.parametrize("layout", ["training checkpoint", "save_for_hf folder"])
def test_an_open_clip_checkpoint_gives_open_clips_features(tmp_path, quick_gelu, layout):
    model, config = open_clip_model(tmp_path, quick_gelu)
    folder = tmp_path / "model"
    folder.mkdir()
    save_config_for_hf(model, folder / "open_clip_config.json", config)  # open_clip's own writer of the file
    if layout == "training checkpoint":  # as open_clip's training saves it under DDP
        source = folder / "epoch_3.pt"
        torch.save({"epoch": 3, "name": "tiny", "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}},
                   source)
    else:
        source = folder
        save_file(model.state_dict(), folder / "open_clip_model.safetensors")
    ours = clip_weights.load(source)
    assert (ours.config.activation, ours.config.vision_heads) == ("quick_gelu" if quick_gelu else "gelu", 4)
    assert_same_features(ours, model.encode_image, model.encode_text, "open_clip")


def test_a_bare_state_dict_records_no_activation_and_quick_gelu_is_assumed_in_a_line(tmp_path, capsys):
    openai_heads = dict(vision=dict(layers=2, width=128, patch_size=16, image_size=32), text_heads=1)  # 64 wide
    model, _ = open_clip_model(tmp_path, quick_gelu=True, seed=5, **openai_heads)
    save_file(model.state_dict(), tmp_path / "openai_names.safetensors")
    ours = clip_weights.load(tmp_path / "openai_names.safetensors")
    assert capsys.readouterr().out == (f"{tmp_path / 'openai_names.safetensors'}: records no activation; QuickGELU "
                                       "assumed, as OpenAI's CLIPs use (LAION's open_clip models use GELU: put their "
                                       "open_clip_config.json beside the file)\n")
    assert_same_features(ours, model.encode_image, model.encode_text, "open_clip")
    gelu, _ = open_clip_model(tmp_path, quick_gelu=False, seed=6, **openai_heads)  # a GELU model's file is misread
    torch.save(gelu.state_dict(), tmp_path / "gelu.pt")
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (clip_weights.load(tmp_path / "gelu.pt").encode_image(images) - gelu.encode_image(images)).abs().max() > 1e-3


def test_image_towers_other_than_a_vit_are_named(tmp_path):
    resnet, _ = open_clip_model(tmp_path, False, seed=7, vision=dict(layers=[1, 1, 1, 1], width=64, image_size=64))
    torch.save(resnet.state_dict(), tmp_path / "rn.pt")
    with pytest.raises(clip_weights.InputError, match="rn.pt: a ResNet CLIP checkpoint .*open_clip's ModifiedResNet"):
        clip_weights.load(tmp_path / "rn.pt")
    convnext, _ = open_clip_model(tmp_path, False, seed=8, vision=dict(timm_model_name="convnext_atto", image_size=32))
    save_file(convnext.state_dict(), tmp_path / "convnext.safetensors")
    with pytest.raises(clip_weights.InputError, match=r"convnext.safetensors: a CLIP whose image tower is a timm model "
                                                      r"\(visual.trunk.\*, such as ConvNeXt\); only ViT"):
        clip_weights.load(tmp_path / "convnext.safetensors")


def test_files_and_folders_of_no_known_kind_are_named(tmp_path):
    (tmp_path / "notes.safetensors").write_text("not a tensor file")
    with pytest.raises(clip_weights.InputError, match="notes.safetensors: cannot read it as a .safetensors file"):
        clip_weights.load(tmp_path / "notes.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(clip_weights.InputError, match=r"empty: a folder without CLIP weights; expected what transformers' "
                                                      r"save_pretrained writes \(config.json, model.safetensors"):
        clip_weights.load(tmp_path / "empty")
    hf_model("gelu").save_pretrained(tmp_path / "hf")
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "config.json")
    save_file({f"{tower}_model.encoder.layers.0.layer_norm1.weight": torch.ones(64) for tower in ("vision", "text")},
              tmp_path / "model.safetensors")
    with pytest.raises(clip_weights.InputError, match=r"not a transformers CLIPModel's state dict: missing keys "
                                                      r"\['logit_scale', 'text_model"):
        clip_weights.load(tmp_path)


def test_the_project_runs_without_transformers_or_open_clip():
    code = ("import sys, adapt, caption, evaluate, clip_weights; "
            "print(sorted({'transformers', 'open_clip', 'timm'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"

