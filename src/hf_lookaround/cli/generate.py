"""``hf-lookaround generate``: group decoding (ar / dar checkpoints) and any-order infilling (masked / GVP)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from ..decoding.infill import ORDERS, SCHEDULES, infill
from ..generation import default_group_size, group_generate
from ..hub.weights import check_local_weights
from .common import resolve_device

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-lookaround generate",
        description="Decode with a LookAround checkpoint through its query stream: continue a prompt by group "
        "decoding (ar / dar checkpoints, --group_size), fill [MASK] positions (--infill) or sample --num_tokens "
        "tokens in any order (masked / GVP checkpoints).",
    )
    parser.add_argument("model", help="checkpoint folder (or hub name)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder; default: the checkpoint's")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--infill", default=None, help='text with the mask token at each position to fill, e.g. "a [MASK] b"')
    mode.add_argument("--num_tokens", type=int, default=None,
                      help="any-order sampling of this many tokens (after BOS, or after --prompt)")
    parser.add_argument("--prompt", default=None, help="text to continue (group decoding) or to condition --num_tokens on")
    parser.add_argument("--group_size", type=int, default=None,
                        help="group decoding: tokens per step (t); default: 1 if the checkpoint trained it, else the "
                        "smallest group size it trained")
    parser.add_argument("--draft_group_size", type=int, default=None,
                        help="self-speculative decoding: the tokens of t=1 decoding, drafted k at a time by the query "
                        "stream and verified in the same forward (needs t=1 and t=k in the checkpoint's mixture)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--no_cache", action="store_true", help="group decoding: recompute the prefix every step")
    parser.add_argument("--steps", type=int, default=None, help="infilling: steps (default: one per hidden position)")
    parser.add_argument("--order", choices=ORDERS, default="confidence")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    parser.add_argument("--block_length", type=int, default=None,
                        help="infilling: semi-AR blocks of this many hidden positions, left to right, --steps each (LLaDA)")
    parser.add_argument("--confidence_noise", type=float, default=0.0,
                        help="infilling: annealed Gumbel noise on the confidence order (MaskGIT); 0 = none")
    parser.add_argument("--do_sample", action="store_true", help="sample (default: greedy / argmax)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--num_samples", type=int, default=1, help="independent samples (rows of one batch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow_untrained", action="store_true",
                        help="decode even with a group size / decoder the checkpoint was not trained for (warns)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``hf-lookaround generate``; bad input raises ValueError, which the CLI prints as one line (exit 2)."""
    args = build_parser().parse_args(argv)
    if args.num_samples < 1:
        raise ValueError(f"--num_samples {args.num_samples}: must be at least 1")
    args.device = resolve_device(args.device)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # to stderr

    from transformers import AutoConfig, AutoModelForPreTraining, AutoTokenizer  # our classes are registered

    if args.infill is None and args.num_tokens is None and args.prompt is None:
        raise SystemExit("give --prompt (group decoding), --infill TEXT or --num_tokens N")
    check_local_weights(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    torch.manual_seed(args.seed)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    sampling = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    config = AutoConfig.from_pretrained(args.model)
    # trained single-stream as a causal LM: GPT's form of ar (causal), dar's one-stream form (block-causal, t tokens
    # a forward); both decode through LookAroundForCausalLM's content stream
    pattern = config.default_attention if config.prediction_stream == "content" else None
    one_stream_groups = pattern == "block_causal"
    if pattern in ("causal", "block_causal") and args.prompt is not None and args.infill is None \
            and args.num_tokens is None and args.draft_group_size is None \
            and (args.group_size is None or one_stream_groups):
        return _print(args, _single_stream_generate(args, config, tokenizer, sampling))
    # every LookAround checkpoint loads into the pretraining head: the query stream and the LM head
    model = AutoModelForPreTraining.from_pretrained(args.model, config=config).to(args.device).eval()

    if args.infill is not None or args.num_tokens is not None:
        text = args.infill if args.infill is not None else (args.prompt or None)
        inputs = [text] * args.num_samples if text is not None else None
        if inputs is None and args.num_samples > 1:
            inputs = [""] * args.num_samples
        result = infill(
            model, tokenizer, inputs, num_tokens=args.num_tokens, steps=args.steps, order=args.order,
            schedule=args.schedule, generator=generator, allow_untrained=args.allow_untrained,
            block_length=args.block_length, confidence_noise=args.confidence_noise, **sampling,
        )
        outputs, info = result.text, {"mode": "infill", "steps": result.num_steps, "order": args.order,
                                      "schedule": args.schedule, "block_length": args.block_length}
    else:
        ids = _prompt_ids(args, tokenizer)
        input_ids = torch.tensor([ids] * args.num_samples, device=args.device)
        group_size = args.group_size
        if group_size is None and args.draft_group_size is None:
            group_size = default_group_size(model.config)
            if group_size != 1:
                logger.info("no --group_size: decoding t = %d tokens per forward, the smallest group size this "
                            "checkpoint trained (it never trained t = 1); --group_size sets it", group_size)
        result = group_generate(
            model, input_ids, group_size=group_size, draft_group_size=args.draft_group_size,
            max_new_tokens=args.max_new_tokens, use_cache=not args.no_cache, generator=generator,
            allow_untrained=args.allow_untrained, pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True,
            **sampling,
        )
        outputs = [tokenizer.decode(row[len(ids):], skip_special_tokens=True) for row in result.sequences.tolist()]
        if args.draft_group_size is not None:
            info = {"mode": "self_speculative", "draft_group_size": args.draft_group_size,
                    "acceptance_rate": result.acceptance_rate, "forwards": result.num_forwards}
        else:
            info = {"mode": "group_decoding", "group_size": group_size}
        info["max_new_tokens"] = args.max_new_tokens
    return _print(args, (outputs, info))


def _prompt_ids(args, tokenizer) -> list[int]:
    """The prompt's ids after BOS, without EOS: generation continues the text."""
    ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(ids)


def _single_stream_generate(args, config, tokenizer, sampling):
    """A checkpoint trained single-stream (`--ar_form single_stream`, GPT): its causal content stream decodes,
    through `LookAroundForCausalLM.generate()` with a KV cache; the query stream was never trained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, config=config).to(args.device).eval()
    input_ids = torch.tensor([_prompt_ids(args, tokenizer)] * args.num_samples, device=args.device)
    groups = {"group_size": args.group_size} if args.group_size is not None else {}  # one-stream dar: its t only
    sequences = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens,
                               pad_token_id=tokenizer.pad_token_id, allow_untrained=args.allow_untrained, **groups,
                               **{k: v for k, v in sampling.items() if v is not None})
    outputs = [tokenizer.decode(row[input_ids.shape[1]:], skip_special_tokens=True) for row in sequences.tolist()]
    if config.default_attention == "block_causal":
        mode = f"one stream, {config.attention_group_size} tokens per forward (block-causal)"
    else:
        mode = "causal (single stream)"
    return outputs, {"mode": mode, "max_new_tokens": args.max_new_tokens}


def _print(args, result) -> int:
    """The outputs on stdout. A continuation is printed after its prompt (plain text), or beside it ("prompt" and
    "outputs", the continuations, in --json); infilling's outputs are the whole text already."""
    outputs, info = result
    continued = args.prompt is not None and args.infill is None and args.num_tokens is None
    if args.json:
        print(json.dumps({**info, **({"prompt": args.prompt} if continued else {}), "outputs": outputs},
                         ensure_ascii=False))
    else:
        for i, text in enumerate(outputs):
            text = args.prompt + text if continued else text
            print(f"[{i}] {text}" if len(outputs) > 1 else text)
        if "acceptance_rate" in info:
            print(f"self-speculative decoding: {info['acceptance_rate']:.1%} of the drafts accepted, "
                  f"{info['forwards']} forwards", file=sys.stderr)
    return 0
