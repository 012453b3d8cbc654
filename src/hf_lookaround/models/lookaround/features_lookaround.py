"""Which state of a frozen or fine-tuned backbone stands for a token: the named features that probing
(``evaluation/probing.py``), GLUE fine-tuning (``LookAroundForSequenceClassification``) and the study read.

- ``content_last_layer``: the content stream's last layer under ``attention_pattern`` (as pretrained by default).
  A two-stream checkpoint's loss never reads it (``content_output=False``): it is what the model computes beside
  its predictions, not the prediction state.
- ``prediction_state``: the state that predicts, taken in the form's own training layout.

  * look-ahead families (``ar``, ``dar``, mixtures with a look-ahead component), two streams: column ``i`` holds the
    query row that predicts token ``i + 1`` from tokens ``<= i`` under a plan of the objective in which token
    ``i + 1`` opens a group (the dar rule ``g = 1 + (k - s1) // t`` with ``s1 = (i mod t) + 1``; ``t`` laid out
    once per ``s1``, stacked in the batch, as the one-stream next-token view does). The content stream sees its
    own group, as in training. ``t = 1`` is the AR plan: the query rows of the causal LM's two-stream view.
  * dar's one-stream form: the rows of the causal LM's next-token view (``one_stream_next_token_layouts``):
    column ``i`` is the row that predicts token ``i + 1`` after seeing every earlier token, in the training layout
    with its start rows.
  * masked and GVP families, two streams: column ``i`` holds the query row that predicts token ``i`` with ``i``
    hidden: the positions are split into ``round(1 / MASKED_FEATURE_RATIO)`` strided sets and each set is hidden
    in turn under the masked plan's ranks (condition 0, visible 1, hidden 2; ``infilling_ranks``), so every token
    is predicted once from about 85 % of the text, as in BERT-ratio training. (Hiding every position at once would
    leave each query row nothing but BOS to read.)
  * one-stream causal (GPT) and ``[MASK]`` (BERT) forms: the content stream's last layer: it is their prediction
    state.
  * BD3-LM's one-stream form (``default_attention="block_diffusion"``) reads only ``x_t ⊕ x_0``; a plain sequence
    of ids would be misread as the two halves. Its prediction state: the ``x_t`` row of each token with that token
    ``[MASK]`` in ``x_t``, the strided sets of the masked families hidden in turn, so every token is predicted from
    the rest of its block (about 85 % of it visible) and the clean blocks before it. Its ``content_last_layer`` as
    pretrained: the clean half ``x_0`` of the layout (block-causal over the text, as a two-stream bd3lm's content
    stream); a forced ``attention_pattern`` runs the plain forward under that pattern, as for every checkpoint.

``all_layers=True`` gives the same rows after the embeddings and after every layer: ``num_hidden_layers + 1`` tables,
the last equal to the single one.
"""

from __future__ import annotations

import torch

from .configuration_lookaround import FEATURES
from .decoding_lookaround import (
    default_group_size, is_block_diffusion_model, is_one_stream_group_model, trained_group_sizes,
)
from .layout_lookaround import one_stream_next_token_layouts
from .masking_lookaround import NO_TARGET_RANK, infilling_ranks

__all__ = ["FEATURES", "MASKED_FEATURE_RATIO", "token_states", "reads_query_stream", "positions_past_input"]

MASKED_FEATURE_RATIO = 0.15  # BERT's ratio, the lowest the text masked objectives train


def check_features(features: str) -> None:
    if features not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")


def reads_query_stream(config, features: str) -> bool:
    """Whether these features come from the query stream (a two-stream checkpoint's prediction state)."""
    return features == "prediction_state" and getattr(config, "prediction_stream", None) == "query"


def positions_past_input(config, features: str) -> int:
    """Positions the features read past the input: 1 for a look-ahead two-stream prediction state (the last column's
    row predicts the token after the input, at the next position), else 0."""
    return int(reads_query_stream(config, features) and bool(trained_group_sizes(config)))


def token_states(backbone, input_ids, attention_mask=None, features: str = "prediction_state",
                 attention_pattern: str | None = None, all_layers: bool = False):
    """The named state of every input token, ``(B, T, D)`` (right padding), or with ``all_layers`` a list of
    ``num_hidden_layers + 1`` of them. ``backbone`` is a ``LookAroundModel``; gradients flow (fine-tuning)."""
    check_features(features)
    config = backbone.config
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if is_block_diffusion_model(config) and (features == "prediction_state" or attention_pattern is None):
        if attention_pattern is not None:
            raise ValueError(_PATTERN_ERROR.format(attention_pattern))
        return _block_diffusion_states(backbone, input_ids, attention_mask, features, all_layers)
    if features == "content_last_layer" or config.prediction_stream != "query" and not is_one_stream_group_model(config):
        pattern = attention_pattern if features == "content_last_layer" else None
        if features != "content_last_layer" and attention_pattern is not None:
            raise ValueError(_PATTERN_ERROR.format(attention_pattern))
        tables = _run(backbone, all_layers, input_ids=input_ids, attention_mask=attention_mask,
                      attention_pattern=pattern)
        return _pick(tables, all_layers, lambda hidden: hidden[:, : input_ids.shape[1]])
    if attention_pattern is not None:
        raise ValueError(_PATTERN_ERROR.format(attention_pattern))
    if is_one_stream_group_model(config):
        return _one_stream_group_states(backbone, input_ids, attention_mask, all_layers)
    if trained_group_sizes(config):
        return _look_ahead_states(backbone, input_ids, attention_mask, default_group_size(config), all_layers)
    return _look_around_states(backbone, input_ids, attention_mask, all_layers)


_PATTERN_ERROR = ("attention_pattern={!r} applies to content_last_layer; prediction_state is read in the checkpoint's "
                  "own training layout: drop the pattern or ask for features='content_last_layer'")


def _run(backbone, all_layers: bool, **inputs) -> list:
    """Every row of the forward (content, then query stream), after the last layer or, with ``all_layers``, after
    the embeddings and after each layer (the last one normalised, as the model returns it)."""
    captured, handles = [], []
    if all_layers:  # the layers' own inputs and outputs: the query rows too, which hidden_states leave out
        handles.append(backbone.layers[0].register_forward_pre_hook(lambda _, args: captured.append(args[0])))
        handles += [layer.register_forward_hook(lambda _, args, output: captured.append(output[0]))
                    for layer in backbone.layers[:-1]]
    try:
        out = backbone(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    rows = [out.last_hidden_state] + ([out.query_hidden_state] if out.query_hidden_state is not None else [])
    return captured + [torch.cat(rows, dim=1)]


def _pick(tables: list, all_layers: bool, select):
    picked = [select(hidden) for hidden in tables]
    return picked if all_layers else picked[-1]


def _one_stream_group_states(backbone, input_ids, attention_mask, all_layers: bool):
    config = backbone.config
    t = config.attention_group_size
    if t == 1:  # block-causal with groups of one is causal: the rows are the tokens'
        tables = _run(backbone, all_layers, input_ids=input_ids, attention_mask=attention_mask,
                      attention_pattern="block_causal")
        return _pick(tables, all_layers, lambda hidden: hidden)
    layouts, rows = one_stream_next_token_layouts(input_ids, attention_mask, t, config.bos_token_id,
                                                  config.pad_token_id or 0)
    tables = _run(backbone, all_layers, input_ids=layouts, attention_pattern="block_causal")
    return _pick(tables, all_layers, lambda hidden: hidden.flatten(0, 1)[rows])


def _block_diffusion_states(backbone, input_ids, attention_mask, features: str, all_layers: bool):
    """BD3-LM's one-stream form, in its layout ``x_t ⊕ x_0`` (module doc): ``content_last_layer`` the clean half of
    ``x ⊕ x``; ``prediction_state`` the ``x_t`` rows of hidden tokens, ``K`` strided sets (BOS, the condition, never
    hidden), one layout each, stacked in the batch."""
    batch, length = input_ids.shape
    doubled = torch.cat([attention_mask, attention_mask], 1)
    if features == "content_last_layer":
        tables = _run(backbone, all_layers, input_ids=torch.cat([input_ids, input_ids], 1), attention_mask=doubled,
                      attention_pattern="block_diffusion")
        return _pick(tables, all_layers, lambda hidden: hidden[:, length:])
    device = input_ids.device
    sets = max(1, round(1 / MASKED_FEATURE_RATIO))
    column = torch.arange(length, device=device)
    which = torch.arange(sets, device=device).repeat_interleave(batch)[:, None]  # (K * B, 1): the hidden set
    clean = input_ids.repeat(sets, 1)
    noised = clean.masked_fill((column % sets == which) & (column > 0), backbone.config.mask_token_id)
    tables = _run(backbone, all_layers, input_ids=torch.cat([noised, clean], 1), attention_mask=doubled.repeat(sets, 1),
                  attention_pattern="block_diffusion")
    rows = (column % sets)[None, :] * batch + torch.arange(batch, device=device)[:, None]  # (B, T): column i's layout
    return _pick(tables, all_layers, lambda hidden: hidden[rows, column.expand(batch, length)])


def _look_ahead_states(backbone, input_ids, attention_mask, t: int, all_layers: bool):
    """Query rows at positions ``1..T`` under ``t`` dar plans (``s1 = 1..t``), one per layout, stacked in the batch;
    column ``i`` is read from the layout in which token ``i + 1`` opens a group."""
    batch, length = input_ids.shape
    device = input_ids.device
    s1 = torch.arange(1, t + 1, device=device)[:, None]  # (t, 1)
    k = torch.arange(length + 1, device=device)  # positions 0..T: the content's, and one past for the last row
    ranks = torch.where(k < s1, 0, 1 + torch.div(k - s1, t, rounding_mode="floor"))  # (t, T + 1): objectives/dar
    query_positions = k[1:].expand(t * batch, length)
    query_ranks = ranks[:, 1:].repeat_interleave(batch, 0)
    # a row past the model's last position predicts nothing (as in the causal LM's two-stream view)
    beyond = query_positions >= backbone.config.max_position_embeddings
    tables = _run(backbone, all_layers, input_ids=input_ids.repeat(t, 1), attention_mask=attention_mask.repeat(t, 1),
                  group_ids=ranks[:, :length].repeat_interleave(batch, 0),
                  query_position_ids=query_positions.masked_fill(beyond, 0),
                  query_group_ids=query_ranks.masked_fill(beyond, NO_TARGET_RANK))
    layout = torch.remainder(k[1:] - 1, t)  # (T,): the s1 - 1 under which token i + 1 opens a group
    sequence = torch.arange(batch, device=device)[:, None]

    def select(hidden):
        query = hidden[:, length:].view(t, batch, length, -1)
        return query[layout.expand(batch, length), sequence, torch.arange(length, device=device)]

    return _pick(tables, all_layers, select)


def _look_around_states(backbone, input_ids, attention_mask, all_layers: bool):
    """Every position hidden once: ``K`` strided sets, one forward each, stacked in the batch."""
    batch, length = input_ids.shape
    device = input_ids.device
    sets = max(1, round(1 / MASKED_FEATURE_RATIO))
    column = torch.arange(length, device=device)
    real = (attention_mask != 0).repeat(sets, 1)
    which = torch.arange(sets, device=device).repeat_interleave(batch)[:, None]  # (K * B, 1): the hidden set
    hidden = (column % sets == which) & real
    bos = backbone.config.bos_token_id
    ids = input_ids.repeat(sets, 1)
    is_condition = torch.zeros_like(hidden)
    if bos is not None:
        is_condition[:, 0] = (ids[:, 0] == bos) & ~hidden[:, 0] & real[:, 0]
    slots = -(-length // sets)
    targets = which + sets * torch.arange(slots, device=device)  # (K * B, slots): the columns of the set
    targets = torch.where((targets < length) & real.gather(1, targets.clamp(max=length - 1)), targets, -1)
    tables = _run(backbone, all_layers, input_ids=ids, attention_mask=attention_mask.repeat(sets, 1),
                  group_ids=infilling_ranks(hidden, is_condition), target_positions=targets)
    # column i sits in set i % K, slot i // K
    rows = (column % sets)[None, :] * batch + torch.arange(batch, device=device)[:, None]  # (B, T)
    slot = (column // sets).expand(batch, length)

    def select(states):
        return states[:, length:][rows, slot]

    return _pick(tables, all_layers, select)
