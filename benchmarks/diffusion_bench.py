"""Issue 40's GPU benchmark: the likelihood table of BD3-LM's Table 3, and diffusion decoding against compiled AR.

    # on a lent 4-GPU machine, through benchmarks/diffusion_device_call.sh (2-3 calls of <= 9.5 min)
    python benchmarks/diffusion_bench.py --out $OUT/diffbench --corpus_dir .devdata/c1/gutenberg
    # the report alone, from the records of earlier calls
    python benchmarks/diffusion_bench.py --report .devdata/diffbench --out docs/results/diffusion_bench
    # the CPU smoke run (tiny preset, a few steps, synthetic text): the whole pipeline end to end
    PYTHONPATH=src python benchmarks/diffusion_bench.py --smoke --out /tmp/diffbench_smoke

**1. The likelihood table.** Every objective below is pretrained through ``hf-lookaround pretrain`` at the same
preset, block, batch, schedule and number of tokens (``--tokens``) on the same Gutenberg slice
(docs/gutenberg.md), for each seed, and scored with ``hf-lookaround perplexity`` on the same held-out passages
(the test split's books, ``--heldout_passages`` passages of ``--passage_chars`` characters each):

| cell | pretraining | protocol |
| --- | --- | --- |
| ar | ``--objective ar`` (two streams) | ``--protocol ar`` (AR perplexity) |
| dar-t2-1s | ``--objective dar --group_size 2 --dar_form single_stream`` (SAT, rate 2e-3: C1's) | ``--protocol ar`` on its one-stream layout (semi-AR perplexity: each token read from the row that saw every earlier token) |
| mdlm | ``--objective mdlm`` | ``--protocol elbo`` (ELBO perplexity, an upper bound, with its standard error) |
| bd3lm-b4, bd3lm-b16 | ``--objective bd3lm --diffusion_block 4`` / ``16`` | ``--protocol elbo`` (BD3-LM's bound) |
| bd3lm-b4-1s | ``--objective bd3lm --diffusion_block 4 --masked_form single_stream`` (the paper's one-stream ``x_t ⊕ x_0``) | ``--protocol elbo`` |
| vmlm | ``--objective vmlm`` | ``--protocol masked`` (masked-prefix perplexity, ``two_stream_prefix``) |

**2. Decoding** on the bd3lm-b4 checkpoint of seed 0: ``generate(diffusion_threshold=p)`` for each threshold of
``--thresholds`` and ``generate(diffusion_steps=s)`` for each of ``--steps``, all with the static cache (one compiled
graph per step on CUDA); on the bd3lm-b4-1s checkpoint of seed 0 (when that cell is in ``--cells``) the same
decoders with the static cache too, and at batch 1 also with a dynamic cache (eager: what the static cache gains);
all against compiled AR t = 1 on the ar checkpoint of seed 0 (``group_size=1`` with its static
cache, and transformers' own ``generate()`` with it; the faster is the baseline), in the same job, at batch 1 and 8:
``--new_tokens`` new tokens after ``--prompt_tokens``-token prompts from held-out passages; greedy and sampled
(temperature 1). New tokens/s (median of ``--repeats`` after a warm-up on the same shapes), forwards, tokens per
forward, and the generative perplexity of each continuation under the ar checkpoint (fp32). The target: >= 2.5x the
baseline's tokens/s at a generative perplexity within 10 % of the baseline's, stated either way.

**Budget.** 7 cells x 3 seeds = 21 pretraining runs of 40 M tokens each (``--tokens``; batch 64 x 256 = 2442
steps): the C1 protocol's length, about 1.6 passes over the slice's ~25 M tokens (8k BPE). ``small`` trained at
about 370 k tokens/s alone on an H100 (docs/results/c1_finetune_timing.json), so a cell is ~2-3 min of training at
two per GPU, plus ~1 min of start-up, compilation and scoring (the first wave of a fresh machine also tokenizes
the slice, ~1-2 min): ~4-5 min a cell, eight at a time on 4 GPUs, so ~14 min for the 21; decoding alone on one GPU
~4-5 min (mostly compiling its graphs), before the one-stream form's static rows (two more graphs per batch
size and their timed runs: not measured yet). That is 2 calls of <= 9.5 min when the machine stays warm between them, 3
when it does not (a fresh machine retrains the decoding job's two cells, ~5 min, before decoding).

**The plan is resumable.** Jobs run one process each, ``--jobs_per_gpu`` training cells per GPU (the decoding job
alone on its GPU), and are killed at ``--minutes``. A cell saves a checkpoint every ``--save_every`` steps and
continues from its last complete one (on a machine that kept ``--work_dir``); a finished cell's record
(``cells/<cell>.json``) and the decoding record are copied to ``--out`` at once, and a later call given them
(``--records_from``) skips them. ``diffusion_bench.json`` and ``diffusion_bench.md`` (the tables) are rewritten after
every job.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# name -> (pretrain arguments, learning rate, perplexity arguments, protocol label)
CELLS = {
    "ar": (["--objective", "ar"], 1e-3, ["--protocol", "ar"], "AR"),
    "dar-t2-1s": (["--objective", "dar", "--group_size", "2", "--dar_form", "single_stream"], 2e-3,
                  ["--protocol", "ar"], "semi-AR (one-stream layout)"),
    "mdlm": (["--objective", "mdlm"], 1e-3, ["--protocol", "elbo"], "ELBO (<=)"),
    "bd3lm-b4": (["--objective", "bd3lm", "--diffusion_block", "4"], 1e-3, ["--protocol", "elbo"], "ELBO (<=)"),
    "bd3lm-b16": (["--objective", "bd3lm", "--diffusion_block", "16"], 1e-3, ["--protocol", "elbo"], "ELBO (<=)"),
    "bd3lm-b4-1s": (["--objective", "bd3lm", "--diffusion_block", "4", "--masked_form", "single_stream"], 1e-3,
                    ["--protocol", "elbo"], "ELBO (<=), one stream x_t ⊕ x_0"),
    "vmlm": (["--objective", "vmlm"], 1e-3, ["--protocol", "masked", "--masked_mode", "two_stream_prefix"],
             "masked prefix"),
}
DECODE_NEEDS = ("ar", "bd3lm-b4")  # the decoding job reads these cells' seed-0 models
DECODE_ONE_STREAM = "bd3lm-b4-1s"  # and this one's too, when it is in --cells (static; batch 1 dynamic too)


def decode_needs(cells) -> tuple[str, ...]:
    return DECODE_NEEDS + ((DECODE_ONE_STREAM,) if DECODE_ONE_STREAM in cells else ())
TARGET_SPEEDUP, TARGET_GEN_PPL = 2.5, 0.10


def cell_name(cell: str, seed: int) -> str:
    return f"{cell}__s{seed}"


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_json(path: Path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"


# ---------------------------------------------------------------------------------------------
# data: tokenizer, held-out passages, prompts (built once per work dir, on the driver)
# ---------------------------------------------------------------------------------------------
def read_texts(path: Path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def synthetic_corpus(folder: Path) -> Path:
    """Tiny deterministic text for --smoke: sentences over a small vocabulary, split into books."""
    import random

    rng = random.Random(0)
    words = "the a cat dog sat ran on under mat hill house river saw heard quietly loudly and then".split()
    folder.mkdir(parents=True, exist_ok=True)
    for split, books in (("train", 40), ("validation", 4), ("test", 4)):
        with gzip.open(folder / f"{split}.jsonl.gz", "wt", encoding="utf-8") as f:
            for _ in range(books):
                text = " ".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))) + "."
                                for _ in range(120))
                f.write(json.dumps({"text": text}) + "\n")
    return folder


def prepare(args, work: Path) -> dict:
    """The tokenizer (a byte-level BPE on the training slice's first documents), the held-out passages every cell
    is scored on, and the decoding prompts; cached in the work dir (deterministic: a new machine makes the same)."""
    prep = work / "prep"
    done = prep / "prep.json"
    if done.is_file():
        return json.loads(done.read_text())
    prep.mkdir(parents=True, exist_ok=True)
    from hf_lookaround.data.tokenization import train_tokenizer

    corpus = Path(args.corpus_dir)
    texts, chars = [], 0
    for text in read_texts(corpus / "train.jsonl.gz"):  # file order: the slice's fixed book order
        texts.append(text)
        chars += len(text)
        if chars >= args.tokenizer_chars:
            break
    train_tokenizer(texts, vocab_size=args.vocab_size, output_dir=str(prep / "tokenizer"))
    # held-out: passages from every test book, away from its front matter, on whitespace
    passages = []
    for book in read_texts(corpus / "test.jsonl.gz"):
        words = book.split()
        start = len(words) // 10
        for i in range(args.heldout_passages):
            chunk, size = [], 0
            for w in words[start:]:
                chunk.append(w)
                size += len(w) + 1
                if size >= args.passage_chars:
                    break
            start += len(chunk) + 200  # the next passage a little further on
            if size >= args.passage_chars:
                passages.append(" ".join(chunk))
    with gzip.open(prep / "heldout.jsonl.gz", "wt", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"text": p}) + "\n")
    # prompts: the first words of held-out passages (the decoding job cuts them to --prompt_tokens tokens)
    (prep / "prompts.txt").write_text("\n".join(" ".join(p.split()[:200]) for p in passages[::2]) + "\n")
    info = {"tokenizer": str(prep / "tokenizer"), "heldout": str(prep / "heldout.jsonl.gz"),
            "prompts": str(prep / "prompts.txt"), "heldout_passages": len(passages),
            "heldout_chars": sum(len(p) for p in passages), "tokenizer_documents": len(texts)}
    write_json(done, info)
    return info


# ---------------------------------------------------------------------------------------------
# the jobs (each one process; the driver sets CUDA_VISIBLE_DEVICES)
# ---------------------------------------------------------------------------------------------
def _run(cmd: list[str], log_path: Path) -> int:
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def _last_complete_checkpoint(model_dir: Path) -> bool:
    from hf_lookaround.training.checkpointing import complete_checkpoints

    return model_dir.is_dir() and bool(complete_checkpoints(model_dir))


def cell_job(spec: dict) -> int:
    """Pretrain (continuing from the last complete checkpoint if any), save the final model, score it."""
    folder, s = Path(spec["folder"]), spec["settings"]
    pretrain_args, lr, ppl_args, _ = CELLS[spec["cell"]]
    model_dir, log_path = folder / "model", folder / "log.txt"
    final = model_dir / "model.safetensors"
    cli = [sys.executable, "-m", "hf_lookaround.cli"]
    t0 = time.time()
    if not final.is_file():
        resume = (["--resume_from_checkpoint", "last"] if _last_complete_checkpoint(model_dir)
                  else ["--overwrite_output_dir", "true"])
        cmd = cli + ["pretrain", "--train_files", str(Path(s["corpus_dir"]) / "train.jsonl.gz"),
                     "--tokenizer_name", spec["prep"]["tokenizer"], "--preset", s["preset"], *pretrain_args,
                     "--block_size", str(s["block_size"]), "--per_device_train_batch_size", str(s["batch_size"]),
                     "--learning_rate", str(lr), "--lr_scheduler_type", "cosine",
                     "--warmup_steps", str(max(1, round(0.05 * s["steps"]))), "--max_steps", str(s["steps"]),
                     "--do_train", "--validation_split_percentage", "0", "--save_strategy", "steps",
                     "--save_steps", str(s["save_every"]), "--save_total_limit", "1", "--report_to", "none",
                     "--logging_steps", str(max(1, s["steps"] // 20)), "--seed", str(spec["seed"]),
                     "--bf16", str(s["cuda"]).lower(), "--torch_compile", str(s["cuda"]).lower(),
                     "--dataloader_num_workers", "2" if s["cuda"] else "0",
                     *(["--preprocessing_num_workers", str(s["num_proc"])] if s["num_proc"] > 1 else []),
                     "--output_dir", str(model_dir), *resume]
        if (rc := _run(cmd, log_path)) != 0:
            return rc
    train_seconds = time.time() - t0
    ppl_dir = folder / "ppl"
    cmd = cli + ["perplexity", "--model_name_or_path", str(model_dir), "--dataset", spec["prep"]["heldout"],
                 *ppl_args, "--max_length", str(s["block_size"]), "--stride", str(s["block_size"] // 2),
                 "--batch_size", str(s["eval_batch_size"]), "--seed", str(spec["seed"]), "--output_dir", str(ppl_dir)]
    if ppl_args[1] == "elbo":
        cmd += ["--num_samples", str(s["elbo_samples"])]
    if (rc := _run(cmd, log_path)) != 0:
        return rc
    report = json.loads((ppl_dir / "perplexity.json").read_text())
    state = json.loads((model_dir / "trainer_state.json").read_text()) if (model_dir / "trainer_state.json").is_file() \
        else {}
    losses = [h["loss"] for h in state.get("log_history", []) if "loss" in h]
    result = {"cell": spec["cell"], "seed": spec["seed"], "pretrain_args": pretrain_args, "learning_rate": lr,
              "steps": state.get("global_step", s["steps"]), "tokens": s["steps"] * s["batch_size"] * s["block_size"],
              "logged_losses": losses, "perplexity": report, "job_seconds": round(time.time() - t0, 1),
              "train_and_load_seconds": round(train_seconds, 1), "finished_utc": utc_now(), "gpu": spec["gpu"]}
    write_json(folder / "result.json", result)
    return 0


def decode_job(spec: dict) -> int:
    """Diffusion decoding on bd3lm-b4 (seed 0) against compiled AR t = 1 on ar (seed 0), in one process."""
    import torch

    sys.path.insert(0, str(HERE))
    from decode_bench import ar_perplexity, graphs_compiled, synchronize

    import hf_lookaround as H
    from transformers import AutoTokenizer

    for name in ("recompile_limit", "cache_size_limit"):  # a graph pair per batch size and decoder
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    s = spec["settings"]
    device = torch.device("cuda" if s["cuda"] else "cpu")
    dtype = torch.bfloat16 if s["cuda"] else torch.float32
    ar_dir, bd_dir = spec["models"]["ar"], spec["models"]["bd3lm-b4"]
    tokenizer = AutoTokenizer.from_pretrained(ar_dir)
    scorer = H.LookAroundForPreTraining.from_pretrained(ar_dir, dtype=torch.float32).to(device).eval()

    def causal(path):
        model = H.LookAroundForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        model.generation_config.eos_token_id = None  # every row makes exactly new_tokens
        model.generation_config.pad_token_id = model.config.pad_token_id
        return model

    ar, bd = causal(ar_dir), causal(bd_dir)
    lines = [line for line in Path(spec["prep"]["prompts"]).read_text().splitlines() if line.strip()]
    bos = ar.config.bos_token_id

    def prompts(batch):
        rows = []
        for i in range(batch):
            ids = tokenizer(lines[i % len(lines)], add_special_tokens=False)["input_ids"][: s["prompt_tokens"] - 1]
            rows.append([bos] + ids + ids[-1:] * (s["prompt_tokens"] - 1 - len(ids)))
        return torch.tensor(rows, device=device)

    def decoder(model, static=True, **kwargs):
        def decode(x, sample):
            torch.manual_seed(0)
            extra = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
            cache = dict(cache_implementation="static") if static else {}
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=s["new_tokens"],
                                 return_dict_in_generate=True, **cache, **extra, **kwargs)
            return out.sequences, getattr(out, "num_forwards", None)
        return decode

    table = {"AR t=1 group_size=1 (static+compile)": ("baseline", decoder(ar, group_size=1)),
             "AR t=1 generate() (static+compile)": ("baseline", decoder(ar))}
    for p in s["thresholds"]:
        table[f"bd3lm b=4 threshold={p:g}"] = ("diffusion", decoder(bd, diffusion_threshold=p))
    for k in s["steps_per_block"]:
        table[f"bd3lm b=4 steps={k}"] = ("diffusion", decoder(bd, diffusion_steps=k))
    one_stream = {}  # the one-stream form's decoders with a dynamic cache (eager): batch 1 only, beside its static rows
    if DECODE_ONE_STREAM in spec["models"]:
        bd1 = causal(spec["models"][DECODE_ONE_STREAM])
        for p in s["thresholds"]:
            table[f"bd3lm-1s b=4 threshold={p:g}"] = ("diffusion", decoder(bd1, diffusion_threshold=p))
            one_stream[f"bd3lm-1s b=4 threshold={p:g} (dynamic)"] = (
                "diffusion", decoder(bd1, static=False, diffusion_threshold=p))
        for k in s["steps_per_block"]:
            table[f"bd3lm-1s b=4 steps={k}"] = ("diffusion", decoder(bd1, diffusion_steps=k))
            one_stream[f"bd3lm-1s b=4 steps={k} (dynamic)"] = (
                "diffusion", decoder(bd1, static=False, diffusion_steps=k))
    rows = []
    record = {"started_utc": utc_now(), "models": spec["models"], "rows": rows,
                        "device": torch.cuda.get_device_name() if s["cuda"] else platform.processor() or "cpu",
                        "dtype": str(dtype), "torch": torch.__version__}
    out_path = Path(spec["folder"]) / "result.json"
    for mode in s["decode_modes"]:
        for batch in s["decode_batches"]:
            x = prompts(batch)
            for name, (kind, decode) in {**table, **(one_stream if batch == 1 else {})}.items():
                row = {"decoder": name, "kind": kind, "mode": mode, "batch": batch}
                try:
                    decode(x, mode == "sample")  # warm-up on the timed shapes (compiles)
                    synchronize(device)
                    graphs, times = graphs_compiled(), []
                    for _ in range(s["repeats"]):
                        synchronize(device)
                        start = time.perf_counter()
                        seqs, forwards = decode(x, mode == "sample")
                        synchronize(device)
                        times.append(time.perf_counter() - start)
                    new = seqs.shape[1] - x.shape[1]
                    forwards = forwards if forwards is not None else new
                    row.update(seconds=statistics.median(times), new_tokens=new, forwards=int(forwards),
                               new_tokens_per_s=batch * new / statistics.median(times),
                               tokens_per_forward=new / int(forwards),
                               graphs_compiled_after_warmup=graphs_compiled() - graphs,
                               gen_ppl=ar_perplexity(scorer, seqs.to(device), x.shape[1]))
                except Exception as error:  # noqa: BLE001 - one failed row must not lose the others
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                print(json.dumps(row), flush=True)
                rows.append(row)
                write_json(out_path.with_suffix(".partial.json"), record)
    record["finished_utc"] = utc_now()
    write_json(out_path, summarise_decoding(record))
    return 0


def summarise_decoding(record: dict) -> dict:
    """For each (mode, batch): the faster compiled AR row is the baseline; each diffusion row's speed-up and
    generative-perplexity ratio against it, and whether any row meets the target."""
    record = dict(record)
    verdicts = []
    for key in sorted({(r["mode"], r["batch"]) for r in record["rows"]}):
        rows = [r for r in record["rows"] if (r["mode"], r["batch"]) == key and "error" not in r]
        base = max((r for r in rows if r["kind"] == "baseline"), key=lambda r: r["new_tokens_per_s"], default=None)
        if base is None:
            continue
        best = None
        for r in rows:
            r["speedup_vs_baseline"] = r["new_tokens_per_s"] / base["new_tokens_per_s"]
            r["gen_ppl_vs_baseline"] = r["gen_ppl"] / base["gen_ppl"]
            r["meets_target"] = (r["kind"] == "diffusion" and r["speedup_vs_baseline"] >= TARGET_SPEEDUP
                                 and r["gen_ppl_vs_baseline"] <= 1 + TARGET_GEN_PPL)
            if r["meets_target"] and (best is None or r["speedup_vs_baseline"] > best["speedup_vs_baseline"]):
                best = r
        verdicts.append({"mode": key[0], "batch": key[1], "baseline": base["decoder"],
                         "baseline_tokens_per_s": base["new_tokens_per_s"], "baseline_gen_ppl": base["gen_ppl"],
                         "met": best is not None, "best_meeting_target": best and best["decoder"]})
    record["target"] = {"speedup_at_least": TARGET_SPEEDUP, "gen_ppl_within": TARGET_GEN_PPL, "by_setting": verdicts}
    return record


def run_job(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    return (cell_job if spec["kind"] == "cell" else decode_job)(spec)


# ---------------------------------------------------------------------------------------------
# the driver: plan, pool over GPUs, deadline, records
# ---------------------------------------------------------------------------------------------
def visible_gpus(cuda: bool) -> list[str]:
    if not cuda:
        return ["cpu"]
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def load_records(folders: list[Path]) -> tuple[dict, dict | None]:
    """Finished cells and the decoding record from earlier calls' --out folders (first found wins)."""
    cells, decoding = {}, None
    for folder in folders:
        for path in sorted((folder / "cells").glob("*.json")) if (folder / "cells").is_dir() else []:
            cells.setdefault(path.stem, json.loads(path.read_text()))
        if decoding is None and (folder / "decoding.json").is_file():
            decoding = json.loads((folder / "decoding.json").read_text())
    return cells, decoding


def plan(args, cells_done: dict, decoding_done: bool, work: Path) -> list[dict]:
    """The jobs still to run, in the order a free slot takes them: the decoding job's two cells first (seed 0),
    then seed by seed (a cut call leaves whole seeds), the decoding job once its models exist."""
    jobs = []
    order = [cell_name(c, 0) for c in decode_needs(args.cells)]
    order += [cell_name(c, seed) for seed in args.seeds for c in args.cells]
    for name in dict.fromkeys(order):
        cell, seed = name.split("__s")[0], int(name.split("__s")[1])
        if cell not in args.cells or seed not in args.seeds:
            continue
        model_here = (work / "cells" / name / "model" / "model.safetensors").is_file()
        needed_for_decoding = (not decoding_done and args.decode and seed == 0 and cell in decode_needs(args.cells)
                               and not model_here)
        if name in cells_done and not needed_for_decoding:
            continue
        jobs.append(dict(name=name, kind="cell", cell=cell, seed=seed, needs=[], exclusive=False,
                         rerun_for_decoding=name in cells_done))
    if args.decode and not decoding_done:
        # it waits for every one of its cells to end, and starts if the two it cannot do without finished (a failed
        # one-stream cell only leaves its rows out)
        jobs.append(dict(name="decoding", kind="decode", needs=[cell_name(c, 0) for c in decode_needs(args.cells)],
                         required=[cell_name(c, 0) for c in DECODE_NEEDS],
                         exclusive=True))
    return jobs


def needs_met(job: dict, done: dict, waiting: set) -> bool:
    """Every cell the job needs has ended (none still to run or running: a rerun of an earlier call's cell counts),
    and the ones it requires finished (exit 0); ``done``: cell -> exit code."""
    if any(n not in done or n in waiting for n in job["needs"]):
        return False
    return all(done[n] == 0 for n in job.get("required", job["needs"]))


def run_pool(args, jobs, settings, prep, work: Path, out: Path, state: dict) -> None:
    deadline = args.t0 + args.minutes * 60
    slots = {gpu: 0 for gpu in args.gpus}  # jobs running per GPU
    exclusive = set()  # GPUs held by an exclusive job
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_CACHE=str(work / "hf_datasets_cache"),
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // max(1, len(args.gpus) * args.jobs_per_gpu))),
               PYTHONPATH=os.pathsep.join([str(REPO / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(
                   os.pathsep) if p]))
    pending, running = list(jobs), {}
    done = {name: 0 for name in state["cells"]}  # finished in earlier calls count as done for the needs
    models = {c: str(work / "cells" / cell_name(c, 0) / "model") for c in decode_needs(args.cells)}
    while pending or running:
        now = time.time()
        for job in list(pending):
            if not needs_met(job, done, waiting=set(running) | {j["name"] for j in pending}):
                continue
            if job["kind"] == "decode" and not all(Path(models[c], "model.safetensors").is_file()
                                                   for c in DECODE_NEEDS):
                continue  # its models are not on this machine yet (their cells are rerun above)
            left = deadline - now
            if left < (args.decode_min_s if job["kind"] == "decode" else args.cell_min_s):
                continue
            if job["exclusive"]:
                gpu = next((g for g in args.gpus if slots[g] == 0), None)
            else:
                gpu = next((g for g in sorted(args.gpus, key=lambda g: slots[g])
                            if g not in exclusive and slots[g] < args.jobs_per_gpu), None)
            if gpu is None:
                continue
            pending.remove(job)
            slots[gpu] += 1
            if job["exclusive"]:
                exclusive.add(gpu)
            folder = work / ("cells/" + job["name"] if job["kind"] == "cell" else job["name"])
            folder.mkdir(parents=True, exist_ok=True)
            have = {c: m for c, m in models.items() if c in DECODE_NEEDS or Path(m, "model.safetensors").is_file()}
            spec = dict(job, gpu=gpu, folder=str(folder), settings=settings, prep=prep, models=have)
            (folder / "spec.json").write_text(json.dumps(spec, indent=1))
            job_env = env if gpu == "cpu" else dict(env, CUDA_VISIBLE_DEVICES=gpu)
            log = open(folder / "job_log.txt", "a")
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "job", str(folder / "spec.json")],
                                    stdout=log, stderr=subprocess.STDOUT, env=job_env, start_new_session=True)
            running[job["name"]] = (proc, gpu, time.time(), job, folder)
            print(f"[diffbench] {utc_now()} start {job['name']} on {gpu}", flush=True)
        time.sleep(args.poll_s)
        for name, (proc, gpu, started, job, folder) in list(running.items()):
            if proc.poll() is None and time.time() > deadline:
                # the job's own process group (it, the hf-lookaround command it runs and its data workers); a warm
                # machine continues the cell from its last checkpoint
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.poll() is None:
                continue
            del running[name]
            slots[gpu] -= 1
            exclusive.discard(gpu)
            done[name] = proc.returncode
            result = folder / "result.json"
            entry = {"exit_code": proc.returncode, "gpu": gpu, "wall_seconds": round(time.time() - started, 1)}
            if proc.returncode == 0 and result.is_file():
                record = json.loads(result.read_text())
                if job["kind"] == "cell":
                    if job.get("rerun_for_decoding") and name in state["cells"]:
                        entry["note"] = "rerun for the decoding job's model; the first record stays in the table"
                    else:
                        state["cells"][name] = record
                        write_json(out / "cells" / f"{name}.json", record)
                else:
                    state["decoding"] = record
                    write_json(out / "decoding.json", record)
                entry["state"] = "finished"
            else:
                entry.update(state="failed, or killed at the deadline (a warm machine continues it)",
                             log_tail=_tail(folder / "log.txt") + _tail(folder / "job_log.txt"))
            state["calls"][-1]["jobs"][name] = entry
            print(f"[diffbench] {utc_now()} {name}: {entry['state']} ({entry['wall_seconds']} s)", flush=True)
            write_report(state, settings, out)
        if not running and (time.time() > deadline - min(args.cell_min_s, args.decode_min_s) or not pending):
            for job in pending:
                state["calls"][-1]["jobs"][job["name"]] = {"state": "not started in this call"}
            break


def _tail(path: Path, lines: int = 15) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
def cell_perplexity(record: dict) -> tuple[float, float | None, int | None]:
    """(perplexity, standard error in nats per token or None, Monte-Carlo samples or None) of one cell."""
    p = record["perplexity"]
    for key in ("elbo_perplexity", "ar_perplexity", "masked_perplexity", "perplexity"):
        if key in p:
            return float(p[key]), p.get("standard_error"), p.get("num_samples")
    raise KeyError(f"no perplexity in {sorted(p)}")


def likelihood_table(cells: dict, settings: dict) -> tuple[list[dict], str]:
    rows, lines = [], []
    lines.append("| model | protocol | perplexity (mean over seeds) | sd over seeds | per seed | ELBO s.e. (nats/token, "
                 "per seed) | seeds | tokens |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cell in CELLS:
        recs = sorted((r for r in cells.values() if r["cell"] == cell), key=lambda r: r["seed"])
        if not recs:
            lines.append(f"| {cell} | {CELLS[cell][3]} | not run yet | | | | 0 | |")
            continue
        ppls = [cell_perplexity(r) for r in recs]
        values = [p for p, _, _ in ppls]
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else None
        se = [e for _, e, _ in ppls if e is not None]
        row = {"cell": cell, "protocol": CELLS[cell][3], "seeds": [r["seed"] for r in recs], "perplexities": values,
               "mean": mean, "sd": sd, "standard_errors": se or None,
               "num_samples": ppls[0][2], "tokens": sorted({r["tokens"] for r in recs})}
        rows.append(row)
        bound = "≤ " if CELLS[cell][2][1] == "elbo" else ""
        lines.append(f"| {cell} | {CELLS[cell][3]} | {bound}{mean:.2f} | {'–' if sd is None else f'{sd:.2f}'} | "
                     f"{', '.join(f'{v:.2f}' for v in values)} | "
                     f"{', '.join(f'{e:.4f}' for e in se) if se else '–'} | {len(values)} | "
                     f"{', '.join(f'{t / 1e6:g} M' for t in row['tokens'])} |")
    return rows, "\n".join(lines)


def ordering(rows: list[dict]) -> str:
    """BD3-LM's published ordering, AR < BD3-LM (b = 4) < MDLM, against ours (means over seeds)."""
    by = {r["cell"]: r["mean"] for r in rows}
    if not all(c in by for c in ("ar", "bd3lm-b4", "mdlm")):
        return "ordering AR < BD3-LM (b = 4) < MDLM: not all three cells have run yet"
    agrees = by["ar"] < by["bd3lm-b4"] < by["mdlm"]
    return (f"BD3-LM's ordering AR < BD3-LM (b = 4) < MDLM: {'agrees' if agrees else 'does not agree'} "
            f"(ar {by['ar']:.2f}, bd3lm-b4 {by['bd3lm-b4']:.2f}, mdlm {by['mdlm']:.2f}; means over seeds; the "
            "seed spread is in the table)")


def decoding_table(record: dict | None) -> str:
    if not record:
        return "Decoding: not run yet."
    lines = [f"Decoding on {record.get('device')} ({record.get('dtype')}); generative perplexity under the ar "
             "checkpoint (fp32).", "",
             "| decoder | mode | batch | new tokens/s | vs compiled AR | forwards | tokens/forward | gen. ppl | "
             "gen. ppl vs AR | graphs after warm-up | target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["rows"]:
        if "error" in r:
            lines.append(f"| {r['decoder']} | {r['mode']} | {r['batch']} | {r['error'][:160]} | | | | | | | |")
            continue
        lines.append(f"| {r['decoder']} | {r['mode']} | {r['batch']} | {r['new_tokens_per_s']:.0f} | "
                     f"{r.get('speedup_vs_baseline', float('nan')):.2f}x | {r['forwards']} | "
                     f"{r['tokens_per_forward']:.2f} | {r['gen_ppl']:.2f} | "
                     f"{r.get('gen_ppl_vs_baseline', float('nan')):.3f} | {r['graphs_compiled_after_warmup']} | "
                     f"{'met' if r.get('meets_target') else '–'} |")
    lines.append("")
    for v in record.get("target", {}).get("by_setting", []):
        lines.append(f"- target (>= {TARGET_SPEEDUP}x {v['baseline']} at a generative perplexity within "
                     f"{TARGET_GEN_PPL:.0%} of its {v['baseline_gen_ppl']:.2f}), {v['mode']}, batch {v['batch']}: "
                     + (f"met by {v['best_meeting_target']}" if v["met"] else "not met"))
    return "\n".join(lines)


def write_report(state: dict, settings: dict, out: Path) -> dict:
    rows, table = likelihood_table(state["cells"], settings)
    report = dict(state, likelihood=rows, ordering=ordering(rows))
    write_json(out / "diffusion_bench.json", report)
    s = settings
    md = [f"# Issue 40: likelihood and diffusion decoding ({s['preset']}, "
          f"{s['steps'] * s['batch_size'] * s['block_size'] / 1e6:g} M tokens per cell)", "",
          f"Pretrained with `hf-lookaround pretrain` on {s['corpus_dir']} (block {s['block_size']}, batch "
          f"{s['batch_size']}, {s['steps']} steps, cosine, 5 % warm-up); scored on the held-out passages (windows "
          f"of {s['block_size']}, stride {s['block_size'] // 2}; ELBO with {s['elbo_samples']} Monte-Carlo samples "
          "per window). Code commit " + state.get("code_commit", "?") + ".", "", table, "", report["ordering"], "",
          decoding_table(state.get("decoding")), ""]
    (out / "diffusion_bench.md").write_text("\n".join(md))
    return report


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------
SMOKE = dict(preset="tiny", vocab_size=512, tokenizer_chars=200_000, tokens=4 * 4 * 64, batch_size=4, block_size=64,
             save_every=2, eval_batch_size=8, elbo_samples=2, heldout_passages=2, passage_chars=300,
             seeds=[0, 1], thresholds=[0.5, 0.9], steps_per_block=[2], decode_batches=[1, 2], new_tokens=8,
             prompt_tokens=8, repeats=1, jobs_per_gpu=2, cell_min_s=0, decode_min_s=0, minutes=20.0,
             decode_modes=["greedy", "sample"])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "device_out") + "/diffbench",
                   help="records (cells/*.json, decoding.json), diffusion_bench.json and .md")
    p.add_argument("--work_dir", default="runs/diffbench", help="models and logs (kept by a warm machine)")
    p.add_argument("--records_from", nargs="*", default=[".devdata/diffbench"],
                   help="earlier calls' --out folders: their finished cells and decoding are not run again")
    p.add_argument("--report", nargs="+", default=None, metavar="RECORDS",
                   help="only write the report from these records folders into --out")
    p.add_argument("--corpus_dir", default=".devdata/c1/gutenberg")
    p.add_argument("--preset", default="small")
    p.add_argument("--vocab_size", type=int, default=8192)
    p.add_argument("--tokenizer_chars", type=int, default=20_000_000, help="train the BPE on this much text")
    p.add_argument("--tokens", type=int, default=40_000_000, help="pretraining tokens per cell (equal for all)")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--block_size", type=int, default=256)
    p.add_argument("--save_every", type=int, default=500, help="steps between checkpoints (a cut cell resumes)")
    p.add_argument("--eval_batch_size", type=int, default=64)
    p.add_argument("--elbo_samples", type=int, default=16)
    p.add_argument("--heldout_passages", type=int, default=20, help="per test book")
    p.add_argument("--passage_chars", type=int, default=4000)
    p.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--no_decode", dest="decode", action="store_false")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99])
    p.add_argument("--steps_per_block", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--decode_batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode_modes", nargs="+", default=["greedy", "sample"], choices=["greedy", "sample"])
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--prompt_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--jobs_per_gpu", type=int, default=2, help="training cells side by side on one GPU")
    p.add_argument("--minutes", type=float, default=8.8, help="the deadline: jobs still running are killed")
    p.add_argument("--cell_min_s", type=float, default=90, help="no cell starts with less time left")
    p.add_argument("--decode_min_s", type=float, default=300, help="the decoding job needs this much time left")
    p.add_argument("--poll_s", type=float, default=2.0)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny preset, a few steps, synthetic text")
    args = p.parse_args(argv)
    if args.smoke:  # the smoke sizes, except where the command line gives another value
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:
        return run_job(argv[1])
    args = parse_args(argv)
    args.t0 = time.time()
    out, work = Path(args.out), Path(args.work_dir)
    if args.smoke:
        work = Path(args.out) / "work"
        args.corpus_dir = str(synthetic_corpus(work / "corpus"))
        args.records_from = []
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    steps = max(1, math.ceil(args.tokens / (args.batch_size * args.block_size)))
    settings = {k: getattr(args, k) for k in (
        "preset", "vocab_size", "batch_size", "block_size", "save_every", "eval_batch_size", "elbo_samples",
        "corpus_dir", "thresholds", "steps_per_block", "decode_batches", "decode_modes", "new_tokens",
        "prompt_tokens", "repeats", "heldout_passages", "passage_chars", "tokenizer_chars")}
    args.gpus = visible_gpus(cuda)
    # the cells that start together tokenize the slice together (once per machine: the datasets cache is shared)
    num_proc = (os.cpu_count() or 1) // (len(args.gpus) * args.jobs_per_gpu) if cuda else 1
    settings.update(steps=steps, cuda=cuda, num_proc=max(1, min(8, num_proc)))
    if args.report:
        cells, decoding = load_records([Path(f) for f in args.report])
        earlier = Path(args.report[0]) / "diffusion_bench.json"  # the settings and calls the records ran with
        state = json.loads(earlier.read_text()) if earlier.is_file() else {"calls": [], "settings": settings}
        state.update(cells=cells, decoding=decoding)
        write_report(state, state["settings"], out)
        return 0
    cells, decoding = load_records([Path(f) for f in args.records_from] + [out])
    state = {"what": "issue 40: the likelihood table (BD3-LM Table 3 form) and diffusion decoding against compiled "
                     "AR t = 1", "settings": settings, "code_commit": git_commit(), "cells": cells,
             "decoding": decoding, "calls": [{"started_utc": utc_now(), "gpus": args.gpus, "jobs": {}}]}
    for name, record in cells.items():
        write_json(out / "cells" / f"{name}.json", record)  # every call's --out holds every record so far
    if decoding:
        write_json(out / "decoding.json", decoding)
    prep = prepare(args, work)
    state["prep"] = prep
    jobs = plan(args, cells, decoding is not None, work)
    print(f"[diffbench] {len(cells)} cells done earlier; {len(jobs)} jobs to run on {args.gpus} "
          f"({steps} steps = {steps * args.batch_size * args.block_size / 1e6:g} M tokens per cell)", flush=True)
    run_pool(args, jobs, settings, prep, work, out, state)
    state["calls"][-1]["finished_utc"] = utc_now()
    state["calls"][-1]["minutes"] = round((time.time() - args.t0) / 60, 2)
    print((out / "diffusion_bench.md").read_text() if write_report(state, settings, out) else "", flush=True)
    missing = [cell_name(c, s) for s in args.seeds for c in args.cells if cell_name(c, s) not in state["cells"]]
    print(f"[diffbench] missing after this call: {missing or 'none'}; decoding "
          f"{'done' if state.get('decoding') else 'not done'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
