"""The application builder: ``build_app(config) -> serve.Application``.

Used by ``disagg serve``, by ``serve run deployments.app:build_app`` /
``serve deploy`` with a serve config (``import_path: deployments.app:build_app``,
``args:`` = an ``AppConfig``), and by the Helm chart's ``serveConfigV2``.

    disaggregated:  Ingress -> DecodeServer --(long uncached suffix)--> PrefillServer
    aggregated:     Ingress -> DecodeServer (prefills everything itself)
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.env import SERVE_ENV
from deployments.ingress import Ingress
from deployments.servers import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, DecodeServer, PrefillServer
from disagg.config import AppConfig, ReplicaConfig, load_config
from disagg.costs import cost_profile
from disagg.router.calibration import with_engine_costs

# router.policy -> the Serve request router class
ROUTERS = {
    "state_aware": "deployments.request_router:StateAwareRequestRouter",
    "affinity": "deployments.request_router:AffinityRequestRouter",
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}


SERVE_AREA_TAU_S = 1800.0  # decay of the router's booked prefill area in a served cluster (docs/router.md)


def request_router_config(cfg: AppConfig, prefill_pool: str | None = None) -> RequestRouterConfig:
    """``prefill_pool``: a decode deployment's prefill deployment (its router reads that pool's view:
    ``deployments.request_router`` NOTE 2)."""
    if cfg.router.policy not in ROUTERS:
        raise ValueError(f"unknown router.policy {cfg.router.policy!r}; choose one of {sorted(ROUTERS)}")
    kwargs = {}
    if cfg.router.policy == "state_aware":
        # A served cluster runs for days: prefill area booked an hour ago says nothing about
        # today's queues, so the first-turn guard's booking fades (the simulator's runs are
        # minutes long and keep the router's default of no decay).
        # each deployment's router places within its own pool (replicas report their real role:
        # disagg.router.router step 3c), by the router's default profiles as the simulator does,
        # unless router.weights replaces their scorers
        kwargs["policy"] = {"area_tau_s": SERVE_AREA_TAU_S}
        if prefill_pool:
            kwargs["prefill_pool"] = prefill_pool
        if cfg.router.weights:
            placement = {"filters": ["healthy", "role", "load_guard"], "scorers": dict(cfg.router.weights)}
            kwargs["policy"]["profiles"] = {phase: placement for phase in ("both", "prefill", "decode")}
        if cfg.router.engine_profile:  # price time as the replicas' engine runs (disagg.router.calibration)
            engine = cost_profile(cfg.router.engine_profile).to_dict()
            kwargs["policy"] = with_engine_costs(kwargs["policy"], engine)
    return RequestRouterConfig(request_router_class=ROUTERS[cfg.router.policy], request_router_kwargs=kwargs,
                               request_routing_stats_period_s=cfg.router.stats_period_s)


def deployment_options(rc: ReplicaConfig, cfg: AppConfig, routed: bool = True,
                       prefill_pool: str | None = None) -> dict[str, Any]:
    """Serve deployment options for one role (``prefill_pool``: see ``request_router_config``)."""
    actor: dict[str, Any] = {"num_cpus": rc.num_cpus, "runtime_env": {"env_vars": dict(SERVE_ENV)}}
    if rc.num_gpus:
        actor["num_gpus"] = rc.num_gpus
    if rc.accelerator_type:
        actor["accelerator_type"] = rc.accelerator_type
    if rc.resources:  # custom node resources, e.g. a Kubernetes worker group's role marker
        actor["resources"] = dict(rc.resources)
    opts: dict[str, Any] = {
        "max_ongoing_requests": rc.max_ongoing_requests,
        "graceful_shutdown_timeout_s": cfg.deployment.graceful_shutdown_timeout_s,
        "health_check_period_s": cfg.deployment.health_check_period_s,
    }
    if rc.tensor_parallel_size > 1 and rc.num_gpus:
        # one bundle per TP rank, packed on one node; the replica actor takes the first
        bundle = {"GPU": 1, "CPU": 1}
        if rc.accelerator_type:
            bundle[f"accelerator_type:{rc.accelerator_type}"] = 0.001
        opts["placement_group_bundles"] = [dict(bundle, CPU=rc.num_cpus, GPU=rc.num_gpus, **rc.resources)] + [
            bundle for _ in range(rc.tensor_parallel_size - 1)
        ]
        opts["placement_group_strategy"] = "STRICT_PACK"
    opts["ray_actor_options"] = actor
    if rc.min_replicas is not None:
        opts["autoscaling_config"] = {"min_replicas": rc.min_replicas, "max_replicas": rc.max_replicas,
                                      "target_ongoing_requests": rc.target_ongoing_requests}
    else:
        opts["num_replicas"] = rc.num_replicas
    if routed:
        opts["request_router_config"] = request_router_config(cfg, prefill_pool)
    return opts


def build_app(args: dict | AppConfig | None = None) -> serve.Application:
    cfg = args if isinstance(args, AppConfig) else load_config(args or {})
    data = cfg.model_dump()
    d = cfg.deployment
    prefill = None
    if d.mode == "disaggregated":
        prefill = serve.deployment(PrefillServer, name=PREFILL_DEPLOYMENT).options(
            **deployment_options(d.prefill, cfg)).bind(data)
    decode = serve.deployment(DecodeServer, name=DECODE_DEPLOYMENT).options(
        **deployment_options(d.decode, cfg, prefill_pool=PREFILL_DEPLOYMENT if prefill else None)).bind(data, prefill)
    ingress = serve.deployment(Ingress, name="Ingress").options(
        **deployment_options(d.ingress, cfg, routed=False)).bind(data, decode, prefill)
    return ingress
