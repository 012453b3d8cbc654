"""Peak memory of building the training set, against the size of the corpus.

    .venv/bin/python benchmarks/data_memory.py                      # the text corpora at 1x and 10x
    .venv/bin/python benchmarks/data_memory.py --repeats 1 10 --streaming --output results.json
    .venv/bin/python benchmarks/data_memory.py --smoke              # seconds: a slice, 1x and 2x

The corpora (State of the Union addresses, Brown Corpus, Moby-Dick; every split, JSON Lines .gz)
are copied ``r`` times into a temporary folder for each repeat ``r``: the ``r``x corpus holds every
document ``r`` times. One tokenizer is trained on the 1x corpus first. Then, for each size, a fresh
child process (with a fresh `datasets` cache) builds the training blocks exactly as
``hf-lookaround pretrain`` does (``load_text_dataset`` + ``build_blocks``: load with ``load_dataset``,
tokenize with ``.map``, pack with a second ``.map``), or, with ``--streaming``, builds the stream and
reads every block of it. The child reports:

- ``peak_rss_mb``: the kernel's high-water mark of its resident memory (``ru_maxrss``, = VmHWM). It
  counts pages of memory-mapped Arrow files that were read, which the kernel may drop at any time;
- ``peak_anon_rss_mb``: the highest anonymous resident memory seen (``RssAnon``, sampled every 20 ms):
  the Python heap and buffers, the part that has to fit in RAM;
- ``import_rss_mb``: the resident memory after importing torch/transformers/datasets, before any data.

The target (issue 14): the 10x run's peak RSS is under 1.5x the 1x run's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "text"
CORPORA = ("sotu", "brown", "moby_dick")
NAMES = {"sotu": "State of the Union addresses", "brown": "Brown Corpus", "moby_dick": "Moby-Dick"}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class AnonPeak(threading.Thread):
    """Samples RssAnon of this process (Linux) until stopped; keeps the maximum."""

    def __init__(self, interval: float = 0.02):
        super().__init__(daemon=True)
        self.interval, self.peak_kb, self._done = interval, 0, threading.Event()

    def run(self):
        while not self._done.is_set():
            self.peak_kb = max(self.peak_kb, _status_kb("RssAnon"))
            time.sleep(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak_kb, _status_kb("RssAnon"))


def child(args) -> None:
    """Build the training set of one corpus copy; print one JSON line of measurements."""
    import datasets
    import torch  # noqa: F401  (imported as in a training run, so the baseline is the real one)
    import transformers
    from transformers import AutoTokenizer

    from hf_lookaround.data.text import build_blocks, load_text_dataset

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    import_rss = _status_kb("VmRSS")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    sampler = AnonPeak()
    sampler.start()
    start = time.perf_counter()
    raw = load_text_dataset(args.corpus, streaming=args.streaming, cache_dir=args.cache)
    blocks, stats = build_blocks(raw, tokenizer, args.block_size, num_proc=args.num_proc)
    if args.streaming:
        # read the whole stream, as training would, and count what came out
        count = 0
        for batch in blocks.iter(batch_size=256):
            count += len(batch["input_ids"])
        result = {"blocks": count}
    else:
        result = {"blocks": stats.blocks, "tokens": stats.tokens, "dropped_tokens": stats.dropped_tokens,
                  "documents": stats.documents}
    seconds = time.perf_counter() - start
    anon_peak = sampler.stop()
    result.update(
        seconds=round(seconds, 1),
        import_rss_mb=round(import_rss / 1024, 1),
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        peak_anon_rss_mb=round(anon_peak / 1024, 1),
        children_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
    )
    print("RESULT " + json.dumps(result), flush=True)


def make_copies(text_root: Path, corpora, repeats: int, out: Path, smoke: bool) -> tuple[int, int]:
    """``repeats`` copies of every file of the corpora under ``out``; returns (files, compressed bytes)."""
    out.mkdir(parents=True)
    files = [f for name in corpora for f in sorted((text_root / name).glob("*.jsonl.gz"))]
    if not files:
        raise SystemExit(f"no *.jsonl.gz under {text_root}/{{{','.join(corpora)}}}: pass --text-root")
    if smoke:  # the first (at most) 40 documents of one file
        import gzip
        import itertools

        with gzip.open(files[0], "rt") as f:
            head = list(itertools.islice(f, 40))
        source = out.parent / "smoke.jsonl.gz"
        if not source.exists():
            with gzip.open(source, "wt") as f:
                f.writelines(head)
        files = [source]
    size = 0
    for copy in range(repeats):
        for f in files:
            target = out / f"{f.parent.name}_{f.name.split('.')[0]}_{copy:03d}.jsonl.gz"
            shutil.copyfile(f, target)
            size += target.stat().st_size
    return len(files) * repeats, size


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text-root", type=Path, default=DEFAULT_TEXT, help="folder holding <corpus>/*.jsonl.gz")
    p.add_argument("--corpora", nargs="+", default=list(CORPORA))
    p.add_argument("--repeats", nargs="+", type=int, default=[1, 10])
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--num-proc", type=int, default=None, help="datasets .map num_proc (default: one process)")
    p.add_argument("--streaming", action="store_true", help="also measure the --streaming path")
    p.add_argument("--workdir", type=Path, default=None, help="where the copies and caches go (default: a temp dir)")
    p.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="a 40-document slice at 1x and 2x (checks the script)")
    # child mode
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.smoke:
        args.repeats, args.vocab_size, args.block_size = [1, 2], 300, 32

    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="true")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="data_memory_"))
    results = {"corpora": [NAMES.get(c, c) for c in args.corpora], "block_size": args.block_size,
               "vocab_size": args.vocab_size, "num_proc": args.num_proc, "runs": []}
    try:
        copies = {r: make_copies(args.text_root, args.corpora, r, work / f"x{r}", args.smoke) for r in args.repeats}
        tokenizer_dir = work / "tokenizer"
        from hf_lookaround.data.text import iter_texts
        from hf_lookaround.data.tokenization import train_tokenizer

        first = min(args.repeats)
        print(f"training a {args.vocab_size}-token tokenizer on the {first}x corpus ...", flush=True)
        train_tokenizer(iter_texts(work / f"x{first}"), vocab_size=args.vocab_size, output_dir=str(tokenizer_dir))
        modes = ["map"] + (["streaming"] if args.streaming else [])
        for mode in modes:
            for r in args.repeats:
                cache = work / f"cache_{mode}_{r}"
                cmd = [sys.executable, __file__, "--child", "--corpus", str(work / f"x{r}"), "--tokenizer",
                       str(tokenizer_dir), "--cache", str(cache), "--block-size", str(args.block_size)]
                if args.num_proc:
                    cmd += ["--num-proc", str(args.num_proc)]
                if mode == "streaming":
                    cmd.append("--streaming")
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    raise SystemExit(f"child failed ({mode}, {r}x):\n{proc.stderr[-4000:]}")
                run = {"mode": mode, "repeats": r, "files": copies[r][0], "compressed_mb": round(copies[r][1] / 2**20, 1),
                       **json.loads(line[len("RESULT "):])}
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    lo, hi = min(args.repeats), max(args.repeats)
    print(f"\n| path | corpus | compressed MB | tokens | blocks | seconds | peak RSS MB | peak anon RSS MB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for run in results["runs"]:
        print(f"| {run['mode']} | {run['repeats']}x | {run['compressed_mb']} | {run.get('tokens', '')} | {run['blocks']} "
              f"| {run['seconds']} | {run['peak_rss_mb']} | {run['peak_anon_rss_mb']} |")
    for mode in dict.fromkeys(r["mode"] for r in results["runs"]):
        by = {r["repeats"]: r for r in results["runs"] if r["mode"] == mode}
        ratio = by[hi]["peak_rss_mb"] / by[lo]["peak_rss_mb"]
        anon = by[hi]["peak_anon_rss_mb"] / by[lo]["peak_anon_rss_mb"]
        results[f"{mode}_peak_rss_ratio"] = round(ratio, 3)
        results[f"{mode}_peak_anon_rss_ratio"] = round(anon, 3)
        print(f"{mode}: {hi}x / {lo}x peak RSS = {ratio:.2f} (anonymous: {anon:.2f}); target < 1.5")
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
