"""Version floors (spmdsplit/versions.py): a library older than the code needs stops the job at
start-up with one line, instead of loading a model in fp32 or failing deep inside an import."""

import os
import subprocess
import sys

import pytest

from spmdsplit import versions
from spmdsplit.config import load_config


def test_what_this_environment_has_passes_every_floor():
    cfg = load_config(None, ["rollout.name=vllm", "actor.engine=deepspeed"])
    assert versions.required_packages(cfg) == ["torch", "transformers", "vllm", "deepspeed"]
    assert versions.version_problems(cfg) == []


def test_pyproject_states_the_same_floors():
    text = open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")).read()
    for package, (floor, _) in versions.FLOORS.items():
        assert f'"{package}>={floor}' in text, package


@pytest.mark.e2e
def test_a_transformers_below_the_floor_stops_the_job_with_one_line(tmp_path):
    """A real transformers 4.55.4 from the package registry, put in front of the environment's
    newer one, as in a cluster environment that already had it. The wheel itself goes on the path
    (Python imports from a zip archive and reads its metadata there): unpacking its thousands of
    files, all the check needs is its metadata, took 20 s here."""
    download = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                               "-d", str(tmp_path), "transformers==4.55.4"], capture_output=True, text=True)
    assert download.returncode == 0, download.stderr[-2000:]
    (wheel,) = tmp_path.glob("transformers-4.55.4-*.whl")
    from tests.support import launch

    result = launch.python(["-m", "spmdsplit.train", "trainer.total_steps=1"], timeout=120,
                           env={"PYTHONPATH": os.pathsep.join([str(wheel), os.getcwd()])})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["spmdsplit [rank 0]: error: transformers 4.55.4 is installed; spmdsplit needs "
                     "transformers>=4.56 (`from_pretrained(dtype=...)` / `from_config(dtype=...)`: older versions "
                     "ignore `dtype` and load the model in fp32)"], result.stderr[-2000:]


@pytest.mark.parametrize("found, problem", [
    ("0.19.8", None), ("0.19.12", None),
    ("0.19.7", "deepspeed 0.19.7 is installed; spmdsplit needs deepspeed>=0.19.8"),
    ("0.20.0", "deepspeed 0.20.0 is installed; spmdsplit needs deepspeed<0.20"),
])
def test_deepspeed_has_a_floor_and_a_ceiling(monkeypatch, found, problem):
    monkeypatch.setattr(versions, "installed_version", lambda package: found)
    got = versions.version_problem("deepspeed")
    assert got == problem if problem is None else got.startswith(problem)
