"""Bad or unusual input, as a new user or an adversarial tester would give it: each is refused with
one line naming the flag, file or id and what was expected (exit status 2, no traceback), and
nothing on disk changes; or it is handled as the user meant it."""
import contextlib
import dataclasses
import errno
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import typing
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import adapt
import bench
import caption
import cli
import clip_weights
import data
import evaluate
import pretrain
import synth
import train
import tokenizer
from cli import InputError
from model import CLIP, Captioner, CaptionerConfig, CLIPConfig
from tiny import tiny_pair_encoder

SMALL = ["--data", "synth", "--epochs", "1", "--max_steps", "2", "--batch_size", "16", "--workers", "0"]


def error_of(capsys, run, *argv):
    """The one stderr line of the command line `run` given argv, which must end in a refusal."""
    with pytest.raises(SystemExit) as exit:
        cli.main(run, [str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


def snapshot(folder):
    """Every file below `folder` with its bytes: what "nothing on disk changes" compares."""
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad") / "synth"
    synth.write_synth(root, 30, seed=2)
    return root


@pytest.fixture(scope="module")
def stage_1(root, tmp_path_factory):
    """A finished small stage-1 run."""
    out = tmp_path_factory.mktemp("runs") / "adapt"
    cli.main(adapt.main, SMALL + ["--data_root", str(root), "--out_dir", str(out)])
    return out


@pytest.fixture(scope="module")
def unfinished(stage_1, tmp_path_factory):
    """stage_1 as if killed while it scored the test split: trained, resumable, not finished."""
    out = tmp_path_factory.mktemp("runs") / "unfinished"
    shutil.copytree(stage_1, out, ignore=shutil.ignore_patterns("metrics.json"))
    return out


# ---------------------------------------------------------------------------------------------
# runs: an earlier run, a concurrent run, a killed write
# ---------------------------------------------------------------------------------------------
def test_an_earlier_run_is_kept_unless_resumed_or_overwritten(root, tmp_path, capsys):
    out = tmp_path / "run"
    flags = SMALL + ["--data_root", root, "--out_dir", out]
    cli.main(adapt.main, [str(f) for f in flags])
    before = snapshot(out)
    assert sorted(p.name for p in before) == ["best.pt", "last.pt", "metrics.json"]
    error = error_of(capsys, adapt.main, *flags)  # finished: nothing is left to resume, and --resume is not offered
    assert error.endswith(f"{out} holds an earlier run (last.pt, best.pt, metrics.json): pass --overwrite to start it "
                          "anew, or another --out_dir")
    assert snapshot(out) == before
    assert error_of(capsys, adapt.main, *flags, "--resume").endswith(
        f"--resume: {out} holds a finished run ({out / 'metrics.json'}), nothing is left to train: score its best.pt "
        "with evaluate.py, or pass --overwrite to train it anew")
    assert snapshot(out) == before
    (out / "metrics.json").rename(tmp_path / "metrics.json")  # as if killed while it scored the test split
    assert error_of(capsys, adapt.main, *flags).endswith(f"{out} holds an earlier run (last.pt, best.pt): pass --resume "
                                                         "to continue it, --overwrite to start it anew, or another --out_dir")
    (tmp_path / "metrics.json").rename(out / "metrics.json")
    (out / "last.pt").rename(tmp_path / "last.pt")  # without it there is nothing to resume: --resume is not offered
    assert error_of(capsys, adapt.main, *flags).endswith(f"{out} holds an earlier run (best.pt, metrics.json): pass "
                                                         "--overwrite to start it anew, or another --out_dir")
    (tmp_path / "last.pt").rename(out / "last.pt")
    (out / "last.pt.tmp").write_bytes(b"half a checkpoint")  # a write killed in the earlier run
    (out / "notes.tmp").write_text("the user's own")
    cli.main(adapt.main, [str(f) for f in flags + ["--overwrite", "--seed", "7"]])
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "last.pt", "metrics.json", "notes.tmp"]
    assert torch.load(out / "last.pt", weights_only=True)["config"]["seed"] == 7


@pytest.mark.parametrize("name", [".lock", "metrics.json", "last.pt"])
def test_a_folder_where_a_run_writes_a_file_is_refused_before_any_work(name, root, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    (out / name / "kept").mkdir(parents=True)
    monkeypatch.setattr(train, "prepare_data", lambda *a, **k: pytest.fail("read the data"))
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", out, "--overwrite")
    assert error.endswith(f"{out / name} is a folder: expected the run's file of that name, or none; move it away")
    assert [p.relative_to(out) for p in sorted(out.rglob("*"))] == [Path(name), Path(name, "kept")]


def test_a_checkpoint_write_a_killed_run_left_goes_when_the_next_run_takes_the_folder(root, tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "last.pt.tmp").write_bytes(b"half a checkpoint")
    (out / "best.pt.tmp").write_bytes(b"half a checkpoint")
    (out / "notes.tmp").write_text("the user's own")

    def killed(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "update", killed)
    with pytest.raises(KeyboardInterrupt):
        adapt.main([str(f) for f in SMALL + ["--data_root", root, "--out_dir", out]])
    assert os.listdir(out) == ["notes.tmp"]


def test_a_run_finished_in_the_folder_while_another_started_there_is_kept(root, stage_1, tmp_path, capsys, monkeypatch):
    """Two runs started together on one folder: the later to reach training finds the other's results there."""
    out, lock = tmp_path / "run", train.locked

    @contextlib.contextmanager
    def finished_meanwhile(folder):  # the other run trained, scored and let go while this one started
        shutil.copytree(stage_1, folder, dirs_exist_ok=True)
        with lock(folder):
            yield
    monkeypatch.setattr(train, "locked", finished_meanwhile)
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", out)
    assert error.endswith(f"{out} holds an earlier run (last.pt, best.pt, metrics.json): pass --overwrite to start it "
                          "anew, or another --out_dir")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in stage_1.iterdir()}


HOLD = """
import multiprocessing, os, signal, sys, time
from pathlib import Path
import train

with train.locked(Path(sys.argv[1])):  # as a run holds its folder
    if sys.argv[2] == "killed":
        worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        worker.start()  # as a loader worker is, which outlives its killed run for a while
        Path(sys.argv[1], "worker.pid").write_text(str(worker.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    print("held", flush=True)
    time.sleep(60)
"""


def hold(out, how):
    """A process holding the lock of `out`: "running" says so on its stdout; "killed" dies holding it,
    its forked worker (which would keep a pipe open) left alive."""
    return subprocess.Popen([sys.executable, "-c", HOLD, str(out), how], cwd=Path(__file__).parent.parent, text=True,
                            stdout=subprocess.PIPE if how == "running" else subprocess.DEVNULL)


def test_a_second_run_on_a_folder_in_use_is_refused_before_it_builds_anything(root, tmp_path, capsys, monkeypatch):
    out = tmp_path / "busy"
    monkeypatch.setattr(adapt, "build_model", lambda cfg: pytest.fail("built the model of a run it then refused"))
    with hold(out, "running") as first:  # closes its pipe and waits for it
        try:
            assert first.stdout.readline() == "held\n"
            error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", out)
        finally:
            first.kill()
    assert error.endswith(f"{out} is in use by another run; wait for it, or give another --out_dir")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # the refused run wrote nothing


def test_the_folder_of_a_killed_run_is_free_at_once_for_its_resume(tmp_path):
    out = tmp_path / "killed"
    with hold(out, "killed"):
        pass  # waits for it to die
    worker = int((out / "worker.pid").read_text())
    try:
        with train.locked(out):  # while the killed run's worker still lives
            os.kill(worker, 0)
    finally:
        os.kill(worker, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# flags: choices and ranges, checked before anything is built, downloaded or written
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--init", "OpenAI"], "argument --init: invalid choice: 'OpenAI'"),
    (["--preset", "tiny"], "argument --preset: invalid choice: 'tiny'"),
    (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
    (["--data", "foo"], "argument --data: invalid choice: 'foo'"),
    (["--lr=-1e-3"], "--lr -0.001: expected a value >= 0"),
    (["--lr_clip=-1"], "--lr_clip -1.0: expected a value >= 0"),
    (["--grad_clip=-1"], "--grad_clip -1.0: expected a value >= 0"),
    (["--batch_size", "0"], "--batch_size 0: expected a value >= 1"),
    (["--save_every", "0"], "--save_every 0: expected a value >= 1"),
    (["--log_every", "0"], "--log_every 0: expected a value >= 1"),
    (["--epochs", "0"], "--epochs 0: expected a value >= 1"),
    (["--warmup", "1.5"], "--warmup 1.5: expected a value in [0, 1]"),
    (["--lr", "inf"], "--lr inf: expected a finite value >= 0"),
    (["--lr", "0", "--lr_clip", "0"], "--lr 0 and --lr_clip 0: nothing would train"),
    (["--beta2", "1"], "--beta2 1.0: expected a value in [0, 0.9999]"),  # AdamW's second moment would never move
    (["--seed", "-1"], "--seed -1: expected a value in [0, 4294967295]"),
    (["--workers", "1" + "0" * 20], "--workers 100000000000000000000: expected a value in [-1, 256]"),  # not as many forks
    (["--epochs", str(2**63)], "--epochs 9223372036854775808: expected a value below 2**63, as torch's sizes and counts"),
    (["--seed", "1" + "0" * 400], "expected a value in [0, 4294967295]"),
    (["--device", "tpu"], "--device tpu: expected auto, cpu, cuda or cuda:N"),
    (["--device", "cpu:3"], "--device cpu:3: expected auto, cpu, cuda or cuda:N"),
    (["--device", "meta"], "--device meta: expected auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "--device cuda:99: "),
    (["--out_dir", "a_file/run"], "a_file is not a folder"),
    (["--out_dir", "a_link/run"], "a_link is not a folder"),  # a link to nowhere
    (["--data_root", "a_file/synth"], "--data_root a_file/synth: "),  # where the synthetic data would go
    (["--data", "clevr"], "data/clevr: no such folder (--data_root); expected CLEVR-Change's layout"),
    (["--data", "clevr", "--data_root", "nowhere"], "nowhere: no such folder (--data_root); expected CLEVR-Change's"),
    (["--resume", "--overwrite"], "--resume continues the run in --out_dir and --overwrite starts it anew: give one"),
    (["--hard_negatives", "-1"], "--hard_negatives -1: expected a value in [0, 64]"),
    (["--hard_negatives", "65"], "--hard_negatives 65: expected a value in [0, 64]"),
    (["--rewrites", "retrieve,swap"], "--rewrites retrieve,swap: expected some of retrieve,replace,confuse, comma-separated"),
])
def test_flags_are_checked_before_anything_is_built(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)  # data/ and out/ are relative to here
    monkeypatch.setattr(clip_weights, "load", lambda *a, **k: pytest.fail("downloaded or loaded CLIP"))
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "a_link").symlink_to(tmp_path / "nowhere")
    assert message in error_of(capsys, adapt.main, *flags)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "a_link"]  # no data generated, no run folder


def test_both_ends_of_a_flags_range_are_accepted():
    cfg = train.parse_config(adapt.AdaptConfig, [
        "--warmup", "1", "--beta2", "0.9999", "--seed", "4294967295", "--max_steps", "0", "--grad_clip", "0", "--workers", "256"])
    assert (cfg.warmup, cfg.beta2, cfg.seed, cfg.max_steps, cfg.grad_clip, cfg.workers) == (1, 0.9999, 2**32 - 1, 0, 0, 256)
    cfg = train.parse_config(caption.CaptionConfig, [
        "--dropout", "0.99", "--attn_dropout", "0.99", "--max_len", "2", "--patience", "0"])
    assert (cfg.dropout, cfg.attn_dropout, cfg.max_len, cfg.patience) == (0.99, 0.99, 2, 0)


def test_a_file_or_an_empty_folder_as_the_data_root_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(adapt, "build_model", lambda *a: pytest.fail("built the model"))
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "empty").mkdir()  # made by hand for the synthetic data, which is drawn into a new folder
    assert error_of(capsys, adapt.main, "--data_root", "a_file").endswith(
        f"--data_root a_file: {tmp_path / 'a_file'} is not a folder")
    assert error_of(capsys, adapt.main, "--data_root", "empty").endswith(
        "--data_root empty: an empty folder; the synthetic data is drawn into a folder that does not exist yet: "
        "remove it, or give another --data_root")
    assert sorted(os.listdir(tmp_path)) == ["a_file", "empty"] and os.listdir("empty") == []


def test_a_batch_that_does_not_split_over_the_processes_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    assert error_of(capsys, adapt.main, "--batch_size", "5").endswith("--batch_size 5 does not split evenly over 2 processes")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flag, error", [("--epochs=0", "--epochs 0: expected a value >= 1"),
                                         ("--batch_size=15", "--batch_size 15 does not split evenly over 2 processes")])
def test_under_torchrun_bad_input_is_said_by_the_first_process_of_each_machine(flag, error, tmp_path, capsys, monkeypatch):
    """Till training begins, the processes of a machine read the same flags and files and fail alike."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli, "training_begun", False)  # as a process starts
    for local_rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as exit:
            cli.main(adapt.main, [flag])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and len(err.splitlines()) == err.count(f": error: {error}") == lines
    assert os.listdir(tmp_path) == []


def test_under_torchrun_a_damaged_last_pt_is_said_by_the_first_process_of_each_machine(root, unfinished, tmp_path,
                                                                                     capsys, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(unfinished, out)
    torch.save(edited_model(out / "last.pt", lambda m: m["pair_pos"].fill_(math.nan)), out / "last.pt")
    monkeypatch.setattr(cli, "training_begun", False)  # as a process starts
    for local_rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit):
            cli.main(adapt.main, [str(a) for a in [*SMALL, "--data_root", root, "--out_dir", out, "--resume"]])
        assert capsys.readouterr().err.count("its weights are not all finite") == lines


def test_under_torchrun_memory_that_runs_out_is_said_by_every_process(capsys, monkeypatch):
    """One process may meet a GPU that another job fills."""
    def builds(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(cli, "training_begun", False)
    with pytest.raises(SystemExit):
        cli.main(builds, [])
    assert ": error: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB; " in capsys.readouterr().err


def test_more_torchrun_processes_than_gpus_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)  # the first process of `torchrun --nproc_per_node 2`: the second fails alike
    assert error_of(capsys, adapt.main).endswith("torchrun started 2 processes on this machine, one a GPU, but 1 CUDA "
                                                 "GPUs are visible: give --nproc_per_node 1 or less, or --device cpu")
    assert os.listdir(tmp_path) == [] and not torch.distributed.is_initialized()


def test_an_out_dir_that_cannot_be_written_is_refused_before_any_work(root, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only disk, as root meets it too
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "run")
    assert error.endswith(f"--out_dir {tmp_path / 'run'}: {tmp_path} is not writable")
    assert list(tmp_path.iterdir()) == []


def test_caption_py_without_java_is_refused_before_any_work(root, stage_1, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # validation scores in Java, and no java is on this PATH
    flags = [*SMALL, "--data_root", root, "--out_dir", tmp_path / "run", "--init_from", stage_1 / "best.pt"]
    assert error_of(capsys, caption.main, *flags, "--heads", 3).endswith(": --heads 3: expected a divisor of the width 64")
    monkeypatch.setattr(train, "prepare_data", lambda *args: pytest.fail("read the data before the refusal"))
    error = error_of(capsys, caption.main, *flags)
    assert error.endswith("scoring captions needs a Java runtime (METEOR and the PTB tokenizer of pycocoevalcap run "
                          "in it), but `java` is not on PATH: install one, e.g. `apt-get install default-jre-headless` "
                          "(Debian/Ubuntu) or `conda install openjdk`")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code, one_line", [(errno.ENOSPC, True), (errno.EIO, False)])
def test_synth_py_on_a_full_disk_says_so_in_one_line(code, one_line, tmp_path):
    """Every image write fails as the disk would, in the pool's workers too (they are forked from this)."""
    fail = ("import errno, runpy, sys; from PIL import Image\n"
            f"def fail(*args, **kwargs): raise OSError({code}, 'as the disk would')\n"
            "Image.Image.save, sys.argv = fail, ['synth.py', '--out', sys.argv[1], '--pairs', '10']\n"
            "runpy.run_path('synth.py', run_name='__main__')")
    out = tmp_path / "new" / "folders" / "synth"
    result = subprocess.run([sys.executable, "-c", fail, str(out)], cwd=Path(__file__).parent.parent,
                            capture_output=True, text=True)
    if one_line:
        assert (result.returncode, result.stderr) == (2, f"synth.py: error: [Errno {code}] as the disk would: '{out}'\n")
    else:  # not the disk's space: a bug or a broken device, whose traceback stays
        assert result.returncode == 1 and "Traceback" in result.stderr
    assert list(tmp_path.iterdir()) == []  # nor the folders made for it


def test_synth_py_refuses_an_out_it_cannot_write(tmp_path):
    (tmp_path / "a_file").write_text("x")
    result = subprocess.run([sys.executable, "synth.py", "--out", str(tmp_path / "a_file" / "synth"), "--pairs", "10"],
                            cwd=Path(__file__).parent.parent, capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.endswith(f"{tmp_path / 'a_file'} is not a folder\n") and result.stderr.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


@pytest.mark.parametrize("argv", [["adapt.py"], ["caption.py"], ["evaluate.py"], ["synth.py", "--out", "x"], ["bench.py", "clip"]])
def test_a_mistyped_flag_is_one_line_without_the_usage(argv):
    result = subprocess.run([sys.executable, *argv, "--epocs", "2"], cwd=Path(__file__).parent.parent,
                            capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"{argv[0]}: error: unrecognized arguments: --epocs 2\n"


@pytest.mark.parametrize("argv, message", [
    (["loader"], "loader times a dataset's loading: give its folder as --data_root"),
    (["loader", "--data_root", "nowhere"], "--data_root nowhere: expected a dataset folder"),
    (["train", "--amp", "fp8"], "argument --amp: invalid choice: 'fp8'"),
    (["train", "--batch", "0"], "--batch 0: expected a finite value above 0"),
    (["clip", "--repeats", "0"], "--repeats 0: expected a finite value above 0"),
    (["train", "--fit_steps", "0"], "--fit_steps 0: expected a finite value above 0"),
    (["decode", "--pairs", str(2**63 - 1), "--repeats", "1"], "out of memory: Storage size calculation overflowed with "
                                                             f"sizes=[{2**63 - 1}, 100, 512]"),
    (["decode", "--pairs", str(2**63)], f"--pairs {2**63}: expected a value below 2**63, as torch's sizes and counts"),
    (["clip", "--images", str(10**20)], f"--images {10**20}: expected a value below 2**63, as torch's sizes and counts"),
    (["train", "--modes", "eagr"], "argument --modes: invalid choice: 'eagr'"),
    (["train", "--hard_negatives", "0", "65"], "--hard_negatives 65: expected 0 to 64 a pair"),
    (["train", "--stage", "2", "--hard_negatives", "6"], "--hard_negatives has no use in stage 2"),
    (["train", "--device", "tpu"], "--device tpu: expected auto, cpu, cuda or cuda:N"),
    (["loader", "--data_root", ".", "--workers_list", "-2"], "--workers_list -2: expected worker counts of 0 to 256"),
    (["loader", "--data_root", ".", "--workers_list", "4", "4000"], "--workers_list 4000: expected worker counts of 0 to 256"),
    (["train", "--workers", "-5", "--steps", "1"], "--workers -5: expected -1 (from the machine's cores) or 0 to 256"),
    (["train", "--workers", "257", "--steps", "1"], "--workers 257: expected -1 (from the machine's cores) or 0 to 256"),
    (["decode", "--data_root", ".", "--repeats", "1"], "--data_root has no use in the decode check, which takes "
                                                       "--pairs, --repeats"),
    (["clip", "--steps", "5"], "--steps has no use in the clip check, which takes --images, --texts, --repeats"),
    (["train", "--fit_steps", "5"], "--fit_steps has no use in the train check without --data_root, which takes"),
    (["loader", "--data_root", ".", "--amp", "bf16"], "--amp has no use in the loader check, which takes --stage"),
    (["train", "--preset", "small", "--modes", "eager", "--batch", "1", "--steps", "1", "--amp", "off", "--peak_tflops",
      "989"], "--peak_tflops has no use without --amp bf16, the precision whose MFU it gives"),
])
def test_bench_py_refuses_bad_flags_in_one_line(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    with pytest.raises(SystemExit) as exit:
        cli.main(bench.main)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("bench.py: error: ") and message in err and err.count("\n") == 1


def test_flags_the_model_cannot_take_are_one_line_and_write_nothing(root, stage_1, tmp_path, capsys):
    shutil.copytree(root, tmp_path / "data", ignore=shutil.ignore_patterns("store_*"))  # no image store yet
    earlier, at = snapshot(tmp_path), ["--data_root", tmp_path / "data"]
    assert error_of(capsys, caption.main, *SMALL, *at, "--out_dir", tmp_path / "c", "--init_from",
                    stage_1 / "best.pt", "--heads", 3).endswith(": --heads 3: expected a divisor of the width 64")
    for run, stage in ((adapt.main, []), (caption.main, ["--init_from", stage_1 / "best.pt"])):
        assert error_of(capsys, run, *SMALL, *at, "--out_dir", tmp_path / "a", *stage, "--batch_size", 1000).endswith(
            f"--batch_size 1000: expected at most the {120 if run is adapt.main else 24} training samples")
    assert error_of(capsys, caption.main, *SMALL, *at, "--out_dir", tmp_path / "c", "--init_from",
                    "openai", "--lr_clip", 0).endswith("--lr_clip 0 with --init_from openai would leave e1, e2 and p "
                                                       "as drawn: freeze a pair encoder that stage 1 trained")
    stage_2 = [*SMALL, *at, "--out_dir", tmp_path / "c", "--init_from", stage_1 / "best.pt"]
    assert error_of(capsys, caption.main, *stage_2, "--ffn", 10**15).endswith(  # beyond any address space
        "out of memory: can't allocate memory: you tried to allocate 256000000000000000 bytes. Error code 12 (Cannot "
        "allocate memory); a smaller batch or model, or fewer loader workers, needs less")
    assert error_of(capsys, caption.main, *stage_2, "--ffn", 2**62).endswith(  # more bytes than 64 bits count
        f"out of memory: Storage size calculation overflowed with sizes=[{2**62}, 64]; a smaller batch or model, or "
        "fewer loader workers, needs less")
    assert error_of(capsys, caption.main, *stage_2, "--ffn", 10**20).endswith(  # not a size torch can hold
        "--ffn 100000000000000000000: expected a value below 2**63, as torch's sizes and counts are 64-bit")
    assert snapshot(tmp_path) == earlier and [p.name for p in tmp_path.iterdir()] == ["data"]  # no image store


@pytest.mark.slow  # whole runs of both stages, scored with Java
def test_a_flag_the_run_would_not_read_is_refused(root, stage_1, tmp_path, capsys):
    at, best = ["--data_root", root, "--out_dir", tmp_path / "run"], stage_1 / "best.pt"
    assert error_of(capsys, adapt.main, *SMALL, *at, "--init", "random", "--clip", "ViT-L/14").endswith(
        "--clip ViT-L/14: read only with --init openai, and this run starts from random weights")
    assert error_of(capsys, adapt.main, *SMALL, *at, "--data", "clevr", "--data_root", tmp_path, "--preset", "small",
                    "--init", "openai").endswith("--preset small: the shape of a CLIP from random weights (--init random); "
                                                 "with --init openai, the --clip file gives it")
    assert error_of(capsys, caption.main, *SMALL, *at, "--init_from", best, "--clip", "ViT-L/14").endswith(
        f"--clip ViT-L/14: read only with --init_from openai, and the pair encoder comes from {best}")
    for flag, value, held in (("n_intra", 3, 2), ("n_inter", 1, 2)):  # the stage-1 run: 2 + 2 layers
        assert error_of(capsys, caption.main, *SMALL, *at, "--init_from", best, f"--{flag}", value).endswith(
            f"--{flag} {value}: the pair encoder in {best} has {flag} {held}; expected that or no flag (an authors' "
            "file is split by --n_intra)")
    assert not (tmp_path / "run").exists()
    cli.main(caption.main, [str(a) for a in (*SMALL, *at, "--init_from", best, "--n_intra", 2, "--n_inter", 2)])
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_overwrite_is_refused_where_it_would_replace_the_stage_1_file_the_run_starts_from(root, stage_1, tmp_path,
                                                                                          capsys):
    out = tmp_path / "run"
    shutil.copytree(stage_1, out)
    (tmp_path / "link.pt").symlink_to(out / "best.pt")
    before = snapshot(out)
    for init in (out / "best.pt", tmp_path / "link.pt"):
        assert error_of(capsys, caption.main, *SMALL, "--data_root", root, "--out_dir", out, "--overwrite",
                        "--init_from", init).endswith(
            f"--init_from {init}: a file of the run in --out_dir, which --overwrite replaces; copy it elsewhere "
            "first, or pick another --out_dir")
    assert snapshot(out) == before


def test_memory_that_runs_out_is_one_line_and_other_runtime_errors_keep_their_traceback(capsys):
    def cuda_oom(argv):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.06 GiB is free. See documentation for Memory "
                                     "Management (https://pytorch.org/docs/stable/notes/cuda.html)")
    assert error_of(capsys, cuda_oom).endswith("error: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB. "
                                               "GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. See "
                                               "documentation for Memory Management (https://pytorch.org/docs/stable/"
                                               "notes/cuda.html); a smaller batch or model, or fewer loader workers, "
                                               "needs less")

    class Hungry(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            raise MemoryError

    def in_a_loader_process(argv):
        next(iter(torch.utils.data.DataLoader(Hungry(), num_workers=1)))
    assert error_of(capsys, in_a_loader_process).endswith(
        "error: out of memory: MemoryError; a smaller batch or model, or fewer loader workers, needs less")

    def no_memory_to_fork(argv):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    assert error_of(capsys, no_memory_to_fork).endswith("error: out of memory: [Errno 12] Cannot allocate memory; a "
                                                        "smaller batch or model, or fewer loader workers, needs less")

    def bug(argv):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        cli.main(bug, [])


def test_a_failed_download_is_one_line(root, tmp_path, capsys, monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("cannot download https://x/ViT-B-32.pt (no route). No network? Download the file ...")

    monkeypatch.setattr(clip_weights, "download", offline)
    error = error_of(capsys, adapt.main, "--data_root", root, "--out_dir", tmp_path / "a", "--clip", "ViT-B/32")
    assert error.endswith("cannot download https://x/ViT-B-32.pt (no route). No network? Download the file ...")
    assert not (tmp_path / "a").exists()


def said_defaults(text, help):
    """{"default": "12", "--data synth": "5", "--recipe authors --data spot or birds": "20", ...} of a flag's help."""
    after = text.split(help, 1)[1]
    said = after[2:].split(")")[0] if after.startswith(" (") else ""
    return dict(part.split(": ", 1) for part in said.split("; ") if ": " in part)


@pytest.mark.parametrize("run, config", [(adapt.main, adapt.AdaptConfig), (caption.main, caption.CaptionConfig),
                                         (pretrain.main, pretrain.PretrainConfig)])
def test_help_describes_every_flag_and_its_default_on_each_dataset_and_recipe(run, config, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # a help on one line: argparse breaks lines at hyphens
    with pytest.raises(SystemExit):
        run(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    datasets = typing.get_args(config.__dataclass_fields__["data"].type) if config is not pretrain.PretrainConfig else [None]
    for f in dataclasses.fields(config):
        help = config.meta(f.name).get("help", "").replace("<stage>", config.stage)
        assert help and f"--{f.name}" in text and help in text, f"--{f.name} has no description"
        said = said_defaults(text, help)
        for data_set, recipe in itertools.product(datasets, ("paper", "authors")):
            cfg = config(data=data_set, recipe=recipe) if data_set else config()
            by_recipe = next((v for k, v in said.items() if recipe == "authors" and k.startswith("--recipe authors")
                              and data_set in k.split("--data ")[1].split(" or ")), None)
            expected = by_recipe or said.get(f"--data {data_set}") or said.get("default")
            if expected is not None and f.name not in ("data", "recipe"):  # --data_root, --out_dir: in words
                assert expected == str(getattr(cfg, f.name)), (f.name, data_set, recipe)
    assert "--amp {auto,bf16,fp16,off}" in text and f" (default: {config().warmup}; 0 to 1) " in text  # --warmup's
    if config is adapt.AdaptConfig:
        assert "(default: 12; --data synth: 5; --recipe authors --data spot or birds: 20; at least 1)" in text


# ---------------------------------------------------------------------------------------------
# resume: any change that shapes the model, the optimiser or the data order is refused
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, changed", [
    (["--n_intra", "3", "--n_inter", "1"], "'n_intra': (2, 3)"),
    (["--weight_decay", "0.1"], "'weight_decay': (0.05, 0.1)"),
    (["--batch_size", "8"], "'batch_size': (16, 8)"),
    (["--amp", "bf16"], "'amp': ('auto', 'bf16')"),
    (["--max_steps", "3"], "'max_steps': (2, 3)"),
    (["--epochs", "2"], "'epochs': (1, 2)"),
    (["--warmup", "0.2"], "'warmup': (0.1, 0.2)"),
    (["--seed", "7"], "'seed': (42, 7)"),
    (["--hard_negatives", "6"], "'hard_negatives': (0, 6)"),
])
def test_resume_refuses_changed_settings(root, unfinished, capsys, flags, changed):
    before = snapshot(unfinished)
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", unfinished, "--resume", *flags)
    assert f"--resume: {unfinished / 'last.pt'} was trained with other settings, (saved, now): " in error
    assert changed in error
    assert snapshot(unfinished) == before


def test_a_run_saved_before_a_setting_existed_resumes_as_holding_its_default(root, unfinished, tmp_path):
    out = tmp_path / "old"
    shutil.copytree(unfinished, out)
    ckpt = torch.load(out / "last.pt", weights_only=True)
    del ckpt["config"]["hard_negatives"], ckpt["config"]["rewrites"], ckpt["model_config"]["encoder"]["clip"]["activation"]
    torch.save(ckpt, out / "last.pt")
    cli.main(adapt.main, [str(a) for a in [*SMALL, "--data_root", root, "--out_dir", out, "--resume"]])
    assert (out / "metrics.json").is_file()


def edited_model(last, edit):
    ckpt = torch.load(last, weights_only=True)
    edit(ckpt["model"])
    return ckpt


@pytest.mark.parametrize("damage, message", [
    (lambda last, best: last.write_bytes(last.read_bytes()[:100_000]), "cannot read it as a checkpoint"),
    (lambda last, best: last.write_text("not a checkpoint"), "cannot read it as a checkpoint"),
    (lambda last, best: last.write_bytes(b""), "last.pt: an empty file; expected a checkpoint"),
    (lambda last, best: torch.save({"config": {}}, last), "is not a last.pt of adapt.py or caption.py"),
    (lambda last, best: last.write_bytes(best.read_bytes()), "is not a last.pt of adapt.py or caption.py"),
    (lambda last, best: torch.save({**torch.load(last, weights_only=True), "config": "seed=7"}, last),
     "is not a last.pt of adapt.py or caption.py"),
    (lambda last, best: torch.save({**torch.load(last, weights_only=True), "state": {"best": 0.5}}, last),
     "is not a last.pt of adapt.py or caption.py"),
    (lambda last, best: torch.save({k: v for k, v in torch.load(last, weights_only=True).items() if k != "schedule"},
                                   last), "is not a last.pt of adapt.py or caption.py"),
    (lambda last, best: torch.save(edited_model(last, lambda m: m.pop("ln_inter.bias")), last),
     "does not match CLIP4IDC: missing keys: ['ln_inter.bias']"),
    (lambda last, best: torch.save(edited_model(last, lambda m: m["pair_pos"].fill_(math.nan)), last),
     "its weights are not all finite"),
    (lambda last, best: best.write_bytes(best.read_bytes()[:100_000]), "best.pt: cannot read it as a checkpoint"),
    (lambda last, best: best.unlink(), "best.pt: no such checkpoint file"),  # the model the run would score
])
def test_resume_from_a_damaged_last_pt_or_best_pt_is_refused(root, stage_1, tmp_path, capsys, damage, message):
    out = tmp_path / "run"
    out.mkdir()
    for name in ("last.pt", "best.pt"):
        (out / name).write_bytes((stage_1 / name).read_bytes())
    damage(out / "last.pt", out / "best.pt")
    before = snapshot(out)
    assert message in error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", out, "--resume")
    assert snapshot(out) == before


def test_a_resumed_stage_2_run_may_change_its_patience_alone(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    saved = caption.CaptionConfig(out_dir=str(out), patience=10)  # a run of an earlier default
    torch.save(dict(config=asdict(saved), state=dict(step=0), rng=[], model={}, model_config={}, optimizer={},
               schedule={}), out / "last.pt")
    train.check_run_folder(caption.CaptionConfig(out_dir=str(out), resume=True))  # patience 11: when to stop, alone
    with pytest.raises(InputError, match=r"'lr': \(0.001, 0.01\)"):
        train.check_run_folder(caption.CaptionConfig(out_dir=str(out), resume=True, lr=1e-2))


@pytest.mark.slow  # whole runs of both stages, scored with Java
def test_a_stage_2_run_resumes_without_its_stage_1_file_and_split_flags_that_repeat_its_encoders(
        root, stage_1, tmp_path, capsys, monkeypatch):
    init, out = tmp_path / "stage1" / "best.pt", tmp_path / "c"
    init.parent.mkdir()
    shutil.copy(stage_1 / "best.pt", init)
    flags = [str(f) for f in [*SMALL, "--epochs", 4, "--max_steps", 4, "--save_every", 1, "--data_root", root,
                              "--out_dir", out, "--layers", 1, "--ffn", 32]]
    update, steps = train.update, []

    def killed_in_step_3(*args):
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        update(*args)
    monkeypatch.setattr(train, "update", killed_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        caption.main(flags + ["--init_from", str(init)])
    assert "over a pair encoder of 2 intra + 2 inter layers" in capsys.readouterr().out  # not the flags' 9 + 3
    monkeypatch.undo()
    init.unlink()  # the stage-1 file is gone: last.pt holds the whole model
    assert torch.load(out / "last.pt", weights_only=True)["config"]["n_intra"] == 2  # no flag: the encoder's, on record
    before = snapshot(out)
    assert error_of(capsys, caption.main, *flags, "--resume", "--n_intra", 3).endswith(
        f"--n_intra 3: the pair encoder in {out / 'last.pt'} has n_intra 2; expected that or no flag (an authors' "
        "file is split by --n_intra)")
    assert snapshot(out) == before
    cli.main(caption.main, flags + ["--resume", "--init_from", f"{init.parent}/./best.pt", "--n_intra", "2",
                                      "--n_inter", "2"])  # the split it started with, now named
    last = torch.load(out / "last.pt", weights_only=True)
    assert last["state"]["step"] == 4 and last["config"]["init_from"] == str(init)  # where it started, on record
    assert json.loads((out / "metrics.json").read_text())["test"]


def test_resume_of_the_other_stages_run_names_that_stage(root, unfinished, capsys):
    before = snapshot(unfinished)
    assert error_of(capsys, caption.main, *SMALL, "--data_root", root, "--out_dir", unfinished, "--resume").endswith(
        f"--resume: {unfinished / 'last.pt'} is a run of adapt.py: resume it with adapt.py")
    assert snapshot(unfinished) == before


def test_resume_on_other_data_is_refused(unfinished, tmp_path, capsys):
    synth.write_synth(tmp_path / "other", 40, seed=2)  # --data_root may move, but this data is not the run's
    before = snapshot(unfinished), snapshot(tmp_path / "other")
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", tmp_path / "other", "--out_dir", unfinished, "--resume")
    assert error.endswith(f"--resume: {unfinished / 'last.pt'} trained on 120 samples, the data now holds 160: "
                          "resume on the same data")
    assert (snapshot(unfinished), snapshot(tmp_path / "other")) == before  # no image store built there either


def test_resume_into_a_model_of_another_shape_is_refused(root, stage_1, tmp_path, capsys):
    out = tmp_path / "run"  # as when stage 1's --clip file was swapped for one of another layer split
    out.mkdir()
    last = torch.load(stage_1 / "last.pt", weights_only=True)
    last["model_config"]["encoder"]["n_intra"] = 1
    torch.save(last, out / "last.pt")
    before = snapshot(out)
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", out, "--resume")
    assert error.endswith(f"--resume: {out / 'last.pt'} holds a model of another shape than the one built now, "
                          "(saved, now): {'encoder.n_intra': (1, 2)}; resume as the run started")
    assert snapshot(out) == before


@pytest.mark.slow  # whole runs of both stages, scored with Java
def test_resume_with_other_words_to_write_counts_them(root, stage_1, tmp_path, capsys):
    out = tmp_path / "run"
    flags = [*SMALL, "--data_root", root, "--init_from", stage_1 / "best.pt", "--out_dir", out]
    cli.main(caption.main, [str(f) for f in flags])
    (out / "metrics.json").unlink()  # as if killed while it scored the test split
    last = torch.load(out / "last.pt", weights_only=True)
    words = last["model_config"]["captioner"]["vocab"]
    last["model_config"]["captioner"]["vocab"] = words[:-1]  # as when --data_root now holds other captions
    torch.save(last, out / "last.pt")
    before, _ = snapshot(out), capsys.readouterr()
    error = error_of(capsys, caption.main, *flags, "--resume")
    assert error.endswith(f"(saved, now): {{'captioner.vocab': ('{len(words) - 1} words', '{len(words)} words, 1 of "
                          "them new')}; "
                          "resume as the run started")
    assert snapshot(out) == before


def test_resume_accepts_another_spelling_of_the_same_folder(root, unfinished, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(unfinished.parent)
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", f"{unfinished}/", "--resume",
                     "--batch_size", 8)
    assert "'batch_size': (16, 8)" in error and "out_dir" not in error.split("(saved, now)")[1]


def test_resume_without_a_run_says_so(root, tmp_path, capsys):
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "new", "--resume")
    assert error.endswith(f"--resume: there is no {tmp_path / 'new' / 'last.pt'} to resume from")
    assert not (tmp_path / "new").exists()


def interrupt(argv, ready, cwd=Path(__file__).parent.parent):
    """Run `python argv` and press Ctrl-C once `ready(its pid)`: (exit status, stderr)."""
    run = subprocess.Popen([sys.executable, *map(str, argv)], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, process_group=0,  # its loader or pool workers get the signal too, as in a terminal
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background job ignores it
    for _ in range(600):
        if ready(run.pid) or run.poll() is not None:
            break
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    return run.wait(timeout=60), run.communicate(timeout=60)[1]  # a process left behind holds stderr open


def test_ctrl_c_is_one_line_ends_by_the_signal_and_a_resume_continues_the_run(root, tmp_path):
    out = tmp_path / "run"
    flags = [*SMALL, "--max_steps", 0, "--epochs", 3, "--data_root", root, "--save_every", 1, "--out_dir", out]
    status, err = interrupt(["adapt.py", *flags], ready=lambda _: (out / "last.pt").exists())
    assert status == -signal.SIGINT and err.endswith("adapt.py: interrupted\n") and "Traceback" not in err, err
    step = torch.load(out / "last.pt", weights_only=True)["state"]["step"]
    cli.main(adapt.main, [str(f) for f in flags + ["--resume"]])
    assert 1 <= step < torch.load(out / "last.pt", weights_only=True)["state"]["step"]
    assert json.loads((out / "metrics.json").read_text())["test"]


SLOW_FEEDER = """
import multiprocessing, time
import cli

class Slow:  # pickled by the queue's feeder thread, which thus ends half a second after the queue is closed
    def __reduce__(self):
        time.sleep(0.5)
        return int, (1,)

if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Queue()  # a loader's queue: semaphores that a tracker follows
    queue.put(Slow())
    queue.close()
    del queue
    cli.end_interrupted("x.py")
"""


def test_ctrl_c_ends_once_a_closed_queue_has_let_its_semaphores_go():
    run = subprocess.run([sys.executable, "-c", SLOW_FEEDER], cwd=Path(__file__).parent.parent, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == -signal.SIGINT and run.stderr == "x.py: interrupted\n"  # no tracker warning of leaks


def test_ctrl_c_while_drawing_the_synthetic_data_leaves_nothing(tmp_path):
    status, err = interrupt(["adapt.py", "--data_root", tmp_path / "synth", "--out_dir", tmp_path / "run"],
                            ready=lambda _: any(tmp_path.glob("synth.*/images/*.png")))
    assert status == -signal.SIGINT and err.splitlines()[1:] == ["adapt.py: interrupted"], err  # after "generating"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spawned", [[], ["tests/spawned.py"]])  # forked, or spawned as on macOS
def test_ctrl_c_in_synth_py_is_one_line_and_leaves_nothing(tmp_path, spawned):
    status, err = interrupt([*spawned, "synth.py", "--out", tmp_path / "synth"],
                            ready=lambda _: any(tmp_path.glob("synth.*/images/*.png")))
    assert status == -signal.SIGINT and err == "synth.py: interrupted\n", err
    assert list(tmp_path.iterdir()) == []


def sigint_blocked(pid):
    """Whether Ctrl-C's signal is blocked in the process `pid` (Linux)."""
    mask = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigBlk"))
    return bool(int(mask.split()[1], 16) >> signal.SIGINT - 1 & 1)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_pool_and_loader_processes_never_see_ctrl_c_however_they_are_started(method):
    script = f"""
import multiprocessing, signal, torch, cli, data
from test_bad_input import sigint_blocked
multiprocessing.set_start_method("{method}")
with cli.worker_pool(2):
    print([sigint_blocked(p.pid) for p in multiprocessing.active_children()])
batches = iter(data.make_loader(torch.utils.data.TensorDataset(torch.arange(8)), 4, torch.device("cpu"), workers=2))
print([sigint_blocked(p.pid) for p in multiprocessing.active_children()], sigint_blocked("self"),
      signal.getsignal(signal.SIGINT) is signal.default_int_handler, sum(len(b) for b, in batches))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["tests", os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.stdout == "[True, True]\n[True, True] False True 8\n", run.stderr  # this process's Ctrl-C as before


def proc_stat(pid):
    """The fields of /proc/PID/stat after the command's name: state, parent's pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def spawned_children(pid):
    """The processes that `pid` has started by spawn, while they run."""
    children = set()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # one that ended meanwhile
            if int(proc_stat(proc.name)[1]) == pid and b"spawn_main" in (proc / "cmdline").read_bytes():
                children.add(int(proc.name))
    return children


def running(pid):
    with contextlib.suppress(OSError):
        return proc_stat(pid)[0] != "Z"
    return False


@pytest.mark.parametrize("cache", ["--cache", "--no-cache"])  # the first to start: the image store's pool, a loader's
def test_ctrl_c_while_spawned_processes_import_is_one_line_and_ends_them(tmp_path, cache):
    root, seen = tmp_path / "synth", set()
    synth.write_synth(root, 30, seed=2)
    flags = ["--data", "synth", "--max_steps", 2, "--workers", 2, cache, "--data_root", root, "--out_dir", tmp_path / "run"]
    try:
        status, err = interrupt(["tests/spawned.py", "adapt.py", *flags],
                                ready=lambda pid: seen.update(spawned_children(pid)) or seen)
        assert seen and status == -signal.SIGINT and err.endswith("adapt.py: interrupted\n"), err
        assert "Traceback" not in err and "Warning" not in err, err  # a process's as it imports; leaked semaphores
        assert not any(map(running, seen))
    finally:
        for pid in filter(running, seen):
            os.kill(pid, signal.SIGKILL)


def test_a_resumed_run_keeps_every_figure(root, tmp_path):
    out = tmp_path / "resumed"
    flags = [str(f) for f in SMALL + ["--data_root", root, "--out_dir", out]]
    cli.main(adapt.main, flags)
    step0 = json.loads((out / "metrics.json").read_text())["test_step0"]
    (out / "metrics.json").unlink()
    cli.main(adapt.main, flags + ["--resume", "--log_every", "5", "--workers", "1"])  # logging, loading may change
    assert json.loads((out / "metrics.json").read_text())["test_step0"] == step0


# ---------------------------------------------------------------------------------------------
# readers: types, unique ids, captions with no words
# ---------------------------------------------------------------------------------------------
def write_split(root, dataset, entries, split="test"):
    folder = root / ("annotations" if dataset == "spot" else "dataset/adobe")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{'valid' if split == 'val' else split}.json").write_text(json.dumps(entries))
    (root / ("resized_images" if dataset == "spot" else "images")).mkdir(exist_ok=True)
    for name in ("1.png", "1_2.png", "2.png", "2_2.png", "a.png", "b.png"):
        Image.new("RGB", (8, 8)).save(root / ("resized_images" if dataset == "spot" else "images") / name)
    return folder / f"{split}.json"


@pytest.mark.parametrize("dataset, entries, message", [
    ("spot", [{"img_id": 1, "sentences": ["a car left"]}, {"img_id": 2, "sentences": "the ball is gone"}],
     r"test.json: entry 1: expected a non-empty list of caption strings, got \"the ball is gone\""),
    ("spot", [{"img_id": 1, "sentences": []}], r"test.json: entry 0: expected a non-empty list of caption strings"),
    ("ier", [{"img0": "a.png", "img1": "b.png", "sents": "make it brighter", "uid": "u1"}],
     r"test.json: entry 0 \(uid 'u1'\): expected a non-empty list of caption strings"),
    ("ier", [{"img0": "a.png", "img1": "b.png", "sents": ["brighter"], "uid": "u1"},
             {"img0": "b.png", "img1": "a.png", "sents": ["darker"], "uid": "u1"}],
     r"test: ids \['u1'\] name more than one pair; each pair needs its own id"),
    ("ier", [{"img0": "a.png", "img1": "b.png", "sents": ["brighter", 7], "uid": "u1"}],
     r"entry 0 \(uid 'u1'\): expected a non-empty list of caption strings, got \[\"brighter\", 7\]"),
])
def test_readers_check_types_and_ids(tmp_path, dataset, entries, message):
    write_split(tmp_path, dataset, entries)
    with pytest.raises(InputError, match=message):
        data.read_split(dataset, tmp_path, "test")


def test_captions_without_words_are_reported_and_left_out_of_training(tmp_path, caplog):
    write_split(tmp_path, "spot", [{"img_id": 1, "sentences": ["a car left", "", " ... "]},
                                   {"img_id": 2, "sentences": ["?!"]}], split="train")
    with caplog.at_level(logging.WARNING):
        pairs = data.read_split("spot", tmp_path, "train")
    assert [(p.id, p.captions) for p in pairs] == [("1.png", ["a car left"])]
    assert "2 pairs have empty or punctuation-only captions, left out (first: 1.png, 2.png)" in caplog.text
    assert "1 pairs are left without any caption" in caplog.text


# ---------------------------------------------------------------------------------------------
# images in other modes
# ---------------------------------------------------------------------------------------------
def test_sixteen_bit_and_float_images_keep_their_values(tmp_path):
    grey16 = Image.fromarray(np.full((6, 6), 32896, dtype=np.uint16))  # 128 * 257
    grey16.save(tmp_path / "grey16.png")
    assert Image.open(tmp_path / "grey16.png").mode.startswith("I")
    Image.fromarray(np.full((6, 6), 0.5, dtype=np.float32)).save(tmp_path / "half.tif")
    Image.fromarray(np.full((6, 6), 200.0, dtype=np.float32)).save(tmp_path / "wide.tif")
    for name, value in (("grey16.png", 128), ("half.tif", 128), ("wide.tif", 200)):
        pixels = data.read_pixels(tmp_path / name, 4)
        assert pixels.shape == (3, 4, 4) and (pixels.int() - value).abs().max() <= 1, name


@pytest.mark.parametrize("workers", [0, 1])
def test_an_unreadable_training_image_is_one_line_and_leaves_no_run_folder(root, tmp_path, capsys, workers):
    shutil.copytree(root, tmp_path / "synth")
    image = tmp_path / "synth" / "images" / "CLEVR_default_000000.png"  # a training pair's
    image.write_bytes(image.read_bytes()[:200])
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", tmp_path / "synth", "--out_dir",
                     tmp_path / "new" / "run", "--no-cache", "--workers", workers, "--max_steps", 0)
    assert error.split(": error: ", 1)[1].startswith(f"{image}: cannot read image")
    assert sorted(os.listdir(tmp_path)) == ["synth"]  # nor the folders made above the run's


@pytest.mark.parametrize("disk", ["read-only", "full"])
def test_bench_py_on_a_disk_it_cannot_write_does_not_advise_a_flag_it_lacks(disk, root, tmp_path, capsys, monkeypatch):
    shutil.copytree(root, tmp_path / "synth", ignore=shutil.ignore_patterns("store_*"))
    code, reason = (errno.EROFS, "Read-only file system") if disk == "read-only" else (errno.ENOSPC, "No space left")

    def fail(*args, **kwargs):  # as on a read-only mount (which root cannot write either), or a full disk
        raise OSError(code, reason)
    monkeypatch.setattr(*(Path, "unlink") if disk == "read-only" else (data.os, "posix_fallocate"), fail)
    error = error_of(capsys, bench.main, "loader", "--data_root", tmp_path / "synth", "--preset", "small")
    store = tmp_path / "synth" / "store_128px.u8"
    assert error.endswith(f"cannot write the image store {store}{' of 4.4 MB' * (disk == 'full')} ({reason}): bench.py "
                          "times the store, so it must be written there")


def test_bench_py_times_the_loader_on_a_batch_after_the_first(root, capsys):
    error = error_of(capsys, bench.main, "loader", "--data_root", root, "--preset", "small", "--batch", 61)
    assert error.endswith("--batch 61: expected at most half the 120 training samples, for at least one timed batch")


def test_bench_py_train_refuses_a_dataset_it_cannot_read_before_timing_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(bench.main, ["train", "--preset", "small", "--amp", "off", "--modes", "eager", "--batch", "1",
                                "--steps", "1", "--data_root", str(tmp_path)])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""  # not a step timed, which on a GPU takes minutes
    assert err.split(": error: ", 1)[1].startswith(f"{tmp_path / 'splits.json'}: not found; expected CLEVR-Change's")
    assert err.count("\n") == 1


def test_an_unreadable_image_is_one_line_in_bench_py_too(root, tmp_path, capsys):
    shutil.copytree(root, tmp_path / "synth", ignore=shutil.ignore_patterns("store_*"))
    image = tmp_path / "synth" / "images" / "CLEVR_default_000000.png"
    image.write_bytes(image.read_bytes()[:200])
    error = error_of(capsys, bench.main, "loader", "--data_root", tmp_path / "synth", "--preset", "small")
    assert error.split(": error: ", 1)[1].startswith(f"{image}: cannot read image")
    assert not list((tmp_path / "synth").glob("store_*"))


@pytest.mark.slow  # whole runs of both stages, scored with Java
def test_an_unreadable_test_image_met_after_training_says_how_to_finish_the_run(root, stage_1, tmp_path, capsys):
    shutil.copytree(root, tmp_path / "synth", ignore=shutil.ignore_patterns("store_*"))
    image = tmp_path / "synth" / "sc_images" / "CLEVR_semantic_000028.png"  # a test pair's, read after training
    image.write_bytes(image.read_bytes()[:200])
    out = tmp_path / "run"
    flags = [*SMALL, "--data_root", tmp_path / "synth", "--out_dir", out, "--no-cache", "--init_from", stage_1 / "best.pt",
             "--layers", 1, "--ffn", 32]
    error = error_of(capsys, caption.main, *flags)
    assert error.split(": error: ", 1)[1].startswith(f"{image}: cannot read image")
    assert error.endswith(f"; the trained model is in {out}/best.pt: once mended, run the same command with --resume, "
                          "which trains no further and scores it")
    assert (out / "best.pt").is_file() and not (out / "metrics.json").exists()
    image.write_bytes((root / "sc_images" / image.name).read_bytes())
    caption.main([str(a) for a in [*flags, "--resume"]])
    assert "test" in json.loads((out / "metrics.json").read_text()) and (out / "examples.png").is_file()
    assert "resumed from" in capsys.readouterr().out


@pytest.mark.slow  # whole runs of both stages, scored with Java
def test_a_scorer_that_fails_after_training_says_how_to_finish_the_run(root, stage_1, tmp_path, capsys, monkeypatch):
    def java_gone(gts, res):  # METEOR runs at the test split alone: validation scores CIDEr
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(evaluate, "meteor", java_gone)
    out = tmp_path / "run"
    flags = [*SMALL, "--data_root", root, "--out_dir", out, "--init_from", stage_1 / "best.pt", "--layers", 1, "--ffn", 32]
    with pytest.raises(SystemExit):  # after the test split's progress line on stderr, the one error line
        cli.main(caption.main, [str(a) for a in flags])
    assert capsys.readouterr().err.endswith(
        f"error: [Errno 32] Broken pipe; the trained model is in {out}/best.pt: once mended, run the same command "
        "with --resume, which trains no further and scores it\n")
    assert (out / "best.pt").is_file() and not (out / "metrics.json").exists()
    monkeypatch.undo()
    caption.main([str(a) for a in [*flags, "--resume"]])
    assert "METEOR" in json.loads((out / "metrics.json").read_text())["test"]


def test_a_decompression_bomb_is_an_unreadable_image(tmp_path, monkeypatch):
    Image.new("RGB", (64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64 // 4)  # twice that and more: Pillow refuses
    with pytest.raises(InputError, match=f"{tmp_path / 'big.png'}: cannot read image"):
        data.read_pixels(tmp_path / "big.png", 16)


# ---------------------------------------------------------------------------------------------
# checkpoints and prediction files
# ---------------------------------------------------------------------------------------------
def test_checkpoints_that_are_not_ours_are_named(root, stage_1, tmp_path, capsys):
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes((stage_1 / "best.pt").read_bytes()[:1000])
    assert f"{truncated}: cannot read it as a checkpoint" in error_of(
        capsys, evaluate.main, "--ckpt", truncated, "--pair", truncated, truncated)
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    assert f"{foreign}: expected a best.pt or last.pt of adapt.py or caption.py" in error_of(
        capsys, caption.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "c", "--init_from", foreign)
    assert "holds a stage-1 pair encoder: captions need a stage-2 checkpoint" in error_of(
        capsys, evaluate.main, "--ckpt", stage_1 / "last.pt", "--pairs", foreign)  # last.pt loads like best.pt
    assert error_of(capsys, caption.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "c", "--init_from",
                    root / "splits.json").endswith(f"error: {root / 'splits.json'}: cannot read it as a checkpoint "
                                                   "(not torch's format, or it holds objects besides tensors and plain data)")
    (tmp_path / "notes.pt").write_text("hello")  # torch's legacy reader fails on it with a bare KeyError(101), the "e" of "hello"
    assert error_of(capsys, evaluate.main, "--ckpt", tmp_path / "notes.pt", "--pairs", foreign).endswith(
        f"{tmp_path / 'notes.pt'}: cannot read it as a checkpoint (KeyError: 101)")
    assert error_of(capsys, caption.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "c", "--init_from",
                    stage_1).endswith(f"{stage_1} is a folder: expected a checkpoint file, such as {stage_1 / 'best.pt'}")
    assert not (tmp_path / "c").exists()


def test_memory_that_runs_out_while_reading_a_checkpoint_is_said_as_memory_not_as_the_file(tmp_path, capsys,
                                                                                          monkeypatch):
    (tmp_path / "best.pt").write_bytes(b"a checkpoint")
    def short_of_memory(*args, **kwargs):  # torch's CPU allocator, in its words
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 200000000 bytes. Error code 12 (Cannot allocate memory)")
    monkeypatch.setattr(torch, "load", short_of_memory)
    monkeypatch.setattr(cli, "training_begun", False)
    for local_rank in ("0", "1"):  # under torchrun every process says it: one may be short of memory, another not
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert error_of(capsys, evaluate.main, "--ckpt", tmp_path / "best.pt", "--pair", tmp_path / "best.pt",
                        tmp_path / "best.pt").endswith(
            "error: out of memory: can't allocate memory: you tried to allocate 200000000 bytes. Error code 12 (Cannot "
            "allocate memory); a smaller batch or model, or fewer loader workers, needs less")


def test_a_caption_length_beyond_the_encoders_text_positions_is_refused(root, stage_1, tmp_path, capsys):
    assert error_of(capsys, caption.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "c", "--init_from",
                    stage_1 / "best.pt", "--max_len", 34).endswith(": --max_len 34: expected at most 33, CLIP's 32 text positions + 1")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda ckpt: ckpt.update(model_config={}), "its model_config describes no model of ours (KeyError: 'encoder')"),
    (lambda ckpt: ckpt.update(model_config="hello"), "its model_config describes no model of ours (TypeError"),
    (lambda ckpt: ckpt["model"].pop("e1"), "does not match CLIP4IDC: missing keys: ['e1']"),
    (lambda ckpt: ckpt["model_config"]["encoder"]["clip"].update(vision_width=32), "does not match CLIP4IDC: "),
    (lambda ckpt: ckpt.update(model={f"other.{k}": v for k, v in ckpt["model"].items()}),  # every key: a few are named
     "'clip.text_projection'] and 86 more; unexpected keys: ['other."),
])
def test_a_checkpoint_of_ours_with_bad_content_is_named(root, stage_1, tmp_path, capsys, edit, message):
    ckpt = torch.load(stage_1 / "best.pt", weights_only=True)
    edit(ckpt)
    torch.save(ckpt, tmp_path / "bad.pt")
    error = error_of(capsys, caption.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "c", "--init_from",
                     tmp_path / "bad.pt")
    assert f"{tmp_path / 'bad.pt'}" in error and message in error and len(error) < 1000
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("vocab", [(320, 49407, 60000), (-5, 320, 49407), (320, 1125)])
def test_a_captioners_words_beyond_clips_or_without_eot_are_named(tmp_path, capsys, vocab):
    # past the vocabulary: an IndexError at the first caption; negative: another word; no EOT: captions never end
    torch.manual_seed(0)
    captioner = Captioner(tiny_pair_encoder(), CaptionerConfig(layers=1, heads=4, ffn=64, max_len=8))
    config = clip_weights.model_config(captioner)
    config["captioner"]["vocab"] = vocab
    torch.save({"model": captioner.state_dict(), "model_config": config}, tmp_path / "bad.pt")
    for name in ("before", "after"):
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / f"{name}.png")
    error = error_of(capsys, evaluate.main, "--ckpt", tmp_path / "bad.pt", "--pair", tmp_path / "before.png",
                     tmp_path / "after.png", "--device", "cpu")
    assert error.endswith(f"{tmp_path / 'bad.pt'}: its model_config describes no model of ours (ValueError: vocab: "
                          f"expected token ids in 0..49407, EOT (49407) among them; got {len(vocab)} ids from "
                          f"{min(vocab)} to {max(vocab)})")


def test_a_clip_file_that_is_not_clip_is_named(root, tmp_path, capsys):
    torch.save({"w": torch.zeros(2)}, tmp_path / "foreign.pt")
    error = error_of(capsys, adapt.main, "--data_root", root, "--out_dir", tmp_path / "a", "--clip", tmp_path / "foreign.pt")
    assert error.endswith(f"{tmp_path / 'foreign.pt'}: not a CLIP ViT checkpoint: missing keys ['visual.conv1.weight', "
                          "'visual.positional_embedding', 'visual.proj', 'positional_embedding', 'token_embedding.weight', "
                          "'ln_final.weight', 'text_projection']")


def test_a_clip_file_with_too_few_text_positions_for_a_caption_is_named(root, tmp_path, capsys):
    config = CLIPConfig(embed_dim=64, image_size=32, patch_size=16, vision_width=64, vision_layers=2, vision_heads=1,
                        context_length=16, text_width=64, text_layers=1, text_heads=1)
    torch.save(CLIP(config).state_dict(), tmp_path / "short.pt")
    error = error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "a", "--clip",
                     tmp_path / "short.pt", "--n_intra", 1, "--n_inter", 1)
    assert error.endswith(f"--clip {tmp_path / 'short.pt'}: 16 text positions; expected at least 32, the length of a "
                          "caption in tokens")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("content, message", [
    (b"[{'image_id': 1}", "not a JSON file"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, "not a JSON file (maximum recursion depth exceeded", id="deep"),
    pytest.param(b'[{"image_id": ' + b"9" * 5000 + b', "caption": "y"}]', "not a JSON file (Exceeds the limit (4300 "
                 "digits)", id="long-int"),
    (b'{"image_id": "x", "caption": "y"}', 'expected a list of {"image_id", "caption"} objects, not a dict'),
    (b'[{"image_id": "000000.png", "caption": "y"}, {"image_id": "x"}]', 'entry 1 is not an object with an image_id '
                                                                         'and a caption string: {"image_id": "x"}'),
    (b'[{"image_id": "x", "caption": 3}]', "entry 0 is not an object with an image_id and a caption string"),
    (b'[{"image_id": "x", "caption": "a \\ud800 b"}]', 'entry 0: a caption holds the lone surrogate "\\ud800"'),
])
def test_prediction_files_are_checked(root, tmp_path, capsys, content, message):
    (tmp_path / "preds.json").write_bytes(content)
    error = error_of(capsys, evaluate.main, "--predictions", tmp_path / "preds.json", "--data", "synth",
                     "--data_root", root)
    assert f"{tmp_path / 'preds.json'}: {message}" in error


def test_numeric_image_ids_name_the_pairs_whose_ids_read_so(tmp_path):
    (tmp_path / "p.json").write_text('[{"image_id": 123, "caption": "a"}, {"image_id": "7", "caption": "b"}]')
    assert evaluate.read_predictions(tmp_path / "p.json") == {"123": "a", "7": "b"}  # IER's uids, as its reader names them
    (tmp_path / "p.json").write_text('[{"image_id": 123, "caption": "a"}, {"image_id": "123", "caption": "b"}]')
    with pytest.raises(InputError, match="more than one caption for image_id '123'"):
        evaluate.read_predictions(tmp_path / "p.json")
    (tmp_path / "p.json").write_text('[{"image_id": true, "caption": "a"}]')  # a number to json, but no uid
    with pytest.raises(InputError, match="entry 0 is not an object with an image_id and a caption string"):
        evaluate.read_predictions(tmp_path / "p.json")


def test_files_one_may_not_read_are_one_line(root, tmp_path, capsys, monkeypatch):
    preds = tmp_path / "p.json"
    evaluate.write_predictions(preds, {"x": "y"})
    read_text, unreadable = Path.read_text, [preds]

    def denied(path, *args, **kwargs):  # as chmod 000 is for a user other than root, who runs these tests
        if path in unreadable:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return read_text(path, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", denied)
    assert error_of(capsys, evaluate.main, "--predictions", preds, "--data", "synth", "--data_root", root).endswith(
        f"[Errno 13] Permission denied: '{preds}'")
    unreadable.append(root / "splits.json")
    assert error_of(capsys, adapt.main, *SMALL, "--data_root", root, "--out_dir", tmp_path / "run").endswith(
        f"[Errno 13] Permission denied: '{root / 'splits.json'}'")
    assert not (tmp_path / "run").exists()


def test_a_byte_order_mark_is_accepted(tmp_path):
    preds = {"000001.png": "the cube moved"}
    evaluate.write_predictions(tmp_path / "p.json", preds)
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "p.json").read_bytes())
    assert evaluate.read_predictions(tmp_path / "bom.json") == preds


def test_command_line_combinations_are_checked(root, stage_1, tmp_path, capsys):
    image = root / "images" / "CLEVR_default_000000.png"
    preds = tmp_path / "p.json"
    evaluate.write_predictions(preds, {"x": "y"})
    for name in ("fig", "fig.psd", "fig.xbm"):  # Pillow reads PSD but does not write it; XBM only in black and white
        assert "expected the name of an image file Pillow writes, such as attention.png" in error_of(
            capsys, evaluate.main, "--ckpt", stage_1 / "best.pt", "--pair", image, image, "--attention", tmp_path / name)
    assert "give --predictions with --data_root, or --ckpt with one of" in error_of(
        capsys, evaluate.main, "--predictions", preds, "--ckpt", stage_1 / "best.pt", "--pair", image, image)
    assert f"{tmp_path} is a folder: expected a file to write (--out)" in error_of(
        capsys, evaluate.main, "--predictions", preds, "--data", "synth", "--data_root", root, "--out", tmp_path)
    (tmp_path / "figure.png").mkdir()
    assert error_of(capsys, evaluate.main, "--ckpt", stage_1 / "best.pt", "--pair", image, image, "--attention",
                    tmp_path / "figure.png", "--overwrite").endswith(
        f"{tmp_path / 'figure.png'} is a folder: expected a file to write (--attention)")
    (tmp_path / "figure.png").rmdir()
    (tmp_path / "run" / "metrics.json").mkdir(parents=True)
    assert f"{tmp_path / 'run' / 'metrics.json'} is a folder: expected a file to write (--out_dir)" in error_of(
        capsys, evaluate.main, "--ckpt", stage_1 / "best.pt", "--data", "synth", "--data_root", root,
        "--out_dir", tmp_path / "run")
    shutil.rmtree(tmp_path / "run")
    assert "--pairs 5: expected at least 10, for non-empty val and test splits" in error_of(
        capsys, lambda argv: synth.write_synth(tmp_path / "s", 5, 0))
    assert not (tmp_path / "s").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]
    with pytest.raises(TypeError, match="tokenize takes a string or a list of strings, not None"):
        tokenizer.tokenize(None)


def test_a_path_that_names_no_usable_file_is_one_line_said_alike_by_every_process():
    for error in (IsADirectoryError(errno.EISDIR, "Is a directory", "run/.lock"),
                  NotADirectoryError(errno.ENOTDIR, "Not a directory", "a_file/x"),
                  OSError(errno.ELOOP, "Too many levels of symbolic links", "loop"),
                  OSError(errno.ENAMETOOLONG, "File name too long", "x" * 300)):
        assert cli.error_line(error) == str(error) and cli.bad_input(error)
    assert cli.bad_input(IsADirectoryError("Caught IsADirectoryError in DataLoader worker process 0."))  # as torch re-raises it
    for error in (OSError(errno.EIO, "Input/output error", "disk"), PermissionError(errno.EACCES, "denied", "x")):
        assert not cli.bad_input(error)  # a disk that fails or a file one may not read: each process says its own
    assert cli.error_line(OSError(errno.EIO, "Input/output error", "disk")) is None  # keeps its traceback


def test_a_list_of_pairs_names_its_bad_line(tmp_path):
    (tmp_path / "pairs.txt").write_text("a.png b.png\nonly_one.png\n")
    with pytest.raises(InputError, match=r"pairs.txt: line 2: expected two image paths \(before, after\), found 1"):
        data.read_pair_list(tmp_path / "pairs.txt")
    (tmp_path / "pairs.txt").write_text("a.png\tb c.png\n")  # a tab: paths may hold spaces
    with pytest.raises(InputError, match=r"pairs.txt: 2 images missing, e.g. .*a.png: not found$"):
        data.read_pair_list(tmp_path / "pairs.txt")
    (tmp_path / "a.png").mkdir()  # a folder where an image belongs is named so, not as absent
    with pytest.raises(InputError, match=r"pairs.txt: 2 images missing, e.g. .*a.png: not a file$"):
        data.read_pair_list(tmp_path / "pairs.txt")


@pytest.mark.parametrize("run, argv, flag", [
    (adapt.main, ["--data_root", ""], "--data_root"),  # `--data_root "$DATA"` with DATA unset: not the default
    (adapt.main, ["--out_dir", "", "--overwrite"], "--out_dir"),
    (caption.main, ["--init_from", ""], "--init_from"),
    (evaluate.main, ["--ckpt", "best.pt", "--pair", "b.png", ""], "--pair"),
    (bench.main, ["loader", "--data_root", ""], "--data_root"),
])
def test_an_empty_value_is_refused_not_read_as_the_default(run, argv, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert error_of(capsys, run, *argv).endswith(f"error: {flag}: expected a value, got an empty string")
    assert list(tmp_path.iterdir()) == []


def test_synth_refuses_an_empty_out(tmp_path):
    done = subprocess.run([sys.executable, Path(synth.__file__).resolve(), "--out", ""], cwd=tmp_path,
                          capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (2, "synth.py: error: --out: expected a value, got an empty string\n")
    assert list(tmp_path.iterdir()) == []


def test_the_folders_a_failed_start_made_are_removed_even_when_making_them_failed(tmp_path, monkeypatch):
    mkdir = os.mkdir

    def full_at_c(path, *args, **kwargs):  # a/ and a/b/ are made, then the disk is full
        if Path(path).name == "c":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", full_at_c)
    with pytest.raises(OSError, match="No space left"), cli.new_folders(tmp_path / "a" / "b" / "c"):
        pytest.fail("the block ran without its folder")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt), cli.new_folders(tmp_path / "a" / "b"):  # made, then the block fails
        (tmp_path / "a" / "kept").write_text("written by the block")
        raise KeyboardInterrupt
    assert [p.name for p in tmp_path.rglob("*")] == ["a", "kept"]
