"""Patches for deepspeedai/DeepSpeed."""
