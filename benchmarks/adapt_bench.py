"""Issue 39's headline: does adapting a pretrained causal LM match training from scratch with at most 1/5 of the tokens?

Two subcommands; benchmarks/adapt_device_call.sh runs the whole measurement with them and `hf-lookaround`:

- ``source``: the "pretrained AR model", a run_clm-style ``LlamaForCausalLM`` (the LookAround `base` size: 768 wide,
  12 layers, 12 heads, SwiGLU 3072, tied embeddings) trained by plain transformers ``Trainer`` on packed blocks of
  BOS + text (the package's packing), under torchrun (DDP). Resumes from its last checkpoint.
- ``eval``: for each named checkpoint, on held-out books: AR perplexity (``evaluation.perplexity.ar_perplexity``,
  the package's protocol), semi-AR (t = 2) perplexity (the loss of dar's one-stream layout: each group of 2 given
  the earlier groups; a checkpoint that is not block-causal is read as one, which is what adaptation starts from),
  generative perplexity of sampled 128-token continuations decoded two tokens a forward (``generate(group_size=2)``)
  and scored by the source Llama, their unigram entropy (low: repetition), and new tokens/s of that decoding.

    torchrun --nproc_per_node 4 benchmarks/adapt_bench.py source --train_file T --tokenizer TOK --tokens 200e6 \
        --out runs/adapt/source
    python benchmarks/adapt_bench.py eval --source runs/adapt/source --eval_file V --out result.json \
        --checkpoint adapted_dar_40M=runs/adapt/dar_40M ...
    # the CPU smoke run: adapt_device_call.sh end to end (every stage, 3b's annealing arm included) at the sizes of
    # SMOKE_RUN (`tiny`, a few steps) on synthetic text, with DEVICE_SMOKE=1 (source and eval get --smoke)
    PYTHONPATH=src python benchmarks/adapt_bench.py --smoke --out /tmp/adapt_smoke
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import time
from pathlib import Path

import torch


def read_texts(path: str, limit: int | None = None) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return texts[:limit] if limit else texts


# ------------------------------------------------------------------------------------------------------ source
BASE_LLAMA = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
SMOKE_LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)  # `tiny`'s


def packed_blocks(texts, tokenizer, block_size: int) -> torch.Tensor:
    """BOS + block_size - 1 tokens per block, documents joined by EOS (the package's packing, data/text.py)."""
    stream: list[int] = []
    for start in range(0, len(texts), 64):
        for ids in tokenizer(texts[start : start + 64], add_special_tokens=False)["input_ids"]:
            stream.extend(ids + [tokenizer.eos_token_id])
    body = block_size - 1
    count = len(stream) // body
    data = torch.tensor(stream[: count * body]).view(count, body)
    return torch.cat([torch.full((count, 1), tokenizer.bos_token_id), data], 1)


def train_source(args) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.per_device_batch, learning_rate=args.lr,
        lr_scheduler_type="cosine", warmup_steps=args.warmup_steps, weight_decay=0.1, adam_beta2=0.95,
        max_grad_norm=1.0, bf16=torch.cuda.is_available(), torch_compile=torch.cuda.is_available(), logging_steps=50,
        save_steps=500, save_total_limit=1, report_to="none", seed=0, dataloader_num_workers=2,
        max_steps=1,  # set below, once the world size is known
    )
    tokens_per_step = args.per_device_batch * args.block_size * training_args.world_size
    training_args.max_steps = math.ceil(args.tokens / tokens_per_step)
    cache = Path(args.out) / f"blocks_{args.block_size}.pt"
    with training_args.main_process_first(local=False, desc="packing the corpus"):
        if not cache.is_file():
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save(packed_blocks(read_texts(args.train_file), tokenizer, args.block_size), cache)
    blocks = torch.load(cache)
    epochs = args.tokens / blocks.numel()
    print(f"source: {training_args.max_steps} steps of {tokens_per_step} tokens = {args.tokens / 1e6:.0f} M tokens "
          f"({epochs:.2f} epochs of {blocks.numel() / 1e6:.1f} M)", flush=True)

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return len(blocks)

        def __getitem__(self, i):
            return {"input_ids": blocks[i], "labels": blocks[i]}

    size = SMOKE_LLAMA if args.smoke else BASE_LLAMA
    config = LlamaConfig(
        vocab_size=len(tokenizer), **size, max_position_embeddings=args.max_positions, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=training_args, train_dataset=Blocks())
    resume = any(Path(args.out).glob("checkpoint-*"))
    result = trainer.train(resume_from_checkpoint=True if resume else None)
    trainer.save_model(args.out)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(args.out)
        (Path(args.out) / "source_run.json").write_text(json.dumps(
            {**result.metrics, "tokens": args.tokens, "epochs": epochs, "steps": training_args.max_steps}, indent=2))


# -------------------------------------------------------------------------------------------------------- eval
def prompts_of(texts, tokenizer, count: int, prompt_tokens: int, new_tokens: int) -> torch.Tensor:
    """``count`` prompts of BOS + ``prompt_tokens - 1`` tokens, one window per document in turn."""
    window = prompt_tokens - 1 + new_tokens
    docs = [ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] if len(ids) >= window]
    prompts, i = [], 0
    while len(prompts) < count:
        doc, start = docs[i % len(docs)], (i // len(docs)) * window
        if start + window <= len(doc):
            prompts.append([tokenizer.bos_token_id] + doc[start : start + prompt_tokens - 1])
        i += 1
    return torch.tensor(prompts)


@torch.no_grad()
def semi_ar_perplexity(model, tokenizer, blocks: torch.Tensor, batch_size: int = 16) -> float:
    """exp of the mean NLL of dar's one-stream layout with t = 2 over ``blocks`` (each group given earlier groups)."""
    from hf_lookaround.objectives import make_collator

    collator = make_collator("dar", tokenizer, seed=0, group_size=2, form="single_stream")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(blocks), batch_size):
        batch = collator([{"input_ids": row} for row in blocks[start : start + batch_size]])
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(**batch, one_stream_layout=True).logits.float()[:, :-1]
        labels = batch["labels"][:, 1:]
        seen = labels != -100
        nll = torch.nn.functional.cross_entropy(logits[seen], labels[seen], reduction="sum")
        total, count = total + float(nll), count + int(seen.sum())
    return math.exp(total / count)


@torch.no_grad()
def continuation_nll(scorer, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    logits = scorer(input_ids=sequences).logits.float()[:, prompt_len - 1 : -1]
    return -torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def unigram_entropy(rows) -> float:
    values = []
    for row in rows:
        p = torch.bincount(torch.tensor(row)).float()
        p = p[p > 0] / len(row)
        values.append(float(-(p * p.log()).sum()))
    return statistics.fmean(values)


def evaluate(args) -> None:
    import transformers

    import hf_lookaround  # noqa: F401  (registers the LookAround Auto classes)
    from hf_lookaround.evaluation.perplexity import ar_perplexity

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.source)
    texts = read_texts(args.eval_file)
    ppl_texts = [t[: args.chars_per_document] for t in texts[: args.documents]]
    blocks = packed_blocks(ppl_texts, tokenizer, args.block_size)[: args.semi_ar_blocks]
    prompts = prompts_of(texts, tokenizer, args.prompts, args.prompt_tokens, args.new_tokens).to(device)
    scorer = transformers.AutoModelForCausalLM.from_pretrained(args.source, dtype=torch.float32).to(device).eval()
    results = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
    for item in args.checkpoint:
        name, path = item.split("=", 1)
        if name in results:
            continue
        row = {"path": path}
        config = transformers.AutoConfig.from_pretrained(path)
        if config.model_type == "lookaround" and config.default_attention != "block_causal":
            # the semi-AR reading of a causal checkpoint: the same weights, block-causal with t = 2 (adaptation's
            # step 0); its AR numbers come from the checkpoint as it is
            as_groups = transformers.AutoModelForCausalLM.from_pretrained(
                path, default_attention="block_causal", attention_group_size=2, dtype=torch.float32).to(device).eval()
        else:
            as_groups = None
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        row["ar_perplexity"] = ar_perplexity(model, tokenizer, ppl_texts, args.block_size - 8, args.block_size // 2,
                                             batch_size=8).mean_nll
        row["ar_perplexity"] = math.exp(row["ar_perplexity"])
        if config.model_type == "lookaround":
            row["semi_ar_perplexity_t2"] = semi_ar_perplexity(as_groups or model, tokenizer, blocks)
        decoder = (as_groups or model).to(dtype)
        group = {"group_size": 2} if config.model_type == "lookaround" else {}
        kwargs = dict(max_new_tokens=args.new_tokens, do_sample=True, top_k=0, temperature=1.0, **group)
        torch.manual_seed(0)
        decoder.generate(prompts[:2], attention_mask=torch.ones_like(prompts[:2]),
                         **{**kwargs, "max_new_tokens": 8})  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.manual_seed(0)
        out = decoder.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        nll = continuation_nll(scorer, out, prompts.shape[1])
        row.update(generative_perplexity=math.exp(float(nll.mean())), unigram_entropy=unigram_entropy(
            out[:, prompts.shape[1]:].tolist()), new_tokens_per_s=prompts.shape[0] * args.new_tokens / seconds,
            tokens_per_forward=2 if group else 1)
        results[name] = row
        print(name, json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")  # after each row: a cut-off call keeps them
        del model, as_groups, decoder
    rows = ["| checkpoint | AR ppl | semi-AR ppl (t=2) | gen. ppl (by source) | entropy | new tok/s |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, row in results.items():
        semi = row.get("semi_ar_perplexity_t2")
        rows.append(f"| {name} | {row['ar_perplexity']:.2f} | {'' if semi is None else f'{semi:.2f}'} | "
                    f"{row['generative_perplexity']:.2f} | {row['unigram_entropy']:.3f} | "
                    f"{row['new_tokens_per_s']:.0f} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


# ------------------------------------------------------------------------------------------------------ smoke
# the CPU smoke run: adapt_device_call.sh end to end, every stage (3b's annealing arm included), at these sizes
SMOKE_RUN = dict(NGPU="1", BLOCK="64", BATCH="4", PRESET="tiny", VOCAB="512", SOURCE_TOKENS="1024",
                 ADAPT_TOKENS="1024 2048", ANNEAL_TOKENS="2048", ANNEAL_SHARE="2", SCRATCH_TOKENS="2048",
                 SCRATCH_EVERY="1024")
SMOKE_EVAL = dict(documents=2, chars_per_document=4000, semi_ar_blocks=4, prompts=2, prompt_tokens=8, new_tokens=8)


def smoke(out: str) -> int:
    """Synthetic books (diffusion_bench's), then the device script with DEVICE_SMOKE=1; checks every row came."""
    import importlib.util
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("diffusion_bench", here / "diffusion_bench.py")
    diffusion_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(diffusion_bench)
    out = Path(out).resolve()
    corpus = diffusion_bench.synthetic_corpus(out / "corpus")
    env = dict(os.environ, **SMOKE_RUN, DEVICE_SMOKE="1", OUT=str(out), R=str(out / "runs"),
               TRAIN=str(corpus / "train.jsonl.gz"), VALID=str(corpus / "validation.jsonl.gz"),
               TOK=str(out / "runs" / "tok"), PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                                                   os.environ.get("PATH", "")]))
    rc = subprocess.run(["bash", str(here / "adapt_device_call.sh")], env=env).returncode
    rows = json.loads((out / "adapt_bench.json").read_text()) if (out / "adapt_bench.json").is_file() else {}
    expected = ["source_llama", "converted_step0"] + [
        f"{objective}_{run}" for objective in ("dar", "mixture")
        for run in ("adapt_1k", "adapt_2k", "adapt_2k_annealed", "scratch_1k", "scratch_2k")]
    missing = [name for name in expected if name not in rows]
    print(f"adapt smoke: exit {rc}; {len(rows)} rows; missing: {missing or 'none'}", flush=True)
    return rc or (1 if missing else 0)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: the device script end to end at tiny sizes "
                        "on synthetic text (with --out DIR and no subcommand)")
    parser.add_argument("--out", default=None, help="--smoke's folder")
    commands = parser.add_subparsers(dest="command")
    source = commands.add_parser("source", help="train the plain-transformers Llama (under torchrun)")
    source.add_argument("--train_file", required=True)
    source.add_argument("--tokenizer", required=True)
    source.add_argument("--tokens", type=float, default=200e6)
    source.add_argument("--block_size", type=int, default=512)
    source.add_argument("--max_positions", type=int, default=1024, help="RoPE positions (room for dar's start rows)")
    source.add_argument("--per_device_batch", type=int, default=32)
    source.add_argument("--lr", type=float, default=6e-4)
    source.add_argument("--warmup_steps", type=int, default=200)
    source.add_argument("--out", required=True)
    source.add_argument("--smoke", action="store_true", help="a tiny Llama (the smoke run)")
    ev = commands.add_parser("eval", help="score checkpoints on held-out books")
    ev.add_argument("--source", required=True, help="the source Llama: the scorer of generations, and the tokenizer")
    ev.add_argument("--eval_file", required=True)
    ev.add_argument("--checkpoint", action="append", default=[], metavar="NAME=PATH")
    ev.add_argument("--out", required=True)
    ev.add_argument("--block_size", type=int, default=512)
    ev.add_argument("--documents", type=int, default=6)
    ev.add_argument("--chars_per_document", type=int, default=200_000)
    ev.add_argument("--semi_ar_blocks", type=int, default=256)
    ev.add_argument("--prompts", type=int, default=32)
    ev.add_argument("--prompt_tokens", type=int, default=64)
    ev.add_argument("--new_tokens", type=int, default=128)
    ev.add_argument("--smoke", action="store_true", help="the smoke run's sizes, except where given")
    args = parser.parse_args(argv)
    if args.command is None and not (args.smoke and args.out):
        parser.error("give a subcommand (source or eval), or --smoke --out DIR")
    if args.command == "eval" and args.smoke:
        for key, value in SMOKE_EVAL.items():
            if getattr(args, key) == ev.get_default(key):
                setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command is None:
        return smoke(args.out)
    (train_source if args.command == "source" else evaluate)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
