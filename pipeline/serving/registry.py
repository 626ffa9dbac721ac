"""Which speculator to serve: a registry alias, a version or a run, resolved to a local checkpoint folder.

    models:/<name>@<alias>      the version an alias points at (the default: <registered name>@champion)
    models:/<name>/<version>    one version
    runs:/<run id>/<path>       an exported folder logged by a run (not necessarily registered)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from filelock import FileLock

from pipeline.errors import PipelineError
from pipeline.fsutil import FOLDER_MODE, share
from pipeline.integrity import is_intact, verify

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/]+)|/(?P<version>\d+))$")
RUN_URI = re.compile(r"^runs:/(?P<run_id>[0-9a-f]+)/(?P<path>.+)$")


URI_FORMS = "models:/<name>@<alias>, models:/<name>/<version> or runs:/<run id>/<path>"


def check_model_uri(uri: str) -> None:
    """Refuse a serving.model that is none of the three forms, or a run path that leaves the run's artifacts (an
    absolute path, '..' or '.' parts): the download lands at <download root>/<run>/<path>."""
    run = RUN_URI.match(uri)
    if not MODEL_URI.match(uri) and not run:
        raise PipelineError(f"serving.model: '{uri}' is not {URI_FORMS}")
    if run:
        parts = run["path"].replace("\\", "/").rstrip("/").split("/")
        if run["path"].startswith("/") or any(part in ("", ".", "..") for part in parts):
            raise PipelineError(f"serving.model: '{uri}': the path after the run id must name a folder inside the "
                                "run's artifacts (no '..', '.', empty or absolute parts)")


def pinned_uri(uri: str, version: str) -> str:
    """`models:/<name>/<version>` for a registry URI (an alias or a version) and the version it resolved to."""
    model = MODEL_URI.match(uri)
    assert model is not None, uri  # only a registry URI resolves to a version
    return f"models:/{model['name']}/{version}"


def served_model_name(uri: str, default: str) -> str:
    """The OpenAI "model" a speculator is served as: the registered model's name, else `default`."""
    model = MODEL_URI.match(uri)
    return model["name"] if model else default


def _usable(local: Path) -> bool:
    return (local / "config.json").is_file() and is_intact(local)


def _download(client: Any, run_id: str, path: str, into: Path) -> Path:
    """The speculator's folder under `into`, downloaded once and checked against the integrity record its export
    wrote (sizes and sha256 of every file) before it is used, and again whenever it is reused: a damaged cache is
    downloaded again, a damaged download is refused. A finished download is never replaced while it may be in use:
    when another resolver (the job, the Serve app) renamed its own into place first, this one is dropped."""
    local = into / path
    if _usable(local):
        return local
    made = [folder for folder in (into.parent, *into.parent.parents) if not folder.exists()]
    into.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{into.name}.", dir=into.parent))
    try:
        share(staging, FOLDER_MODE)  # a replica of another user reads it
        client.download_artifacts(run_id, path, str(staging))
        if not (staging / path / "config.json").is_file():
            raise PipelineError(f"serving.model: {run_id}/{path} holds no speculators config.json")
        verify(staging / path, "serving.model")
        # One resolver at a time decides what `into` holds: otherwise two that both found it damaged could each
        # remove it, and the second would delete the first one's finished (perhaps already served) download.
        with FileLock(str(into.parent / f".{into.name}.lock")):
            if not _usable(local):
                shutil.rmtree(into, ignore_errors=True)
                os.rename(staging, into)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # before the folders above it can be removed
        for folder in made:  # a failed first download leaves no empty download folders behind
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


@dataclass(kw_only=True)
class LocatedSpeculator:
    """Where a speculator URI points and what it is, read before its weights are downloaded: the registry
    version's (or run's) tags and its config.json, enough for every serving check."""

    uri: str
    run_id: Optional[str] = None
    path: str = ""  # the exported folder inside the run's artifacts
    folder: str = ""  # its download folder under the download root: one per version or run
    version: Optional[str] = None  # the registry version; None for a runs:/ URI
    tags: dict[str, str] = field(default_factory=dict)  # the version's tags, or the run's
    config: dict[str, Any] = field(default_factory=dict)  # the speculator's config.json
    cached: Optional[Path] = None  # its finished download, checked against its integrity record by locate

    @property
    def algorithm(self) -> str:
        """The drafter's speculators_model_type (a DRAFTERS key)."""
        return str(self.config.get("speculators_model_type", ""))

    @property
    def trained_k(self) -> Optional[int]:
        return trained_k(self.config)

    @property
    def recommended_k(self) -> Optional[int]:
        """The K its evaluation recommends (tag eval.recommended_k, else the evaluated eval.num_speculative_tokens);
        None where neither is set. Tags can be edited in MLflow: one that is no positive whole number raises
        PipelineError naming it."""
        for tag in ("eval.recommended_k", "eval.num_speculative_tokens"):
            value = self.tags.get(tag)
            if value:
                if not (value.strip().isascii() and value.strip().isdecimal()) or int(value) < 1:
                    raise PipelineError(f"serving.model: {self.uri}'s tag {tag}={value!r} is no K (a whole number "
                                        ">= 1); set serving.num_speculative_tokens or fix the tag")
                return int(value)
        return None


@dataclass(kw_only=True)
class ResolvedSpeculator(LocatedSpeculator):
    """A located speculator downloaded and checked against its integrity record: `local_dir` holds its folder and
    `config` is the downloaded config.json."""

    local_dir: Path


def locate(client: Any, uri: str, download_root: Path) -> LocatedSpeculator:
    """The run, artifact folder, version, tags and config.json `uri` names. The config is read from a finished
    download under download_root, else only that file is downloaded, into a temporary folder. Raises PipelineError
    naming serving.model for a malformed URI, an unknown name, alias, version or run, a version whose source names
    no folder, or a folder without a speculators config.json."""
    from pipeline.tracking import mlflow_errors_as

    check_model_uri(uri)
    model, run = MODEL_URI.match(uri), RUN_URI.match(uri)
    with mlflow_errors_as("serving.model", f"cannot resolve '{uri}'"):
        if model:
            name = model["name"]
            version = (client.get_model_version_by_alias(name, model["alias"]) if model["alias"]
                       else client.get_model_version(name, model["version"]))
            run_id, path = version.run_id, version.source.rstrip("/").rsplit("/", 1)[-1]
            if path in ("", ".", ".."):
                raise PipelineError(f"serving.model: {uri}'s source {version.source!r} names no artifact folder")
            # The run id in the name: a recreated model, or another tracking server, has other runs behind v<N>.
            located = LocatedSpeculator(uri=uri, run_id=run_id, path=path,
                                        folder=f"{name}-v{version.version}-{run_id[:12]}",
                                        version=str(version.version), tags=dict(version.tags))
        else:
            assert run is not None  # check_model_uri accepted one of the two forms
            located = LocatedSpeculator(uri=uri, run_id=run["run_id"], path=run["path"].rstrip("/"),
                                        folder=f"run-{run['run_id']}",
                                        tags=dict(client.get_run(run["run_id"]).data.tags))
        where = f"{located.run_id}/{located.path}"
        cached = download_root / located.folder / located.path
        if _usable(cached):  # a finished download: nothing is fetched again
            located.config, located.cached = _read_config(cached, where), cached
            return located
        listed = {Path(entry.path).name for entry in client.list_artifacts(located.run_id, located.path)}
        if "config.json" not in listed:  # else MLflow's own download error, which names no file
            raise PipelineError(f"serving.model: {where} holds no speculators config.json")
        with tempfile.TemporaryDirectory(prefix="speculator-config-") as scratch:  # outside the download root
            file = client.download_artifacts(located.run_id, f"{located.path}/config.json", scratch)
            located.config = _read_config(Path(file).parent, where)
    return located


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    """The speculators config.json in `folder`; PipelineError naming serving.model where there is none, or it is
    no JSON object naming its speculators_model_type."""
    file = folder / "config.json"
    if not file.is_file():
        raise PipelineError(f"serving.model: {where} holds no speculators config.json")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PipelineError(f"serving.model: {where}/config.json is not JSON ({error})") from None
    if not isinstance(config, dict) or not isinstance(config.get("speculators_model_type"), str):
        raise PipelineError(f"serving.model: {where}/config.json names no speculators_model_type")
    return config


def fetch(client: Any, located: LocatedSpeculator, download_root: Path) -> ResolvedSpeculator:
    """Download the located speculator into download_root (once; checked against its integrity record); one
    locate found finished there is used as it is."""
    from pipeline.tracking import mlflow_errors_as

    assert located.run_id is not None  # locate found its run
    if located.cached is not None:  # checked by locate a moment ago: not hashed again
        return ResolvedSpeculator(**vars(located), local_dir=located.cached)
    with mlflow_errors_as("serving.model", f"cannot resolve '{located.uri}'"):
        local = _download(client, located.run_id, located.path, download_root / located.folder)
    config = _read_config(local, f"{located.run_id}/{located.path}")
    return ResolvedSpeculator(**{**vars(located), "config": config}, local_dir=local)


def resolve(client: Any, uri: str, download_root: Path) -> ResolvedSpeculator:
    """Fetch the speculator `uri` names into download_root (a folder per version or run)."""
    return fetch(client, locate(client, uri, download_root), download_root)


def trained_k(config: dict[str, Any]) -> Optional[int]:
    """The K a speculators config.json says its drafter was trained for (speculators_format.exported_k); None
    where it names none or names no whole number >= 1."""
    from pipeline.export.speculators_format import exported_k

    value = exported_k(config)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None
