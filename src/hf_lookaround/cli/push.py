"""``hf-lookaround push``: push a checkpoint, its card and remote code to the Hub (or preview it with --dry-run)."""

from __future__ import annotations

import argparse

from ..hub.push import HubPushError, preview_push, push_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-lookaround push",
        description="Push a checkpoint folder (safetensors weights, config, tokenizer, model card and the "
        "remote code that lets users load it without this package) to a Hub model repo. The local folder "
        "is not modified. The endpoint is HF_ENDPOINT (default https://huggingface.co).",
    )
    parser.add_argument("checkpoint_dir", help="a folder written by save_pretrained / Trainer.save_model")
    parser.add_argument("repo_id", help="'namespace/name' (or 'name' for your own namespace)")
    parser.add_argument("--private", action="store_true", help="create the repo private (ignored if it exists)")
    parser.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the saved login)")
    parser.add_argument("--commit-message", "--commit_message", dest="commit_message", default=None)
    parser.add_argument("--revision", default=None, help="branch to push to (default: main)")
    parser.add_argument("--dataset", default=None, help="pretraining data named in the card (if it is re-rendered)")
    parser.add_argument("--license", default=None, help="the card's license (e.g. apache-2.0); none is assumed")
    parser.add_argument("--language", nargs="+", default=None, help="the card's language(s) (e.g. en); none is assumed")
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", default=None, metavar="PREVIEW_DIR",
                        help="send nothing: write what the push would upload (card and remote code included) into "
                             "this new folder, to read before pushing")
    args = parser.parse_args(argv)

    card_kwargs = {k: v for k, v in dict(dataset=args.dataset, license=args.license, language=args.language).items()
                   if v} or None
    if args.dry_run:
        names = preview_push(args.checkpoint_dir, args.repo_id, args.dry_run, card_kwargs)
        print(f"dry run, nothing sent: a push of {args.checkpoint_dir} to {args.repo_id} would upload "
              f"{len(names)} files, now in {args.dry_run}: {', '.join(names)}")
        return 0
    try:
        info = push_checkpoint(args.checkpoint_dir, args.repo_id, private=args.private or None, token=args.token,
                               commit_message=args.commit_message, revision=args.revision, card_kwargs=card_kwargs)
    except HubPushError as err:  # the CLI's one-line error form (exit 2), as for bad input
        raise OSError(str(err)) from err
    print(f"pushed {args.checkpoint_dir} -> {info.commit_url}")
    print(f"load it with: AutoModel.from_pretrained({args.repo_id!r}, trust_remote_code=True)")
    return 0
