"""Clean the Project Gutenberg books of ``rcdm-uga/Gutenberg_Text`` into train / validation / test JSON lines.

Usage (see docs/gutenberg.md)::

    git clone https://github.com/rcdm-uga/Gutenberg_Text
    python benchmarks/prepare_gutenberg.py Gutenberg_Text --out gutenberg_clean \
        --slice_out gutenberg_slice --slice_words 17500000

Input: a folder laid out ``Author, Name/Title.txt`` (every regular file one folder deep that does
not start with a dot is read as a book, whatever its extension: a few names were cut before ``.txt``).

Rules, applied in this order (each dropped book is counted under its reason in ``manifest.json``):

1. Header / footer / licence.  The body starts after the last ``*** START OF THE/THIS PROJECT
   GUTENBERG ...`` line that comes before the first ``*** END OF ...`` line; older files have no such
   line and start after the licence's closing line (``*END*THE SMALL PRINT! ...``,
   ``*END THE SMALL PRINT! ...`` or ``["Small Print" V.xx]``).  The body ends at the first
   ``*** END OF THE/THIS PROJECT GUTENBERG`` line; without one, at the last line that starts with
   ``End of (the/this) Project Gutenberg ...`` / ``End of this Etext ...``.  A ``End of ... Project
   Gutenberg ...`` line in the last 40 lines of the body is cut too, as are the producers' credit
   paragraphs (``Produced by``, ``This etext was prepared by``, ...) among the first five paragraphs,
   and the ``<<THIS ELECTRONIC VERSION ... >>`` notices of the 1990s Shakespeare files.  A file where
   no start line is found is kept whole only if it does not mention "Project Gutenberg" in its first
   3,000 characters (then there is no header to strip); otherwise it is dropped as ``no_marker``.
   A body with fewer than 500 words is dropped as ``no_text``.
2. Language.  The header's ``Language:`` line decides: kept if it names English (``English and
   French`` included), dropped as ``not_english`` otherwise.  Without a ``Language:`` line (older
   files) the body decides: English if at least 8 % of its first 20,000 words are one of "the",
   "and", "of", "to", "a", "in" (an English prose text is about 20 %, French or German under 1 %).
3. Ebook number, read in the header: ``[EBook #1234]``, ``[eBook #1234]``, ``[Etext #1234]``,
   ``[Etext 1234]``, ``EBook-No. 1234``.  A file that has none gets the key ``path:<Author>/<file>``
   (counted as ``no_ebook_number``).  The same ebook number in several author folders is one book:
   the copy in the first folder (sorted by path) is kept, the others are ``same_ebook``.
4. Duplicate editions: books with the same author (header ``Author:``, else the folder name) and
   the same normalised title (the header's ``Title:`` line, else the file name's main title before
   any subtitle; lower-cased, accents, punctuation, a leading "the/a/an" and the words
   "complete"/"edition"/"unabridged" removed) and the same volume designation ("Volume 2", "Part
   III", "Second Series", read in the file name, else the header title; file names keep it where
   the header's title often drops it) are one work: the one with the most words is kept (ties: the lowest ebook number), the
   others are ``duplicate_edition``.
5. Single volumes: a book whose title (as in rule 4) is ``<work> <sep> Volume/Vol./Part/Book <n>`` (or an
   ordinal "First Part"...) or names a part of a work (``<work>, <part>``) is dropped as
   ``single_volume`` when the same author has a complete edition of ``<work>``: a title containing
   the word "Complete" whose normalised title, with "complete" removed, is a prefix of the volume's;
   or a longer book by the same author with the work's title and no volume designation.
6. Line breaks.  Paragraphs are separated by blank lines.  A paragraph of several lines is *prose*
   (its lines are joined with single spaces) when it is hard-wrapped: its longest line has 55 to 80
   characters, at least 60 % of its lines except the last reach 75 % of that length, and fewer than
   half of its lines are indented.  Any other paragraph (verse, songs, tables of contents, letters'
   addresses, indented quotations) keeps its line breaks.  Paragraphs are written separated by one
   blank line; trailing spaces are dropped.
7. Split by key (the ebook number, or the path key): ``h = int(sha256("gutenberg-split:" + key)[:8],
   16) % 10000``; ``h < 100`` is validation, ``100 <= h < 200`` test, the rest train (about 1 % each).
   A book's split depends only on its own key, so adding books never moves another one.

Output: ``OUT/{train,validation,test}.jsonl.gz`` (gzip level 9, one JSON object per book:
``text``, ``ebook``, ``title``, ``author``; books sorted by key) and ``OUT/manifest.json``.

``--slice_out DIR --slice_words N`` also writes a small fixed slice: train books ordered by
``sha256("gutenberg-slice:" + key)``, whole books, until at least N words; and, for held-out
perplexity, validation and test books in the same hash order until ``--slice_eval_words`` words
each.  ``--measure_tokens`` trains a byte-level BPE (vocabulary 8192, as
``hf_lookaround.tokenization.train_tokenizer``) on the slice's train text and counts its tokens.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import sys
import time
import unicodedata

SPLIT_SALT = "gutenberg-split:"
SLICE_SALT = "gutenberg-slice:"
VALIDATION_BELOW = 100  # of 10000: 1 %
TEST_BELOW = 200  # of 10000: the next 1 %
MIN_WORDS = 500

START_RE = re.compile(r"^[ \t]*\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
END_RE = re.compile(r"^[ \t]*\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
OLD_START_RE = re.compile(r"^[ \t]*\*+\s*END\*?\s*THE SMALL PRINT.*$|^[ \t]*\[\"Small Print\" V\..*$", re.M | re.I)
OLD_END_RE = re.compile(
    r"^[ \t]*\**\s*End of (?:the |this )?(?:Project Gutenb[eu]rg|Etext|E-text|EBook)\b.*$", re.M | re.I
)
FOOTER_LINE_RE = re.compile(r"^[ \t]*\**\s*End of .*Project Gutenb[eu]rg", re.I)
CREDIT_RE = re.compile(
    r"^\s*(produced by|this (project gutenberg )?e-?text (was )?(prepared|produced) by|e-?text (was )?prepared by|"
    r"etext prepared by|prepared by|transcribed (from|by)|html (version|file) by|this ebook was (prepared|produced) by)",
    re.I,
)
SHAKESPEARE_NOTICE_RE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.S)
EBOOK_RE = re.compile(r"\[\s*e-?(?:book|text)\s*#?\s*(\d+)\s*\]|EBook-No\.\s*(\d+)", re.I)
LANGUAGE_RE = re.compile(r"^Language:\s*(.+?)\s*$", re.M)
TITLE_RE = re.compile(r"^Title:\s*(.+?)\s*$", re.M)
AUTHOR_RE = re.compile(r"^Author:\s*(.+?)\s*$", re.M)
VOLUME_RE = re.compile(
    r"^(?P<work>.+?)\s*(?:[,;:\-\u2014\u2013]+|\s)\s*(?:[\[(]?\s*)"
    r"(?:(?:volume|vol\.?|part|book)\s+(?:\d+|[ivxlc]+|one|two|three|four|five|six|seven|eight|nine|ten)\b"
    r"|(?:first|second|third|fourth|fifth|sixth) (?:part|volume)\b).*$",
    re.I,
)
VOLUME_TAG_RE = re.compile(
    r"\b(?:volume|vol\.?|part|book|series|chapters)(?:\s*\d+|\s+(?:[ivxlc]+|one|two|three|four|five|six|seven|eight|nine|ten)\b)"
    r"|\b(?:first|second|third|fourth|fifth|sixth) (?:part|volume|series)\b",
    re.I,
)
ENGLISH_WORDS = {"the", "and", "of", "to", "a", "in"}


# ----------------------------------------------------------------------------- reading one file


def list_book_files(root: str) -> list[str]:
    """Every regular file one folder deep (``Author/Title``), names starting with a dot skipped, sorted."""
    paths = []
    for author_dir in sorted(os.listdir(root)):
        full = os.path.join(root, author_dir)
        if author_dir.startswith(".") or not os.path.isdir(full):
            continue
        for name in sorted(os.listdir(full)):
            if not name.startswith(".") and os.path.isfile(os.path.join(full, name)):
                paths.append(os.path.join(author_dir, name))
    return paths


def read_text(path: str) -> str:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def split_header_body(text: str) -> tuple[str, str | None, str]:
    """Return ``(header, body, kind)``; body is None when no start line is found (kind ``none``)."""
    end_marker = END_RE.search(text)
    limit = end_marker.start() if end_marker else len(text)
    starts = [m for m in START_RE.finditer(text, 0, limit)]
    if starts:
        header, body_start, kind = text[: starts[0].start()], starts[-1].end(), "modern"
    else:
        old = OLD_START_RE.search(text)
        if old is None:
            return text[:3000], None, "none"
        header, body_start, kind = text[: old.start()], old.end(), "old"
    if end_marker and end_marker.start() > body_start:
        body = text[body_start : end_marker.start()]
    else:
        ends = [m for m in OLD_END_RE.finditer(text, body_start)]
        body = text[body_start : ends[-1].start()] if ends else text[body_start:]
    return header, body, kind


def header_field(regex: re.Pattern, header: str) -> str | None:
    m = regex.search(header)
    return m.group(1).strip() if m else None


def ebook_number(header: str) -> int | None:
    m = EBOOK_RE.search(header)
    if m is None:
        return None
    return int(m.group(1) or m.group(2))


def is_english(language: str | None, body: str) -> bool:
    if language is not None:
        return "english" in language.lower()
    words = body.lower().split()[:20000]
    if not words:
        return False
    return sum(w in ENGLISH_WORDS for w in words) / len(words) >= 0.08


# ----------------------------------------------------------------------------- cleaning the body


def paragraphs_of(body: str) -> list[list[str]]:
    """Blocks of non-blank lines (trailing spaces removed)."""
    blocks, current = [], []
    for line in body.split("\n"):
        line = line.rstrip()
        if line.strip():
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    return blocks


def is_prose(lines: list[str]) -> bool:
    """A hard-wrapped prose paragraph (see rule 6 of the module docstring)."""
    if len(lines) < 2:
        return False
    width = max(len(line) for line in lines)
    if width < 55 or width > 80:
        return False
    indented = sum(line[:1] in (" ", "\t") for line in lines)
    if indented * 2 >= len(lines):
        return False
    body_lines = lines[:-1]
    long_lines = sum(len(line) >= 0.75 * width for line in body_lines)
    return long_lines >= 0.6 * len(body_lines)


def clean_body(body: str) -> str:
    body = SHAKESPEARE_NOTICE_RE.sub("", body)
    blocks = paragraphs_of(body)
    # producers' credits among the first five paragraphs
    head = [b for b in blocks[:5] if not CREDIT_RE.match(b[0])]
    blocks = head + blocks[5:]
    # an "End of the Project Gutenberg EBook of ..." line near the end
    for i in range(len(blocks) - 1, -1, -1):
        if sum(len(b) for b in blocks[i:]) > 40:
            break
        if FOOTER_LINE_RE.match(blocks[i][0]):
            blocks = blocks[:i]
            break
    out = []
    for lines in blocks:
        if is_prose(lines):
            out.append(" ".join(line.strip() for line in lines))
        else:
            out.append("\n".join(lines))
    return "\n\n".join(out)


# ----------------------------------------------------------------------------- titles, duplicates, volumes


def normalise(title: str) -> str:
    t = unicodedata.normalize("NFKD", title)
    t = "".join(c for c in t if not unicodedata.combining(c)).lower().replace("&", " and ")
    t = re.sub(r"[^a-z0-9]+", " ", t)
    t = re.sub(r"\b(complete|edition|unabridged)\b", " ", t)
    t = re.sub(r"^\s*(the|a|an)\s+", "", t)
    return " ".join(t.split())


def main_title(relative_path: str) -> str:
    """The file name's main title: before the first line break (the catalogue's subtitle), without .txt."""
    name = relative_path.split(os.sep, 1)[1] if os.sep in relative_path else relative_path
    if name.endswith(".txt"):
        name = name[:-4]
    return name.split("\r")[0].split("\n")[0].strip()


def is_complete(title: str) -> bool:
    return re.search(r"\bcomplete\b", title, re.I) is not None


def volume_work(title: str) -> str | None:
    m = VOLUME_RE.match(title)
    return m.group("work") if m else None


def volume_tag(*names: str) -> str:
    """The volume designation ("volume 2", "part iii", "second series", "chapters 01") of the first name that has one."""
    for name in names:
        m = VOLUME_TAG_RE.search(name.replace("\r", " "))
        if m:
            return " ".join(m.group(0).lower().replace(".", " ").split())
    return ""


def split_of(key: str) -> str:
    h = int(hashlib.sha256((SPLIT_SALT + key).encode()).hexdigest()[:8], 16) % 10000
    if h < VALIDATION_BELOW:
        return "validation"
    if h < TEST_BELOW:
        return "test"
    return "train"


def slice_order(key: str) -> str:
    return hashlib.sha256((SLICE_SALT + key).encode()).hexdigest()


# ----------------------------------------------------------------------------- the pipeline


def load_books(root: str, counts: dict) -> list[dict]:
    """Read, strip and filter every file; returns the candidate books (before duplicates)."""
    books = []
    for rel in list_book_files(root):
        counts["files"] += 1
        text = read_text(os.path.join(root, rel))
        header, body, kind = split_header_body(text)
        if body is None:
            if "project gutenb" in text[:3000].lower():
                counts["dropped"]["no_marker"] += 1
                continue
            counts["no_marker_kept_whole"] += 1
            body = text
        counts["header_kind"][kind] += 1
        language = header_field(LANGUAGE_RE, header)
        if language is None:
            counts["no_language_line"] += 1
        if not is_english(language, body):
            counts["dropped"]["not_english"] += 1
            continue
        cleaned = clean_body(body)
        words = len(cleaned.split())
        if words < MIN_WORDS:
            counts["dropped"]["no_text"] += 1
            continue
        number = ebook_number(header)
        if number is None:
            counts["no_ebook_number"] += 1
            key = "path:" + rel.replace("\r", " ")
        else:
            key = str(number)
        folder = rel.split(os.sep, 1)[0]
        title = header_field(TITLE_RE, header) or main_title(rel)
        author = header_field(AUTHOR_RE, header) or folder
        books.append(
            {
                "key": key,
                "ebook": number,
                "title": title,
                "author": author,
                "path": rel,
                "key_title": header_field(TITLE_RE, header) or main_title(rel),
                "volume": volume_tag(rel.split(os.sep, 1)[1], header_field(TITLE_RE, header) or ""),
                "words": words,
                "text": cleaned,
            }
        )
    return books


def drop_duplicates(books: list[dict], counts: dict, log: list) -> list[dict]:
    # rule 3: one book per ebook number (first path wins; books are in path order)
    seen, unique = set(), []
    for b in books:
        if b["key"] in seen:
            counts["dropped"]["same_ebook"] += 1
            log.append(("same_ebook", b["path"]))
            continue
        seen.add(b["key"])
        unique.append(b)

    # rule 4: same author + normalised title -> keep the most words, then the lowest ebook number
    def rank(b):
        return (-b["words"], b["ebook"] if b["ebook"] is not None else 10**9, b["path"])

    groups: dict = {}
    for b in unique:
        groups.setdefault((normalise(b["author"]), normalise(b["key_title"]), b["volume"]), []).append(b)
    kept = []
    for group in groups.values():
        group.sort(key=rank)
        kept.append(group[0])
        for b in group[1:]:
            counts["dropped"]["duplicate_edition"] += 1
            log.append(("duplicate_edition", b["path"], "kept " + group[0]["path"]))

    # rule 5: volumes / parts of a work whose complete edition is present
    complete_bases: dict = {}
    whole_books: dict = {}  # (author, normalised title) -> the book without a volume designation
    for b in kept:
        if is_complete(b["key_title"]):
            complete_bases.setdefault(normalise(b["author"]), []).append((normalise(b["key_title"]), b["path"]))
        if not b["volume"]:
            whole_books[(normalise(b["author"]), normalise(b["key_title"]))] = b
    result = []
    for b in kept:
        bases = complete_bases.get(normalise(b["author"]), [])
        work = volume_work(b["key_title"]) if not is_complete(b["key_title"]) else None
        holder = None
        if work is not None:
            norm_work = normalise(work)
            for base, path in bases:
                if base and (norm_work == base or norm_work.startswith(base + " ")):
                    holder = path
                    break
        if holder is None and not is_complete(b["key_title"]):
            # parts named by name ("Divine Comedy, Longfellow's Translation, Paradise")
            norm = normalise(b["key_title"])
            for base, path in bases:
                if base and norm.startswith(base + " ") and "," in b["key_title"]:
                    holder = path
                    break
        if holder is None and b["volume"] and not is_complete(b["key_title"]):
            # "A Tramp Abroad — Volume 01" (its header title: "A Tramp Abroad") next to a longer "A Tramp Abroad"
            whole = whole_books.get((normalise(b["author"]), normalise(work or b["key_title"])))
            if whole is not None and whole is not b and whole["words"] > b["words"]:
                holder = whole["path"]
        if holder is not None:
            counts["dropped"]["single_volume"] += 1
            log.append(("single_volume", b["path"], "complete " + holder))
            continue
        result.append(b)
    return sorted(result, key=lambda b: (b["ebook"] is None, b["ebook"] or 0, b["key"]))


def write_jsonl_gz(path: str, books: list[dict]) -> None:
    # mtime=0 and no file name in the gzip header: the same books give the same bytes
    with open(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=raw, mtime=0) as gz:
            for b in books:
                record = {"text": b["text"], "ebook": b["ebook"], "title": b["title"], "author": b["author"]}
                gz.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_stats(books: list[dict]) -> dict:
    return {
        "books": len(books),
        "words": sum(b["words"] for b in books),
        "characters": sum(len(b["text"]) for b in books),
    }


def write_split_folder(out: str, splits: dict) -> dict:
    os.makedirs(out, exist_ok=True)
    files = {}
    for name in ("train", "validation", "test"):
        path = os.path.join(out, f"{name}.jsonl.gz")
        write_jsonl_gz(path, splits[name])
        files[f"{name}.jsonl.gz"] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
    return files


def take_words(books: list[dict], words: int) -> list[dict]:
    """Whole books in slice hash order until at least ``words`` words."""
    taken, total = [], 0
    for b in sorted(books, key=lambda b: slice_order(b["key"])):
        if total >= words:
            break
        taken.append(b)
        total += b["words"]
    return sorted(taken, key=lambda b: (b["ebook"] is None, b["ebook"] or 0, b["key"]))


def measure_tokens(books: list[dict], vocab_size: int = 8192) -> dict:
    """Train a byte-level BPE on the books (as hf_lookaround.tokenization.train_tokenizer) and count tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((b["text"] for b in books), trainer=trainer)
    tokens = sum(len(e.ids) for e in tok.encode_batch([b["text"] for b in books]))
    words = sum(b["words"] for b in books)
    return {"vocab_size": vocab_size, "tokens": tokens, "tokens_per_word": round(tokens / words, 4)}


def new_counts() -> dict:
    return {
        "files": 0,
        "dropped": {k: 0 for k in ("no_marker", "not_english", "no_text", "same_ebook", "duplicate_edition", "single_volume")},
        "header_kind": {"modern": 0, "old": 0, "none": 0},
        "no_marker_kept_whole": 0,
        "no_language_line": 0,
        "no_ebook_number": 0,
    }


def prepare(root: str, out: str, slice_out: str | None = None, slice_words: int = 0,
            slice_eval_words: int = 400_000, measure: bool = False, log_path: str | None = None) -> dict:
    started = time.time()
    counts = new_counts()
    log: list = []
    books = load_books(root, counts)
    books = drop_duplicates(books, counts, log)
    counts["kept"] = len(books)
    splits = {"train": [], "validation": [], "test": []}
    for b in books:
        splits[split_of(b["key"])].append(b)
    manifest = {
        "source": "Project Gutenberg (via rcdm-uga/Gutenberg_Text)",
        "rules": "see the docstring of benchmarks/prepare_gutenberg.py",
        "counts": counts,
        "splits": {name: split_stats(bs) for name, bs in splits.items()},
        "files": write_split_folder(out, splits),
    }
    if slice_out:
        sliced = {
            "train": take_words(splits["train"], slice_words),
            "validation": take_words(splits["validation"], slice_eval_words),
            "test": take_words(splits["test"], slice_eval_words),
        }
        slice_manifest = {
            "source": manifest["source"],
            "slice_of": "the full train/validation/test splits; whole books in sha256('gutenberg-slice:' + key) order",
            "slice_words": slice_words,
            "slice_eval_words": slice_eval_words,
            "splits": {name: split_stats(bs) for name, bs in sliced.items()},
            "files": write_split_folder(slice_out, sliced),
        }
        if measure:
            slice_manifest["tokens"] = measure_tokens(sliced["train"])
        with open(os.path.join(slice_out, "manifest.json"), "w") as f:
            json.dump(slice_manifest, f, indent=2, sort_keys=True)
        manifest["slice"] = slice_manifest
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    if log_path:
        with open(log_path, "w") as f:
            for entry in log:
                f.write("\t".join(e.replace("\r", " | ") for e in entry) + "\n")
    manifest["seconds"] = round(time.time() - started, 1)
    return manifest


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="the cloned Gutenberg_Text folder (Author/Title.txt)")
    parser.add_argument("--out", required=True, help="output folder for {train,validation,test}.jsonl.gz and manifest.json")
    parser.add_argument("--slice_out", default=None, help="also write a small fixed slice into this folder")
    parser.add_argument("--slice_words", type=int, default=17_500_000, help="train words of the slice (whole books)")
    parser.add_argument("--slice_eval_words", type=int, default=400_000, help="validation and test words of the slice, each")
    parser.add_argument("--measure_tokens", action="store_true", help="train an 8192-entry byte-level BPE on the slice and count its tokens")
    parser.add_argument("--log", default=None, help="write one line per dropped duplicate / volume (reason, path, kept)")
    args = parser.parse_args(argv)
    manifest = prepare(args.source, args.out, args.slice_out, args.slice_words, args.slice_eval_words,
                       args.measure_tokens, args.log)
    summary = {k: manifest[k] for k in ("counts", "splits", "seconds")}
    if "slice" in manifest:
        summary["slice"] = {k: v for k, v in manifest["slice"].items() if k in ("splits", "files", "tokens")}
    json.dump(summary, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
