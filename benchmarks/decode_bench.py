"""Decoding speed benchmark (issue 19): t = 1, group decoding, self-speculative decoding, compiled generate().

One model of about 110 M parameters (the ``base`` preset, 768 hidden, 12 layers, 32 000-token vocabulary), or the
checkpoint given with ``--checkpoint``. For each batch size (1 and 8) it decodes ``--new_tokens`` new tokens after
``--prompt_tokens``-token prompts with:

- ``t=1``: ``group_generate(group_size=1)``, AR decoding through the query stream (DynamicCache, eager);
- ``group t=2`` / ``t=4``: group decoding (fewer forwards, not the t = 1 tokens);
- ``speculative k=2`` / ``k=4``: self-speculative decoding (``draft_group_size=k``), the tokens of t = 1;
- the same group and speculative decoders through ``generate(..., cache_implementation="static")``: a StaticCache
  and fixed shapes, the decoding step compiled (on CUDA; eager on CPU), 0 graphs compiled after warm-up expected;
- since issue 41 a compiled group row (``group t=1/2/4``, ``one-stream t=2``) runs each step after the prompt's as
  one graph (forward, pick, EOS and the budget inside; one status read per step), as the speculative step does;
  ``--targets`` runs only the rows issue 41 compares in one call (compiled group t = 1, "speculative k=2, plain
  steps only", compiled group t = 2 and one-stream t = 2) and prints their ratios (``targets`` in the JSON):
  compiled t = 1 against the speculative path's plain step (asked: >= 1), t = 2 of both forms against compiled
  t = 1 (asked: >= 1.9);
- ``speculative k=2, plain steps only``: the speculative decoder whose schedule never speculates (a benchmark-only
  patch, :func:`never_speculate`): the prompt's forward, then only its compiled plain (t = 1) step; the row checks
  0 speculative steps and forwards == new tokens. ``speculative k=2, always falls back``
  (``speculation_break_even=inf``) is not that: it still probes with 8 speculative steps per 40, and drafts that
  random weights happen to accept make it faster than plain steps (issue 41's first measurement compared it);
- ``speculative k=2, no fallback``: the same with ``speculation_break_even=0`` (never a plain step), beside the
  default, which runs plain t = 1 steps while the drafts do not pay; both report their speculative / plain steps;
- ``generate() eager`` and ``generate() static+compile``: ``LookAroundForCausalLM.generate()`` without
  group_size, transformers' token-by-token loop (the compiled reference; transformers compiles a static cache's
  decoding step on CUDA only).

It times each decoder after a warm-up call on the same shapes, with CUDA synchronisation, median of ``--repeats``
calls, and reports new tokens/s, forwards, the acceptance rate of the drafts, whether the output equals t = 1's
(greedy: it must, for the speculative rows), and the perplexity of the continuations under the model's own AR
(t = 1) pathway. **With random weights (no --checkpoint) the acceptance rate and the perplexities mean nothing**:
the drafts of an untrained model are noise, so speculative decoding accepts few and is slower than t = 1; the
table says so. Give a checkpoint trained with t = 1, 2 and 4 in its mixture (``hf-lookaround pretrain --objective
dar --group_size 1 2 4``) for meaningful acceptance rates; its tokenizer encodes ``--prompts`` (text, one prompt
per line) if given, otherwise prompts are random token ids.

GPU:

    PYTHONPATH=src python benchmarks/decode_bench.py --output decode_bench.json
    PYTHONPATH=src python benchmarks/decode_bench.py --checkpoint runs/dar124 --prompts prompts.txt --output d.json

CPU smoke (tiny config, under a minute):

    PYTHONPATH=src python benchmarks/decode_bench.py --smoke --output /tmp/decode_smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import hf_lookaround as H
from hf_lookaround.decoding import group_generate, trained_group_sizes
from hf_lookaround.models.lookaround import speculation_lookaround

SIZES = (1, 2, 4)  # the group sizes the random model claims to have trained (every decoder below may run)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def build_model(args, device, dtype):
    """(LookAroundForPreTraining, LookAroundForCausalLM sharing its weights, tokenizer or None, note)."""
    if args.checkpoint:
        from transformers import AutoTokenizer

        model = H.LookAroundForPreTraining.from_pretrained(args.checkpoint, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        note = f"checkpoint {args.checkpoint} (trained group sizes {list(trained_group_sizes(model.config) or [])})"
    else:
        if args.smoke:
            config = H.LookAroundConfig.from_preset("tiny", vocab_size=300, max_position_embeddings=128)
        else:
            config = H.LookAroundConfig.from_preset(args.preset, vocab_size=args.vocab_size,
                                                    max_position_embeddings=1024)
        config.objective, config.plan_params = "dar", {"t": list(SIZES)}
        torch.manual_seed(0)
        model = H.LookAroundForPreTraining(config).to(device=device, dtype=dtype).eval()
        tokenizer = None
        note = "random weights: acceptance rates and perplexities mean nothing (pass --checkpoint)"
    causal = H.LookAroundForCausalLM(model.config).to(device=device, dtype=dtype).eval()
    causal.load_state_dict(model.state_dict())
    causal.generation_config.eos_token_id = None  # every decoder emits exactly new_tokens
    causal.generation_config.pad_token_id = model.config.pad_token_id
    params = sum(p.numel() for p in model.parameters())
    return model, causal, tokenizer, note, params


def make_prompts(args, model, tokenizer, batch, device) -> torch.Tensor:
    """(batch, prompt_tokens) ids starting with BOS, all of one length (no padding, so that batch 1 and 8 compare)."""
    config = model.config
    if tokenizer is not None and args.prompts:
        lines = [line for line in Path(args.prompts).read_text(encoding="utf-8").splitlines() if line.strip()]
        rows = []
        for i in range(batch):
            ids = tokenizer(lines[i % len(lines)], add_special_tokens=False)["input_ids"][: args.prompt_tokens - 1]
            ids = ids + ids[-1:] * (args.prompt_tokens - 1 - len(ids))  # too short: repeat the last token
            rows.append([config.bos_token_id] + ids)
        return torch.tensor(rows, device=device)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, config.vocab_size, (batch, args.prompt_tokens), generator=generator)
    ids[:, 0] = config.bos_token_id
    return ids.to(device)


@torch.no_grad()
def ar_perplexity(model, sequences: torch.Tensor, prompt_len: int) -> float:
    """Perplexity of the continuation under the model's own AR pathway (query stream, plan g[i] = i)."""
    batch, length = sequences.shape
    group_ids = torch.arange(length, device=sequences.device).expand(batch, length)
    targets = torch.arange(prompt_len, length, device=sequences.device).expand(batch, -1)
    logits = model(input_ids=sequences, group_ids=group_ids, target_positions=targets).logits.float()
    nll = -torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)
    return float(torch.exp(nll.mean()))


def llama_like(config, dtype, device, attn="sdpa"):
    """A ``LlamaForCausalLM`` of the same size (hidden, layers, heads, intermediate, vocabulary), random weights:
    the Hugging Face reference for speed (its text says nothing); it emits exactly max_new_tokens (no EOS).
    ``generation_bench.py`` uses it too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta, tie_word_embeddings=True,
        pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id, eos_token_id=None,
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM._from_config(llama_config, dtype=dtype, attn_implementation=attn).to(device).eval()
    llama.generation_config.eos_token_id = None
    llama.generation_config.pad_token_id = config.pad_token_id
    return llama


def decoders(model, causal, args):
    """name -> (kind, decode(prompts) -> (sequences, info)); kind says eager or compiled."""
    common = dict(max_new_tokens=args.new_tokens, eos_token_id=[], do_sample=args.do_sample)

    def group(t):
        def decode(prompts):
            out = group_generate(model, prompts, group_size=t, generator=torch.Generator(prompts.device).manual_seed(0),
                                 **common)
            return out, {"forwards": -(-args.new_tokens // t)}
        return decode

    def speculative(k):
        def decode(prompts):
            out = group_generate(model, prompts, draft_group_size=k, return_dict_in_generate=True,
                                 generator=torch.Generator(prompts.device).manual_seed(0), **common)
            return out.sequences, {"forwards": out.num_forwards, **speculation_info(out)}
        return decode

    def hf(static, lm=causal):
        def decode(prompts):
            torch.manual_seed(0)
            kwargs = {"cache_implementation": "static"} if static else {}
            out = lm.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                                  do_sample=args.do_sample, **kwargs)
            return out, {"forwards": args.new_tokens}
        return decode

    def static(**decoder):
        def decode(prompts):
            torch.manual_seed(0)
            out = causal.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                                  do_sample=args.do_sample, cache_implementation="static", return_dict_in_generate=True,
                                  **decoder)
            info = {"forwards": getattr(out, "num_forwards", None) or -(-args.new_tokens // decoder.get("group_size", 1))}
            if hasattr(out, "acceptance_rate"):
                info.update(speculation_info(out))
            return out.sequences, info
        return decode

    compiled = compiled_label(args)
    table = {"t=1": ("eager", group(1))}
    for t in (2, 4):
        table[f"group t={t}"] = ("eager", group(t))
    for k in (2, 4):
        table[f"speculative k={k}"] = ("eager", speculative(k))
    if not args.no_compile:
        for t in (1, 2, 4):
            table[f"group t={t} ({compiled})"] = (compiled, static(group_size=t))
        for k in (2, 4):
            table[f"speculative k={k} ({compiled})"] = (compiled, static(draft_group_size=k))
            if k == 2:  # the same without falling back to plain steps: what speculation alone costs or gains
                table[f"speculative k=2, no fallback ({compiled})"] = (
                    compiled, static(draft_group_size=2, speculation_break_even=0.0))
                # every window below break-even: the schedule zero acceptance gets (a window of 8 speculative
                # probes, then 32 plain steps, and again); drafts that happen to be accepted still speed it up
                table[f"speculative k=2, always falls back ({compiled})"] = (
                    compiled, static(draft_group_size=2, speculation_break_even=float("inf")))
                # the speculative path's plain (t = 1) step alone, whatever the drafts are worth: issue 41's
                # reference for compiled group t = 1
                table[f"speculative k=2, plain steps only ({compiled})"] = (
                    compiled, plain_steps_only(static(draft_group_size=2), args.new_tokens))
    # dar's one-stream form (SAT): the same weights as a block-causal LM, a group of t rows per forward
    one = one_stream_twin(causal)

    def one_stream(t, static_cache):
        def decode(prompts):
            kwargs = {"cache_implementation": "static"} if static_cache else {}
            out = one.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.new_tokens,
                               do_sample=args.do_sample, group_size=t, **kwargs)
            return out, {"forwards": -(-args.new_tokens // t)}
        return decode

    table["one-stream t=2"] = ("eager", one_stream(2, False))
    if not args.no_compile:
        table[f"one-stream t=2 ({compiled})"] = (compiled, one_stream(2, True))
    table["generate() eager"] = ("eager", hf(False))
    if not args.no_compile:
        table["generate() static+compile"] = (compiled, hf(True))
        if not args.decoders or "Llama generate() static+compile" in args.decoders:  # a second model: only if asked
            table["Llama generate() static+compile"] = (compiled, hf(True, llama_like(model.config, causal.dtype,
                                                                                     causal.device)))
    if args.decoders:
        unknown = [name for name in args.decoders if name not in table]
        if unknown:
            raise SystemExit(f"--decoders: unknown {unknown}; choose from {list(table)}")
        table = {name: table[name] for name in ["t=1", *args.decoders]}  # t=1 stays: the reference tokens
    return table


@contextlib.contextmanager
def never_speculate():
    """Benchmark only: while inside, the self-speculative decoder's schedule never speculates, so every step after
    the prompt's forward is its plain (t = 1) step. No public option does this: ``speculation_break_even`` only
    decides after a window of speculative steps, whose drafts random weights partly accept."""
    class PlainOnly(speculation_lookaround._SpeculationSchedule):
        speculate = property(lambda self: False)

    with mock.patch.object(speculation_lookaround, "_SpeculationSchedule", PlainOnly):
        yield


def plain_steps_only(decode, new_tokens: int):
    """``decode`` (a speculative row) under :func:`never_speculate`, checked: no speculative step, and one forward
    per new token (the prompt's, then one plain step per token), else the row fails."""
    def run(prompts):
        with never_speculate():
            out, info = decode(prompts)
        if info["speculative_steps"] or info["forwards"] != new_tokens:
            raise RuntimeError(f"plain steps only: {info['speculative_steps']} speculative steps and "
                               f"{info['forwards']} forwards for {new_tokens} new tokens (expected 0 and {new_tokens})")
        return out, info
    return run


# issue 41's decoding rows, timed in one call: (name of the ratio, row, row it is divided by, the ratio asked for);
# {c} is how the compiled rows are labelled ("static+compile" on CUDA)
TARGETS = (
    ("compiled group t=1 / speculative k=2 plain steps only", "group t=1 ({c})",
     "speculative k=2, plain steps only ({c})", 1.0),
    ("compiled group t=2 / compiled group t=1", "group t=2 ({c})", "group t=1 ({c})", 1.9),
    ("compiled one-stream t=2 / compiled group t=1", "one-stream t=2 ({c})", "group t=1 ({c})", 1.9),
)


def compiled_label(args) -> str:
    """How the static-cache rows are labelled: compiled on CUDA, eager on CPU (as transformers decides)."""
    return "static+compile" if torch.cuda.is_available() and not args.smoke else "static, eager on CPU"


def target_rows(compiled: str) -> list[str]:
    return list(dict.fromkeys(name.format(c=compiled) for _, *rows, _ in TARGETS for name in rows))


def target_ratios(rows, compiled: str) -> list[dict]:
    """Each of :data:`TARGETS` per batch size, from rows of one call (None where a row is missing or failed)."""
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        speed = {r["decoder"]: r["new_tokens_per_s"] for r in rows if r["batch"] == batch and "error" not in r}
        for name, row, base, asked in TARGETS:
            row, base = row.format(c=compiled), base.format(c=compiled)
            ratio = speed[row] / speed[base] if row in speed and base in speed else None
            out.append({"ratio": name, "batch": batch, "value": ratio, "asked": asked,
                        "met": None if ratio is None else ratio >= asked})
    return out


def speculation_info(out) -> dict:
    """How the drafts fared, and how many steps speculated or ran plain (t = 1) while speculation did not pay."""
    rate = out.acceptance_rate  # NaN when nothing was drafted (plain steps only): null in the JSON, "–" in the table
    return {"acceptance_rate": None if math.isnan(rate) else rate, "speculative_steps": out.num_speculative_steps,
            "plain_steps": out.num_plain_steps}


def one_stream_twin(causal):
    """A block-causal (dar one-stream, t = 2) LookAroundForCausalLM with the weights of ``causal``."""
    config = causal.config.__class__(**{**causal.config.to_dict(), "default_attention": "block_causal",
                                        "attention_group_size": 2, "prediction_stream": "content"})
    config.plan_params = {"t": 2}
    one = H.LookAroundForCausalLM(config).to(device=causal.device, dtype=causal.dtype).eval()
    one.load_state_dict(causal.state_dict())
    one.generation_config.eos_token_id = None
    one.generation_config.pad_token_id = config.pad_token_id
    return one


def time_decoder(decode, prompts, device, repeats):
    decode(prompts)  # warm-up on the very shapes that are timed (compiles, allocator)
    synchronize(device)
    graphs = graphs_compiled()
    times, out, info = [], None, {}
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        out, info = decode(prompts)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return out, info, statistics.median(times), graphs_compiled() - graphs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="JSON file to write (after every row)")
    p.add_argument("--checkpoint", default=None, help="a LookAround checkpoint (trained with t=1,2,4 for all rows)")
    p.add_argument("--prompts", default=None, help="with --checkpoint: a text file, one prompt per line")
    p.add_argument("--preset", default="base", help="model size without --checkpoint (base: ~110 M parameters)")
    p.add_argument("--vocab_size", type=int, default=32000)
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt_tokens", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--do_sample", action="store_true", help="sample (default greedy: speculative == t=1 is checked)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no_compile", action="store_true", help="skip the static-cache (compiled) rows")
    p.add_argument("--decoders", nargs="+", default=None, help="only these rows (and t=1), by name as in the table")
    p.add_argument("--smoke", action="store_true", help="tiny config on CPU, a few tokens: checks the script runs")
    p.add_argument("--targets", action="store_true",
                   help="only issue 41's decoding rows (compiled group t=1 and t=2, one-stream t=2, speculative k=2 "
                        "plain steps only), in one call, and their ratios")
    args = p.parse_args(argv)
    if args.targets:
        if args.decoders or args.no_compile:
            raise SystemExit("--targets chooses the rows (compiled): drop --decoders / --no_compile")
        args.decoders = target_rows(compiled_label(args))
    if args.smoke:
        args.batch_sizes, args.prompt_tokens, args.new_tokens, args.repeats = [1, 2], 6, 8, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # every decoder and batch size compiles its own graphs of one step function (2 each): above dynamo's default
    # limit of 8 it would silently fall back to eager
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model, causal, tokenizer, note, params = build_model(args, device, dtype)
    result = {
        "note": note, "parameters": params, "device": torch.cuda.get_device_name() if device.type == "cuda" else
        platform.processor() or "cpu", "dtype": str(dtype), "torch": torch.__version__,
        "transformers": __import__("transformers").__version__, "args": vars(args), "rows": [],
    }
    print(f"# {params / 1e6:.1f} M parameters on {result['device']}, {dtype}; {note}", flush=True)
    table = decoders(model, causal, args)  # once: the same decoders (and Llama) serve every batch size
    for batch in args.batch_sizes:
        prompts = make_prompts(args, model, tokenizer, batch, device)
        reference = None
        for name, (kind, decode) in table.items():
            try:
                out, info, seconds, graphs = time_decoder(decode, prompts, device, args.repeats)
            except Exception as error:  # noqa: BLE001 - one failed row must not lose the others
                row = {"decoder": name, "batch": batch, "error": f"{type(error).__name__}: {error}"}
                print(f"  {name} batch {batch}: {row['error']}", flush=True)
                result["rows"].append(row)
                continue
            made = out.shape[1] - prompts.shape[1]
            if name == "t=1":
                reference = out
            row = {
                "decoder": name, "kind": kind, "batch": batch, "seconds": seconds,
                "new_tokens_per_s": batch * made / seconds, **info,
                "graphs_compiled_after_warmup": graphs,
                "equals_t1": bool(reference is not None and torch.equal(out, reference)),
                # under the decoded model's own AR pathway; Llama's random-weight text is not scored
                "ar_perplexity": None if name.startswith("Llama") else ar_perplexity(model, out, prompts.shape[1]),
            }
            base = next((r for r in result["rows"] if r["decoder"] == "t=1" and r["batch"] == batch), row)
            row["speedup_vs_t1"] = row["new_tokens_per_s"] / base["new_tokens_per_s"]
            compiled_t1 = next((r for r in result["rows"] if r["decoder"].startswith("group t=1 (")
                                and r["batch"] == batch and "error" not in r), None)
            if compiled_t1 is not None:
                row["speedup_vs_compiled_t1"] = row["new_tokens_per_s"] / compiled_t1["new_tokens_per_s"]
            result["rows"].append(row)
            print(f"  {name} batch {batch}: {row['new_tokens_per_s']:.0f} new tokens/s", flush=True)
            Path(args.output).write_text(json.dumps(result, indent=2))
    result["targets"] = target_ratios(result["rows"], compiled_label(args))
    print(markdown_table(result))
    Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


def markdown_table(result) -> str:
    def fmt(value, spec):
        return "–" if value is None else format(value, spec)

    lines = [
        f"{result['note']}; {result['parameters'] / 1e6:.1f} M parameters, {result['device']}, {result['dtype']}",
        "",
        "| decoder | kind | batch | new tokens/s | vs t=1 | vs compiled t=1 | forwards | acceptance "
        "| speculative / plain steps | = t=1 tokens | graphs after warm-up | AR ppl |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['decoder']} | – | {r['batch']} | {r['error'][:200]} | | | | | | | | |")
            continue
        steps = f"{r['speculative_steps']} / {r['plain_steps']}" if "plain_steps" in r else "–"
        lines.append(
            f"| {r['decoder']} | {r['kind']} | {r['batch']} | {r['new_tokens_per_s']:.0f} | "
            f"{r['speedup_vs_t1']:.2f} | {fmt(r.get('speedup_vs_compiled_t1'), '.2f')} | {r['forwards']} | {fmt(r.get('acceptance_rate'), '.2f')} | "
            f"{steps} | "
            f"{'yes' if r['equals_t1'] else 'no'} | {r['graphs_compiled_after_warmup']} | {fmt(r['ar_perplexity'], '.1f')} |"
        )
    targets = [t for t in result.get("targets", []) if t["value"] is not None]
    if targets:
        lines += ["", "| ratio (same call) | batch | value | asked | met |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {t['ratio']} | {t['batch']} | {t['value']:.2f} | >= {t['asked']} | {'yes' if t['met'] else 'no'} |"
                  for t in targets]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
