"""Checks the CLI runs before it starts anything, and their messages for people.

A user mistake (a missing or misspelt config, an unknown model, a GPU that is
not there, more CPUs reserved than the cluster has, a port already taken) becomes a :class:`UsageError`: the CLI prints
its message (one line per problem, naming the fix) and exits with status 2,
without a traceback (``disagg --debug`` shows one). Each check runs before Ray
starts, so it answers in about a second instead of after a cluster start.

    cfg = load_config_for_cli("serve.yaml")
    # UsageError: serve.yaml: unknown key 'model.nmae'; did you mean 'model.name'?
    check_model(cfg); check_device(cfg); check_cpus(cfg, 4); check_port(cfg.http.host, cfg.http.port)

NOTES
1. The config path a message names is the path the user typed, and a key path is
   the dotted path inside the ``AppConfig`` (for a Serve config: inside
   ``applications[0].args``), the path ``disagg deploy --set`` takes.
"""

from __future__ import annotations

import difflib
import errno
import socket
import typing
from pathlib import Path

from pydantic import BaseModel, ValidationError

from disagg.config import AppConfig, load_config


class UsageError(Exception):
    """A mistake the user can fix; ``str()`` is the whole message (one or more lines)."""


def load_config_for_cli(path: str | None) -> AppConfig:
    """``load_config(path)``; a missing file, bad YAML or invalid keys raise :class:`UsageError`."""
    if path is None:
        return AppConfig()
    import yaml

    p = Path(path)
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "does not exist"
        raise UsageError(f"config {path!r} {what}; give a YAML file such as deployments/configs/local-cpu.yaml")
    try:
        return load_config(p)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"config {path!r} is not valid YAML{where}: {problem}") from exc
    except ValidationError as exc:
        raise UsageError("\n".join(explain_validation(exc, path))) from exc
    except (AttributeError, TypeError, IndexError, KeyError) as exc:  # a top level that is not a mapping
        raise UsageError(f"config {path!r} must be a YAML mapping of AppConfig sections "
                         f"({', '.join(AppConfig.model_fields)}) or a Serve config with applications[0].args"
                         ) from exc


def explain_validation(exc: ValidationError, source: str) -> list[str]:
    """One line per bad key of an ``AppConfig`` (NOTE 1); an unknown key gets a did-you-mean."""
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        key = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            known = _fields_at(AppConfig, err["loc"][:-1])
            close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
            if close:
                hint = f"did you mean {'.'.join([*loc[:-1], close[0]])!r}?"
            else:
                hint = f"known keys here: {', '.join(known)}" if known else "remove it"
            lines.append(f"{source}: unknown key {key!r}; {hint}")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
            lines.append(f"{source}: {key}: {err['msg']}{shown}")
    return lines


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the model found at ``loc`` inside ``model`` ([] when not a model)."""
    current: typing.Any = model
    for part in loc:
        if isinstance(part, int):  # an index into a list field: step into its item type
            args = typing.get_args(current)
            current = args[0] if args else None
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = fields[part].annotation
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def check_model(cfg: AppConfig) -> None:
    """The reference engine's model is a preset or a checkpoint directory with a config.json."""
    if cfg.engine.backend != "reference":  # vLLM also takes Hugging Face ids; it checks them itself
        return
    from disagg.engine.reference.config import PRESETS

    name = cfg.model.name
    if name in PRESETS:
        return
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        return
    if path.is_dir():
        raise UsageError(f"model directory {name!r} has no config.json; give a Kimi-Linear / K3 checkpoint "
                         "directory (config.json + *.safetensors)")
    close = difflib.get_close_matches(name, PRESETS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UsageError(f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}) nor a checkpoint "
                     f"directory{hint}")


def check_device(cfg: AppConfig) -> None:
    """A CUDA device (model.device or a replica's num_gpus) needs a GPU torch can see."""
    wants_gpu = cfg.model.device.startswith("cuda") or any(
        rc.num_gpus > 0 for rc in (cfg.deployment.prefill, cfg.deployment.decode, cfg.deployment.ingress))
    if not wants_gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    if cfg.model.device.startswith("cuda"):
        raise UsageError(f"device {cfg.model.device!r} asked for, but torch sees no GPU "
                         f"(torch {torch.__version__}); use --device cpu or install a CUDA/ROCm build of torch")
    raise UsageError("the config gives replicas num_gpus > 0, but torch sees no GPU on this machine; "
                     "set deployment.*.num_gpus: 0 (and model.device: cpu) to run on CPU")


def check_cpus(cfg: AppConfig, num_cpus: float) -> None:
    """The replicas' reserved CPUs fit a cluster of ``num_cpus`` logical CPUs (else Serve would
    wait for resources forever)."""
    d = cfg.deployment
    roles = {"ingress": d.ingress, "decode": d.decode}
    if d.mode == "disaggregated":
        roles["prefill"] = d.prefill
    need = sum(rc.num_cpus * (rc.min_replicas if rc.min_replicas is not None else rc.num_replicas)
               for rc in roles.values())
    if need > num_cpus + 1e-9:
        parts = ", ".join(f"{name} {rc.num_cpus:g}" for name, rc in roles.items())
        raise UsageError(f"the replicas reserve {need:g} CPUs ({parts} per replica) but the local cluster has "
                         f"{num_cpus:g}; lower deployment.*.num_cpus or num_replicas")


def check_port(host: str, port: int) -> None:
    """``host:port`` can be listened on now (the HTTP front binds it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} on {host} is already in use (another server?); stop it or "
                                 f"choose another port with --port") from exc
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host / --port") from exc
