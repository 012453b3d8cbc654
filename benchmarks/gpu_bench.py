"""GPU checks and throughput: LookAround objectives against plain Hugging Face models of the same size.

One call does everything (the device lease is short):
1. the gradient leak audit on CUDA for eager, SDPA and FlexAttention (flex has a backward pass on the GPU);
2. training-step throughput (tokens/s), model-FLOPs utilisation and peak memory, bf16 autocast,
   for Llama (causal) vs LookAround causal / two-stream AR / semi-AR, and BERT (masked LM) vs
   LookAround single-stream masked / two-stream masked with the query stream only at the targets;
3. the same two-stream step under torch.compile.

    python benchmarks/gpu_bench.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

import hf_lookaround as H
from hf_lookaround.leakcheck import audit_two_stream
from hf_lookaround.plans import make_plan


def audit_on_cuda() -> list[dict]:
    # the audit takes one backward per target from one graph (retain_graph); flex's compiled backward
    # donates its buffers unless told not to
    torch._functorch.config.donated_buffer = False
    rows = []
    torch.manual_seed(0)
    config = H.LookAroundConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=128, max_position_embeddings=256)
    lengths = [40, 33]
    ids = torch.randint(4, 97, (2, 40), device="cuda")
    mask = (torch.arange(40, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]).long()
    for impl in ["eager", "sdpa", "flex_attention"]:
        model = H.LookAroundForPreTraining(config).cuda().eval()
        model.set_attn_implementation(impl)
        for objective, params in [("ar", {}), ("dar", {"t": 2}), ("mlm", {"mask_ratio": 0.3}),
                                  ("gvp", {"num_groups": 5, "segmentation": "mixed"})]:
            plan = make_plan(objective, lengths, 40, generator=torch.Generator().manual_seed(1), **params)
            report = audit_two_stream(model, ids, mask, plan.group_ids.cuda(), plan.is_target.cuda())
            rows.append(dict(backend=impl, objective=objective, targets=report.targets_checked,
                             leaks=len(report.leaks), blind=len(report.blind), ok=report.ok))
    return rows


def flops_per_token(n_params_no_embed: int, layers: int, hidden: int, seq: int) -> float:
    # PaLM's estimate (App. B): 6N for the matmuls plus 12 L d T for attention scores and values
    return 6 * n_params_no_embed + 12 * layers * hidden * seq


def time_steps(model, make_batch, steps: int, warmup: int) -> tuple[float, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        batch = make_batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return seconds, torch.cuda.max_memory_allocated() / 2**30


def throughput(args) -> list[dict]:
    B, T, V = args.batch, args.seq, args.vocab
    d, L, nh, ff = args.hidden, args.layers, args.heads, args.intermediate
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (B, T), generator=gen).cuda()
    ones = torch.ones(B, T, dtype=torch.long, device="cuda")
    lengths = [T] * B

    def plan_batch(objective, **params):
        # plans are drawn once on the host and reused: the benchmark times the model, not the collator
        plan = make_plan(objective, lengths, T, generator=gen, **params)
        labels = torch.where(plan.is_target, ids.cpu(), -100).cuda()
        pad_to = math.ceil(0.15 * T) if objective == "mlm" else T
        targets = plan.target_positions(pad_to=pad_to).cuda()
        batch = dict(input_ids=ids, attention_mask=ones, group_ids=plan.group_ids.cuda(), labels=labels,
                     target_positions=targets)
        return lambda: batch

    mlm_plan = make_plan("mlm", lengths, T, mask_ratio=0.15, generator=gen)
    mlm_labels = torch.where(mlm_plan.is_target, ids.cpu(), -100).cuda()
    mlm_inputs = torch.where(mlm_plan.is_target.cuda(), 4, ids)

    llama_like = dict(vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=nh,
                      intermediate_size=ff, max_position_embeddings=T, tie_word_embeddings=True)
    bert_like = dict(vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=nh,
                     intermediate_size=ff, max_position_embeddings=T, norm_type="layernorm", norm_position="post",
                     hidden_act="gelu", position_embedding_type="absolute", attention_bias=True, mlp_bias=True)

    def lookaround(cls, impl, **cfg):
        model = cls(H.LookAroundConfig(**cfg, mask_token_id=4)).cuda().train()
        model.set_attn_implementation(impl)
        return model

    cases = [
        ("HF Llama causal LM", lambda: LlamaForCausalLM(LlamaConfig(**llama_like, attn_implementation="sdpa")),
         lambda: dict(input_ids=ids, labels=ids)),
        ("LookAround causal LM (sdpa)", lambda: lookaround(H.LookAroundForCausalLM, "sdpa", **llama_like),
         lambda: dict(input_ids=ids, labels=ids)),
        ("LookAround 2-stream AR (sdpa)", lambda: lookaround(H.LookAroundForPreTraining, "sdpa", **llama_like),
         plan_batch("ar")),
        ("LookAround 2-stream AR (flex)", lambda: lookaround(H.LookAroundForPreTraining, "flex_attention",
                                                             **llama_like), plan_batch("ar")),
        ("LookAround 2-stream semi-AR t=2 (flex)", lambda: lookaround(H.LookAroundForPreTraining, "flex_attention",
                                                                       **llama_like), plan_batch("dar", t=2)),
        ("HF BERT masked LM 0.15", lambda: BertForMaskedLM(BertConfig(
            vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=nh, intermediate_size=ff,
            max_position_embeddings=T, attn_implementation="sdpa")),
         lambda: dict(input_ids=mlm_inputs, labels=mlm_labels)),
        ("LookAround masked LM 0.15 (sdpa)", lambda: lookaround(H.LookAroundForMaskedLM, "sdpa", **bert_like),
         lambda: dict(input_ids=mlm_inputs, labels=mlm_labels)),
        ("LookAround 2-stream masked 0.15 (sdpa)", lambda: lookaround(H.LookAroundForPreTraining, "sdpa",
                                                                       **bert_like), plan_batch("mlm", mask_ratio=0.15)),
        ("LookAround 2-stream masked 0.15 (flex)", lambda: lookaround(H.LookAroundForPreTraining, "flex_attention",
                                                                       **bert_like), plan_batch("mlm", mask_ratio=0.15)),
    ]
    if args.compile:
        def compiled(cls, impl, **cfg):
            return lambda: torch.compile(lookaround(cls, impl, **cfg))

        cases += [
            ("LookAround 2-stream semi-AR t=2 (sdpa, compiled)",
             compiled(H.LookAroundForPreTraining, "sdpa", **llama_like), plan_batch("dar", t=2)),
            ("LookAround 2-stream masked 0.15 (sdpa, compiled)",
             compiled(H.LookAroundForPreTraining, "sdpa", **bert_like), plan_batch("mlm", mask_ratio=0.15)),
            ("LookAround causal LM (sdpa, compiled)", compiled(H.LookAroundForCausalLM, "sdpa", **llama_like),
             lambda: dict(input_ids=ids, labels=ids)),
            ("HF Llama causal LM (compiled)", lambda: torch.compile(
                LlamaForCausalLM(LlamaConfig(**llama_like, attn_implementation="sdpa")).cuda()),
             lambda: dict(input_ids=ids, labels=ids)),
            ("HF BERT masked LM 0.15 (compiled)", lambda: torch.compile(BertForMaskedLM(BertConfig(
                vocab_size=V, hidden_size=d, num_hidden_layers=L, num_attention_heads=nh, intermediate_size=ff,
                max_position_embeddings=T, attn_implementation="sdpa")).cuda()),
             lambda: dict(input_ids=mlm_inputs, labels=mlm_labels)),
        ]

    rows = []
    peak_tflops = args.peak_tflops
    for name, build, make_batch in cases:
        torch.cuda.empty_cache()
        model = None
        try:
            model = build().cuda().train()
            inner = getattr(model, "_orig_mod", model)
            n = sum(p.numel() for p in inner.parameters()) - inner.get_input_embeddings().weight.numel()
            seconds, peak_gib = time_steps(model, make_batch, args.steps, args.warmup)
            tokens_per_s = B * T / seconds
            mfu = tokens_per_s * flops_per_token(n, L, d, T) / (peak_tflops * 1e12)
            rows.append(dict(case=name, ms_per_step=1e3 * seconds, tokens_per_s=tokens_per_s, mfu=mfu,
                             peak_gib=peak_gib, params_no_embed=n))
        except Exception as error:  # report and go on: one failing case must not cost the whole lease
            rows.append(dict(case=name, error=f"{type(error).__name__}: {str(error)[:300]}"))
        print(rows[-1], flush=True)
        del model
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak_tflops", type=float, default=989.0, help="dense bf16 peak of the card (H100 SXM)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--skip_audit", action="store_true")
    parser.add_argument("--out", default="gpu_bench.json")
    args = parser.parse_args()

    device = torch.cuda.get_device_name()
    audit = []
    if not args.skip_audit:
        try:
            audit = audit_on_cuda()
        except Exception as error:
            audit = [dict(backend="-", objective="-", targets=0, leaks=-1, blind=-1, ok=False,
                          error=f"{type(error).__name__}: {str(error)[:300]}")]
    for row in audit:
        print(row, flush=True)
    rows = throughput(args)
    with open(args.out, "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, args=vars(args), audit=audit, throughput=rows), f,
                  indent=2)

    print(f"\n## {device}, torch {torch.__version__}, B={args.batch} T={args.seq} d={args.hidden} L={args.layers}")
    if audit:
        print("\n| backend | objective | targets | leaks | blind |\n| --- | --- | --- | --- | --- |")
        for r in audit:
            print(f"| {r['backend']} | {r['objective']} | {r['targets']} | {r['leaks']} | {r['blind']} |")
    print("\n| case | ms/step | tokens/s | MFU | peak GiB |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error'][:80]} | | | |")
        else:
            print(f"| {r['case']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
                  f"{r['peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
