"""Share checkpoints on the Hugging Face Hub, one job per module: :mod:`.cards` (model cards), :mod:`.results`
(the results a card shows), :mod:`.remote_code` (the files ``trust_remote_code`` loads), :mod:`.weights`
(weights checks), :mod:`.push` (``hf-lookaround push``), :mod:`.load` (a checked ``from_pretrained``)."""
