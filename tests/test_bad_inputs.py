"""Every mistake in ``bad_input_table.ROWS`` fails where the table says, with a message naming the option, the value
and the fix; the "Common errors" section of docs/errors.md is that table with the messages the rows really produce."""

from __future__ import annotations

import re

import pytest
import torch
from bad_input_table import (
    BEFORE_LAUNCH,
    CONSTRUCTION,
    ROWS,
    BadInput,
    damaged_row,
    damaged_texts,
    docs_section,
    error_text,
    render,
    stable_text,
)
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


def test_the_docs_rows_hold_nothing_that_depends_on_the_machine(monkeypatch):
    """The damaged-checkpoint rows carry checksums of float tensors, which another processor's kernels round
    differently. Made from other float data (another seed, denormals flushed), their raw messages change and the
    rows in the docs do not: each such value is a placeholder there, and the rest of the message is compared."""
    before = dict(damaged_texts())
    seed = torch.manual_seed
    monkeypatch.setattr(torch, "manual_seed", lambda value: seed(value + 1))
    torch.set_flush_denormal(True)
    try:
        after = dict(damaged_texts())
    finally:
        torch.set_flush_denormal(False)
    changed = [case.name for case in before if before[case] != after[case]]
    assert {"overwritten single file", "overwritten shard"} <= set(changed), changed  # the data did change
    documented = docs_section().splitlines()
    for case, text in after.items():
        assert damaged_row(case, text) in documented, f"{case.name}: {stable_text(text)}"


def test_placeholders_stand_only_for_what_the_machine_decides():
    assert stable_text("(CRC-32 0badf00d, the save recorded 12345678)") == "(CRC-32 <checksum>, the save recorded <checksum>)"
    assert stable_text("at http://127.0.0.1:41234 did not answer within 3 s") == (
        "at http://127.0.0.1:<port> did not answer within 3 s"
    )
    assert stable_text("took 12.5 s; rank pid 48213") == "took <seconds> s; rank pid <pid>"
    kept = "has 70 bytes but the save wrote 1,261; port 9 at http://127.0.0.1:9; record 'data/0'; tp=2 of 8 heads"
    assert stable_text(kept) == kept  # sizes, fixed ports and the user's own numbers stay as they are
