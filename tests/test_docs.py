"""The README and docs/ hold together: the README stays a short guide, every relative link and
`#anchor` resolves, docs/BENCHMARKS.md's contents list names every section, and the files the README's
commands name exist. Anchors follow GitHub's rules (github-slugger), so a link that works here works
on GitHub. The docs speak of the project as it is: no commit, issue or work-session talk outside
docs/history.md, BENCHMARKS short enough to read, every shipped config in docs/training.md's table, and
every figure the README quotes found, with the same value, in the BENCHMARKS section it links to."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "history.md"
TRAINING = ROOT / "docs" / "training.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BENCHMARKS_MAX_LINES = 1200

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
# A commit hash: 7 to 40 hex digits, not inside a longer hex run (a 64-digit sha256 digest is not one),
# with at least one digit and one letter (so neither a plain number nor a word like "defaced").
COMMIT_HASH = re.compile(r"(?<![0-9A-Za-z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z])")
# Words about how the work was organised rather than about the project: "issue 41", "session". A POSIX
# session (torchrun starts each rank "in a session of its own", setsid) is the project's own subject.
ORGANISATION = re.compile(
    r"\bissues?\s+#?\d+|\bsessions?\b|\bother engineers\b|\bdevice tool\b", re.IGNORECASE
)
POSIX_SESSION = re.compile(r"\bsession of its own\b", re.IGNORECASE)
# A measured quantity with its unit: "12 min 48 s", "768.2 s", "16 ms", "63k sequences/s", "1,354 s".
QUANTITY = re.compile(
    r"(?<![\w.,])(?:(?P<minutes>\d+) min (?P<seconds>\d+(?:\.\d+)?) s\b"
    r"|(?P<number>\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?P<k>k)? ?(?P<unit>sequences/s|ms|min|h|s)(?![\w/]))"
)
UNITS = {"ms": ("time", 1e-3), "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0),
         "sequences/s": ("rate", 1.0)}  # fmt: skip
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
    """Each figure of the README's results table appears once in the README and in the BENCHMARKS section
    its caption links to (the whole page when the caption links none)."""
    readme = README.read_text(encoding="utf-8")
    after_table = readme.split("| avg5 |", 1)[1].split("\n\n", 2)[1] if "| avg5 |" in readme else ""
    cited = re.findall(r"\]\((?:docs/)?BENCHMARKS\.md#([^)\s]+)\)", after_table)
    benchmarks = benchmarks_section(cited[0] if cited else "")
    table = [line for line in readme.splitlines() if re.match(r"^\|.*\bavg5\b|^\|.*\d+\.\d\d \|", line)]
    figures = {f for line in table for f in re.findall(r"(?<![\d.])\d+\.\d\d(?![\d.])", line)}
    assert len(figures) >= 12, "the README's results table was not found"
    for figure in sorted(figures):
        assert figure in benchmarks, f"README figure {figure} is not in docs/BENCHMARKS.md"
        assert len(re.findall(rf"(?<![\d.]){re.escape(figure)}(?![\d.])", readme)) == 1, (
            f"README figure {figure} appears more than once in README.md")


def organisation_words(text: str) -> list[tuple[int, str]]:
    """(line number, match) of every commit hash and every word about how the work was organised."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = POSIX_SESSION.sub("", line)
        found += [(number, m) for m in COMMIT_HASH.findall(line)]
        found += [(number, m.group(0)) for m in ORGANISATION.finditer(line)]
    return found


def test_organisation_words_pattern():
    text = "on b38e498 (issue 33) in this session; sha256 " + "3ec1f54b" * 8 + "\nother engineers' jobs"
    found = [word for _, word in organisation_words(text)]
    assert found == ["b38e498", "issue 33", "session", "other engineers"]
    clean = "torchrun starts each rank in a session of its own; the issue is a full disk; 1,200 issues\n"
    assert organisation_words(clean) == []


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name == "docs" and p != HISTORY],
                         ids=lambda p: str(p.relative_to(ROOT)))  # fmt: skip
def test_docs_speak_of_the_project(page):
    """No commit hash (7-40 hex digits; a 64-digit sha256 pin of an artifact is not one, COMMIT_HASH skips
    it), no "issue N", no "session" in docs/ outside history.md, which is where the history goes."""
    found = organisation_words(page.read_text(encoding="utf-8"))
    where = [f"{page.relative_to(ROOT)}:{number}: {word}" for number, word in found]
    assert not where, "history belongs in docs/history.md:\n" + "\n".join(where)


def test_benchmarks_stays_readable():
    lines = BENCHMARKS.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_MAX_LINES, (
        f"docs/BENCHMARKS.md has {len(lines)} lines (at most {BENCHMARKS_MAX_LINES}): keep each question's "
        "current answer there and move superseded runs to docs/history.md")


def test_benchmarks_sections_name_their_machine():
    """Every section with figures names the machine they ran on (a CPU named in the machines note, with
    whether it has native bf16, or the GPU)."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    note = next(line for line in text.splitlines() if line.startswith("| **CPU A** |"))
    assert "Intel Xeon" in note and "AVX512-BF16" in note and "native bf16" in note
    sections = re.split(r"^(?=#{2,3} )", text, flags=re.MULTILINE)[1:]
    unnamed = [s.splitlines()[0] for s in sections
               if "unmeasured" not in s.splitlines()[0] and not re.search(r"\bCPU A\b|\bH200\b|\bH100\b", s)]
    assert not unnamed, f"sections that do not name their machine: {unnamed}"


def config_table_files(text: str) -> set[str]:
    """The file names in the first column of docs/training.md's table of launch/configs/."""
    section = text.split("## Configs (`launch/configs/`)", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}


def test_training_lists_every_shipped_config():
    listed = config_table_files(TRAINING.read_text(encoding="utf-8"))
    shipped = {path.name for path in (ROOT / "launch" / "configs").iterdir() if path.is_file()}
    missing = sorted(shipped - listed)
    assert shipped and not missing, f"launch/configs/ files missing from docs/training.md's table: {missing}"


def quantities(text: str) -> list[tuple[str, float, float]]:
    """(dimension, value in base units, the step its digits resolve) of every quantity with a unit."""
    found = []
    for m in QUANTITY.finditer(text):
        if m.group("minutes"):
            seconds = m.group("seconds")
            places = len(seconds.split(".")[1]) if "." in seconds else 0
            found.append(("time", 60 * int(m.group("minutes")) + float(seconds), 10.0**-places))
            continue
        number, (dimension, factor) = m.group("number").replace(",", ""), UNITS[m.group("unit")]
        scale = factor * (1000 if m.group("k") else 1)
        places = len(number.split(".")[1]) if "." in number else 0
        found.append((dimension, float(number) * scale, scale * 10.0**-places))
    return found


def same_value(quoted: tuple[str, float, float], measured: tuple[str, float, float]) -> bool:
    """A figure quoted to some precision ("13 min", "about 63k") equals a measurement that rounds to it."""
    (dimension, value, step), (other_dimension, measured_value, _) = quoted, measured
    return dimension == other_dimension and round(measured_value / step) == round(value / step)


def benchmarks_section(anchor: str) -> str:
    """The text under the BENCHMARKS heading with this anchor, down to the next heading of its level or
    above; the whole page for no anchor."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    if not anchor:
        return text
    lines = text.splitlines()
    for start, line in enumerate(lines):
        match = HEADING.match(line)
        if match and slug(heading_text(match.group(2))) == anchor:
            level = len(match.group(1))
            end = next((i for i in range(start + 1, len(lines))
                        if (m := HEADING.match(lines[i])) and len(m.group(1)) <= level), len(lines))
            return "\n".join(lines[start:end])
    raise AssertionError(f"no heading with anchor #{anchor} in docs/BENCHMARKS.md")


def readme_figures(text: str) -> list[tuple[str, str]]:
    """(figure as written, BENCHMARKS anchor it is measured under) for every time or rate in the README's
    prose that cites BENCHMARKS: its paragraph links a BENCHMARKS section (a table, the paragraph after
    it). A time in a paragraph that cites no measurement is a setting (a timeout), not a figure."""
    blocks = re.split(r"\n\s*\n", "\n".join(line for _, line in prose_lines(text)))
    link = re.compile(r"\]\((?:docs/)?BENCHMARKS\.md(?:#([^)\s]*))?\)")
    figures = []
    for i, block in enumerate(blocks):
        cited = link.findall(block)
        if not cited and block.lstrip().startswith("|") and i + 1 < len(blocks):
            cited = link.findall(blocks[i + 1])
        if cited:
            prose = re.sub(r"`[^`]*`|\]\([^)]*\)", "", block)
            figures += [(m.group(0), cited[0]) for m in QUANTITY.finditer(prose)]
    return figures


def test_quantity_matching():
    assert same_value(quantities("13 min")[0], quantities("12 min 48 s")[0])
    assert not same_value(quantities("13 min")[0], quantities("18 min 8 s")[0])
    assert same_value(quantities("about 63k sequences/s")[0], quantities("63,339 sequences/s")[0])
    assert not same_value(quantities("16 ms")[0], quantities("16 s")[0])
    assert [q[0] for q in quantities("1,024 rows, 5.19 s, 16 ms, 45.31")] == ["time", "time"]


def test_readme_figures_match_benchmarks():
    """Each time or rate the README quotes is measured, to the README's precision, in the BENCHMARKS
    section the README links beside it."""
    figures = readme_figures(README.read_text(encoding="utf-8"))
    assert figures, "no time or rate found in the README"
    wrong = []
    for figure, anchor in figures:
        quoted = quantities(figure)[0]
        if not any(same_value(quoted, measured) for measured in quantities(benchmarks_section(anchor))):
            wrong.append(f"{figure!r} (BENCHMARKS#{anchor or ''})")
    assert not wrong, f"README figures not found with the same value in docs/BENCHMARKS.md: {wrong}"
