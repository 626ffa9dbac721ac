"""Connecting to Ray: the cluster in RAY_ADDRESS (as `ray job submit` sets it) or a local one started here."""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

log = logging.getLogger(__name__)

_started_locally = False


def ensure_ray(cluster_cfg: Any, metrics_export_port: Optional[int] = None) -> None:
    """metrics_export_port: where a local Ray serves its Prometheus metrics (a cluster has its own)."""
    global _started_locally
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cluster_cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True)
        return
    log.info("starting a local Ray")
    extra = {"_metrics_export_port": metrics_export_port} if metrics_export_port else {}
    ray.init(num_cpus=cluster_cfg.local_num_cpus, include_dashboard=False, log_to_driver=True, **extra)
    _started_locally = True


def shutdown_if_started_here() -> None:
    """Stop the local Ray this process started; leave a cluster (or a caller's Ray) running."""
    global _started_locally
    import ray

    if _started_locally and ray.is_initialized():
        ray.shutdown()
    _started_locally = False
