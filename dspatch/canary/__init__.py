"""`dspatch canary CONFIG`: the user's DeepSpeed configuration trained on a tiny model, through DeepSpeed and through
plain torch, compared step by step, so that a silent training bug shows before a run, named or not.

    dspatch canary ds_config.json                          the raw engine loop (engine.backward/step)
    dspatch canary ds_config.json --loop trainer --ga 4     the Trainer, its arguments from the options
    dspatch canary ds_config.json --stock --json            also without dspatch; JSON for CI
    dspatch canary ds_config.json --loop pipeline --ga 3    a 2-stage PipelineModule, train_batch, 2 ranks

DeepSpeed trains in an interpreter of its own, with dspatch as the environment has it there (--stock: also one without
it); the reference trains in this one (dspatch.canary.reference). Exit 0: DeepSpeed trained as plain torch does; 1: it
diverged, or the run crashed (said, with the error); 2: bad input, or an option the reference does not model (said).
"""
import json
import os
import sys

from dspatch.canary.plan import HEADS, LOOPS, MODELS, Unmodelled, build_plan, default_options, read


def arguments(parser):
    parser.add_argument("config", metavar="CONFIG", help="your DeepSpeed config (JSON) or accelerate config (YAML); "
                        "\"auto\" values are filled by the Trainer's own code, from the options")
    parser.add_argument("--loop", choices=LOOPS, default=None, help="the loop you train with: the raw engine "
                        "(default; accelerate's for a YAML file), an accelerate loop under accumulate, the Trainer, "
                        "or a pipeline's train_batch (2 stages of a token model)")
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=None, help="1 or 2 gloo/NCCL ranks (default 1; "
                        "2 with --loop pipeline, one stage each)")
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="compare the first N optimizer steps "
                        "only (default: all, the first 2 at 8 micro-batches a step or more; the data is two epochs the "
                        "accumulation does not divide)")
    parser.add_argument("--group-lrs", metavar="LR,LR", default=None,
                        help="two param groups (the output head its own) at these rates")
    parser.add_argument("--ga", type=int, default=None, metavar="N",
                        help="gradient accumulation where the config says auto or nothing (default 1)")
    parser.add_argument("--micro-batch", type=int, default=None, metavar="N", help="where the config says auto (1)")
    parser.add_argument("--world-size", type=int, default=None, metavar="N", help="your job's number of ranks "
                        "(default: the YAML's num_processes, else what train_batch_size implies, else 1)")
    parser.add_argument("--model-params", type=float, default=None, metavar="N", help="your model's parameter "
                        "count, to scale ZeRO's sizes to the tiny model (default 7e9)")
    parser.add_argument("--lr", type=float, default=None, help="the learning rate where the config says auto (0.05)")
    parser.add_argument("--max-grad-norm", type=float, default=None,
                        help="the Trainer's max_grad_norm (1.0, as TrainingArguments); fills gradient_clipping: auto")
    parser.add_argument("--warmup-steps", type=int, default=None, help="warmup steps (auto schedulers, the "
                        "Trainer's; 0)")
    parser.add_argument("--scheduler", default=None, help="the Trainer's lr_scheduler_type where the config "
                        "has no scheduler block (constant)")
    parser.add_argument("--bf16", action="store_true", help="bf16 where the config says auto")
    parser.add_argument("--fp16", action="store_true", help="fp16 where the config says auto (its loss scaler "
                        "modelled)")
    parser.add_argument("--model", choices=MODELS, default="llama", help="a tiny Llama (default) or a sparse "
                        "mixture of experts (Mixtral)")
    parser.add_argument("--head", choices=HEADS, default="causal", help="the Trainer's model head: causal LM "
                        "(default), sequence or token classification")
    parser.add_argument("--backwards", type=int, default=1, metavar="K",
                        help="engine loop: K engine.backward() calls before each engine.step() (default 1)")
    parser.add_argument("--boundary-call", action="store_true",
                        help="with --backwards: engine.set_gradient_accumulation_boundary(False) before all but the "
                        "last backward of a step (True before the last), DeepSpeed's documented way")
    parser.add_argument("--no-accumulate", action="store_true",
                        help="accelerate loop: no accelerator.accumulate() (the accumulation left to DeepSpeed's count)")
    parser.add_argument("--clip-call", type=float, default=None, metavar="NORM",
                        help="accelerate loop: accelerator.clip_grad_norm_(model.parameters(), NORM) after each "
                        "backward that syncs (from the second step on: DeepSpeed steps inside accelerator.backward)")
    parser.add_argument("--backward", choices=("engine", "torch"), default="engine",
                        help="engine loop: engine.backward(loss) (default) or loss.backward() on the engine's output, "
                        "the PyTorch-style backward DeepSpeed supports from 0.18.3")
    parser.add_argument("--stock", action="store_true", help="also run without dspatch, and report both")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where DeepSpeed trains: auto takes DS_ACCELERATOR, else CUDA when torch sees it")
    return parser


def _options(args, facts=None):
    """The plan's options from the command line and what the file says of the job (an accelerate YAML's loop,
    num_processes and mixed_precision): only the options given count as given (the Trainer's loop checks those
    against the config)."""
    facts = facts or {}
    loop = args.loop or facts.get("loop") or "engine"
    rates = None
    if args.group_lrs:
        try:
            rates = [float(r) for r in args.group_lrs.split(",")]
        except ValueError:
            raise Unmodelled(f"--group-lrs {args.group_lrs!r}: give two rates, as 0.01,0.001") from None
        if len(rates) != 2:
            raise Unmodelled(f"--group-lrs {args.group_lrs!r}: give two rates, as 0.01,0.001")
        if loop == "trainer":
            raise Unmodelled("--group-lrs with the Trainer is not modelled (its optimizer makes its own groups)")
    if args.backwards > 1 and loop != "engine":
        raise Unmodelled("--backwards is a raw engine loop's shape (several engine.backward() before a step)")
    if args.clip_call is not None and (loop != "accelerate" or args.clip_call < 0):
        raise Unmodelled("--clip-call NORM is an accelerate loop's call: give --loop accelerate and a NORM of 0 or more")
    if args.no_accumulate and loop != "accelerate":
        raise Unmodelled("--no-accumulate is an accelerate loop's shape: give --loop accelerate")
    if args.backward == "torch":
        from dspatch.canary.plan import version_of

        if loop != "engine":
            raise Unmodelled("--backward torch is a raw engine loop's call: give --loop engine")
        if version_of("deepspeed") < (0, 18, 3):
            raise Unmodelled("--backward torch: DeepSpeed supports loss.backward() on its engine's output from 0.18.3")
    if args.boundary_call and args.backwards < 2:
        raise Unmodelled("--boundary-call marks the backwards of a step: give --backwards 2 or more")
    for name in ("ga", "micro_batch", "world_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise Unmodelled(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number")
    given = {name: value for name, value in (
        ("micro_batch", args.micro_batch), ("accumulation", args.ga), ("lr", args.lr),
        ("max_grad_norm", args.max_grad_norm), ("warmup_steps", args.warmup_steps), ("scheduler", args.scheduler),
        ("world_size", args.world_size or facts.get("world_size")), ("model_params", args.model_params),
        ("precision", "bf16" if args.bf16 else "fp16" if args.fp16 else facts.get("precision")))
        if value is not None}
    if args.bf16 and args.fp16:
        raise Unmodelled("--bf16 and --fp16: give one")
    ranks = args.ranks or (2 if loop == "pipeline" else 1)
    options = default_options(loop=loop, ranks=ranks, steps=args.steps or 0, group_lrs=rates, model=args.model,
                              head=args.head, backwards=args.backwards, boundary_call=args.boundary_call,
                              accumulate=not args.no_accumulate, clip_call=args.clip_call, backward=args.backward,
                              **given)
    if args.steps is None:  # not given: a large accumulation compares its first steps only
        options["given"].remove("steps")
    return options


TIMEOUT = 900  # seconds for one DeepSpeed interpreter or job: a default run takes under 60 s on 2 cores, the tests'
# longest list of plans about 100 s


def _run_job(command, env):
    """(stderr, how it ended) of the DeepSpeed side's command; past TIMEOUT, torchrun is asked to stop (SIGTERM, which
    it passes to its ranks: they run in sessions of their own, out of reach of a kill of its group), then killed."""
    import subprocess

    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT)
        return stderr, f"exited {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        return stderr or "", f"did not finish in {TIMEOUT} s"


def _runner_files(folder, plans):
    """(PLANS, OUT) of a dspatch.canary.runner job in `folder`: the plans written to PLANS, OUT where it saves."""
    plan_path, out = os.path.join(folder, "plan.json"), os.path.join(folder, "record.pt")
    with open(plan_path, "w", encoding="utf-8") as f:
        json.dump(plans, f)
    return plan_path, out


def deepspeed_side(plans, env):
    """The runner's records of DeepSpeed runs under `env` (one plan, or a list run in turn in one interpreter; two
    ranks under torchrun where the plans say)."""
    import glob
    import tempfile

    import torch

    many = isinstance(plans, list)
    ranks = (plans[0] if many else plans)["ranks"]
    with tempfile.TemporaryDirectory(prefix="dspatch-canary-") as folder:
        plan_path, out = _runner_files(folder, plans)
        if ranks > 1:
            from dspatch.scenario import free_port

            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                       "--master_port", free_port(), "-m", "dspatch.canary.runner", plan_path, out]
        else:
            command = [sys.executable, "-m", "dspatch.canary.runner", plan_path, out]
        stderr, why = _run_job(command, env)
        if not os.path.exists(out):
            # a rank whose run failed wrote its error beside the record (dspatch.canary.runner._stop_the_job); the
            # first written is the cause (a peer it left in a collective fails after it, "connection closed by peer")
            errors = sorted(glob.glob(f"{out}.rank*.error"), key=os.path.getmtime)
            if errors:
                with open(errors[0], encoding="utf-8") as f:
                    error = f.read()
            else:
                error = f"the DeepSpeed run {why} without a record:\n{stderr[-4000:]}"
            failed = {"steps": [], "losses": [], "applied": [], "error": error}
            return [failed] * len(plans) if many else failed
        return torch.load(out, weights_only=False)


def environments(stock):
    """[(label, env)] to run DeepSpeed under: the environment as it is, and without dspatch with --stock."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    label = f"DSPATCH={env['DSPATCH']}" if env.get("DSPATCH") else "DSPATCH unset (stock)"
    runs = [(label, env)]
    if stock and env.get("DSPATCH"):
        runs.append(("DSPATCH unset (stock)", {k: v for k, v in env.items() if not k.startswith("DSPATCH")}))
    return runs


def judge(the_plan, got):
    """The first divergence of one DeepSpeed record, or None, with the known bugs its shape names."""
    from dspatch.canary import reference, verdict

    if got.get("error"):
        found = verdict.compare(the_plan, got, {"steps": [], "count": 0}, {})
    else:
        found = verdict.compare(the_plan, got, reference.replay(the_plan, got), reference.start(the_plan))
    if found:
        found["known"] = known_for(found, got, the_plan["loop"])
        found["findings"] = [] if found["known"] else verdict.findings(found["code"])
    return found


def in_process(config, **options):
    """One comparison in this interpreter, as a reproducer runs it: (the runner's record, the first divergence or
    None; for a run that failed, the failure)."""
    from dspatch.canary import runner

    the_plan = build_plan(config, default_options(**options))
    record = runner.run(the_plan)
    return record, judge(the_plan, record.as_dict([]))


def in_ranks(config, **options):
    """One comparison of a job of several ranks, as a reproducer runs it: the ranks launched from this process
    (dspatch.ranks.launch_ranks: with exactly the patches in force here); (the plan, the runner's record, the first
    divergence or None)."""
    import tempfile

    import torch

    from dspatch.ranks import launch_ranks

    the_plan = build_plan(config, default_options(**options))
    with tempfile.TemporaryDirectory(prefix="dspatch-canary-") as folder:
        plan_path, out = _runner_files(folder, the_plan)
        launch_ranks("dspatch.canary.runner", args=(plan_path, out), nproc=the_plan["ranks"])
        record = torch.load(out, weights_only=False)
    return the_plan, record, judge(the_plan, record)


def expect_shape(found, code, what):
    """A reproducer's reading of one comparison: BugSeen(what: step, words) where the first divergence has the bug's
    shape `code`, AssertionError for any other, None where the run trains as the reference."""
    from dspatch.spec import BugSeen

    if found and found["code"] == code:
        raise BugSeen(f"{what}: step {found['step']}: {found['words']}")
    if found:
        raise AssertionError(f"{what}: step {found['step']} ({found['what']}): {found['words']}")


# the libraries whose code each loop runs: deepspeed's engine always, accelerate's under accelerate and the Trainer,
# transformers' Trainer only in its own loop
LIBRARIES = {"engine": ("deepspeed",), "pipeline": ("deepspeed",), "accelerate": ("deepspeed", "accelerate"),
             "trainer": ("deepspeed", "accelerate", "transformers")}


def known_for(found, got, plan_loop="engine"):
    """The patches whose bug shows in this shape in this loop ({id, verdict here, applied in the run}); for a crash,
    those explain names in its error."""
    from dspatch import gating, registry

    patches = registry.all_patches()
    if found["code"] == "crash":
        from dspatch import explain

        _, bugs, choices, _ = explain.explain(found.get("error", ""))
        ids = [b["id"] for b in bugs] + [i for c in choices for i in c["ids"]]
    else:  # a bug of a library the loop does not run cannot be what it shows
        ids = [pid for pid, p in patches.items() if found["code"] in p.canary
               and p.distribution in LIBRARIES[plan_loop]]
    named = []
    for pid in ids:
        verdict = gating.evaluate(patches[pid]).verdict
        named.append({"id": pid, "here": verdict, "applied": pid in got.get("applied", ()),
                      "fixes": verdict == gating.APPLIES})
    return named


def skipped(the_plan, got):
    """(steps skipped, steps compared, the last loss scale) of an fp16 run that skipped any, else None."""
    steps = got.get("steps") or []
    steps = steps[:the_plan.get("steps") or len(steps)]
    count = sum(bool(step.get("skipped")) for step in steps)
    return (count, len(steps), steps[-1].get("scale") or 1.0) if count else None


def describe(the_plan):
    stage = the_plan["stage"]
    loop = f"pipeline of {the_plan['stages']} stages" if the_plan["loop"] == "pipeline" else f"{the_plan['loop']} loop"
    if not the_plan.get("accumulate", True):
        loop += " without accumulate()"
    if the_plan.get("clip_call") is not None:
        loop += f" calling clip_grad_norm_({the_plan['clip_call']:g})"
    if the_plan.get("backward") == "torch":
        loop += " with loss.backward()"
    bits = [loop, f"ZeRO-{stage}", f"micro batch {the_plan['micro']}", f"GA {the_plan['accumulation']}",
            the_plan["precision"], f"{the_plan['ranks']} rank{'s' * (the_plan['ranks'] > 1)}"]
    if the_plan.get("world_size", 1) > 1:
        bits.append(f"for a job of {the_plan['world_size']}")
    if the_plan["offloaded"]:
        bits.append("optimizer offloaded to the CPU")
    if len(the_plan["lrs"]) > 1:
        bits.append(f"param groups at {', '.join(str(r) for r in the_plan['lrs'])}")
    if the_plan["backwards"] > 1:
        bits.append(f"{the_plan['backwards']} backwards a step"
                    + (" (set_gradient_accumulation_boundary before each)" if the_plan["boundary_call"] else ""))
    return ", ".join(bits)


def _filled(key, value, given):
    """One filled "auto" value, as `lr 0.05 (--lr)`."""
    from dspatch.canary.reading import source

    parts = key.split(".")
    name = ".".join(parts[-2:]) if parts[-1] == "enabled" else parts[-1]
    return f"{name} {f'{value:g}' if isinstance(value, float) else value} ({source(key, given)})"


def read_lines(the_plan):
    """What the canary made of the file, a line each: the batch sizes it derived, the "auto" values the Trainer's
    code filled and from what, the sizes it scaled to the tiny model, the steps it compares."""
    read = the_plan.get("read") or {}
    lines = [f"read: {', '.join(read['batch'])}"] if read.get("batch") else []
    if read.get("filled"):
        lines.append("\"auto\" filled by the Trainer's code: " + ", ".join(
            _filled(key, value, the_plan.get("given") or ()) for key, value in read["filled"]))
    if read.get("scaled"):
        lines.append(f"scaled to the tiny model ({read.get('ratio', 'its size')}): " + ", ".join(
            f"{key} {was:g} -> {now}" for key, was, now in read["scaled"]))
    if the_plan.get("steps") and read.get("steps_why"):
        lines.append(read["steps_why"])
    return lines


def _lines(config_path, the_plan, results, tol):
    from dspatch.canary.verdict import power

    out = [f"dspatch canary {config_path}: {describe(the_plan)}; {the_plan['epochs']} epochs of "
           f"{the_plan['per_epoch']} micro-batches"]
    out += ["  " + line for line in read_lines(the_plan)]
    for label, found, applied, skips in results:
        out.append(f"{label}{f' ({len(applied)} patches applied in the run)' if applied else ''}:")
        if found is None:
            out.append(f"  trains as plain torch: every step's rates, gradient, update and reported norm within {tol:g}")
            if skips:
                out.append(f"  {skips[0]} of {skips[1]} steps skipped for an overflow, as the config's loss scaler "
                           f"means (loss scale {power(skips[2])} at the end)")
            continue
        out.append(f"  {'CRASHED' if found['code'] == 'crash' else 'DIVERGES'} at optimizer step {found['step']} "
                   f"({found['what']}): {found['words']}")
        if found["code"] == "crash":
            out += ["    " + line for line in found.get("error", "").strip().splitlines()[-6:]]
        if found["known"]:
            # several bugs of one shape: each is a candidate, and DSPATCH=1 fixes the divergence only if it is one
            maybe = ", if it is this one" if len(found["known"]) > 1 else ""
            others = any(b["fixes"] and not b["applied"] for b in found["known"])
            for bug in found["known"]:
                state = (("applied in this run: not this one" if others else
                          "applied in this run, and it still diverges: please report it") if bug["applied"] else
                         f"DSPATCH=1 fixes it here{maybe}" if bug["fixes"] else f"{bug['here']} here")
                out.append(f"  a known bug of this shape: {bug['id']} ({state})")
        elif found.get("findings"):
            out += [f"  a known upstream bug of this shape, not patched: {words}" for words in found["findings"]]
        elif found["code"] == "crash":
            out.append("  no known bug names this error (dspatch explain knows none)")
        else:
            out.append("  no known bug has this shape: a new bug, or something the reference does not model (say so "
                       "in an issue, with this output)")
    return out


def command(args, prog="dspatch canary"):
    from dspatch import term
    from dspatch.canary import verdict

    from dspatch.upstream import installed_version

    missing = [name for name in ("torch", "deepspeed", "transformers") if not installed_version(name)]
    if missing:
        print(f"{prog}: {', '.join(missing)} not installed for {sys.executable}: run it with the training "
              f"environment's Python", file=sys.stderr)
        return 2
    import dspatch

    # the reference is plain torch: no patch in this process (DeepSpeed runs in its own, with dspatch as the
    # environment has it); the filling of "auto" is stock transformers' too
    dspatch.revert()
    try:
        config, facts = read(args.config)
        options = _options(args, facts)
        the_plan = build_plan(config, options)
    except Unmodelled as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the canary's own set-up failed on this file: never a traceback, never a divergence
        print(f"{prog}: the canary cannot model this: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 2
    if args.device == "cuda" or (args.device == "auto" and os.environ.get("DS_ACCELERATOR") == "cuda"):
        print(f"{prog}: a GPU run is not modelled yet (the reference runs on the CPU): --device cpu", file=sys.stderr)
        return 2
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dspatch.canary.runner import UNMODELLED

    results = []
    for label, env in environments(args.stock):
        got = deepspeed_side(the_plan, env)
        if UNMODELLED in (got.get("error") or ""):
            print(f"{prog}: {got['error'].split(UNMODELLED, 1)[1].splitlines()[0]}", file=sys.stderr)
            return 2
        try:
            results.append((label, judge(the_plan, got), got.get("applied", []), skipped(the_plan, got)))
        except Exception as e:  # the reference failed: the canary's own, not the user's stack
            print(f"{prog}: the canary cannot model this: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    tol = verdict.tolerance(the_plan)
    status = 1 if results[0][1] else 0
    if args.json:
        print(json.dumps({"config": args.config, "plan": {k: v for k, v in the_plan.items() if k != "config"},
                          "tolerance": tol, "exit": status,
                          "runs": [{"environment": label, "applied": applied, "divergence": found,
                                    "skipped": skips[0] if skips else 0}
                                   for label, found, applied, skips in results]}, indent=1, default=str))
    else:
        term.out(_lines(args.config, the_plan, results, tol))
    return status


def main(argv=None, prog="python -m dspatch.canary"):
    import argparse

    parser = arguments(argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0]))
    return command(parser.parse_args(argv), prog)
