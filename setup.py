"""The folders stay at the top of the repository but install under one name.

``./envs`` installs as ``rollflow.envs``, ``./tasks`` as ``rollflow.tasks``, and so on:
generic top-level names (``tasks``, ``storage``) would collide with a user's own modules
(a ``tasks.py`` is the Celery and invoke convention). ``pyproject.toml`` holds everything
else; only the computed package list lives here.
"""

from setuptools import find_packages, setup

FOLDERS = ("envs", "tasks", "generators", "config", "flows", "cluster", "ops", "storage", "policy")

subpackages = find_packages(include=[pattern for folder in FOLDERS for pattern in (folder, f"{folder}.*")])
setup(
    packages=["rollflow", *(f"rollflow.{name}" for name in subpackages)],
    package_dir={"rollflow": "rollflow", **{f"rollflow.{folder}": folder for folder in FOLDERS}},
)
