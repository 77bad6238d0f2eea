"""`dspatch canary` on the configs real projects ship (issue 57): tests/canary_corpus/ holds DeepSpeed JSON configs and
accelerate YAML files taken as they are from public repositories (SOURCES.tsv: repository, path, commit). Each is read
as its stack reads it (accelerate's loader, the Trainer's filling, DeepSpeed's config classes) and either trains as
plain torch with DSPATCH=1 or is refused for a reason docs/canary.md lists: never a crash of the canary's own, never a
divergence that is the canary's mistake. One DeepSpeed interpreter runs every config of a pass.
"""
import argparse
import csv
import os
import shutil

import pytest

from conftest import STACK, clean_env

CORPUS = os.path.join(os.path.dirname(__file__), "canary_corpus")
# what the canary says it cannot model, as docs/canary.md lists it (a refusal must start with one of these)
REASONS = ("NVMe offload is not modelled", "the optimizer 'OneBitAdam' is not modelled",
           "fp16_master_weights_and_grads is not modelled",
           # --ga 3 asked of a config whose train_batch_size states another accumulation
           "DeepSpeed refuses this config at world size")


def sources():
    with open(os.path.join(CORPUS, "SOURCES.tsv"), encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def laid_out(folder):
    """The corpus laid out as its repositories have it ({file: path under folder}), so that a YAML's
    deepspeed_config_file resolves as it does there."""
    found = {}
    for row in sources():
        path = os.path.join(folder, row["repo"], row["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.copy(os.path.join(CORPUS, row["file"]), path)
        found[row["file"]] = path
    return found


def plans(folder, *args):
    """({file: plan}, {file: why refused}) of `dspatch canary FILE ARGS` for every file of the corpus."""
    from dspatch import canary

    made, refused = {}, {}
    for name, path in sorted(laid_out(folder).items()):
        parsed = canary.arguments(argparse.ArgumentParser()).parse_args([path, *args])
        try:
            config, facts = canary.read(path)
            made[name] = canary.build_plan(config, canary._options(parsed, facts))
        except canary.Unmodelled as e:
            refused[name] = str(e)
    return made, refused


@pytest.mark.unit_only
def test_the_corpus_is_real_and_sourced():
    """At least 25 configs from public projects, each with its repository, path and commit; YAML files among them."""
    rows = sources()
    assert len(rows) >= 25 and len({row["repo"] for row in rows}) >= 10, len(rows)
    for row in rows:
        assert os.path.exists(os.path.join(CORPUS, row["file"])), row
        assert "/" in row["repo"] and row["path"] and len(row["commit"]) == 40, row
    assert sorted(os.listdir(CORPUS)) == sorted([row["file"] for row in rows] + ["SOURCES.tsv"])
    assert sum(row["file"].endswith((".yaml", ".yml")) for row in rows) >= 5


def _judged(made, env):
    """{file: None or why it diverged or crashed, or "refused: why"} of one DeepSpeed interpreter's runs; a
    divergence the canary names as a known upstream finding (dspatch.canary.verdict.FINDINGS) is "finding: why"."""
    from dspatch.canary import deepspeed_side, judge
    from dspatch.canary.runner import UNMODELLED

    names = sorted(made)
    records = deepspeed_side([made[n] for n in names], env)
    found = {}
    for name, record in zip(names, records):
        if UNMODELLED in (record["error"] or ""):
            found[name] = "refused: " + record["error"].split(UNMODELLED, 1)[1].splitlines()[0]
            continue
        verdict = judge(made[name], record)
        found[name] = None if verdict is None else \
            f"{'finding: ' if verdict.get('findings') else ''}step {verdict['step']} ({verdict['what']}): " \
            f"{verdict['words']}"
    return found


def _check(made, refused):
    """Every file trains as plain torch with DSPATCH=1, or is refused for a listed reason, or shows an upstream bug
    the canary names (a finding no patch fixes): never a crash, never "a new bug"."""
    found = _judged(made, clean_env(DSPATCH="1", DS_ACCELERATOR="cpu"))
    wrong = {name: why for name, why in refused.items() if not why.startswith(REASONS)}
    wrong.update({name: why for name, why in found.items() if why and not why.startswith("finding: ")
                  and not why[len("refused: "):].startswith(REASONS)})
    assert not wrong, wrong
    trained = [name for name, why in found.items() if why is None]
    assert len(trained) >= 25, (len(trained), found)
    return found


@pytest.mark.stack
@pytest.mark.skipif(STACK != "latest", reason="the whole corpus on the latest stack, at GA 3 on mid")
def test_every_config_trains_as_plain_torch_or_is_refused_for_a_listed_reason(tmp_path):
    """The default run of each file (the engine loop for JSON, accelerate's for YAML), as a user runs it."""
    made, refused = plans(str(tmp_path))
    _check(made, refused)


@pytest.mark.stack
@pytest.mark.skipif(STACK != "mid", reason="the old release at GA 3 on mid")
def test_on_an_older_release_at_ga_3_dspatch_trains_every_modellable_config_right(tmp_path):
    """deepspeed 0.16.3 at GA 3 in bf16 ("auto" precision; fp16 where the config enables it), its first 2 steps,
    with DSPATCH=1: the patches fix what is known there. One finding: DeepSpeedExamples' fp16 config that sets no
    scaler value starts at 2^32 (before 0.17.1), which the canary names."""
    made, refused = plans(str(tmp_path), "--ga", "3", "--bf16", "--steps", "2")
    found = _check(made, refused)
    findings = {name: why for name, why in found.items() if why and why.startswith("finding: ")}
    assert list(findings) == ["microsoft__DeepSpeedExamples__autotuning__hf__dsconfigs__ds_config_fp16_z2.json"], \
        findings
    assert "loss scale is 2^32 where the config's scaler gives 2^16" in next(iter(findings.values()))
