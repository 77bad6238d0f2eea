"""Reproducers: a 2-rank torchrun job of this module (gloo, CPU): ZeRO-3 partitions a model of several large
weights followed by a tiny one, and every rank gathers them all at once with `GatheredParameters`, as a save, an
evaluation hook or a user's own code does.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

# large weights (one async all-gather each, long enough to still run when the last one is done) and a tiny last
# one: waiting for the last gather alone then returns while the large ones are still arriving
LARGE, COUNT, TRIES = 1 << 20, 6, 200


def _job(folder):
    import logging

    import torch

    from dspatch.scenario import finish_rank, init_deepspeed, settle

    deepspeed = init_deepspeed()
    settle()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    torch.manual_seed(0)  # the same weights on both ranks, known before ZeRO-3 partitions them
    model = torch.nn.Sequential(*(torch.nn.Linear(LARGE // 8, 8, bias=False) for _ in range(COUNT)),
                                torch.nn.Linear(2, 2, bias=False))
    expected = [p.detach().clone() for p in model.parameters()]
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "Adam", "params": {"lr": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    params = list(engine.module.parameters())
    wrong = []
    for attempt in range(TRIES):
        with deepspeed.zero.GatheredParameters(params):  # a collective: every rank
            # read at once, as a caller does: what the gather put there by the time it returned
            got = [p.detach().clone() for p in params]
        wrong += [f"try {attempt}: weight {i} {tuple(g.shape)}" for i, (g, e) in enumerate(zip(got, expected))
                  if not torch.equal(g, e)]
    finish_rank(folder, {"rank": engine.global_rank, "world": engine.world_size, "wrong": wrong})


def gather_many_at_once():
    """2 ranks at ZeRO-3: GatheredParameters over 7 partitioned weights returns each of them whole, on both ranks,
    every time (200 gathers)."""
    from dspatch.scenario import launch_ranks

    ranks = launch_ranks(__name__)
    if [r["world"] for r in ranks] != [2, 2]:
        raise AssertionError(f"deepspeed did not run 2 ranks: {ranks}")
    wrong = [f"rank {r['rank']}: {', '.join(r['wrong'][:3])}" for r in ranks if r["wrong"]]
    if wrong:
        raise BugSeen("GatheredParameters returned before every weight had arrived, read other values: "
                      + "; ".join(wrong))


PROOF = Proof(
    scenarios={"gather_many_at_once": gather_many_at_once},
    expected_on_stock={"gather_many_at_once": "GatheredParameters returned before every weight had arrived"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    # The bug writes nothing a log would show: why `python -m dspatch.explain` cannot name it.
    silent="weights read before they arrive, no message: proven by their values",
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1])
