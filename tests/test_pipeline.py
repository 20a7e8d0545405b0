"""Both stages end to end on a small synthetic CLEVR-Change: the flags, files and metrics users see."""
import json

import pytest
from PIL import Image

import adapt
import caption
import data
import evaluate
import figures
import synth


@pytest.mark.slow
def test_adapt_then_caption_then_evaluate(tmp_path, capsys):
    root = tmp_path / "synth"
    synth.write_synth(root, 60, seed=1)  # 48 train, 6 val, 6 test pairs
    small = ["--data", "synth", "--data_root", str(root), "--epochs", "1", "--batch_size", "16", "--workers", "0",
             "--device", "cpu"]  # on a GPU host too: the runs must score as the CPU scores their checkpoints below
    adapt.main(small + ["--out_dir", str(tmp_path / "adapt")])
    retrieval = json.loads((tmp_path / "adapt" / "metrics.json").read_text())
    assert set(retrieval) == {"val", "test", "test_step0"}
    for direction in ("pair_to_text", "text_to_pair"):
        assert set(retrieval["test"][direction]) == {"R@1", "R@5", "R@10", "R@20", "R@50", "MdR", "MnR"}
    out = capsys.readouterr().out
    assert "epoch 1/1 step 15/15 loss" in out and "pairs/s" in out and "eta" in out and "temp" in out
    assert "with zero adaptation steps, chance 16.7" in out

    caption.main(small + ["--out_dir", str(tmp_path / "caption"), "--init_from", str(tmp_path / "adapt" / "best.pt"),
                          "--layers", "1", "--ffn", "64", "--batch_size", "8"])
    metrics = json.loads((tmp_path / "caption" / "metrics.json").read_text())
    assert set(metrics["test"]) == {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "per_type",
                                    "grades"}
    assert set(metrics["test"]["grades"]) == {"change", "shape", "move", "distractor"}
    assert metrics["blind_baseline"]["test"]["grades"]["change"] == 0  # a no-change sentence names no change
    assert set(metrics["test"]["per_type"]) <= {"color", "texture", "move", "add", "drop", "distractor"}
    assert "distractor" in metrics["test"]["per_type"]
    assert metrics["decoding"] == {"beam": 1, "length_penalty": 1.0}  # greedy, the default
    figure_path = tmp_path / "caption" / "examples.png"
    assert f"wrote {figure_path}" in capsys.readouterr().out
    with Image.open(figure_path) as figure:
        figure.verify()  # a whole PNG
    shown = figures.example_items(data.eval_items(data.read_split("synth", root, "test")))
    assert {i.change_type for i in shown} == {"color", "material", "move", "add", "drop", "distractor"} & {
        i.change_type for i in data.eval_items(data.read_split("synth", root, "test"))}
    width, height, gap, font_size, lines = figures.EXAMPLE
    rows = (len(shown) + 1) // 2
    assert figure.size == (2 * (2 * width + gap) + 12 * gap, rows * (height + gap + lines * (font_size + 3) + 4 * gap)
                           + 2 * gap)
    predictions = json.loads((tmp_path / "caption" / "test_predictions.json").read_text())
    assert len(predictions) == 12 and {"image_id", "caption"} == set(predictions[0])  # 6 change + 6 distractor pairs
    assert {p["image_id"] for p in predictions if p["image_id"].endswith("_n")}

    scored = tmp_path / "rescored.json"
    evaluate.main(["--predictions", str(tmp_path / "caption" / "test_predictions.json"), "--data", "synth",
                   "--data_root", str(root), "--split", "test", "--out", str(scored)])
    assert json.loads(scored.read_text())["test"] == metrics["test"]  # the same protocol in both places

    for stage, run in ((1, retrieval), (2, metrics)):  # a checkpoint scored on a split: what the run wrote
        folder = tmp_path / f"scored{stage}"
        best = tmp_path / ("adapt" if stage == 1 else "caption") / "best.pt"
        evaluate.main(["--ckpt", str(best), "--data", "synth", "--data_root", str(root), "--split", "test",
                       "--out_dir", str(folder), "--device", "cpu"])
        scored = json.loads((folder / "metrics.json").read_text())
        assert scored["test"] == run["test"] and scored.get("decoding") == run.get("decoding")
    assert json.loads((folder / "test_predictions.json").read_text()) == predictions
