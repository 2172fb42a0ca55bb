"""Paths of the data bundled with the package (see README.md in this folder)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
SAMPLE_CORPUS = ROOT / "corpus" / "peoples_daily_199801.txt"
CILIN = ROOT / "synonyms" / "cilin_extended.txt"
EVAL_DIR = ROOT / "eval"
# The five scored sets, name -> bundled file (pipeline eval); the order is the column order of every table.
STS_SETS: dict[str, str] = {
    "ATEC": "ATEC.test.tsv",
    "BQ": "BQ.dev.tsv",
    "LCQMC": "LCQMC.dev.tsv",
    "PAWSX": "PAWSX.dev.tsv",
    "STS-B": "STS-B.test.tsv",
}
SENTIMENT = EVAL_DIR / "sentiment_reviews.tsv"


def sample_sentences(n: int, min_chars: int = 6, max_chars: int = 40) -> list[str]:
    """``n`` distinct sentences cut from the bundled corpus, in corpus order (tests and benchmarks)."""
    out: list[str] = []
    seen: set[str] = set()
    for line in SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines():
        for piece in line.replace("！", "。").replace("？", "。").split("。"):
            piece = piece.strip()
            if min_chars <= len(piece) <= max_chars and piece not in seen:
                seen.add(piece)
                out.append(piece)
                if len(out) == n:
                    return out
    raise ValueError(f"the sample corpus has fewer than {n} sentences of {min_chars}-{max_chars} characters")
