"""hf_lookaround: autoregressive, masked and group-rank objectives on one two-stream transformer."""

__version__ = "0.1.0"
