""":func:`load_checkpoint`, the one way the package's commands load a model: the checkpoint is checked first
(``weights.check_local_checkpoint``: its kind, its weights files, its tensors against config.json), then loaded,
then its weights are checked for NaN and infinity, so that a broken checkpoint fails with one line that names
what is wrong instead of generating from re-initialised or NaN weights. :func:`load_pretrained` does the same
for a head by name, for a local folder or a Hub repo.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .files import read_json
from .remote_code import HEADS
from .weights import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, check_finite, check_local_checkpoint, check_weights

logger = logging.getLogger(__name__)

def _fetch_weights(repo_id: str, hub_kwargs: dict) -> Path:
    """Download the weights of ``repo_id`` (into the cache) and return the snapshot folder that holds them."""
    from huggingface_hub import hf_hub_download

    # only the server saying "no such file" counts as missing; offline cache misses keep their own error
    from huggingface_hub.errors import RemoteEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, WEIGHTS_NAME, **hub_kwargs)).parent
    except RemoteEntryNotFoundError:
        pass
    try:
        index = Path(hf_hub_download(repo_id, WEIGHTS_INDEX_NAME, **hub_kwargs))
    except RemoteEntryNotFoundError:
        raise ValueError(
            f"no weights in the Hub repo {repo_id}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}. "
            f"Push the checkpoint again (hf-lookaround push <checkpoint_dir> {repo_id})."
        ) from None
    data = read_json(index) or {}
    for shard in sorted(set((data.get("weight_map") or {}).values())):
        try:
            hf_hub_download(repo_id, shard, **hub_kwargs)
        except RemoteEntryNotFoundError:
            raise ValueError(f"{shard}, listed in {WEIGHTS_INDEX_NAME}, is missing from the Hub repo {repo_id}; "
                             "push the checkpoint again") from None
    return index.parent


def load_checkpoint(auto_class, model_name_or_path, command: str, kinds=("text",), **kwargs):
    """``auto_class.from_pretrained(model_name_or_path, **kwargs)``, checked before (a local folder: see
    ``check_local_checkpoint``; ``command`` (say ``"hf-lookaround generate"``) reads the checkpoint ``kinds``) and after
    (no NaN or infinity in the loaded weights). Raises ValueError with one line otherwise."""
    check_local_checkpoint(model_name_or_path, command, kinds)
    model = auto_class.from_pretrained(model_name_or_path, **kwargs)
    check_finite(model.named_parameters(), str(model_name_or_path))
    return model


def load_pretrained(repo_or_dir, head: str = "base", **kwargs):
    """Load a LookAround checkpoint (local folder or Hub repo id) into ``head`` with the package's classes.

    ``head`` is one of :data:`HEADS` (base, pretraining, masked-lm, causal-lm, sequence-classification).
    The weights are checked first (present, valid safetensors), so a broken checkpoint fails with a
    ValueError that names the file; ``kwargs`` go to ``from_pretrained`` (``revision``, ``cache_dir``,
    ``token`` and ``local_files_only`` also to the download).
    """
    import transformers  # the package registered the LookAround Auto classes when this module was imported

    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {sorted(HEADS)}")
    if not Path(repo_or_dir).is_dir():
        hub_kwargs = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
        snapshot = _fetch_weights(str(repo_or_dir), hub_kwargs)
        check_weights(snapshot, where=f"the Hub repo {repo_or_dir} (cached in {snapshot})")
    auto_class = getattr(transformers, HEADS[head][0])
    return load_checkpoint(auto_class, repo_or_dir, "load_pretrained()", kinds=("text", "vision"), **kwargs)
