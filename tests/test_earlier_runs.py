"""A last.pt written by an earlier version of the code resumes: tests/earlier_runs holds one of each stage, a
tiny run killed after step 3 (its last.pt at step 2), written by `write_earlier_runs` below with the code of
commit 01d1589 (tests/earlier_runs/README.md). Resumed now, each reaches the weights of a whole run of today's code."""
import gzip
import shutil
import sys
from pathlib import Path

import pytest
import torch

from adapt import AdaptConfig
from caption import CaptionConfig
from model import EOT, Captioner, CaptionerConfig
from test_training_loop import ToyPairs, fail_at
from tiny import tiny_pair_encoder
from train import fit

EARLIER = Path(__file__).parent / "earlier_runs"
SETTINGS = dict(data="clevr", device="cpu", epochs=2, batch_size=4, workers=0, save_every=2, log_every=100, lr=1e-3,
                lr_clip=0.0)


def model(stage):
    torch.manual_seed(0)
    encoder = tiny_pair_encoder()
    with torch.no_grad():  # word vectors zero and the rest in bf16's values: the files compress to a few hundred kB
        encoder.clip.token_embedding.weight.zero_()
        for p in encoder.parameters():
            p.copy_(p.bfloat16())
    if stage == "adapt":
        return encoder
    return Captioner(encoder, CaptionerConfig(layers=1, heads=4, ffn=64, max_len=12, vocab=(*range(1, 1000), EOT)))


def run(stage, out, kill_at=None, **flags):
    net = model(stage)
    if kill_at:
        fail_at(net, kill_at)
    cfg = (AdaptConfig if stage == "adapt" else CaptionConfig)(out_dir=str(out), **SETTINGS, **flags)
    fit(cfg, net, ToyPairs(), lambda: (0.0, {}), net.new_parameter_names(), "cosine")
    return net


def write_earlier_runs(folder):
    for stage in ("adapt", "caption"):
        with pytest.raises(KeyboardInterrupt):
            run(stage, Path(folder) / stage, kill_at=3)
        with open(Path(folder) / stage / "last.pt", "rb") as f, gzip.open(EARLIER / f"{stage}.last.pt.gz", "wb") as g:
            shutil.copyfileobj(f, g)


@pytest.mark.parametrize("stage", ["adapt", "caption"])
def test_a_last_pt_of_an_earlier_version_resumes_to_the_weights_of_a_whole_run(stage, tmp_path):
    (tmp_path / "resumed").mkdir()
    with gzip.open(EARLIER / f"{stage}.last.pt.gz") as f:
        (tmp_path / "resumed" / "last.pt").write_bytes(f.read())
    assert torch.load(tmp_path / "resumed" / "last.pt", weights_only=True)["state"]["step"] == 2
    resumed, whole = run(stage, tmp_path / "resumed", resume=True), run(stage, tmp_path / "whole")
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


if __name__ == "__main__":
    write_earlier_runs(sys.argv[1])
