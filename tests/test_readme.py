"""The README stays true to the code: its Quickstart holds the two commands, it stays short enough to read
top to bottom, and every `python ...` or `torchrun ...` command it shows parses its flags, so that none
goes stale. Parsing runs nothing: adapt.py and caption.py go through train.parse_config (the flags and
their ranges), any other script's main() is stopped right after its parser has read the flags."""
import importlib
import re
import shlex
from pathlib import Path

import pytest

import adapt
import caption
import cli
import train

README = (Path(__file__).parent.parent / "README.md").read_text()
QUICKSTART = ("pip install -r requirements.txt && python adapt.py --data synth && python caption.py",
              "pip install -r requirements-dev.txt && python -m pytest")
MAX_LINES = 300


def section(title):
    """The text of the README's `## title` section, up to the next section of that level."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"the README has no '## {title}' section"
    return match[1]


def shown_commands():
    """Every python or torchrun command of the README: in its indented code blocks and its `code` spans,
    each part of an `a && b` line on its own, shell comments left out."""
    lines = [line for line in README.splitlines() if line.startswith("    ")]
    lines += re.findall(r"`((?:python|torchrun) [^`]+)`", README.replace("\n", " "))
    commands = []
    for line in lines:
        for part in " ".join(shlex.split(line, comments=True)).split(" && "):
            words = part.split()
            if words[:1] in (["python"], ["torchrun"]) and words[:2] != ["python", "-m"]:  # -m pytest: pytest's flags
                commands.append(" ".join(words))
    return list(dict.fromkeys(commands))  # each once


def script_and_flags(command):
    """("adapt.py", [flags]) of a command; torchrun's own options, before the script, are left out. A trailing
    `...` (the command goes on as the lines above it) is dropped and the rest parsed; placeholders such as
    HOST or PATH are flag values any string fills, so they parse as they are."""
    words = command.split()[1:]
    if command.startswith("torchrun"):
        words = words[next(i for i, w in enumerate(words) if w.endswith(".py")):]
    if words[-1] == "...":
        words = words[:-1]
    return words[0], words[1:]


class Parsed(Exception):
    """Raised in place of running a command once its parser has read the flags."""


def parse(script, argv, monkeypatch):
    """The flags `argv` of `script` as its command line reads them, without running it; a bad flag raises
    SystemExit (argparse's exit, status 2)."""
    if script in ("adapt.py", "caption.py"):  # the flags and their limits, as train.start_run reads them
        return train.parse_config(adapt.AdaptConfig if script == "adapt.py" else caption.CaptionConfig, argv)
    assert (Path(__file__).parent.parent / script).is_file(), f"the README shows {script}, which is not here"
    main = importlib.import_module(script[:-3]).main  # evaluate.py, synth.py, bench.py, ...
    read = cli.ArgumentParser.parse_args

    def read_then_stop(self, args=None, namespace=None):
        raise Parsed(read(self, args, namespace))

    monkeypatch.setattr(cli.ArgumentParser, "parse_args", read_then_stop)  # each main() parses before any work
    with pytest.raises(Parsed) as parsed:  # a main() that ran without parsing first fails here
        main(argv)
    return parsed.value.args[0]


def test_readme_quickstart_holds_its_two_commands():
    commands = [line.strip() for line in section("Quickstart").splitlines() if line.startswith("    ")]
    assert commands == list(QUICKSTART)


def test_readme_is_at_most_300_lines():
    assert len(README.splitlines()) <= MAX_LINES


def test_readme_shows_commands_of_both_stages_and_evaluation():
    assert {script_and_flags(c)[0] for c in shown_commands()} >= {"adapt.py", "caption.py", "evaluate.py"}


@pytest.mark.parametrize("command", shown_commands())
def test_readme_commands_parse(command, monkeypatch):
    script, argv = script_and_flags(command)
    try:
        parse(script, argv, monkeypatch)
    except (SystemExit, cli.InputError) as e:  # argparse's error exits with status 2
        pytest.fail(f"{command!r}: its flags do not parse ({e!r})")


def test_a_command_with_a_stale_flag_fails_to_parse(monkeypatch):
    for command in ("python adapt.py --data synth --no_such_flag 1", "python evaluate.py --ckpt a.pt --no_such_flag 3",
                    "python bench.py train --stage 3", "python synth.py --out data/synth --pairs many"):
        with pytest.raises(SystemExit):
            parse(*script_and_flags(command), monkeypatch)
