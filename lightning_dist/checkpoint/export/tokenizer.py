"""The files beside the weights that make an export a folder serving tools load as it is: the tokenizer (its
``tokenizer.json`` or vocabulary files, config, special tokens, chat template) and the generation config, copied byte
for byte from the folder the model was trained from (the ``initial_weights`` the checkpoint records) or from the
folder the user names."""

from __future__ import annotations

import shutil
from pathlib import Path

#: What an export copies when the source folder has it.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)  # fmt: skip


def tokenizer_source(recorded: str | None, given: str | Path | None) -> tuple[Path | None, str]:
    """The folder to copy from (``given`` first, then ``recorded``), and a sentence saying where the files come from
    or why there are none."""
    if given is not None:
        folder = Path(given).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"--tokenizer {str(given)!r}: no such folder (give the folder holding tokenizer.json)"
            )
        return folder, f"tokenizer files from {str(folder)!r}"
    if recorded is None:
        return None, (
            "no tokenizer files copied: the checkpoint records no initial_weights folder to copy them from; give"
            " --tokenizer PATH (the published model's folder)"
        )
    folder = Path(recorded)
    if not folder.is_dir():
        return None, (
            f"no tokenizer files copied: the initial_weights folder the checkpoint records ({recorded!r}) is not"
            " there any more; give --tokenizer PATH"
        )
    return folder, f"tokenizer files from the initial_weights folder {recorded!r}"


def copy_tokenizer_files(source: Path | None, folder: Path) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` ``source`` holds into ``folder`` (replacing a file of the same name written
    there before); returns their names."""
    if source is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        file = source / name
        if file.is_file():
            shutil.copyfile(file, folder / name)
            copied.append(name)
    return copied
