"""``hf-lookaround push``: push a checkpoint, its card and remote code to the Hub."""

from __future__ import annotations

import argparse

from ..hub.push import HubPushError, push_checkpoint


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
    args = parser.parse_args(argv)

    card_kwargs = {"dataset": args.dataset} if args.dataset else None
    try:
        info = push_checkpoint(args.checkpoint_dir, args.repo_id, private=args.private or None, token=args.token,
                               commit_message=args.commit_message, revision=args.revision, card_kwargs=card_kwargs)
    except (ValueError, HubPushError) as err:
        print(f"error: {err}")
        return 1
    print(f"pushed {args.checkpoint_dir} -> {info.commit_url}")
    print(f"load it with: AutoModel.from_pretrained({args.repo_id!r}, trust_remote_code=True)")
    return 0
