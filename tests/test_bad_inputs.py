"""Every mistake in ``bad_input_table.ROWS`` fails where the table says, with a message naming the option, the value
and the fix; the "Common errors" section of docs/errors.md is that table with the messages the rows really produce."""

from __future__ import annotations

import re

import pytest
from bad_input_table import BEFORE_LAUNCH, CONSTRUCTION, ROWS, BadInput, docs_section, error_text, render
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from test_checkpoint_integrity import CASES as DAMAGED_CHECKPOINTS

_MESSAGES: dict[str, tuple[BaseException | None, str]] = {}  # what each row said, for the docs check


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def refuse(self: _SubprocessScriptLauncher) -> None:
        raise AssertionError("processes were launched although the configuration is invalid")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", refuse)


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.mistake)
def test_the_mistake_fails_where_and_as_the_table_says(row: BadInput, tmp_path):
    assert row.caught in (CONSTRUCTION, BEFORE_LAUNCH)
    err, text = error_text(row, tmp_path)
    _MESSAGES[row.mistake] = (err, text)
    assert err is not None, f"{row.mistake}: no error at all"
    assert isinstance(err, row.error), f"{row.mistake}: {type(err).__name__}, not {row.error.__name__}: {text}"
    assert re.search(row.message, text, flags=re.DOTALL), f"{row.mistake}: the message does not match:\n{text}"


def test_the_table_covers_at_least_forty_mistakes():
    assert len(ROWS) + len(DAMAGED_CHECKPOINTS) >= 40
    assert len({row.mistake for row in ROWS}) == len(ROWS)


def test_the_docs_list_the_table_with_its_real_messages():
    expected = render(_MESSAGES)
    assert docs_section() == expected, (
        "docs/errors.md's Common errors section is out of date: run `python tests/bad_input_table.py --write-docs`"
    )
