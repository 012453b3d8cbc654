"""GPU checks and throughput: LookAround objectives against plain Hugging Face models of the same size.

One call runs everything (the device lease is short), in this order, each section optional with ``--only``:

1. ``long``: two-stream semi-AR (t=2) compiled against compiled ``LlamaForCausalLM`` at T = 1024, 4096, 8192
   with 16k tokens per step, SDPA and FlexAttention (the long-context rows decide what ``lookaround_auto`` picks);
2. ``masked``: two-stream masked 0.15 compiled against ``BertForMaskedLM``, eager and compiled;
3. ``audit``: the gradient leak audit (``hf_lookaround.leakcheck``) on the device for eager, SDPA, FlexAttention
   and the compiled step with masks prepared outside the graph (SDPA and FlexAttention), every objective;
4. ``collator``: collator time per batch (B = 16 and 64, T = 1024) as a fraction of the compiled step time
   (``collator_times`` from ``benchmarks/collator_bench.py``, if that file exists);
5. ``grid``: every objective (ar, dar, mlm, vmlm, gvp) compiled, Llama-like and BERT-like config, SDPA and
   FlexAttention, each against the plain HF model of its family (eager and compiled) from the same run.

Method (the same for every row): a training step is forward, backward and a fused AdamW step under bf16 autocast;
``--warmup`` untimed steps (compilation happens there and is reported separately), then ``--steps`` timed ones,
mean time per step. For a two-stream model the masks are built every step from the batch
(``model.prepare_attention``) outside the compiled graph and inside the timed region. Plans are drawn on the host
once per row: this times the model, not the collator. tokens/s counts input tokens (B x T); MFU uses PaLM's
6 N + 12 L d T FLOPs per input token (N without embeddings) for every row, so it credits no row for extra
query-stream rows. Compiled means ``torch.compile(model, dynamic=False)``: every shape compiles a static graph.
A row that fails is recorded with its error; a row that would start after ``--budget_s`` is recorded as not run.

    python benchmarks/gpu_bench.py --out gpu_bench.json            # everything, one GPU (about 8 minutes)
    python benchmarks/gpu_bench.py --only long,masked --out x.json # some sections
    python benchmarks/gpu_bench.py --smoke --out smoke.json        # tiny CPU run of every code path
    python benchmarks/gpu_bench.py --report gpu_bench.json         # the docs tables from a JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

from hf_lookaround import objectives

# in the order they run: the targets first, the long grid last (a row past --budget_s is not run)
SECTIONS = ("long", "masked", "audit", "collator", "grid")
OBJECTIVES = ("ar", "dar", "mlm", "vmlm", "gvp")
PLAN_PARAMS = {"ar": {}, "dar": {"t": 2}, "mlm": {"mask_ratio": 0.15}, "vmlm": {"mask_ratio_range": (0.15, 0.3)},
               "gvp": {"num_groups": 20, "segmentation": "mixed"}}
OBJECTIVE_NAMES = {"ar": "AR", "dar": "semi-AR t=2", "mlm": "masked 0.15", "vmlm": "var. masked [0.15, 0.3]",
                   "gvp": "GVP K=20"}
# dense bf16 peak (TFLOP/s) by card name; --peak_tflops overrides
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


GVP_WIDTH_MULTIPLE = 256


def content_width(objective: str, seq_len: int) -> int | str | None:
    """Width of the content rows kept by `drop_unread_content` (None: nothing worth dropping).

    Masked plans: the objective's bound on the rows a sequence keeps (``objectives.max_content_rows``: its masked
    tokens, the top rank, feed no prediction). GVP: the top group ranges from one token to most of the sequence, so
    the width is the batch's own, rounded up to a multiple of GVP_WIDTH_MULTIPLE (a training run compiles at most
    T / 256 graphs)."""
    if objective == "gvp":
        return f"x{GVP_WIDTH_MULTIPLE}"
    return objectives.max_content_rows(objective, seq_len, **PLAN_PARAMS[objective])


def target_width(objective: str, seq_len: int) -> int:
    """Static width of target_positions: the largest count the plan can draw (``objectives.max_targets``)."""
    return objectives.max_targets(objective, seq_len, **PLAN_PARAMS[objective])


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.device.type == "cuda"
        self.start = time.perf_counter()
        self.rows: list[dict] = []
        self.results: dict = {}  # key -> row, so a measurement serves several tables
        name = torch.cuda.get_device_name() if self.cuda else "cpu"
        self.device_name = name
        self.peak_tflops = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 989.0)
        if args.smoke:
            self.sizes = dict(vocab=97, hidden=32, layers=2, heads=2, intermediate=64, seq=64, batch=2,
                              long_seqs=(64, 128), tokens_per_step=256)
        else:
            self.sizes = dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                              intermediate=args.intermediate, seq=args.seq, batch=args.batch,
                              long_seqs=tuple(int(t) for t in args.long_seqs.split(",")), tokens_per_step=16384)
        # one graph per shape and model: allow many (the names changed across torch versions)
        for name, value in [("cache_size_limit", 64), ("recompile_limit", 64), ("accumulated_cache_size_limit", 512),
                            ("accumulated_recompile_limit", 512)]:
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, value)
        self.compile_kwargs = dict(dynamic=False)
        if args.smoke and not self.cuda:
            # inductor's CPU code generation takes minutes per graph on two cores; aot_eager still traces the
            # whole step (graph breaks and dynamo errors show) and runs AOTAutograd's backward
            self.compile_kwargs["backend"] = args.smoke_backend
        # the audit's models are tiny: always the whole forward in one graph
        self.audit_compile_kwargs = dict(self.compile_kwargs, fullgraph=True)

    # ------------------------------------------------------------------ bookkeeping
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def out_of_time(self) -> bool:
        return self.elapsed() > self.args.budget_s

    def record(self, row: dict) -> dict:
        row.setdefault("elapsed_s", round(self.elapsed(), 1))
        self.rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        self.save()  # after every row: a run cut short still leaves its rows
        return row

    def summary(self) -> dict:
        import transformers

        args = self.args
        return dict(device=self.device_name, torch=torch.__version__, transformers=transformers.__version__,
                    sizes=dict(self.sizes), steps=2 if args.smoke else args.steps,
                    warmup=1 if args.smoke else args.warmup, peak_tflops=self.peak_tflops, args=vars(args),
                    compile={k: str(v) for k, v in self.compile_kwargs.items()}, total_s=self.elapsed(),
                    rows=self.rows)

    def save(self) -> dict:
        data = self.summary()
        with open(self.args.out, "w") as f:
            json.dump(data, f, indent=1)
        return data

    # ------------------------------------------------------------------ models
    def configs(self, seq_len: int):
        s = self.sizes
        common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], intermediate_size=s["intermediate"],
                      max_position_embeddings=seq_len)
        llama = dict(common, tie_word_embeddings=True)
        bert = dict(common, norm_type="layernorm", norm_position="post", hidden_act="gelu",
                    position_embedding_type="absolute", attention_bias=True, mlp_bias=True)
        return {"llama": llama, "bert": bert}

    def lookaround(self, config_name: str, impl: str, seq_len: int, cls_name: str = "LookAroundForPreTraining"):
        import hf_lookaround as H

        torch.manual_seed(0)
        config = H.LookAroundConfig(**self.configs(seq_len)[config_name], mask_token_id=4)
        model = getattr(H, cls_name)(config).to(self.device).train()
        model.set_attn_implementation(impl)
        return model

    def hf_model(self, family: str, seq_len: int):
        from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        s = self.sizes
        if family == "llama":
            model = LlamaForCausalLM(LlamaConfig(**self.configs(seq_len)["llama"], attn_implementation="sdpa"))
        else:
            model = BertForMaskedLM(BertConfig(
                vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"], intermediate_size=s["intermediate"], max_position_embeddings=seq_len,
                attn_implementation="sdpa"))
        return model.to(self.device).train()

    def compiled(self, model):
        """`--compile full`: the whole model in one graph. `regional` (PyTorch's regional compilation): each
        transformer layer compiled on its own; the identical layers share one graph, so a shape compiles in
        seconds instead of a minute; embeddings, LM head and loss stay eager. The same for every model."""
        if self.args.compile == "full":
            return torch.compile(model, **self.compile_kwargs)
        layers = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
        for layer in layers:
            layer.compile(**self.compile_kwargs)
        return model

    # ------------------------------------------------------------------ batches
    def two_stream_batch(self, objective: str, batch: int, seq_len: int, seed: int = 0):
        from hf_lookaround.objectives import make_plan

        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, self.sizes["vocab"], (batch, seq_len), generator=gen)
        plan = make_plan(objective, [seq_len] * batch, seq_len, generator=gen, **PLAN_PARAMS[objective])
        labels = torch.where(plan.is_target, ids, -100)
        targets = plan.target_positions(pad_to=target_width(objective, seq_len))
        tensors = dict(input_ids=ids, attention_mask=torch.ones_like(ids), group_ids=plan.group_ids, labels=labels,
                       target_positions=targets)
        return {k: v.to(self.device) for k, v in tensors.items()}

    def causal_batch(self, batch: int, seq_len: int):
        ids = torch.randint(5, self.sizes["vocab"], (batch, seq_len), generator=torch.Generator().manual_seed(0))
        ids = ids.to(self.device)
        return dict(input_ids=ids, labels=ids)

    def masked_lm_batch(self, batch: int, seq_len: int):
        from hf_lookaround.objectives import make_plan

        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(5, self.sizes["vocab"], (batch, seq_len), generator=gen)
        plan = make_plan("mlm", [seq_len] * batch, seq_len, generator=gen, mask_ratio=0.15)
        inputs = torch.where(plan.is_target, 4, ids)
        return dict(input_ids=inputs.to(self.device), labels=torch.where(plan.is_target, ids, -100).to(self.device))

    # ------------------------------------------------------------------ timing
    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_training(self, model, run, batch: dict, seq_len: int, prepare=None, train=True) -> dict:
        """Warm-up (compiles) then timed steps; `prepare(batch)` gives the model's inputs in every step (the
        two-stream masks, built outside the graph), timed."""
        args = self.args
        steps, warmup = (2, 1) if args.smoke else (args.steps, args.warmup)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=self.cuda) if train else None
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else torch.autocast("cpu", enabled=False)
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

        def step():
            inputs = prepare(batch) if prepare else batch
            with autocast, torch.set_grad_enabled(train):
                loss = run(**inputs).loss
            if train:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return loss

        t0 = time.perf_counter()
        for _ in range(warmup):
            loss = step()
        self.sync()
        warmup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        self.sync()
        seconds = (time.perf_counter() - t0) / steps
        inner = getattr(model, "_orig_mod", model)
        s = self.sizes
        n = sum(p.numel() for p in inner.parameters()) - inner.get_input_embeddings().weight.numel()
        tokens = batch["input_ids"].numel()  # the batch's tokens, whatever the model's inputs were made of
        tokens_per_s = tokens / seconds
        flops = 6 * n + 12 * s["layers"] * s["hidden"] * seq_len
        return dict(ms_per_step=round(1e3 * seconds, 2), tokens_per_s=round(tokens_per_s), warmup_s=round(warmup_s, 1),
                    mfu=round(tokens_per_s * flops / (self.peak_tflops * 1e12), 4),
                    peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if self.cuda else None,
                    loss=round(float(loss.detach()), 4), params_no_embed=n, train=train)

    def measure(self, key: str, section: str, case: str, build, batch_of, seq_len: int, two_stream: bool,
                baselines=(), content_width=None, **info) -> dict | None:
        """One row; measured once per key (another table reuses it)."""
        if key in self.results:
            row = dict(self.results[key], section=section, baselines=list(baselines), reused=True)
            return self.record(row)
        row = dict(section=section, key=key, case=case, seq=seq_len, baselines=list(baselines), **info)
        if self.out_of_time():
            row["error"] = f"not run: time budget of {self.args.budget_s:.0f} s spent"
            self.results[key] = row
            return self.record(row)
        model = None
        try:
            model, run = build()
            batch = batch_of()
            row["batch"] = batch["input_ids"].shape[0]
            prepare = None
            inner = getattr(model, "_orig_mod", model)
            if two_stream:
                from hf_lookaround.training.unread_content import drop_unread_content

                def prepare(b):
                    if isinstance(content_width, int):  # the content rows no prediction reads are not computed
                        b = drop_unread_content(b, content_width)
                    elif content_width is not None:  # "x256": the batch's width rounded up to a multiple of 256
                        b = drop_unread_content(b, width_multiple=int(content_width[1:]))
                    return dict(b, prepared_attention=inner.prepare_attention(**b))
            # FlexAttention has no backward on the CPU: the smoke run times its forward only
            train = not (not self.cuda and info.get("backend") == "flex_attention")
            row.update(self.time_training(model, run, batch, seq_len, prepare, train))
            if two_stream:
                inputs = prepare(batch)
                row["content_rows"] = inputs["input_ids"].shape[1]  # what the model ran (T unless some were dropped)
                mask = inputs["prepared_attention"].mask
                if hasattr(mask, "sparsity"):
                    row["block_sparsity_pct"] = round(float(mask.sparsity()), 1)
        except Exception as error:  # one failing row must not cost the others
            row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            row["traceback"] = traceback.format_exc()[-2000:]
        finally:
            del model
            if self.cuda:
                torch.cuda.empty_cache()
        self.results[key] = row
        return self.record(row)

    # ------------------------------------------------------------------ sections
    def hf_row(self, section: str, family: str, compiled: bool, batch: int, seq_len: int):
        name = {"llama": "HF LlamaForCausalLM", "bert": "HF BertForMaskedLM 0.15"}[family]
        case = f"{name} ({'compiled' if compiled else 'eager'})"
        key = f"hf/{family}/{'compiled' if compiled else 'eager'}/B{batch}/T{seq_len}"

        def build():
            torch._dynamo.reset()  # a new model: drop the graphs of the last one
            model = self.hf_model(family, seq_len)
            return model, (self.compiled(model) if compiled else model)

        batch_of = (lambda: self.causal_batch(batch, seq_len)) if family == "llama" else \
            (lambda: self.masked_lm_batch(batch, seq_len))
        return self.measure(key, section, case, build, batch_of, seq_len, False, model="hf", family=family,
                            compiled=compiled, backend="sdpa")

    def two_stream_row(self, section, config_name, impl, objective, batch, seq_len, baselines, model_cache,
                       drop_unread=False):
        backend = {"flex_attention": "flex"}.get(impl, impl)
        width = content_width(objective, seq_len) if drop_unread else None
        rows = f"{width} content rows" if isinstance(width, int) else f"content rows to a multiple of {str(width)[1:]}"
        case = f"LookAround 2-stream {OBJECTIVE_NAMES[objective]} ({backend}, compiled" + (f", {rows})" if width else ")")
        key = f"la/{config_name}/{impl}/{objective}/B{batch}/T{seq_len}" + (f"/W{width}" if width else "")

        def build():
            # one compiled model per (config, kernel, shape family): objectives of the same shapes share its graph
            cache_key = (config_name, impl, seq_len)
            if cache_key not in model_cache:
                model_cache.clear()
                torch._dynamo.reset()
                model = self.lookaround(config_name, impl, seq_len)
                model_cache[cache_key] = (model, self.compiled(model))
            return model_cache[cache_key]

        return self.measure(key, section, case, build, lambda: self.two_stream_batch(objective, batch, seq_len),
                            seq_len, True, baselines, content_width=width, model="lookaround", family=config_name,
                            objective=objective, compiled=True, backend=impl)

    def section_audit(self):
        from hf_lookaround.leakcheck import audit_two_stream
        from hf_lookaround.objectives import make_plan
        import hf_lookaround as H

        # the audit takes one backward per target from one graph (retain_graph); compiled backward graphs
        # donate their buffers unless told not to
        torch._functorch.config.donated_buffer = False
        torch.manual_seed(0)
        config = H.LookAroundConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=128, max_position_embeddings=64)
        lengths, seq_len = [40, 33], 40
        ids = torch.randint(4, 97, (2, seq_len), device=self.device)
        mask = (torch.arange(seq_len, device=self.device)[None] < torch.tensor(lengths, device=self.device)[:, None])
        backends = [("eager", False), ("sdpa", False), ("flex_attention", False), ("sdpa", True),
                    ("flex_attention", True)]
        for impl, compiled in backends:
            model = H.LookAroundForPreTraining(config).to(self.device).eval()
            model.set_attn_implementation(impl)
            # one compiled wrapper per kernel: every objective's batch has the same shapes, so one graph serves all
            compiled_model = torch.compile(model, **self.audit_compile_kwargs) if compiled else None
            for objective in OBJECTIVES:
                params = dict(PLAN_PARAMS[objective])
                if objective == "gvp":
                    params["num_groups"] = 5
                row = dict(section="audit", backend=impl, compiled=compiled, objective=objective)
                if not self.cuda and impl == "flex_attention":
                    row["error"] = "not run: FlexAttention has no backward on the CPU (tests check its forward)"
                    self.record(row)
                    continue
                try:
                    plan = make_plan(objective, lengths, seq_len, generator=torch.Generator().manual_seed(1), **params)
                    report = audit_two_stream(model, ids, mask.long(), plan.group_ids.to(self.device),
                                              plan.is_target.to(self.device), compiled=compiled,
                                              compiled_model=compiled_model)
                    row.update(targets=report.targets_checked, leaks=len(report.leaks), blind=len(report.blind),
                               ok=report.ok)
                except Exception as error:
                    row.update(error=f"{type(error).__name__}: {str(error)[:400]}", ok=False,
                               traceback=traceback.format_exc()[-2000:])
                self.record(row)

    def section_long(self):
        tokens = self.sizes["tokens_per_step"]
        for seq_len in self.sizes["long_seqs"]:
            batch = max(1, tokens // seq_len)
            base = self.hf_row("long", "llama", True, batch, seq_len)
            cache = {}
            for impl in ("sdpa", "flex_attention"):
                self.two_stream_row("long", "llama", impl, "dar", batch, seq_len, [base["key"]], cache)

    def section_masked(self):
        B, T = self.sizes["batch"], self.sizes["seq"]
        eager = self.hf_row("masked", "bert", False, B, T)
        compiled = self.hf_row("masked", "bert", True, B, T)
        cache = {}
        for impl in self.args.masked_kernels.split(","):
            for drop in (False, True):
                self.two_stream_row("masked", "bert", impl, "mlm", B, T, [eager["key"], compiled["key"]], cache, drop)

    def section_grid(self):
        B, T = self.sizes["batch"], self.sizes["seq"]
        for family in ("llama", "bert"):
            baselines = [self.hf_row("grid", family, False, B, T)["key"], self.hf_row("grid", family, True, B, T)["key"]]
            for impl in self.args.grid_kernels.split(","):
                cache = {}
                # objectives grouped by input shapes so that each compiled graph serves several in a row
                for objective in ("ar", "dar", "gvp", "mlm", "vmlm"):
                    self.two_stream_row("grid", family, impl, objective, B, T, baselines, cache,
                                        drop_unread=objective in ("mlm", "vmlm", "gvp"))

    def section_collator(self):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        try:
            from collator_bench import collator_times
        except ImportError as error:
            self.record(dict(section="collator", error=f"not run: benchmarks/collator_bench.py has no collator_times "
                                                         f"yet ({error})"))
            return
        T = 64 if self.args.smoke else 1024
        for batch in ((2, 4) if self.args.smoke else (16, 64)):
            row = dict(section="collator", batch=batch, seq=T)
            try:
                times = collator_times(batch_size=batch, seq_len=T, data_root=self.args.data_root)
                row["collator_ms"] = {k: round(1e3 * float(v), 3) for k, v in dict(times).items()}
            except Exception as error:
                row.update(error=f"{type(error).__name__}: {str(error)[:400]}", traceback=traceback.format_exc()[-2000:])
            self.record(row)

    def run(self, sections):
        for section in SECTIONS:
            if section in sections:
                try:
                    getattr(self, f"section_{section}")()
                except Exception as error:  # a bug in a section's bookkeeping still leaves the other sections
                    self.record(dict(section=section, error=f"{type(error).__name__}: {str(error)[:400]}",
                                     traceback=traceback.format_exc()[-2000:]))
        try:
            add_ratios(self.rows)
        except Exception as error:
            self.record(dict(section="ratios", error=f"{type(error).__name__}: {str(error)[:400]}"))


def add_ratios(rows):
    """Each row's tokens/s over each of its baselines' (measured in the same run); collator time over step time."""
    by_key = {r["key"]: r for r in rows if "key" in r and "tokens_per_s" in r}
    for row in rows:
        if "tokens_per_s" in row and row.get("baselines"):
            row["vs"] = {b: round(row["tokens_per_s"] / by_key[b]["tokens_per_s"], 3) for b in row["baselines"]
                         if b in by_key}
    for row in rows:
        if row.get("section") == "collator" and "collator_ms" in row:
            # per token: the collator's time for this batch over the fastest measured compiled step of the same
            # objective (grid size, any config and kernel) for as many tokens; the step was measured at the grid's
            # batch only, so at another batch this assumes the step's time per token stays the same
            fastest = {}
            for r in rows:
                if r.get("model") == "lookaround" and r.get("seq") == row["seq"] and "ms_per_step" in r \
                        and r.get("train"):
                    per_token = r["ms_per_step"] / (r["batch"] * r["seq"])
                    fastest[r["objective"]] = min(per_token, fastest.get(r["objective"], per_token))
            row["fraction_of_step"] = {k: round(v / (fastest[k] * row["batch"] * row["seq"]), 4)
                                       for k, v in row["collator_ms"].items() if k in fastest}


# ---------------------------------------------------------------------------------------------- report
def fmt_ratio(row, key):
    v = row.get("vs", {}).get(key)
    return f"{v:.2f}x" if v is not None else "–"


def report(data: dict) -> str:
    rows = data["rows"]
    keyed = {r["key"]: r for r in rows if "key" in r}
    out = [f"{data['device']}, torch {data['torch']}, transformers {data.get('transformers', '?')}; "
           f"{data['sizes']['layers']} layers, hidden {data['sizes']['hidden']}, vocab {data['sizes']['vocab']}; "
           f"{data['steps']} timed steps after {data['warmup']} warm-up; compile: {data['args'].get('compile')} "
           f"{data.get('compile', {})}; total {data['total_s']:.0f} s"]

    def perf(r):
        if "error" in r:
            return f"**failed**: {r['error'][:120]}" if not r["error"].startswith("not run") else r["error"]
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "–"
        return f"{r['ms_per_step']:.1f} | {r['tokens_per_s']:,} | {100 * r['mfu']:.1f}% | {peak} | {r['warmup_s']:.0f}"

    def table(*extra_columns):
        names = ["case", "B×T", "ms/step", "tokens/s", "MFU", "peak GiB", "warm-up s", *extra_columns]
        return ["| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]

    def line(r, *extra):
        cells = perf(r) if "error" not in r else perf(r) + " | | | |"
        case = r.get("case") or f"section {r.get('section')}"
        return f"| {case} | {r.get('batch', '?')}×{r.get('seq', '?')} | {cells} | " + " | ".join(extra) + " |"

    long_rows = [r for r in rows if r.get("section") == "long"]
    if long_rows:
        out += ["", "### Long context (16k tokens per step)", "", *table("vs compiled Llama", "block sparsity")]
        for r in long_rows:
            ratio = fmt_ratio(r, r["baselines"][0]) if r.get("baselines") else ""
            sparsity = f"{r['block_sparsity_pct']:.0f}%" if "block_sparsity_pct" in r else ""
            out.append(line(r, ratio, sparsity))
        out += ["", auto_rule(rows)]
    masked = [r for r in rows if r.get("section") == "masked"]
    if masked:
        out += ["", "### Masked 0.15, BERT-like config", "", *table("vs BERT eager", "vs BERT compiled")]
        for r in masked:
            b = r.get("baselines") or []
            out.append(line(r, *([fmt_ratio(r, b[0]), fmt_ratio(r, b[1])] if b else ["", ""])))
    grid = [r for r in rows if r.get("section") == "grid"]
    if grid:
        out += ["", "### Every objective, compiled", "", *table("vs HF eager", "vs HF compiled", "block sparsity")]
        for r in grid:
            b = r.get("baselines") or []
            label = dict(r, case=f"[{r.get('family')}-like] {r.get('case')}")
            sparsity = f"{r['block_sparsity_pct']:.0f}%" if "block_sparsity_pct" in r else ""
            out.append(line(label, *([fmt_ratio(r, b[0]), fmt_ratio(r, b[1])] if b else ["", ""]), sparsity))
    coll = [r for r in rows if r.get("section") == "collator"]
    if coll:
        out += ["", "### Collator time per batch", "",
                "Collator: one CPU thread, median (`benchmarks/collator_bench.py`). Fraction: collator time over the "
                "time the fastest compiled step of the objective takes for as many tokens (step measured at the grid's "
                "B; at B=64 this assumes its time per token stays the same).", "",
                "| B | T | collator ms (per objective) | fraction of the compiled step |", "| --- | --- | --- | --- |"]
        for r in coll:
            if "error" in r:
                out.append(f"| {r.get('batch', '')} | {r.get('seq', '')} | {r['error']} | |")
            else:
                ms = ", ".join(f"{k} {v:.2f}" for k, v in r["collator_ms"].items())
                frac = ", ".join(f"{k} {100 * v:.1f}%" for k, v in r.get("fraction_of_step", {}).items())
                out.append(f"| {r['batch']} | {r['seq']} | {ms} | {frac or '–'} |")
    audit = [r for r in rows if r.get("section") == "audit"]
    if audit:
        out += ["", "### Gradient leak audit on the device", "", "| backend | compiled | " + " | ".join(OBJECTIVES)
                + " |", "| --- | --- |" + " --- |" * len(OBJECTIVES)]
        for impl, compiled in dict.fromkeys((r["backend"], r["compiled"]) for r in audit):
            cells = []
            for objective in OBJECTIVES:
                r = next((x for x in audit if (x["backend"], x["compiled"], x["objective"]) == (impl, compiled,
                                                                                                objective)), None)
                if r is None:
                    cells.append("–")
                elif "error" in r:
                    cells.append("not run" if r["error"].startswith("not run") else "**failed**")
                else:
                    cells.append(f"{r['targets']} targets, {r['leaks']} leaks, {r['blind']} blind")
            out.append(f"| {impl} | {'yes' if compiled else 'no'} | " + " | ".join(cells) + " |")
        leaks = sum(r.get("leaks", 0) for r in audit)
        failed = [r for r in audit if "error" in r and not r["error"].startswith("not run")]
        out.append(f"\nTotal leaks: {leaks}; audit rows that failed to run: {len(failed)}.")
    errors = [r for r in rows if "error" in r and not r["error"].startswith("not run")]
    if errors:
        out += ["", "### Failures", ""]
        for r in errors:
            where = " ".join(str(r.get(k, "")) for k in ("case", "backend", "objective") if r.get(k) is not None)
            out.append(f"- {where or r.get('section')}: {r['error']}")
            # the innermost frames say where it failed
            frames = [x for x in r.get("traceback", "").splitlines() if x.strip().startswith("File ")][-3:]
            out += [f"    {x.strip()}" for x in frames]
    return "\n".join(out)


def auto_rule(rows) -> str:
    """What the long-context rows say about FLEX_ATTENTION_MIN_KEYS."""
    from hf_lookaround.models.lookaround.modeling_lookaround import FLEX_ATTENTION_MIN_KEYS

    faster = []
    for r in rows:
        if r.get("section") != "long" or r.get("model") != "lookaround" or "tokens_per_s" not in r:
            continue
        other = next((x for x in rows if x.get("section") == "long" and x.get("model") == "lookaround"
                      and x.get("seq") == r["seq"] and x.get("backend") != r["backend"] and "tokens_per_s" in x), None)
        if other and r["tokens_per_s"] > other["tokens_per_s"] and (r["seq"], r["backend"]) not in faster:
            faster.append((r["seq"], r["backend"]))
    if not faster:
        return f"lookaround_auto: flex from {FLEX_ATTENTION_MIN_KEYS} keys (no pair of rows to compare in this run)."
    said = ", ".join(f"T={t}: {b}" for t, b in sorted(faster))
    flex_from = min((t for t, b in faster if b == "flex_attention"), default=None)
    return (f"Faster kernel per length in this run: {said}. lookaround_auto uses FlexAttention from "
            f"FLEX_ATTENTION_MIN_KEYS = {FLEX_ATTENTION_MIN_KEYS} keys"
            + (f"; this run suggests {flex_from}." if flex_from else "; this run never found flex faster."))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 timed steps: checks every code path on CPU")
    parser.add_argument("--smoke_backend", default="aot_eager", help="compile backend of --smoke on the CPU")
    parser.add_argument("--compile", choices=("regional", "full"), default="regional",
                        help="compile each transformer layer (regional, fast to compile) or the whole model (full)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--long_seqs", default="1024,4096,8192", help="sequence lengths of the long-context section")
    parser.add_argument("--grid_kernels", default="sdpa",
                        help="attention kernels of the grid (T=1024, where lookaround_auto picks sdpa); e.g. "
                             "sdpa,flex_attention")
    parser.add_argument("--masked_kernels", default="sdpa", help="kernels of the masked section, e.g. sdpa,flex_attention")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget_s", type=float, default=440.0,
                        help="rows that would start after this many seconds are recorded as not run")
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense bf16 peak (default: by card name)")
    parser.add_argument("--data_root", default="../shared/data", help="real text for the collator section")
    parser.add_argument("--out", default="gpu_bench.json")
    parser.add_argument("--report", metavar="JSON", help="print the markdown tables of an earlier run and exit")
    args = parser.parse_args(argv)

    if args.report:
        with open(args.report) as f:
            print(report(json.load(f)))
        return 0
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {SECTIONS}")
    bench = Bench(args)
    if not bench.cuda and not args.smoke:
        parser.error("no GPU: run with --smoke for the CPU check")
    bench.run(sections)
    data = bench.save()
    print("\n" + report(data))
    print(f"\nwrote {args.out} ({bench.elapsed():.0f} s)")
    failed = [r for r in bench.rows if "error" in r and not r["error"].startswith("not run")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
