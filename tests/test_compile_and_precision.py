"""The training steps compile to one graph whatever the caption lengths, and fit() trains under
bf16 autocast and under fp16 with the grad scaler, its layers computing in that precision; --amp auto picks
bf16 only where the GPU has it."""
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from adapt import AdaptConfig
from model import EOT, Captioner, CaptionerConfig
from test_training_loop import ToyPairs
from tiny import tiny_pair_encoder
from cli import mixed_precision
from train import fit


def captions(batch, eot_at, length=12):
    ids = torch.randint(1, 1000, (batch, length))
    ids[:, eot_at], ids[:, eot_at + 1:] = EOT, 0
    return ids


def pixels(*shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8)


def captioner():
    return Captioner(tiny_pair_encoder(), CaptionerConfig(layers=1, heads=4, ffn=64, max_len=12))


def test_stage_1_loss_is_one_graph_for_any_caption_length():
    torch.manual_seed(0)
    counter = CompileCounter()
    loss = torch.compile(tiny_pair_encoder(), backend=counter, fullgraph=True)  # fullgraph: a break is an error
    for eot_at in (3, 7, 11):
        loss(pixels(4, 3, 32, 32), pixels(4, 3, 32, 32), captions(4, eot_at)).backward()
    assert counter.frame_count == 1  # compiled once: no recompilation as the lengths change


def test_stage_2_loss_is_one_graph_for_any_caption_length():
    torch.manual_seed(0)
    counter = CompileCounter()
    loss = torch.compile(captioner().train(), backend=counter, fullgraph=True)
    for eot_at in (3, 7, 11):  # change and distractor pairs share their before image
        ids = torch.stack([captions(4, eot_at), captions(4, eot_at - 2)], dim=1)
        loss(pixels(4, 3, 32, 32), pixels(4, 2, 3, 32, 32), ids).backward()
    assert counter.frame_count == 1


def test_compiled_code_computes_the_eager_loss():
    """Compiled, the caption loss runs over the padding with ignore_index; eager, it skips it."""
    torch.manual_seed(0)
    model = captioner().eval()
    batch = pixels(3, 3, 32, 32), pixels(3, 2, 3, 32, 32), torch.stack([captions(3, 4), captions(3, 9)], dim=1)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(*batch), model(*batch), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
@pytest.mark.parametrize("make_model", [tiny_pair_encoder, captioner])
def test_fit_trains_under_autocast(tmp_path, amp, make_model):
    torch.manual_seed(0)
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    outputs = []  # the dtype of each nn.Linear's output: under autocast, the low one
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_hook(lambda layer, inputs, output: outputs.append(output.dtype))
    cfg = AdaptConfig(out_dir=str(tmp_path), device="cpu", amp=amp, epochs=1, batch_size=4, workers=0, lr=1e-3,
                      lr_clip=1e-3, log_every=100)
    fit(cfg, model, ToyPairs(), lambda: (0.0, {}), model.new_parameter_names(), "cosine")
    assert outputs and set(outputs) == {torch.bfloat16 if amp == "bf16" else torch.float16}
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sum(not torch.equal(a, b) for a, b in zip(before, model.parameters())) > 10  # it trained
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert ("scaler" in saved) == (amp == "fp16")  # fp16 alone needs the grad scaler, and resumes it
    if amp == "fp16":
        assert saved["scaler"]["scale"] > 0


@pytest.mark.parametrize("native_bf16, dtype, scaled", [(True, torch.bfloat16, False), (False, torch.float16, True)])
def test_auto_precision_takes_bf16_only_where_the_gpu_computes_it(monkeypatch, native_bf16, dtype, scaled):
    # torch also says bf16 is supported where it would emulate it (V100, T4): slow, so fp16 there
    def is_bf16_supported(including_emulation=True):
        return including_emulation or native_bf16

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    with warnings.catch_warnings():  # without CUDA, autocast and the scaler say so, and stay off
        warnings.simplefilter("ignore")
        autocast, scaler = mixed_precision(torch.device("cuda"), "auto")
    assert autocast.fast_dtype == dtype and (scaler is not None) == scaled
