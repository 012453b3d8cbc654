"""Decoding beyond generate(): any-order infilling and image sampling."""
