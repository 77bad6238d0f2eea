"""A tiny ZeRO-3 training job (a Llama built from a config, no `.id` anywhere), run by torchrun in
tests/test_torchrun.py. Each rank writes {"rank", "losses" (float.hex, for bit-for-bit comparison), "applied",
"module_ids"}.

    torchrun --nproc_per_node 2 tests/train_zero3.py OUT_DIR [STEPS]
"""
import os
import sys


def main(out_dir, steps=5):
    from dspatch.scenario import finish_rank, init_deepspeed, settle, zero3_config

    deepspeed = init_deepspeed()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import dspatch._runtime

    settle()

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    engine, *_ = deepspeed.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
    generator = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()).hex())
    print(f"rank {rank}: losses {[float.fromhex(x) for x in losses]} applied {dspatch._runtime.applied_ids()}")
    os.makedirs(out_dir, exist_ok=True)
    # both ranks leave gloo together and exit at once: left to interpreter teardown, a finished rank can abort
    # ("terminate called without an active exception", seen on bridge under load)
    finish_rank(out_dir, {"rank": rank, "losses": losses, "applied": dspatch._runtime.applied_ids(),
                          "module_ids": sorted({type(getattr(m, "id", None)).__name__ for m in model.modules()})})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
