"""Patches for transformers."""
