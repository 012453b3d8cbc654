"""``hf-lookaround generate``: group decoding (ar / dar checkpoints), diffusion decoding (mdlm / bd3lm) and any-order
infilling (masked / GVP)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from ..data.tokenization import auto_tokenizer
from ..decoding.infill import ORDERS, SCHEDULES, infill
from ..decoding import DiffusionDecoding, default_group_size, diffusion_block_of, is_one_stream_group_model, \
    make_logits_processor
from ..models.lookaround.diffusion_lookaround import is_diffusion_model
from ..hub.load import load_checkpoint
from ..hub.weights import check_local_checkpoint
from .common import resolve_device

COMMAND = "hf-lookaround generate"
logger = logging.getLogger(__name__)


# the most samples of one call: they are the rows of one batch (10,000,000 failed in the allocator)
MAX_SAMPLES = 1024


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-lookaround generate",
        description="Decode with a LookAround checkpoint through its query stream: continue a prompt by group "
        "decoding (ar / dar checkpoints, --group_size) or diffusion decoding (mdlm / bd3lm checkpoints, "
        "--diffusion_threshold / --diffusion_steps), fill [MASK] positions (--infill) or sample --num_tokens "
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
    parser.add_argument("--speculation_break_even", type=float, default=None,
                        help="self-speculative decoding: accepted drafts per verify step below which it runs plain "
                        "(t=1) steps for a while (default 0.25; 0: never)")
    parser.add_argument("--diffusion_threshold", type=float, default=None,
                        help="diffusion decoding (mdlm / bd3lm checkpoints): commit every masked position of the block "
                             "whose token has probability >= p, at least one per step (Fast-dLLM)")
    parser.add_argument("--diffusion_steps", type=int, default=None,
                        help="diffusion decoding: a fixed number of steps per block (the most confident each step); "
                             "default without either knob: one commit per step")
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
    if not 1 <= args.num_samples <= MAX_SAMPLES:
        raise ValueError(f"--num_samples {args.num_samples}: must be between 1 and {MAX_SAMPLES} (the samples are the "
                         "rows of one batch); for more, run the command again with other --seed values")
    if not 0 <= args.seed < 2**63:  # torch's generators take a 64-bit seed
        raise ValueError(f"--seed {args.seed}: must be between 0 and 2**63 - 1")
    args.device = resolve_device(args.device)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # to stderr

    from transformers import AutoConfig, AutoModelForPreTraining  # our classes are registered

    if args.infill is None and args.num_tokens is None and args.prompt is None:
        raise SystemExit("give --prompt (group decoding), --infill TEXT or --num_tokens N")
    check_local_checkpoint(args.model, COMMAND)  # before the config is read: a vision or foreign one is refused
    tokenizer = auto_tokenizer(args.tokenizer or args.model)
    torch.manual_seed(args.seed)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    sampling = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    config = AutoConfig.from_pretrained(args.model)
    if args.infill is None and args.num_tokens is None:
        return _print(args, _continue_prompt(args, config, tokenizer, sampling, generator))
    # every LookAround checkpoint loads into the pretraining head: the query stream and the LM head
    model = load_checkpoint(AutoModelForPreTraining, args.model, COMMAND, config=config).to(args.device).eval()
    text = args.infill if args.infill is not None else (args.prompt or None)
    inputs = [text] * args.num_samples if text is not None else None
    if inputs is None and args.num_samples > 1:
        inputs = [""] * args.num_samples
    result = infill(
        model, tokenizer, inputs, num_tokens=args.num_tokens, steps=args.steps, order=args.order,
        schedule=args.schedule, generator=generator, allow_untrained=args.allow_untrained,
        block_length=args.block_length, confidence_noise=args.confidence_noise, **sampling,
    )
    info = {"mode": "infill", "steps": result.num_steps, "order": args.order, "schedule": args.schedule,
            "block_length": args.block_length}
    return _print(args, (result.text, info))


def _prompt_ids(args, tokenizer) -> list[int]:
    """The prompt's ids after BOS, without EOS: generation continues the text."""
    ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(ids)


def _continue_prompt(args, config, tokenizer, sampling, generator):
    """Continue the prompt through the causal LM head's ``generate()``: group decoding (``--group_size``, by
    default the one the checkpoint trained), self-speculative decoding (``--draft_group_size``) or, for a checkpoint
    trained single-stream as GPT (causal content stream), transformers' own token-by-token loop."""
    from transformers import AutoModelForCausalLM

    make_logits_processor(**sampling)  # sampling flags without --do_sample, or top_p > 1: one-line errors
    model = load_checkpoint(AutoModelForCausalLM, args.model, COMMAND, config=config).to(args.device).eval()
    input_ids = torch.tensor([_prompt_ids(args, tokenizer)] * args.num_samples, device=args.device)
    gpt_form = config.prediction_stream == "content" and config.default_attention == "causal"
    group_size = args.group_size
    diffusion = args.diffusion_threshold is not None or args.diffusion_steps is not None
    if not diffusion and group_size is None and args.draft_group_size is None and is_diffusion_model(config):
        diffusion = True  # an mdlm / bd3lm checkpoint decodes by diffusion unless asked otherwise
        logger.info("no --diffusion_threshold / --diffusion_steps: diffusion decoding with one commit per step")
    if diffusion and (group_size is not None or args.draft_group_size is not None):
        raise ValueError("--diffusion_threshold / --diffusion_steps choose diffusion decoding; drop --group_size / "
                         "--draft_group_size")
    if group_size is None and args.draft_group_size is None and not gpt_form and not diffusion:
        group_size = default_group_size(config)  # group decoding, t = 1 included (not transformers' loop)
        if group_size != 1:
            logger.info("no --group_size: decoding t = %d tokens per forward, the smallest group size this "
                        "checkpoint trained (it never trained t = 1); --group_size sets it", group_size)
    decoder = {name: value for name, value in (("group_size", group_size), ("draft_group_size", args.draft_group_size))
               if value is not None}
    if args.speculation_break_even is not None:
        if args.draft_group_size is None:
            raise ValueError("--speculation_break_even tunes self-speculative decoding: give --draft_group_size too")
        decoder["speculation_break_even"] = args.speculation_break_even
    if diffusion:
        decoder["decoding"] = DiffusionDecoding(threshold=args.diffusion_threshold, steps=args.diffusion_steps)
    if decoder:  # group decoding draws with the seeded generator (transformers' loop: torch's seeded global one)
        decoder["generator"] = generator
        if args.do_sample and args.top_k is None and config.prediction_stream != "content":
            decoder["top_k"] = 0  # the query stream samples the whole distribution without --top_k (generate(): 50)
    result = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens,
        use_cache=not args.no_cache, pad_token_id=tokenizer.pad_token_id, allow_untrained=args.allow_untrained,
        return_dict_in_generate=True, **decoder, **{k: v for k, v in sampling.items() if v is not None},
    )
    outputs = [tokenizer.decode(row[input_ids.shape[1]:], skip_special_tokens=True) for row in result.sequences.tolist()]
    if diffusion:
        info = {"mode": "diffusion", "diffusion_threshold": args.diffusion_threshold,
                "diffusion_steps": args.diffusion_steps, "diffusion_block": diffusion_block_of(config),
                "forwards": result.num_forwards, "new_tokens": result.num_new_tokens.tolist(),
                "tokens_per_forward": result.tokens_per_forward}
    elif args.draft_group_size is not None:
        info = {"mode": "self_speculative", "draft_group_size": args.draft_group_size,
                "acceptance_rate": result.acceptance_rate, "forwards": result.num_forwards,
                "speculative_steps": result.num_speculative_steps, "plain_steps": result.num_plain_steps}
    elif is_one_stream_group_model(config):
        info = {"mode": f"one stream, {config.attention_group_size} tokens per forward (block-causal)"}
    elif gpt_form and args.group_size is None:
        info = {"mode": "causal (single stream)"}
    else:
        info = {"mode": "group_decoding", "group_size": group_size}
    info["max_new_tokens"] = args.max_new_tokens
    return outputs, info


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
        if "tokens_per_forward" in info:
            print(f"diffusion decoding: {info['forwards']} forwards, {info['tokens_per_forward']:.2f} new tokens per "
                  "forward", file=sys.stderr)
    return 0
