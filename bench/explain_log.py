"""A long training log with one traceback in it, for bench/run.py's explain part: what a DeepSpeed job prints step
after step (progress bars redrawn in place, loss dictionaries, DeepSpeed's timers, NCCL and torch warnings), then
ZeRO-3's deque traceback, then a little more output.

    python bench/explain_log.py OUT MEGABYTES
"""
import random
import sys

TRACEBACK = """Traceback (most recent call last):
  File "/home/user/train.py", line 120, in <module>
    trainer.train()
  File "/venv/lib/python3.11/site-packages/transformers/trainer.py", line 1938, in train
    return inner_training_loop(
  File "/venv/lib/python3.11/site-packages/deepspeed/runtime/zero/partitioned_param_coordinator.py", line 301, in fetch_sub_module
    self.__step_id_module_fetched_for[sub_module.id].popleft()
IndexError: pop from an empty deque
"""


def line(step, rng):
    kind = step % 8
    if kind == 0:
        return (f"[rank{step % 2}]: {{'loss': {rng.random():.4f}, 'grad_norm': {rng.random() * 3:.4f}, "
                f"'learning_rate': {rng.random() * 1e-4:.3e}, 'epoch': {step / 1000:.2f}}}\n")
    if kind == 1:
        return "".join(f" {(step + i) % 100:3d}%|{'#' * ((step + i) % 50):<50}| {step + i}/100000 "
                       f"[01:{step % 60:02d}<10:00, 1.23it/s]\r" for i in range(3)) + "\n"
    if kind == 2:
        return (f"[2026-11-26 02:{step % 60:02d}:00,123] [INFO] [logging.py:96:log_dist] [Rank 0] step={step}, "
                f"skipped=0, lr=[1e-05], mom=[(0.9, 0.999)]\n")
    if kind == 3:
        return (f"[2026-11-26 02:00:00,123] [INFO] [timer.py:258:stop] epoch=0/micro_step={step}/global_step={step}, "
                "RunningAvgSamplesPerSec=12.3, CurrSamplesPerSec=12.1, MemAllocated=1.2GB, MaxMemAllocated=3.4GB\n")
    if kind == 4:
        return ("/venv/lib/python3.11/site-packages/torch/utils/checkpoint.py:91: UserWarning: None of the inputs "
                "have requires_grad=True. Gradients will be None\n")
    if kind == 5:
        return (f"node-3:{1000 + step % 8}:{2000 + step % 8} [{step % 8}] NCCL INFO Channel 0{step % 4}/0 : "
                f"{step % 8}[{step % 8}] -> {(step + 1) % 8}[{(step + 1) % 8}] via P2P/IPC\n")
    if kind == 6:
        return (f"[rank{step % 8}]:[W1126 02:00:00.123 ProcessGroupNCCL.cpp:4115] Warning: "
                "TORCH_NCCL_AVOID_RECORD_STREAMS is the default now\n")
    return f"wandb: Run summary: train/loss {rng.random():.5f} train/global_step {step}\n"


def write(path, megabytes):
    rng = random.Random(0)
    size, step = 0, 0
    with open(path, "w") as f:
        while size < megabytes * 1_000_000:
            step += 1
            text = line(step, rng)
            f.write(text)
            size += len(text)
        f.write(TRACEBACK)
        for step in range(1000):
            f.write(f"wandb: step {step} done\n")


if __name__ == "__main__":
    write(sys.argv[1], float(sys.argv[2]))
