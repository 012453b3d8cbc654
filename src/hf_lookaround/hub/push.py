"""Push a checkpoint to the Hub (:func:`push_checkpoint`, ``hf-lookaround push``): weights, config, tokenizer,
card and the remote-code files, with ``HfApi.create_repo`` + ``HfApi.upload_folder``. The local checkpoint is
never modified: missing pieces (card, remote code, ``auto_map``) are generated in a staging folder.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
import tempfile
from pathlib import Path

from .cards import CARD_ARGS_KEY, write_model_card
from .remote_code import ensure_remote_code
from .weights import check_local_checkpoint

logger = logging.getLogger(__name__)

# Trainer state and pickles never go to the Hub; weights go as safetensors.
EXCLUDED_FILES = ("optimizer.*", "scheduler.*", "scaler.*", "rng_state*", "*.pt", "*.pth", "*.bin", "*.ckpt",
                  ".*", "*.lock", "final_model_complete.json")  # the last: a local run's completeness record



class HubPushError(RuntimeError):
    """A push failed; the local checkpoint is untouched and the push can simply be run again."""


def _files_to_push(folder: Path) -> list[Path]:
    files = sorted(
        p for p in folder.iterdir()
        if p.is_file() and not any(fnmatch.fnmatch(p.name, pattern) for pattern in EXCLUDED_FILES)
    )
    root = folder.resolve()
    for path in files:
        # a link out of the folder would upload a file the checkpoint does not hold (a key, another run's weights)
        if path.is_symlink() and root not in path.resolve().parents:
            raise ValueError(f"{path} is a symbolic link to {path.resolve()}, outside {folder}: a push uploads only "
                             "what the checkpoint folder holds; copy the file into it, or remove the link")
    return files


def _stage(folder: Path, staging: Path, repo_id: str, card_kwargs: dict | None) -> list[str]:
    """Fill ``staging`` with links to the checkpoint's files plus what is missing; returns what was generated."""
    for path in _files_to_push(folder):
        target = staging / path.name
        try:
            target.symlink_to(path.resolve())
        except OSError:  # no symlinks on this file system: copy
            shutil.copy2(path, target)
    generated = ensure_remote_code(staging)

    # Re-render the card if it is missing or ours (its arguments are in its metadata), with the repo id.
    readme = staging / "README.md"
    stored = None
    if readme.exists():
        from huggingface_hub import ModelCard

        try:
            stored = ModelCard.load(readme).data.to_dict().get(CARD_ARGS_KEY)
        except Exception:  # unparsable metadata: a hand-written card, uploaded as it is
            stored = None
    if not readme.exists() or stored is not None or card_kwargs:
        args = {**(stored or {}), **(card_kwargs or {}), "model_id": repo_id}
        write_model_card(staging, **args)
        generated.append("README.md")
    return generated


def preview_push(checkpoint_dir, repo_id: str, preview_dir, card_kwargs: dict | None = None) -> list[str]:
    """A dry run of :func:`push_checkpoint` with no Hub: write into ``preview_dir`` exactly what would be uploaded
    (links to the checkpoint's files, plus the generated card and remote code); return the file names."""
    folder, preview = Path(checkpoint_dir), Path(preview_dir)
    _check_checkpoint(folder, repo_id)
    if preview.exists() and any(preview.iterdir()):
        raise ValueError(f"--dry-run {preview}: the folder is not empty; give a new or empty folder")
    if preview.resolve() == folder.resolve():
        raise ValueError("--dry-run: give a folder other than the checkpoint's")
    preview.mkdir(parents=True, exist_ok=True)
    _stage(folder, preview, repo_id, card_kwargs)
    return sorted(p.name for p in preview.iterdir())


def _check_checkpoint(folder: Path, repo_id: str) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a checkpoint: it has no config.json (save the model with save_pretrained)")
    if repo_id.count("/") > 1 or not all(repo_id.split("/")):
        raise ValueError(f"repo_id must be 'name' or 'namespace/name', got {repo_id!r}")
    check_local_checkpoint(folder, "hf-lookaround push", kinds=("text", "vision"), finite=True)
    _files_to_push(folder)  # refuses links out of the folder


def push_checkpoint(
    checkpoint_dir,
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
    card_kwargs: dict | None = None,
):
    """Upload a checkpoint folder to the Hub repo ``repo_id`` (created if needed); returns the ``CommitInfo``.

    Uploads the safetensors weights, ``config.json``, tokenizer files, the model card and the
    remote-code modules (added from the installed package if the folder lacks them), with
    ``HfApi.create_repo`` + ``HfApi.upload_folder``. Optimizer/scheduler state and pickles are not
    uploaded. ``checkpoint_dir`` itself is never modified. ``endpoint`` defaults to ``HF_ENDPOINT``.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    folder = Path(checkpoint_dir)
    _check_checkpoint(folder, repo_id)
    if constants.is_offline_mode():
        raise HubPushError("HF_HUB_OFFLINE is set, so nothing can be pushed: unset it (or set HF_HUB_OFFLINE=0)")

    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="hf_lookaround_push_") as tmp:
        staging = Path(tmp)
        generated = _stage(folder, staging, repo_id, card_kwargs)
        if generated:
            logger.info("generated for the upload (not written to %s): %s", folder, ", ".join(generated))
        try:
            url = api.create_repo(repo_id, private=private, exist_ok=True)
            return api.upload_folder(
                folder_path=staging,
                repo_id=url.repo_id,
                commit_message=commit_message or f"Upload {folder.name} with hf_lookaround",
                revision=revision,
            )
        except (HfHubHTTPError, *_transport_errors(), OSError) as err:  # OSError: connection errors, offline mode
            raise HubPushError(
                f"pushing {folder} to {repo_id} at {api.endpoint} failed: {err}\n"
                "The local checkpoint was not modified. Fix the cause (token, network, HF_ENDPOINT, server) "
                "and run the same push again; files already on the Hub are skipped."
            ) from err


def _transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's own connection errors (httpx for huggingface_hub 1.x, if it is installed)."""
    try:
        import httpx
    except ImportError:
        return ()
    return (httpx.HTTPError,)


def push_trainer_output(trainer, repo_id: str | None = None, **card_kwargs):
    """What ``--push_to_hub`` calls at the end of pretraining, in place of ``trainer.push_to_hub()``.

    Saves the model and tokenizer to ``args.output_dir``, writes our model card there, and pushes
    the folder with :func:`push_checkpoint`, using the Trainer's hub arguments (``hub_model_id``,
    ``hub_token``, ``hub_private_repo``, ``hub_revision``). ``trainer.push_to_hub`` would replace our
    card by Trainer's generic one and upload an ``auto_map`` that names only the saved head.
    """
    args = trainer.args
    trainer.save_model(args.output_dir)
    if not trainer.is_world_process_zero():
        return None
    repo_id = repo_id or args.hub_model_id or Path(args.output_dir).name
    write_model_card(args.output_dir, **card_kwargs)
    return push_checkpoint(args.output_dir, repo_id, private=args.hub_private_repo, token=args.hub_token,
                           revision=getattr(args, "hub_revision", None))
