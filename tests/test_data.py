"""Training data with `datasets`: loading every file type, exact packing, the cache, streaming, ranks, errors.

All data is made in tmp_path; the `datasets` cache goes to tmp_path too."""

import gzip
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hf_lookaround.data.text import build_blocks, chunk_into_blocks, load_text_dataset, split_for_rank
from hf_lookaround.cli.pretrain import parse_args
from hf_lookaround.training.pretraining import run
from hf_lookaround.data.tokenization import train_tokenizer
from conftest import HUNG_CHILD_SECONDS  # a guard against a hung child, not a speed test

WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()


def documents(n: int, seed: int = 0, words=(5, 80)) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))).capitalize() + "." for _ in range(n)]


def write_jsonl(path: Path, texts, field="text", gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({field: t, "id": len(t)}) + "\n")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(documents(200, seed=99), vocab_size=300)


def stream_of(texts, tok) -> list[int]:
    return [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def rows(blocks) -> list[list[int]]:
    return [list(b["input_ids"]) for b in blocks]


# ---------------------------------------------------------------------------------------------
def test_loads_txt_jsonl_gz_json_and_parquet_in_path_order(tmp_path):
    docs = documents(9, seed=1)
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text(docs[0])  # one document per .txt file
    with gzip.open(data / "b.txt.gz", "wt") as f:
        f.write(docs[1])
    write_jsonl(data / "c.jsonl", docs[2:4], field="body")
    write_jsonl(data / "d.jsonl.gz", ["", "   "] + docs[4:6], field="body", gz=True)  # empty ones are skipped later
    pq.write_table(pa.table({"body": docs[6:8], "n": [1, 2]}), data / "sub" / "e.parquet")
    write_jsonl(data / "sub" / "f.json", docs[8:], field="body")
    (data / "ignored.csv").write_text("x,y")
    cache = str(tmp_path / "cache")

    ds = load_text_dataset(data, text_column="body", cache_dir=cache)
    assert isinstance(ds, datasets.Dataset) and ds.column_names == ["body"]
    assert [t for t in ds["body"] if t.strip()] == docs  # sorted paths: a, b, c, d, sub/e, sub/f
    assert all(f["filename"].startswith(cache) for f in ds.cache_files)
    stream = load_text_dataset(data, text_column="body", streaming=True)
    assert isinstance(stream, datasets.IterableDataset)
    assert [r["body"] for r in stream if r["body"].strip()] == docs

    with pytest.raises(ValueError, match="no field 'text'"):
        load_text_dataset(data / "c.jsonl", cache_dir=cache)
    with pytest.raises(ValueError, match="no field 'text'"):
        load_text_dataset(data / "sub" / "e.parquet", cache_dir=cache)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text found"):
        load_text_dataset(empty, cache_dir=cache)


@pytest.mark.parametrize("num_proc", [None, 2])
def test_blocks_are_the_bos_prefixed_token_stream_and_only_its_tail_is_dropped(tmp_path, tokenizer, num_proc):
    texts = documents(60, seed=2)
    write_jsonl(tmp_path / "train.jsonl", texts[:30] + ["", " \n "] + texts[30:])
    ds = load_text_dataset(tmp_path / "train.jsonl", cache_dir=str(tmp_path / "cache"))
    # 7 documents per map batch: blocks cross batch (and num_proc shard) boundaries
    blocks, stats = build_blocks(ds, tokenizer, block_size=16, num_proc=num_proc, batch_size=7)
    stream = stream_of(texts, tokenizer)
    assert stats.documents == 60 and stats.tokens == len(stream)
    assert stats.blocks == len(blocks) == len(stream) // 15
    assert stats.dropped_tokens == len(stream) % 15 < 15
    for k, block in enumerate(rows(blocks)):
        assert len(block) == 16 and block[0] == tokenizer.bos_token_id
        assert block[1:] == stream[15 * k : 15 * (k + 1)]  # nothing lost or reordered between blocks
    assert "tokens dropped at the end of the stream" in stats.describe()
    # one document per map batch, blocks longer than several documents: most batches start no block
    long_blocks, long_stats = build_blocks(ds, tokenizer, block_size=200, num_proc=num_proc, batch_size=1)
    assert rows(long_blocks) == [[tokenizer.bos_token_id] + stream[199 * k : 199 * (k + 1)]
                                 for k in range(len(stream) // 199)]
    assert long_stats.dropped_tokens == len(stream) % 199


def test_second_build_loads_the_cache_without_tokenizing(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", documents(40, seed=3))
    cache = str(tmp_path / "cache")
    first, _ = build_blocks(load_text_dataset(tmp_path / "train.jsonl", cache_dir=cache), tokenizer, 32)
    assert first.cache_files and all(f["filename"].startswith(cache) for f in first.cache_files)
    with mock.patch.object(type(tokenizer), "__call__", side_effect=AssertionError("tokenized again")):
        second, stats = build_blocks(load_text_dataset(tmp_path / "train.jsonl", cache_dir=cache), tokenizer, 32)
    assert [f["filename"] for f in second.cache_files] == [f["filename"] for f in first.cache_files]
    assert rows(second) == rows(first) and stats.blocks == len(first)
    # another block size is another cache entry (the tokenized documents are reused, packing runs again)
    with mock.patch.object(type(tokenizer), "__call__", side_effect=AssertionError("tokenized again")):
        other, _ = build_blocks(load_text_dataset(tmp_path / "train.jsonl", cache_dir=cache), tokenizer, 16)
    assert len(rows(other)[0]) == 16


def test_streaming_yields_the_same_blocks_as_map_style(tmp_path, tokenizer):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", documents(25, seed=4))
    write_jsonl(data / "b.jsonl.gz", documents(20, seed=5), gz=True)
    map_style, stats = build_blocks(load_text_dataset(data, cache_dir=str(tmp_path / "cache")), tokenizer, 24)
    stream, none = build_blocks(load_text_dataset(data, streaming=True), tokenizer, 24, batch_size=4)
    assert none is None and isinstance(stream, datasets.IterableDataset)
    assert rows(stream) == rows(map_style)  # the carry-over packs across batches exactly as the global packing
    assert rows(stream) == rows(map_style)  # a second pass starts afresh (no carry from the first)
    assert len(rows(map_style)) == stats.blocks > 10


def test_chunk_into_blocks_keeps_documents_in_memory_api(tokenizer):
    texts = documents(12, seed=6)
    blocks = chunk_into_blocks(texts, tokenizer, block_size=20)
    stream = stream_of(texts, tokenizer)
    assert rows(blocks) == [[tokenizer.bos_token_id] + stream[19 * k : 19 * (k + 1)] for k in range(len(stream) // 19)]
    with pytest.raises(ValueError, match="fewer than one block"):
        chunk_into_blocks(["tiny"], tokenizer, block_size=512)


@pytest.mark.parametrize("files", [1, 2])
def test_split_dataset_by_node_gives_disjoint_parts(tmp_path, tokenizer, files):
    texts = documents(40, seed=7)
    parts = [texts[i::files] for i in range(files)]
    for i, part in enumerate(parts):
        write_jsonl(tmp_path / f"part{i}.jsonl", part)
    blocks, _ = build_blocks(load_text_dataset(tmp_path, streaming=True), tokenizer, 16)
    everything = rows(blocks)
    ranks = [rows(split_for_rank(blocks, rank, 2)) for rank in (0, 1)]
    assert ranks[0] and ranks[1]
    seen = [tuple(b) for r in ranks for b in r]
    assert len(seen) == len(set(seen))  # no block on both ranks
    if files == 1:  # one shard: every rank packs the stream and keeps every other block
        assert ranks[0] == everything[0::2] and ranks[1] == everything[1::2]
    else:  # two shards: each rank reads (and packs) only its own file
        for rank in (0, 1):
            own, _ = build_blocks(load_text_dataset(tmp_path / f"part{rank}.jsonl", streaming=True), tokenizer, 16)
            assert ranks[rank] == rows(own)
    with pytest.raises(ValueError, match="outside a world"):
        split_for_rank(blocks, 2, 2)


# ---------------------------------------------------------------------------------------------
# The pretraining command: errors, and two processes
# ---------------------------------------------------------------------------------------------
TINY = "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64"


def command(tmp_path, tok_dir, *extra):
    return [
        "--train_files", str(tmp_path / "train.jsonl"), "--tokenizer_name", str(tok_dir), "--preset", "tiny",
        "--config_overrides", TINY, "--block_size", "16", "--output_dir", str(tmp_path / "out"),
        "--cache_dir", str(tmp_path / "cache"), "--per_device_train_batch_size", "2", "--report_to", "none",
        "--disable_tqdm", "true", "--use_cpu", "true", "--save_strategy", "no", *extra,
    ]


def test_clear_errors(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", documents(30, seed=8))
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)

    def fails(match, *extra):
        with pytest.raises(ValueError, match=match):
            run(*parse_args(command(tmp_path, tok_dir, *extra)))

    fails("preprocessing_num_workers", "--streaming", "--do_train", "--max_steps", "2",
          "--preprocessing_num_workers", "2")
    fails("give --max_steps", "--streaming", "--do_train")
    fails("cannot hold out", "--streaming", "--do_train", "--do_eval", "--max_steps", "2")
    fails("max_position_embeddings", "--do_train", "--max_steps", "1", "--block_size", "100000")
    # one .txt file is one document: 5 % of it holds out none, and the message says so (not "needs > 0")
    (tmp_path / "one.txt").write_text(" ".join(documents(30, seed=8)))
    with pytest.raises(ValueError, match=r"5 of 1 training document\(s\) holds out none.*--validation_files"):
        run(*parse_args(command(tmp_path, tok_dir, "--max_steps", "1") + ["--train_files", str(tmp_path / "one.txt")]))
    # empty data: only empty documents
    write_jsonl(tmp_path / "blank.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="no text found"):
        run(*parse_args(command(tmp_path, tok_dir, "--do_train", "--max_steps", "1", "--validation_split_percentage",
                                "0") + ["--train_files", str(tmp_path / "blank.jsonl")]))
    write_jsonl(tmp_path / "tiny.jsonl", ["a few words"])  # fewer tokens than one block
    with pytest.raises(ValueError, match="got no block of 16 tokens"):
        run(*parse_args(command(tmp_path, tok_dir, "--streaming", "--do_train", "--max_steps", "1")
                        + ["--train_files", str(tmp_path / "tiny.jsonl")]))
    # a tokenizer with neither BOS nor CLS
    no_bos = tmp_path / "nobos"
    bare = train_tokenizer(documents(20, seed=9), vocab_size=300)
    bare.bos_token = None
    bare.cls_token = None
    bare.save_pretrained(no_bos)
    with pytest.raises(ValueError, match="no BOS or CLS|neither a BOS nor a CLS"):
        run(*parse_args(command(tmp_path, no_bos, "--do_train", "--max_steps", "1")))


def test_streaming_run_honours_max_train_samples(tmp_path, tokenizer):
    write_jsonl(tmp_path / "train.jsonl", documents(30, seed=10))
    write_jsonl(tmp_path / "valid.jsonl", documents(6, seed=11))
    tokenizer.save_pretrained(tmp_path / "tok")
    metrics = run(*parse_args(command(tmp_path, tmp_path / "tok", "--streaming", "--do_train", "--do_eval",
                                      "--max_steps", "3", "--max_train_samples", "4", "--max_eval_samples", "4",
                                      "--validation_files", str(tmp_path / "valid.jsonl"),
                                      "--perplexity_max_documents", "1")))
    assert metrics["train_loss"] > 0 and metrics["eval_loss"] > 0
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.arrow"))  # nothing written


WORKER = textwrap.dedent('''
    """Run `pretrain` on 2 processes; record what each rank trained on and who trained the tokenizer."""
    import json, os, sys
    import torch.distributed as dist
    from hf_lookaround.cli.pretrain import main
    from hf_lookaround.data import tokenization
    from hf_lookaround.training import pretraining

    record = os.environ["RECORD_DIR"]
    rank = int(os.environ["RANK"])
    real_train = tokenization.train_tokenizer

    def counted(*args, **kwargs):
        open(os.path.join(record, f"tokenizer_trained_by_{rank}"), "w").close()
        return real_train(*args, **kwargs)

    tokenization.train_tokenizer = counted

    class Recording(pretraining.LookAroundTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            with open(os.path.join(record, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps({"world": dist.get_world_size(), "input_ids": inputs["input_ids"].tolist()}) + "\\n")
            return super().training_step(model, inputs, num_items_in_batch)

    pretraining.LookAroundTrainer = Recording
    main(sys.argv[1:])
''')


def test_two_processes_streaming_with_a_tokenizer_trained_once(tmp_path):
    # 2 files, so that split_dataset_by_node gives each rank its own file; the second is short, so that
    # rank 1 runs out of blocks before the last step and must go round its part again
    docs = documents(10, seed=12, words=(20, 30))
    write_jsonl(tmp_path / "p0.jsonl", docs[:8])
    write_jsonl(tmp_path / "p1.jsonl", docs[8:])
    record = tmp_path / "record"
    record.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out"
    argv = [
        "--train_files", str(tmp_path / "p0.jsonl"), str(tmp_path / "p1.jsonl"), "--train_tokenizer",
        "--tokenizer_vocab_size", "300", "--preset", "tiny", "--config_overrides", TINY, "--block_size", "16",
        "--output_dir", str(out), "--per_device_train_batch_size", "2", "--max_steps", "3", "--streaming",
        "--shuffle_buffer_size", "0", "--do_train", "--report_to", "none", "--disable_tqdm", "true",
        "--use_cpu", "true", "--save_strategy", "no", "--ddp_backend", "gloo",
    ]
    env = dict(os.environ, RECORD_DIR=str(record), OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(tmp_path / "worker.py"), *argv], env=env, capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in record.glob("tokenizer_trained_by_*")) == ["tokenizer_trained_by_0"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    seen = {}
    for rank in (0, 1):
        steps = [json.loads(line) for line in (record / f"rank{rank}.jsonl").read_text().splitlines()]
        assert len(steps) == 3 and all(s["world"] == 2 for s in steps)
        seen[rank] = [tuple(b) for s in steps for b in s["input_ids"]]
    # each rank trained on the blocks of its own file, in order, going round again when it ran out
    for rank, part in ((0, docs[:8]), (1, docs[8:])):
        own = [tuple(b) for b in chunk_into_blocks(part, tok, 16)["input_ids"]]
        assert seen[rank] == (own * 6)[: len(seen[rank])]
        if rank == 1:
            assert len(own) < len(seen[1])  # it did go round
    assert not set(seen[0]) & set(seen[1])


def test_streaming_resume_within_the_first_pass_sees_the_same_blocks(tmp_path, tokenizer, monkeypatch):
    # Trainer skips the batches already trained on by reading them again (an IterableDataset cannot seek)
    from hf_lookaround.training import pretraining

    write_jsonl(tmp_path / "train.jsonl", documents(40, seed=13))
    tokenizer.save_pretrained(tmp_path / "tok")
    seen: dict[str, dict[int, list]] = {}

    class Recording(pretraining.LookAroundTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen[self.args.output_dir][self.state.global_step + 1] = inputs["input_ids"].tolist()
            return super().training_step(model, inputs, num_items_in_batch)

    monkeypatch.setattr(pretraining, "LookAroundTrainer", Recording)
    common = ("--streaming", "--do_train", "--max_steps", "5", "--save_strategy", "steps", "--save_steps", "2",
              "--shuffle_buffer_size", "8", "--seed", "3")
    straight = command(tmp_path, tmp_path / "tok", *common)
    seen[str(tmp_path / "out")] = {}
    run(*parse_args(straight))
    resumed_out = tmp_path / "resumed"
    seen[str(resumed_out)] = {}
    resumed = command(tmp_path, tmp_path / "tok", *common, "--resume_from_checkpoint",
                      str(tmp_path / "out" / "checkpoint-2"))
    resumed[resumed.index("--output_dir") + 1] = str(resumed_out)
    run(*parse_args(resumed))
    reference, after = seen[str(tmp_path / "out")], seen[str(resumed_out)]
    assert sorted(reference) == [1, 2, 3, 4, 5] and sorted(after) == [3, 4, 5]
    assert len({str(reference[s]) for s in reference}) == 5  # five different batches, shuffled in a buffer
    assert all(after[s] == reference[s] for s in after)


def test_json_lines_files_with_different_fields_load_together(tmp_path):
    docs = documents(6, seed=14)
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "a.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t, "genre": "news"}) + "\n" for t in docs[:3])
    with open(data / "b.jsonl", "w") as f:
        f.writelines(json.dumps({"chapter": i, "text": t}) + "\n" for i, t in enumerate(docs[3:]))
    ds = load_text_dataset(data, cache_dir=str(tmp_path / "cache"))
    assert ds["text"] == docs
    assert [r["text"] for r in load_text_dataset(data, streaming=True)] == docs
