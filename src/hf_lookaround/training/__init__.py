"""Training loops and their pieces: the pretrain command, checkpoints, the unread-content drop, vision."""
