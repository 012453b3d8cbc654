"""benchmarks/prepare_gutenberg.py on a tiny fake collection (tests/fixtures/gutenberg, Author/Title.txt with
Project Gutenberg headers, CRLF line ends as in the real files): every rule checked from the outputs."""

import gzip
import hashlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "prepare_gutenberg.py")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "gutenberg")


def run_script(out, slice_out=None, extra=()):
    cmd = [sys.executable, SCRIPT, FIXTURE, "--out", str(out)]
    if slice_out is not None:
        cmd += ["--slice_out", str(slice_out), "--slice_words", "1000", "--slice_eval_words", "1"]
    subprocess.run(cmd + list(extra), check=True, capture_output=True, text=True)


def read_split(folder, name):
    with gzip.open(os.path.join(folder, f"{name}.jsonl.gz"), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    sliced = tmp_path_factory.mktemp("slice")
    run_script(out, sliced)
    splits = {name: read_split(out, name) for name in ("train", "validation", "test")}
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    return out, sliced, splits, manifest


def by_title(splits):
    return {b["title"]: (name, b) for name, books in splits.items() for b in books}


def test_splits_hold_the_expected_books(outputs):
    _, _, splits, _ = outputs
    placed = {title: (name, b["ebook"]) for title, (name, b) in by_title(splits).items()}
    assert placed == {
        "The Mill on the River": ("train", 9001),  # old-style header, no Language line
        "Songs of the Mill": ("test", 9011),
        "The Long Road": ("validation", 9522),  # the larger of two editions
        "Winter Tales \u2014 Complete": ("train", 9006),  # its "Volume 1" is dropped
        "Letters Without Number": ("train", None),  # no ebook number: split by its path
    }
    for books in splits.values():
        assert all(set(b) == {"text", "ebook", "title", "author"} for b in books)


def test_manifest_counts(outputs):
    out, _, splits, manifest = outputs
    counts = manifest["counts"]
    assert counts["files"] == 9
    assert counts["kept"] == 5
    assert counts["dropped"] == {
        "no_marker": 0,
        "not_english": 1,
        "no_text": 0,
        "same_ebook": 1,
        "duplicate_edition": 1,
        "single_volume": 1,
    }
    assert counts["no_ebook_number"] == 1
    assert counts["no_language_line"] == 2  # the two copies of the old-style file
    assert counts["header_kind"] == {"modern": 7, "old": 2, "none": 0}
    for name, books in splits.items():
        stats = manifest["splits"][name]
        assert stats["books"] == len(books)
        assert stats["words"] == sum(len(b["text"].split()) for b in books)
        assert stats["characters"] == sum(len(b["text"]) for b in books)
        with open(os.path.join(out, f"{name}.jsonl.gz"), "rb") as f:
            assert manifest["files"][f"{name}.jsonl.gz"]["sha256"] == hashlib.sha256(f.read()).hexdigest()


def test_header_footer_and_licence_are_gone(outputs):
    _, _, splits, _ = outputs
    for _, (_, book) in by_title(splits).items():
        text = book["text"]
        for boilerplate in ("Project Gutenberg", "PROJECT GUTENBERG", "START OF", "END OF", "SMALL PRINT",
                            "Produced by", "prepared by", "LICENSE", "Release Date", "\r"):
            assert boilerplate not in text, (book["title"], boilerplate)
        assert text == text.strip()
    mill = by_title(splits)["The Mill on the River"][1]["text"]
    assert mill.startswith("CHAPTER I\n\nIt was a bright cold day")


def test_prose_is_joined_and_verse_keeps_its_lines(outputs):
    _, _, splits, _ = outputs
    books = by_title(splits)
    mill = books["The Mill on the River"][1]["text"]
    # the three hard-wrapped lines became one paragraph line
    assert "striking thirteen as the miller" in mill and "where the boats lay idle" in mill
    paragraphs = mill.split("\n\n")
    assert all("\n" not in p for p in paragraphs[1:])
    song = books["Songs of the Mill"][1]["text"]
    assert song.startswith("THE SONG OF THE MILL\n\n")
    assert "The wheel goes round and round,\n  The water sings below;\nThe miller hears the sound\n" in song
    assert "And that is all I know." in song


def test_output_is_deterministic_and_the_slice_is_a_fixed_subset(outputs, tmp_path):
    out, sliced, splits, manifest = outputs
    again = tmp_path / "again"
    run_script(again)
    for name in ("train", "validation", "test"):
        with open(os.path.join(out, f"{name}.jsonl.gz"), "rb") as a, open(again / f"{name}.jsonl.gz", "rb") as b:
            assert a.read() == b.read()
    with open(os.path.join(sliced, "manifest.json")) as f:
        slice_manifest = json.load(f)
    train_slice = read_split(sliced, "train")
    assert 1000 <= slice_manifest["splits"]["train"]["words"] == sum(len(b["text"].split()) for b in train_slice)
    assert len(train_slice) < len(splits["train"])
    full = {json.dumps(b, sort_keys=True) for b in splits["train"]}
    assert all(json.dumps(b, sort_keys=True) in full for b in train_slice)  # whole books of the train split
    assert read_split(sliced, "validation") == splits["validation"]  # one book: the first in hash order
    assert read_split(sliced, "test") == splits["test"]
    assert manifest["slice"]["files"] == slice_manifest["files"]
