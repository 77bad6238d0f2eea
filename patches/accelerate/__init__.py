"""Patches for huggingface/accelerate (one module each; registered in patches/__init__.py)."""
