"""Patches for huggingface/trl (none yet)."""
