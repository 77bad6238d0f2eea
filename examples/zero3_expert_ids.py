"""A mixture-of-experts model whose experts carry their own `.id` (which slot each expert is placed on),
trained a few ZeRO-3 steps. On deepspeed <= 0.16.3 ZeRO-3 overwrites those ids; with DSPATCH=1 they survive.

    torchrun --nproc_per_node 2 examples/zero3_expert_ids.py [--require-fixed]
"""
import os
import sys

from dspatch.patches.deepspeed.zero3_module_id import _moe_model, _train
from dspatch.scenario import init_deepspeed, zero3_config


def main():
    deepspeed = init_deepspeed()
    model = _moe_model()
    placed = [expert.id for expert in model.experts]
    engine, *_ = deepspeed.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
    _train(engine, 3)
    now = [expert.id for expert in model.experts]
    rank = os.environ.get("RANK", "0")
    import dspatch._runtime

    patched = dspatch._runtime.applied_ids()
    if now == placed:
        print(f"rank {rank}: expert ids kept {now} (deepspeed {deepspeed.__version__}, dspatch: {patched})")
        return 0
    print(f"rank {rank}: BUG: expert ids {placed} became {now} (deepspeed {deepspeed.__version__}, "
          f"dspatch: {patched or 'not active'})")
    return 1 if "--require-fixed" in sys.argv else 0


if __name__ == "__main__":
    sys.exit(main())
