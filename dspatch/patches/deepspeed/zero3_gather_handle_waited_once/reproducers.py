"""Reproducers: a 2-rank job (gloo, forked ranks) of a ZeRO-3 engine without an optimizer (an inference or reference
model), `stage3_allgather_sequential`, persistence threshold 0, the default prefetch bucket: four Linear layers, four
forwards without gradients, each rank its own inputs. The reference is the same model in plain torch.

Loaded only by `dspatch verify` and the tests (dspatch.spec.Patch.scenarios).
"""
from dspatch.spec import BugSeen, Proof

LAYERS, WIDTH, FORWARDS = 4, 16, 4
RELEASED = ("size mismatch, got input", "mat2 must be a matrix, got 1-D tensor")


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())])


def _inputs(rank):
    import torch

    generator = torch.Generator().manual_seed(11 + rank)
    return [torch.randn(2, WIDTH, generator=generator) for _ in range(FORWARDS)]


def _job(folder):
    import torch

    from dspatch.scenario import finish_rank, init_deepspeed, on_accelerator

    deepspeed = init_deepspeed()
    rank = torch.distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_allgather_sequential": True}}
    engine, *_ = deepspeed.initialize(model=_model(), config=config)
    engine.eval()
    outputs, error = [], None
    try:
        with torch.no_grad():
            for x in _inputs(rank):
                outputs.append(engine(on_accelerator(x)).float().cpu().sum().item())
    except RuntimeError as e:
        if not any(words in str(e) for words in RELEASED):
            raise
        import traceback

        traceback.print_exc()  # upstream's traceback, as the job's log shows it
        error = f"{type(e).__name__}: {e}"
    finish_rank(folder, {"outputs": outputs, "error": error})


def inference_engine_forwards():
    """Four forwards of a ZeRO-3 inference engine with stage3_allgather_sequential give plain torch's outputs."""
    import torch

    from dspatch.scenario import launch_ranks

    ranks = launch_ranks(__name__)
    failed = [r["error"] for r in ranks if r["error"]]
    if failed:
        raise BugSeen(f"a ZeRO-3 gather handle waited twice left a released weight marked available: forward "
                      f"{len(ranks[0]['outputs']) + 1} failed: {failed[0]}")
    model = _model()
    with torch.no_grad():
        want = [[model(x).sum().item() for x in _inputs(rank)] for rank in range(len(ranks))]
    for rank, result in enumerate(ranks):
        if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(result["outputs"], want[rank])):
            raise AssertionError(f"rank {rank}: outputs {result['outputs']}, plain torch's {want[rank]}")


PROOF = Proof(
    scenarios={"inference_engine_forwards": inference_engine_forwards},
    expected_on_stock={"inference_engine_forwards": "a ZeRO-3 gather handle waited twice left a released weight"},
    releases_checked=("0.18.5", "0.19.6"),
    # pins no stack of the matrix has: these sessions of the noxfile prove it too
    proven_in=("ds0192",),
)


if __name__ == "__main__":
    import sys

    _job(sys.argv[1])
