"""clip_weights: config inference, strict key checks, safe reading, and the cached, hash-checked download."""
import dataclasses
import hashlib
import re
import http.server
import socket
import struct
import threading
import zipfile

import pytest
import torch

import clip_weights
from model import SMALL_CLIP, CLIP, CLIP4IDC, CLIP4IDCConfig, CLIPConfig
from openai_reference import model as openai_model
from openai_reference import random_state_dict

TINY = CLIPConfig(embed_dim=64, image_size=32, patch_size=16, vision_width=64, vision_layers=2, vision_heads=1,
                  context_length=16, vocab_size=49408, text_width=64, text_layers=2, text_heads=1)


@pytest.fixture(scope="module")
def tiny_sd():
    return random_state_dict(TINY, seed=0)


def save(sd, path):
    torch.save(sd, path)
    return path


# ---------------------------------------------------------------------------------------------
# the architecture is read off the shapes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, args, expected", [
    ("ViT-B/16", (512, 224, 12, 768, 16, 77, 49408, 512, 8, 12),
     CLIPConfig(patch_size=16)),
    ("ViT-L/14", (768, 224, 24, 1024, 14, 77, 49408, 768, 12, 12),
     CLIPConfig(embed_dim=768, patch_size=14, vision_width=1024, vision_layers=24, vision_heads=16,
                text_width=768, text_heads=12)),
    ("ViT-L/14@336px", (768, 336, 24, 1024, 14, 77, 49408, 768, 12, 12),
     CLIPConfig(embed_dim=768, image_size=336, patch_size=14, vision_width=1024, vision_layers=24,
                vision_heads=16, text_width=768, text_heads=12)),
])
def test_config_of_other_releases(name, args, expected):
    with torch.device("meta"):  # shapes only: nothing is allocated
        sd = openai_model.CLIP(*args).state_dict()
        assert clip_weights.config_from_state_dict(sd) == expected, name
        clip_weights.load_weights(CLIP(expected), sd)  # same keys, same shapes


def test_resnet_checkpoint_is_rejected(tmp_path):
    resnet = openai_model.CLIP(64, 64, (1, 1, 1, 1), 64, None, 16, 100, 64, 1, 1)
    with pytest.raises(ValueError, match="ResNet"):
        clip_weights.load(save(resnet.state_dict(), tmp_path / "rn.pt"))


def test_a_width_below_one_attention_head_is_named(tmp_path):
    narrow = dataclasses.replace(TINY, embed_dim=32, vision_width=32, text_width=32)
    with pytest.raises(ValueError, match="vision width 32, text width 32: expected at least 64"):
        clip_weights.load(save(CLIP(narrow).state_dict(), tmp_path / "narrow.pt"))


def test_a_vocabulary_other_than_the_tokenizers_is_named(tmp_path):
    other = dataclasses.replace(TINY, vocab_size=1000)
    with pytest.raises(ValueError, match="a vocabulary of 1000 tokens; expected CLIP's 49408, the ids its BPE"):
        clip_weights.load(save(CLIP(other).state_dict(), tmp_path / "other.pt"))


# ---------------------------------------------------------------------------------------------
# loading is strict
# ---------------------------------------------------------------------------------------------
def test_missing_key_is_named(tiny_sd, tmp_path):
    sd = dict(tiny_sd)
    del sd["transformer.resblocks.1.ln_2.bias"]
    with pytest.raises(ValueError, match=r"missing keys: \['transformer.resblocks.1.ln_2.bias'\]"):
        clip_weights.load(save(sd, tmp_path / "ckpt.pt"))


def test_missing_block_is_named(tiny_sd, tmp_path):
    sd = {k: v for k, v in tiny_sd.items() if not k.startswith("visual.transformer.resblocks.0.")}
    with pytest.raises(ValueError, match=r"missing keys: \['visual.transformer.resblocks.0.attn.in_proj_bias'"):
        clip_weights.load(save(sd, tmp_path / "ckpt.pt"))


def test_unexpected_key_is_named(tiny_sd, tmp_path):
    sd = dict(tiny_sd, **{"visual.extra_token": torch.zeros(64)})
    with pytest.raises(ValueError, match=r"unexpected keys: \['visual.extra_token'\]"):
        clip_weights.load(save(sd, tmp_path / "ckpt.pt"))


def test_misshaped_key_is_named(tiny_sd, tmp_path):
    sd = dict(tiny_sd)
    sd["transformer.resblocks.0.mlp.c_fc.weight"] = torch.zeros(100, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"transformer.resblocks.0.mlp.c_fc.weight: checkpoint \(100, 64\) vs model \(256, 64\)"):
        clip_weights.load(save(sd, tmp_path / "ckpt.pt"))


@pytest.mark.parametrize("kind", ["sparse", "complex", "meta", "a number"])
def test_a_weight_without_dense_real_values_is_named(tiny_sd, tmp_path, kind):
    key = "transformer.resblocks.0.mlp.c_fc.weight"  # a sparse one would not load; a complex one would lose a part
    w = tiny_sd[key]
    odd = {"sparse": w.to_sparse(), "complex": w.to(torch.complex64), "meta": w.to("meta"), "a number": 0.5}[kind]
    with pytest.raises(clip_weights.InputError, match=r"ckpt.pt: expected a dense real tensor with values for every "
                                                      rf"weight, not a sparse, complex or meta tensor .*: \['{key}'\]$"):
        clip_weights.load(save(dict(tiny_sd, **{key: odd}), tmp_path / "ckpt.pt"))


@pytest.mark.parametrize("dropped, message", [
    ("visual.proj", r"missing keys \['visual.proj'\]"),
    ("transformer.resblocks.", r"no keys start with 'transformer.resblocks.'"),
])
def test_keys_needed_for_the_config_are_named(tiny_sd, tmp_path, dropped, message):
    sd = {k: v for k, v in tiny_sd.items() if not k.startswith(dropped)}
    with pytest.raises(ValueError, match=message):
        clip_weights.load(save(sd, tmp_path / "ckpt.pt"))


def test_loading_never_unpickles_objects(tiny_sd, tmp_path):
    marker = tmp_path / "code_ran"

    class Payload:
        def __reduce__(self):  # unpickling this would create `marker`
            return open, (str(marker), "w")

    path = save(dict(tiny_sd, payload=Payload()), tmp_path / "evil.pt")
    with pytest.raises(clip_weights.InputError, match="it holds objects besides tensors and plain data"):
        clip_weights.load(path)
    assert not marker.exists()


def test_a_damaged_torchscript_archive_is_named(tmp_path):
    with zipfile.ZipFile(tmp_path / "ViT-B-32.pt", "w") as z:  # the layout of OpenAI's release, its records garbage
        z.writestr("ViT-B-32/constants.pkl", b"not a pickle")
        z.writestr("ViT-B-32/data.pkl", b"not a pickle")
    with pytest.raises(clip_weights.InputError, match=f"^{tmp_path / 'ViT-B-32.pt'}: cannot read it as a TorchScript "
                                                      "archive"):
        clip_weights.load(tmp_path / "ViT-B-32.pt")


def test_a_torchscript_archive_given_as_a_checkpoint_is_named_without_torchs_unsafe_advice(tmp_path):
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(tmp_path / "ViT-B-32.pt"))  # as OpenAI's release is
    for read in (clip_weights.load_checkpoint, lambda path: clip_weights.read_checkpoint(path, mmap=True)):
        with pytest.raises(clip_weights.InputError, match=f"^{tmp_path / 'ViT-B-32.pt'}: a TorchScript archive, as "
                                                          "OpenAI's CLIP release is, .*read by --clip") as error:
            read(tmp_path / "ViT-B-32.pt")
        assert "weights_only" not in str(error.value)


def test_a_zip_file_whose_directory_is_damaged_is_named(tiny_sd, tmp_path):
    content = bytearray(save(tiny_sd, tmp_path / "ckpt.pt").read_bytes())
    entry = content.rfind(b"PK\x01\x02")  # the last entry of the central directory, whose end record stays whole
    content[entry:entry + 4] = b"XXXX"
    (tmp_path / "ckpt.pt").write_bytes(content)
    with pytest.raises(clip_weights.InputError, match=f"^{tmp_path / 'ckpt.pt'}: cannot read it as a checkpoint"):
        clip_weights.load(tmp_path / "ckpt.pt")


def test_a_checkpoint_in_torchs_legacy_format_is_read_whole_where_mmap_was_asked(tiny_sd, tmp_path):
    torch.save(tiny_sd, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert clip_weights.read_checkpoint(tmp_path / "old.pt", mmap=True).keys() == tiny_sd.keys()


def test_unknown_name_lists_the_known_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # a name of the form org/name may be a Hugging Face model id
    with pytest.raises(FileNotFoundError, match="^ViT-H/99: no such file, nor a model in the Hugging Face cache .*; "
                                                "expected a checkpoint file or folder, a model id there, or one of ViT-B/32"):
        clip_weights.load("ViT-H/99")
    with pytest.raises(FileNotFoundError, match="^ViT-H-99: no such file; expected a checkpoint file or folder, or one "
                                                "of ViT-B/32"):
        clip_weights.load("ViT-H-99")


@pytest.mark.parametrize("activation", ["gelu", "quick_gelu"])
def test_our_checkpoints_record_the_activation_and_reload_the_same(tmp_path, activation):
    model = CLIP4IDC(CLIP4IDCConfig(clip=dataclasses.replace(TINY, activation=activation), n_intra=1, context_length=16))
    save({"model": model.state_dict(), "model_config": clip_weights.model_config(model)}, tmp_path / "best.pt")
    loaded = clip_weights.load_checkpoint(tmp_path / "best.pt")
    images = torch.randn(2, 3, 32, 32)
    assert loaded.config == model.config
    torch.testing.assert_close(loaded.encode_pair(images, images.flip(0)), model.eval().encode_pair(images, images.flip(0)),
                               rtol=0, atol=0)
    config = clip_weights.model_config(model)
    del config["encoder"]["clip"]["activation"]  # a checkpoint written before the field: OpenAI's QuickGELU, as then
    assert clip_weights.model_from_config(config).config.clip.activation == "quick_gelu"


# ---------------------------------------------------------------------------------------------
# downloading: a local server stands in for OpenAI's
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def server(tmp_path, monkeypatch):
    """Serves tmp_path/www on 127.0.0.1; `server.requests` lists the paths asked for."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    www = tmp_path / "www"
    www.mkdir()
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(www), **kwargs)

        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    httpd.www, httpd.requests = www, requests
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def publish(server, content, name="ViT-B-32.pt", sha=None):
    """Put `content` on the server under /<sha>/<name>, as OpenAI's URLs are laid out."""
    sha = sha or hashlib.sha256(content).hexdigest()
    (server.www / sha).mkdir()
    (server.www / sha / name).write_bytes(content)
    return f"{server.url}/{sha}/{name}"


def test_download_caches_and_reuses(server, tiny_sd, tmp_path, monkeypatch, capsys):
    content = save(tiny_sd, tmp_path / "tiny.pt").read_bytes()
    monkeypatch.setitem(clip_weights.MODELS, "ViT-B/32", publish(server, content))
    cache = tmp_path / "cache"

    model = clip_weights.load("ViT-B/32", root=cache)
    assert model.config == TINY
    assert (cache / "ViT-B-32.pt").read_bytes() == content
    assert sorted(p.name for p in cache.iterdir()) == ["ViT-B-32.pt"]  # no temporary file left
    assert len(server.requests) == 1
    assert re.search(r" 8% \(1.0/13.2 MB, eta \dm\d\ds\).* 100% \(13.2/13.2 MB, eta 0m00s\)", capsys.readouterr().err)

    clip_weights.load("ViT-B/32", root=cache)
    assert len(server.requests) == 1  # the cached file's hash matched: no second request


def test_a_download_cut_off_ends_its_progress_line_before_the_error(tmp_path, monkeypatch, capsys):
    progressed, shown = threading.Event(), clip_weights.progress
    monkeypatch.setattr(clip_weights, "progress", lambda *args: (shown(*args), progressed.set()))
    monkeypatch.setenv("no_proxy", "127.0.0.1")

    def serve(server):  # half of the file, then the connection is reset
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2000000\r\n\r\n" + bytes(clip_weights.CHUNK))
            progressed.wait(30)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close by a reset

    with socket.create_server(("127.0.0.1", 0)) as server:
        threading.Thread(target=serve, args=(server,), daemon=True).start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/{'0' * 64}/ViT-B-32.pt"
        with pytest.raises(ConnectionError, match="^cannot download .*Connection reset by peer"):
            clip_weights.download(url, tmp_path / "cache")
    assert re.fullmatch(r"\rdownloading ViT-B-32.pt:  52% \(1.0/2.0 MB, eta \dm\d\ds\)\n", capsys.readouterr().err)
    assert not (tmp_path / "cache").exists()


def test_a_chunked_download_cut_off_is_a_connection_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("no_proxy", "127.0.0.1")

    def serve(server):  # a chunk of 4096 bytes announced, 100 sent, then the connection is closed
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n1000\r\n"
                               + bytes(100))

    with socket.create_server(("127.0.0.1", 0)) as server:
        threading.Thread(target=serve, args=(server,), daemon=True).start()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/{'0' * 64}/ViT-B-32.pt"
        with pytest.raises(ConnectionError, match=r"^cannot download .*IncompleteRead.*No network\?"):  # one line (cli.main)
            clip_weights.download(url, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_corrupt_cached_file_is_downloaded_again(server, tmp_path):
    content = b"the real checkpoint bytes"
    url = publish(server, content, name="x.pt")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "x.pt").write_bytes(b"truncated")
    assert clip_weights.download(url, cache).read_bytes() == content
    assert len(server.requests) == 1


def test_hash_mismatch_leaves_nothing_cached(server, tmp_path):
    url = publish(server, b"not what the URL promises", sha="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(ConnectionError, match="SHA-256 .*expected 0{64}; nothing was cached"):  # one line (cli.main)
        clip_weights.download(url, cache)
    assert not cache.exists()  # nor the folder made for it


def test_no_network_says_where_to_put_the_file(tmp_path):
    with socket.socket() as s:  # a port that nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cache = tmp_path / "cache"
    url = f"http://127.0.0.1:{port}/{'0' * 64}/ViT-B-32.pt"
    with pytest.raises(ConnectionError, match="No network") as error:
        clip_weights.download(url, cache)
    assert str(error.value).endswith(f"put it at {cache / 'ViT-B-32.pt'}, or give its path as --clip")
    assert not cache.exists()
    cache.mkdir()
    (cache / "ViT-B-32.pt").write_bytes(b"another file")
    with pytest.raises(ConnectionError, match="in place of the file there, whose SHA-256 differs"):
        clip_weights.download(url, cache)
    assert list(cache.iterdir()) == [cache / "ViT-B-32.pt"]


def test_the_shipped_synthetic_clip_loads_as_the_small_shape_and_a_changed_copy_is_refused(tmp_path, monkeypatch):
    import adapt
    shipped = clip_weights.ASSETS / "clip_synth.pt"
    assert clip_weights.sha256(shipped) == clip_weights.SHIPPED["clip_synth.pt"]
    assert clip_weights.load("assets/clip_synth.pt").config == SMALL_CLIP  # --init random: the same shape
    copy = torch.load(shipped)
    copy["logit_scale"] += 1  # a file that differs, under the shipped name, is not taken for it
    monkeypatch.setattr(clip_weights, "ASSETS", tmp_path)
    with pytest.raises(clip_weights.InputError, match=r"clip_synth.pt: SHA-256 \w+, not that of the file shipped"):
        clip_weights.load(save(copy, tmp_path / "clip_synth.pt"))
    assert clip_weights.load(save(copy, tmp_path / "other.pt")).config == SMALL_CLIP  # another name: any file
