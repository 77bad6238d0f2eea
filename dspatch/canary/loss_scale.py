"""fp16's loss scaler as a config means it, without DeepSpeed: a static `loss_scale`, or a dynamic scale from
2^initial_scale_power that an overflow lowers (after `hysteresis` overflows, refilled per `consecutive_hysteresis`),
that `loss_scale_window` clean steps raise, never below `min_loss_scale`. An overflowed step is skipped: no update,
the schedule not advanced.

DeepSpeed's documented defaults where the config says nothing (fp16 block: loss_scale 0 = dynamic,
initial_scale_power 16, loss_scale_window 1000, hysteresis 2, consecutive_hysteresis false, min_loss_scale 1).
The window is counted as the installed release counts it: from 0.17.1 (its "stable interval", read in the released
sources: 0.17.0 and earlier have none) the scale is raised one clean step later than before.
"""

FP16_MAX = 65504.0  # the largest finite fp16 value


def _number(block, key, default):
    """`block[key]` as DeepSpeed reads a number ("8" and 8 alike), `default` where it says nothing, "auto" or words."""
    from dspatch.canary.reading import number

    value = number(block.get(key, default))
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default


class Scaler:
    """The loss scale at each optimizer step of an fp16 run, and which steps it skips."""

    def __init__(self, block, stable_interval=True):
        block = block if isinstance(block, dict) else {}
        static = float(_number(block, "loss_scale", 0) or 0)
        self.dynamic = static <= 0
        self.scale = 2.0 ** float(_number(block, "initial_scale_power", 16)) if self.dynamic else static
        self.window = int(_number(block, "loss_scale_window", 1000))
        self.delayed = int(_number(block, "hysteresis", 2))
        self.hysteresis = self.delayed
        self.consecutive = bool(block.get("consecutive_hysteresis", False))
        self.min_scale = float(_number(block, "min_loss_scale", 1))
        self.stable_interval = stable_interval
        self.iteration, self.last_overflow = 0, -1

    def update(self, overflow):
        """After a step: `overflow` says whether its gradient was not finite at this scale (a dynamic scaler
        skips such a step; a static one never checks)."""
        if not self.dynamic:
            return
        if overflow:
            if self.delayed == 1 or self.hysteresis == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive:
                self.hysteresis = self.delayed
            since = self.iteration - self.last_overflow - (1 if self.stable_interval else 0)
            if since > 0 and since % self.window == 0:
                if not self.consecutive:
                    self.hysteresis = self.delayed
                self.scale *= 2.0
        self.iteration += 1


def overflowed(peak, count):
    """Whether a gradient whose largest scaled fp16 value is `peak` (inf where a micro-batch's was not finite),
    summed over `count` micro-batches, overflows: True, False, or None where it is too close to fp16's largest
    value to say (the sum's order and rounding decide it)."""
    if peak != peak or peak == float("inf"):
        return True
    if peak * count < FP16_MAX / 2:
        return False
    return None
