"""Reproducers: a 2-rank job of this module (gloo, CPU): a small MLP (Linear 6-8, Tanh, Linear 8-3), ZeRO-1 and ZeRO-2
with `contiguous_gradients: false`, two SGD steps of `engine.backward(loss); engine.step()`, each rank on its own
micro-batch, against plain torch on the same model stepped with the two ranks' gradients averaged (what data
parallelism means), computed on each rank from the same seeded data.

Tolerance: relative 1e-6 on the weights (two ranks' fp32 gradients summed in another order); the bug leaves each
rank's partition stepped on that rank's own gradient, more than a tenth off. Where the weights differ, a reproducer
says "bug" only if they are exactly those of each rank stepping its partition with its own gradient, and fails with an
error otherwise. On an accelerator (where the bug cannot happen) the same job checks plain torch's weights within the
tolerance.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, LR, RTOL = 2, 0.5, 1e-6


def _config(stage):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": stage, "contiguous_gradients": False}}


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(ranks):
    """[step][rank] -> (x, y): every rank's micro-batch of every step, the same on every rank."""
    import torch

    generator = torch.Generator().manual_seed(5)
    return [[(torch.randn(1, 6, generator=generator), torch.randn(1, 3, generator=generator)) for _ in range(ranks)]
            for _ in range(STEPS)]


def _loss(model, batch):
    import torch

    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def plain_torch(ranks, own=None):
    """The weights after STEPS SGD steps of plain torch on the ranks' gradients averaged; `own`: a rank's gradient
    alone for the parameters' elements that rank owns (as flat ZeRO partitions cut them), the bug's shape."""
    import torch

    model = _model()
    params = list(model.parameters())
    flat = sum(p.numel() for p in params)
    cut = -(-flat // ranks)  # ZeRO's partition of the flat fp32 buffer: equal parts, the last padded
    for step in _batches(ranks):
        grads = []
        for batch in step:
            model.zero_grad()
            _loss(model, batch).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        if own:
            applied = torch.cat([grads[min(i // cut, ranks - 1)][i:i + 1] for i in range(flat)])
        else:
            applied = sum(grads) / ranks
        with torch.no_grad():
            offset = 0
            for p in params:
                p -= LR * applied[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
    return {name: p.detach().reshape(-1).tolist() for name, p in model.named_parameters()}


def _job(folder, stage):
    import torch

    from dspatch.scenario import finish_rank, init_deepspeed, on_accelerator, settle

    deepspeed = init_deepspeed()
    settle()
    rank, ranks = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=_config(int(stage)))
    for step in _batches(ranks):
        x, y = step[rank]
        engine.backward(_loss(engine, (on_accelerator(x), on_accelerator(y))))
        engine.step()
    weights = {name: p.detach().cpu().reshape(-1).tolist() for name, p in model.named_parameters()}
    finish_rank(folder, {"weights": weights, "ranks": ranks})


def _off(got, want):
    import torch

    return max(float((torch.tensor(got[n]) - torch.tensor(want[n])).norm() / torch.tensor(want[n]).norm())
               for n in want)


def judge(stage):
    from dspatch.scenario import launch_ranks

    results = launch_ranks(__name__, args=(str(stage),))
    ranks = results[0]["ranks"]
    want = plain_torch(ranks)
    off = max(_off(r["weights"], want) for r in results)
    if off <= RTOL:
        return
    own = plain_torch(ranks, own=True)
    if all(_off(r["weights"], own) <= RTOL for r in results):
        raise BugSeen(f"ZeRO-{stage} with contiguous_gradients false: no gradient all-reduced, each rank stepped its "
                      f"partition on its own micro-batch (weights {off:.0%} off plain torch's averaged gradient)")
    raise AssertionError(f"ZeRO-{stage}: weights {off:.2e} off plain torch, and not as this bug leaves them")


def zero1_not_contiguous():
    """ZeRO-1, contiguous_gradients false, 2 ranks: plain torch's weights on the averaged gradient."""
    judge(1)


def zero2_not_contiguous():
    """ZeRO-2, contiguous_gradients false, 2 ranks: plain torch's weights on the averaged gradient."""
    judge(2)


PROOF = Proof(
    scenarios={"zero1_not_contiguous": zero1_not_contiguous, "zero2_not_contiguous": zero2_not_contiguous},
    expected_on_stock={"zero1_not_contiguous": "ZeRO-1 with contiguous_gradients false: no gradient all-reduced",
                       "zero2_not_contiguous": "ZeRO-2 with contiguous_gradients false: no gradient all-reduced"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    silent="each rank steps on its own gradient, no message: proven by numbers",
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1], sys.argv[2])
