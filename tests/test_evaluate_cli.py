"""`python evaluate.py --predictions ...` on a tiny folder in CLEVR-Change's layout: references come
from data.py's readers, the json holds the paper's metrics and the per-type CIDEr of Table 2. Bad
input and outputs that exist or cannot be written are refused in one line, before any scoring."""
import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

import cli
import clip_weights
import data
import evaluate
from model import Captioner
from test_caption_own_pair import save_checkpoint, tiny_captioner, write_pair

OBJECTS = ["red cube", "blue sphere", "green cylinder"]
TEMPLATES = {"color": "the {} changed its color", "material": "the {} changed its material",
             "add": "a {} has been added", "drop": "the {} has disappeared", "move": "the {} moved"}


def write_clevr_change(root):
    """Pairs 0-14 (three of each change type) form the test split; 15 and 16 are train and val."""
    change, no_change, type_mapping = {}, {}, {t: [] for t in TEMPLATES}
    for index in range(17):
        change_type, obj = list(TEMPLATES)[index // 3 % 5], OBJECTS[index % 3]
        name = f"CLEVR_default_{index:06d}.png"
        change[name] = [TEMPLATES[change_type].format(obj) + ".", f"Look, the {obj} is different."]
        no_change[name] = ["Nothing has changed.", f"The {obj} did not change."]
        type_mapping[change_type].append(f"{index:06d}.png")
        for folder, prefix in (("images", "default"), ("sc_images", "semantic"), ("nsc_images", "nonsemantic")):
            (root / folder).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (index, 0, 0)).save(root / folder / f"CLEVR_{prefix}_{index:06d}.png")
    files = {"change_captions.json": change, "no_change_captions.json": no_change,
             "type_mapping.json": type_mapping, "splits.json": {"train": [15], "val": [16], "test": list(range(15))}}
    for file, content in files.items():
        (root / file).write_text(json.dumps(content))


@pytest.mark.slow
def test_scores_a_predictions_file(tmp_path, capsys):
    root = tmp_path / "clevr"
    write_clevr_change(root)
    items = data.eval_items(data.read_split("clevr", root, "test"))
    assert len(items) == 30  # every change pair has its distractor
    # Right on every type but move. (CIDEr rewards the n-grams that set a pair's references apart, so
    # the distractors, which all share "nothing has changed", score low even when right.)
    preds = {i.id: "zzz qqq xxx" if i.change_type == "move" else i.captions[0] for i in items}
    evaluate.write_predictions(tmp_path / "preds.json", preds)
    assert evaluate.read_predictions(tmp_path / "preds.json") == preds

    evaluate.main(["--predictions", str(tmp_path / "preds.json"), "--data", "clevr", "--data_root", str(root),
                   "--split", "test", "--out", str(tmp_path / "out" / "metrics.json")])
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["test"]
    assert tuple(metrics) == evaluate.CAPTION_METRICS + ("per_type",)
    per_type = metrics["per_type"]
    assert tuple(per_type) == evaluate.CHANGE_TYPES
    assert per_type["move"] == 0 and per_type["color"] > 100 and per_type["texture"] > 100
    types = {i.id: i.change_type for i in items}
    assert per_type == evaluate.per_type_cider({i.id: i.captions for i in items}, preds, types)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "clevr test: 30 image pairs"
    assert printed[1].split() == ["B", "M", "C", "R"] and printed[-2].split() == ["C", "T", "M", "A", "D", "DI"]
    assert printed[-1].split()[2] == "0.0"


@pytest.mark.slow
def test_metrics_to_dev_stdout_follow_the_table_in_a_redirected_file(root, preds, tmp_path):
    """Opened anew, /dev/stdout would cut the file short and the table would land over the json. A device
    replaces no result: no --overwrite is needed."""
    log = tmp_path / "log.txt"
    with log.open("w") as stdout:
        subprocess.run([sys.executable, "evaluate.py", "--predictions", preds, "--data", "clevr", "--data_root", root,
                        "--out", "/dev/stdout"], cwd=Path(__file__).parent.parent, stdout=stdout, check=True)
    table, _, metrics = log.read_text().partition("{")
    assert table.startswith("clevr test: 30 image pairs\n") and table.splitlines()[-2].split()[-1] == "DI"
    assert json.loads("{" + metrics)["test"]["per_type"]["move"] > 100


def test_captions_to_dev_stdout_in_a_redirected_file_are_json_lines_alone(ckpt, tmp_path):
    before, after = write_pair(tmp_path)
    (tmp_path / "pairs.txt").write_text(f"{before.name} {after.name}\n" * 2)
    with (tmp_path / "captions.jsonl").open("w") as stdout:
        subprocess.run([sys.executable, "evaluate.py", "--ckpt", ckpt, "--pairs", tmp_path / "pairs.txt", "--out",
                        "/dev/stdout"], cwd=Path(__file__).parent.parent, stdout=stdout, check=True)
    lines = (tmp_path / "captions.jsonl").read_text().splitlines()
    assert [json.loads(line)["after"] for line in lines] == [str(after)] * 2


def test_a_list_of_pairs_gets_each_pairs_own_caption_to_stdout_or_out(ckpt, tmp_path, capsys):
    before, after = write_pair(tmp_path)
    (tmp_path / "pairs.txt").write_text(f"{before.name} {after.name}\n\n{after.name}\t{before.name} \n")
    captioner, lines = tiny_captioner(), ((before, after), (after, before))
    expected = [{"before": str(b), "after": str(a), "caption": evaluate.ids_to_text(
        captioner.generate(data.read_pixels(b, 32)[None], data.read_pixels(a, 32)[None]))[0]} for b, a in lines]
    assert expected[0]["caption"] != expected[1]["caption"]
    argv = ["--ckpt", ckpt, "--pairs", tmp_path / "pairs.txt", "--device", "cpu"]
    evaluate.main([str(a) for a in argv])
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == expected
    evaluate.main([str(a) for a in argv + ["--out", tmp_path / "captions.jsonl"]])
    assert capsys.readouterr().out == f"wrote 2 captions to {tmp_path / 'captions.jsonl'}\n"
    assert [json.loads(line) for line in (tmp_path / "captions.jsonl").read_text().splitlines()] == expected


def test_own_pairs_are_captioned_under_the_amp_asked_for(ckpt, tmp_path, capsys, monkeypatch):
    before, after = write_pair(tmp_path)
    (tmp_path / "pairs.txt").write_text(f"{before} {after}\n")
    generate, under = Captioner.generate, []

    def recorded(self, *images, **decoding):
        under.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return generate(self, *images, **decoding)
    monkeypatch.setattr(Captioner, "generate", recorded)
    cpu_bf16 = ["--ckpt", ckpt, "--device", "cpu", "--amp", "bf16"]
    evaluate.main([str(a) for a in cpu_bf16 + ["--pair", before, after]])
    evaluate.main([str(a) for a in cpu_bf16 + ["--pairs", tmp_path / "pairs.txt"]])
    evaluate.main([str(a) for a in cpu_bf16[:-2] + ["--pair", before, after]])
    assert under == [torch.bfloat16, torch.bfloat16, None]


@pytest.mark.slow
def test_predictions_are_scored_with_the_annotation_files_alone(root, preds, tmp_path, capsys):
    """Scoring text reads no image: a dataset's json files are enough."""
    annotations = tmp_path / "annotations"
    annotations.mkdir()
    for path in root.glob("*.json"):
        shutil.copy(path, annotations)
    evaluate.main([str(a) for a in ["--predictions", preds, "--data", "clevr", "--data_root", annotations]])
    assert capsys.readouterr().out.startswith("clevr test: 30 image pairs\n")


@pytest.mark.slow
def test_a_checkpoint_is_scored_under_the_amp_its_run_was_scored_under(root, tmp_path):
    """As caption.py scored the test split at its end, so that evaluate.py gives the same captions; --amp may
    choose another."""
    captioner = tiny_captioner()
    torch.save({"model": captioner.state_dict(), "model_config": clip_weights.model_config(captioner),
                "config": {"amp": "bf16"}}, tmp_path / "best.pt")
    items = data.eval_items(data.read_split("clevr", root, "test"))
    bf16, fp32 = (evaluate.predict(captioner, items, torch.device("cpu"), amp=amp, workers=0) for amp in ("bf16", "off"))
    assert bf16 != fp32  # else this test could not tell them apart
    for amp, expected in ((None, bf16), ("off", fp32)):
        flags = ["--ckpt", tmp_path / "best.pt", "--data_root", root, "--out_dir", tmp_path / str(amp), "--device", "cpu"]
        evaluate.main([str(a) for a in flags + ["--amp", amp] * (amp is not None)])
        assert evaluate.read_predictions(tmp_path / str(amp) / "test_predictions.json") == expected


def test_the_blind_baseline_writes_the_most_frequent_training_caption_for_every_pair():
    train_pairs = [data.Pair("0", Path("a"), Path("b"), ["the cube moved", "a ball left"], "move", Path("c"),
                             ["nothing has changed"]),
                   data.Pair("1", Path("a"), Path("b"), ["a ball left"], "drop", Path("c"), ["nothing has changed"]),
                   data.Pair("2", Path("a"), Path("b"), ["the cube moved"], "move", Path("c"), ["nothing has changed"])]
    items = data.eval_items(train_pairs[:2])
    assert evaluate.blind_baseline(train_pairs, items) == {item.id: "nothing has changed" for item in items}


def test_duplicate_predictions_are_rejected(tmp_path):
    path = tmp_path / "preds.json"
    path.write_text(json.dumps([{"image_id": "000001.png", "caption": c} for c in ("a", "b")]))
    with pytest.raises(ValueError, match="more than one caption for image_id '000001.png'"):
        evaluate.read_predictions(path)


# ---------------------------------------------------------------------------------------------
# refusals: one line, exit status 2, nothing scored and nothing on disk changed
# ---------------------------------------------------------------------------------------------
def error_of(capsys, *argv):
    """The one stderr line, less its "prog: error: " head, of `python evaluate.py argv`, which must be
    refused before anything is scored or printed."""
    with pytest.raises(SystemExit) as exit:
        cli.main(evaluate.main, [str(a) for a in argv])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    return err.strip().split(": error: ", 1)[1]


def snapshot(folder):
    """Every file below `folder` with its bytes: what "nothing on disk changes" compares."""
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data") / "clevr"
    write_clevr_change(root)
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny stage-2 checkpoint that really captions, so that a refusal after scoring would show."""
    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    save_checkpoint(tiny_captioner(), path)
    return path


@pytest.fixture
def right_captions(root):
    return {i.id: i.captions[0] for i in data.eval_items(data.read_split("clevr", root, "test"))}


@pytest.fixture
def preds(tmp_path, right_captions):
    evaluate.write_predictions(tmp_path / "preds.json", right_captions)
    return tmp_path / "preds.json"


@pytest.mark.parametrize("flag", ["--out_dir", pytest.param("--out", marks=pytest.mark.slow),  # --out: scored anew
                                  "--attention"])
def test_an_earlier_result_is_kept_unless_overwritten(flag, root, ckpt, preds, tmp_path, capsys):
    run = tmp_path / "run"  # a finished caption.py run: its test metrics must survive a val evaluation
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"test": {}, "blind_baseline": {}}))
    (tmp_path / "m.json").write_text("earlier")
    (tmp_path / "att.png").write_bytes(b"earlier")
    before, after = write_pair(tmp_path)
    clevr = ["--data", "clevr", "--data_root", root]
    path, argv = {"--out_dir": (run / "metrics.json", ["--ckpt", ckpt, *clevr, "--split", "val", "--out_dir", run]),
                  "--out": (tmp_path / "m.json", ["--predictions", preds, *clevr, "--out", tmp_path / "m.json"]),
                  "--attention": (tmp_path / "att.png", ["--ckpt", ckpt, "--pair", before, after, "--attention",
                                                         tmp_path / "att.png"])}[flag]
    earlier = snapshot(tmp_path)
    assert error_of(capsys, *argv) == f"{path} exists: pass --overwrite to replace it, or another {flag}"
    assert snapshot(tmp_path) == earlier
    if flag == "--out":
        evaluate.main([str(a) for a in argv + ["--overwrite"]])
        assert list(json.loads(path.read_text())) == ["test"]


@pytest.mark.parametrize("mark", ["last.pt", ".lock"])
def test_a_run_that_has_not_finished_gets_no_metrics_file(mark, root, ckpt, preds, tmp_path, capsys):
    """A metrics.json in a run folder says that the run finished: --resume would refuse to continue it."""
    run = tmp_path / "run"  # killed before its end (last.pt), or training now (.lock)
    run.mkdir()
    (run / mark).write_bytes(b"a run's")
    earlier = snapshot(tmp_path)
    clevr = ["--data", "clevr", "--data_root", root]
    for flag, argv in (("--out_dir", ["--ckpt", ckpt, *clevr, "--split", "val", "--out_dir", run]),
                       ("--out", ["--predictions", preds, *clevr, "--out", run / "metrics.json", "--overwrite"])):
        assert error_of(capsys, *argv) == (f"{flag}: {run} holds a run that has not finished, which a metrics.json "
                                           f"would mark as finished (--resume refuses it then); give another {flag}")
    assert snapshot(tmp_path) == earlier


@pytest.mark.slow
def test_a_split_is_scored_without_the_images_of_the_others(root, ckpt, tmp_path, capsys):
    """The training split lends the blind baseline its captions only."""
    copy = tmp_path / "clevr"
    shutil.copytree(root, copy)
    (copy / "sc_images" / "CLEVR_semantic_000015.png").unlink()  # the train pair's after image
    evaluate.main([str(a) for a in ["--ckpt", ckpt, "--data", "clevr", "--data_root", copy, "--out_dir", tmp_path]])
    assert set(json.loads((tmp_path / "metrics.json").read_text())) == {"test", "blind_baseline", "decoding"}
    with pytest.raises(FileNotFoundError, match="1 of 1 train pairs lack image files"):
        data.read_split("clevr", copy, "train")


def test_a_flag_the_chosen_command_does_not_use_is_refused(root, ckpt, preds, tmp_path, capsys):
    before, after = write_pair(tmp_path)
    (tmp_path / "pairs.txt").write_text(f"{before} {after}\n")
    clevr = ["--data", "clevr", "--data_root", root]
    earlier = snapshot(tmp_path)
    with_ckpt = "--device, --amp, --n_intra, --heads, --beam, --length_penalty"
    assert error_of(capsys, "--ckpt", ckpt, *clevr, "--out", tmp_path / "m.json") == (
        f"--out has no use with --ckpt --data_root, which takes --data, --data_root, --split, --out_dir, {with_ckpt}")
    assert error_of(capsys, "--predictions", preds, *clevr, "--out_dir", tmp_path / "run") == (
        "--out_dir has no use with --predictions, which takes --data, --data_root, --split, --out")
    for flag, value in (("--device", "cpu"), ("--amp", "off")):
        assert error_of(capsys, "--predictions", preds, *clevr, flag, value) == (
            f"{flag} has no use with --predictions, which takes --data, --data_root, --split, --out")
    assert error_of(capsys, "--predictions", preds) == "--predictions needs --data_root, the dataset it scores against"
    assert error_of(capsys, "--ckpt", ckpt, "--pair", before, after, "--split", "val") == (
        f"--split has no use with --pair, which takes --attention, {with_ckpt}")
    assert error_of(capsys, "--ckpt", ckpt, "--pair", before, after, *clevr) == (
        f"--data has no use with --pair, which takes --attention, {with_ckpt}")
    assert error_of(capsys, "--ckpt", ckpt, "--pairs", tmp_path / "pairs.txt", "--attention", tmp_path / "a.png") == (
        f"--attention has no use with --pairs, which takes --out, {with_ckpt}")
    assert snapshot(tmp_path) == earlier


def test_layer_split_and_heads_that_our_checkpoint_contradicts_are_refused(root, ckpt, tmp_path, capsys):
    """Our files record --n_intra and --heads; only the authors' files need them (their test below)."""
    before, after = write_pair(tmp_path)
    save_checkpoint(tiny_captioner().encoder, tmp_path / "stage1.pt")
    pair = ["--pair", before, after]
    assert error_of(capsys, "--ckpt", ckpt, *pair, "--n_intra", 3) == (
        f"--n_intra 3: {ckpt} records its own n_intra, 2 (the flag is for the authors' files, which do not)")
    assert error_of(capsys, "--ckpt", ckpt, *pair, "--heads", 2) == (
        f"--heads 2: {ckpt} records its own heads, 4 (the flag is for the authors' files, which do not)")
    clevr = ["--data", "clevr", "--data_root", root, "--out_dir", tmp_path / "run"]
    assert error_of(capsys, "--ckpt", tmp_path / "stage1.pt", *clevr, "--heads", 4) == (
        f"--heads 4: {tmp_path / 'stage1.pt'} holds a stage-1 pair encoder, which has no captioner heads")
    assert not (tmp_path / "run").exists()
    cli.main(evaluate.main, [str(a) for a in ["--ckpt", ckpt, *pair, "--n_intra", 2, "--heads", 4]])
    assert capsys.readouterr().out.strip()  # the values the file holds are welcome


def test_an_authors_file_without_flags_is_read_as_their_released_models(tmp_path, monkeypatch):
    torch.save({"clip.visual.proj": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    told = []
    monkeypatch.setattr(clip_weights, "load_checkpoint",
                        lambda path, device, n_intra, heads: told.append((n_intra, heads)) or tiny_captioner())
    args = argparse.Namespace(ckpt=tmp_path / "pytorch_model.bin", n_intra=None, heads=None, amp=None)
    evaluate.load_model(args, torch.device("cpu"))
    assert told == [(9, 8)] and args.amp == "auto"


def test_a_checkpoint_of_a_diverged_training_is_refused(tmp_path, capsys):
    captioner = tiny_captioner()
    next(captioner.parameters()).data[0] = float("nan")
    save_checkpoint(captioner, tmp_path / "nan.pt")
    assert error_of(capsys, "--ckpt", tmp_path / "nan.pt", "--pair", *write_pair(tmp_path)) == (
        f"{tmp_path / 'nan.pt'}: its weights are not all finite, as a diverged training leaves them")


def test_a_pair_encoder_is_refused_only_the_file_it_writes(root, tmp_path, capsys):
    save_checkpoint(tiny_captioner().encoder, tmp_path / "stage1.pt")
    run = tmp_path / "run"
    run.mkdir()
    (run / "test_predictions.json").write_text("[]")  # a captioner's: a retrieval run writes none
    evaluate.main([str(a) for a in ["--ckpt", tmp_path / "stage1.pt", "--data", "clevr", "--data_root", root,
                                    "--out_dir", run]])
    assert "test" in json.loads((run / "metrics.json").read_text())
    capsys.readouterr()
    assert error_of(capsys, "--ckpt", tmp_path / "stage1.pt", "--data", "clevr", "--data_root", root, "--out_dir",
                    run) == f"{run / 'metrics.json'} exists: pass --overwrite to replace it, or another --out_dir"


def test_a_finished_runs_retrieval_is_printed_and_replaces_its_metrics_with_overwrite(root, tmp_path, capsys):
    save_checkpoint(tiny_captioner().encoder, tmp_path / "stage1.pt")
    run = tmp_path / "run"  # a finished run keeps its last.pt beside its metrics.json
    run.mkdir()
    (run / "last.pt").write_bytes(b"a run's")
    (run / "metrics.json").write_text("{}")
    evaluate.main([str(a) for a in ["--ckpt", tmp_path / "stage1.pt", "--data", "clevr", "--data_root", root,
                                    "--out_dir", run, "--overwrite"]])
    metrics = json.loads((run / "metrics.json").read_text())
    assert capsys.readouterr().out.splitlines() == ["clevr test: 15 image pairs",
                                                    *evaluate.format_retrieval(metrics["test"]).splitlines(),
                                                    f"wrote {run}/metrics.json"]


def test_scoring_captions_without_java_is_refused_before_any_work(root, ckpt, preds, tmp_path, capsys, monkeypatch):
    save_checkpoint(tiny_captioner().encoder, tmp_path / "stage1.pt")
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on it
    monkeypatch.setattr(evaluate, "predict", lambda *args, **kwargs: pytest.fail("captioned before the refusal"))
    clevr = ["--data", "clevr", "--data_root", root]
    for argv in (["--predictions", preds, *clevr, "--out", tmp_path / "m.json"],
                 ["--ckpt", ckpt, *clevr, "--out_dir", tmp_path / "run"]):
        assert error_of(capsys, *argv).startswith("scoring captions needs a Java runtime")
    evaluate.write_predictions(tmp_path / "few.json", {"000000.png": "a caption"})
    assert " its ids are not those of the test split " in error_of(capsys, "--predictions", tmp_path / "few.json",
                                                                   *clevr)  # bad input is named as such first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["few.json", "preds.json", "stage1.pt"]
    evaluate.main([str(a) for a in ["--ckpt", tmp_path / "stage1.pt", *clevr, "--out_dir", tmp_path / "run"]])
    assert "test" in json.loads((tmp_path / "run" / "metrics.json").read_text())  # retrieval runs no Java


@pytest.mark.parametrize("flag", ["--out", "--out_dir", "read-only"])
def test_an_output_that_cannot_be_written_is_refused_before_scoring(flag, root, ckpt, preds, tmp_path, capsys,
                                                                    monkeypatch):
    afile, read_only = tmp_path / "afile", tmp_path / "read_only"
    afile.write_text("a file")
    read_only.mkdir()
    # Tests may run as root, who may write anywhere: os.access says here what it says of a read-only mount.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != read_only and real_access(p, mode))
    clevr = ["--data", "clevr", "--data_root", root]
    argv, expected = {
        "--out": (["--predictions", preds, *clevr, "--out", afile / "m.json"], f"--out {afile}: {afile} is not a folder"),
        "--out_dir": (["--ckpt", ckpt, *clevr, "--out_dir", afile], f"--out_dir {afile}: {afile} is not a folder"),
        "read-only": (["--predictions", preds, *clevr, "--out", read_only / "new" / "m.json"],
                      f"--out {read_only / 'new'}: {read_only} is not writable")}[flag]
    earlier = snapshot(tmp_path)
    assert error_of(capsys, *argv) == expected
    assert snapshot(tmp_path) == earlier and not (read_only / "new").exists()


@pytest.mark.parametrize("flag", [pytest.param("--out", marks=pytest.mark.slow), "--attention"])  # --out: scored
def test_a_full_disk_is_one_line_and_leaves_no_cut_file(flag, root, ckpt, preds, tmp_path, capsys, monkeypatch):
    """Found only once the metrics are printed or the figure drawn: the one line comes after them."""
    out = tmp_path / ("m.json" if flag == "--out" else "att.png")
    out.write_text("earlier")
    before, after = write_pair(tmp_path)
    earlier, real_write = snapshot(tmp_path), Path.write_bytes
    argv = (["--predictions", preds, "--data", "clevr", "--data_root", root] if flag == "--out" else
            ["--ckpt", ckpt, "--pair", before, after, "--device", "cpu"])

    def fills_up(path, content):
        real_write(path, content[:10])
        raise OSError(errno.ENOSPC, "No space left on device")
    for target in ("/dev/full", out)[flag == "--attention":]:  # a figure's name has a suffix that names its format
        with monkeypatch.context() as patch, pytest.raises(SystemExit) as exit:
            if target == out:
                patch.setattr(Path, "write_bytes", fills_up)
            cli.main(evaluate.main, [str(a) for a in [*argv, flag, target, "--overwrite"]])
        err = capsys.readouterr().err.splitlines()
        assert exit.value.code == 2 and len(err) == 1 and err[0].endswith(
            f": error: {target}: cannot write it (No space left on device)")
    assert snapshot(tmp_path) == earlier  # the earlier file whole, and no part of the new one


FIRST_TEST_IDS = "['000000.png', '000000.png_n', '000001.png', '000001.png_n', '000002.png']"


@pytest.mark.parametrize("case, detail", [
    ("one missing", "1 without a prediction (e.g. ['000000.png']), 0 without references (e.g. [])"),
    ("one extra", "0 without a prediction (e.g. []), 1 without references (e.g. ['999999.png'])"),
    ("integer ids", f"30 without a prediction (e.g. {FIRST_TEST_IDS}), 30 without references "
                    "(e.g. ['0', '1', '10', '11', '12'])"),
    ("none", f"30 without a prediction (e.g. {FIRST_TEST_IDS}), 0 without references (e.g. [])"),
    ("val split", "2 without a prediction (e.g. ['000016.png', '000016.png_n']), 30 without references "
                  f"(e.g. {FIRST_TEST_IDS})"),
])
def test_predictions_of_other_ids_name_the_file_and_split(case, detail, root, right_captions, tmp_path, capsys):
    captions = list(right_captions.items())
    results = {"one missing": captions[1:], "one extra": captions + [("999999.png", "a caption")],
               "integer ids": [(n, c) for n, (_, c) in enumerate(captions)], "none": [], "val split": captions}[case]
    (tmp_path / "p.json").write_text(json.dumps([{"image_id": k, "caption": c} for k, c in results]))
    split, n_ids = ("val", 2) if case == "val split" else ("test", 30)
    assert error_of(capsys, "--predictions", tmp_path / "p.json", "--data", "clevr", "--data_root", root,
                    "--split", split) == (f"{tmp_path / 'p.json'}: its ids are not those of the {split} split of "
                                          f"{root}: {detail}; expected one caption for each of its {n_ids} ids")


def test_a_loop_of_links_is_one_line_and_as_an_output_is_refused_before_captioning(ckpt, tmp_path, capsys):
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop.name)
    before, after = write_pair(tmp_path)
    earlier = snapshot(tmp_path)
    assert error_of(capsys, "--ckpt", ckpt, "--pairs", loop) == (
        f"[Errno {errno.ELOOP}] Too many levels of symbolic links: '{loop}'")
    assert error_of(capsys, "--ckpt", ckpt, "--pair", before, after, "--attention", loop) == (
        f"{loop}: a loop of symbolic links; expected a file to write, or a link to one")
    assert snapshot(tmp_path) == earlier and loop.is_symlink()


def test_input_files_that_are_missing_empty_binary_or_folders_are_named(root, ckpt, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)))
    earlier = snapshot(tmp_path)
    assert error_of(capsys, "--ckpt", ckpt, "--pairs", tmp_path / "missing.txt") == (
        f"{tmp_path / 'missing.txt'}: no such file; expected two image paths a line")
    assert error_of(capsys, "--predictions", tmp_path / "missing.json", "--data", "clevr", "--data_root", root) == (
        f"{tmp_path / 'missing.json'}: no such file; expected a COCO results json")
    assert error_of(capsys, "--ckpt", ckpt, "--pairs", tmp_path / "empty.txt") == (
        f"{tmp_path / 'empty.txt'}: no pairs; expected two image paths (before, after) a line")
    assert error_of(capsys, "--ckpt", ckpt, "--pairs", tmp_path / "binary.txt") == (
        f"{tmp_path / 'binary.txt'}: not a text file ('utf-8' codec can't decode byte 0x80 in position 128: "
        "invalid start byte); expected two image paths a line")
    assert error_of(capsys, "--predictions", tmp_path, "--data", "clevr", "--data_root", root) == (
        f"{tmp_path}: not a text file ([Errno 21] Is a directory: '{tmp_path}'); expected a COCO results json")
    assert snapshot(tmp_path) == earlier
