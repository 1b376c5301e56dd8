"""Build hook only (the package's metadata is in pyproject.toml): the demo's Scrapy project ships in
the wheel.

``python -m scrapy_proxy_shard.demo`` runs ``scrapy crawl shop`` in ``example_project/``, which lives at
the top of the repository, where people read it. A wheel built from this tree (or from its sdist,
which holds the folder: MANIFEST.in) gets a copy of its ``scrapy.cfg`` and ``shardshop/`` package as
``scrapy_proxy_shard/demo/example_project/`` (found by ``scrapy_proxy_shard.demo.run.default_project``).
An editable install gets no copy: the demo runs the checkout's folder itself.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROJECT = Path(__file__).resolve().parent / "example_project"
SHIPPED = ("scrapy.cfg", "shardshop/**/*.py")


class BuildPyWithDemoProject(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        if not (PROJECT / "scrapy.cfg").is_file():
            raise SystemExit(f"cannot build: {PROJECT} (the demo's Scrapy project) is missing")
        target = Path(self.build_lib) / "scrapy_proxy_shard" / "demo" / "example_project"
        for pattern in SHIPPED:
            for source in sorted(PROJECT.glob(pattern)):
                if "__pycache__" in source.parts:
                    continue
                dest = target / source.relative_to(PROJECT)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, dest)


setup(cmdclass={"build_py": BuildPyWithDemoProject})
