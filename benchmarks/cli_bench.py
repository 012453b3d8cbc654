"""Speed where users live: ``hf-lookaround pretrain`` against the Hugging Face Trainer baseline of each family.

Each run is its own process. A package run calls what the command calls (``cli.pretrain.parse_args`` on the
argument list a user types, then ``training.pretraining.run``), with one more ``TrainerCallback``: a step timer.
A baseline run is the run_clm / run_mlm recipe for a plain HF model of the same size, on the same blocks
(the same tokenizer, ``group_texts`` into ``--block_size`` blocks), through ``Trainer`` with the same flags:

| family | objectives | baseline |
| --- | --- | --- |
| look ahead | ar, dar | ``LlamaForCausalLM`` (run_clm) |
| masked | mlm, vmlm | ``BertForMaskedLM`` + ``DataCollatorForLanguageModeling(0.15)`` (run_mlm) |
| any order | gvp | ``XLNetLMHeadModel`` + ``DataCollatorForPermutationLanguageModeling`` |

What is timed: steady-state steps. The timer synchronises the device at each step's end; tokens/s is the timed
steps' tokens (B x T each) over the time from the end of step ``--warmup_steps`` to the end of the last step
(what a user waits for, data loading included). It also reports the compiled graphs dynamo made before and after
the warm-up (``recompiles after warm-up``, target 0), the share of that time spent outside steps (waiting for
the next batch), and the collator's cost: the run's own training collator timed in the main process on one batch
of the run's own blocks, as a share of a step (target <= 2% at B = 16).

    python benchmarks/cli_bench.py --train_file news.jsonl --tokenizer tok/ --out cli_bench.json
    python benchmarks/cli_bench.py --report cli_bench.json     # the table again (of each file, given several)
    python benchmarks/cli_bench.py --smoke --out smoke.json    # a tiny CPU run of every code path
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (name, family baseline, pretrain arguments beyond the shared ones)
PACKAGE_RUNS = {
    "ar": ("llama", ["--objective", "ar"]),
    "ar, single stream": ("llama", ["--objective", "ar", "--ar_form", "single_stream"]),  # GPT's form of ar
    "dar t=2": ("llama", ["--objective", "dar", "--group_size", "2"]),
    # SAT's one-stream form: 2t - 2 start rows per block, so 1022 text tokens fill the 1024 positions (tokens/s
    # counts the 1022)
    "dar t=2, one stream": ("llama", ["--objective", "dar", "--group_size", "2", "--dar_form", "single_stream",
                                      "--block_size", "1022"]),
    # DDP tuning a user can pass through TrainingArguments: fewer, larger gradient buckets, no buffer broadcast
    "dar t=2, ddp tuned": ("llama", ["--objective", "dar", "--group_size", "2", "--ddp_bucket_cap_mb", "100",
                                     "--ddp_broadcast_buffers", "false"]),
    # the command's defaults; the masked objectives drop their unread content by default (since cli_bench_2)
    "mlm 0.15": ("bert", ["--objective", "mlm", "--mask_ratio", "0.15"]),
    "mlm 0.15, drop": ("bert", ["--objective", "mlm", "--mask_ratio", "0.15", "--drop_unread_content", "true"]),
    "mlm 0.15, no drop": ("bert", ["--objective", "mlm", "--mask_ratio", "0.15", "--drop_unread_content", "false"]),
    "vmlm [0.15, 0.3]": ("bert", ["--objective", "vmlm"]),
    "vmlm [0.15, 0.3], drop": ("bert", ["--objective", "vmlm", "--drop_unread_content", "true"]),
    "vmlm [0.15, 0.3], no drop": ("bert", ["--objective", "vmlm", "--drop_unread_content", "false"]),
    "gvp": ("xlnet", ["--objective", "gvp"]),  # drops its unread content by default (since cli_bench_4)
    "gvp, drop": ("xlnet", ["--objective", "gvp", "--drop_unread_content", "true"]),
    "gvp, no drop": ("xlnet", ["--objective", "gvp", "--drop_unread_content", "false"]),
    # UL2-style: half the rows semi-AR, half variable masking; compared with the look-ahead family's baseline
    "mixture dar+vmlm": ("llama", ["--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5"]),
    # the one-stream mixture: dar rows block-causal (SAT), vmlm rows BERT's [MASK] form, one BlockMask per batch;
    # 1022 tokens and dar's 2t - 2 start rows fill the 1024 positions, as for one-stream dar
    "mixture dar+vmlm, one stream": ("llama", ["--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5",
                                               "--dar_form", "single_stream", "--masked_form", "single_stream",
                                               "--block_size", "1022"]),
}
BASELINES = ("llama", "bert", "xlnet")
# under fsdp:N a baseline is wrapped by its own decoder layer, with every other setting of examples/accelerate/fsdp.yaml
BASELINE_LAYERS = {"llama": "LlamaDecoderLayer", "bert": "BertLayer", "xlnet": "XLNetLayer"}
SIZES = {"base": dict(hidden=768, layers=12, heads=12, intermediate=3072),
         "tiny": dict(hidden=64, layers=2, heads=2, intermediate=256)}


# ---------------------------------------------------------------------------------------------
# in the child process
# ---------------------------------------------------------------------------------------------
def step_timer(warmup_steps: int, tokens_per_step: int, timed_steps: int):
    import torch
    from transformers import TrainerCallback

    def graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends, self.gaps, self.graphs_at_warmup, self.collate_ms = [], [], None, None
            self.loader = None

        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            self.loader = train_dataloader

        def on_step_begin(self, args, state, control, **kwargs):
            if self.ends:
                self.gaps.append(time.perf_counter() - self.ends[-1])

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            if len(self.ends) == warmup_steps:
                self.graphs_at_warmup = graphs()

        def on_train_end(self, args, state, control, **kwargs):
            # the run's training collator, in the main process, on one batch of the run's blocks
            loader = self.loader
            if loader is None or getattr(loader, "collate_fn", None) is None:
                return
            batch = [loader.dataset[i] for i in range(args.per_device_train_batch_size)]
            loader.collate_fn(batch)
            times = []
            for _ in range(20):
                t = time.perf_counter()
                loader.collate_fn(batch)
                times.append(time.perf_counter() - t)
            self.collate_ms = 1000 * sorted(times)[len(times) // 2]

        def result(self) -> dict:
            # steps after the timed ones (--profile) are not timed
            timed = min(timed_steps, len(self.ends) - warmup_steps)
            if timed < 1:
                raise RuntimeError(f"only {len(self.ends)} steps ran; need more than --warmup_steps {warmup_steps}")
            seconds = self.ends[warmup_steps + timed - 1] - self.ends[warmup_steps - 1]
            step_ms = 1000 * seconds / timed
            outside = sum(self.gaps[warmup_steps - 1:warmup_steps + timed - 1])  # gap i precedes step i + 2
            return {"timed_steps": timed, "seconds": seconds, "tokens_per_s": timed * tokens_per_step / seconds,
                    "step_ms": step_ms, "outside_step_share": outside / seconds,
                    "graphs_at_warmup": self.graphs_at_warmup, "graphs_at_end": graphs(),
                    "recompiles_after_warmup": graphs() - (self.graphs_at_warmup or 0),
                    "collate_ms": self.collate_ms,
                    "collator_share": None if self.collate_ms is None else self.collate_ms / step_ms}

    return StepTimer()


def callbacks(spec: dict, tokens_per_step: int) -> list:
    """The step timer, and with --profile the step profile (benchmarks/step_profile.py) after it."""
    timed = spec["steps"] - spec["warmup_steps"]
    timers = [step_timer(spec["warmup_steps"], tokens_per_step, timed)]
    if spec.get("profile"):
        import step_profile

        step_profile.install_host_timers()
        timers.append(step_profile.profile_callback(spec["warmup_steps"], timed, spec["profile_steps"],
                                                    Path(spec["result"]).parent))
    return timers


def timed_result(timers: list) -> dict:
    return {**timers[0].result(), **({"profile": timers[1].summary()} if len(timers) > 1 else {})}


def train_samples(spec: dict) -> int:
    """Blocks a run trains on: one batch per step, per rank with --samples_per_rank (else the ranks share them, and
    each rank's epoch ends after steps / world size steps)."""
    steps = spec["steps"] + spec.get("profile_steps", 0)
    return spec["batch_size"] * steps * (world_size() if spec.get("samples_per_rank") else 1)


def shared_flags(spec: dict) -> list[str]:
    steps = spec["steps"] + spec.get("profile_steps", 0)  # the profiled steps come after the timed ones
    flags = ["--per_device_train_batch_size", str(spec["batch_size"]), "--max_steps", str(steps),
             "--save_strategy", "no", "--report_to", "none", "--logging_steps", "10", "--seed", "0",
             "--output_dir", spec["output_dir"]]
    if spec["kind"] == "package":
        flags += ["--overwrite_output_dir", "true"]  # transformers 5's TrainingArguments no longer has it
    if spec["device"] == "cuda":
        flags += ["--bf16", "true"]
    else:
        flags += ["--use_cpu", "true"]
    if spec["compile"]:
        flags += ["--torch_compile", "true"]
    return flags + spec.get("extra_args", [])  # --extra_args: TrainingArguments flags for every run of the call


def run_package(spec: dict) -> dict:
    from hf_lookaround.cli.pretrain import parse_args
    from hf_lookaround.training.pretraining import run

    argv = ["--train_files", spec["train_file"], "--tokenizer_name", spec["tokenizer"], "--preset", spec["preset"],
            "--block_size", str(spec["block_size"]), "--validation_split_percentage", "0",
            "--max_train_samples", str(train_samples(spec)),
            "--do_train",
            *shared_flags(spec), *spec["extra"]]
    args = parse_args(argv)
    block_size = args[1].block_size  # a run may set its own (the one-stream dar row leaves room for start rows)
    timers = callbacks(spec, spec["batch_size"] * block_size * world_size())
    run(*args, callbacks=timers)
    shown = [Path(a).name if a in (spec["train_file"], spec["tokenizer"], spec["output_dir"]) else a for a in argv]
    return {"command": "hf-lookaround pretrain " + " ".join(shown), **timed_result(timers)}


def run_baseline(spec: dict) -> dict:
    """run_clm / run_mlm, as the examples do it: tokenize, group_texts, a fresh model, Trainer."""
    from itertools import chain

    from datasets import load_dataset
    from transformers import (
        AutoTokenizer,
        HfArgumentParser,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    block = spec["block_size"]
    raw = load_dataset("json", data_files=spec["train_file"], split="train")
    tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=raw.column_names)

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}  # run_clm's join (linear, unlike sum(..., []))
        total = (len(joined["input_ids"]) // block) * block
        out = {k: [t[i: i + block] for i in range(0, total, block)] for k, t in joined.items()}
        out["labels"] = out["input_ids"].copy()  # run_clm; the masked collators replace them
        return out

    blocks = tokenized.map(group_texts, batched=True)
    if len(blocks) < train_samples(spec):
        raise RuntimeError(f"{len(blocks)} blocks of {block} tokens, {train_samples(spec)} needed: a larger --train_file")
    blocks = blocks.select(range(train_samples(spec)))
    model, collator = baseline_model(spec["baseline"], tokenizer, block, SIZES[spec["preset"]])
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(args=shared_flags(spec))
    timers = callbacks(spec, spec["batch_size"] * block * world_size())
    parameters = sum(p.numel() for p in model.parameters())  # before FSDP shards them
    trainer = Trainer(model=model, args=args, train_dataset=blocks, data_collator=collator or default_data_collator,
                      callbacks=timers)
    trainer.train()
    return {"model": type(model).__name__, "parameters": parameters, **timed_result(timers)}


def baseline_model(name: str, tokenizer, block: int, size: dict):
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        DataCollatorForPermutationLanguageModeling,
        LlamaConfig,
        LlamaForCausalLM,
        XLNetConfig,
        XLNetLMHeadModel,
    )

    vocab = len(tokenizer)
    if name == "llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                             num_attention_heads=size["heads"], intermediate_size=size["intermediate"],
                             max_position_embeddings=block, pad_token_id=tokenizer.pad_token_id)
        return LlamaForCausalLM(config), None  # run_clm: labels = input_ids (default_data_collator)
    if name == "bert":
        config = BertConfig(vocab_size=vocab, hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                            num_attention_heads=size["heads"], intermediate_size=size["intermediate"],
                            max_position_embeddings=block, pad_token_id=tokenizer.pad_token_id)
        return BertForMaskedLM(config), DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    if name == "xlnet":
        config = XLNetConfig(vocab_size=vocab, d_model=size["hidden"], n_layer=size["layers"], n_head=size["heads"],
                             d_inner=size["intermediate"], pad_token_id=tokenizer.pad_token_id)
        return XLNetLMHeadModel(config), DataCollatorForPermutationLanguageModeling(tokenizer)
    raise ValueError(f"unknown baseline {name!r}; choose one of {BASELINES}")


def set_ddp_kwargs(extra: dict) -> None:
    """DDP constructor arguments that TrainingArguments has no flag for (gradient_as_bucket_view): added to those
    Trainer hands accelerate, for package and baseline runs alike."""
    from accelerate.utils import DistributedDataParallelKwargs

    to_kwargs = DistributedDataParallelKwargs.to_kwargs
    DistributedDataParallelKwargs.to_kwargs = lambda self: {**to_kwargs(self), **extra}


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def child(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("ddp_kwargs"):
        set_ddp_kwargs(spec["ddp_kwargs"])
    if spec["kind"] == "baseline":
        # run_clm's labels: the Trainer computes the shifted loss from labels = input_ids
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        result = run_baseline(spec)
    else:
        result = run_package(spec)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(dict(result, world_size=world_size()), indent=1))
    if "profile" in result:  # every rank's own numbers (the slowest rank sets the pace)
        Path(spec["result"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(result["profile"], indent=1))
    return 0


# ---------------------------------------------------------------------------------------------
# in the parent process
# ---------------------------------------------------------------------------------------------
def launch(name: str, spec: dict, work: Path, timeout_s: int) -> dict:
    folder = work / name.replace(" ", "_").replace(",", "").replace("[", "").replace("]", "").replace("=", "")
    folder.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, output_dir=str(folder / "out"), result=str(folder / "result.json"))
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    t = time.perf_counter()
    log = folder / "log.txt"
    command = [str(Path(__file__).resolve()), "--_child", str(folder / "spec.json")]
    if spec["launch"] != "none":  # accelerate launch with the committed config: one process per GPU
        config, processes = spec["launch"].split(":")
        config_file = launch_config(config, spec, folder)
        command = ["-m", "accelerate.commands.launch", "--config_file", str(config_file), "--num_processes",
                   processes, *command]
    env = dict(os.environ)
    if spec["launch"] == "none" and spec["device"] == "cuda":
        # one process, one GPU (several would mean DataParallel); side by side, each its own
        env["CUDA_VISIBLE_DEVICES"] = str(spec.get("gpu", env.get("CUDA_VISIBLE_DEVICES", "0")))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *command], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # the launcher and its ranks (torch's elastic agent starts them in sessions of their own), so that
            # they free their GPUs for the next run
            import psutil

            for pid in [c.pid for c in psutil.Process(proc.pid).children(recursive=True)] + [proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            code = "timeout"
    row = {"name": name, "kind": spec["kind"], "launch": spec["launch"], "wall_s": round(time.perf_counter() - t, 1)}
    if code == 0 and Path(spec["result"]).is_file():
        row.update(status="ok", **json.loads(Path(spec["result"]).read_text()))
        ranks = sorted(folder.glob("result.rank*.json"), key=lambda f: int(f.stem.split("rank")[-1]))
        if ranks:
            row["profile"] = [json.loads(f.read_text()) for f in ranks]
    else:
        tail = log.read_text(errors="replace").strip().splitlines()[-25:]
        errors = [line for line in tail if "Error" in line or "error" in line]
        row.update(status="failed", exit=code, error=(errors[-1] if errors else tail[-1] if tail else "")[:400],
                   log_tail="\n".join(tail)[-3000:])
    print(f"[cli_bench] {name}: {row['status']} in {row['wall_s']} s"
          + (f", {row['tokens_per_s']:,.0f} tokens/s" if row["status"] == "ok" else f" ({row['error']})"), flush=True)
    return row


def launch_config(config: str, spec: dict, folder: Path) -> Path:
    """examples/accelerate/{config}.yaml; for a baseline under FSDP, the same file wrapping the baseline's layer."""
    committed = HERE.parent / "examples" / "accelerate" / f"{config}.yaml"
    if config != "fsdp" or spec["kind"] != "baseline":
        return committed
    text = committed.read_text()
    key = "fsdp_transformer_layer_cls_to_wrap: LookAroundLayer"
    if key not in text:
        raise RuntimeError(f"{committed} no longer says {key!r}: update cli_bench.launch_config")
    derived = folder / "fsdp.yaml"
    derived.write_text(text.replace(key, f"fsdp_transformer_layer_cls_to_wrap: {BASELINE_LAYERS[spec['baseline']]}"))
    return derived


def rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:,.0f}k" if tokens_per_s >= 1e4 else f"{tokens_per_s:,.0f}"


def table(result: dict) -> str:
    launches = list(dict.fromkeys(r.get("launch", "none") for r in result["rows"]))
    return "\n\n".join(launch_table(result, how) for how in launches)


def launch_table(result: dict, how: str) -> str:
    suffix = "" if how == "none" else f" @{how}"
    rows = {r["name"][: len(r["name"]) - len(suffix)]: r for r in result["rows"] if r.get("launch", "none") == how}
    one = {r["name"]: r for r in result["rows"] if r.get("launch", "none") == "none"}
    title = "one process" if how == "none" else f"accelerate launch, {how.replace(':', ' on ')} GPUs"
    lines = [f"**{title}**", "", "| objective | this package, tokens/s | recompiles after warm-up | outside steps | "
             "collator share | HF baseline, tokens/s | ratio |" + (" scaling vs one process |" if how != "none" else ""),
             "| --- | ---: | ---: | ---: | ---: | --- | ---: |" + (" ---: |" if how != "none" else "")]
    for name, (baseline, _) in PACKAGE_RUNS.items():
        r = rows.get(name)
        if r is None:
            continue
        b = rows.get(baseline)
        base = f"{b['model']} {rate(b['tokens_per_s'])}" if b and b["status"] == "ok" else \
            (f"{baseline}: {b['status']}" if b else "not run")
        if r["status"] != "ok":
            lines.append(f"| {name} | **{r['status']}**: {r['error'][:120]} | | | | {base} | |"
                         + (" |" if how != "none" else ""))
            continue
        ratio = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b and b["status"] == "ok" else ""
        share = "" if r.get("collator_share") is None else f"{100 * r['collator_share']:.1f}% ({r['collate_ms']:.1f} ms)"
        scaling = ""
        if how != "none":
            single = one.get(name)
            scaling = f" {r['tokens_per_s'] / single['tokens_per_s']:.2f}x |" if single and single["status"] == "ok" \
                else " |"
        lines.append(f"| {name} | {rate(r['tokens_per_s'])} ({r['step_ms']:.0f} ms/step) | "
                     f"{r['recompiles_after_warmup']} | {100 * r['outside_step_share']:.1f}% | {share} | {base} | {ratio} |"
                     + scaling)
    for name in BASELINES:
        b = rows.get(name)
        if b is not None and b["status"] == "ok":
            single = one.get(name)
            scaling = "" if how == "none" else (
                f" {b['tokens_per_s'] / single['tokens_per_s']:.2f}x |" if single and single["status"] == "ok" else " |")
            lines.append(f"| baseline {b['model']} | | {b['recompiles_after_warmup']} | "
                         f"{100 * b['outside_step_share']:.1f}% | "
                         + ("" if b.get("collator_share") is None else f"{100 * b['collator_share']:.1f}%")
                         + f" | {rate(b['tokens_per_s'])} ({b['step_ms']:.0f} ms/step) | |" + scaling)
        elif b is not None:
            lines.append(f"| baseline {name} | | | | | **{b['status']}**: {b['error'][:120]} | |"
                         + (" |" if how != "none" else ""))
    return "\n".join(lines)


def profile_table(result: dict) -> str:
    """Where each profiled run's step goes (benchmarks/step_profile.py), ms per step: rank 0, and the largest
    over the ranks where it differs by more than 10%."""
    def ms(value) -> str:
        return "" if value is None else f"{value:.1f}"

    def across(ranks, pick) -> str:
        values = [v for v in (pick(p) for p in ranks) if v is not None]
        if not values:
            return ""
        first, top = values[0], max(values)
        return ms(first) + (f" (max {ms(top)})" if top > 1.1 * first + 0.05 else "")

    lines = ["**Where the step goes** (ms per step; rank 0, max over ranks in brackets; GPU times from CUDA events, "
             "communication from torch.profiler on the steps after the timed ones)", "",
             "| run | ms/step | outside steps | data wait | count items | logging | rest of gap | fwd+bwd+clip (GPU) "
             "| optimizer (GPU) | sched+zero_grad (GPU) | mask building host / GPU | NCCL kernels | NCCL exposed "
             "| GPU idle |",
             "| --- |" + " ---: |" * 13]
    for r in result["rows"]:
        ranks = r.get("profile")
        if r["status"] != "ok" or not ranks:
            continue
        outside = r["outside_step_share"] * r["step_ms"]
        gap = ranks[0]["gap"]
        rest = outside - sum(v for v in gap.values() if v is not None)
        mask = ranks[0]["mask_building"]
        lines.append("| " + " | ".join([
            r["name"], f"{r['step_ms']:.1f}", f"{outside:.1f} ({100 * r['outside_step_share']:.1f}%)",
            across(ranks, lambda p: p["gap"]["data_wait_ms"]), across(ranks, lambda p: p["gap"]["count_items_ms"]),
            across(ranks, lambda p: p["gap"]["log_save_eval_ms"]), f"{rest:.1f}",
            across(ranks, lambda p: p["step"].get("forward_backward_clip_ms")),
            across(ranks, lambda p: p["step"].get("optimizer_ms")),
            across(ranks, lambda p: p["step"].get("scheduler_zero_grad_ms")),
            "" if mask["host_ms"] is None else f"{ms(mask['host_ms'])} / {ms(mask['gpu_ms'])}",
            across(ranks, lambda p: (p["profiled"] or {}).get("communication_ms")),
            across(ranks, lambda p: (p["profiled"] or {}).get("exposed_communication_ms")),
            across(ranks, lambda p: (p["profiled"] or {}).get("gpu_idle_ms"))]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train_file", help="a .jsonl(.gz) with a 'text' field")
    parser.add_argument("--tokenizer", help="a tokenizer folder (hf-lookaround train-tokenizer)")
    parser.add_argument("--runs", nargs="+", default=[*PACKAGE_RUNS, *BASELINES],
                        help=f"which runs, in order: {list(PACKAGE_RUNS)} and {list(BASELINES)}")
    parser.add_argument("--preset", default="base", choices=sorted(SIZES))
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--warmup_steps", type=int, default=15)
    parser.add_argument("--timed_steps", type=int, default=30)
    parser.add_argument("--launch", nargs="+", default=["none"],
                        help="none (one process), or ddp:N / fsdp:N (accelerate launch with examples/accelerate/"
                             "{ddp,fsdp}.yaml on N GPUs); every run under each; a baseline under fsdp wraps its own layer")
    parser.add_argument("--no_compile", action="store_true")
    parser.add_argument("--samples_per_rank", action="store_true",
                        help="a batch per step for every rank (else the ranks split one run's worth of blocks, and "
                             "under ddp:N each rank starts a new epoch every steps / N steps)")
    parser.add_argument("--extra_args", default="", metavar="FLAGS",
                        help="TrainingArguments flags added to every run, package and baseline, as one string: "
                             "--extra_args='--ddp_bucket_cap_mb 100'")
    parser.add_argument("--ddp_kwargs", default=None, metavar="JSON",
                        help="DDP constructor arguments added to every run's, e.g. '{\"gradient_as_bucket_view\": true}'")
    parser.add_argument("--timeout_s", type=int, default=240, help="per run")
    parser.add_argument("--profile", nargs="*", default=None, metavar="LAUNCH",
                        help="profile the runs under these launches (all, if none named): where a step's time goes, "
                             "per rank (benchmarks/step_profile.py), on --profile_steps more steps after the timed ones")
    parser.add_argument("--profile_steps", type=int, default=3)
    parser.add_argument("--side_by_side", action="store_true",
                        help="start the one-process runs together, one GPU each (needs as many GPUs as runs)")
    parser.add_argument("--deadline_s", type=float, default=None,
                        help="a budget for the whole call: a run that cannot finish in what is left (its timeout, or "
                             "--expected_run_s) is skipped and marked so, and each run's timeout shrinks to fit")
    parser.add_argument("--expected_run_s", type=float, default=80.0, help="a run's wall time, for --deadline_s")
    parser.add_argument("--work_dir", default=None)
    parser.add_argument("--out", default=None, help="write every row as JSON here (rewritten after each run)")
    parser.add_argument("--report", nargs="+", default=None,
                        help="print the table of a JSON this script wrote (of each, for several: one per GPU)")
    parser.add_argument("--smoke", action="store_true", help="tiny preset, T=64, B=4, 2+3 steps, CPU, no compile")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        return child(args._child)
    if args.report:
        for path in args.report:
            result = json.loads(Path(path).read_text())
            if len(args.report) > 1:
                print(f"\n### {Path(path).name}: {result['device']}\n")
            print(table(result))
            if any("profile" in r for r in result["rows"]):
                print("\n" + profile_table(result))
        return 0
    if not (args.train_file and args.tokenizer):
        parser.error("--train_file and --tokenizer are needed (or --report)")
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if args.smoke:
        args.preset, args.block_size, args.batch_size, args.warmup_steps, args.timed_steps = "tiny", 64, 4, 2, 3
        args.no_compile = True
    unknown = [r for r in args.runs if r not in PACKAGE_RUNS and r not in BASELINES]
    if unknown:
        parser.error(f"unknown runs {unknown}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="cli_bench_"))
    common = dict(train_file=str(Path(args.train_file).resolve()), tokenizer=str(Path(args.tokenizer).resolve()),
                  preset=args.preset, block_size=args.block_size, batch_size=args.batch_size,
                  warmup_steps=args.warmup_steps, steps=args.warmup_steps + args.timed_steps,
                  compile=not args.no_compile, device=device, samples_per_rank=args.samples_per_rank,
                  extra_args=shlex.split(args.extra_args), ddp_kwargs=json.loads(args.ddp_kwargs or "{}"))
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__,
              "settings": {k: Path(v).name if k == "tokenizer" else v for k, v in common.items() if k != "train_file"},
              "train_file": Path(args.train_file).name, "rows": []}
    started = time.perf_counter()

    def timeout_left() -> int | None:  # None: no time left for another run
        if args.deadline_s is None:
            return args.timeout_s
        left = args.deadline_s - (time.perf_counter() - started)
        return int(min(args.timeout_s, left)) if left >= min(args.timeout_s, args.expected_run_s) else None

    def record(rows):
        result["rows"].extend(rows)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    for how in args.launch:
        profiled = args.profile is not None and (not args.profile or how in args.profile)
        specs = []
        for name in args.runs:
            kind = dict(kind="package", extra=PACKAGE_RUNS[name][1]) if name in PACKAGE_RUNS else \
                dict(kind="baseline", baseline=name)
            label = name if how == "none" else f"{name} @{how}"
            specs.append((label, dict(common, **kind, launch=how, profile=profiled,
                                      profile_steps=args.profile_steps if profiled else 0)))
        if how == "none" and args.side_by_side and device == "cuda":
            if len(specs) > torch.cuda.device_count():
                parser.error(f"--side_by_side: {len(specs)} runs, {torch.cuda.device_count()} GPUs")
            timeout = timeout_left()
            if timeout is None:
                record([skipped(label, spec) for label, spec in specs])
                continue
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(specs)) as pool:
                rows = list(pool.map(lambda i: launch(specs[i][0], dict(specs[i][1], gpu=i), work, timeout),
                                     range(len(specs))))
            record(rows)
            continue
        for label, spec in specs:
            timeout = timeout_left()
            record([skipped(label, spec) if timeout is None else launch(label, spec, work, timeout)])
    print(table(result))
    if any("profile" in r for r in result["rows"]):
        print("\n" + profile_table(result))
    return 0 if all(r["status"] == "ok" for r in result["rows"]) else 1


def skipped(label: str, spec: dict) -> dict:
    print(f"[cli_bench] {label}: skipped (--deadline_s reached)", flush=True)
    return {"name": label, "kind": spec["kind"], "launch": spec["launch"], "status": "skipped",
            "error": "--deadline_s reached", "wall_s": 0}


if __name__ == "__main__":
    sys.exit(main())
