"""Several processes through torchrun (gloo on CPU): 2 processes with half the global batch each
train both stages (stage 1 with hard negatives) to the weights of 1 process with the whole batch and
print its losses, a killed 2-process run resumes to the same weights, and each process draws its own
dropout masks."""
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cli
import clip_weights
import image_store
import synth
import train as train_py
from adapt import AdaptConfig, build_model
from model import CLIP
from tiny import tiny_clip_config

ROOT = Path(__file__).parent.parent
# gloo, on any machine: a CUDA host may have fewer GPUs than processes
CPU = ["--device", "cpu", "--workers", "0", "--log_every", "2"]
# stage 1 with hard negatives: each process rewrites its own samples' captions, and Eq. 6 gathers them
STAGE_1 = [*CPU, "--epochs", "1", "--max_steps", "8", "--batch_size", "8", "--save_every", "2", "--hard_negatives", "3"]
STAGE_2 = [*CPU, "--epochs", "1", "--max_steps", "4", "--batch_size", "4", "--layers", "1", "--ffn", "64",
           "--dropout", "0"]  # dropout draws other masks in 2 processes than in 1


def command(script, processes, *flags, writes=None):
    """The command line of a run; `writes`: a file that lists each file the run writes, by rank."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                "--standalone"] if processes > 1 else [sys.executable]
    recorder = [str(ROOT / "tests" / "record_writes.py"), str(writes)] if writes else []
    return launcher + recorder + [str(ROOT / script), "--data", "synth", *flags]


def train(script, processes, *flags, writes=None):
    result = subprocess.run(command(script, processes, *flags, writes=writes), cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def weights(out_dir):
    return torch.load(Path(out_dir) / "last.pt", weights_only=True)["model"]


def assert_same_weights(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Stage 1 and stage 2, each in 1 and in 2 processes, on the same small synthetic data."""
    tmp = tmp_path_factory.mktemp("ddp")
    synth.write_synth(tmp / "synth", 60, seed=1)
    out = {}
    for processes in (1, 2):
        out[1, processes] = tmp / f"adapt{processes}"
        out["log", 1, processes] = log = train("adapt.py", processes, "--data_root", str(tmp / "synth"),
                                               "--out_dir", str(out[1, processes]), *STAGE_1,
                                               writes=tmp / f"writes_1_{processes}.txt")
        assert (f"\n{processes} processes" in log) == (processes > 1)
        assert log.count("holds 60 pairs, not the 5600 asked for") == 1, log  # rank 0 alone checks the data
    for processes in (1, 2):
        out[2, processes] = tmp / f"caption{processes}"
        out["log", 2, processes] = train("caption.py", processes, "--data_root", str(tmp / "synth"),
                                         "--out_dir", str(out[2, processes]), "--init_from", str(out[1, 1] / "best.pt"),
                                         *STAGE_2, writes=tmp / f"writes_2_{processes}.txt")
    out["tmp"] = tmp
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_two_processes_reach_the_weights_of_one(runs, stage):
    assert_same_weights(weights(runs[stage, 1]), weights(runs[stage, 2]))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_two_processes_print_the_loss_of_one(runs, stage):  # the global batch's, not rank 0's half of it
    losses = [re.findall(r" loss (\S+)", runs["log", stage, processes]) for processes in (1, 2)]
    assert losses[0] == losses[1] and len(losses[0]) >= 2


@pytest.mark.slow
def test_the_runs_compared_did_train(runs):
    start = torch.load(runs[1, 1] / "best.pt", weights_only=True)["model"]["clip.visual.conv1.weight"]
    trained = weights(runs[2, 2])["encoder.clip.visual.conv1.weight"]  # stage 2 started from that best.pt
    assert (trained - start).abs().max() > 1e-4


@pytest.mark.slow
def test_rank_0_alone_writes_the_run(runs):
    for stage in (1, 2):
        files = sorted(p.name for p in runs[stage, 2].iterdir())
        written_by_stage_2 = ["examples.png", "test_predictions.json"] if stage == 2 else []
        expected = sorted(["best.pt", "last.pt", "metrics.json", *written_by_stage_2])
        assert files == expected
        for processes in (1, 2):  # two processes writing one file at once could leave it broken
            writes = [line.split() for line in (runs["tmp"] / f"writes_{stage}_{processes}.txt").read_text().splitlines()]
            assert {rank for rank, _ in writes} == {"0"} and set(expected) <= {name for _, name in writes}, writes


@pytest.mark.slow
def test_a_killed_two_process_run_resumes(runs):
    out = runs["tmp"] / "killed"
    flags = ["--data_root", str(runs["tmp"] / "synth"), "--out_dir", str(out), *STAGE_1]
    proc = subprocess.Popen(command("adapt.py", 2, *flags), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 300
    while not (out / "last.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # torchrun ends both processes, mid-epoch
    proc.wait()
    step = torch.load(out / "last.pt", weights_only=True)["state"]["step"]
    assert 0 < step < 8
    log = train("adapt.py", 2, *flags, "--resume")
    assert f"at step {step}" in log, log
    assert_same_weights(weights(out), weights(runs[1, 2]))


DROPOUT = """
import sys, torch
import cli
import train
from adapt import AdaptConfig
from test_training_loop import ToyPairs
from tiny import tiny_pair_encoder

masks, cfg = [], AdaptConfig(out_dir=sys.argv[1], device="cpu", epochs=1, max_steps=1, batch_size=4, workers=0)
cli.setup_device(cfg)
torch.manual_seed(cfg.seed)  # as train.start_run seeds every process
model = tiny_pair_encoder()
loss = model.forward

def dropping(*batch):  # the loss, and a dropout mask drawn as a dropout layer would
    masks.append(torch.nn.functional.dropout(torch.ones(64), 0.5, training=True))
    return loss(*batch)

def run(argv):
    train.fit(cfg, model, ToyPairs(), lambda: (0.0, {}), model.new_parameter_names(), "cosine")
    first, second = cli.gather_objects(masks[0])
    if cli.rank() == 0:
        print("masks", "equal" if torch.equal(first, second) else "differ")

model.forward = dropping
cli.main(run)  # ends as the stage files do: every process leaves the process group together
"""


@pytest.mark.slow
def test_each_process_draws_its_own_dropout_masks(tmp_path):
    (tmp_path / "dropping.py").write_text(DROPOUT)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]
    result = subprocess.run(launcher + [str(tmp_path / "dropping.py"), str(tmp_path / "out")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
                                [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "masks differ" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("rank, local_rank, order", [
    (0, 0, ["generated", "stored", "turn", "turn", "turn"]),  # rank 0 first, while all others wait
    (2, 0, ["turn", "generated", "stored", "turn", "turn"]),  # then the first of another machine, which may have a
    (3, 1, ["turn", "turn", "stored", "turn"]),  # disk of its own; then the others read what is there
])
def test_the_first_process_of_each_machine_readies_its_data_in_turn(rank, local_rank, order, tmp_path, monkeypatch):
    synth.write_synth(tmp_path / "synth", 30, seed=1)
    events = []
    monkeypatch.setattr(cli, "rank", lambda: rank)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(cli, "gather_objects", lambda obj: events.append("turn") or [obj])
    monkeypatch.setattr(synth, "ensure_synth", lambda root: events.append("generated"))
    monkeypatch.setattr(image_store, "ImageStore", lambda *args: events.append("stored"))
    cfg = AdaptConfig(data="synth", data_root=str(tmp_path / "synth"), out_dir=str(tmp_path / "out"), cache=True,
                      batch_size=16)
    train_py.prepare_data(cfg, 32)
    assert events == order


@pytest.mark.parametrize("rank, local_rank, order", [
    (0, 0, ["loaded", "turn", "turn", "turn"]),  # rank 0 downloads OpenAI's file while all others wait
    (2, 0, ["turn", "loaded", "turn", "turn"]),  # then the first of another machine, whose cache may be its own
    (3, 1, ["turn", "turn", "loaded", "turn"]),  # then the others, which find it cached
])
def test_openais_weights_are_fetched_in_turn_so_a_machine_downloads_them_once(rank, local_rank, order, monkeypatch):
    events, clip = [], CLIP(dataclasses.replace(tiny_clip_config(layers=2), context_length=32))
    monkeypatch.setattr(cli, "rank", lambda: rank)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(cli, "gather_objects", lambda obj: events.append("turn") or [obj])
    monkeypatch.setattr(clip_weights, "load", lambda name: events.append("loaded") or clip)
    assert build_model(AdaptConfig(init="openai", n_intra=1, n_inter=1)).clip is clip
    assert events == order


def test_a_turn_that_fails_stops_the_processes_after_it_with_its_line(monkeypatch):
    shared = []
    monkeypatch.setattr(cli, "gather_objects", lambda obj: shared.append(obj) or [obj])
    with pytest.raises(FileNotFoundError), train_py.in_turns():  # rank 0's turn, the first
        raise FileNotFoundError("nothere.pt: no such file")
    assert shared == ["nothere.pt: no such file"]  # what every process learns at the end of the turn

    monkeypatch.setattr(cli, "rank", lambda: 3)  # a later turn's process: it stops with that line
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cli, "gather_objects", lambda obj: ["nothere.pt: no such file", None, None, obj])
    with pytest.raises(train_py.InputError, match="^nothere.pt: no such file$"), train_py.in_turns():
        raise AssertionError("a turn after a failed one does not run")


@pytest.mark.slow
def test_data_that_rank_0_finds_bad_stops_both_processes_in_one_line(tmp_path):
    synth.write_synth(tmp_path / "synth", 30, seed=1)
    (tmp_path / "synth" / "splits.json").write_text("{")
    result = subprocess.run(command("adapt.py", 2, *CPU, "--data_root", str(tmp_path / "synth"), "--out_dir",
                                    str(tmp_path / "run")), cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode != 0 and result.stderr.count(": error: ") == 1, result.stderr[-3000:]
    assert "splits.json: malformed JSON" in result.stderr and "[rank1]" not in result.stderr, result.stderr[-3000:]
