"""A mixture-of-experts model whose experts carry their own `.id` (which slot each expert is placed on),
trained a few ZeRO-3 steps. On deepspeed <= 0.16.3 ZeRO-3 overwrites those ids; with DSPATCH=1 they survive.

    torchrun --nproc_per_node 2 examples/zero3_expert_ids.py [--require-fixed]
"""
import logging
import os
import sys

import dspatch._runtime
from dspatch.patches.deepspeed.zero3_module_id.reproducers import expert_ids_through_training
from dspatch.scenario import leave_and_exit


def main():
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)  # DeepSpeed's config dump would bury the two result lines
    placed, now = expert_ids_through_training(steps=3)

    applied = dspatch._runtime.applied_ids()
    named = "deepspeed/zero3-module-id among them" if "deepspeed/zero3-module-id" in applied else "not that one"
    where = f"deepspeed {deepspeed.__version__}; " + (f"dspatch applied {len(applied)} patches, {named}" if applied
                                                       else "dspatch not active")
    rank = os.environ.get("RANK", "0")
    if now == placed:
        say(f"rank {rank}: expert ids kept: {now} ({where})")
        return 0
    say(f"rank {rank}: BUG: expert ids {placed} became {now} ({where})")
    return 1 if "--require-fixed" in sys.argv else 0


def say(line):
    """One write of the whole line: the ranks share the launcher's pipe, and print's two writes (text, then
    newline) from two ranks can interleave into one line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    # the ranks leave gloo together and exit at once: left to interpreter teardown, gloo's threads can abort a
    # finished rank ("terminate called without an active exception")
    leave_and_exit(main())
