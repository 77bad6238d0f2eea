"""Reproducers: a 2-rank job of this module (gloo, CPU): an MLP whose parameters' sizes are odd (Linear 5-3, Tanh,
Linear 3-5: 15, 3, 15 and 5 values, each padded to an even length), built under `zero.Init`, ZeRO-3 with every
parameter partitioned, three SGD steps of `engine.backward(loss); engine.step()`, with the all-reduce fetch
(`stage3_use_all_reduce_for_fetch_params: true`) against the same job with the default all-gather fetch.

The padding of each partition is set to NaN before `deepspeed.initialize`: it is memory nobody initialised, which
the fetch must never read into a weight whatever it holds (a NaN shows it at once, where a zero would hide it). The
all-gather job never reads it; the all-reduce job must equal it to the bit, losses and weights. Where it does not,
the reproducer says "bug" only for this bug's failures (a non-finite loss or weight from the padding; the TypeError
of `handle_dependency` on 0.16.3-0.17.2) and fails with an error otherwise.

Loaded only by `--verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

STEPS, LR = 3, 0.1


def _config(all_reduce):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_model_persistence_threshold": 0,
                                  "stage3_use_all_reduce_for_fetch_params": all_reduce}}


def _poison_padding(model, rank):
    """NaN in every position of this rank's partitions past its parameter's own values (the padding)."""
    import torch

    for p in model.parameters():
        part = p.ds_tensor.data.view(-1)
        own = min(max(p.ds_numel - part.numel() * rank, 0), part.numel())
        part[own:] = torch.nan


def _job(folder, fetch):
    import torch

    from dspatch.scenario import finish_rank, gathered_whole, init_deepspeed, on_accelerator, settle

    deepspeed = init_deepspeed()
    settle()
    rank = torch.distributed.get_rank()
    config = _config(fetch == "all_reduce")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 5))
    padded = sum(p.ds_numel_aligned - p.ds_numel for p in model.parameters())
    _poison_padding(model, rank)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config)
    generator = torch.Generator().manual_seed(7)
    losses, error = [], None
    try:
        for _ in range(STEPS):
            x, y = torch.randn(1, 5, generator=generator), torch.randn(1, 5, generator=generator)
            loss = torch.nn.functional.mse_loss(engine(on_accelerator(x)), on_accelerator(y))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        # one at a time: a gather of several at once can read early on gloo (deepspeed/zero3-gather-waits-all)
        weights = {name: w.cpu().tolist() for name, w in gathered_whole(model.named_parameters()).items()}
    except TypeError as e:
        if "handle_dependency" not in str(e):
            raise
        import traceback

        traceback.print_exc()  # upstream's traceback, as the job's log shows it
        error, weights = f"{type(e).__name__}: {e}", None
    finish_rank(folder, {"losses": losses, "weights": weights, "error": error, "padded": padded})


def run(fetch):
    """The ranks' results of the 2-rank job with `fetch` ("all_reduce" or "all_gather")."""
    from dspatch.scenario import launch_ranks

    return launch_ranks(__name__, args=(fetch,))


def all_reduce_fetch():
    """Three steps with the all-reduce fetch equal the all-gather fetch's, to the bit (losses and weights)."""
    import math

    want, got = run("all_gather"), run("all_reduce")
    if any(r["error"] for r in want) or not all(r["padded"] for r in want):
        raise AssertionError(f"the all-gather job is not the one meant: {want}")
    if any(r["error"] for r in got):
        raise BugSeen("stage3_use_all_reduce_for_fetch_params: true fails at the first forward: "
                      f"{next(r['error'] for r in got if r['error'])}")
    if [(r["losses"], r["weights"]) for r in got] == [(r["losses"], r["weights"]) for r in want]:
        return
    values = [v for r in got for v in r["losses"]]
    values += [v for r in got for w in r["weights"].values() for row in w for v in (row if isinstance(row, list)
                                                                                   else [row])]
    if any(not math.isfinite(v) for v in values):
        raise BugSeen(f"stage3_use_all_reduce_for_fetch_params: true sums the padding into the next weight: losses "
                      f"{got[0]['losses']} (the all-gather fetch's {want[0]['losses']})")
    raise AssertionError(f"the all-reduce fetch's job differs from the all-gather fetch's, and not by the padding: "
                         f"losses {got[0]['losses']} against {want[0]['losses']}")


PROOF = Proof(
    scenarios={"all_reduce_fetch": all_reduce_fetch},
    expected_on_stock={"all_reduce_fetch": "stage3_use_all_reduce_for_fetch_params: true"},
    # The releases of deepspeed that the release suite (tests/test_releases.py) checks: first and last.
    releases_checked=("0.14.0", "0.19.8"),
    silent="the padding summed into weights, no message but a NaN loss: proven by numbers",
    loud_on=">=0.16.3,<0.17.3",  # the TypeError of handle_dependency
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0183",),
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1], sys.argv[2])
