"""Offline tokenizers: trained on local text, loaded back with AutoTokenizer."""

import gzip
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_lookaround.data.text import chunk_into_blocks, iter_texts, load_texts
from hf_lookaround.cli.train_tokenizer import main
from hf_lookaround.data.tokenization import train_tokenizer


def test_cli_trains_a_tokenizer_that_autotokenizer_loads(tmp_path, bbc_text_dir):
    out = tmp_path / "tok"
    assert main([str(bbc_text_dir / "train.jsonl.gz"), "--output_dir", str(out), "--vocab_size", "1000"]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == 1000
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.mask_token) == ("[PAD]", "<s>", "</s>", "[MASK]")
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id, tok.unk_token_id}) == 5
    text = "The State of the Union is strong, said the President in 2001."
    ids = tok(text)["input_ids"]
    # every sequence starts with the condition token (BOS); a single text is a prompt, it ends without EOS
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text  # byte-level: lossless
    assert tok("a", "b")["input_ids"].count(tok.eos_token_id) == 2
    # BPE learned merges: far fewer tokens than bytes
    assert len(ids) < 0.5 * len(text)


def test_unicode_and_unseen_bytes_round_trip(tmp_path):
    tok = train_tokenizer(["hello world"] * 50, vocab_size=300, output_dir=tmp_path)
    weird = "naïve café — 東京 🙂"
    assert tok.decode(tok(weird)["input_ids"], skip_special_tokens=True) == weird
    assert tok.unk_token_id not in tok(weird)["input_ids"]
    assert AutoTokenizer.from_pretrained(tmp_path)(weird)["input_ids"] == tok(weird)["input_ids"]


def test_a_loaded_tokenizer_saves_again_without_how_it_was_loaded(tmp_path):
    """transformers 5.17 keeps ``is_local`` and ``local_files_only`` (how from_pretrained found the files) among the
    arguments ``save_pretrained`` writes; every checkpoint the Trainer saved then carried ``local_files_only: true``
    to whoever downloads it. ``auto_tokenizer``, what the commands load with, drops both."""
    from hf_lookaround.data.tokenization import auto_tokenizer

    train_tokenizer(["hello world"] * 50, vocab_size=300, output_dir=tmp_path / "trained")
    AutoTokenizer.from_pretrained(tmp_path / "trained", local_files_only=True).save_pretrained(tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())
    assert plain["local_files_only"] is True and plain["is_local"] is True  # the cause, shown
    tokenizer = auto_tokenizer(tmp_path / "trained", local_files_only=True)
    tokenizer.save_pretrained(tmp_path / "ours")
    ours = json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text())
    assert "local_files_only" not in ours and "is_local" not in ours
    assert {k: v for k, v in plain.items() if k not in ("local_files_only", "is_local")} == ours
    assert auto_tokenizer(tmp_path / "ours")("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]


def test_errors():
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(["", "  "], vocab_size=500)
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["text"], vocab_size=100)


def test_data_reading_and_chunking(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("first document " * 20)
    with gzip.open(tmp_path / "sub" / "b.jsonl.gz", "wt") as f:
        for i in range(3):
            f.write(json.dumps({"body": f"record {i} " * 10}) + "\n")
    (tmp_path / "ignored.csv").write_text("x")
    texts = list(iter_texts(tmp_path, text_column="body"))
    assert len(texts) == 4 and texts[0].startswith("first")
    with pytest.raises(ValueError, match="no field 'text'"):
        load_texts(tmp_path / "sub")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text found"):
        load_texts(empty)

    tok = train_tokenizer(texts, vocab_size=300)
    blocks = chunk_into_blocks(texts, tok, block_size=16)
    stream = [t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert len(blocks) == len(stream) // 15
    for i, block in enumerate(blocks["input_ids"]):
        assert len(block) == 16 and block[0] == tok.bos_token_id
        assert block[1:] == stream[15 * i : 15 * (i + 1)]  # nothing lost or reordered between blocks
    with pytest.raises(ValueError, match="fewer than one block"):
        chunk_into_blocks(["tiny"], tok, block_size=512)
