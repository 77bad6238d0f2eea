"""Released upstream sources, straight from PyPI's sdists, for gating tests and fingerprint tables.

    python tests/upstream_releases.py deepspeed/zero3-module-id 0.14.0 0.19.8   # fingerprint table

Downloads from the package index pip is configured to use (PIP_INDEX_URL, pip's config, else pip's own
default), through its simple JSON API, each file checked against its sha256, into DSPATCH_RELEASE_CACHE
(default ~/.cache/dspatch/releases); nothing is built or executed. (`pip download` of an sdist would build
its metadata first: deepspeed's setup.py imports torch and takes a minute per release.)
"""
import hashlib
import json
import os
import sys
import tarfile
import urllib.parse
import urllib.request

CACHE = os.environ.get("DSPATCH_RELEASE_CACHE", os.path.expanduser("~/.cache/dspatch/releases"))


_indexes = {}


def _store(path, data):
    """Write `path` whole or not at all: through a file of this process's own (pytest-xdist workers fill the
    same cache at once; a shared temporary name let one worker publish another's half-written file)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.{os.getpid()}.part"
    with open(part, "wb") as f:
        f.write(data)
    os.replace(part, path)


def _index_url():
    """The index pip would use: PIP_INDEX_URL, else `pip config`, else pip's built-in default."""
    import subprocess

    url = os.environ.get("PIP_INDEX_URL", "").split()
    if not url:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                              capture_output=True, text=True)
        url = proc.stdout.split() if proc.returncode == 0 else []
    if not url:
        from pip._internal.models.index import PyPI

        url = [PyPI.simple_url]
    return url[0].rstrip("/") + "/"


def _index(project):
    """PyPI's file list for a project: fetched once per run, kept in the cache for runs without a network."""
    if project not in _indexes:
        cached = os.path.join(CACHE, f"{project}-index.json")
        request = urllib.request.Request(f"{_index_url()}{project}/",
                                         headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                data = json.load(response)
            _store(cached, json.dumps(data).encode())
        except OSError:
            if not os.path.exists(cached):
                raise
            with open(cached) as f:
                data = json.load(f)
        _indexes[project] = data
    return _indexes[project]


def named_releases(text, versions):
    """The releases of `versions` that a fingerprint table's "0.14.0-0.15.3" (or "0.16.3", or ranges separated by
    commas) names."""
    from packaging.version import Version

    found = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        found += [v for v in versions if Version(low) <= Version(v) <= Version(high or low)]
    return sorted(set(found), key=Version)


def sdist_versions(project, low, high):
    from packaging.version import InvalidVersion, Version

    found = []
    for f in _index(project)["files"]:
        name = f["filename"]
        if not name.endswith(".tar.gz") or f.get("yanked"):
            continue
        try:
            v = Version(name[len(project) + 1:-len(".tar.gz")])
        except InvalidVersion:
            continue
        if Version(low) <= v <= Version(high) and not v.is_prerelease:
            found.append(v)
    return [str(v) for v in sorted(set(found))]


def released_versions(project):
    """Every final release of `project` on the index (sdist or wheel, not yanked), oldest first."""
    from packaging.version import InvalidVersion, Version

    found = set()
    for f in _index(project)["files"]:
        name = f["filename"]
        if f.get("yanked") or not name.endswith((".tar.gz", ".whl")):
            continue
        text = name[:-len(".tar.gz")].split("-", 1)[-1] if name.endswith(".tar.gz") else name.split("-")[1]
        try:
            v = Version(text)
        except InvalidVersion:
            continue
        if not (v.is_prerelease or v.is_postrelease or v.local):
            found.add(v)
    return [str(v) for v in sorted(found)]


def write_release_list(path):
    """dspatch/releases.py: the releases `dspatch audit` knows, from the index (python tests/upstream_releases.py)."""
    from dspatch.releases import RELEASES

    lines = ['"""The final releases of each package dspatch knows of, oldest first: what `dspatch audit` reads a range',
             "pin against (a release newer than the last listed is said to be unknown). Written by",
             '`python tests/upstream_releases.py`; tests/test_audit.py checks it against the package index."""',
             "RELEASES = {"]
    for project in RELEASES:
        versions = released_versions(project)
        lines.append(f"    {project!r}: (")
        line = "       "
        for v in versions:
            if len(line) + len(v) + 4 > 118:
                lines.append(line)
                line = "       "
            line += f" {v!r},"
        lines += [line, "    ),"]
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# From these releases on (older ones were published before what dspatch patches): the packages whose requirements on
# the others `dspatch audit` minds when it proposes an upgrade (transformers names none of them outside its extras)
REQUIRES_FROM = {"deepspeed": "0.14.0", "accelerate": "0.20.0", "trl": "0.9.0", "peft": "0.10.0"}


def requires_dist(project, version):
    """{other package of dspatch.releases.RELEASES: its specifier} that release requires (Requires-Dist of its sdist's
    PKG-INFO, or its wheel's METADATA; requirements of an extra left out; none without a specifier)."""
    import email.parser
    import zipfile

    from packaging.requirements import Requirement

    from dspatch.releases import RELEASES

    name = f"{project}-{version}-py3-none-any.whl"
    if any(f["filename"] == name for f in _index(project)["files"]):  # a wheel's METADATA always lists them (the PKG-INFO of an sdist built by an older setuptools does not)
        with zipfile.ZipFile(wheel(project, version)) as whl:
            text = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    else:  # deepspeed publishes sdists only; its setup.py reads requirements/requirements.txt
        with tarfile.open(sdist(project, version)) as tar:
            names = {m.name.split("/", 1)[-1]: m for m in tar.getmembers()}
            text = tar.extractfile(names["PKG-INFO"]).read().decode()
            if "Requires-Dist:" not in text and "requirements/requirements.txt" in names:
                listed = tar.extractfile(names["requirements/requirements.txt"]).read().decode()
                text += "".join(f"Requires-Dist: {line.strip()}\n" for line in listed.splitlines()
                                if line.strip() and not line.startswith("#"))
    found = {}
    for line in email.parser.Parser().parsestr(text).get_all("Requires-Dist") or ():
        req = Requirement(line)
        name = req.name.lower().replace("_", "-")
        if name in RELEASES and name != project and str(req.specifier) and \
                not (req.marker and "extra" in str(req.marker)):
            found[name] = str(req.specifier & found.get(name, ""))  # a package named twice: both hold
    return found


def write_requires_list(path):
    """dspatch/requires.py: what each release of REQUIRES_FROM's packages requires of the others, from the released
    files (python tests/upstream_releases.py --write-requires-list)."""
    lines = ['"""What each release requires of the other packages dspatch knows (Requires-Dist, extras left out),',
             "for the upgrades `dspatch audit` proposes: {package: {release: {other: specifier}}}, releases from the",
             "first listed on (older ones: not known). Written by `python tests/upstream_releases.py",
             '--write-requires-list` from the released files; tests/test_audit.py checks some against them."""',
             "REQUIRES = {"]
    for project, low in REQUIRES_FROM.items():
        lines.append(f"    {project!r}: {{")
        for version in release_versions(project, low, "999"):
            lines.append(f"        {version!r}: {requires_dist(project, version)!r},")
        lines.append("    },")
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def sdist(project, version):
    """Path of the cached sdist, downloaded and verified on first use."""
    name = f"{project}-{version}.tar.gz"
    path = os.path.join(CACHE, name)
    if os.path.exists(path):
        return path
    entry = next(f for f in _index(project)["files"] if f["filename"] == name)
    url = urllib.parse.urljoin(f"{_index_url()}{project}/", entry["url"])  # an index may give relative URLs
    with urllib.request.urlopen(url, timeout=300) as response:
        data = response.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise RuntimeError(f"{name}: sha256 mismatch")
    _store(path, data)
    return path


def extract_modules(project, version, modules, into):
    """Extract the source files of `modules` (dotted names) from the sdist into `into`; returns a locate
    function (module name -> path or None) for dspatch.gating.evaluate."""
    wanted = {}
    for module in modules:
        parts = module.split(".")
        wanted["/".join(parts) + ".py"] = module
        wanted["/".join(parts) + "/__init__.py"] = module
    found = {}
    with tarfile.open(sdist(project, version)) as tar:
        for member in tar.getmembers():
            relative = member.name.split("/", 1)[-1]
            if relative.startswith("src/") and relative[4:] in wanted:  # accelerate, transformers: a src/ layout
                relative = relative[4:]
            if relative in wanted and member.isfile():
                target = os.path.join(into, relative)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with tar.extractfile(member) as src, open(target, "wb") as dst:
                    dst.write(src.read())
                found[wanted[relative]] = target
    return found.get


def release_files(project, version, files):
    """{relative path under src/: path of the file as released}, read from the sdist once into the cache."""
    base = os.path.join(CACHE, "src-files", f"{project}-{version}")
    out = {f: os.path.join(base, f) for f in files}
    if all(os.path.exists(p) for p in out.values()):
        return out
    want = {f"src/{f}": f for f in files}
    with tarfile.open(sdist(project, version), "r|gz") as tar:
        for member in tar:
            relative = member.name.split("/", 1)[-1]
            if relative in want and member.isfile():
                with tar.extractfile(member) as src:
                    _store(out[want.pop(relative)], src.read())
                if not want:
                    break
    missing = [f for f, p in out.items() if not os.path.exists(p)]
    assert not missing, (project, version, missing)
    return out


def wheel(project, version):
    """The release's pure-Python wheel, for releases published without an sdist (trl 0.9.2-0.9.6, 0.12.1):
    downloaded through the configured index, checked against its sha256 and cached like the sdists."""
    name = f"{project}-{version}-py3-none-any.whl"
    path = os.path.join(CACHE, name)
    if not os.path.exists(path):
        entry = next(f for f in _index(project)["files"] if f["filename"] == name)
        with urllib.request.urlopen(urllib.parse.urljoin(f"{_index_url()}{project}/", entry["url"]), timeout=300) as r:
            data = r.read()
        assert hashlib.sha256(data).hexdigest() == entry["hashes"]["sha256"], name
        _store(path, data)
    return path


def release_versions(project, low, high):
    """Every release low..high (no pre-releases, none yanked): those with an sdist, and those published as a
    pure-Python wheel only (trl 0.9.2-0.9.6, 0.12.1)."""
    from packaging.version import InvalidVersion, Version

    found = set(sdist_versions(project, low, high))
    for f in _index(project)["files"]:
        name = f["filename"]
        if name.endswith("-py3-none-any.whl") and not f.get("yanked"):
            try:
                v = Version(name.split("-")[1])
            except InvalidVersion:
                continue
            if Version(low) <= v <= Version(high) and not v.is_prerelease:
                found.add(str(v))
    return sorted(found, key=Version)


def release_tree(project, version, paths):
    """A folder holding `paths` (repository paths: "deepspeed/runtime/engine.py", "src/accelerate/accelerator.py")
    as that release has them, read once from its sdist (or its wheel, for a release published without one) into
    the cache; paths the release lacks are simply not there. Returns the folder, laid out as the repository."""
    import zipfile

    root = os.path.join(CACHE, "trees", f"{project}-{version}")
    asked = os.path.join(root, ".asked.json")
    known = set(json.load(open(asked))) if os.path.exists(asked) else set()
    wanted = set(paths) - known
    if not wanted:
        return root
    names = {}  # a wheel has no src/ level: its file serves both forms of the path
    for path in wanted:
        names.setdefault(path[4:] if path.startswith("src/") else path, []).append(path)
    if f"{project}-{version}.tar.gz" in {f["filename"] for f in _index(project)["files"]}:
        with tarfile.open(sdist(project, version), "r|gz") as tar:
            for member in tar:
                relative = member.name.split("/", 1)[-1]
                if member.isfile() and relative in wanted:
                    with tar.extractfile(member) as src:
                        _store(os.path.join(root, relative), src.read())
    else:
        with zipfile.ZipFile(wheel(project, version)) as whl:
            for name in whl.namelist():
                for path in names.get(name, ()):
                    _store(os.path.join(root, path), whl.read(name))
    _store(asked, json.dumps(sorted(known | wanted)).encode())
    return root


def module_paths(module):
    """The repository paths where a module's source can be (a module or a package; src/ layout or not)."""
    base = module.replace(".", "/")
    return [f"{prefix}{base}{suffix}" for prefix in ("", "src/") for suffix in (".py", "/__init__.py")]


def tree_locate(root):
    """module -> path of its source in a release_tree (None when the release lacks it), for gating.evaluate."""
    def locate(module):
        for path in module_paths(module):
            if os.path.isfile(os.path.join(root, path)):
                return os.path.join(root, path)
        return None

    return locate


def released_fingerprints(patch, versions, into):
    """{target qualname: set of its fingerprints} over the released sources of `versions`."""
    from dspatch import upstream

    seen = {t.qualname: set() for t in patch.targets}
    for version in versions:
        locate = extract_modules(patch.distribution, version, patch.modules, os.path.join(str(into), version))
        for t in patch.targets:
            seen[t.qualname].add(upstream.fingerprint(locate(t.module), t.qualname))
    return seen


# What the per-patch tests read in the released sources and the diffs (each patch's own test module).

def named(text, patch):
    """Whether dspatch.explain names `patch` in the log `text` (only that patch considered)."""
    from dspatch import explain

    return [item["patch"] for item in explain.find(explain.clean_lines(text), [patch])[0]] == [patch]


def diff_text(relative):
    """The text of a diff of upstream_prs/, by its relative path."""
    from dspatch import data_dir

    return open(os.path.join(data_dir("upstream_prs"), relative)).read()


def changed_lines(text):
    """(removed, added) lines of a diff's body, without their +/- and the file headers."""
    body = text.split("\n---\n", 1)[1].split("\n-- \n", 1)[0]  # between the stat and the signature
    removed = [line[1:] for line in body.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in body.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return removed, added


def member(project, version, relative):
    """One file of a release, by its repository path (None when the release lacks it)."""
    path = os.path.join(release_tree(project, version, [relative]), relative)
    return open(path, "rb").read() if os.path.isfile(path) else None


def git_am(tree, diff, message):
    """Commit `tree` as it is, `git am` the diff of upstream_prs/ on it; the applied commit's message."""
    import subprocess

    from dspatch import data_dir

    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    git = lambda *a: subprocess.run(["git", *a], cwd=tree, env=env, check=True, capture_output=True,  # noqa: E731
                                    text=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", message)
    git("am", os.path.join(data_dir("upstream_prs"), diff))
    return git("log", "-1", "--format=%s%n%b").stdout


def main(argv):
    """`python tests/upstream_releases.py PATCH_ID LOW HIGH`: each target's fingerprints over those releases (to
    declare them); `python tests/upstream_releases.py --write-release-list`: dspatch/releases.py from the index;
    `--write-requires-list`: dspatch/requires.py from the released files."""
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    if argv == ["--write-release-list"]:
        return write_release_list(os.path.join(root, "dspatch", "releases.py"))
    if argv == ["--write-requires-list"]:
        return write_requires_list(os.path.join(root, "dspatch", "requires.py"))
    from dspatch import registry
    from dspatch import upstream

    patch = registry.all_patches()[argv[0]]
    table = {}
    for version in sdist_versions(patch.distribution, argv[1], argv[2]):
        with tempfile.TemporaryDirectory() as tmp:
            locate = extract_modules(patch.distribution, version, patch.modules, tmp)
            for t in patch.targets:
                path = locate(t.module)
                fp = path and upstream.fingerprint(path, t.qualname)
                table.setdefault((t.module, t.qualname), {}).setdefault(fp, []).append(version)
    for (module, qualname), prints in table.items():
        print(f"{module}:{qualname}")
        for fp, versions in prints.items():
            print(f"    {fp!r}: {versions[0]}-{versions[-1]} ({len(versions)} releases: {', '.join(versions)})")


if __name__ == "__main__":
    main(sys.argv[1:])
