"""deepspeed/zero3-moe-leaf-modules beyond the shared proofs (which run on mid), on ds0183 (deepspeed 0.18.3,
transformers 4.57.6) with Ernie 4.5 MoE, a class DeepSpeed does not mark: the user's choice wins. Leaves the user
set by hand stay theirs (with every patch active the job is stock's to the bit), DSPATCH_DISABLE leaves the patch
out (the ranks diverge again, as on stock), and a config that sets `zero_optimization.leaf_module` itself, to no
class, is obeyed. On old and bridge (transformers 4.40-4.51), Mixtral's block, which runs every expert there, is left
as it is while Jamba's becomes a leaf, and on bridge PhiMoE's ranks routed apart train as with its leaves set by hand; in the unit session, the classes it marks are those the released sources of
transformers run apart."""
import pytest

from conftest import clean_env, last_json, run_python, skip_unless_applies
from dspatch.patches.deepspeed.zero3_moe_leaf_modules.reproducers import _how_it_failed

pytestmark = pytest.mark.stack

PID = "deepspeed/zero3-moe-leaf-modules"

RUN = r'''
import json, sys
import deepspeed.runtime.zero.parameter_offload  # the patches DSPATCH selects apply here, and the ranks inherit them
from dspatch import _runtime
from dspatch.patches.deepspeed.zero3_moe_leaf_modules.reproducers import run

print(json.dumps({"applied": _runtime.applied_ids(), "ranks": run(sys.argv[2], sys.argv[1])}))
'''


def _run(mode, kind="mixtral", **env):
    return last_json(run_python(["-c", RUN, mode, kind], env=clean_env(**env), warm="stack"))


@pytest.fixture(autouse=True)
def applies_here(request):
    from dspatch import upstream
    from dspatch.versions import Version

    if request.node.get_closest_marker("unit_only"):  # released sources only
        return
    skip_unless_applies(PID)
    if request.node.get_closest_marker("any_deepspeed"):
        return
    if Version(upstream.installed_version("deepspeed")) < Version("0.18.0"):  # CI time: the shared proofs run here
        pytest.skip("the user's choices are tested on deepspeed >= 0.18.0 (ds0183), where the config's leaf_module "
                    "exists too")


def test_leaves_set_by_hand_stay_the_users_with_every_patch_active():
    stock, patched = _run("by_hand", "ernie"), _run("by_hand", "ernie", DSPATCH="1")
    assert stock["applied"] == [] and PID in patched["applied"]
    assert isinstance(stock["ranks"], list) and stock["ranks"][0]["hit"] != stock["ranks"][1]["hit"]
    assert patched["ranks"] == stock["ranks"]


def test_dspatch_disable_leaves_it_out():
    left_out = _run("", "ernie", DSPATCH="1", DSPATCH_DISABLE=PID)
    assert PID not in left_out["applied"]
    assert isinstance(left_out["ranks"], str) and _how_it_failed(left_out["ranks"]), left_out  # as on stock


def test_a_config_that_sets_leaf_module_itself_is_obeyed():
    obeyed = _run("config_none", "ernie", DSPATCH="1")
    assert PID in obeyed["applied"]
    assert isinstance(obeyed["ranks"], str) and _how_it_failed(obeyed["ranks"]), obeyed  # no leaf: they diverge


LEAVES = r'''
import json
import deepspeed.runtime.zero.parameter_offload  # the patches DSPATCH selects apply here
from dspatch import _runtime
from dspatch.patches.deepspeed.zero3_moe_leaf_modules.reproducers import _model
from dspatch.scenario import init_deepspeed, zero3_config

deepspeed = init_deepspeed()
marked = {}
for kind in ("mixtral", "jamba"):
    model, block = _model(kind)
    deepspeed.initialize(model=model, config=zero3_config(), model_parameters=model.parameters())
    marked[kind] = [getattr(m, "_z3_leaf", False) for m in model.modules() if isinstance(m, block)]
print(json.dumps({"applied": _runtime.applied_ids(), "marked": marked}))
'''


@pytest.mark.any_deepspeed
def test_where_mixtral_runs_every_expert_its_block_is_left_as_it_is():
    """transformers 4.40-4.51 (old, bridge): Mixtral's block runs every expert, so the patch leaves it as it is
    (DeepSpeed < 0.18 marks nothing); Jamba's, which skips experts without tokens, becomes a leaf."""
    from dspatch import upstream
    from dspatch.versions import Version

    if not Version("4.40.0") <= Version(upstream.installed_version("transformers")) < Version("4.52.0"):
        pytest.skip("proven where transformers is 4.40-4.51 (the old and bridge stacks)")
    found = last_json(run_python(["-c", LEAVES], env=clean_env(DSPATCH="1"), warm="stack"))
    assert PID in found["applied"] and found["marked"] == {"mixtral": [False], "jamba": [True]}, found


@pytest.mark.any_deepspeed
def test_phimoe_routed_apart_trains_as_with_its_blocks_set_by_hand():
    """PhiMoE (its block skips experts without tokens from transformers 4.46, read from the sources; no DeepSpeed
    release marks it), on bridge (transformers 4.46.3): stock's ranks diverge at the first forward, DSPATCH=1 trains
    with the losses of the leaves set by hand, to the bit."""
    from dspatch import upstream
    from dspatch.versions import Version

    if not Version("4.46.0") <= Version(upstream.installed_version("transformers")) < Version("4.52.0"):
        pytest.skip("proven where transformers is 4.46-4.51 (the bridge stack)")
    want, stock, patched = _run("by_hand", "phimoe"), _run("", "phimoe"), _run("", "phimoe", DSPATCH="1")
    assert isinstance(want["ranks"], list) and want["ranks"][0]["hit"] != want["ranks"][1]["hit"], want
    assert isinstance(stock["ranks"], str) and _how_it_failed(stock["ranks"]), stock
    assert PID in patched["applied"] and patched["ranks"] == want["ranks"], (patched, want)


def _blocks_that_skip_experts(version):
    """{(module, class)} of that transformers release whose forward loops over experts, skips those without tokens
    (`expert_hit`, or a `continue`) and runs each as a module of its own (`self.experts[...]`): read from its sdist."""
    import ast
    import re
    import tarfile

    from upstream_releases import sdist

    found = set()
    with tarfile.open(sdist("transformers", version), "r|gz") as tar:
        for member in tar:
            path = re.search(r"src/(transformers/models/\w+/modeling_\w+)\.py$", member.name)
            if not path or not member.isfile():
                continue
            text = tar.extractfile(member).read().decode()
            if "expert" not in text:
                continue
            for cls in (node for node in ast.parse(text).body if isinstance(node, ast.ClassDef)):
                for loop in (node for fn in cls.body if isinstance(fn, ast.FunctionDef) and fn.name == "forward"
                             for node in ast.walk(fn) if isinstance(node, ast.For)):
                    source = ast.get_source_segment(text, loop)
                    head = source.splitlines()[0]
                    skips = "expert_hit" in head or any(isinstance(n, ast.Continue) for n in ast.walk(loop))
                    if "expert" in head and skips and "self.experts[" in source:
                        found.add((path.group(1).replace("/", "."), cls.name))
    return found


# the releases where the set changes: Mixtral skips (4.36-4.39), then not, Jamba and PhiMoE come, the `expert_hit`
# routing comes (4.52), then the last release before transformers 5 (read once over every release 4.36.0-4.57.6)
@pytest.mark.unit_only
@pytest.mark.parametrize("version", ["4.39.3", "4.40.0", "4.51.3", "4.52.1", "4.57.6"])
def test_the_blocks_it_marks_are_those_the_release_runs_apart(version):
    from dspatch.patches.deepspeed.zero3_moe_leaf_modules import SPARSE_MOE_BLOCKS, skips_experts

    declared = {(module, name) for module, classes in SPARSE_MOE_BLOCKS.items() for name in classes
                if skips_experts(module, name, version)}
    assert _blocks_that_skip_experts(version) == declared, version
