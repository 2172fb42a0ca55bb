"""Paths of the data bundled with the package (see README.md in this folder)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
SAMPLE_CORPUS = ROOT / "corpus" / "peoples_daily_199801.txt"
CILIN = ROOT / "synonyms" / "cilin_extended.txt"
EVAL_DIR = ROOT / "eval"
SENTIMENT = EVAL_DIR / "sentiment_reviews.tsv"
