"""Reproducers: a job of two gloo ranks on the CPU, started as torchrun starts them and with nothing telling accelerate
`cpu` (TrainingArguments' `use_cpu` left at its default): what each rank's accelerate state says, and the rows a
Trainer gives each rank in one epoch of eight.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

ROWS = 8


def _job(folder):
    import tempfile

    import torch

    from dspatch.scenario import finish_rank

    from accelerate import PartialState

    state = PartialState()
    seen = {"processes": state.num_processes, "index": state.process_index, "main": state.is_main_process,
            "type": str(state.distributed_type)}
    from transformers import Trainer, TrainingArguments

    rows = [{"input_ids": [i, i], "labels": [i, i]} for i in range(ROWS)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, report_to=[], seed=0,
                                 dataloader_num_workers=0, remove_unused_columns=False)
        trainer = Trainer(model=torch.nn.Linear(2, 2), args=args, train_dataset=rows)
        seen["rows"] = sorted(i for batch in trainer.get_train_dataloader() for i in batch["input_ids"][:, 0].tolist())
    finish_rank(folder, seen)


def two_cpu_ranks_know_each_other():
    """Two ranks of one job: processes 0 and 1 of 2, one main process, and the Trainer gives each half the rows."""
    from dspatch.scenario import launch_ranks

    ranks = launch_ranks(__name__)
    if any(rank["processes"] != 2 for rank in ranks) or [rank["index"] for rank in ranks] != [0, 1]:
        raise BugSeen(f"two CPU ranks started without --cpu are each process {ranks[0]['index']} of "
                      f"{ranks[0]['processes']} ({ranks[0]['type']}), not 0 and 1 of 2: every rank trains on all the "
                      f"rows (rank 0: {ranks[0]['rows']}, rank 1: {ranks[1]['rows']}) and is the main process")
    if [rank["main"] for rank in ranks] != [True, False]:
        raise AssertionError(f"main process on each rank: {[rank['main'] for rank in ranks]}")
    if sorted(ranks[0]["rows"] + ranks[1]["rows"]) != list(range(ROWS)) or len(ranks[0]["rows"]) != ROWS // 2:
        raise AssertionError(f"the Trainer's rows per rank: {ranks[0]['rows']} and {ranks[1]['rows']}")


PROOF = Proof(
    scenarios={"two_cpu_ranks_know_each_other": two_cpu_ranks_know_each_other},
    expected_on_stock={"two_cpu_ranks_know_each_other": "two CPU ranks started without --cpu are each process 0 of 1"},
    silent="every rank trains alone, without an error",
    releases_checked=("1.13.0", "1.15.0"),
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1])
