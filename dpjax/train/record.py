"""The run record: what produced a run (its settings, the plan resolved from them, the
devices, the process count, the package versions and the git commit), written as the
first metrics row (`{"record": {...}}`) and as `run.json` in the checkpoint folder; and
`--config FILE`, which reads settings back from a YAML, TOML or JSON file (a record
included: any run's record, fed back, repeats the run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version

import jax
import yaml

from dpjax.errors import UserError
from dpjax.recovery.checkpoint import RUN_FILE
from dpjax.settings import Settings
from dpjax.train.trl_names import dpjax_name
from dpjax.models import model_options
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "dpjax")


class ConfigError(UserError):
    """A --config file that cannot be read as settings; printed as one line."""


def versions() -> dict:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def git_commit(folder: str | None = None) -> dict | None:
    """The commit of the checkout dpjax is imported from (and whether it has uncommitted
    changes); None outside a git checkout or without git."""
    folder = folder or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        run = lambda *a: subprocess.run(["git", "-C", folder, *a], capture_output=True, text=True,  # noqa: E731
                                        timeout=10)
        head = run("rev-parse", "HEAD")
        if head.returncode:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def build(settings: Settings, plan) -> dict:
    """The record of a run of `settings` resolved to `plan`."""
    devices = list(plan.mesh.devices.flat)
    return {"settings": dataclasses.asdict(settings), "plan": plan.describe(),
            "devices": {"count": len(devices), "platform": devices[0].platform,
                        "kinds": sorted({d.device_kind for d in devices})},
            "processes": jax.process_count(), "versions": versions(), "git": git_commit(),
            "init_from": absolute_source(settings.init_from)}


def absolute_source(source: str | None) -> str | None:
    """--init-from with an absolute path: what `python -m dpjax.hf export` follows, from
    any folder, to the Hub model's config and tokenizer (`dpjax.hf.identity`)."""
    if source is None:
        return None
    prefix = "hf:" if source.startswith("hf:") else ""
    return prefix + os.path.abspath(source[len(prefix):])


def write_run_file(folder: str, record: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, RUN_FILE)
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)
        fh.write("\n")
    return path


CONFIG_FORMATS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML"}  # by suffix; anything else is JSON


def _parse(path: str, text: str):
    """The file's data by its suffix: YAML (PyYAML's safe loader: plain data, no tags that
    build objects), TOML (the standard library's), else JSON (a .jsonl metrics file: its
    first line, the record)."""
    kind = CONFIG_FORMATS.get(os.path.splitext(path)[1].lower(), "JSON")
    if kind == "YAML":
        return yaml.safe_load(text)
    if kind == "TOML":
        return tomllib.loads(text)
    return json.loads(text.splitlines()[0] if path.endswith(".jsonl") else text)


def load_config(path: str) -> dict:
    """Settings by field name from a YAML, TOML or JSON file: a flat table of `Settings` fields
    (model options under `model_options`, or flat as `d_model = 64`), or a run record
    (`run.json`, or a metrics file's first line `{"record": ...}`), whose `settings`
    are taken. Unknown keys are an error."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    try:
        data = _parse(path, raw.decode())
    except (ValueError, IndexError, yaml.YAMLError) as e:  # tomllib's and json's errors are ValueErrors
        kind = CONFIG_FORMATS.get(os.path.splitext(path)[1].lower(), "JSON")
        raise ConfigError(f"--config {path}: not valid {kind} ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a table of settings, got {type(data).__name__}")
    data = data.get("record", data)
    data = data.get("settings", data) if isinstance(data.get("settings"), dict) else data
    return _settings(data, path)


def _settings(data: dict, path: str) -> dict:
    fields = {f.name: str(f.type) for f in dataclasses.fields(Settings)}
    options = {o for opts in model_options().values() for o in opts}
    out, opts = {}, dict(data.get("model_options") or {})
    for key, value in data.items():
        if key == "model_options":
            continue
        name = key.replace("-", "_")
        if name in fields:  # a YAML or JSON number where a text setting is meant (mesh: 8) is that text
            text = fields[name] in ("str", "str | None") and isinstance(value, (int, float)) \
                and not isinstance(value, bool)
            out[name] = str(value) if text else value
        elif name in options:
            opts[name] = value
        else:
            raise ConfigError(f"--config {path}: unknown setting {key!r}"
                              + (dpjax_name(key) or " (python -m dpjax.train --help lists them)"))
    wrong = sorted(set(opts) - options)
    if wrong:
        raise ConfigError(f"--config {path}: unknown model option {wrong[0]!r}")
    out["model_options"] = opts
    return out
