"""Matching: which known bugs a log's lines show, decided by frames, hints and versions, and what to do about each."""
import os

from dspatch.explain.lines import (JOINED, first_match, message_at, present_lines, traceback_window, clean_lines,
                                     log_versions)
from dspatch.explain.patterns import trigger_words


def _hits(lines, patches):
    """Every place a patch's signature matches: {line number: [hit]}, a hit the patch, its signature, the text
    and the line numbers that decided (needs, and the hint if one matched). `needs` are looked for in the message's
    traceback; `context`, `hints` and `unless` in the whole log."""
    hits = {}
    everywhere = range(len(lines))
    holding = {}  # trigger word -> numbers of the lines that hold it
    for patch in patches:
        for signature in patch.signatures:
            trigger = trigger_words(signature.message)
            if trigger:  # only where the message's word is, on its line or up to JOINED lines below
                for word in trigger[0]:
                    if word not in holding:
                        holding[word] = [n for n in present_lines(lines) if word in lines[n]]
                starts = sorted({max(0, n - k) for word in trigger[0] for n in holding[word]
                                 for k in range(JOINED + 1)})
            else:
                starts = present_lines(lines)
            for number in starts:
                text = message_at(lines, number, signature)
                if text is None:
                    continue
                where = traceback_window(lines, number)
                needed = [first_match(lines, where, p) for p in signature.needs]
                if None in needed or any(first_match(lines, everywhere, p) is None for p in signature.context):
                    continue
                if any(first_match(lines, everywhere, p) is not None for p in signature.unless):
                    continue
                hint = next((n for n in (first_match(lines, everywhere, p) for p in signature.hints) if n is not None),
                            None)
                found = needed + [first_match(lines, everywhere, p) for p in signature.context]
                hits.setdefault(number, []).append(
                    {"patch": patch, "signature": signature, "text": text, "evidence": found, "hint": hint})
                break  # this signature's first full match; later repeats (other ranks) add nothing
    return hits


def _in_range(version, specifier):
    from dspatch.versions import SpecifierSet
    from dspatch.versions import InvalidVersion, Version

    try:
        return SpecifierSet(specifier or "").contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True  # not a release version: it cannot rule a candidate out


def _outside(patch, versions):
    """Why `versions` ({distribution: version}) rule the patch's bug out, or None."""
    wanted = {patch.distribution: patch.affected, **patch.requires}
    for name, specifier in wanted.items():
        if name in versions and not _in_range(versions[name], specifier):
            return f"{name} {versions[name]} is outside {specifier}"
    return None


def _environment_versions(names):
    from dspatch.gating import installed_version

    found = {}
    for name in names:
        version = installed_version(name)
        if version:
            found[name] = version
    return found


def _decide(lines, candidates, printed):
    """For the hits at one line: (those still standing, how they were told apart, the versions used, whether this
    environment's versions decided, the hits set aside because this environment's versions rule them out)."""
    how, used = [], {}
    specific = [c for c in candidates if not c["signature"].generic]
    if specific and len(specific) < len(candidates):
        how.append("its message is more specific than " + ", ".join(
            c["patch"].id for c in candidates if c["signature"].generic))
        candidates = specific
    shown = {name: version for name, (version, _) in printed.items()}
    standing = []
    for candidate in candidates:
        reason = _outside(candidate["patch"], shown)
        if reason:
            how.append(f"not {candidate['patch'].id}: the log shows {reason}")
        else:
            standing.append(candidate)
    for candidate in standing:
        for name in (candidate["patch"].distribution, *candidate["patch"].requires):
            if name in printed:
                used[name] = f"{printed[name][0]} (printed at line {printed[name][1]})"
    candidates = standing
    if len(candidates) > 1 and any(c["hint"] is not None for c in candidates):
        hinted = [c for c in candidates if c["hint"] is not None]
        if len(hinted) < len(candidates):
            for c in hinted:
                how.append(f"line {c['hint'] + 1} points to it: {lines[c['hint']].strip()[:160]}")
            candidates = hinted
    # what the log does not print: the versions installed here (explain runs where the job ran, as a rule)
    names = {n for c in candidates for n in (c["patch"].distribution, *c["patch"].requires) if n not in printed}
    here = _environment_versions(names) if names else {}
    if not here:
        return candidates, how, used, False, []
    inside = [c for c in candidates if not _outside(c["patch"], here)]
    aside = [c for c in candidates if c not in inside]
    for c in inside:
        for name in (c["patch"].distribution, *c["patch"].requires):
            if name in here:
                used[name] = f"{here[name]} (installed here; the log prints none)"
    if aside and inside:
        how.append("the versions installed here rule out " + ", ".join(c["patch"].id for c in aside)
                   + " (if the log came from another machine, check its versions)")
    return inside, how, used, bool(aside and inside), aside


def find(lines, patches):
    """(named, undecided, set aside): named, one dict per bug the log decides ({patch, line, text, confidence,
    why, versions}); undecided, one per message that two known bugs (or a known bug and a failure no patch fixes,
    `Signature.also`) give and the log cannot tell apart ({patches, line, text, why, tell, also}); set aside, the
    bugs whose message the log shows but that the versions installed here do not have ({patch, line, text,
    reason})."""
    printed = log_versions(lines)
    named, undecided, aside = [], [], []
    for number, candidates in sorted(_hits(lines, patches).items()):
        standing, how, used, from_here, ruled_out = _decide(lines, candidates, printed)
        if not standing:
            here = _environment_versions({c["patch"].distribution for c in ruled_out})
            aside += [{"patch": c["patch"], "line": number + 1, "text": c["text"],
                       "reason": _outside(c["patch"], here)} for c in ruled_out]
            continue
        # a failure no patch fixes writes the same lines: only a hint decides (a choice between known bugs that
        # the versions settled is no decision against it)
        also = [c["signature"].also for c in standing if c["signature"].also]
        if len(standing) > 1 or (also and standing[0]["hint"] is None):
            undecided.append({"patches": [c["patch"] for c in standing], "line": number + 1,
                              "text": standing[0]["text"], "why": how, "versions": used,
                              "tell": {c["patch"].id: c["signature"].tell for c in standing}, "also": also})
            continue
        (hit,) = standing
        why = [f"line {n + 1}: {lines[n].strip()[:160]}" for n in hit["evidence"]] + how
        if hit["hint"] is not None and len(candidates) == 1:
            why.append(f"line {hit['hint'] + 1}: {lines[hit['hint']].strip()[:160]}")
        named.append({"patch": hit["patch"], "line": number + 1, "text": hit["text"],
                      "confidence": "likely" if from_here else "certain", "why": why, "versions": used})
    # one bug per report: the first place it is decided; a choice that includes a named bug is that bug, seen again
    seen, unique = set(), []
    for item in named:
        if item["patch"].id not in seen:
            seen.add(item["patch"].id)
            unique.append(item)
    choices = [u for u in undecided if not seen & {p.id for p in u["patches"]}]
    once = []
    for item in aside:
        if item["patch"].id not in seen:
            seen.add(item["patch"].id)
            once.append(item)
    return unique, choices, once


def _where_the_job_ran(patch, logged):
    """What to do where the log came from, when this environment is not where its bug is: the release the log
    printed (or the patch's range, where it printed none), and the DSPATCH that fixes the job there."""
    fix = f"DSPATCH={patch.id} (or DSPATCH=1) on every rank fixes it there"
    upgrade = f", as does {patch.distribution} {patch.fixed_in} or later" if patch.fixed_in else ""
    version = logged.get(patch.distribution)
    if version and not _outside(patch, logged):
        if patch.supported and not _in_range(version, patch.supported):
            return (f"the job's {patch.distribution} {version} has this bug, but the patch is written for "
                    f"{patch.supported} only: upgrade to {patch.fixed_in or 'a release with the fix'}")
        return f"the job ran {patch.distribution} {version} (printed in the log), which has this bug: {fix}{upgrade}"
    span = "every release" if patch.affected.strip() in ("", ">=0") else patch.affected
    return f"where the job ran a {patch.distribution} with the bug ({span}), {fix}{upgrade}"


def advice(patch, environ=None, logged=None):
    """(verdict, reason, active, what to do) for this environment, and the job the log came from (`logged`: the
    versions the log prints, {distribution: version})."""
    from dspatch import gating, registry

    env = os.environ if environ is None else environ
    logged = logged or {}
    found = gating.evaluate(patch)
    version, verdict, reason = found.version, found.verdict, found.reason
    try:
        selected = patch.id in registry.selection(None, env, "DSPATCH")[0] if registry.active(env) else False
    except registry.SelectionError:
        selected = False
    if verdict == gating.APPLIES and not (logged.get(patch.distribution, version) != version
                                          and _outside(patch, logged)):
        if selected:
            todo = ("it is active here (DSPATCH selects it); if this log comes from a job run with it active, "
                    "the fix did not hold: please report it with the log")
        else:
            todo = f"set DSPATCH={patch.id} (or DSPATCH=1) for the job, on every rank"
    else:
        todo = _where_the_job_ran(patch, logged)
        if verdict == gating.DRIFTED:
            todo += "; here dspatch leaves this install alone: its source is not a known release's"
    return verdict, reason, selected, todo


def _entry(patch, environ, logged=None):
    verdict, reason, active, todo = advice(patch, environ, logged)
    return {"id": patch.id, "cause": patch.cause or patch.summary, "fix": patch.summary, "verdict": verdict,
            "reason": reason, "active": active, "do": todo, "links": list(patch.links)}


def explain(text, patches=None, environ=None):
    """(lines read, bugs named, choices left open, bugs set aside by the versions here): JSON-ready dicts. `text` is
    the log (a str) or its lines as skim gives them."""
    from dspatch import registry

    patches = list(registry.all_patches().values()) if patches is None else patches
    lines = clean_lines(text) if isinstance(text, str) else text
    named, undecided, aside = find(lines, patches)
    logged = {name: version for name, (version, _) in log_versions(lines).items()}
    bugs = [{**_entry(item["patch"], environ, logged), "line": item["line"], "text": item["text"],
             "confidence": item["confidence"], "why": item["why"], "versions": item["versions"]}
            for item in named]
    choices = [{"ids": [p.id for p in item["patches"]], "line": item["line"], "text": item["text"],
                "why": item["why"], "versions": item["versions"], "also": item["also"],
                "candidates": [{**_entry(p, environ, logged), "tell": item["tell"][p.id]} for p in item["patches"]]}
               for item in undecided]
    set_aside = [{**_entry(item["patch"], environ, logged), "line": item["line"], "text": item["text"],
                  "ruled_out": item["reason"]} for item in aside]
    return len(lines), bugs, choices, set_aside
