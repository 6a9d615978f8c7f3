"""The command line: every registered subcommand answers --help; the version prints."""

import argparse

import pytest

from autofit.cli import build_parser
from conftest import run_main


def _subcommands(parser: argparse.ArgumentParser, prefix=()) -> list[tuple[str, ...]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*prefix, name))
                out += _subcommands(sub, (*prefix, name))
    return out


COMMANDS = _subcommands(build_parser())


def test_the_documented_commands_are_registered():
    top = {c[0] for c in COMMANDS}
    assert {"train", "tune", "trial", "estimate", "probe", "doctor", "profiles", "serve", "status"} <= top


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_subcommand_has_help(capsys, command):
    code, out, _ = run_main(capsys, *command, "--help")
    assert code == 0
    assert "usage: autofit" in out


def test_version(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.startswith("autofit ")
