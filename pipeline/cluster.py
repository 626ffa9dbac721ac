"""Connecting to Ray: the cluster in RAY_ADDRESS (as `ray job submit` sets it) or a local one started here."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Optional

from pipeline.errors import PipelineError, Terminated
from pipeline.logs import ray_runtime_env

if TYPE_CHECKING:
    from pipeline.config.schema import ClusterConfig

log = logging.getLogger(__name__)

_started_locally = False
_sigterm_received = False
_interrupt_received = False

# Ray waits a fixed 30 s for a new local node to register (ray/_private/node.py); a loaded 2-core machine can miss it.
LOCAL_START_ATTEMPTS = 3
_NODE_START_TIMEOUT = "timed out during startup"


def ensure_ray(cluster_cfg: ClusterConfig, metrics_export_port: Optional[int] = None) -> None:
    """Connect to the cluster in cluster.address or RAY_ADDRESS, else start a local Ray; either way the job's
    workers get pipeline.logs' quiet settings. metrics_export_port: where a local Ray serves its Prometheus
    metrics (a cluster has its own). Returns None; raises what ray.init raises."""
    global _started_locally
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cluster_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        _connect(address)
        stop_cleanly_on_signals()
        return
    log.info("starting a local Ray")
    # One node that nothing drains: Ray Train's preemption watcher has nothing to watch, and creating it logs a
    # core_worker ERROR about actor restarts (ray-project/ray#53727).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    extra: dict[str, Any] = {"_metrics_export_port": metrics_export_port} if metrics_export_port else {}
    start_local(lambda: ray.init(num_cpus=cluster_cfg.local_num_cpus, include_dashboard=False, log_to_driver=True,
                                  runtime_env=ray_runtime_env(), **extra))
    _started_locally = True
    stop_cleanly_on_signals()


def stop_cleanly_on_signals() -> None:
    """Make SIGTERM raise Terminated and SIGINT KeyboardInterrupt in the main thread, each remembered: at a job's
    start, and again after ray.init, whose driver leaves a fatal-signal handler on SIGTERM that prints a native
    stack trace and aborts (exit 134), so no stage lock, MLflow run or local Ray was closed and the job printed no
    line saying what stopped it. Remembered because Python drops an exception a handler raises while the main
    thread runs a finalizer or weakref callback (SQLAlchemy's, under MLflow): raise_if_stopped raises it again at
    the next safe point. Elsewhere than the main thread (where Python runs signal handlers) nothing changes."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
        signal.signal(signal.SIGINT, _raise_interrupt)


def _raise_terminated(signum: int, frame: Any) -> None:
    global _sigterm_received
    _sigterm_received = True
    raise Terminated()


def _raise_interrupt(signum: int, frame: Any) -> None:
    global _interrupt_received
    _interrupt_received = True
    raise KeyboardInterrupt()


def raise_if_stopped() -> None:
    """Raise Terminated (or KeyboardInterrupt) when SIGTERM (SIGINT) reached the job, whether or not the handler's
    own exception got through: the loops of long stages and the stage chain call it between units of work."""
    if _sigterm_received:
        raise Terminated()
    if _interrupt_received:
        raise KeyboardInterrupt()


def forget_stop_signals() -> None:
    """A new job in this process starts with no stop signal recorded (tests and tools run several)."""
    global _sigterm_received, _interrupt_received
    _sigterm_received = _interrupt_received = False


def sigterm_received() -> bool:
    """Whether SIGTERM reached this job. Inside ray.get, Ray turns the Terminated a signal handler raised into a
    plain KeyboardInterrupt (or, in Ray Train's fit, SystemExit), so what stopped a job is told by this."""
    return _sigterm_received


def running_local_cluster() -> Optional[str]:
    """The address of a Ray started on this machine with `ray start` (ray.init() with no address joins it), else
    None."""
    try:
        from ray._private.services import canonicalize_bootstrap_address  # how ray.init finds it

        return canonicalize_bootstrap_address(None)  # type: ignore[arg-type]  # None: "find one", as ray.init
    except Exception:  # noqa: BLE001 - a private helper: assume none
        return None


def starts_local_ray(cluster_cfg: ClusterConfig) -> bool:
    """Whether ensure_ray would start a Ray of its own on this machine: no cluster address (or `local`, which
    ray.init takes as "start one"), no `ray start` cluster here to join, and no Ray running in this process yet."""
    import ray

    address = cluster_cfg.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return False
    return address == "local" or (not address and running_local_cluster() is None)


def local_ray_cpus(cluster_cfg: ClusterConfig) -> Optional[int]:
    """The CPUs of the local Ray ensure_ray would start for this job (cluster.local_num_cpus, else what Ray counts
    on this machine, its container's limit included); None when the job joins a cluster (cluster.address,
    RAY_ADDRESS, one `ray start` began on this machine) or a Ray already running in this process, whose size is
    not known here."""
    if not starts_local_ray(cluster_cfg):
        return None
    address = cluster_cfg.address or os.environ.get("RAY_ADDRESS")
    if cluster_cfg.local_num_cpus and not address:
        return int(cluster_cfg.local_num_cpus)
    try:
        from ray._private.utils import get_num_cpus  # how ray.init counts them

        return int(get_num_cpus())
    except Exception:  # noqa: BLE001 - a private helper: fall back to what the OS says
        return os.cpu_count()


def check_fits_local_ray(cfg: Any, stages: list[str], prompts_made: bool = False) -> None:
    """Refuse CPU requests a local Ray cannot grant: Ray queues an infeasible request and waits (Ray Train retried
    its worker group every minute, for ever). Checks the Ray Train workers (1 CPU each), the verifier's actor
    pool (regenerate, capture) and the prompt writer's task (a source the verifier writes, unless `prompts_made`;
    an evaluated set the verifier writes) and, for the "serve" job, the LLM replica actors that must start.
    Raises PipelineError naming the setting."""
    from pipeline.data.synthesize import WRITTEN_BY_THE_VERIFIER

    cpus = local_ray_cpus(cfg.cluster)
    if cpus is None:
        return
    requests = []
    if "train" in stages:
        requests.append(("training.num_workers", cfg.training.num_workers,
                         f"{cfg.training.num_workers} Ray Train workers of 1 CPU"))
    if {"regenerate", "capture"} & set(stages):
        gen = cfg.generation
        requests.append(("generation.num_actors", gen.num_actors * gen.cpus_per_actor,
                         f"{gen.num_actors} verifier actors of generation.cpus_per_actor={gen.cpus_per_actor} CPUs"))
    # regenerate and evaluate make the prompts too when no earlier job has
    if {"prompts", "regenerate", "evaluate"} & set(stages) and cfg.data.source in WRITTEN_BY_THE_VERIFIER \
            and not prompts_made:
        requests.append(("data.synthetic.cpus", cfg.data.synthetic.cpus, "the prompt writer's task"))
    if "evaluate" in stages:
        from pipeline.evaluation.eval_sets import set_config

        for name in cfg.evaluation.datasets:
            definition = set_config(name, cfg.evaluation) if name in cfg.evaluation.sets else None
            if definition is not None and definition.source in WRITTEN_BY_THE_VERIFIER:
                requests.append((f"evaluation.sets.{name}.synthetic.cpus", definition.synthetic.cpus,
                                 "the prompt writer's task"))
    if "serve" in stages:
        serving = cfg.serving
        replicas = int(serving.autoscaling.get("min_replicas", 1) or 1)
        engine = serving_engine_cpus(serving)
        requests.append(("serving.replica_cpus", (serving.replica_cpus + engine) * replicas,
                         f"{replicas} LLM replicas, each an actor of serving.replica_cpus={serving.replica_cpus} "
                         f"CPUs beside its vLLM engine's {engine}"))
    for field, needed, what in requests:
        if needed > cpus:
            raise PipelineError(f"{field}: asks for {needed} CPUs ({what}); the local Ray this job starts has {cpus} "
                                "(cluster.local_num_cpus, or this machine's); lower it, or join a cluster "
                                "(cluster.address / RAY_ADDRESS)")


def serving_engine_cpus(serving: Any) -> int:
    """CPUs one vLLM engine of the serve job holds besides its replica actor: on CPU, Ray Serve LLM's placement
    group gives each of its tensor x pipeline parallel workers a bundle of 1 CPU (ray.llm CPUAccelerator's default
    bundles, merged with the replica actor's); on GPU its bundles ask for GPUs only."""
    if str(serving.accelerator) != "cpu":
        return 0
    engine = serving.engine_kwargs  # wins over serving.tensor_parallel_size in the engine's config (llm_config)
    return (int(engine.get("tensor_parallel_size", serving.tensor_parallel_size) or 1)
            * int(engine.get("pipeline_parallel_size", 1) or 1))


def start_local(init: Any, attempts: int = LOCAL_START_ATTEMPTS) -> None:
    """Call init() (a local ray.init), again up to `attempts` times in all when the new node misses Ray's fixed
    startup wait. Each missed attempt's processes are stopped first (Ray leaves them running, holding cores and
    ports), the last one's too before its error is raised. Any other error is raised at once."""
    import psutil
    import ray

    for attempt in range(1, attempts + 1):
        children_before = {child.pid for child in psutil.Process().children()}
        try:
            init()
            return
        except Exception as error:
            if _NODE_START_TIMEOUT not in str(error):
                raise
            ray.shutdown()
            _stop_started_children(children_before)
            if attempt == attempts:
                raise
            log.warning("the local Ray node did not register in time (attempt %d of %d); stopping it and retrying",
                        attempt, attempts)


def _stop_started_children(children_before: set[int]) -> None:
    """Kill the direct children of this process not in children_before (a failed ray.init's GCS server and raylet)
    and everything under them. They are suspended first, so none forks a process the kill would miss; processes
    under children that were already running are left alone."""
    import psutil

    started = [child for child in psutil.Process().children() if child.pid not in children_before and _running(child)]
    for child in started:
        _signal(child, "suspend")
    tree = [*started, *(grandchild for child in started for grandchild in _descendants(child))]
    for process in tree:
        _signal(process, "kill")
    psutil.wait_procs(tree, timeout=10)


def _signal(process: Any, action: str) -> None:
    import psutil

    try:
        getattr(process, action)()
    except psutil.NoSuchProcess:
        pass


def _running(process: Any) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants(process: Any) -> list:
    import psutil

    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _connect(address: str) -> None:
    import ray

    try:
        ray.init(address=address, log_to_driver=True, runtime_env=ray_runtime_env())
    except ValueError as error:
        if "runtime env" not in str(error):
            raise
        # The submitted job's runtime_env already sets one of these keys: the job's own settings win.
        log.warning("keeping the submitted job's runtime_env as it is (%s)", error)
        ray.init(address=address, log_to_driver=True)


def shutdown_if_started_here() -> None:
    """Stop the local Ray this process started; leave a cluster (or a caller's Ray) running."""
    global _started_locally
    import ray

    if _started_locally and ray.is_initialized():
        ray.shutdown()
    _started_locally = False


def get_remote(ref: Any, what: str) -> Any:
    """ray.get(ref), with a failed task or actor turned into one PipelineError line naming `what` and the worker's
    own exception (pipeline.errors.remote_cause) rather than Ray's wrapper and its traceback."""
    import ray

    from pipeline.errors import PipelineError, remote_cause

    try:
        return ray.get(ref)
    except ray.exceptions.RayError as error:
        raise PipelineError(f"{what}: {remote_cause(error)}") from error
