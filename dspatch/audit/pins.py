"""Reading the pins: requirements and constraints files (-r/-c, markers, hashes), `pip freeze` output, uv.lock,
poetry.lock, pylock.toml; each package's pin as the versions it admits."""
import os
import re
import sys

from dspatch.releases import RELEASES
from dspatch.versions import InvalidVersion, Specifier, SpecifierSet, Version


class Unreadable(ValueError):
    """An input that cannot be read: the message says which file, which line, and why."""


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


class Pin:
    """What the inputs say of one package: `spec` (a PEP 440 specifier; "" for any release), or `versions` (the exact
    releases a lock file lists: more than one where it resolves per platform), and where it was read."""

    def __init__(self, name, spec="", versions=None, where=""):
        self.name, self.spec, self.versions, self.where = canonical(name), spec, list(versions or []), where

    @property
    def text(self):
        if self.versions:
            return " or ".join(f"=={v}" for v in self.versions)
        return self.spec or "(any release)"

    def releases(self):
        """The releases the pin admits: its exact versions, or those of dspatch.releases its range contains."""
        if self.versions:
            return list(self.versions)
        spec = SpecifierSet(self.spec)
        return [v for v in RELEASES.get(self.name, ()) if spec.contains(v)]

    def merged(self, other):
        """Both pins at once (a requirements file and its constraints): exact versions win, ranges add up; two
        different exact versions cannot both hold (pip would refuse them too)."""
        if self.versions and other.versions and self.versions != other.versions:
            raise Unreadable(f"{other.where}: {self.name}{other.text} conflicts with {self.name}{self.text} "
                             f"({self.where})")
        if self.versions or other.versions:
            exact = self if self.versions else other
            return Pin(self.name, versions=exact.versions, where=exact.where)
        spec = ",".join(s for s in (self.spec, other.spec) if s)
        return Pin(self.name, spec, where=f"{self.where}, {other.where}")


# ---- reading the inputs -------------------------------------------------------------------------------------------

_NAME = re.compile(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[^\]]*\])?\s*(.*)$")
# pip options with a value that say nothing of a pin (a requirement line's own --hash/--config-settings included)
_IGNORED = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--trusted-host", "--no-binary",
            "--only-binary", "--use-feature", "--hash", "--config-settings", "-C", "--global-option")
_IGNORED_FLAGS = ("--pre", "--prefer-binary", "--require-hashes", "--no-index")
# what pip installs from a location given alone: a URL (git+https://..., https://.../x.whl), a path (./pkg, /x, ~/x),
# an archive or wheel file
_BARE_LOCATION = re.compile(r"^(?:[a-z][a-z0-9+.-]*://|[./~]|[A-Za-z]:[\\/])|\.(?:whl|zip|tar\.gz|tgz|tar\.bz2)$")


def _marker_holds(marker, where):
    """Whether an environment marker holds for this interpreter (pip's reading), or None where no marker parser is
    there (packaging, or pip's copy of it): then the pin is kept."""
    try:
        from packaging.markers import InvalidMarker, Marker
    except ImportError:
        try:
            from pip._vendor.packaging.markers import InvalidMarker, Marker
        except ImportError:
            return None
    try:
        return Marker(marker).evaluate()
    except InvalidMarker as e:
        raise Unreadable(f"{where}: invalid environment marker {marker!r}: {e}") from None


def requirement(text, where):
    """A Pin from one requirement (`name[extras] specifiers ; marker`, `name @ url`), or None when its marker does
    not hold here."""
    found = _NAME.match(text)
    if not found:
        raise Unreadable(f"{where}: not a requirement: {text.strip()!r}")
    name, _, rest = found.groups()
    rest, _, marker = rest.partition(";")
    if marker.strip() and _marker_holds(marker.strip(), where) is False:
        return None
    rest = rest.strip()
    if rest.startswith("@"):  # a direct reference (a URL, a path): no release number to judge
        return Pin(name, where=where)
    spec = rest.strip("()").replace(" ", "")
    if spec.startswith("===") and "," not in spec:  # arbitrary equality: that exact string
        return Pin(name, versions=[spec[3:]], where=where)
    parts = [p for p in spec.split(",") if p]
    for part in parts:
        try:
            Specifier(part)
        except (InvalidVersion, ValueError) as e:
            raise Unreadable(f"{where}: {name}: not a version specifier: {part!r} ({e})") from None
    if len(parts) == 1 and parts[0].startswith(("==", "===")) and "*" not in parts[0]:
        return Pin(name, versions=[parts[0].lstrip("=")], where=where)
    return Pin(name, ",".join(parts), where=where)


def _logical_lines(text):
    """(line number, text) of a requirements file: comments out, `\\` continuations joined."""
    held, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", line)
        if not held:
            start = number
        if line.endswith("\\"):
            held += line[:-1] + " "
            continue
        yield start, held + line
        held = ""
    if held:
        yield start, held


def _requirements(text, name, pins, seen):
    folder = os.path.dirname(os.path.abspath(name)) if name != "-" else os.getcwd()
    for number, line in _logical_lines(text):
        where = f"{name}:{number}"
        words = line.split()
        if not words:
            continue
        first = words[0]
        if first in ("-r", "--requirement", "-c", "--constraint") or \
                first.startswith(("-r", "-c", "--requirement=", "--constraint=")):
            target = first.split("=", 1)[1] if "=" in first else (first[2:] if first[:2] in ("-r", "-c") and
                                                                   len(first) > 2 else " ".join(words[1:2]))
            if not target:
                raise Unreadable(f"{where}: {first} names no file")
            _read_file(os.path.join(folder, target), pins, seen, where)
            continue
        if first in ("-e", "--editable") or first.startswith("--editable=") or _BARE_LOCATION.match(first):
            continue  # a checkout, a URL or a path of something: not a release
        if first.startswith("-"):
            option = first.split("=", 1)[0]
            if option in _IGNORED or option in _IGNORED_FLAGS:
                continue
            raise Unreadable(f"{where}: unknown option {option!r}")
        # a requirement, maybe followed by --hash=... options
        text_part = re.split(r"\s--?[a-zA-Z]", " " + line, maxsplit=1)[0].strip()
        found = requirement(text_part, where)
        if found:
            pins[found.name] = pins[found.name].merged(found) if found.name in pins else found


def _toml(text, name):
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise Unreadable(f"{name}: reading a TOML lock file needs Python >= 3.11 (or the tomli package)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise Unreadable(f"{name}: not valid TOML: {e}") from None


def _lock(data, name, pins):
    """uv.lock and poetry.lock ([[package]]) and pylock.toml (PEP 751, [[packages]]): name and version of each."""
    entries = data.get("packages") if "lock-version" in data else data.get("package")
    if not isinstance(entries, list):
        raise Unreadable(f"{name}: a TOML file that is no lock file dspatch knows (uv.lock, poetry.lock, pylock.toml: "
                         f"no [[package]] or [[packages]] list)")
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise Unreadable(f"{name}: package entry {index + 1} has no name")
        version = entry.get("version")
        where = f"{name}: {entry['name']}"
        if version is None:  # a directory, a VCS checkout, the project itself: no release
            continue
        try:
            Version(str(version))
        except InvalidVersion:
            raise Unreadable(f"{where}: version {version!r} is not a PEP 440 version") from None
        key = canonical(entry["name"])
        versions = pins[key].versions if key in pins else []
        pins[key] = Pin(key, versions=sorted(set(versions) | {str(version)}, key=Version), where=where)


def _read_file(path, pins, seen, where=None):
    if path != "-" and os.path.abspath(path) in seen:
        return
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            seen.add(os.path.abspath(path))
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise Unreadable(f"{where + ': ' if where else ''}{path}: cannot read: {e}") from None
    base = os.path.basename(path)
    if base in ("uv.lock", "poetry.lock") or (base.startswith("pylock.") and base.endswith(".toml")) or \
            (path == "-" and re.match(r"\s*(#.*\n\s*)*(\[\[packages?\]\]|lock-version\s*=|version\s*=)", text)):
        _lock(_toml(text, path), path, pins)
    else:
        _requirements(text, path, pins, seen)


def read_pins(paths=(), pins_text=""):
    """{canonical name: Pin} from the files (requirements, constraints, `pip freeze`, uv.lock, poetry.lock,
    pylock.toml) and from `--pins` ("name==version ..."). Unreadable says where and why."""
    pins, seen = {}, set()
    for path in paths:
        _read_file(path, pins, seen)
    for number, text in enumerate(pins_text.split(), 1):  # a "what if": they replace what the files say
        found = requirement(text, f"--pins item {number}")
        if found:
            pins[found.name] = found
    return pins

