"""Decoding benchmark (issue 12): group decoding speed and quality, compiled single-stream generation vs Llama.

One call does everything (the device lease is short):
1. train a byte-level BPE tokenizer and pretrain, with a plain torch loop, two checkpoints at ``--preset``:
   ``dar`` with the group-size mixture ``t in {1, 2, 4}`` (so that every group size decoded below was trained;
   a ``t = 2`` checkpoint would be refused at ``t = 4`` without ``allow_untrained``) and ``ar``; and a third,
   the scorer (step 3);
2. decode 256 new tokens after 64-token prompts cut from held-out documents (batch 8: eight different windows,
   batch 1: the first of them), sampling (temperature 1, top-k 50, top-p 0.95, ``--seeds`` seeds), EOS off so
   that every decoder emits the same count:
   - group decoding at t = 1, 2, 4 with the same ``dar`` checkpoint (query stream, KV cache of clean content),
     and t = 1 with the ``ar`` checkpoint;
   - ``LookAroundForCausalLM`` on the ``dar`` checkpoint through ``generate()``: eager (dynamic cache) and
     ``cache_implementation="static"`` (transformers compiles the decoding step on CUDA), with the number of
     graphs compiled after warm-up;
   - ``LlamaForCausalLM`` of the same size (hidden, layers, heads, intermediate, vocabulary; random weights),
     eager and static-compiled, in the same run;
   - self-speculative decoding (``draft_group_size`` k = 2, 4) with the ``dar`` checkpoint, when t = 1 is in its
     mixture: t = 1's distribution in fewer forwards (the rows give the drafts' acceptance rate);
3. quality next to speed, judged by an **independent, larger** AR checkpoint (``--scorer_preset``, default
   ``base``, another seed) that decodes nothing: the perplexity of each decoder's continuations under it, the
   unigram entropy of each continuation (low for repetitive text), distinct-1/2, and the same for the held-out
   text that really followed each prompt (the reference row). Every decoder samples with ``--seeds`` seeds; the
   quality columns are the mean ± standard error over them. Each row also gives its model forwards per call
   (t = 1 and ``generate()``: one per new token; group t: ceil(new / t); speculative: counted), so that decoders
   are compared as quality against forwards: group decoding buys fewer forwards with quality, speculative
   decoding should not pay any.

It prints a markdown table and writes JSON. ``--smoke`` runs a tiny CPU version (``tiny`` decoders, ``mini``
scorer) in a few minutes.

GPU (the lead copies a corpus into the git-ignored ``.devdata/``):

    PYTHONPATH=src python benchmarks/generation_bench.py --data .devdata/sotu/train.jsonl.gz \
        --eval_data .devdata/sotu/validation.jsonl.gz --out generation_bench.json

CPU smoke:

    PYTHONPATH=src python benchmarks/generation_bench.py --smoke --data ../shared/data/text/sotu/validation.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import hf_lookaround as H
from hf_lookaround.objectives import make_collator
from hf_lookaround.decoding import group_generate
from hf_lookaround.data.tokenization import train_tokenizer

SAMPLING = dict(do_sample=True, temperature=1.0, top_k=50, top_p=0.95)


# ----------------------------------------------------------------------------------------------
# data (no `datasets`: the GPU image has none)
# ----------------------------------------------------------------------------------------------
def read_documents(paths: list[str]) -> list[str]:
    """Documents of .jsonl(.gz) files (field ``text``) and .txt files, or folders of them, in sorted order."""
    files = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.name.endswith((".jsonl", ".jsonl.gz", ".txt")))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"--data/--eval_data: {path} does not exist")
    docs = []
    for path in files:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            if path.name.endswith(".txt"):
                docs.append(f.read())
            else:
                docs += [json.loads(line)["text"] for line in f if line.strip()]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"no documents in {paths}")
    return docs


def blocks_of(docs, tokenizer, block_size: int) -> torch.Tensor:
    """Concatenate (EOS after each document) and cut into BOS-prefixed blocks, as pretraining does."""
    stream = []
    for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        stream += ids + [tokenizer.eos_token_id]
    body = block_size - 1
    count = len(stream) // body
    if count == 0:
        raise ValueError(f"{len(stream)} tokens are fewer than one block of {block_size}")
    data = torch.tensor(stream[: count * body]).view(count, body)
    return torch.cat([torch.full((count, 1), tokenizer.bos_token_id), data], 1)


def prompts_of(docs, tokenizer, count: int, prompt_tokens: int, new_tokens: int):
    """``count`` windows of held-out text: BOS + ``prompt_tokens - 1`` tokens, and the ``new_tokens`` that followed."""
    window = prompt_tokens - 1 + new_tokens
    encoded = [ids for ids in tokenizer(docs, add_special_tokens=False)["input_ids"] if len(ids) >= window]
    if not encoded:
        raise ValueError(f"no held-out document has {window} tokens; lower --prompt_tokens/--new_tokens")
    prompts, references, i = [], [], 0
    while len(prompts) < count:  # cycle through documents, moving one window further each round
        doc, start = encoded[i % len(encoded)], (i // len(encoded)) * window
        if start + window > len(doc):
            if i // len(encoded) > 1000:
                raise ValueError("held-out text too short for the prompts asked for")
            i += 1
            continue
        prompts.append([tokenizer.bos_token_id] + doc[start : start + prompt_tokens - 1])
        references.append(doc[start + prompt_tokens - 1 : start + window])
        i += 1
    return torch.tensor(prompts), torch.tensor(references)


# ----------------------------------------------------------------------------------------------
# pretraining (plain torch loop)
# ----------------------------------------------------------------------------------------------
def pretrain(objective, plan_params, collator_params, tokenizer, blocks, args, device, log, preset=None, steps=None,
             lr=None, seed=None):
    """A checkpoint of ``preset`` (default ``--preset``) trained ``steps`` steps at ``lr`` from ``seed``."""
    preset = args.preset if preset is None else preset
    steps = args.train_steps if steps is None else steps
    lr, seed = args.lr if lr is None else lr, args.seed if seed is None else seed
    config = H.LookAroundConfig.from_preset(
        preset, vocab_size=len(tokenizer), max_position_embeddings=args.block_size,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, mask_token_id=tokenizer.mask_token_id,
        objective=objective, plan_params=plan_params, default_attention="causal",
    )
    torch.manual_seed(seed)
    model = H.LookAroundForPreTraining(config).to(device)
    collator = make_collator(objective, tokenizer, seed=seed, **collator_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
    )
    generator = torch.Generator().manual_seed(seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(steps):
        rows = torch.randint(len(blocks), (args.train_batch_size,), generator=generator)
        batch = {k: v.to(device) for k, v in collator([{"input_ids": blocks[r]} for r in rows.tolist()]).items()}
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 5) == 0:
            log(f"  {objective} step {step + 1}/{steps} loss {statistics.fmean(losses[-20:]):.3f}")
    seconds = time.perf_counter() - start
    model.eval()
    return model, {"objective": objective, "preset": preset, "plan_params": plan_params, "steps": steps, "lr": lr,
                   "final_loss": statistics.fmean(losses[-20:]), "train_seconds": round(seconds, 1),
                   "parameters": sum(p.numel() for p in model.parameters())}


# ----------------------------------------------------------------------------------------------
# quality
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def ar_nll(scorer, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Per-token NLL of the continuation (columns ``prompt_len:``) under the AR checkpoint's query stream, AR plan."""
    device = next(scorer.parameters()).device
    sequences = sequences.to(device)
    batch, length = sequences.shape
    group_ids = torch.arange(length, device=device).expand(batch, length)
    targets = torch.arange(prompt_len, length, device=device).expand(batch, -1)
    logits = scorer(input_ids=sequences, group_ids=group_ids, target_positions=targets).logits.float()
    return -torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def distinct(rows: list[list[int]], n: int) -> float:
    grams = [tuple(r[i : i + n]) for r in rows for i in range(len(r) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def unigram_entropy(rows: list[list[int]]) -> float:
    """Mean over continuations of the entropy (nats) of each one's token histogram: low for repetitive text."""
    values = []
    for r in rows:
        counts = torch.bincount(torch.tensor(r)).float()
        p = counts[counts > 0] / len(r)
        values.append(float(-(p * p.log()).sum()))
    return statistics.fmean(values)


def quality(scorer, sequences, prompt_len) -> dict:
    continuations = sequences[:, prompt_len:]
    nll = ar_nll(scorer, sequences, prompt_len)
    rows = continuations.tolist()
    return {"ar_perplexity": float(torch.exp(nll.mean())), "entropy": unigram_entropy(rows),
            "distinct_1": distinct(rows, 1), "distinct_2": distinct(rows, 2)}


def mean_and_se(samples: list[dict]) -> dict:
    """Each quality key's mean over seeds, and its standard error as ``<key>_se``."""
    out = {}
    for key in samples[0]:
        values = [q[key] for q in samples]
        out[key] = statistics.fmean(values)
        out[key + "_se"] = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return out


# ----------------------------------------------------------------------------------------------
# decoders
# ----------------------------------------------------------------------------------------------
def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def graphs_compiled() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a counter we only report
        return -1


def run_timed(name, decode, prompts, new_tokens, device, seeds, log):
    """Warm up once with the very shapes that are timed (compiles, allocator), then time one call per seed.
    Returns every seed's sequences, and the timing (median over seeds) with the forwards of one call (and, for
    speculative decoding, the drafts' acceptance rate), both averaged over seeds."""
    decode(prompts, new_tokens, seed=0)
    synchronize(device)
    graphs = graphs_compiled()
    times, outs, forwards, accepted = [], [], [], []
    for seed in range(1, seeds + 1):
        synchronize(device)
        start = time.perf_counter()
        out, count, acceptance = decode(prompts, new_tokens, seed=seed)
        synchronize(device)
        times.append(time.perf_counter() - start)
        made = out.shape[1] - prompts.shape[1]
        if made != new_tokens:
            raise RuntimeError(f"{name} made {made} tokens, not {new_tokens}")
        outs.append(out)
        forwards.append(count)
        if acceptance is not None:
            accepted.append(acceptance)
    seconds = statistics.median(times)
    result = {"seconds": seconds, "new_tokens_per_s": prompts.shape[0] * new_tokens / seconds,
              "forwards": statistics.fmean(forwards),
              "graphs_compiled_after_warmup": graphs_compiled() - graphs if graphs >= 0 else None}
    if accepted:
        result["acceptance_rate"] = statistics.fmean(accepted)
    log(f"  {name} batch {prompts.shape[0]}: {result['new_tokens_per_s']:.0f} new tokens/s, "
        f"{result['forwards']:.0f} forwards" + (f", acceptance {result['acceptance_rate']:.2f}" if accepted else ""))
    return outs, result


def group_decoder(model, t):
    def decode(prompts, new_tokens, seed):
        generator = torch.Generator(device=prompts.device).manual_seed(seed)
        out = group_generate(model, prompts, group_size=t, max_new_tokens=new_tokens, eos_token_id=[],
                             generator=generator, **SAMPLING)
        return out, -(-new_tokens // t), None  # the prompt's forward samples the first group
    return decode


def speculative_decoder(model, k):
    """Self-speculative decoding: the tokens of t = 1 sampling (in distribution), fewer forwards."""
    def decode(prompts, new_tokens, seed):
        generator = torch.Generator(device=prompts.device).manual_seed(seed)
        out = group_generate(model, prompts, draft_group_size=k, max_new_tokens=new_tokens, eos_token_id=[],
                             generator=generator, return_dict_in_generate=True, **SAMPLING)
        return out.sequences, out.num_forwards, out.acceptance_rate
    return decode


def hf_decoder(model, static: bool):
    def decode(prompts, new_tokens, seed):
        torch.manual_seed(seed)
        kwargs = {"cache_implementation": "static"} if static else {}
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             **SAMPLING, **kwargs)
        return out, new_tokens, None
    return decode


def hf_models(dar_dir, config, dtype, device, attn):
    from decode_bench import llama_like  # the same Llama reference as the speed benchmark

    causal = H.LookAroundForCausalLM.from_pretrained(dar_dir, dtype=dtype, attn_implementation=attn).to(device).eval()
    causal.generation_config.eos_token_id = None  # every decoder emits exactly new_tokens
    causal.generation_config.pad_token_id = config.pad_token_id
    return causal, llama_like(config, dtype, device, attn)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", nargs="+", required=True, help="training text: .jsonl(.gz) (field text) / .txt, or folders")
    p.add_argument("--eval_data", nargs="*", default=None, help="held-out text for prompts (default: the last 5%% of --data)")
    p.add_argument("--out", default="generation_bench.json")
    p.add_argument("--checkpoint_dir", default="runs/generation_bench")
    p.add_argument("--preset", default="small")
    p.add_argument("--block_size", type=int, default=384)
    p.add_argument("--vocab_size", type=int, default=8192)
    p.add_argument("--train_steps", type=int, default=400)
    p.add_argument("--train_batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dar_group_sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--group_sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt_tokens", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--seeds", type=int, default=3, help="sampling seeds per decoder: quality is their mean ± SE")
    p.add_argument("--scorer_preset", default="base",
                   help="the independent AR checkpoint that scores every continuation: larger than --preset")
    p.add_argument("--scorer_steps", type=int, default=None, help="default: --train_steps")
    p.add_argument("--scorer_lr", type=float, default=6e-4)
    p.add_argument("--attn_implementation", default="sdpa")
    p.add_argument("--no_static", action="store_true", help="skip the static-cache (compiled) generate() rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: tiny preset, few steps and tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.block_size, args.vocab_size = "tiny", 64, 400
        args.train_steps, args.train_batch_size = 6, 4
        args.batch_sizes, args.prompt_tokens, args.new_tokens = [1, 2], 8, 12
        args.scorer_preset = "mini"
        args.checkpoint_dir = args.checkpoint_dir + "_smoke"
    from hf_lookaround.models.lookaround.configuration_lookaround import PRESETS

    for name in (args.preset, args.scorer_preset):
        if name not in PRESETS:
            p.error(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    if PRESETS[args.scorer_preset]["hidden_size"] <= PRESETS[args.preset]["hidden_size"]:
        p.error(f"--scorer_preset {args.scorer_preset} must be larger than --preset {args.preset}: a scorer of the "
                "decoded model's size shares its blind spots")
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    if args.scorer_steps is not None and args.scorer_steps < 1:
        p.error("--scorer_steps must be at least 1")
    if not args.scorer_lr > 0:
        p.error("--scorer_lr must be positive")
    if args.prompt_tokens + args.new_tokens > args.block_size:
        p.error(f"--prompt_tokens + --new_tokens ({args.prompt_tokens + args.new_tokens}) must fit in --block_size "
                f"({args.block_size}): the models are trained on positions < block_size")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    began = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - began:6.1f}s] {message}", flush=True)

    docs = read_documents(args.data)
    if args.eval_data:
        train_docs, held_out = docs, read_documents(args.eval_data)
    else:
        held = max(1, len(docs) // 20)
        if held >= len(docs):
            raise ValueError("--data holds one document: pass --eval_data for the prompts")
        train_docs, held_out = docs[:-held], docs[-held:]
    log(f"{len(train_docs)} training / {len(held_out)} held-out documents")
    tokenizer = train_tokenizer(train_docs, vocab_size=args.vocab_size)
    blocks = blocks_of(train_docs, tokenizer, args.block_size)
    log(f"tokenizer {len(tokenizer)} tokens; {len(blocks)} blocks of {args.block_size}")

    t = args.dar_group_sizes
    dar, dar_info = pretrain("dar", {"t": t if len(t) > 1 else t[0]}, {"group_size": t}, tokenizer, blocks,
                             args, device, log)
    ar, ar_info = pretrain("ar", {}, {}, tokenizer, blocks, args, device, log)
    # the judge: an AR checkpoint larger than the decoded ones, from another seed, used only to score
    scorer, scorer_info = pretrain("ar", {}, {}, tokenizer, blocks, args, device, log, preset=args.scorer_preset,
                                   steps=args.scorer_steps, lr=args.scorer_lr, seed=args.seed + 1000)
    ckpt = Path(args.checkpoint_dir)
    for name, model in (("dar", dar), ("ar", ar), ("scorer", scorer)):
        model.save_pretrained(ckpt / name)
        tokenizer.save_pretrained(ckpt / name)
    for model in (dar, ar, scorer):
        model.to(dtype)
        model.set_attn_implementation(args.attn_implementation)
    log(f"pretrained and saved to {ckpt}")

    prompts, references = prompts_of(held_out, tokenizer, max(args.batch_sizes), args.prompt_tokens,
                                     args.new_tokens)
    prompts, references = prompts.to(device), references.to(device)
    decoders = [(f"LookAround dar, group decoding t={g} (KV cache)", "group", g, group_decoder(dar, g))
                for g in args.group_sizes]
    if 1 in t:  # self-speculative decoding needs the AR pathway (t = 1) in the mixture
        decoders += [(f"LookAround dar, self-speculative k={k}", "group", 1, speculative_decoder(dar, k))
                     for k in (2, 4) if k in t]
    decoders.append(("LookAround ar, group decoding t=1 (KV cache)", "group", 1, group_decoder(ar, 1)))
    hf = []
    try:
        causal, llama = hf_models(ckpt / "dar", dar.config, dtype, device, args.attn_implementation)
        hf = [("LookAroundForCausalLM (dar) generate(), eager", "generate", 1, hf_decoder(causal, False))]
        # transformers compiles the decoding step of a static cache on CUDA only
        static = "static cache + compile" if device.type == "cuda" else "static cache (not compiled on CPU)"
        if not args.no_static:
            hf.append((f"LookAroundForCausalLM (dar) generate(), {static}", "generate", 1,
                       hf_decoder(causal, True)))
        hf.append(("LlamaForCausalLM (random weights) generate(), eager", "llama", 1, hf_decoder(llama, False)))
        if not args.no_static:
            hf.append((f"LlamaForCausalLM (random weights) generate(), {static}", "llama", 1,
                       hf_decoder(llama, True)))
    except Exception as err:  # noqa: BLE001 - report and go on with the other rows
        log(f"could not build the generate() models: {err!r}")
        traceback.print_exc()
    decoders += hf

    rows = []

    def save():  # after every row, so that a run cut short by the lease still leaves its numbers
        result = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "dtype": str(dtype), "attn_implementation": args.attn_implementation,
            "args": vars(args), "pretraining": [dar_info, ar_info], "scorer": scorer_info, "sampling": SAMPLING,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "seeds": args.seeds,
            "prompts": len(prompts), "prompt_windows": "one held-out window per batch row; batch b uses the first b",
            "rows": rows,
            "wall_seconds": round(time.perf_counter() - began, 1),
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
        return result

    reference = torch.cat([prompts, references], 1)
    rows.append({"decoder": "held-out text (what followed the prompt)", "kind": "reference", "group_size": None,
                 "batch_size": prompts.shape[0], **quality(scorer, reference, prompts.shape[1])})
    for name, kind, group_size, decode in decoders:
        for batch in args.batch_sizes:
            row = {"decoder": name, "kind": kind, "group_size": group_size, "batch_size": batch}
            try:
                outs, timing = run_timed(name, decode, prompts[:batch], args.new_tokens, device, args.seeds, log)
                row.update(timing)
                if kind != "llama":  # random weights: their text says nothing
                    row.update(mean_and_se([quality(scorer, out, prompts.shape[1]) for out in outs]))
            except Exception as err:  # noqa: BLE001 - one failing decoder must not cost the whole lease
                row["error"] = f"{type(err).__name__}: {err}"
                log(f"  {name} batch {batch} FAILED: {row['error']}")
                traceback.print_exc()
            rows.append(row)
            save()

    for row in rows:  # speed-ups against t = 1 of the same checkpoint / the eager Llama, same batch
        base_name = ("LookAround dar, group decoding t=1 (KV cache)" if row["kind"] == "group"
                     else "LlamaForCausalLM (random weights) generate(), eager")
        base = next((r for r in rows if r["decoder"] == base_name and r["batch_size"] == row["batch_size"]
                     and "new_tokens_per_s" in r), None)
        if base and "new_tokens_per_s" in row and row["kind"] != "reference":
            row["speedup_vs_" + ("t1" if row["kind"] == "group" else "llama_eager")] = (
                row["new_tokens_per_s"] / base["new_tokens_per_s"])

    result = save()
    print()
    print(markdown_table(result))
    log(f"wrote {args.out}")
    return 0


def markdown_table(result) -> str:
    def fmt(value, spec):
        return "–" if value is None else format(value, spec)

    def with_se(row, key, spec):  # the reference row and --seeds 1 have no SE
        se = row.get(key + "_se")
        return fmt(row.get(key), spec) + ("" if se is None else f" ± {se:{spec}}")

    lines = [
        f"{result['device']}, {result['dtype']}, {result['attn_implementation']}; prompts of {result['prompt_tokens']} "
        f"tokens, {result['new_tokens']} new tokens, sampling {result['sampling']}; {result['prompts']} held-out "
        f"prompts, {result['seeds']} seeds per decoder; quality under an independent {result['scorer']['preset']} AR "
        f"scorer ({result['scorer']['parameters']:,} parameters); forwards: model calls per decoding call",
        "",
        "| decoder | batch | new tokens/s | speed-up | forwards | draft acceptance | graphs compiled after warm-up "
        "| scorer ppl of output (± SE over seeds) | entropy (nats, ± SE) | distinct-1 | distinct-2 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        speedup = r.get("speedup_vs_t1", r.get("speedup_vs_llama_eager"))
        tag = " vs t=1" if "speedup_vs_t1" in r else (" vs Llama eager" if "speedup_vs_llama_eager" in r else "")
        if "error" in r:
            lines.append(f"| {r['decoder']} | {r['batch_size']} | failed: {r['error'][:80]} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['decoder']} | {r['batch_size']} | {fmt(r.get('new_tokens_per_s'), '.0f')} | "
            f"{fmt(speedup, '.2f')}{tag if speedup else ''} | {fmt(r.get('forwards'), '.0f')} | "
            f"{fmt(r.get('acceptance_rate'), '.2f')} | {fmt(r.get('graphs_compiled_after_warmup'), 'd')} | "
            f"{with_se(r, 'ar_perplexity', '.1f')} | {with_se(r, 'entropy', '.2f')} | "
            f"{fmt(r.get('distinct_1'), '.3f')} | {fmt(r.get('distinct_2'), '.3f')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
