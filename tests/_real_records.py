"""Real public records (tests/fixtures/real_records, sources in pipeline/resources/README.md) laid out
as the corpora ship: ``wiki_zh/AA/wiki_00`` without an extension, a gzip file, a zip member."""

from __future__ import annotations

import gzip
import shutil
import zipfile
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "real_records"
README_RECORDS = FIXTURES / "nlp_chinese_corpus_readme"
CLUE_SENTENCES = FIXTURES / "clue_small_sentence_per_line.txt"
CLUE_DOCUMENTS = FIXTURES / "clue_small_document_per_line.txt"


def real_layout(root: Path) -> Path:
    """The fixtures in the nlp_chinese_corpus / CLUECorpusSmall file layout under ``root``."""
    (root / "wiki_zh" / "AA").mkdir(parents=True)
    shutil.copy(README_RECORDS / "wiki_zh.json", root / "wiki_zh" / "AA" / "wiki_00")
    (root / "new2016zh").mkdir()
    with gzip.open(root / "new2016zh" / "news2016zh_valid.json.gz", "wb") as f:
        f.write((README_RECORDS / "news2016zh.json").read_bytes())
    with zipfile.ZipFile(root / "baike2018qa.zip", "w") as z:
        z.write(README_RECORDS / "baike2018qa.json", "baike_qa2019/baike_qa_valid.json")
    (root / "webtext2019zh").mkdir()
    shutil.copy(README_RECORDS / "webtext2019zh.json", root / "webtext2019zh" / "web_text_zh_valid.json")
    (root / "translation2019zh").mkdir()
    shutil.copy(
        README_RECORDS / "translation2019zh.json", root / "translation2019zh" / "translation2019zh_valid.json"
    )
    (root / "clue").mkdir()
    shutil.copy(CLUE_SENTENCES, root / "clue" / "wiki_sentences.txt")
    shutil.copy(CLUE_DOCUMENTS, root / "clue" / "news_documents.txt")
    return root
