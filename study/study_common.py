"""What every part of the seeded study shares: names, sizes, the objective table, settings, keys and JSON files.

No import of ``hf_lookaround`` here: the driver and the report import this module and start without torch.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# ---------------------------------------------------------------------------------------------
# the study's objectives: the rows of `hf_lookaround.objectives.presets()` it runs (the same rows as the demo's)
# ---------------------------------------------------------------------------------------------
OBJECTIVES = ("ar", "dar-t2", "mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3", "gvp-k8", "mix-dar12-vmlm")


def __getattr__(name: str):
    """``STUDY_OBJECTIVES``: each study objective's ObjectiveArguments keyword arguments, read from the objectives'
    presets on first use (only the cell workers ask, so the driver and the report start without torch)."""
    if name != "STUDY_OBJECTIVES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from hf_lookaround import objectives

    presets = objectives.presets()
    return {row: dict(objective=presets[row][0], **presets[row][2]) for row in OBJECTIVES}

# held-out perplexity sets: the corpus's own test split (in domain) and a second domain
HELDOUT_SETS = ("gutenberg", "bbc", "sotu", "brown")
HELDOUT_SET_NAMES = {"gutenberg": "Project Gutenberg (test books)", "bbc": "BBC News", "sotu": "State of the Union",
                     "brown": "Brown"}
HELDOUT_DOMAIN = {"gutenberg": "in_domain", "bbc": "other_domain", "sotu": "other_domain", "brown": "other_domain"}
TASKS = ("rotten_tomatoes", "trec", "vader_movie", "sms_spam")
PROTOCOLS = ("masked_prefix", "ar_plan")
MODE_OF_PROTOCOL = {"masked_prefix": "two_stream_prefix", "ar_plan": "two_stream"}
FT_MODES = ("full", "lora")
PREFIX_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SHORT_PREFIX_MAX = 15  # "short prefix": k <= 15 tokens visible
LONG_PREFIX_MIN = 64  # "long prefix": k >= 64

# sizes per preset (pretraining tokens per grid cell and batch; the learning rate comes from the sweep)
PRESET_SETTINGS = {
    "small": dict(tokens=25_000_000, batch_size=64),
    "base": dict(tokens=50_000_000, batch_size=64),
    "mini": dict(tokens=8_000_000, batch_size=64),
    "tiny": dict(tokens=40 * 8 * 64, batch_size=8),
}
DEFAULTS = dict(
    block_size=256, vocab_size=8192, val_blocks=256, warmup_fraction=0.05, eval_batch_size=256,
    ppl_passages=128, ppl_passage_chars=1000, probe_train=None, probe_eval=None, max_seq_length=128,
    ft_train=None, ft_eval=None, ft_epochs=3.0, ft_batch_size=32,
    max_train_docs=None, train_doc_chars=None,
)
LIST_DEFAULTS = dict(ft_lrs=[1e-4, 3e-4, 1e-3], lora_lrs=[3e-4, 1e-3, 3e-3], ft_modes=["full"])
SWEEP_LRS = [5e-4, 1e-3, 2e-3, 4e-3]
SWEEP_TOKENS = 8_000_000
SIZE_KEYS = tuple(DEFAULTS) + tuple(LIST_DEFAULTS)
# what a cell's JSON records of the shared data preparation (no machine paths)
PREP_RECORDED = ("tokenizer_sha256", "vocab_size", "num_train_blocks", "num_val_blocks", "train_tokens",
                 "train_corpus", "heldout_sizes", "task_sizes", "seconds", "data_id")


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------
def cell_key(preset: str, objective: str, seed: int) -> str:
    return f"{preset}__{objective}__seed{seed}"


def lr_tag(lr: float) -> str:
    return f"{float(lr):g}"


def sweep_key(preset: str, objective: str, lr: float) -> str:
    return f"sweep__{preset}__{objective}__lr{lr_tag(lr)}"


def parse_key(key: str) -> dict:
    """A cell key (``small__ar__seed0``) or a sweep key (``sweep__small__ar__lr0.001``) as its parts."""
    parts = key.split("__")
    if len(parts) == 4 and parts[0] == "sweep" and parts[3].startswith("lr"):
        return {"kind": "sweep", "preset": parts[1], "objective": parts[2], "learning_rate": float(parts[3][2:]),
                "seed": None}
    if len(parts) == 3 and parts[2].startswith("seed") and parts[2][4:].isdigit():
        return {"kind": "cell", "preset": parts[0], "objective": parts[1], "seed": int(parts[2][4:])}
    raise ValueError(f"not a cell key: {key!r} (PRESET__OBJECTIVE__seedN or sweep__PRESET__OBJECTIVE__lrLR)")


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def sanitize(text: str) -> str:
    """No machine paths in recorded JSON: the checkout becomes ".", the GPU machine's output folder "$OUT"."""
    out = os.environ.get("OUT")
    if out:
        text = text.replace(out, "$OUT")
    return text.replace(str(REPO) + "/", "").replace(str(REPO), ".")


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def round_sig(x, digits: int = 5):
    """``x`` rounded to ``digits`` significant digits (lists and dicts recursively; ints, None, str unchanged)."""
    if isinstance(x, dict):
        return {k: round_sig(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [round_sig(v, digits) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if getattr(x, "dtype", None) is not None and x.dtype.kind in "iub":  # numpy integers
        return bool(x) if x.dtype.kind == "b" else int(x)
    try:
        x = float(x)
    except (TypeError, ValueError):
        return x
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def write_json(path: Path, payload: dict, copy_to: Path | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=1, sort_keys=True) + "\n"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a file
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        (copy_to / path.name).write_text(text, encoding="utf-8")


def write_bundle(path: Path, files) -> None:
    """All of ``files`` (JSON) in one gzipped JSON ``{name: content}``; ``--unbundle`` writes them back out."""
    import gzip

    payload = {Path(f).name: json.loads(Path(f).read_text()) for f in files if Path(f).is_file()}
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as handle:
        json.dump(payload, handle, sort_keys=True)
    tmp.replace(path)


def unbundle(path: Path, results_dir: Path) -> list[Path]:
    """Write the files of a bundle into ``results_dir`` (as ``write_json`` writes them); returns their paths."""
    import gzip

    with gzip.open(path, "rt", encoding="utf-8") as handle:
        payload = json.load(handle)
    out = []
    for name, content in sorted(payload.items()):
        if "/" in name or not name.endswith(".json"):
            raise ValueError(f"{path}: unexpected entry {name!r}")
        write_json(results_dir / name, content)
        out.append(results_dir / name)
    return out


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no git checkout; pass --git_commit)"


def versions() -> dict:
    import platform

    import numpy
    import sklearn
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "numpy": numpy.__version__, "scikit-learn": sklearn.__version__}
    for name in ("datasets", "peft", "evaluate", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return out


def machine() -> dict:
    """The GPUs this process sees (name, count) and its CPU cores."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"gpu_count": count, "gpu_names": sorted({torch.cuda.get_device_name(i) for i in range(count)}),
            "cpu_count": os.cpu_count()}


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------
def settings_for(args, preset: str, kind: str = "cell") -> dict:
    """Every size that shapes a cell's numbers (recorded in its JSON; cells with other settings never mix).

    The learning rate is not among them: it is chosen per objective (the sweep) and recorded in
    ``pretrain.learning_rate``. A sweep run (``kind="sweep"``) pretrains ``--sweep_tokens``."""
    if preset not in PRESET_SETTINGS:
        raise ValueError(f"no study settings for preset {preset!r}; choose from {sorted(PRESET_SETTINGS)}")
    base = dict(PRESET_SETTINGS[preset])
    for key in ("tokens", "batch_size"):
        if getattr(args, key, None) is not None:
            base[key] = getattr(args, key)
    if kind == "sweep":
        base["tokens"] = args.sweep_tokens
    sizes = {k: getattr(args, k) for k in SIZE_KEYS}
    out = {"preset": preset, "kind": kind, **base, **sizes, "device": args.device, "corpus": corpus_name(args),
           "heldout_sets": list(HELDOUT_SETS), "tasks": list(TASKS)}
    out["steps"] = max(1, math.ceil(out["tokens"] / (out["batch_size"] * out["block_size"])))
    return out


def corpus_name(args) -> str:
    return Path(args.corpus_dir).name if getattr(args, "corpus_dir", None) else "synthetic"


def data_settings(settings: dict, corpus_dir: str, data_root: str) -> dict:
    keys = ("block_size", "vocab_size", "val_blocks", "ppl_passages", "ppl_passage_chars", "max_train_docs",
            "train_doc_chars")
    return {k: settings[k] for k in keys} | {"corpus_dir": str(Path(corpus_dir).resolve()),
                                             "data_root": str(Path(data_root).resolve())}
