"""deepspeed/bf16-buffers-left-fp32 beyond the shared proofs, with every patch active: a model that runs with its
buffers as loaded keeps them and stock's numbers to the bit (a tiny Llama, whose rotary inv_freq is its only floating
buffer; a module that casts its own fp32 buffer); a model with both a rotary table and a BatchNorm trains, the
statistics in bf16 and inv_freq still fp32; a first forward that fails for another reason (fp32 inputs) raises stock's
error with every buffer as it was, bit for bit; a config that sets buffer_dtype is left to it."""
import json

import pytest

from conftest import stock_and_patched

pytestmark = pytest.mark.stack

PID = "deepspeed/bf16-buffers-left-fp32"

RUNS = r'''
import json
import torch
from dspatch import _runtime
from dspatch.patches.deepspeed.bf16_buffers_left_fp32.reproducers import batchnorm_loss, batchnorm_model, trained
from dspatch.scenario import digest, init_deepspeed, lm_batches, tiny_llama

def llama_loss(engine, step):
    return engine(**lm_batches(2, seed=step)[step]).loss

class CastsItself(torch.nn.Module):  # an fp32 table the module casts itself, as rotary embeddings do
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8), persistent=False)
    def forward(self, x):
        return self.linear(x) * self.scale.to(x.dtype)

class RotaryAndNorm(torch.nn.Module):  # a rotary table beside a BatchNorm
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear, self.norm = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
    def forward(self, x):
        angles = torch.arange(x.shape[0]).float()[:, None] * self.inv_freq[None, :]
        return self.norm(self.linear(x)) + torch.cat([angles.cos(), angles.sin()], -1).to(x.dtype)

def casts_itself_loss(engine, step):
    return batchnorm_loss(engine, step)

def dtypes(named):
    return {name: str(t.dtype) for name, t in named.items()}

def fp32_inputs():  # a BatchNorm model fed fp32 inputs: its first forward fails whatever the buffers' dtype
    model = batchnorm_model()
    loaded = {name: b.clone() for name, b in model.named_buffers()}
    engine, *_ = init_deepspeed().initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
                "zero_allow_untested_optimizer": True})
    try:
        engine(torch.randn(4, 8))
    except RuntimeError as error:
        message = str(error).splitlines()[0]
    else:
        message = None
    kept = all(b.dtype == loaded[n].dtype and b.equal(loaded[n]) for n, b in engine.module.named_buffers())
    return message, kept

runs = {"llama": trained(lambda: tiny_llama(), llama_loss, 2),
        "casts_itself": trained(CastsItself, casts_itself_loss, 1),
        "rotary_and_norm": None, "buffer_dtype_fp32": None}
try:
    runs["rotary_and_norm"] = trained(RotaryAndNorm, casts_itself_loss, 2)
except RuntimeError as error:
    runs["rotary_and_norm"] = str(error).splitlines()[0]
try:  # buffer_dtype set (to fp32): the config decides, and the BatchNorm fails as it chose
    trained(batchnorm_model, batchnorm_loss, 2, buffer_dtype="fp32")
except RuntimeError as error:
    runs["buffer_dtype_fp32"] = str(error).splitlines()[0]
print(json.dumps({"applied": _runtime.applied_ids(),
                  "digest": {n: digest(w) for n, w in runs.items() if isinstance(w, dict)},
                  "dtypes": {n: dtypes(w) for n, w in runs.items() if isinstance(w, dict)},
                  "failed": {n: w for n, w in runs.items() if isinstance(w, str)},
                  "fp32_inputs": fp32_inputs()}))
'''


@pytest.fixture(scope="module")
def runs():
    return stock_and_patched([PID], RUNS, {"DSPATCH": "1"}, "every_patch")


@pytest.mark.parametrize("name", ["llama", "casts_itself"])
def test_a_model_that_runs_as_loaded_keeps_stocks_numbers_and_buffers(runs, name):
    stock, patched = runs["stock"], runs["every_patch"]
    assert stock["applied"] == [] and PID in patched["applied"]
    assert patched["digest"][name] == stock["digest"][name]
    assert patched["dtypes"][name] == stock["dtypes"][name]
    fp32 = [n for n, d in stock["dtypes"][name].items() if d == "torch.float32"]
    assert fp32, stock["dtypes"][name]  # the model does hold an fp32 buffer the engine left as loaded


def test_a_rotary_table_stays_fp32_where_a_batchnorm_beside_it_is_cast(runs):
    stock, patched = runs["stock"], runs["every_patch"]
    assert "rotary_and_norm" in stock["failed"], json.dumps(stock)  # stock fails on the BatchNorm
    got = patched["dtypes"]["rotary_and_norm"]
    assert got["inv_freq"] == "torch.float32", got
    assert got["norm.running_mean"] == got["norm.running_var"] == "torch.bfloat16", got
    assert got["norm.num_batches_tracked"] == "torch.int64", got


def test_a_first_forward_failing_for_another_reason_raises_stocks_error_and_keeps_the_buffers(runs):
    stock, patched = runs["stock"]["fp32_inputs"], runs["every_patch"]["fp32_inputs"]
    assert stock[0] and patched == stock, (stock, patched)
    assert patched[1] is True


def test_a_config_that_sets_buffer_dtype_is_left_to_it(runs):
    stock, patched = runs["stock"]["failed"], runs["every_patch"]["failed"]
    assert "buffer_dtype_fp32" in stock and patched.get("buffer_dtype_fp32") == stock["buffer_dtype_fp32"]
