"""What pyproject.toml cannot say: the repository's top-level profiles/ ships inside the package.

    profiles/<device>/<model>[.prior].json ─► package_dir ─► jigsaw/profiles/data/<device>/... in a wheel
                                                             (jigsaw.profiles.SHIPPED_DIR finds it there)

`[tool.setuptools.packages.find]` finds only directories under jigsaw/, and pyproject.toml cannot
add a package to what it finds, so the packages are listed here: every jigsaw* package, the
directories of package data under jigsaw/, and the mapped one with its device directories (the
data directories are listed so that setuptools neither warns that they are left out nor, as its
warning says it one day will, leaves them out).
An editable install (the README's) maps nothing; there jigsaw.profiles reads the clone's profiles/.
"""

from pathlib import Path

from setuptools import find_packages, setup

PROFILES = Path(__file__).resolve().parent / "profiles"
devices = sorted(p.name for p in PROFILES.iterdir() if p.is_dir())

setup(packages=[*find_packages(include=["jigsaw*"]), "jigsaw.csrc", "jigsaw.sim.workloads", "jigsaw.profiles.data",
                *(f"jigsaw.profiles.data.{d}" for d in devices)],
      package_dir={"jigsaw.profiles.data": "profiles"})
