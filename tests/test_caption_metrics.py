"""Caption metrics: the wrapper reproduces pycocoevalcap called directly; CIDEr by change type;
mismatched ids and a missing Java runtime give clear errors. Each scoring call starts Java."""
import subprocess
import sys
from pathlib import Path

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.meteor.meteor import Meteor
from pycocoevalcap.rouge.rouge import Rouge
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

import evaluate
from cli import InputError
from evaluate import CHANGE_TYPES, caption_metrics, format_table, per_type_cider

REFS = {
    "000001": ["The red cube changed to blue.", "A red cube became blue.", "the red cube turned blue"],
    "000002": ["A small metal sphere was added.", "Someone added a small metal sphere."],
    "000003_n": ["There is no change.", "Nothing has changed.", "The scene is the same as before."],
    "000004": ["The big rubber cylinder has disappeared.", "The big rubber cylinder is missing."],
    "000005": ["The yellow ball moved.", "The yellow sphere changed its location."],
}
PREDS = {"000001": "the red cube turned blue .", "000002": "a small sphere was added",
         "000003_n": "Nothing changed!", "000004": "the cylinder is gone", "000005": "the yellow cube moved"}


@pytest.mark.slow
def test_matches_pycocoevalcap_called_directly(monkeypatch):
    # One METEOR process for both sides: each start takes ~10 s to load its paraphrase tables.
    meteor = Meteor()
    monkeypatch.setattr(evaluate, "Meteor", lambda: meteor)
    # Ours first: were METEOR to fail, the direct call would keep the lock its clean-up waits on, forever.
    metrics = caption_metrics(REFS, PREDS)
    gts = PTBTokenizer().tokenize({k: [{"caption": c} for c in v] for k, v in REFS.items()})
    res = PTBTokenizer().tokenize({k: [{"caption": c}] for k, c in PREDS.items()})
    bleu, _ = Bleu(4).compute_score(gts, res)
    expected = {"BLEU-1": bleu[0], "BLEU-2": bleu[1], "BLEU-3": bleu[2], "BLEU-4": bleu[3],
                "METEOR": meteor.compute_score(gts, res)[0], "ROUGE-L": Rouge().compute_score(gts, res)[0],
                "CIDEr": Cider().compute_score(gts, res)[0]}
    assert metrics == {k: 100 * v for k, v in expected.items()}
    assert 0 < metrics["BLEU-4"] < metrics["BLEU-1"] < 100 and metrics["CIDEr"] > 0
    cider_and_bleu2 = caption_metrics(REFS, PREDS, only=("CIDEr", "BLEU-2"))
    assert cider_and_bleu2 == {k: metrics[k] for k in ("BLEU-2", "CIDEr")}


def clevr_fixture():
    """Three pairs of each CLEVR-Change type with distinct, known captions."""
    objects = ["red cube", "blue sphere", "green cylinder", "gray cube", "purple sphere", "brown cylinder",
               "cyan cube", "yellow sphere", "small red cylinder"]
    templates = {"color": ["the {} changed its color", "the {} became another color"],
                 "material": ["the {} changed its material", "the {} is made of something else now"],
                 "add": ["a {} has been added", "someone added a {}"],
                 "drop": ["the {} has disappeared", "the {} is missing"],
                 "move": ["the {} moved", "the {} changed its location"],
                 "distractor": ["no change was made", "the scene is the same as before"]}
    refs, types = {}, {}
    for t, (a, b) in templates.items():
        for i, obj in enumerate(objects[:3] if t != "move" else objects[-3:]):
            k = f"{t}{i}_n" if t == "distractor" else f"{t}{i}"
            refs[k] = [a.format(obj), b.format(obj)] if t != "distractor" else [a, b, f"nothing near the {obj}"]
            types[k] = t
    return refs, types


def test_per_type_cider():
    refs, types = clevr_fixture()
    # Perfect on color, made-up words on move, a distractor's caption (no word in common) on add,
    # the first three words of a reference elsewhere.
    preds = {k: v[0] if types[k] == "color" else "zzz qqq xxx" if types[k] == "move"
             else refs["distractor0_n"][0] if types[k] == "add" else " ".join(v[0].split()[:3])
             for k, v in refs.items()}
    cider = per_type_cider(refs, preds, types)
    assert tuple(cider) == CHANGE_TYPES  # "material" is reported as the paper's "texture"
    assert cider["color"] > 100 and cider["move"] == 0 and cider["add"] == 0
    assert 0 < cider["texture"] < cider["color"]
    # Each type is its own corpus: the same as scoring only that type's pairs.
    colors = [k for k in refs if types[k] == "color"]
    gts = PTBTokenizer().tokenize({k: [{"caption": c} for c in refs[k]] for k in colors})
    res = PTBTokenizer().tokenize({k: [{"caption": preds[k]}] for k in colors})
    assert cider["color"] == 100 * Cider().compute_score(gts, res)[0]


def test_a_change_type_without_pairs_is_left_out():
    refs, types = clevr_fixture()
    refs = {k: v for k, v in refs.items() if types[k] != "add"}
    cider = per_type_cider(refs, {k: v[0] for k, v in refs.items()}, {k: types[k] for k in refs})
    assert tuple(cider) == ("color", "texture", "move", "drop", "distractor")


def test_a_line_break_inside_a_caption_scores_as_a_space():
    refs, types = clevr_fixture()
    preds = {k: v[0] for k, v in refs.items()}
    broken = dict(preds, color0=preds["color0"].replace(" ", "\r", 1), add1=preds["add1"].replace(" ", "\u2028 ", 1))
    refs_broken = dict(refs, drop0=[refs["drop0"][0].replace(" ", "\r\n", 1), *refs["drop0"][1:]])
    expected = per_type_cider(refs, preds, types)
    assert all(expected[t] > 100 for t in CHANGE_TYPES[:5])  # the five change types, scored perfectly
    assert per_type_cider(refs_broken, broken, types) == expected  # without the fix: every later pair shifts


def test_bad_requests_are_explained():
    with pytest.raises(ValueError, match=r"unknown metrics \['SPICE'\]"):
        caption_metrics(REFS, PREDS, only=("CIDEr", "SPICE"))
    preds = {k: c for k, c in PREDS.items() if k != "000002"} | {"999999": "a cube"}
    with pytest.raises(ValueError, match=r"1 without a prediction \(e\.g\. \['000002'\]\), 1 without "
                                         r"references \(e\.g\. \['999999'\]\)"):
        caption_metrics(REFS, preds)
    with pytest.raises(ValueError, match=r"ids without reference captions: \['000002'\]"):
        caption_metrics(REFS | {"000002": []}, PREDS)
    with pytest.raises(ValueError, match="'000009' of change type 'color': the id must have references"):
        per_type_cider(REFS, PREDS, {"000001": "color", "000009": "color"})
    with pytest.raises(ValueError, match="'000001' of change type 'colour'"):
        per_type_cider(REFS, PREDS, {"000001": "colour"})
    with pytest.raises(ValueError, match=r"0 without a prediction \(e\.g\. \[\]\), 1 without references"):
        per_type_cider(REFS, PREDS | {"999999": "a cube"}, {"000001": "color"})


def test_missing_java_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(InputError, match="needs a Java runtime.*apt-get install default-jre-headless"):
        caption_metrics(REFS, PREDS)


def test_a_java_that_only_says_there_is_none_is_explained(tmp_path, monkeypatch):
    """macOS has a `java` without any JDK installed: it says so and fails."""
    (tmp_path / "java").write_text('#!/bin/sh\necho "Unable to locate a Java Runtime." >&2\n'
                                   'printf "\\tat the stack trace\\n" >&2\nexit 1\n')
    (tmp_path / "java").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/bin:/usr/bin")
    with pytest.raises(InputError, match=r"needs a Java runtime .*, but `java -version` fails \(Unable to locate a "
                                         r"Java Runtime\.\): install one"):
        caption_metrics(REFS, PREDS)


def test_a_java_program_of_pycocoevalcap_that_fails_is_named(monkeypatch, capfd):
    """A METEOR whose files are gone, say, ends in one line with Java's words, not with a traceback,
    and Java prints nothing of its own before it."""
    import pycocoevalcap.meteor.meteor as meteor
    monkeypatch.setattr(meteor, "METEOR_JAR", "gone.jar")
    with pytest.raises(InputError, match=r"^METEOR \(pycocoevalcap's meteor-1.5.jar, run in Java\) stopped: "
                                         "Error: Unable to access jarfile gone.jar$"):
        caption_metrics(REFS, PREDS, only=("METEOR",))
    import pycocoevalcap.tokenizer.ptbtokenizer as ptb
    monkeypatch.setattr(ptb, "STANFORD_CORENLP_3_4_1_JAR", "gone.jar")
    with pytest.raises(InputError, match=r"^the PTB tokenizer of pycocoevalcap \(run in Java\) did not give back a line "
                                         "for each caption: Error: Could not find or load main class "
                                         r"edu\.stanford\.nlp\.process\.PTBTokenizer; "):
        caption_metrics(REFS, PREDS, only=("CIDEr",))
    assert capfd.readouterr().err == ""


def test_format_table_like_tables_1_and_2():
    metrics = {"BLEU-1": 80.0, "BLEU-2": 70.0, "BLEU-3": 60.0, "BLEU-4": 56.94, "METEOR": 38.36,
               "ROUGE-L": 76.44, "CIDEr": 150.66}
    assert format_table(metrics).splitlines() == [f"{'B':>8}{'M':>8}{'C':>8}{'R':>8}",
                                                  f"{'56.9':>8}{'38.4':>8}{'150.7':>8}{'76.4':>8}"]
    metrics["per_type"] = {"color": 149.1, "texture": 135.3, "move": 91.0, "drop": 135.5, "distractor": 133.4}
    lines = format_table(metrics).splitlines()
    assert lines[-2].split() == ["C", "T", "M", "A", "D", "DI"]
    assert lines[-1].split() == ["149.1", "135.3", "91.0", "-", "135.5", "133.4"]


INTERRUPTED_METEOR = """
import evaluate
from pycocoevalcap.meteor.meteor import Meteor

def interrupted(self, hypothesis, references):  # Ctrl-C while Java scores
    raise KeyboardInterrupt
Meteor._stat = interrupted
try:
    evaluate.meteor({"a": ["the cube moved"]}, {"a": ["a cube moved"]})
except KeyboardInterrupt:
    print("interrupted")
"""


def test_an_interrupted_meteor_lets_the_process_end():
    # pycocoevalcap alone: its clean-up would wait forever for the lock the interrupted scoring kept.
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_METEOR], cwd=Path(__file__).parent.parent,
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "interrupted\n"), result.stderr
