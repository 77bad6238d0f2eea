"""Patches for huggingface/trl (one module each; registered in patches/__init__.py)."""
