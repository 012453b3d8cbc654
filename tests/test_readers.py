"""Issue 43: the one reader of data files (data/records.py) and what from_pretrained itself refuses.

Every reader names file and line and refuses, before any library sees the data: a record that is not a JSON
object, a document that is not a string, invalid JSON, a byte that is not UTF-8, a cut gzip, a record nested too
deep; an empty file (or /dev/null) is called empty. A LookAround checkpoint refuses to load through
``from_pretrained`` (any caller: lm-eval, AutoModel) when its backbone tensors are incomplete, its weights are
not finite, or its run is unfinished."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

from hf_lookaround.data import records
from hf_lookaround.data.text import find_files, iter_texts, load_text_dataset
from hf_lookaround.evaluation.tasks import load_texts


def write(path, *lines, raw: bytes | None = None):
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"text": "a good document"})

BAD = {  # file name, content lines, what the error must say
    "number.jsonl": ([GOOD, "5"], ":2: a record must be a JSON object", "not a number"),
    "null.jsonl": (["null"], ":1: a record must be a JSON object", "not null"),
    "list_text.jsonl": ([GOOD, '{"text": ["a", "b"]}'], ":2: field 'text' holds a list", "not a string"),
    "dict_text.jsonl": ([GOOD, '{"text": {"a": 1}}'], ":2: field 'text' holds an object", "not a string"),
    "number_text.jsonl": (['{"text": 5}'], ":1: field 'text' holds a number", "not a string"),
    "bad_json.jsonl": ([GOOD, GOOD, '{"text": "cut'], ":3: not a JSON record", "cut short or malformed"),
    "deep.jsonl": ([GOOD, "[" * 100_000 + "]" * 100_000], ":2: a record nested deeper than", "brackets"),
    "deep_in_text.jsonl": (['{"text": ' + "[" * 1000 + "]" * 1000 + "}"], ":1: a record nested deeper", "fix"),
    "missing.jsonl": ([GOOD, GOOD, '{"title": "x"}', '{"text": null}'], ": 2 record(s) hold no 'text'", "lines 3, 4"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_every_reader_refuses_a_bad_record_naming_file_and_line(tmp_path, name):
    lines, where, what = BAD[name]
    path = write(tmp_path / name, *lines)
    for read in (lambda: records.check_file(path), lambda: list(iter_texts(str(path))),
                 lambda: load_texts(str(path)), lambda: load_text_dataset(str(path), cache_dir=str(tmp_path / "c"))):
        with pytest.raises(ValueError) as err:
            read()
        assert f"{path}{where}" in str(err.value) and what in str(err.value)


def test_brackets_inside_strings_are_text_not_nesting(tmp_path):
    text = "[" * 500 + "{" * 500  # a document may hold any characters
    path = write(tmp_path / "ok.jsonl", json.dumps({"text": text}), GOOD)
    assert list(records.read_documents(path)) == [text, "a good document"]


def test_a_byte_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = write(tmp_path / "latin1.jsonl", raw=(GOOD + "\n" + GOOD + "\n").encode() + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path}:3: not UTF-8 text .*iconv"):
        records.check_file(path)


def test_a_cut_gzip_is_named(tmp_path):
    packed = gzip.compress(("\n".join([GOOD] * 5000) + "\n").encode())
    path = write(tmp_path / "cut.jsonl.gz", raw=packed[: len(packed) // 2])
    for read in (lambda: records.check_file(path), lambda: load_texts(str(path))):
        with pytest.raises(ValueError, match=rf"{path}: the gzip stream is cut short or damaged after line \d+"):
            read()


def test_a_json_array_is_read_by_record(tmp_path):
    path = write(tmp_path / "array.json", json.dumps([{"text": "one"}, {"text": "two"}, {"text": 3}]))
    with pytest.raises(ValueError, match=rf"{path}:record 3: field 'text' holds a number"):
        list(records.read_documents(path))


def test_an_empty_file_and_dev_null_are_called_empty(tmp_path):
    empty = write(tmp_path / "empty.jsonl")
    assert records.check_file(empty) == 0
    with pytest.raises(ValueError, match=rf"no text in {empty}: the file\(s\) are empty"):
        list(iter_texts(str(empty)))
    with pytest.raises(ValueError, match=rf"{empty}: the file is empty"):
        load_texts(str(empty))
    devnull = tmp_path / "devnull.jsonl"
    devnull.symlink_to(os.devnull)
    with pytest.raises(ValueError, match=rf"{devnull}: the file is empty \(it is /dev/null\)"):
        find_files(devnull)


def test_labelled_records_are_checked_without_a_text_field(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"sentence": "a", "label": 0}', '{"sentence": "b", "label": 1}', "[1, 2]")
    with pytest.raises(ValueError, match=rf"{path}:3: a record must be a JSON object"):
        records.check_file(path, None)


# ---------------------------------------------------------------------------------------------
# from_pretrained refuses what the package's own loader refuses
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path, tiny_model):
    from hf_lookaround import LookAroundForPreTraining

    folder = tmp_path / "ckpt"
    tiny_model(LookAroundForPreTraining).save_pretrained(folder)
    return folder


def test_from_pretrained_loads_an_intact_checkpoint_into_a_new_head(saved):
    from transformers import AutoModelForSequenceClassification

    import hf_lookaround  # noqa: F401

    model = AutoModelForSequenceClassification.from_pretrained(saved, num_labels=2)  # the new head may be missing
    assert type(model).__name__ == "LookAroundForSequenceClassification"


def test_from_pretrained_refuses_non_finite_weights(saved):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import hf_lookaround  # noqa: F401

    weights = load_file(saved / "model.safetensors")
    key = next(k for k in weights if "layers.1" in k and weights[k].is_floating_point())
    weights[key][0] = float("nan")
    save_file(weights, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"hold NaN or infinite values in 1 tensor"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_from_pretrained_refuses_missing_backbone_tensors(saved):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForMaskedLM

    import hf_lookaround  # noqa: F401

    weights = load_file(saved / "model.safetensors")
    key = next(k for k in weights if "layers.0" in k)
    del weights[key]
    save_file(weights, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lack 1 tensor\(s\) of the backbone \({key}\)"):
        AutoModelForMaskedLM.from_pretrained(saved)


def test_from_pretrained_refuses_an_unfinished_run(saved):
    from transformers import AutoModel

    import hf_lookaround  # noqa: F401
    from hf_lookaround.training import checkpointing

    (saved / checkpointing.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(ValueError, match="pretrain run that has not finished"):
        AutoModel.from_pretrained(saved)
    (saved / checkpointing.FINAL_MARKER).write_text("{}")
    assert torch.isfinite(next(AutoModel.from_pretrained(saved).parameters())).all()
