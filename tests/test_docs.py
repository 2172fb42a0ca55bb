"""The README and docs/ hold together: the README stays a short guide, every relative link and
`#anchor` resolves, docs/BENCHMARKS.md's contents list names every section, and the files the README's
commands name exist. Anchors follow GitHub's rules (github-slugger), so a link that works here works
on GitHub."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
# A commit hash: 7 to 40 hex digits, not inside a longer hex run (a 64-digit sha256 digest is not one),
# with at least one digit and one letter (so neither a plain number nor a word like "defaced").
COMMIT_HASH = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z])")
REPO_PATH = re.compile(r"(?<![\w./-])((?:\.ci|launch|benchmarks|pipeline|tests|shards|docs)/[\w./-]*[\w])")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def code_blocks(text: str) -> list[str]:
    """The contents of every fenced code block."""
    blocks, current = [], None
    for line in text.splitlines():
        if FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def heading_text(raw: str) -> str:
    """What GitHub renders of a heading's markdown: link text for links, code without backticks,
    no emphasis markers or inline HTML."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|__|\*|(?<!\w)_(?!\w))", "", text)
    return text.strip()


def slug(text: str) -> str:
    """GitHub's heading anchor (github-slugger): lower case; every character dropped except letters
    (CJK included), marks, digits, spaces, '-' and '_'; each space becomes '-'."""
    kept = [c for c in text.lower() if unicodedata.category(c)[0] in "LMN" or c in " -_"]
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link may name in a page: heading slugs (repeats get -1, -2, ...) and
    explicit <a id=...>/<a name=...> anchors."""
    text = path.read_text(encoding="utf-8")
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(heading_text(match.group(2)))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link that is not to another site, outside code."""
    links = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)
        targets = INLINE_LINK.findall(line) + REFERENCE_LINK.findall(line)
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto: ...
                continue
            links.append((number, target))
    return links


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(root)})")
    return broken


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("The mission's size: every stage at up to 110M sentences (issue 25)",
         "the-missions-size-every-stage-at-up-to-110m-sentences-issue-25"),
        ("Projection: the full nlp_chinese_corpus on a cluster (on paper)",
         "projection-the-full-nlp_chinese_corpus-on-a-cluster-on-paper"),
        ("Teacher vectors: int8 beside fp16", "teacher-vectors-int8-beside-fp16"),
        ("Zero-shot: Spearman x100 of cosine, five sets (eval --suite [sts] --max_pairs 2000)",
         "zero-shot-spearman-x100-of-cosine-five-sets-eval---suite-sts---max_pairs-2000"),
        ("1. Preprocess – **split**, `dedup` & [shards](x.md)", "1-preprocess--split-dedup--shards"),
        ("训练：教师向量（int8）与 fp16", "训练教师向量int8与-fp16"),
        ("GPU figures still unmeasured", "gpu-figures-still-unmeasured"),
        ("Ünïcode Façade", "ünïcode-façade"),
    ],
)
def test_slug_follows_github(heading, anchor):
    assert slug(heading_text(heading)) == anchor


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "p.md"
    text = "# A\n## Setup\n```\n## Setup\n```\n## Setup\n<a id=\"old-name\"></a>\n"
    page.write_text(text, encoding="utf-8")
    assert anchors(page) == {"a", "setup", "setup-1", "old-name"}


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n## Its part\n", encoding="utf-8")
    page = tmp_path / "p.md"
    page.write_text(
        "# Top\n[ok](other.md#its-part) [ok](#top) [ok](https://example.com/x.md#y) `[code](nowhere.md)`\n"
        "[bad file](missing.md) [bad anchor](other.md#no-part) [bad here](#nothing)\n",
        encoding="utf-8",
    )
    found = broken_links(page, root=tmp_path)
    assert [entry.split(": ", 1)[1].split(" (")[0] for entry in found] == [
        "missing.md", "other.md#no-part", "#nothing"]


def test_commit_hash_pattern():
    assert COMMIT_HASH.findall("on 52a623d and b38e498, a9896be.") == ["52a623d", "b38e498", "a9896be"]
    assert COMMIT_HASH.findall("sha256 " + "3ec1f54b" * 8) == []  # a 64-digit digest is not a commit
    assert COMMIT_HASH.findall("1234567 sentences, defaced, 110,381, cu128, e5-small") == []


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; keep it a guide, move detail to docs/"


def test_readme_names_no_commit():
    found = COMMIT_HASH.findall(README.read_text(encoding="utf-8"))
    assert not found, f"README.md names commits {found}: history belongs in docs/history.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_benchmarks_contents_lists_every_section():
    text = BENCHMARKS.read_text(encoding="utf-8")
    lines = prose_lines(text)
    first = next(i for i, (_, line) in enumerate(lines) if line.startswith("## "))
    listed = {target[1:] for _, line in lines[:first] for target in INLINE_LINK.findall(line)
              if target.startswith("#")}
    sections = [heading_text(line[3:]) for _, line in lines if line.startswith("## ")]
    missing = [s for s in sections if slug(s) not in listed]
    assert sections and not missing, f"sections missing from the contents list: {missing}"


def test_benchmarks_sections_open_with_their_question():
    text = BENCHMARKS.read_text(encoding="utf-8")
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title, _, body = section.partition("\n")
        first_paragraph = body.strip().split("\n\n")[0]
        assert first_paragraph.startswith("**Question.**"), f"'## {title}' does not open with its question"


def test_readme_commands_name_files_that_exist():
    text = README.read_text(encoding="utf-8")
    named = {path for block in code_blocks(text) for path in REPO_PATH.findall(block)}
    assert named, "no repository file named in the README's code blocks"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"README commands name files that do not exist: {missing}"


def test_readme_results_match_benchmarks():
    """Each figure of the README's results table appears once in the README and in docs/BENCHMARKS.md."""
    readme = README.read_text(encoding="utf-8")
    benchmarks = BENCHMARKS.read_text(encoding="utf-8")
    table = [line for line in readme.splitlines() if re.match(r"^\|.*\bavg5\b|^\|.*\d+\.\d\d \|", line)]
    figures = {f for line in table for f in re.findall(r"(?<![\d.])\d+\.\d\d(?![\d.])", line)}
    assert len(figures) >= 12, "the README's results table was not found"
    for figure in sorted(figures):
        assert figure in benchmarks, f"README figure {figure} is not in docs/BENCHMARKS.md"
        assert len(re.findall(rf"(?<![\d.]){re.escape(figure)}(?![\d.])", readme)) == 1, (
            f"README figure {figure} appears more than once in README.md")
