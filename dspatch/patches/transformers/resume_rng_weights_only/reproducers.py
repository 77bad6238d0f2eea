"""Reproducers: a real Trainer (no DeepSpeed: the bug is the Trainer's own load), a tiny Llama with dropout (so that
the restored RNG state shows in the losses), 16 causal-LM rows, batches of 4, a constant learning rate. A run saves
at step 2 and stops; a new Trainer resumes from that checkpoint to step 4; its losses for steps 3-4 must equal, bit
for bit, those of one uninterrupted 4-step run.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof


def _trainer(folder, steps):
    from transformers import Trainer, TrainingArguments

    from dspatch.scenario import lm_rows, reset_accelerate, tiny_llama

    reset_accelerate()
    args = TrainingArguments(output_dir=folder, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-2,
                             lr_scheduler_type="constant", logging_steps=1, save_steps=2, save_strategy="steps",
                             report_to=[], bf16=False, seed=42, disable_tqdm=True, use_cpu=True)
    return Trainer(model=tiny_llama(attention_dropout=0.1), args=args, train_dataset=lm_rows(16, 12, seed=3))


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def resume_from_checkpoint():
    """Resume at step 2 of 4: the resumed steps' losses equal those of an uninterrupted run, bit for bit."""
    import os
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        whole = _trainer(os.path.join(root, "whole"), 4)
        whole.train()
        first = _trainer(os.path.join(root, "resumed"), 2)
        first.train()
        resumed = _trainer(os.path.join(root, "resumed"), 4)
        try:
            resumed.train(resume_from_checkpoint=os.path.join(root, "resumed", "checkpoint-2"))
        except pickle.UnpicklingError as e:
            if "Weights only load failed" not in str(e):
                raise
            raise BugSeen(f"resume_from_checkpoint: the Trainer's RNG state: UnpicklingError: "
                          f"{' '.join(str(e).split())[:300]}") from e
    # the resumed state's log holds the checkpoint's steps 1-2, then its own 3-4
    want, got = _losses(whole), _losses(resumed)
    if len(want) != 4 or got != want:
        raise AssertionError(f"resumed run: losses {got} != {want} of the uninterrupted run")


def own_loads_stay_weights_only():
    """The allowance is the Trainer's RNG load's alone: the same file loaded by the user's own torch.load (default
    weights_only) is refused as before, in the same process, after a resume."""
    import os
    import pickle
    import tempfile

    import numpy
    import torch

    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "state.pth")
        torch.save({"numpy": numpy.random.get_state()}, path)
        try:
            torch.load(path)
        except pickle.UnpicklingError:
            return
    raise AssertionError("a user's torch.load of numpy globals was not refused: weights_only was loosened globally")


PROOF = Proof(
    scenarios={"resume_from_checkpoint": resume_from_checkpoint,
               "own_loads_stay_weights_only": own_loads_stay_weights_only},
    expected_on_stock={"resume_from_checkpoint": "resume_from_checkpoint: the Trainer's RNG state: UnpicklingError: "
                                                 "Weights only load failed"},
    # The releases of transformers that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("4.38.0", "4.48.0"),
    # A version of each package the patch `requires` with the bug's need, and one without (release suite).
    others_with_and_without=({"torch": "2.13.0"}, {"torch": "2.5.1"}),
)
