"""lm-evaluation-harness on every text checkpoint: the model class ``lookaround``.

lm-eval 0.4 discovers no model plugins: importing this module registers the class with ``register_model``, then
``lm_eval.simple_evaluate(model="lookaround", model_args="pretrained=CKPT", ...)`` runs it, and
``hf-lookaround lm-eval --model_args pretrained=CKPT --tasks ...`` imports it and hands the rest of its command
line to lm-eval's own. Each request goes through the checkpoint's own likelihood (``path``, from its objective):

- ``ar``: the exact ``log p(continuation | context)`` of the causal view, where the checkpoint has one (ar, dar in
  either form, mixtures with a look-ahead half, any ``AutoModelForCausalLM``): ``perplexity.ar_window_nlls``.
- ``elbo``: diffusion checkpoints (mdlm, bd3lm; BD3-LM's one-stream ``x_t ⊕ x_0`` form too; a mixture without a
  look-ahead component but with one diffusion component, e.g. mdlm + vmlm, by that component's bound and
  parameters: ``perplexity.elbo_objective``): the seeded Monte-Carlo ELBO of the continuation given the
  context, as LLaDA and dllm score them: ``mc_num`` draws of a time t and a mask of a fraction t of the
  continuation only, each token weighted by the schedule (1/t, linear), ``perplexity.draw_elbo_plan`` /
  ``elbo_plan_nlls``. The draws of a request are seeded by ``seed`` and the request's tokens, so a score depends
  on neither the batch size nor the order of the requests. ``path=elbo`` given on a mixture with a look-ahead
  component scores its diffusion component's bound too; a mixture of two diffusion objectives (mdlm + bd3lm, which
  ``pretrain`` refuses: they record different blocks) is refused in one line, since no rule makes either bound the
  checkpoint's.
- ``masked``: other masked checkpoints (mlm, vmlm, span, GVP, their mixtures): the masked-prefix protocol, ``p(x_k | x_<k)`` with
  the prefix visible and ``k`` masked, one row per continuation token (``perplexity._per_prefix``). ``path=elbo``
  scores mlm, vmlm, span and their mixtures by MDLM's bound instead (``perplexity.elbo_objective``).

``loglikelihood_rolling`` scores a document in the windows of ``hf-lookaround perplexity`` (``max_length``,
default ``config.trained_block_size``; ``stride``, default half of it) through the same functions, so its total
NLL is the command's. ``generate_until`` decodes with the checkpoint's own decoder (``decoder``, default
:func:`default_decoder`): diffusion decoding for a checkpoint that records a diffusion plan (mdlm, bd3lm in either
form, a mixture with one; ``DiffusionDecoding``, what ``generate(diffusion_threshold=... | diffusion_steps=...)`` runs), group
decoding on the ``ar`` path, else the package's infilling of ``max_gen_toks`` hidden tokens after the prompt.
"""

from __future__ import annotations

import logging
import zlib
from collections import defaultdict

import numpy as np
import torch
try:
    import lm_eval.models  # noqa: F401  (lm-eval's own models, `hf` among them: its registry reads them only if empty)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as err:  # an optional extra: say which
    raise ImportError(f"the lookaround lm-eval model needs lm-evaluation-harness ({err}): "
                      "pip install 'hf-lookaround[lm-eval]'") from err
from tqdm.auto import tqdm

from .. import objectives
from ..decoding import DiffusionDecoding, decodes_by_diffusion, is_block_diffusion_model, is_one_stream_group_model
from ..plans import Plan
from . import perplexity as ppl

logger = logging.getLogger(__name__)

PATHS = ("ar", "elbo", "masked")
DECODERS = ("diffusion", "group", "infill")
ELBO_DOCUMENT_BATCH = 1 << 30  # elbo_perplexity's batch_size for one document: all its windows at once
CONTINUATION_TOO_LONG = ("a continuation of {n} tokens does not fit the window of {w} tokens (BOS and at least "
                         "the continuation): raise max_length in model_args (the checkpoint's positions allow {limit})")


def check_checkpoint(pretrained, command: str, finite: bool = False) -> None:
    """The package loader's checks on a local folder lm-eval is about to load, in one line each, before lm-eval
    or transformers reads a file of it (its tokenizer, its config): a vision checkpoint (lm-eval needs text); a
    run still writing or a cut safetensors file (as ``from_pretrained`` words it); for a LookAround text checkpoint,
    also its weights files and tensors (``weights.check_local_checkpoint``; a model of another type is left to
    transformers there) and, with ``finite``, its values (one more read of the weights; else ``from_pretrained``
    refuses NaN weights as it loads them). A Hub name is left to ``from_pretrained``."""
    from pathlib import Path

    from ..hub.weights import check_local_checkpoint, checkpoint_kind
    from ..models.lookaround.loading_lookaround import check_weights_files

    folder = Path(pretrained)
    if not folder.is_dir():
        return
    kind = checkpoint_kind(folder)
    if kind == "vision":
        raise ValueError(f"{folder} is a vision checkpoint: lm-eval needs a text checkpoint (one saved by "
                         f"hf-lookaround pretrain, glue or convert); score this one with hf-lookaround vision")
    check_weights_files(folder)  # from_pretrained's own first check: a cut file named with its sizes
    if kind == "text":
        check_local_checkpoint(folder, command, finite=finite)


def likelihood_path(config) -> str:
    """How a checkpoint scores text: ``ar`` where it has a causal view (a look-ahead objective or mixture component,
    or no recorded objective: any causal LM), else ``elbo`` where it trained a diffusion objective (mdlm, bd3lm, or a
    mixture's diffusion component: ``perplexity.elbo_objective`` says whose bound), else ``masked``."""
    objective, params = getattr(config, "objective", None), getattr(config, "plan_params", None)
    if objective not in objectives.OBJECTIVES or objectives.LOOK_AHEAD in objectives.families(objective, params):
        return "ar"
    return "elbo" if objectives.diffusion_components(objective, params) else "masked"


def default_decoder(config, path: str) -> str:
    """How ``generate_until`` decodes a checkpoint: ``diffusion`` where it records a diffusion plan
    (``config.diffusion_block_size``) and predicts with the query stream or in BD3-LM's one-stream ``x_t ⊕ x_0``
    layout, ``group`` on the ``ar`` path, else ``infill`` (other masked checkpoints, and mdlm's ``[MASK]`` form)."""
    if decodes_by_diffusion(config):
        return "diffusion"
    return "group" if path == "ar" else "infill"


def request_seed(seed: int, tokens: list[int]) -> int:
    """A request's own seed: ``seed`` and its tokens, so its draws do not depend on what else is in the batch."""
    # 32 bits: torch's CPU generator (mt19937) keeps only the low 32 bits of a seed
    return zlib.crc32(np.asarray([seed, *tokens], dtype=np.int64).tobytes())


def cut_at_stops(text: str, until: list[str]) -> str:
    """``text`` up to the first of the ``until`` strings (lm-eval's stop sequences)."""
    for stop in until:
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text


@register_model("lookaround")
class LookAroundLM(TemplateLM):
    """lm-eval's model ``lookaround``: ``model_args`` ``pretrained`` (a checkpoint folder or Hub name), ``path``
    (``ar``/``elbo``/``masked``; default from the objective, :func:`likelihood_path`), ``mc_num`` (ELBO draws per
    request, default 128), ``seed``, ``max_length`` / ``stride`` (windows), ``max_gen_toks``, ``decoder``
    (``diffusion``/``group``/``infill``; default :func:`default_decoder`), ``group_size`` (group decoding),
    ``diffusion_threshold`` / ``diffusion_steps`` (diffusion decoding: commit every position at least this confident,
    or a fixed number of steps per block; neither: one commit per step; ``diffusion_steps`` and ``diffusion_block``
    also set the infilling decoder's steps and blocks), ``batch_size`` (rows per forward: requests on the ``ar``
    path and in generation, ELBO draws on ``elbo``, prefix rows on ``masked``), ``device``, ``dtype``."""

    def __init__(self, pretrained: str, path: str | None = None, mc_num: int = 128, seed: int = 0,
                 max_length: int | None = None, stride: int | None = None, max_gen_toks: int = 256,
                 group_size: int | None = None, decoder: str | None = None, diffusion_threshold: float | None = None,
                 diffusion_steps: int | None = None, diffusion_block: int | None = None, batch_size: int | str = 1, max_batch_size: int | None = None,
                 device: str | None = None, dtype: str = "float32", tokenizer: str | None = None,
                 trust_remote_code: bool = True, **unused):
        super().__init__()
        import transformers

        from ..data.tokenization import auto_tokenizer
        from ..hub.load import load_checkpoint

        if unused:
            raise ValueError(f"lookaround model_args do not take {sorted(unused)}; see `help(LookAroundLM)`")
        command = "lm-eval --model lookaround"
        # refused here in one line, before its config or tokenizer loads: a vision checkpoint, damaged weights
        check_checkpoint(pretrained, command)
        config = transformers.AutoConfig.from_pretrained(pretrained)
        self.path, self.elbo_objective = path or likelihood_path(config), None
        if self.path not in PATHS:
            raise ValueError(f"path={self.path!r}: choose one of {PATHS}")
        if self.path == "elbo":  # whose bound: the diffusion objective, or a mixture's one diffusion component
            causal = likelihood_path(config) == "ar"
            self.elbo_objective, _ = ppl.elbo_objective(config, "path=elbo",
                                                        "use path=ar" if causal else "use path=masked")
        two_stream = "LookAroundForPreTraining" in (config.architectures or [])
        auto = {"ar": transformers.AutoModelForCausalLM}.get(self.path, transformers.AutoModelForMaskedLM)
        if two_stream:
            auto = transformers.AutoModelForPreTraining
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = dtype if dtype == "auto" else getattr(torch, str(dtype), None)
        if torch_dtype is None:
            raise ValueError(f"dtype={dtype!r} is not a torch dtype (float32, bfloat16, float16, auto)")
        self.model = load_checkpoint(auto, pretrained, command, kinds=("text", "other"), dtype=torch_dtype,
                                     trust_remote_code=trust_remote_code).to(self._device).eval()
        self.tokenizer = auto_tokenizer(tokenizer or pretrained)
        self.pretrained = str(pretrained)
        self.bos = ppl._bos_id(self.tokenizer)
        self.pad = ppl._pad_id(self.model, self.tokenizer)
        self.mask_id = getattr(self.tokenizer, "mask_token_id", None)
        if self.mask_id is None:
            self.mask_id = getattr(config, "mask_token_id", None)
        if self.path != "ar" and not two_stream and self.mask_id is None:
            raise ValueError("a single-stream masked checkpoint reads [MASK] inputs: its tokenizer and config have no "
                             "mask token")
        if self.path == "masked" and is_one_stream_group_model(config):
            raise ValueError("dar's one-stream form has no bidirectional prefix to mask: use path=ar")

        if not str(batch_size).isdigit():
            raise ValueError(f"batch_size={batch_size!r}: lookaround takes a number of rows per forward (no 'auto')")
        self.batch_size = int(batch_size)
        self.mc_num, self.seed = int(mc_num), int(seed)
        if self.batch_size < 1 or self.mc_num < 2:
            raise ValueError(f"batch_size must be >= 1 and mc_num >= 2 (the ELBO's standard error needs two draws), "
                             f"got batch_size={batch_size}, mc_num={mc_num}")
        # the windows of `hf-lookaround perplexity`: the trained length, within the positions
        self.limit = ppl.window_limit(config)
        self.max_length = int(max_length) if max_length is not None else ppl.default_max_length(config)
        if not 2 <= self.max_length <= self.limit:
            raise ValueError(f"max_length={self.max_length}: must lie in [2, {self.limit}] (the checkpoint's positions)")
        self.stride = int(stride) if stride is not None else max(1, self.max_length // 2)
        self._set_up_decoding(config, max_gen_toks, group_size, decoder, diffusion_threshold, diffusion_steps,
                              diffusion_block)
        logger.info("lookaround: %s scored by the %s path (max_length %d, stride %d%s)", pretrained, self.path,
                    self.max_length, self.stride, f", {self.elbo_objective}'s bound, mc_num {self.mc_num}, seed "
                    f"{self.seed}" if self.path == "elbo" else "")
        if self.path == "elbo":
            logger.warning("lookaround: is_greedy is not defined for the ELBO of a diffusion checkpoint (no "
                           "left-to-right argmax): every request reports False")

    def _set_up_decoding(self, config, max_gen_toks, group_size, decoder, diffusion_threshold, diffusion_steps,
                         diffusion_block) -> None:
        """``generate_until``'s decoder and its knobs, checked against the checkpoint now, not at the first
        generation task."""
        self.max_gen_toks, self.group_size = int(max_gen_toks), group_size and int(group_size)
        self.diffusion_steps = diffusion_steps and int(diffusion_steps)
        self.diffusion_block = diffusion_block and int(diffusion_block)
        self.decoder = decoder or default_decoder(config, self.path)
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder={self.decoder!r}: choose one of {DECODERS}")
        if is_block_diffusion_model(config) and (self.path, self.decoder) != ("elbo", "diffusion"):
            # x_t ⊕ x_0 is its only input: no causal view, no [MASK]-only input for the masked prefix or infilling
            raise ValueError(f"this checkpoint is BD3-LM's one-stream form (x_t ⊕ x_0): it is scored by path=elbo and "
                             f"decoded by decoder=diffusion only, got path={self.path}, decoder={self.decoder}: drop "
                             f"path and decoder from model_args")
        self.diffusion = None
        if self.decoder == "diffusion":  # its knobs and the trained block
            self.diffusion = DiffusionDecoding(
                threshold=None if diffusion_threshold is None else float(diffusion_threshold),
                steps=self.diffusion_steps, block=self.diffusion_block)
            self.diffusion.check(config)
        elif diffusion_threshold is not None:
            raise ValueError(f"diffusion_threshold applies to diffusion decoding; this checkpoint decodes with "
                             f"decoder={self.decoder}: drop diffusion_threshold")

    # ------------------------------------------------------------------ lm-eval's TemplateLM interface
    @property
    def device(self):
        return self._device

    @property
    def eot_token_id(self):
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self):
        return self.bos if self.bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=False, verbose=False)["input_ids"]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        rows, firsts, truncated = [], [], 0
        for _, context, continuation in requests:
            row, first, cut = self._row(list(context), list(continuation))
            rows.append(row)
            firsts.append(first)
            truncated += cut
        if truncated:
            logger.warning("lookaround: the context of %d of %d requests was cut on the left to the window of %d "
                           "tokens (BOS kept)", truncated, len(rows), self.max_length)
        if self.path == "elbo":
            bar = tqdm(range(len(rows)), desc="lookaround ELBO", disable=disable_tqdm)
            return [(-self.elbo_loglikelihood(rows[i], firsts[i])[0], False) for i in bar]
        windows = [ppl.Window(row, first, int(row[0] == self.bos)) for row, first in zip(rows, firsts)]
        nlls, greedy = self.window_nlls(windows, disable_tqdm)
        return [(-float(n.double().sum()), bool(g.all())) for n, g in zip(nlls, greedy)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A document's log-likelihood in the windows of ``hf-lookaround perplexity`` (BOS first when the tokenizer
        has one): the same functions, so ``-sum`` is its total NLL (``elbo``: its seeded estimate)."""
        out = []
        for request in tqdm(requests, desc="lookaround rolling", disable=disable_tqdm):
            (text,) = request.args[:1]
            out.append(-self.document_nll(text))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, ``do_sample``) continuations of at most ``max_gen_toks`` tokens, cut at the first
        ``until`` string (and at EOS): :meth:`diffusion_decoder`, :meth:`group_decoder` or :meth:`infill_decoder`
        (``decoder``), ``batch_size`` requests per batch."""
        out = [None] * len(requests)
        groups = defaultdict(list)  # requests with the same generation options decode in one batch
        for i, request in enumerate(requests):
            context, options = request.args
            groups[repr(sorted(options.items()))].append(i)
        bar = tqdm(total=len(requests), desc="lookaround generate", disable=disable_tqdm)
        decode = {"diffusion": self.diffusion_decoder, "group": self.group_decoder,
                  "infill": self.infill_decoder}[self.decoder]
        for indices in groups.values():
            options = dict(requests[indices[0]].args[1])
            until = options.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(options.pop("max_gen_toks", self.max_gen_toks))
            do_sample = bool(options.pop("do_sample", False))
            temperature = options.pop("temperature", None)
            if temperature == 0:
                do_sample, temperature = False, None
            if options:
                logger.warning("lookaround: generation options %s are not used (the decoders take do_sample, "
                               "temperature, until, max_gen_toks)", sorted(options))
            if self.tokenizer.eos_token:
                until.append(self.tokenizer.eos_token)
            prompts = [self._prompt(requests[i].args[0], max_new) for i in indices]
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                new = decode(prompts[start : start + len(chunk)], max_new, do_sample, temperature)
                for i, ids in zip(chunk, new):
                    text = self.tokenizer.decode(ids, skip_special_tokens=False)
                    out[i] = cut_at_stops(text, until)
                bar.update(len(chunk))
        bar.close()
        return out

    # ------------------------------------------------------------------ the scorers
    def _row(self, context: list[int], continuation: list[int]) -> tuple[list[int], int, bool]:
        """BOS, context, continuation, cut on the left to ``max_length`` (BOS kept); and the first scored index."""
        if not continuation:
            raise ValueError("a loglikelihood request has an empty continuation: there is nothing to score")
        head = [self.bos] if self.bos is not None else []
        if head and context[:1] == head:
            context = context[1:]
        keep = self.max_length - len(head) - len(continuation)  # context tokens the window holds
        if len(head) + min(keep, len(context)) < 1 or keep < 0:  # every scored token needs one visible before it
            raise ValueError(CONTINUATION_TOO_LONG.format(n=len(continuation), w=self.max_length, limit=self.limit))
        cut = len(context) > keep
        context = head + (context[max(0, len(context) - keep):] if keep else [])
        return context + continuation, len(context), cut

    @torch.inference_mode()
    def window_nlls(self, windows: list, disable_tqdm: bool = True):
        """Per window, the NLLs of its scored tokens and whether each is the argmax (``ar`` and ``masked``),
        batched ``batch_size`` at a time, longest first (less padding), returned in the given order."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i].input_ids))
        nlls, greedy = [None] * len(windows), [None] * len(windows)
        for start in tqdm(range(0, len(order), self.batch_size), desc="lookaround", disable=disable_tqdm):
            chunk = order[start : start + self.batch_size]
            flags = []
            batch = [windows[i] for i in chunk]
            if self.path == "ar":
                got, _ = ppl.ar_window_nlls(self.model, batch, self.batch_size, self.pad, self.bos, flags)
            else:
                got = ppl._per_prefix(self.model, batch, self.batch_size, self.pad, self.mask_id,
                                      two_stream=ppl.is_two_stream(self.model), greedy=flags)
            for i, n, g in zip(chunk, got, flags):
                nlls[i], greedy[i] = n, g
        return nlls, greedy

    @torch.inference_mode()
    def elbo_loglikelihood(self, row: list[int], first_scored: int) -> tuple[float, float]:
        """The negative ELBO of ``row[first_scored:]`` given ``row[:first_scored]`` (visible), from ``mc_num``
        draws seeded by ``seed`` and the row, run ``batch_size`` draws per forward; and its standard error."""
        generator = torch.Generator().manual_seed(request_seed(self.seed, row))
        ids = torch.tensor([row] * self.mc_num)
        attention = torch.ones_like(ids)
        plan = ppl.draw_elbo_plan(self.model, attention.sum(1), ids.shape[1], first_scored, generator)
        totals = []
        for s in range(0, self.mc_num, self.batch_size):
            part = slice(s, s + self.batch_size)
            sub = Plan(plan.group_ids[part], plan.is_target[part], plan.loss_weights[part])
            totals.append(ppl.elbo_plan_nlls(self.model, ids[part], attention[part], sub, first_scored, self.mask_id))
        totals = np.concatenate(totals)
        return float(totals.mean()), float(totals.std(ddof=1) / np.sqrt(self.mc_num))

    def document_nll(self, text: str) -> float:
        """The total NLL of a document as ``hf-lookaround perplexity --max_length L --stride S`` scores it
        (``elbo``: ``--num_samples mc_num --seed seed``, with all the document's windows in one batch: a draw
        covers the whole batch, so the estimate would otherwise change with ``batch_size``)."""
        if not text:
            return 0.0
        args = (self.model, self.tokenizer, [text], self.max_length, self.stride)
        if self.path == "ar":
            result = ppl.ar_perplexity(*args, self.batch_size)
        elif self.path == "elbo":
            # every window of the document in one forward per draw: the draws then do not depend on batch_size
            result = ppl.elbo_perplexity(*args, ELBO_DOCUMENT_BATCH, num_samples=self.mc_num, seed=self.seed)
        else:
            result = ppl.masked_perplexity(*args, self.batch_size, progress=False)
        return float(result.nlls.sum())

    # ------------------------------------------------------------------ the decoders
    def _prompt(self, context: str, max_new: int) -> list[int]:
        ids = self.tok_encode(context)
        head = [self.bos] if self.bos is not None else []
        room = self.limit - max_new - len(head)
        if room < 1:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt in the checkpoint's {self.limit} "
                             "positions: lower max_gen_toks")
        if len(ids) > room:
            logger.warning("lookaround: a prompt of %d tokens was cut on the left to %d", len(ids), room)
            ids = ids[-room:]
        return head + ids

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts as one left-padded batch on the device, and its attention mask."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
        return ids.to(self._device), mask.to(self._device)

    @torch.inference_mode()
    def diffusion_decoder(self, prompts: list[list[int]], max_new: int, do_sample: bool, temperature
                          ) -> list[list[int]]:
        """Diffusion decoding (``DiffusionDecoding``: blocks left to right with a KV cache, parallel unmasking by
        ``diffusion_threshold`` or ``diffusion_steps``) of left-padded prompts, each row at its own pace; the new
        tokens of each row. The checkpoint's own ``generate(decoding=...)``; on the loaded pretraining head, the same
        decoder through ``group_generate(decoding=...)``. Sampling is seeded by ``seed``."""
        from ..decoding import group_generate

        ids, mask = self._left_padded(prompts)
        generator = torch.Generator(device=self._device).manual_seed(self.seed)
        out = group_generate(self.model, ids, mask, decoding=self.diffusion, max_new_tokens=max_new,
                             do_sample=do_sample, temperature=temperature,
                             pad_token_id=self.pad, generator=generator)
        return [self._until_eos(row[ids.shape[1]:].tolist()) for row in out]

    @torch.inference_mode()
    def group_decoder(self, prompts: list[list[int]], max_new: int, do_sample: bool, temperature) -> list[list[int]]:
        """Group decoding (``group_size``, default the checkpoint's) of left-padded prompts, the new tokens of each
        row: ``group_generate`` on a two-stream head, the causal LM's ``generate()`` otherwise. Sampling is seeded
        by ``seed``."""
        from ..decoding import group_generate

        ids, mask = self._left_padded(prompts)
        width = ids.shape[1]
        kwargs = dict(max_new_tokens=max_new, do_sample=do_sample, temperature=temperature, pad_token_id=self.pad)
        if self.group_size is not None:
            kwargs["group_size"] = self.group_size
        if ppl.is_two_stream(self.model):  # the query stream decodes, as pretraining trained it
            generator = torch.Generator(device=self._device).manual_seed(self.seed)
            out = group_generate(self.model, ids, mask, generator=generator, **kwargs)
        else:  # a causal LM: its own generate() (dar's one-stream form: group decoding by default)
            if do_sample:
                torch.manual_seed(self.seed)  # generate() samples from the global generator
            out = self.model.generate(ids, attention_mask=mask, **kwargs)
        return [self._until_eos(row[width:].tolist()) for row in out]

    def infill_decoder(self, prompts: list[list[int]], max_new: int, do_sample: bool, temperature
                       ) -> list[list[int]]:
        """The decoder of masked checkpoints without a diffusion plan (and of a diffusion one's ``[MASK]`` form): the
        package's infilling of ``max_new`` hidden tokens after each prompt, in LLaDA's semi-autoregressive blocks of
        ``diffusion_block`` tokens (default: bd3lm's block, else all at once), ``diffusion_steps`` steps per block
        (default: one token per step), seeded per request."""
        from ..decoding import infill

        block = self.diffusion_block or dict(self.model.config.plan_params or {}).get("diffusion_block")
        out = []
        for prompt in prompts:
            generator = torch.Generator(device=self._device).manual_seed(request_seed(self.seed, prompt))
            filled = infill(self.model, None, torch.tensor(prompt), num_tokens=max_new, add_bos=False,
                            steps=self.diffusion_steps, block_length=block, do_sample=do_sample,
                            temperature=temperature, generator=generator)
            out.append(self._until_eos(filled.sequences[0, len(prompt):].tolist()))
        return out

    def _until_eos(self, ids: list[int]) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return ids[: ids.index(eos)] if eos is not None and eos in ids else ids
