"""Installs a requirement and its dependency closure one distribution per pip command.

pip keeps every wheel one command downloads until that command ends, so installing torch
in one command needs room for its whole closure twice over: its CUDA libraries' wheels
and what they unpack to. One distribution at a time needs room for the installed venv
plus the largest single wheel. Every requirement is installed with
`--no-deps` and then its own requirements (markers evaluated, the extras it was asked
with included) are visited breadth-first; one already installed at a version the
specifier allows is skipped, and the run fails if a later install broke an earlier
requirement. `--skip NAME` leaves a distribution (and what only it needs) out.

Run it with the venv's interpreter:
    .venv/bin/python scripts/compat/install_piecewise.py "torch>=2.10" --skip triton
"""

import argparse
import importlib.metadata as metadata
import subprocess
import sys
from collections import deque

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name


def installed_version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pip_install(spec):
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "--disable-pip-version-check",
         "--no-deps", spec],
        check=True,
    )


def requirements_of(name, extras):
    """The requirements of installed distribution `name` that apply when it is asked for
    with `extras`."""
    out = []
    for text in metadata.requires(name) or []:
        dep = Requirement(text)
        if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (extras or {""})):
            dep.marker = None
            out.append(dep)
    return out


def satisfied(req):
    version = installed_version(req.name)
    return version is not None and req.specifier.contains(version, prereleases=True)


def walk(requirements, skip, visit):
    """Visits every requirement reachable from `requirements`, breadth-first, once per
    (name, extras, specifier), leaving out the names in `skip`; `visit(name, req)`
    returns whether to go on to what the installed distribution requires."""
    queue = deque(requirements)
    seen = set()
    while queue:
        req = queue.popleft()
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras), str(req.specifier))
        if name in skip or key in seen:
            continue
        seen.add(key)
        if visit(name, req):
            queue.extend(requirements_of(name, req.extras))


def install(requirements, skip):
    """Breadth-first, so that a distribution's pins are installed before what its
    dependencies ask for more loosely (cuda-toolkit pins nvidia-cuda-nvrtc; cuBLAS,
    one level further down, asks for any version)."""

    def install_one(name, req):
        if not satisfied(req):
            spec = name + str(req.specifier)
            print(f"  {spec}", file=sys.stderr, flush=True)
            pip_install(spec)
        return True

    walk(requirements, skip, install_one)
    conflicts = unsatisfied(requirements, skip)
    if conflicts:
        sys.exit("error: installed versions do not satisfy " + ", ".join(conflicts))


def unsatisfied(requirements, skip):
    """The requirements reachable from `requirements` through what is installed now
    (not through versions a later install replaced) that the installed versions do not
    satisfy."""
    out = []

    def check(_name, req):
        if satisfied(req):
            return True
        out.append(str(req))
        return False

    walk(requirements, skip, check)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requirements", nargs="+")
    parser.add_argument("--skip", action="append", default=[], help="a distribution to leave out")
    args = parser.parse_args()
    skip = {canonicalize_name(s) for s in args.skip}
    install([Requirement(t) for t in args.requirements], skip)


if __name__ == "__main__":
    main()
