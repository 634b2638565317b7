"""The deployment's tables in control's SQL database (services/control/deployment.py reads and
writes them): what was applied, each version's pool, each model's stable version, the roll-outs,
why pools failed to start, and the autoscalers' decisions."""

SCHEMA = [
    # What was applied, numbered from 1: the file's text (and where it was read: relative sources are
    # relative to its directory's parent), who applied it, the models as they were declared after it
    # (JSON: a roll-out undone or rolled back declares the stable version again), what it changed.
    """CREATE TABLE IF NOT EXISTS deploy_revisions (
        number BIGINT PRIMARY KEY,
        applied_ms BIGINT NOT NULL,
        origin TEXT NOT NULL,
        file TEXT NOT NULL,
        digest TEXT NOT NULL,
        text TEXT NOT NULL,
        models TEXT NOT NULL,
        changes TEXT NOT NULL
    )""",
    # Each model version's pool as last declared (its workers' source, engine, replicas...).
    """CREATE TABLE IF NOT EXISTS deploy_pools (
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        pool TEXT NOT NULL,
        PRIMARY KEY (model, version)
    )""",
    # The version of each model that takes every new request but a live roll-out's share.
    """CREATE TABLE IF NOT EXISTS deploy_stable (
        model TEXT PRIMARY KEY,
        version TEXT NOT NULL
    )""",
    # Every roll-out, the live ones (at most one per model) with live = 1.
    """CREATE TABLE IF NOT EXISTS rollouts (
        id BIGINT PRIMARY KEY,
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        live INTEGER NOT NULL,
        revision BIGINT NOT NULL,
        data TEXT NOT NULL,
        updated_ms BIGINT NOT NULL
    )""",
    # Why a version's workers could not start (its roll-out halts on the first after it began).
    """CREATE TABLE IF NOT EXISTS pool_failures (
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        reason TEXT NOT NULL,
        worker TEXT NOT NULL,
        at_ms BIGINT NOT NULL
    )""",
    # An autoscaled pool's workers as its autoscaler last decided (services/control/scaling.py),
    # and every decision with its reason.
    """CREATE TABLE IF NOT EXISTS pool_scale (
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        replicas INTEGER NOT NULL,
        reason TEXT NOT NULL,
        at_ms BIGINT NOT NULL,
        PRIMARY KEY (model, version)
    )""",
    """CREATE TABLE IF NOT EXISTS scale_decisions (
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        replicas INTEGER NOT NULL,
        reason TEXT NOT NULL,
        at_ms BIGINT NOT NULL
    )""",
]
TABLES = ("deploy_revisions", "deploy_pools", "deploy_stable", "rollouts", "pool_failures", "pool_scale",
          "scale_decisions")
