"""PEP 440 versions and specifiers, as much as dspatch's gates need, without importing `packaging`.

`packaging.specifiers` costs about 15 ms to import (it pulls in `packaging.tags`, `platform`, `logging`, `typing`):
a third of `--check`. This module orders versions exactly as PEP 440 says (epoch, release, pre, post, dev, local)
and answers `SpecifierSet(...).contains(version, prereleases=...)` with packaging's rules for the operators the
registry uses (`==`, `!=`, `<`, `<=`, `>`, `>=`, `~=`, and `==X.*` / `!=X.*`); tests/test_versions.py checks every
answer against packaging's over a grid of versions and specifiers. Where packaging 26 changed its answers (a
pre-release with `prereleases=None`; `<V` and `>V` for the pre-, post- and dev-releases of V's own release), this
module keeps the earlier ones, which the gates were written with (they ask about plain releases, and pass
`prereleases=True` where a pre-release may come): one answer, whichever packaging a user has.
"""
_PATTERN = r"""
    ^\s*v?
    (?:(?P<epoch>[0-9]+)!)?
    (?P<release>[0-9]+(?:\.[0-9]+)*)
    (?:[-_.]?(?P<pre_l>alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?P<pre_n>[0-9]+)?)?
    (?:-(?P<post_n1>[0-9]+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>[0-9]+)?)?
    (?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>[0-9]+)?)?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    \s*$"""
_VERSION = None  # compiled on first use: plain releases (0.19.8, 2.13.0+cpu) are read without `re`
_PRE = {"alpha": "a", "a": "a", "beta": "b", "b": "b", "preview": "rc", "pre": "rc", "c": "rc", "rc": "rc"}


def _numbers(text, separator="."):
    """The ints of `text` ("0.19.8") when it is only ASCII digits and separators, else None."""
    parts = text.split(separator)
    if all(part.isdigit() and part.isascii() for part in parts):
        return tuple(int(part) for part in parts)
    return None


def _local_parts(text):
    parts = text.replace("-", ".").replace("_", ".").split(".")
    if all(part.isalnum() and part.isascii() for part in parts):
        return tuple(int(p) if p.isdigit() else p.lower() for p in parts)
    return None


class InvalidVersion(ValueError):
    pass


class Version:
    """A PEP 440 version: comparable, hashable, with the parts the gates read."""

    __slots__ = ("epoch", "release", "pre", "post", "dev", "local", "_key")

    def __init__(self, text):
        text = str(text).strip()
        public, plus, local = text.partition("+")
        release, parts = _numbers(public), _local_parts(local) if plus else None
        if release is not None and (parts is not None or not plus):  # the common case, without a regex
            self.epoch, self.release, self.pre, self.post, self.dev, self.local = 0, release, None, None, None, parts
        else:
            self._parse(text)
        self._key = self._sort_key()

    def _parse(self, text):
        global _VERSION
        if _VERSION is None:
            import re

            _VERSION = re.compile(_PATTERN, re.VERBOSE | re.IGNORECASE)
        found = _VERSION.match(text)
        if not found:
            raise InvalidVersion(f"not a PEP 440 version: {text!r}")
        self.epoch = int(found["epoch"] or 0)
        self.release = tuple(int(part) for part in found["release"].split("."))
        self.pre = (_PRE[found["pre_l"].lower()], int(found["pre_n"] or 0)) if found["pre_l"] else None
        post = found["post_n1"] or found["post_n2"] or ("0" if found["post_l"] else None)
        self.post = int(post) if post is not None else None
        self.dev = int(found["dev_n"] or 0) if found["dev_l"] else None
        self.local = _local_parts(found["local"]) if found["local"] else None

    def _sort_key(self):
        release = list(self.release)
        while len(release) > 1 and release[-1] == 0:  # 1.0 == 1.0.0
            release.pop()
        infinity, negative = (1, ()), (-1, ())
        # a dev release of a final version sorts before its pre-releases; no pre-release sorts after them
        if self.pre is None and self.post is None and self.dev is not None:
            pre = negative
        else:
            pre = (0, self.pre) if self.pre is not None else infinity
        post = (0, self.post) if self.post is not None else negative
        dev = (0, self.dev) if self.dev is not None else infinity
        # local parts: numbers sort after strings; a version with a local part sorts after the same without
        local = negative if self.local is None else (0, tuple((1, p, "") if isinstance(p, int) else (0, 0, p)
                                                                  for p in self.local))
        return self.epoch, tuple(release), pre, post, dev, local

    @property
    def is_prerelease(self):
        return self.pre is not None or self.dev is not None

    @property
    def is_postrelease(self):
        return self.post is not None

    @property
    def is_devrelease(self):
        return self.dev is not None

    @property
    def base_version(self):
        return (f"{self.epoch}!" if self.epoch else "") + ".".join(map(str, self.release))

    @property
    def public(self):
        return Version(str(self).split("+")[0])

    def __str__(self):
        text = self.base_version
        if self.pre:
            text += f"{self.pre[0]}{self.pre[1]}"
        if self.post is not None:
            text += f".post{self.post}"
        if self.dev is not None:
            text += f".dev{self.dev}"
        if self.local:
            text += "+" + ".".join(map(str, self.local))
        return text

    def __repr__(self):
        return f"<Version({str(self)!r})>"

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, Version) and self._key == other._key

    def __lt__(self, other):
        return self._key < other._key

    def __le__(self, other):
        return self._key <= other._key

    def __gt__(self, other):
        return self._key > other._key

    def __ge__(self, other):
        return self._key >= other._key


_OPERATORS = ("~=", "==", "!=", "<=", ">=", "<", ">")


class Specifier:
    def __init__(self, text):
        text = text.strip()
        self.operator = next((op for op in _OPERATORS if text.startswith(op)), None)
        self.version = text[len(self.operator or ""):].strip()
        if self.operator is None or not self.version or any(c in self.version for c in " \t,;"):
            raise ValueError(f"not a version specifier dspatch reads: {text!r}")
        self.wildcard = self.version.endswith(".*")
        if self.wildcard and self.operator not in ("==", "!="):
            raise ValueError(f"a wildcard goes with == or != only: {text!r}")
        self.target = Version(self.version[:-2] if self.wildcard else self.version)
        if self.operator == "~=" and len(self.target.release) < 2:
            raise ValueError(f"~= needs at least two release parts: {text!r}")

    @property
    def prereleases(self):
        """Whether this specifier names a pre-release itself (then it admits pre-releases)."""
        return self.operator in ("==", ">=", "<=", "~=") and self.target.is_prerelease

    def contains(self, version):
        op, target = self.operator, self.target
        if op in ("==", "!="):
            if self.wildcard:
                public = version.public
                # compare the release padded to the target's length (1.2.* holds 1.2, 1.2.3, 1.2rc1)
                size = len(target.release)
                release = (public.release + (0,) * size)[:size]
                same = public.epoch == target.epoch and release == target.release
            else:
                same = (version if target.local else version.public) == target
            return same if op == "==" else not same
        if op == "~=":
            prefix = Specifier("==" + ".".join(map(str, target.release[:-1])) + ".*")
            return version >= target and prefix.contains(version)
        public = version.public
        if op == "<=":
            return public <= target
        if op == ">=":
            return public >= target
        if op == "<":
            # <V holds no pre-release of V's release unless V is one
            return public < target and not (not target.is_prerelease and public.is_prerelease
                                             and public._key[:2] == target._key[:2])
        # >V holds no post-release of V's release (unless V is one) and no local version of it
        if not public > target:
            return False
        if not target.is_postrelease and public.is_postrelease and public._key[:2] == target._key[:2]:
            return False
        return not (version.local and public._key[:2] == target._key[:2])


def within_any(version, specifiers):
    """Whether `version` (pre-releases and dev builds included) is within one of `specifiers` (PEP 440 texts): spans a
    single specifier cannot name ("<4.40.0" or ">=4.52.0")."""
    return any(SpecifierSet(spec).contains(version, prereleases=True) for spec in specifiers)


class SpecifierSet:
    """Comma-separated specifiers, all of which must hold ("" holds every version)."""

    def __init__(self, text=""):
        self.specifiers = [Specifier(part) for part in str(text).split(",") if part.strip()]

    def contains(self, version, prereleases=None):
        version = version if isinstance(version, Version) else Version(version)
        if prereleases is None:  # as packaging: only when a specifier names a pre-release itself
            prereleases = any(s.prereleases for s in self.specifiers)
        if version.is_prerelease and not prereleases:
            return False
        return all(s.contains(version) for s in self.specifiers)

    def __contains__(self, version):
        return self.contains(version)

    def __str__(self):
        return ",".join(f"{s.operator}{s.version}" for s in self.specifiers)
