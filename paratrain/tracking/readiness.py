"""Checks, before any process starts, that every tracker in log.trackers can open where the run will
log: its package installed, a W&B login (or a local mode), an MLflow store its client can write.

Without them a new user's first run launches, and rank 0 stops at the tracker with a traceback
(``wandb.errors.UsageError: No API key configured``, MLflow's refusal of a store). Each check asks the
tracker's own package what it would do; none reaches the network.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from urllib.parse import urlparse

from paratrain.errors import ConfigError
from paratrain.tracking.trackers import check_trackers_installed, mlflow_tracking_uri

# The modes in which wandb.init keeps the run on this machine (or drops it) and needs no API key.
WANDB_LOCAL_MODES = ("offline", "dryrun", "disabled")
# URI schemes MLflow serves through SQLAlchemy (sqlite, postgresql+psycopg2, ...).
MLFLOW_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def check_trackers_ready(names: list[str], *, output_dir: Path) -> None:
    """Raises one ConfigError naming what to install or set for each named tracker that cannot open.

    Args:
        names: The trackers named in log.trackers.
        output_dir: run.output_dir, where MLflow's default store goes.

    Raises:
        ConfigError: A package is missing, W&B has no login, or MLflow's store cannot be written.
    """
    check_trackers_installed(names)
    problems = [
        *([wandb_login_problem()] if "wandb" in names else []),
        *([mlflow_store_problem(output_dir)] if "mlflow" in names else []),
    ]
    problems = [problem for problem in problems if problem]
    if problems:
        raise ConfigError("\n".join(problems))


def wandb_login_problem() -> str | None:
    """What to do when wandb.init would stop for want of an API key; None when it would not."""
    # Lazy: an optional dependency, imported only where it is used.
    import wandb

    settings = _wandb_settings(wandb)
    if settings.mode in WANDB_LOCAL_MODES:
        return None
    missing = (
        "log.trackers names 'wandb' but no W&B login was found (no WANDB_API_KEY, no key from `wandb login`); "
        "run `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline to log on this machine (`wandb sync` later)"
    )
    # wandb.init's own look-up (WANDB_API_KEY, its settings files, ~/.netrc), without its prompt.
    # Not wandb.login(prompt=False): once it finds a key it asks the server who is logged in, and
    # against an unreachable host that hung for minutes.
    try:
        from wandb.sdk.lib import wbauth  # lazy: part of the optional wandb, like the import above
    except ImportError:  # wandb before wbauth (0.19-0.2x): the same look-up, without the key's shape check
        from wandb.sdk.lib import apikey  # lazy: likewise

        return None if apikey.api_key(settings=settings) else missing
    host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
    try:
        if wbauth.authenticate_session(host=host, source="paratrain", prompt=False, update_session=False):
            return None
    except wandb.errors.AuthenticationError as error:  # a key of the wrong shape
        return f"log.trackers names 'wandb' but its login is not usable ({error}); set a valid WANDB_API_KEY or run `wandb login --relogin`"
    finally:
        _forget_wandb_setup(wandb)
    return missing


def _forget_wandb_setup(wandb) -> None:
    """Drops the process-wide wandb setup that the look-up above creates, unless a run is using it.

    That setup holds the settings (WANDB_MODE among them) read at its creation, and a later
    wandb.init in this process (a one-process run trains where preflight ran) would use them rather
    than the environment it then has."""
    if wandb.run is None:
        wandb.teardown()


def _wandb_settings(wandb):
    """The settings a new process's wandb.init would read (rank 0 is one): WANDB_MODE and the rest of the
    environment, over the settings file `wandb offline` writes; read afresh, not from this process's cache."""
    settings = wandb.Settings()
    # The settings file's reader was renamed (update_from_system_config_file before wandb 0.2x).
    for read_settings_file in ("update_from_system_settings", "update_from_system_config_file"):
        if hasattr(settings, read_settings_file):
            getattr(settings, read_settings_file)()
            break
    settings.update_from_env_vars(dict(os.environ))
    return settings


def mlflow_store_problem(output_dir: Path) -> str | None:
    """What to do when MLflow's client could not open the store this run would log to; None when it could."""
    uri = mlflow_tracking_uri(output_dir)
    scheme = urlparse(uri).scheme.split("+")[0]
    needs_database = scheme in MLFLOW_DATABASE_SCHEMES
    if needs_database and not all(importlib.util.find_spec(name) for name in ("sqlalchemy", "alembic")):
        where = "MLFLOW_TRACKING_URI=" + uri if os.environ.get("MLFLOW_TRACKING_URI") else "the default store " + uri
        return (
            f"log.trackers names 'mlflow' and {where} needs sqlalchemy and alembic beside mlflow-skinny: "
            f"pip install 'paratrain[mlflow]', or set MLFLOW_TRACKING_URI to your MLflow server (http://HOST:5000)"
        )
    if scheme in ("", "file") and not _mlflow_file_store_allowed():
        return (
            f"log.trackers names 'mlflow' and MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow 3 "
            f"refuses unless MLFLOW_ALLOW_FILE_STORE=true; set that, or unset MLFLOW_TRACKING_URI for a SQLite "
            f"store in run.output_dir"
        )
    return None


def _mlflow_file_store_allowed() -> bool:
    # Lazy: an optional dependency, imported only where it is used.
    from mlflow import environment_variables

    # MLflow before 3 has no such switch: its file store always opens.
    allow = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    return allow is None or bool(allow.get())
