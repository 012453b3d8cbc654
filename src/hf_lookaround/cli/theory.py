"""`hf-lookaround theory <subcommand>`: the checks and figures of docs/theory.md.

- ``thm31``: Theorem 3.1 (spectral loss == factorisation of Ā + const) on enumerable toy data;
- ``thm42``: Theorem 4.2, computed spectra vs the closed form, for several (r, s, ρ);
- ``tails``: tails of the toy spectra of AR, DAR, masked (several ρ) and variable masked;
- ``spectrum``: spectra on real text (``--data``), plans drawn by ``make_plan``;
- ``connectivity``: the Fig. 2 surrogate for checkpoints.

Objectives are written ``ar``, ``dar:T`` (``dar:1,2,3`` for a mixture), ``mlm:RHO``, ``vmlm:A-B``, ...: the forms
of each objective module's ``Params.SPEC``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from .. import objectives
from ..plans import expected_masked_count
from ..theory.cooccurrence import check_theorem_31, normalised_matrix, spectrum
from ..theory.toy import closed_form_spectrum, derived_spectrum, spectrum_bands, toy_cooccurrence, toy_dataset

__all__ = ["main", "parse_objective"]


def _specs() -> str:
    """The spec forms of every objective that has some, as one phrase: ``ar, dar:T, ... or vmlm:A-B``."""
    forms = [form for o in objectives.OBJECTIVES.values() if o.Params.SPEC for form in o.Params.SPEC.split(", ")]
    return ", ".join(forms[:-1]) + " or " + forms[-1] if len(forms) > 1 else "".join(forms)


def parse_objective(spec: str) -> tuple[str, dict]:
    """``ar`` | ``dar:T`` | ``dar:T1,T2`` | ``mlm:RHO`` | ``vmlm:A-B`` | ... -> (objective, plan params): the
    argument after ``:`` is read by the objective's ``Params.from_spec`` (its ``SPEC`` lists the forms)."""
    name, _, arg = spec.partition(":")
    entry = objectives.OBJECTIVES.get(name)
    if entry is not None and entry.Params.SPEC:
        try:
            return name, entry.Params.from_spec(arg).plan_params()
        except ValueError:
            pass
    raise ValueError(f"bad objective {spec!r}: use {_specs()}")


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"
    return str(value)


def _markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "| " + " | ".join("---" for _ in keys) + " |"]
    lines += ["| " + " | ".join(_cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _emit(args, text: str, payload) -> None:
    print(text)
    if getattr(args, "output", None):
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    if getattr(args, "json", None):
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1, default=float), encoding="utf-8")


def _toy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens-per-slot", type=int, default=1, help="tokens per (class, position); 1 = fixed sequences")
    p.add_argument("--shared-per-slot", type=int, default=0, help="tokens a slot shares with the next class's slot")
    p.add_argument("--bos", choices=["none", "shared", "class"], default="none",
                   help="prepend a begin token (a condition token of rank 0): one for all classes, or one per class")


def _out_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", help="also write the markdown table here")
    p.add_argument("--json", help="write the numbers as JSON here")


# --------------------------------------------------------------------------------------------
def cmd_thm31(args) -> int:
    data = toy_dataset(args.r, args.s, args.tokens_per_slot, args.shared_per_slot, args.bos)
    rows, worst = [], 0.0
    for spec in args.objectives:
        objective, params = parse_objective(spec)
        co = toy_cooccurrence(data, objective, **params)
        for seed in range(args.seeds):
            res = check_theorem_31(co, dim=args.dim, seed=seed)
            worst = max(worst, res["rel_diff"])
            rows.append(
                {
                    "objective": spec,
                    "seed": seed,
                    "|C| x |G|": f"{co.shape[0]} x {co.shape[1]}",
                    "L(f,g)": res["spectral_loss"],
                    "‖Ā − FW'ᵀ‖²": res["factorisation"],
                    "‖Ā‖²": res["constant"],
                    "|L − (‖Ā − FW'ᵀ‖² − ‖Ā‖²)|": res["abs_diff"],
                }
            )
    text = _markdown(rows) + f"\n\nlargest relative difference: {worst:.2e} (tolerance {args.tol:g})"
    _emit(args, text, rows)
    return 0 if worst < args.tol else 1


def cmd_thm42(args) -> int:
    """One row per (r, s, ρ, objective): the computed σ_j band by band, with the paper's value in
    brackets where they differ; then whether the paper's closed form holds at the nominal ρ and at
    the ratio the plan really uses, ``m / s``."""
    rows, payload, ok = [], [], True
    for r in args.r:
        for s in args.s:
            data = toy_dataset(r, s, args.tokens_per_slot, args.shared_per_slot, args.bos)
            for rho in args.rho:
                m = expected_masked_count(rho, s)
                for objective, params in (("ar", {}), ("mlm", {"mask_ratio": rho})):
                    values = spectrum(normalised_matrix(toy_cooccurrence(data, objective, **params)))
                    paper = closed_form_spectrum(r, s, objective, rho)
                    effective = closed_form_spectrum(r, s, objective, m / s) if 0 < m < s else paper
                    bands = spectrum_bands(values, paper, r, s)
                    row = {"r": r, "s": s, "ρ": rho, "m": m if objective == "mlm" else "-", "objective": objective}
                    for band in bands:
                        cell = band["computed"]
                        row[f"σ, {band['band']}"] = cell if band["match"] else f"**{cell}** ({band['closed_form']})"
                    failed = [b["band"] for b in bands if not b["match"]]
                    row["paper holds"] = "yes" if not failed else "no: " + ", ".join(failed)
                    eff_failed = [b["band"] for b in spectrum_bands(values, effective, r, s) if not b["match"]]
                    row["holds at ρ = m/s"] = "-" if objective == "ar" else ("yes" if not eff_failed else "no")
                    rows.append(row)
                    derived = derived_spectrum(r, s, objective, rho, args.bos)
                    vs_derived = float(np.abs(_pad(values, len(derived)) - _pad(derived, len(values))).max())
                    ok &= vs_derived < 1e-8
                    payload.append(
                        {"r": r, "s": s, "rho": rho, "m": m, "objective": objective, "values": values.tolist(),
                         "paper": paper.tolist(), "derived": derived.tolist(), "max_diff_vs_derived": vs_derived}
                    )
    note = (
        "every spectrum equals the derived form of hf_lookaround.theory.toy to 1e-8"
        if ok
        else "**some spectra differ from the derived form of hf_lookaround.theory.toy** (its premises: "
        "disjoint class token sets)"
    )
    header = (
        f"toy data: tokens_per_slot={args.tokens_per_slot}, shared_per_slot={args.shared_per_slot}, "
        f"bos={args.bos}. Cells: computed σ_j over the band (min .. max); **bold** (paper) where the "
        "paper's closed form differs by more than 1e-8.\n\n"
    )
    _emit(args, header + _markdown(rows) + f"\n\n{note}", payload)
    return 0 if ok else 1


def _pad(x: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros(max(len(x), width))
    out[: len(x)] = x
    return out


def cmd_tails(args) -> int:
    r, s = args.r, args.s
    data = toy_dataset(r, s, args.tokens_per_slot, args.shared_per_slot, args.bos)
    spectra = {}
    for spec in args.objectives:
        objective, params = parse_objective(spec)
        spectra[spec] = _pad(spectrum(normalised_matrix(toy_cooccurrence(data, objective, **params))), r * s + 1)
    ks = sorted({k for k in (r, 2 * r, r * (s // 2), r * (s - 1) - 1) if r <= k < r * s})
    rows = []
    for spec, v in spectra.items():
        tail = v[r : r * s]
        row = {"objective": spec}
        row.update({f"σ_{k + 1}": float(v[k]) for k in ks})
        row["mean σ_j, r<j≤rs"] = float(tail.mean())
        row["Σ σ_j², r<j≤rs"] = float((tail**2).sum())
        rows.append(row)
    text = f"toy data r={r}, s={s}, tokens_per_slot={args.tokens_per_slot}\n\n" + _markdown(rows)
    if args.plot:
        _plot_spectra({k: v[: r * s + 1] for k, v in spectra.items()}, args.plot, f"toy spectra, r={r}, s={s}", mark=r)
        text += f"\n\nplot: {args.plot}"
    _emit(args, text, {k: v.tolist() for k, v in spectra.items()})
    return 0


def cmd_spectrum(args) -> int:
    from ..theory.text import build_tokenizer, load_texts, sampled_cooccurrence, token_windows

    texts = load_texts(args.data, args.text_field, args.max_documents)
    tokenize = build_tokenizer(args.tokenizer, texts, args.vocab_size)
    windows = token_windows(texts, tokenize, args.seq_len, args.num_windows, args.seed)
    rows, spectra = [], {}
    for context in args.contexts:
        mode, _, buckets = context.partition("@")
        for spec in args.objectives:
            objective, params = parse_objective(spec)
            co = sampled_cooccurrence(
                windows, objective, mode, int(buckets or 0), args.plans_per_window, args.seed, **params
            )
            v = spectrum(normalised_matrix(co), method=args.method, k=args.k)
            spectra[f"{spec} [{context}]"] = v
            row = {"objective": spec, "context": context, "|C| x |G|": f"{co.shape[0]} x {co.shape[1]}"}
            row.update({f"σ_{j}": float(v[j - 1]) if j <= len(v) else float("nan") for j in args.report})
            row["Σσ² (=‖Ā‖²)"] = float((v**2).sum()) if args.method != "svds" else float("nan")
            rows.append(row)
    text = (
        f"data {args.data}: {len(windows)} windows of {args.seq_len} tokens, tokenizer {args.tokenizer} "
        f"(vocab {args.vocab_size}), {args.plans_per_window} plan(s) per window, seed {args.seed}\n\n" + _markdown(rows)
    )
    if args.plot:
        _plot_spectra(spectra, args.plot, f"spectra of Ā on {Path(args.data).name}", max_j=args.plot_max_j)
        text += f"\n\nplot: {args.plot}"
    _emit(args, text, {k: v.tolist() for k, v in spectra.items()})
    return 0


def cmd_connectivity(args) -> int:
    from ..theory.connectivity import mean_pooled_features, plot_connectivity, top_pair_products
    from ..theory.text import load_texts

    texts = load_texts(args.data, args.text_field, None if args.chunk_words else args.num_samples)
    if args.chunk_words:  # long documents (speeches, chapters) -> many samples of W words
        words = [text.split() for text in texts]
        texts = [
            " ".join(w[k : k + args.chunk_words])
            for w in words
            for k in range(0, len(w) - args.chunk_words + 1, args.chunk_words)
        ][: args.num_samples]
    distributions, rows = {}, []
    for spec in args.models:
        name, _, path = spec.rpartition("=")
        name = name or Path(path).name
        feats = mean_pooled_features(path, texts, args.max_length, args.batch_size)
        top = top_pair_products(feats, args.top, normalize=not args.raw)
        distributions[name] = top
        rows.append({"model": name, "samples": len(texts), "pairs": len(top), "mean": float(top.mean()),
                     "median": float(np.median(top)), "min": float(top.min()), "max": float(top.max())})
    text = _markdown(rows)
    if args.plot:
        plot_connectivity(distributions, args.plot)
        text += f"\n\nplot: {args.plot}"
    _emit(args, text, {k: v.tolist() for k, v in distributions.items()})
    return 0


def _plot_spectra(spectra: dict, path, title: str, mark: int | None = None, max_j: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, v in spectra.items():
        v = np.asarray(v)[:max_j]
        ax.plot(np.arange(1, len(v) + 1), v, marker="." if len(v) < 80 else None, label=name)
    if mark:
        ax.axvline(mark + 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("j")
    ax.set_ylabel("σ_j of Ā")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-lookaround theory", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("thm31", help="check Theorem 3.1 on enumerable toy data")
    p.add_argument("--r", type=int, default=3)
    p.add_argument("--s", type=int, default=4)
    p.add_argument("--objectives", nargs="+", default=["ar", "dar:2", "mlm:0.5", "vmlm:0.15-0.6"])
    p.add_argument("--dim", type=int, default=8, help="feature dimension of the random f, g")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--tol", type=float, default=1e-10, help="exit 1 if a relative difference exceeds this")
    _toy_args(p)
    _out_args(p)
    p.set_defaults(func=cmd_thm31)

    p = sub.add_parser("thm42", help="Theorem 4.2: toy spectra vs the closed form")
    p.add_argument("--r", type=int, nargs="+", default=[2, 3])
    p.add_argument("--s", type=int, nargs="+", default=[4, 6])
    p.add_argument("--rho", type=float, nargs="+", default=[0.5])
    _toy_args(p)
    _out_args(p)
    p.set_defaults(func=cmd_thm42)

    p = sub.add_parser("tails", help="tails of the toy spectra for several objectives")
    p.add_argument("--r", type=int, default=3)
    p.add_argument("--s", type=int, default=6)
    p.add_argument("--objectives", nargs="+", default=["ar", "dar:2", "dar:3", "mlm:0.17", "mlm:0.34", "mlm:0.5",
                                                       "mlm:0.67", "vmlm:0.15-0.3"])
    p.add_argument("--plot")
    _toy_args(p)
    _out_args(p)
    p.set_defaults(func=cmd_tails)

    p = sub.add_parser("spectrum", help="spectra of Ā on real text")
    p.add_argument("--data", required=True, help=".jsonl(.gz) / .txt file or a directory of them")
    p.add_argument("--text-field", default="text")
    p.add_argument("--max-documents", type=int)
    p.add_argument("--tokenizer", default="words", help="words | bpe | path to a tokenizer directory")
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--num-windows", type=int, default=4000)
    p.add_argument("--plans-per-window", type=int, default=1)
    p.add_argument("--objectives", nargs="+", default=["ar", "dar:2", "mlm:0.15", "mlm:0.4", "vmlm:0.15-0.3"])
    p.add_argument("--contexts", nargs="+", default=["full"], help="full | window:W, each optionally @BUCKETS")
    p.add_argument("--method", default="auto", choices=["auto", "dense", "gram", "svds"])
    p.add_argument("--k", type=int, help="keep the k largest singular values (svds default 200)")
    p.add_argument("--report", type=int, nargs="+", default=[2, 10, 50, 100, 500])
    p.add_argument("--plot")
    p.add_argument("--plot-max-j", type=int)
    p.add_argument("--seed", type=int, default=0)
    _out_args(p)
    p.set_defaults(func=cmd_spectrum)

    p = sub.add_parser("connectivity", help="paper (a) Fig. 2 surrogate for checkpoints")
    p.add_argument("--models", nargs="+", required=True, help="checkpoint dirs, optionally NAME=PATH")
    p.add_argument("--data", required=True)
    p.add_argument("--text-field", default="text")
    p.add_argument("--num-samples", type=int, default=1000)
    p.add_argument("--chunk-words", type=int, help="cut documents into samples of this many words")
    p.add_argument("--top", type=int, default=100_000)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--raw", action="store_true", help="raw inner products instead of cosine similarities")
    p.add_argument("--plot")
    _out_args(p)
    p.set_defaults(func=cmd_connectivity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:
        print(f"hf-lookaround theory {args.command}: error: {err}")
        return 2
