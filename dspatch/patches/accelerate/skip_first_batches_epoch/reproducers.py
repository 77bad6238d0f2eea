"""Reproducers: which rows the rest of epoch 1 trains on after a resume inside it, against the same epoch
uninterrupted. Eight rows, each its own number, two to a batch, shuffled by accelerate's seedable sampler: four
batches an epoch; the resume skips the first two batches of epoch 1.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

ROWS, BATCH, SKIPPED = 8, 2, 2


def _dataset():
    import torch

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return ROWS

        def __getitem__(self, i):
            return {"input_ids": torch.tensor([i, i, i]), "labels": torch.tensor([i, i, i])}

    return Rows()


def _compare(kind, resumed, whole):
    if resumed != whole:
        raise BugSeen(f"{kind} resumed inside epoch 1 trained on rows {resumed}, the same epoch uninterrupted on "
                      f"{whole}: epoch 0's order")


def accelerate_loop_resumed_in_epoch_1():
    """An accelerate loop that sets the epoch, then skips the batches already trained (as a resume does): the rest of
    epoch 1 is epoch 1's batches, as uninterrupted."""
    import torch

    from dspatch.scenario import reset_accelerate

    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    def loader():
        reset_accelerate()
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
        shuffled = torch.utils.data.DataLoader(_dataset(), batch_size=BATCH, shuffle=True)
        return accelerator, accelerator.prepare(shuffled)

    try:
        _, whole = loader()
        epochs = []
        for epoch in range(2):
            whole.set_epoch(epoch)
            epochs.append([batch["input_ids"][:, 0].tolist() for batch in whole])
        accelerator, again = loader()
        again.set_epoch(1)
        resumed = [batch["input_ids"][:, 0].tolist() for batch in accelerator.skip_first_batches(again, SKIPPED)]
    finally:
        reset_accelerate()
    if epochs[0] == epochs[1]:
        raise AssertionError(f"both epochs drew the same order {epochs[0]}: the scenario shows nothing")
    _compare("an accelerate loop", resumed, epochs[1][SKIPPED:])


def _train(out, resume=None):
    """The rows of each step a Trainer (2 epochs of 4 steps, a checkpoint at step 6) trains on, from its start or
    from `resume`."""
    import torch

    from dspatch.scenario import loads_past_weights_only_bug, reset_accelerate

    from transformers import Trainer, TrainingArguments

    seen = []

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(ROWS, 4)
            self.head = torch.nn.Linear(4, ROWS)

        def forward(self, input_ids=None, labels=None, **kwargs):
            seen.append(input_ids[:, 0].tolist())
            logits = self.head(self.embed(input_ids))
            return {"loss": torch.nn.functional.cross_entropy(logits.reshape(-1, ROWS), labels.reshape(-1)),
                    "logits": logits}

    reset_accelerate()
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, num_train_epochs=2, save_steps=6,
                             save_strategy="steps", use_cpu=True, report_to=[], seed=0, data_seed=0,
                             dataloader_num_workers=0, logging_steps=100, learning_rate=1e-3)
    try:
        with loads_past_weights_only_bug("transformers/resume-rng-weights-only"):
            Trainer(model=Tiny(), args=args, train_dataset=_dataset()).train(resume_from_checkpoint=resume)
    finally:
        reset_accelerate()
    return seen


def trainer_resumed_in_epoch_1():
    """A Trainer resumed from its checkpoint at step 6 (inside epoch 1) trains steps 7-8 on the rows the uninterrupted
    run trained them on."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        whole = _train(out)
        resumed = _train(out, resume=os.path.join(out, "checkpoint-6"))
    if len(whole) != 2 * ROWS // BATCH:
        raise AssertionError(f"the uninterrupted run trained {len(whole)} steps, not {2 * ROWS // BATCH}")
    _compare("the Trainer", resumed, whole[6:])


PROOF = Proof(
    scenarios={"accelerate_loop_resumed_in_epoch_1": accelerate_loop_resumed_in_epoch_1,
               "trainer_resumed_in_epoch_1": trainer_resumed_in_epoch_1},
    expected_on_stock={"accelerate_loop_resumed_in_epoch_1": "an accelerate loop resumed inside epoch 1 trained on",
                       "trainer_resumed_in_epoch_1": "the Trainer resumed inside epoch 1 trained on"},
    # transformers 5.x sets the epoch after skipping: its Trainer is not hit
    stock_fails_on={"trainer_resumed_in_epoch_1": {"transformers": "<5.0.0"}},
    silent="the resumed run trains without an error, on another epoch's order",
    releases_checked=("1.7.0", "1.14.0"),
)
