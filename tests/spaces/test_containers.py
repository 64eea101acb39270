"""Each Space's container entry, run outside docker (no image registry can be reached here).

The rendered Space folder (its CPU image) is installed into a fresh virtualenv the way its Dockerfile
installs it (torch from a CPU wheel first where the image does so, then requirements.txt, then the
project without dependencies), and the Dockerfile's exact CMD is started in that folder, which is the
image's WORKDIR, with the Dockerfile's ENV and what a Space adds: PORT, HOME, variables, secrets.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from shared.process import ServerProcess, free_port
from shared.spaces import ROOT, SPACES, render_space

pytestmark = [pytest.mark.slow, pytest.mark.install]  # `make containers`: ~6-11 minutes of fresh installs
PINS = {line.split("==")[0]: line.split("==")[1]
        for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
TOKEN, API_KEY = "space-update-token", "space-api-key"


def dockerfile(folder: Path, keyword: str) -> list[str]:
    text = (folder / "Dockerfile").read_text().replace("\\\n", " ")
    return [ln.split(None, 1)[1] for ln in text.splitlines() if ln.split(None, 1)[:1] == [keyword]]


def image_env(folder: Path, home: Path) -> dict[str, str]:
    """The Dockerfile's ENV, with the image user's home moved to ``home``."""
    env: dict[str, str] = {}
    for line in dockerfile(folder, "ENV"):
        for pair in shlex.split(line):
            key, value = pair.split("=", 1)
            env[key] = value.replace("/home/user", str(home))
    env.pop("PATH", None)
    return env


def run(cmd: list[str], **kw) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}: {r.stderr[-3000:]}"


def install(folder: Path, venv: Path) -> Path:
    run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    spec = SPACES[folder.name]
    if "torch" in spec.cpu.provided:  # the image's first RUN: the CPU build of the pinned torch
        run([*pip, f"torch=={PINS['torch']}"])
    run([*pip, "-r", "requirements.txt"], cwd=folder)
    if "uninstall" in " ".join(dockerfile(folder, "RUN")):
        run([str(venv / "bin/python"), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
             "torchcodec"])
    run([*pip, "--no-deps", "."], cwd=folder)
    return venv


@pytest.fixture
def space(request, tmp_path: Path):
    """(folder, command, environment) of one Space, installed in a fresh venv."""
    folder = render_space(SPACES[request.param], tmp_path / request.param, cpu=True)
    venv = install(folder, tmp_path / "venv")
    (home := tmp_path / "home").mkdir()
    (cmd,) = dockerfile(folder, "CMD")
    env = {**image_env(folder, home), "HOME": str(home), "PATH": f"{venv}/bin:/usr/bin:/bin",
           "PORT": str(free_port())}
    for step in dockerfile(folder, "RUN"):  # the image's build steps after the installs, as its user
        if step.startswith("deltasync "):
            run(shlex.split(step), cwd=folder, env=env)
    return folder, json.loads(cmd), env


def refuses_without_token(folder: Path, cmd: list[str], env: dict[str, str]) -> str:
    r = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    return r.stderr


@pytest.mark.parametrize("space", ["env"], indirect=True)
def test_env_space_container_entry(space, tmp_path: Path):
    folder, cmd, env = space
    with ServerProcess(cmd, port=int(env["PORT"]), log_path=tmp_path / "env.log", env=env, cwd=folder) as proc:
        proc.wait_ready(180)
        r = httpx.post(f"{proc.url}/reset", json={"seed": 7}, timeout=30)
        assert r.status_code == 200 and r.json()["session_id"], r.text
        assert httpx.get(f"{proc.url}/web/", timeout=30, follow_redirects=True).status_code == 200
    python = Path(env["PATH"].split(":")[0]) / "python"
    r = subprocess.run([str(python), "-c", "import torch"], cwd=tmp_path, capture_output=True, text=True)
    assert "No module named 'torch'" in r.stderr  # the env image stays small


@pytest.mark.parametrize("space", ["rollout"], indirect=True)
def test_rollout_space_container_entry(space, tiny_model_dir: Path, tmp_path: Path):
    folder, cmd, env = space
    # the Space's variables (the image defaults MODEL to a Hub model, unreachable here)
    env |= {"MODEL": str(tiny_model_dir), "DELTASYNC_STORE": str(tmp_path / "bucket"),
            "VLLM_ARGS": "--enforce-eager --max-model-len 256 --kv-cache-memory-bytes 67108864 --max-num-seqs 4"}
    assert "DELTASYNC_TOKEN" in refuses_without_token(folder, cmd, env)
    env |= {"DELTASYNC_TOKEN": TOKEN, "VLLM_API_KEY": API_KEY}  # the Space's secrets
    with ServerProcess(cmd, port=int(env["PORT"]), log_path=tmp_path / "rollout.log", env=env, cwd=folder) as proc:
        proc.wait_ready(400)
        served = httpx.get(f"{proc.url}/version", timeout=30).json()  # the Space's variables reached the CMD
        assert (served["model"], served["store"]) == (env["MODEL"], env["DELTASYNC_STORE"])
        assert httpx.post(f"{proc.url}/update", json={}, timeout=30).status_code == 401
        assert httpx.get(f"{proc.url}/v1/models", timeout=30).status_code == 401
        r = httpx.get(f"{proc.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == str(tiny_model_dir)
        assert TOKEN not in proc.log() and API_KEY not in proc.log()


@pytest.mark.parametrize("space", ["trainer"], indirect=True)
def test_trainer_space_container_entry(space, tmp_path: Path):
    folder, cmd, env = space
    assert "DELTASYNC_TOKEN" in refuses_without_token(folder, cmd, env)
    # A duplicated Space gets the two secrets and no variables: it finds the bucket and its siblings
    # from the SPACE_ID that Spaces set.
    env |= {"DELTASYNC_TOKEN": TOKEN, "HF_TOKEN": "hf_not_a_real_token", "SPACE_ID": "bob/deltasync-trainer"}
    with ServerProcess(cmd, port=int(env["PORT"]), log_path=tmp_path / "trainer.log", env=env, cwd=folder) as proc:
        proc.wait_ready(300)
        assert httpx.get(f"{proc.url}/health", timeout=30).json()["run"] == "idle"
        page = httpx.get(f"{proc.url}/", timeout=30)
        assert page.status_code == 200 and "DeltaSync trainer" in page.text
        config = httpx.get(f"{proc.url}/config", timeout=30).text  # the form's defaults
        for derived in ("hf://buckets/bob/deltasync/run1", "https://bob-deltasync-rollout.hf.space",
                        "https://bob-deltasync-wordle.hf.space"):
            assert derived in config
        assert TOKEN not in proc.log()
