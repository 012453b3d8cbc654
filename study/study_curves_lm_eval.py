"""The learning curves' second, independent scorer: EleutherAI's lm-evaluation-harness (``--second_scorer lm_eval``).

At each checkpoint the harness scores the AR protocol's held-out passages (every set of ``study_common.HELDOUT_SETS``)
as a user runs it on a causal LM: ``HFLM`` loads the checkpoint folder as ``AutoModelForCausalLM`` (the worker has
imported hf_lookaround, whose registered causal view it gets), a local task per set (a YAML over JSON Lines that this
module writes into the cell folder, no Hub), rolling log-likelihood (wikitext's form). The forward is the package's;
the tokenization, windows and sums are the harness's. The package's ``ar_perplexity`` scores the same passages in
the same windows, so the two totals must agree (``AGREEMENT``):

- the harness scores a long passage in disjoint windows of ``L`` inputs (one token of context at a window's start);
  ``ar_perplexity(max_length=L + 1, stride=L)`` lays out the same windows;
- ``L + 1`` is the pretraining block (the context the cell trained on), at most the positions: a two-stream causal
  view takes one token less than the positions (its query row for token ``i + 1`` sits at position ``i + 1``);
- ``add_bos_token=False``: the study's tokenizer adds ``<s>`` and the harness puts its own prefix token (``<s>``)
  before every rolling document; with both it would also score ``<s>`` after ``<s>``.

What each checkpoint's causal view is, and where there is none, is docs/evaluation.md's "lm-evaluation-harness".
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from study_common import HELDOUT_SETS, round_sig

AGREEMENT = 3e-3  # the relative difference of the total NLLs within which the two scorers agree
TASK_PREFIX = "curves_heldout_"
def write_tasks(folder: Path, heldout: dict[str, list[str]]) -> dict[str, str]:
    """One rolling log-likelihood task per held-out set: ``{set: task name}``; YAML (JSON is YAML) and JSON Lines."""
    folder.mkdir(parents=True, exist_ok=True)
    names = {}
    for name in HELDOUT_SETS:
        task = TASK_PREFIX + name
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in heldout[name]), encoding="utf-8")
        spec = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
                "doc_to_target": "{{text}}", "metadata": {"version": 1.0},
                "metric_list": [{"metric": "bits_per_byte"}, {"metric": "word_perplexity"}]}
        (folder / f"{task}.yaml").write_text(json.dumps(spec, indent=1), encoding="utf-8")
        names[name] = task
    return names


def num_windows(tokenizer, texts: list[str], length: int) -> int:
    """How many windows of ``length`` inputs the passages take (more than the passages: some span several)."""
    from hf_lookaround.evaluation.perplexity import encode_documents, sliding_windows

    docs, _, has_bos = encode_documents(tokenizer, texts)
    return sum(len(sliding_windows(doc, length + 1, length, has_bos)) for doc in docs)


def harness_totals(result: dict, samples: list[dict]) -> dict:
    """One task's numbers: total NLL (nats) over the passages, bits per byte, and the harness's word and byte
    counts (what its ``word_perplexity`` and ``bits_per_byte`` divide by)."""
    return {"nll": -sum(s["resps"][0][0] for s in samples), "bits_per_byte": result["bits_per_byte,none"],
            "word_perplexity": result["word_perplexity,none"],
            "num_words": sum(s["word_perplexity"][1] for s in samples),
            "num_bytes": sum(s["bits_per_byte"][1] for s in samples)}


def score(model, tokenizer, checkpoint: Path, spec: dict, log) -> dict:
    """The second scorer's entry of a checkpoint's record: per held-out set, the harness's totals, the package's on
    the same passages and windows, their relative difference and whether they agree; or why it was skipped.
    ``model`` is the checkpoint's pretraining head (the package's side scores through it)."""
    from lm_eval import __version__ as lm_eval_version
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from hf_lookaround.evaluation.perplexity import ar_perplexity

    out = {"scorer": "lm_eval", "version": lm_eval_version, "agreement": AGREEMENT}
    start = time.perf_counter()
    root = Path(spec["cell_dir"]) / "second_scorer"
    heldout = json.loads(Path(spec["prep"]["heldout"]).read_text())
    tasks = write_tasks(root / "tasks", heldout)
    # a window of length + 1 ids; the one-stream form also needs room for its start rows (config.n_positions)
    length = min(spec["settings"]["block_size"], model.config.max_position_embeddings,
                 getattr(model.config, "n_positions", None) or model.config.max_position_embeddings + 1) - 1
    batch_size = spec["settings"]["eval_batch_size"]
    try:
        lm = HFLM(pretrained=str(checkpoint), trust_remote_code=True, device=spec["device"], dtype="float32",
                  batch_size=batch_size, add_bos_token=False, max_length=length)
    except ValueError as err:  # the causal view's own refusal (a single-stream [MASK] checkpoint)
        if "no causal LM view" not in str(err):
            raise
        log(f"second scorer: skipped ({err})")
        return dict(out, skipped=str(err))
    # no seeds: rolling log-likelihood draws nothing, and the cell's random state stays as it was without the flag
    results = simple_evaluate(model=lm, tasks=list(tasks.values()), log_samples=True, bootstrap_iters=0,
                              task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False),
                              random_seed=None, numpy_random_seed=None, torch_random_seed=None,
                              fewshot_random_seed=None)
    del lm
    sets = {}
    for name, task in tasks.items():
        harness = harness_totals(results["results"][task], results["samples"][task])
        r = ar_perplexity(model, tokenizer, heldout[name], max_length=length + 1, stride=length,
                            batch_size=batch_size)
        package = {"nll": r.mean_nll * r.num_tokens, "bits_per_byte": r.bits_per_byte, "num_tokens": r.num_tokens,
                   "num_bytes": int(r.num_bytes), "num_windows": num_windows(tokenizer, heldout[name], length)}
        difference = abs(harness["nll"] - package["nll"]) / package["nll"]
        sets[name] = {"harness": harness, "package": package, "relative_difference": difference,
                      "agrees": difference <= AGREEMENT}
        log(f"second scorer {name}: lm-eval {harness['bits_per_byte']:.4f} bits/byte, package "
            f"{package['bits_per_byte']:.4f} (relative difference of the NLLs {difference:.1e})")
    out.update(max_length=length, package_windows={"max_length": length + 1, "stride": length}, sets=sets,
               max_relative_difference=max(s["relative_difference"] for s in sets.values()),
               agrees=all(s["agrees"] for s in sets.values()), seconds=time.perf_counter() - start)
    return round_sig(out, digits=7)
