"""What the fixes of a step skipped without a word share (deepspeed/bf16-optimizer-silent-skip, 0.19.8's
BF16_Optimizer; deepspeed/static-scaler-silent-skip, a static loss scale before 0.19.8): deepspeed 0.19.8's own
line for a skipped step, written as that release writes it, and the reproducers' ear on DeepSpeed's logger."""
import contextlib

# deepspeed 0.19.8's words (runtime/fp16/loss_scaler.py, PRs 8417 and 8426), so that a log reads the same whichever
# optimizer skipped and whichever release it ran
SKIPPED = "[deepspeed] OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated."
SAID = "OVERFLOW! Skipping step"  # what every release's skip line holds (the dynamic scaler's too)


def say_skipped():
    """Log SKIPPED at WARNING on rank 0, as 0.19.8's loss scaler does."""
    import logging

    from deepspeed.utils import log_dist

    log_dist(SKIPPED, ranks=[0], level=logging.WARNING)


@contextlib.contextmanager
def lines_saying_skipped():
    """A list that collects, while the block runs, the lines DeepSpeed's logger writes that say a step was skipped."""
    import logging

    from deepspeed.utils import logger

    lines = []

    class Listen(logging.Handler):
        def emit(self, record):
            if SAID in record.getMessage():
                lines.append(record.getMessage())

    listen = Listen()
    logger.addHandler(listen)
    try:
        yield lines
    finally:
        logger.removeHandler(listen)
