"""fp16 in `dspatch canary` (issue 57): the loss scaler as the config means it (dspatch.canary.loss_scale), checked by
its definition without torch, and against DeepSpeed's fp16 engines (ZeRO-1/2/3 on the CPU, the canary's process
answering that the CPU supports fp16): with nothing wrong, every step's scale, skip, gradient and update agree."""
import pytest

from conftest import STACK


@pytest.mark.unit_only
def test_the_dynamic_scaler_by_its_definition():
    """2^initial_scale_power; an overflow lowers the scale after `hysteresis` overflows (one spent per overflow, refilled
    at the raise, or at every clean step with consecutive_hysteresis); `loss_scale_window` clean steps raise it; never
    below min_loss_scale; the window counted from 0.17.1 one step later than before."""
    from dspatch.canary.loss_scale import Scaler, overflowed

    def scales(block, overflows, stable_interval=True):
        scaler, seen = Scaler(block, stable_interval), []
        for overflow in overflows:
            seen.append(scaler.scale)
            scaler.update(overflow)
        return seen

    assert scales({"enabled": True}, [True, True, False]) == [65536, 65536, 32768]  # hysteresis 2: the second halves
    assert scales({"initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2},
                  [False, False, False, False]) == [256, 256, 256, 512]  # raised after the window's clean steps
    assert scales({"initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2},
                  [False, False, False, False], stable_interval=False) == [256, 256, 512, 512]
    assert scales({"initial_scale_power": 1, "hysteresis": 1, "min_loss_scale": 1}, [True, True, True]) == [2, 1, 1]
    assert scales({"loss_scale": 128}, [True, True]) == [128, 128]  # static: never changes
    assert scales({"initial_scale_power": 4, "consecutive_hysteresis": True}, [True, False, True, True, False]) == \
        [16, 16, 16, 16, 8]  # the clean step refilled the hysteresis: two more overflows to halve
    assert scales({"initial_scale_power": "8", "hysteresis": "auto"}, [True, True]) == [256, 256]  # as DeepSpeed reads
    assert overflowed(float("inf"), 3) is True and overflowed(10.0, 3) is False and overflowed(30000.0, 3) is None


@pytest.mark.stack
@pytest.mark.skipif(STACK != "latest", reason="DeepSpeed's fp16 engines on the latest stack")
def test_fp16_with_nothing_wrong_is_quiet():
    """ZeRO 1-3 with a dynamic scale that overflows at the start (GA 1), a static one and one that skips every step
    (GA 3): with DSPATCH=1 each trains as plain torch, DeepSpeed skipping exactly the steps the scaler means."""
    from canary_matrix import _judged, fp16_configurations

    assert _judged(fp16_configurations()) == 9
