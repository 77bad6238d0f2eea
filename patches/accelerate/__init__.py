"""Patches for huggingface/accelerate (none yet)."""
