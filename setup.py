"""One installed name, the repository's folders as they are: ``model/``, ``export/`` and ``service/`` install as
``addnorm.model``, ``addnorm.export`` and ``addnorm.service`` (``addnorm/`` holds the package's own
``__init__``). Everything else is in pyproject.toml; bench/ and tests/ are checkout tools, not installed."""

from setuptools import find_packages, setup

FOLDERS = ("model", "export", "service")

setup(
    packages=["addnorm"]
    + [f"addnorm.{folder}" for folder in FOLDERS]
    + [f"addnorm.{folder}.{sub}" for folder in FOLDERS for sub in find_packages(folder)],
    package_dir={"addnorm": "addnorm", **{f"addnorm.{folder}": folder for folder in FOLDERS}},
)
