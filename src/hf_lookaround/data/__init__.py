"""Text and image data: collators per objective, tokenization, packing, image sets."""
