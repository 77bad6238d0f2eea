"""Every rank is patched under each launcher a user starts a DeepSpeed job with, on one node of CPU processes:
`torchrun` (test_torchrun.py), the `deepspeed` launcher, and `accelerate launch` with a DeepSpeed config; and the
multi-node launcher forwards the DSPATCH variables to every node (its command for a 2-host hostfile is built
for real, with `pdsh` standing in as a recorder, since no remote host exists here).

Where a stack's launcher cannot run DeepSpeed with 2 CPU processes, the job runs 1 process and the test says so:
accelerate 1.15 gives every process rank 0 (both think they are the main process).
"""
import json
import os
import re
import socket
import stat

import pytest

from dspatch import gating, registry

from conftest import STACK, clean_env, run_python, run_ranks

# the launchers of the oldest and the newest deepspeed and accelerate of the matrix
pytestmark = [pytest.mark.stack, pytest.mark.machinery("old", "latest")]

# every rank reports what dspatch applied in it, after a real engine took a training step
JOB = r'''
import importlib, json, os, sys
import torch
from dspatch import _runtime
args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
launcher, out = args
# the CPU recipe: no JIT build of DeepSpeed's shm comm op (minutes on 2 cores, and the ranks wait on its lock)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
if launcher == "accelerate":
    from accelerate import Accelerator
    acc = Accelerator()
    model = torch.nn.Linear(4, 1)
    data = torch.utils.data.DataLoader(torch.ones(4, 4), batch_size=2)  # DeepSpeed's micro-batch comes from it
    model, opt, data = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data)
    loss = model(torch.ones(2, 4)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    rank, size = acc.process_index, acc.num_processes
else:
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    model, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    loss = model(torch.ones(2, 4)).pow(2).mean()
    model.backward(loss)
    model.step()
    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "size": size, "engine": type(model).__name__, "applied": _runtime.applied_ids()}, f)
# reported: leave without interpreter teardown, where gloo sometimes aborts a finished rank under load
# ("terminate called without an active exception", exit -6)
os._exit(0)
'''

DEEPSPEED_PATCHES = sorted(pid for pid, p in registry.all_patches().items()
                           if p.distribution == "deepspeed" and gating.evaluate(p).verdict == gating.APPLIES)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _deepspeed_command():
    """The `deepspeed` command of this environment, as users run it (`python -m deepspeed.launcher.runner`
    would run the runner as __main__, which no import hook sees: the README says to use the command)."""
    import sys

    return os.path.join(os.path.dirname(sys.executable), "deepspeed")


def _ranks(out, processes):
    found = sorted(out.glob("rank*.json"))
    assert len(found) == processes, [p.name for p in found]
    return [json.loads(p.read_text()) for p in found]


def _launch(tmp_path, launcher, processes):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = tmp_path / "out"
    out.mkdir()
    # LOCAL_SIZE: DeepSpeed's CPU accelerator counts its "devices" from it (or from numactl, not installed here)
    env = clean_env(DSPATCH="1", LOCAL_SIZE=str(processes), DS_ACCELERATOR="cpu")
    if launcher == "deepspeed":
        args = [_deepspeed_command(), "--num_gpus", str(processes), "--master_port", _port()]
    else:
        args = ["-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "2", "--num_processes",
                str(processes), "--num_machines", "1", "--mixed_precision", "no", "--gradient_accumulation_steps",
                "1", "--main_process_port", _port()]
    run_ranks([*args, str(job), launcher, str(out)], env=env, cwd=str(tmp_path), fresh=out)
    return _ranks(out, processes)


def test_the_deepspeed_launcher_patches_every_rank(tmp_path):
    ranks = _launch(tmp_path, "deepspeed", 2)
    for rank in ranks:
        assert rank["size"] == 2 and rank["engine"] == "DeepSpeedEngine"
        assert sorted(p for p in rank["applied"] if p.startswith("deepspeed/")) == DEEPSPEED_PATCHES, rank


def _accelerate_processes():
    from dspatch.gating import installed_version
    from packaging.version import Version

    # 1.15 (latest) gives every CPU process rank 0 under DeepSpeed; 0.34.2 (old) is not tried with 2
    version = Version(installed_version("accelerate"))
    return 2 if Version("1.8") <= version < Version("1.15") else 1


def test_accelerate_launch_with_deepspeed_patches_every_rank(tmp_path):
    processes = _accelerate_processes()
    ranks = _launch(tmp_path, "accelerate", processes)
    for rank in ranks:
        assert rank["size"] == processes and rank["engine"] == "DeepSpeedEngine", rank
        assert sorted(p for p in rank["applied"] if p.startswith("deepspeed/")) == DEEPSPEED_PATCHES, rank
    if processes == 1:
        pytest.skip(f"{STACK}: accelerate cannot run DeepSpeed with 2 CPU processes here; 1 process was checked")


def test_a_two_host_hostfile_forwards_the_dspatch_variables_to_every_node(tmp_path):
    """The multi-node launcher's real command, for two hosts, with `pdsh` (its default backend) replaced by a
    recorder on PATH: what would run on each node exports DSPATCH, DSPATCH_DISABLE and DSPATCH_STRICT."""
    recorder = tmp_path / "bin" / "pdsh"
    recorder.parent.mkdir()
    recorder.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'pdsh.args'}\n")
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    job = tmp_path / "job.py"
    job.write_text("print('never run here')\n")
    env = clean_env(DSPATCH="deepspeed", DSPATCH_DISABLE="deepspeed/initialize-once", DSPATCH_STRICT="1",
                    DS_ACCELERATOR="cpu", PATH=f"{recorder.parent}{os.pathsep}{os.environ['PATH']}")
    run_python([_deepspeed_command(), "--hostfile", str(hostfile), "--launcher", "pdsh",
                "--no_ssh_check", "--master_addr", "10.0.0.1", str(job)], env=env, cwd=str(tmp_path))
    args = (tmp_path / "pdsh.args").read_text().splitlines()
    assert args[args.index("-w") + 1] == "node-a,node-b"
    command = " ".join(args[args.index("-w") + 2:])  # what each node runs: exports, cd, the per-node launcher
    for name, value in (("DSPATCH", "deepspeed"), ("DSPATCH_DISABLE", "deepspeed/initialize-once"),
                        ("DSPATCH_STRICT", "1")):  # quoted by deepspeed >= 0.16
        assert re.search(f'export {name}="?{re.escape(value)}"?;', command), command
    assert command.index("export DSPATCH=") < command.index(str(job))
