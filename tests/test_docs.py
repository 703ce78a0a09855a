"""The documentation is short and true to the repository: the README keeps at most 400 lines, every relative link of
README.md and docs/ points at a file (and a section) that exists, every path and `lightning_dist.` name they write
exists, and the file map of docs/architecture.md names every folder and module of the package, each where it is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ENTRY = re.compile(r"^( *)(\S+(?:, \S+)*)(?:  +(.*))?$")  # an entry: its name(s), two spaces, what it holds
NAME = re.compile(r"[A-Za-z_][\w.]*\.py\b|[A-Za-z_]\w*/(?![\w.])")  # a module, or a folder


def test_the_readme_is_a_short_front_page() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 400, f"README.md has {lines} lines; keep it at most 400 and move the rest to a page under docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#", 1)[0]
        if "://" in target or not path:
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to paths that do not exist: {broken}"


def anchors(page: Path) -> set[str]:
    """The anchors a Markdown page has: explicit `<a id="...">` and GitHub's slugs of its headings."""
    text = page.read_text()
    found = set(re.findall(r"""\bid=["']([^"']+)["']""", text))
    for heading in re.findall(r"^#+ +(.+?) *$", text, flags=re.MULTILINE):
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_to_a_section_finds_it(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        path, _, fragment = target.partition("#")
        if "://" in target or not fragment or not (path or page.name).endswith(".md"):
            continue
        linked = page.parent / path if path else page
        if linked.exists() and fragment not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to sections that do not exist: {broken}"


def file_map() -> list[tuple[Path, set[str]]]:
    """The map's entries as (folder or file, the names its description mentions): the code block after the heading
    "File map" of docs/architecture.md, one entry per line whose indentation says its parent folder; deeper-indented
    lines continue the entry above."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("```", text.index("## File map")) + 3 :]
    block = block[block.index("\n") + 1 : block.index("```")]
    entries: list[tuple[Path, set[str]]] = []
    parents: list[tuple[int, Path]] = [(-1, ROOT)]
    entry_indent = -1
    for line in block.splitlines():
        match = ENTRY.match(line)
        indent = len(line) - len(line.lstrip())
        if entries and indent > entry_indent + 2:  # a continuation of the entry above
            entries[-1][1].update(NAME.findall(line))
            continue
        assert match, f"cannot read the file map line {line!r}"
        while parents[-1][0] >= indent:
            parents.pop()
        parent = parents[-1][1]
        names = [name.rstrip(",") for name in match.group(2).split(", ")]
        for name in names:
            entries.append((parent / name, set(NAME.findall(match.group(3) or ""))))
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, parent / names[0]))
        entry_indent = indent
    return entries


def test_the_file_map_names_only_what_exists() -> None:
    missing = []
    for path, mentioned in file_map():
        if not path.exists():
            missing.append(str(path.relative_to(ROOT)))
        base = path if path.is_dir() else path.parent
        for name in mentioned:  # a name in a folder's description is somewhere below that folder
            if not (base / name).exists() and not any(base.rglob(name.rstrip("/"))):
                missing.append(f"{name} (below {base.relative_to(ROOT)})")
    assert not missing, f"docs/architecture.md's file map names what does not exist: {missing}"


def test_the_file_map_names_every_folder_and_module_of_the_package() -> None:
    named = {path for path, _ in file_map()}
    mentioned = {(path if path.is_dir() else path.parent, name) for path, names in file_map() for name in names}
    unnamed = []
    for path in sorted((ROOT / "lightning_dist").rglob("*")):
        if "__pycache__" in path.parts or path.name == "__init__.py" or path.suffix not in (".py", ""):
            continue
        if path.is_dir() and not any(path.glob("*.py")):
            continue
        in_description = any(
            base in path.parents and path.name + ("/" if path.is_dir() else "") == name for base, name in mentioned
        )
        if path not in named and not in_description:
            unnamed.append(str(path.relative_to(ROOT)) + ("/" if path.is_dir() else ""))
    assert not unnamed, f"docs/architecture.md's file map leaves out {unnamed}: add each with what it holds"


PATH_IN_CODE = re.compile(r"`([A-Za-z_][\w./-]*(?:\.py|\.md|\.yaml|/))`")  # `parallel/describe.py`, `configs/`
DOTTED = re.compile(r"\blightning_dist(?:\.\w+)+")  # lightning_dist.parallel.parallelize.parallelize
SEARCHED = ("lightning_dist", "benchmarks", "tests", "docs", "examples", "configs")


def named_path_exists(name: str) -> bool:
    """A path in backticks: from the repository root or the package when it has a folder in it, else anywhere."""
    if "/" in name.rstrip("/"):
        return (ROOT / name).exists() or (ROOT / "lightning_dist" / name).exists()
    folder = name.endswith("/")
    for top in SEARCHED:
        for found in (ROOT / top).rglob(name.rstrip("/")):
            if found.is_dir() == folder and "__pycache__" not in found.parts:
                return True
    return (ROOT / name).exists()


def dotted_name_exists(dotted: str) -> bool:
    """`lightning_dist.a.b.c`: the longest prefix that is a module or package, then a name defined or imported in it
    (read from its source, without importing the package)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:end])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            break
    else:
        return False
    if end == len(parts):
        return True
    return re.search(rf"\b{re.escape(parts[end])}\b", source.read_text()) is not None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_path_and_module_named_in_the_docs_exists(page: Path) -> None:
    text = page.read_text()
    missing = [name for name in PATH_IN_CODE.findall(text) if not named_path_exists(name)]
    missing += [name for name in DOTTED.findall(text) if not dotted_name_exists(name)]
    assert not missing, f"{page.relative_to(ROOT)} names paths or modules that do not exist: {missing}"


def test_the_docs_index_links_every_page() -> None:
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.split("#", 1)[0]).resolve() for target in LINK.findall(index.read_text())}
    unlinked = [str(page.relative_to(ROOT)) for page in PAGES[1:] if page != index and page.resolve() not in linked]
    assert not unlinked, f"docs/README.md (the index) does not link {unlinked}: add a row for each"
