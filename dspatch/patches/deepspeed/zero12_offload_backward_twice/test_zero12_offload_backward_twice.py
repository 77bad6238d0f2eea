"""deepspeed/zero12-offload-backward-twice beyond the shared proofs: offloaded runs that meet no second boundary stay
stock's to the bit, and three backwards a step sum, with every patch on."""
import pytest

from conftest import clean_env, skip_unless_applies

PID = "deepspeed/zero12-offload-backward-twice"
pytestmark = pytest.mark.stack


@pytest.fixture(autouse=True)
def _where_it_applies():
    skip_unless_applies(PID)


def _plans(*shapes, **extra):
    from dspatch.canary.plan import build_plan, default_options

    return [build_plan({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ga,
                        "gradient_clipping": clip, "zero_optimization": {
                            "stage": stage, "offload_optimizer": {"device": "cpu"}}, **extra},
                       default_options(backwards=backwards, boundary_call=backwards > 1))
            for stage, ga, clip, backwards in shapes]


def _records(plans, dspatch):
    from dspatch.canary import deepspeed_side

    return deepspeed_side(plans, clean_env(DSPATCH=dspatch) if dspatch else clean_env())


def test_offloaded_runs_without_a_second_boundary_are_stock_to_the_bit():
    """ZeRO-1/2 offloaded at accumulation 3 (the engine's windows), at accumulation 1 with one backward a step (with
    clipping), and ZeRO-1 with the boundary call (where stock sums): every step's gradient, norm and weights equal
    stock's exactly, with the patch applied."""
    import torch

    plans = _plans((1, 3, 0.0, 1), (2, 3, 0.0, 1), (2, 1, 1.0, 1), (1, 1, 0.0, 2))
    patched, stock = _records(plans, PID), _records(plans, None)
    for plan, got, want in zip(plans, patched, stock):
        assert got["error"] is None and want["error"] is None, (got["error"], want["error"])
        assert got["applied"] == [PID] and not want["applied"]
        assert len(got["steps"]) == len(want["steps"]) > 0
        for a, b in zip(got["steps"], want["steps"]):
            assert a["grad_norm"] == b["grad_norm"], plan["stage"]
            for key in ("gradient", "weights"):
                assert all(torch.equal(a[key][n], b[key][n]) for n in b[key]), (plan["stage"], key)


def test_three_backwards_a_step_sum_with_every_patch_on():
    """Three backwards a step at ZeRO-2 offloaded, without and with the boundary call (where the middle one needs
    deepspeed/zero2-offload-grad-accum too on 0.15.2-0.18.9): DSPATCH=1 trains as plain torch."""
    from dspatch.canary import judge

    plans = _plans((2, 1, 0.0, 3))
    plans += [dict(plans[0], boundary_call=False)]
    for plan, record in zip(plans, _records(plans, "1")):
        assert record["error"] is None and PID in record["applied"], record["error"]
        assert judge(plan, record) is None, (plan["boundary_call"], judge(plan, record))


def test_bf16_with_fp32_accumulation_sums_once():
    """bf16 with fp32 gradient accumulation, two backwards a step, ZeRO-2 offloaded: 0.19.8 keeps that partition until
    the step (its compact path sums by itself, and the patch leaves it); elsewhere the patch sums. Either way DSPATCH=<id>
    trains as plain torch (a sum taken twice was 0.68 of the gradient's norm off)."""
    from dspatch.canary import judge

    plans = [dict(plan, boundary_call=False) for plan in _plans(
        (2, 1, 0.0, 2), bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})]
    record = _records(plans, PID)[0]
    assert record["error"] is None and record["applied"] == [PID], record["error"]
    assert judge(plans[0], record) is None, judge(plans[0], record)
