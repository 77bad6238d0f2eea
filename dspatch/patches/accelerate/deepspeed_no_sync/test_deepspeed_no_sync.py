"""accelerate/deepspeed-no-sync on this stack: 2-rank torchrun jobs of real accelerate + DeepSpeed (CPU, gloo) and
transformers' Trainer with gradient accumulation 2.

Where it applies (bridge: accelerate 1.8.1 + deepspeed 0.16.9): stock fails with DeepSpeed's AssertionError at
ZeRO-2 and ZeRO-3 (accumulate, no_sync, the Trainer); DSPATCH fixes it; upstream's fix (the diff, accelerate 1.9.0's
change backported) applied to a copy of the installed accelerate fixes it too, and the patched jobs' losses and
parameters are bit-identical to the diff's, case by case ("equal" = to the fixed upstream code on the same stack);
within each run, ZeRO-2/3 `accumulate` is bit-identical to the same loop with `sync_each_batch=True` (which never
enters no_sync); jobs that hit no bug (ZeRO-1, where DeepSpeed's no_sync is still entered, and the reference loops)
are bit-identical to stock.
Where accelerate is fixed upstream (mid: 1.10.1 with deepspeed 0.16.3, which has the asserting no_sync), the same
jobs run stock and satisfy the same equalities. Elsewhere the verdict is asserted."""
import json

import pytest

from dspatch import gating, registry
from dspatch import upstream

from conftest import apply_upstream_diff, clean_env, verify
from packaging.specifiers import SpecifierSet
from upstream_releases import member
from upstream_releases import release_versions
import ast

pytestmark = pytest.mark.stack

PID = "accelerate/deepspeed-no-sync"
PATCH = registry.all_patches()[PID]
FOUND = gating.evaluate(PATCH)
VERSION, VERDICT, REASON = FOUND.version, FOUND.verdict, FOUND.reason
DEEPSPEED = upstream.installed_version("deepspeed")


def _version(text):
    from packaging.version import Version

    return Version(text)


def _requires_applies():
    if VERDICT != gating.APPLIES:
        pytest.skip(f"{PID} does not apply here: {VERDICT} ({REASON})")


@pytest.fixture(scope="module")
def _records(tmp_path_factory):
    return tmp_path_factory.mktemp("no-sync-records")


def _recorded(folder, name, **env):
    """verify's results and the numbers of every case of the job (same folder and env: one run, memoised)."""
    record = folder / f"{name}.json"
    result = verify(PID, clean_env(DSPATCH_NO_SYNC_RECORD=record, **env))
    with open(record) as f:
        return result, json.load(f)


def test_verdict_on_this_stack():
    """The gate combines accelerate's release and deepspeed's, and says which combination it saw."""
    assert VERSION == upstream.installed_version("accelerate")
    if _version(VERSION) >= _version("1.9.0"):
        assert VERDICT == gating.FIXED_UPSTREAM, REASON
    elif _version(DEEPSPEED) < _version("0.16.0"):
        assert VERDICT == gating.NOT_AFFECTED, REASON
        assert f"the bug needs deepspeed>=0.16.0; deepspeed {DEEPSPEED} is installed" in REASON
    else:
        assert VERDICT == gating.APPLIES, REASON
        assert f"accelerate {VERSION} has the bug" in REASON and f"with deepspeed {DEEPSPEED}" in REASON


def test_stock_fails_and_the_patch_fixes(_records):
    _requires_applies()
    stock, stock_numbers = _recorded(_records, "stock")
    assert stock["applied"] == []
    for name, fragment in PATCH.expected_on_stock.items():
        assert stock["results"][name].startswith("bug:") and fragment in stock["results"][name], stock["results"]
    assert "accumulate-3: AssertionError: no_sync context manager is incompatible with gradient partitioning logic " \
           "of ZeRO stage 3" in stock["results"]["accumulate_zero2_zero3"]
    patched, numbers = _recorded(_records, "patched", DSPATCH=PID)
    assert patched["applied"] == [PID]
    assert patched["results"] == dict.fromkeys(PATCH.scenarios, "ok"), patched["results"]
    # what hits no bug trains exactly as on stock: ZeRO-1 (DeepSpeed's no_sync entered, as before) and the
    # reference loops
    unaffected = [case for case, result in stock_numbers.items() if "error" not in result]
    assert set(unaffected) == {"sync_each_batch-2", "sync_each_batch-3", "native-2", "accumulate-1",
                               "sync_each_batch-1"}
    for case in unaffected:
        assert numbers[case] == stock_numbers[case], case
    assert numbers["accumulate-1"]["entered_deepspeed_no_sync"] == 2


def test_upstream_diff_fixes_it_and_the_patch_trains_as_it_does(_records, package_copy):
    """accelerate 1.9.0's change, as the backport in upstream_prs/ applies it to this accelerate, with no
    monkeypatch: the same jobs pass, and the patched jobs' losses and parameters equal its own, bit for bit."""
    _requires_applies()
    site, package = package_copy("accelerate")
    apply_upstream_diff(PATCH, VERSION, site)
    fixed, reference = _recorded(_records, "upstream", PYTHONPATH=site)
    assert fixed["applied"] == []
    assert fixed["results"] == dict.fromkeys(PATCH.scenarios, "ok"), fixed["results"]
    _, numbers = _recorded(_records, "patched", DSPATCH=PID)
    assert set(numbers) == set(reference)
    for case in reference:
        assert numbers[case] == reference[case], case
    assert reference["trainer-2"]["changed"] and len(reference["trainer-2"]["losses"]) == 2


def test_fixed_upstream_runs_the_same_jobs_stock(_records):
    """accelerate >= 1.9.0 with a deepspeed that has the asserting no_sync: the same jobs pass stock, and the
    same equalities hold (accumulate == sync_each_batch at ZeRO-2/3, no_sync == DeepSpeed's own loop at ZeRO-2,
    ZeRO-1 still entering DeepSpeed's no_sync). accelerate 1.15 + DeepSpeed cannot run 2 CPU processes (both
    ranks take rank 0), so only a stack whose accelerate can is run."""
    if VERDICT != gating.FIXED_UPSTREAM:
        pytest.skip(f"accelerate {VERSION} is not fixed upstream: {VERDICT}")
    if _version(DEEPSPEED) < _version("0.16.0") or _version(VERSION) >= _version("1.11.0"):
        pytest.skip(f"accelerate {VERSION} + deepspeed {DEEPSPEED}: no job that can show the bug runs here")
    stock, numbers = _recorded(_records, "stock")
    assert stock["applied"] == []
    assert stock["results"] == dict.fromkeys(PATCH.scenarios, "ok"), stock["results"]
    assert numbers["accumulate-2"] == numbers["sync_each_batch-2"]
    assert numbers["accumulate-3"] == numbers["sync_each_batch-3"]
    assert numbers["accumulate-1"]["entered_deepspeed_no_sync"] == 2


# ---- what the released sources say: marked unit_only, run once in the unit session, never executed ----

NO_SYNC = registry.all_patches()["accelerate/deepspeed-no-sync"]


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_no_sync_deepspeed_asserts_in_no_sync_from_0_16_0():
    """The second half of the gate: `DeepSpeedEngine.no_sync` exists, and asserts that gradients are not
    partitioned, in exactly the releases `requires` names (0.14.0-0.15.4 have no no_sync at all)."""
    for version in release_versions("deepspeed", "0.14.0", "0.19.8"):
        tree = ast.parse(member("deepspeed", version, "deepspeed/runtime/engine.py"))
        node = upstream.find_definition(tree, "DeepSpeedEngine.no_sync")
        asserting = node is not None and any(
            isinstance(n, ast.Assert) and "zero_optimization_partition_gradients" in ast.dump(n.test)
            for n in ast.walk(node))
        assert asserting == SpecifierSet(NO_SYNC.requires["deepspeed"]).contains(version), version
        assert (node is None) == (not asserting), version


@pytest.mark.unit_only  # released sources only: once, in the unit session
def test_no_sync_the_trainer_reaches_deepspeeds_no_sync_only_through_accelerate():
    """Why there is no transformers patch: the Trainer of every release 4.46.1-4.47.1 (4.46.0 has no sdist) enters
    no_sync only as `self.accelerator.no_sync` (4.46.2-4.47.0 on each micro-step but the last of a window, 4.47.1
    not under DeepSpeed; 4.46.1 through accumulate only), so the fixed Accelerator.no_sync (this patch, or
    accelerate >= 1.9.0) covers it."""
    direct = []
    for version in release_versions("transformers", "4.46.0", "4.47.1"):
        tree = ast.parse(member("transformers", version, "src/transformers/trainer.py"))
        uses = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and node.attr == "no_sync"]
        assert set(uses) <= {"self.accelerator.no_sync"}, (version, uses)
        direct += [version] if uses else []
    assert direct == ["4.46.2", "4.46.3", "4.47.0", "4.47.1"]
