"""Ferry settings, read from the environment.

With no REDIS_URL and no DATABASE_URL Ferry runs in embedded mode: SQLite under FERRY_DATA_DIR,
Channels' in-memory layer, Celery tasks run eagerly, and the web process hosts the model node.
"""

import ipaddress
import os
import re
import secrets
import tempfile
from pathlib import Path

import dj_database_url

from config.env import ImproperSetting, env_bool, env_cidrs, env_int, env_json, env_list, env_rate, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("FERRY_DATA_DIR", str(BASE_DIR / "var"))).resolve()
# Created for this user only: it holds the secret key, the demo's password and key, and SQLite's database. One
# that exists is left as it is (FERRY_DATA_DIR may name a folder of the operator's); its files are private.
DATA_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)


def _private(path: Path) -> None:
    """Narrow `path` (a file of this user's) to mode 600; one another user owns is left alone."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return
    if status.st_uid == os.getuid() and status.st_mode & 0o077:
        path.chmod(0o600)


def _generated_key(path: Path) -> str:
    """The key in `path`, generated into it first if it is missing. The key is written whole to a file of mode
    600 under a temporary name and then linked into place, which fails if another process got there first
    (`serve --workers N` starts several at once): every process reads the one that won, never a partial file,
    and the key is never readable by another user, not even for a moment."""
    if not path.exists():
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".secret_key.")  # mode 600
        try:
            os.write(fd, secrets.token_urlsafe(50).encode())
            os.close(fd)
            try:
                os.link(temporary, path)
            except FileExistsError:
                pass  # another process's key won
        finally:
            os.unlink(temporary)
    _private(path)  # one an earlier version wrote and then narrowed
    return path.read_text().strip()


DEBUG = env_bool("FERRY_DEBUG", False)
# Loopback only by default (`make run`). Django's test client's "testserver" is added by its test set-up alone.
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
# The examples' stand-ins for a key (platform/k8s/base/secret.example.yaml's CHANGE-ME-..., compose's
# compose-local-only-not-a-secret-change-me-...), and Django's own marker of an insecure one.
_PLACEHOLDER_KEY = re.compile(r"change-?me|not-a-secret|django-insecure", re.IGNORECASE)


def _private_host(host: str) -> bool:
    """Whether `host` cannot name this server publicly: a loopback address, or a name of one label (localhost, a
    compose service) that no public DNS resolves."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return "." not in host and "*" not in host


_secret = env_str("SECRET_KEY")
if _secret and _PLACEHOLDER_KEY.search(_secret) and not all(_private_host(host) for host in ALLOWED_HOSTS):
    raise ImproperSetting(
        "SECRET_KEY is an example's placeholder, and ALLOWED_HOSTS names a public host: set a random key"
        " (openssl rand -base64 48)"
    )
# Without SECRET_KEY a process generates a key of its own into the data directory: right for embedded mode (one
# machine, one data directory), wrong wherever processes share a database or Redis (each pod would have its own
# key, and API keys' pepper, sessions and signatures made on one would fail on the others). There a web process
# (config.asgi) and `ensure_demo_user` refuse to start with this message; nodes, which hold no key by design
# (a model is code), start on theirs.
SECRET_KEY_MISSING = (
    "SECRET_KEY is not set, and DATABASE_URL or REDIS_URL makes this a shared deployment: every web process"
    " must have the same key (set SECRET_KEY or SECRET_KEY_FILE)"
    if not _secret and (env_str("DATABASE_URL") or env_str("REDIS_URL"))
    else ""
)
SECRET_KEY = _secret or _generated_key(DATA_DIR / "secret_key")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "tenants",
    "serving",
    "rollout",
    "usage",
    "autoscaling",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "config.csp.content_security_policy",  # every HTML page's Content-Security-Policy (config.csp)
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
ASGI_APPLICATION = "config.asgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{DATA_DIR / 'ferry.sqlite3'}"),
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Embedded mode's one file is written at once by request handlers, the in-process Celery tasks (usage, shadow
    # pairs, rollout gates) and their threads. A transaction that reads and then writes (an approval) takes
    # SQLite's write lock only at its first write, and when another connection is writing SQLite refuses that
    # upgrade at once ("database is locked", no busy wait: it would deadlock), which answered an admin's
    # approval 503 in CI. IMMEDIATE takes the write lock at BEGIN, where SQLite waits up to `timeout` seconds
    # for it; WAL lets the readers read meanwhile.
    # The database holds sessions and password hashes: created for this user only (SQLite gives its -wal and
    # -shm files the database's mode), and one an earlier version created 644 is narrowed.
    _sqlite = Path(DATABASES["default"]["NAME"])
    if _sqlite.parent.is_dir():  # a file's path, not ":memory:"
        os.close(os.open(_sqlite, os.O_CREAT | os.O_WRONLY, 0o600))
        for _path in (_sqlite, _sqlite.with_name(_sqlite.name + "-wal"), _sqlite.with_name(_sqlite.name + "-shm")):
            _private(_path)
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 10,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL")
EMBEDDED = not REDIS_URL
# A socket's channel is read by a blocking BZPOPMIN of 5 s (channels_redis), and redis-py 8 times a read out
# after 5 s by default: a socket idle that long failed with a Redis TimeoutError. The read may take longer.
CHANNEL_LAYER_SOCKET_TIMEOUT_S = 10
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": CHANNEL_LAYER_SOCKET_TIMEOUT_S}]},
        },
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL or "memory://")
CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND", REDIS_URL or "cache+memory://")
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", not REDIS_URL)
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_ACKS_LATE = True
# Rollouts (rollout/): how often every active rollout's gates are evaluated (Celery beat; in embedded mode
# the process's own loop). Usage reaches the gates every FERRY_USAGE_FLUSH_SECONDS, so faster is no fresher.
FERRY_ROLLOUT_EVALUATE_SECONDS = env_int("FERRY_ROLLOUT_EVALUATE_SECONDS", 10, minimum=1)
# Placement (serving.reconciler): how often the reconciler re-plans from the fleet's heartbeats.
FERRY_RECONCILE_SECONDS = env_int("FERRY_RECONCILE_SECONDS", 10, minimum=1)
# Consolidation (serving.reconciler, placement.consolidate): moves in flight at most (0: off), and how long a
# node's placed replicas must plan on under half its compute before they move off it, make before break.
FERRY_CONSOLIDATE_MOVES = env_int("FERRY_CONSOLIDATE_MOVES", 2, minimum=0)
FERRY_CONSOLIDATE_HOLD_SECONDS = env_int("FERRY_CONSOLIDATE_HOLD_SECONDS", 300, minimum=0)
# Relief moves in flight at most (serving.policies.placement.relieve; 0: off): replicas off a device they outgrew.
FERRY_RELIEVE_MOVES = env_int("FERRY_RELIEVE_MOVES", 16, minimum=0)


def _every(task: str, seconds: float, **options: object) -> dict:
    """A beat entry whose run expires when the next is due: after a worker outage the runs queued meanwhile are
    dropped, not run back to back (each reads the state afresh, so the next one loses nothing)."""
    return {"task": task, "schedule": seconds, "options": {"expires": seconds, **options}}


CELERY_BEAT_SCHEDULE = {
    "publish-routing-snapshot": _every("serving.tasks.publish_routing_snapshot", 30.0),
    "prune-usage": _every("usage.tasks.prune_usage", 3600.0),
    "evaluate-rollouts": _every("rollout.tasks.evaluate_rollouts", float(FERRY_ROLLOUT_EVALUATE_SECONDS)),
    "prune-shadow": _every("rollout.tasks.prune_shadow", 3600.0),
    # serving.reconciler: also run at once when a version's desired replicas change; this catches lost nodes.
    "reconcile-placements": _every("serving.tasks.reconcile_placements", float(FERRY_RECONCILE_SECONDS)),
}
# Time limits of serving.tasks' tasks, by what each does (the other apps' tasks carry theirs in their decorators;
# the node's tasks run on a solo pool, which enforces none, and carry deadlines of their own). A reconciler step
# ends before its lock (serving.reconciler.LOCK_SECONDS, 30 s) could lapse.
CELERY_TASK_ANNOTATIONS = {
    # a large model's load and latency profile take minutes; past half an hour it hung (FAILED with the reason)
    "serving.tasks.validate_version": {"soft_time_limit": 1800, "time_limit": 1860},
    "serving.tasks.publish_routing_snapshot": {"soft_time_limit": 25, "time_limit": 30},
    "serving.tasks.reconcile_placements": {"soft_time_limit": 20, "time_limit": 25},
    "serving.tasks.record_placement": {"soft_time_limit": 20, "time_limit": 30},
}
# Autoscaling (autoscaling/): a tick every FERRY_AUTOSCALE_SECONDS (Celery beat) sizes the versions that have a
# scaling policy from their streams' arrivals and backlog, writes desired_replicas and asks FERRY_NODE_PROVIDER
# ("", "local" or "kubernetes") for the nodes of each pool in FERRY_NODE_POOLS, a JSON object by accelerator type:
# {"a10g": {"memory": "24GiB", "min_nodes": 0, "max_nodes": 4, "labels": {"zone": "a"},
#           "statefulset": "ferry-node-a10g"}}.
FERRY_AUTOSCALE_SECONDS = env_int("FERRY_AUTOSCALE_SECONDS", 5, minimum=1)
FERRY_AUTOSCALE_SHORT_WINDOW_S = env_int("FERRY_AUTOSCALE_SHORT_WINDOW_S", 10, minimum=1)
FERRY_AUTOSCALE_LONG_WINDOW_S = env_int("FERRY_AUTOSCALE_LONG_WINDOW_S", 120, minimum=1)
FERRY_AUTOSCALE_SCHEDULING_DELAY_S = env_int("FERRY_AUTOSCALE_SCHEDULING_DELAY_S", 5, minimum=0)
# Surge headroom (serving.policies.autoscale): requests a second per second the whole pool may grow by before any
# forecast can see it; 0 sizes by the forecast alone.
FERRY_AUTOSCALE_SURGE = env_int("FERRY_AUTOSCALE_SURGE", 0, minimum=0)
# Seasonality (serving.policies.seasonal): each version's rate by time of day over past days, in buckets; a rise
# seen at this time of day before is ordered one lead time ahead. FERRY_AUTOSCALE_SEASON_S 0 turns it off; a bucket
# is used once it has FERRY_AUTOSCALE_SEASON_MIN_PERIODS days behind it (2: a one-off day is not followed).
FERRY_AUTOSCALE_SEASON_S = env_int("FERRY_AUTOSCALE_SEASON_S", 86400, minimum=0)
FERRY_AUTOSCALE_SEASON_BUCKETS = env_int("FERRY_AUTOSCALE_SEASON_BUCKETS", 48, minimum=2)
FERRY_AUTOSCALE_SEASON_MIN_PERIODS = env_int("FERRY_AUTOSCALE_SEASON_MIN_PERIODS", 1, minimum=1)
FERRY_NODE_PROVIDER = env_str("FERRY_NODE_PROVIDER", "")
FERRY_NODE_POOLS = env_json("FERRY_NODE_POOLS", {})
FERRY_LOCAL_NODES_MAX = env_int("FERRY_LOCAL_NODES_MAX", 4, minimum=0)  # all pools together, on this machine
FERRY_K8S_NAMESPACE = env_str("FERRY_K8S_NAMESPACE", "")  # empty: the service account's own namespace
# The Celery queue the tick goes to: on Kubernetes a worker of its own, the one pod with an API token.
FERRY_AUTOSCALE_QUEUE = env_str("FERRY_AUTOSCALE_QUEUE", "celery")
if REDIS_URL:
    # A tick that waited past the next one's time is dropped: the next observes fresher numbers.
    CELERY_BEAT_SCHEDULE["autoscale"] = _every(
        "autoscaling.tasks.autoscale", float(FERRY_AUTOSCALE_SECONDS), queue=FERRY_AUTOSCALE_QUEUE
    )

# Passwords set through the admin, `createsuperuser` or `changepassword` (the accounts hold platform-wide rights):
# 12 characters at least, not one of the 20,000 most common, not all digits, not close to the username or email.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Console sessions (superusers' among them) last FERRY_SESSION_HOURS from the login, not Django's two weeks, and
# their cookie is sent on this site's own requests only (SameSite=Strict: a link or form on another site
# reaches the console logged out). The CSRF cookie stays Lax: it grants nothing by itself.
FERRY_SESSION_HOURS = env_int("FERRY_SESSION_HOURS", 12, minimum=1)
SESSION_COOKIE_AGE = FERRY_SESSION_HOURS * 3600
SESSION_COOKIE_SAMESITE = "Strict"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "console-models"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise serves from the finders; it only warns when this is missing
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.BasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "EXCEPTION_HANDLER": "serving.api.errors.json_exception_handler",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 100,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Ferry control-plane API",
    "DESCRIPTION": "Model registry and operations. Inference is served on /v2 (Open Inference Protocol).",
    "VERSION": "0.1.0",
    "ENUM_NAME_OVERRIDES": {"RoleEnum": "tenants.models.Role"},
}

# Serving (data plane).
FERRY_ARTIFACT_ROOT = Path(env_str("FERRY_ARTIFACT_ROOT", str(DATA_DIR / "artifacts"))).resolve()
FERRY_MAX_ARTIFACT_BYTES = env_int("FERRY_MAX_ARTIFACT_BYTES", 512 * 1024 * 1024, minimum=1)
# Where artifacts are stored (serving.artifacts, Django's storage "artifacts"): "filesystem" (under
# FERRY_ARTIFACT_ROOT) or "s3", an S3-compatible bucket through django-storages (installed separately:
# `pip install django-storages[s3]`); boto3 reads the credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY.
FERRY_ARTIFACT_STORAGE = env_str("FERRY_ARTIFACT_STORAGE", "filesystem")
if FERRY_ARTIFACT_STORAGE == "filesystem":
    STORAGES["artifacts"] = {"BACKEND": "serving.artifacts.ArtifactFileStorage"}
elif FERRY_ARTIFACT_STORAGE == "s3":
    STORAGES["artifacts"] = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": env_str("FERRY_ARTIFACT_S3_BUCKET"),
            "endpoint_url": env_str("FERRY_ARTIFACT_S3_ENDPOINT_URL") or None,
            "region_name": env_str("FERRY_ARTIFACT_S3_REGION") or None,
            "location": env_str("FERRY_ARTIFACT_S3_PREFIX", "artifacts"),
            "file_overwrite": True,  # names are sha256: an overwrite writes the same bytes
            "default_acl": None,
        },
    }
    if not STORAGES["artifacts"]["OPTIONS"]["bucket_name"]:
        raise ImproperSetting("FERRY_ARTIFACT_STORAGE=s3 needs FERRY_ARTIFACT_S3_BUCKET")
else:
    raise ImproperSetting(f"FERRY_ARTIFACT_STORAGE={FERRY_ARTIFACT_STORAGE!r} is not filesystem or s3")
# Artifact distribution to nodes (docs/decisions/0015-registry-and-artifacts.md). A node with FERRY_ARTIFACT_URL
# (the control plane's base URL) fetches by sha256 from /internal/artifacts/, sending FERRY_NODE_TOKEN, which
# the web process requires (empty: the endpoint is off). Without it a node reads the storage itself. Either
# way what it fetches goes through its disk cache, bounded in bytes, hash-checked before every load.
FERRY_NODE_TOKEN = env_str("FERRY_NODE_TOKEN")
FERRY_ARTIFACT_URL = env_str("FERRY_ARTIFACT_URL")
FERRY_ARTIFACT_CACHE_DIR = Path(env_str("FERRY_ARTIFACT_CACHE_DIR", str(DATA_DIR / "artifact-cache"))).resolve()
FERRY_ARTIFACT_CACHE_BYTES = env_int("FERRY_ARTIFACT_CACHE_BYTES", 20 * 1024**3, minimum=1024 * 1024)
FERRY_ARTIFACT_FETCH_TIMEOUT_S = env_int("FERRY_ARTIFACT_FETCH_TIMEOUT_S", 120, minimum=1)
FERRY_MAX_INFER_BODY_BYTES = env_int("FERRY_MAX_INFER_BODY_BYTES", 8 * 1024 * 1024, minimum=1024)
# Intra-op threads for CPU inference. 0 (auto) leaves one core to the event loop: with every core
# computing, HTTP parsing starves and tail latency grows (docs/benchmarks.md has the numbers).
FERRY_TORCH_THREADS = env_int("FERRY_TORCH_THREADS", 0, minimum=0)
FERRY_MAX_CONCURRENCY = env_int("FERRY_MAX_CONCURRENCY", 4096, minimum=1)
# Front-end shedding (docs/decisions/0014-admission-and-shedding.md): the front door refuses a share of inference,
# steered to keep the event loop's lag near the target; the consumer refuses outright past the maximum
# lag, or when a request waited longer than the maximum between its first byte and its handler.
FERRY_LOOP_LAG_TARGET_MS = env_int("FERRY_LOOP_LAG_TARGET_MS", 40, minimum=1)
FERRY_MAX_LOOP_LAG_MS = env_int("FERRY_MAX_LOOP_LAG_MS", 150, minimum=1)
FERRY_MAX_FRONTEND_WAIT_MS = env_int("FERRY_MAX_FRONTEND_WAIT_MS", 150, minimum=1)
# CoDel's target for that wait: while every request read for 100 ms waited past it, a queue stands before the
# read and the front door refuses each request that waited longer (serving.policies.shedding); 0 turns it off.
FERRY_FRONTEND_SOJOURN_TARGET_MS = env_int("FERRY_FRONTEND_SOJOURN_TARGET_MS", 20, minimum=0)
# Admission by estimated completion against the deadline, and fallback under saturation. Off only for
# contrast benchmarks: queues and deadlines still bound the work.
FERRY_ADMISSION = env_bool("FERRY_ADMISSION", True)
FERRY_MAX_QUEUE_BYTES = env_int("FERRY_MAX_QUEUE_BYTES", 64 * 1024 * 1024, minimum=1024)  # per version
# Distributed mode: the bytes a version's Redis stream may hold, from every gateway (transport/stream_bound.py).
FERRY_MAX_STREAM_BYTES = env_int("FERRY_MAX_STREAM_BYTES", 64 * 1024 * 1024, minimum=1024)
# A stalled upload frees its slot after this long between chunks; a WebSocket answer its client does not read
# within it drops the connection.
FERRY_BODY_TIMEOUT_S = env_int("FERRY_BODY_TIMEOUT_S", 30, minimum=1)
FERRY_DEVICE = env_str("FERRY_DEVICE", "")  # "" picks cuda when present, else cpu
FERRY_NODE_MEMORY_BYTES = env_int("FERRY_NODE_MEMORY_BYTES", 4 * 1024**3, minimum=1)
# The warm tier: host memory a node keeps evicted versions in (CUDA: moved to the CPU; CPU: the loaded module),
# so reloading one skips the artifact and the warm-up. 0: evicted versions are dropped.
FERRY_NODE_WARM_BYTES = env_int("FERRY_NODE_WARM_BYTES", 0, minimum=0)
# The accelerator type this node declares to placement constraints; "" names the device's kind (cpu, cuda).
FERRY_NODE_ACCELERATOR = env_str("FERRY_NODE_ACCELERATOR", "")
# Loads of cold versions that requests may queue on a node; past it a request for another cold version is 503.
FERRY_MAX_QUEUED_LOADS = env_int("FERRY_MAX_QUEUED_LOADS", 16, minimum=1)
# `runnode` serves Prometheus /metrics on this port (0: off; --metrics-port overrides). platform/ uses 9464.
FERRY_NODE_METRICS_PORT = env_int("FERRY_NODE_METRICS_PORT", 0, minimum=0)
# The web process hosts the node (embedded mode) unless told otherwise.
FERRY_EMBEDDED_NODE = env_bool("FERRY_EMBEDDED_NODE", True)
# Embedded mode with several web processes (`serve --workers N`): the node host's Unix socket, which `serve`
# sets for the web processes it starts (serving.dataplane.transport.host_link). Not a setting to set by hand.
FERRY_NODE_SOCKET = env_str("FERRY_NODE_SOCKET", "")
# Several web processes on one port (`serve --workers N`, either mode): the folder where each writes its metrics
# every second, so that /metrics on the port answers for all of them whichever process the kernel picks
# (serving.dataplane.metrics.process_set). `serve` sets it, a fresh folder per run; not a setting to set by hand.
FERRY_METRICS_DIR = env_str("FERRY_METRICS_DIR", "")
# Per-tenant quotas on /v2 inference (docs/decisions/0012-quotas.md). Shared through Redis (one script call
# per request, FERRY_QUOTA_REDIS_TIMEOUT_MS at most) when FERRY_QUOTA_REDIS_URL (default REDIS_URL) is
# set, in-process otherwise. While Redis does not answer, each gateway enforces its share: the tenant's
# limits divided by FERRY_QUOTA_GATEWAYS, the number of gateways you run. An in-flight lease a gateway
# never releases (it died) expires after FERRY_QUOTA_LEASE_S: keep it above FERRY_LATENCY_BUDGET_MS, which
# caps every request's deadline.
FERRY_QUOTAS = env_bool("FERRY_QUOTAS", True)
FERRY_QUOTA_REDIS_URL = env_str("FERRY_QUOTA_REDIS_URL", REDIS_URL)
FERRY_QUOTA_REDIS_TIMEOUT_MS = env_int("FERRY_QUOTA_REDIS_TIMEOUT_MS", 100, minimum=1)
FERRY_QUOTA_GATEWAYS = env_int("FERRY_QUOTA_GATEWAYS", 1, minimum=1)
FERRY_QUOTA_LEASE_S = env_int("FERRY_QUOTA_LEASE_S", 120, minimum=1)
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024
FILE_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("FERRY_LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}

# Front door (serving.dataplane.http.frontdoor): bounds every request meets before Django or the inference consumer.
# Whole-request read deadline: head and body, from the request's first byte (a silent new connection
# gets as long); 408 JSON, then the connection is closed.
FERRY_REQUEST_READ_TIMEOUT_S = env_int("FERRY_REQUEST_READ_TIMEOUT_S", 10, minimum=1)
# The deadline an engineer's artifact upload gets instead, once its credentials are checked.
FERRY_UPLOAD_READ_TIMEOUT_S = env_int("FERRY_UPLOAD_READ_TIMEOUT_S", 600, minimum=1)
# Any body outside /v2 (forms, JSON, anonymous uploads): 413 JSON past it, before Django reads it.
FERRY_MAX_FORM_BODY_BYTES = env_int("FERRY_MAX_FORM_BODY_BYTES", 1024 * 1024, minimum=1024)
# Request body bytes held in memory by the process across all requests: 503 + Retry-After past it.
FERRY_MAX_INFLIGHT_BODY_BYTES = env_int("FERRY_MAX_INFLIGHT_BODY_BYTES", 256 * 1024 * 1024, minimum=1024 * 1024)

# Usage metering (usage/): each data-plane process drains its counts every FERRY_USAGE_FLUSH_SECONDS and
# sends them to Celery; past FERRY_USAGE_MAX_KEYS distinct (tenant, model, version, minute) cells between
# drains, answers go unmetered and are counted in ferry_usage_unmetered_total.
FERRY_USAGE_FLUSH_SECONDS = env_int("FERRY_USAGE_FLUSH_SECONDS", 10, minimum=1)
FERRY_USAGE_MAX_KEYS = env_int("FERRY_USAGE_MAX_KEYS", 20_000, minimum=1)
FERRY_USAGE_RETENTION_DAYS = env_int("FERRY_USAGE_RETENTION_DAYS", 400, minimum=1)
FERRY_USAGE_BATCH_DAYS = env_int("FERRY_USAGE_BATCH_DAYS", 7, minimum=1)

# Shadow traffic (serving.dataplane.gateway.shadow): the mirror queue's bounds (items, and bytes of requests
# with their primaries' answers), the tasks that send mirrors to the shadow version, the pairs kept between
# flushes (items and bytes), how often they go to Celery for comparison (rollout.tasks.record_shadow), and the
# disagreements kept per model, baseline and candidate.
FERRY_SHADOW_QUEUE_ITEMS = env_int("FERRY_SHADOW_QUEUE_ITEMS", 256, minimum=1)
FERRY_SHADOW_QUEUE_BYTES = env_int("FERRY_SHADOW_QUEUE_BYTES", 16 * 1024 * 1024, minimum=1024)
FERRY_SHADOW_WORKERS = env_int("FERRY_SHADOW_WORKERS", 2, minimum=1)
# The percent of a node's device mirrors may take ahead of callers' batches (serving.policies.mirror_share);
# 0: mirrors run only in the gaps callers leave. At most 50: callers' work comes first. 10 by default: on a quiet
# machine it took the share of mirrors compared from under 1% to 21-24% at half capacity (every caller answered)
# and 3-11% at capacity, where one run of three lost more callers' requests with it (docs/benchmarks/shadow.md).
FERRY_SHADOW_DEVICE_PERCENT = env_int("FERRY_SHADOW_DEVICE_PERCENT", 10, minimum=0)
if FERRY_SHADOW_DEVICE_PERCENT > 50:
    raise ImproperSetting(f"FERRY_SHADOW_DEVICE_PERCENT={FERRY_SHADOW_DEVICE_PERCENT} is over 50")
FERRY_SHADOW_MAX_PAIRS = env_int("FERRY_SHADOW_MAX_PAIRS", 4096, minimum=1)
FERRY_SHADOW_MAX_PAIR_BYTES = env_int("FERRY_SHADOW_MAX_PAIR_BYTES", 32 * 1024 * 1024, minimum=1024)
FERRY_SHADOW_FLUSH_SECONDS = env_int("FERRY_SHADOW_FLUSH_SECONDS", 10, minimum=1)
FERRY_SHADOW_SAMPLES = env_int("FERRY_SHADOW_SAMPLES", 100, minimum=1)
# Shadow comparisons and disagreements older than this are deleted (rollout.tasks.prune_shadow, hourly).
FERRY_SHADOW_RETENTION_DAYS = env_int("FERRY_SHADOW_RETENTION_DAYS", 30, minimum=1)
# The share of live requests a rollout mirrors to its candidate while it shadows (until it ends), in percent.
FERRY_ROLLOUT_SHADOW_PERCENT = env_int("FERRY_ROLLOUT_SHADOW_PERCENT", 100, minimum=1)
FERRY_ROLLOUT_SHADOW_FRACTION = min(FERRY_ROLLOUT_SHADOW_PERCENT, 100) / 100

# --- Runtime isolation: the sandboxed process that runs tenant artifacts (serving.dataplane.node.sandbox) ---
# "process" (default, every mode): each loaded version's model runs in its own confined child process
# (serving.dataplane.node.runtime_process), without this process's files, credentials or network. "inline" runs
# it in this process: UNSAFE (a model can read the secret key and the database); only for the benchmark's
# contrast (bench.runtime_cost), refused unless FERRY_DEBUG is on, and a warning is logged at start.
FERRY_RUNTIME_ISOLATION = env_str("FERRY_RUNTIME_ISOLATION", "process")
if FERRY_RUNTIME_ISOLATION not in ("process", "inline"):
    raise ImproperSetting(f"FERRY_RUNTIME_ISOLATION={FERRY_RUNTIME_ISOLATION!r} is not process or inline")
if FERRY_RUNTIME_ISOLATION == "inline" and not DEBUG:
    raise ImproperSetting(
        "FERRY_RUNTIME_ISOLATION=inline runs tenant code with this process's files and credentials: only with"
        " FERRY_DEBUG=true (contrast benchmarks), never in a deployment"
    )
# A runtime process whose kernel or user gives it no filesystem wall (mount namespace or Landlock) or no network
# wall (network namespace or Landlock ABI >= 4) refuses to run tenant code, and the load fails saying why. "true"
# runs it anyway: UNSAFE (the model may read the data directory and reach the databases); logged at start and
# at each runtime process's start (serving.dataplane.node.sandbox.require_walls).
FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX = env_bool("FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX", False)
# A batch the runtime process has not answered in this long fails (the process is killed and replaced).
FERRY_RUNTIME_TIMEOUT_S = env_int("FERRY_RUNTIME_TIMEOUT_S", 30, minimum=1)
# Starting a runtime process (imports, confinement) and loading an artifact into it, each.
FERRY_RUNTIME_START_TIMEOUT_S = env_int("FERRY_RUNTIME_START_TIMEOUT_S", 120, minimum=1)

# --- Operator check: which operators a registered graph may call (serving.dataplane.node.operator_check) ---
# Operator namespaces besides aten, prim and quantized that registered models may call (comma list), for a
# library of custom operators the platform loads into its nodes. Registration checks this setting; processes
# that load models without Django settings read the same environment variable (operator_check).
FERRY_ALLOWED_OPERATOR_NAMESPACES = env_list("FERRY_ALLOWED_OPERATOR_NAMESPACES", [])

# --- /metrics access, cookies and TLS, login throttling ---

# /metrics, the web process's and a node's (`runnode --metrics-port`), per serving.dataplane.metrics.metrics_access:
# the bearer token FERRY_METRICS_TOKEN (or a file, FERRY_METRICS_TOKEN_FILE: a mounted Secret) reads every
# label; a caller without it whose TCP peer address is in FERRY_METRICS_ALLOW (CIDRs; "none": nobody) reads
# the same families with private models' names and versions and tenants' slugs replaced by opaque names;
# anyone else gets 401. The allow-list defaults to loopback while no token is set, so `make run` can be
# scraped (or curled) on its own machine and not from the network, and to nobody once a token is set.
FERRY_METRICS_TOKEN = env_str("FERRY_METRICS_TOKEN")
FERRY_METRICS_ALLOW = env_cidrs("FERRY_METRICS_ALLOW", [] if FERRY_METRICS_TOKEN else ["127.0.0.0/8", "::1/128"])

# Cookies and TLS, off in embedded mode (plain http on loopback) and on in platform/k8s, where TLS ends at
# the ingress: HSTS for FERRY_HSTS_SECONDS (0: none), with subdomains and preload when asked; the header the
# proxy sets to say the request came over https (FERRY_PROXY_SSL_HEADER=X-Forwarded-Proto), which is what
# lets Django see such a request as secure and send HSTS (set it only behind a proxy that overwrites that
# header: a client could otherwise claim https itself); and Secure session and CSRF cookies, on by default
# whenever either of those says the site is served over https. FERRY_SECURE_COOKIES=false there is warned
# about at start (tenants.checks): the session cookie of a superuser would travel over plain http.
SECURE_HSTS_SECONDS = env_int("FERRY_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("FERRY_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("FERRY_HSTS_PRELOAD", False)
_proxy_ssl_header = env_str("FERRY_PROXY_SSL_HEADER")
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _proxy_ssl_header.upper().replace("-", "_"), "https") if _proxy_ssl_header else None
)
FERRY_SECURE_COOKIES = env_bool("FERRY_SECURE_COOKIES", bool(SECURE_PROXY_SSL_HEADER or SECURE_HSTS_SECONDS))
SESSION_COOKIE_SECURE = FERRY_SECURE_COOKIES
CSRF_COOKIE_SECURE = FERRY_SECURE_COOKIES
# Redirect plain http to https in Django itself (the console and /api; not /v2 or /metrics, which never
# pass Django's middleware). On in platform/k8s, behind the ingress that says which requests came over https;
# never for /internal/, where nodes fetch artifacts from the web Service over in-cluster http.
SECURE_SSL_REDIRECT = env_bool("FERRY_SSL_REDIRECT", False)
SECURE_REDIRECT_EXEMPT = [r"^internal/"]

# The proxies in front of the web processes (addresses or CIDRs; empty, the default: none). A request whose TCP
# peer is one of them comes from the address its X-Forwarded-For names (the right-most one that is not itself a
# trusted proxy) over the scheme its X-Forwarded-Proto names (serving.dataplane.http.frontdoor.uvicorn_config);
# from any other peer those headers are ignored. platform/k8s sets the ingress controller's pod addresses: without
# it every client behind the ingress is the ingress's address, and a lockout below locks out everyone.
FERRY_TRUSTED_PROXIES = [
    str(ipaddress.ip_network(value, strict=False)) for value in env_cidrs("FERRY_TRUSTED_PROXIES", [])
]

# Login throttling (django-axes): FERRY_LOGIN_FAILURE_LIMIT wrong passwords for one username from one
# address lock that pair out for FERRY_LOGIN_COOLOFF_MINUTES, on the console's /login/, the admin's and the
# API's HTTP Basic authentication alike (each calls django.contrib.auth.authenticate, which the backend
# below guards). The count ends a cool-off after the last failure, or at a successful login (Django's
# user_logged_in: the console and the admin; DRF's Basic authentication sends none, so an API success does
# not). A lockout answers 429 with Retry-After (tenants.lockout): JSON on the API, a page elsewhere. The
# address is REMOTE_ADDR: the TCP peer, or behind FERRY_TRUSTED_PROXIES the client they forwarded; axes never
# reads X-Forwarded-For itself (a client could write any address there).
INSTALLED_APPS += ["axes"]
MIDDLEWARE += ["axes.middleware.AxesMiddleware"]  # last, as django-axes requires
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
FERRY_LOGIN_FAILURE_LIMIT = env_int("FERRY_LOGIN_FAILURE_LIMIT", 5, minimum=1)
FERRY_LOGIN_COOLOFF_MINUTES = env_int("FERRY_LOGIN_COOLOFF_MINUTES", 15, minimum=1)
AXES_FAILURE_LIMIT = FERRY_LOGIN_FAILURE_LIMIT
AXES_COOLOFF_TIME = FERRY_LOGIN_COOLOFF_MINUTES / 60  # hours, as a float (an int would be whole hours)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "tenants.lockout.locked_out"
AXES_IPWARE_META_PRECEDENCE_ORDER = ("REMOTE_ADDR",)
# The API's HTTP Basic authentication, answering a lockout 429 (tenants.lockout says why DRF needs this).
REST_FRAMEWORK["DEFAULT_AUTHENTICATION_CLASSES"] = [
    "tenants.lockout.LockoutAwareBasicAuthentication"
    if name == "rest_framework.authentication.BasicAuthentication"
    else name
    for name in REST_FRAMEWORK["DEFAULT_AUTHENTICATION_CLASSES"]
]
# The API's throttles per client address (tenants.throttles): wrong HTTP Basic credentials (each costs a password
# hash; past the rate the next is refused unchecked) and anonymous requests to its open views (the index, the
# schema and its pages). 429 JSON with Retry-After. The address is REMOTE_ADDR, never the client's own
# X-Forwarded-For (NUM_PROXIES 0; FERRY_TRUSTED_PROXIES is where a proxy's is believed).
FERRY_API_FAILED_LOGIN_RATE = env_rate("FERRY_API_FAILED_LOGIN_RATE", "10/minute")
FERRY_API_ANON_RATE = env_rate("FERRY_API_ANON_RATE", "60/minute")
REST_FRAMEWORK["DEFAULT_THROTTLE_CLASSES"] = ["tenants.throttles.AnonymousRate"]
REST_FRAMEWORK["NUM_PROXIES"] = 0

# --- The capacity planner's bounds and the /v2 control calls' quota ---
# A planner simulation check (console /console/planner/, POST) gives up after FERRY_PLANNER_DEADLINE_S of wall
# time (504, saying how far it got); at most FERRY_PLANNER_MAX_SIMULATIONS run at once in a process (503 past
# it) and one per user (429); a client that leaves stops its check.
FERRY_PLANNER_DEADLINE_S = env_int("FERRY_PLANNER_DEADLINE_S", 5, minimum=1)
FERRY_PLANNER_MAX_SIMULATIONS = env_int("FERRY_PLANNER_MAX_SIMULATIONS", 2, minimum=1)
# /v2 metadata, config, ready and repository index take one request of the tenant's quota, like inference.
# Repository load/unload also take a token of a bucket of their own per tenant and gateway process
# (FERRY_CONTROL_LOADS_PER_MINUTE, up to FERRY_CONTROL_LOAD_BURST at once): each writes the database and
# republishes the routing snapshot to every gateway.
FERRY_CONTROL_LOADS_PER_MINUTE = env_int("FERRY_CONTROL_LOADS_PER_MINUTE", 6, minimum=1)
FERRY_CONTROL_LOAD_BURST = env_int("FERRY_CONTROL_LOAD_BURST", 3, minimum=1)

# --- Latency budget (issue 19) ---
# The platform's latency SLO in milliseconds: a request without a deadline (OIP parameter `timeout`) gets it
# as its deadline, a client's longer `timeout` is cut to it, and a version's lower `default_timeout_ms` is
# that version's budget. Admission refuses (fallback, else 503 + Retry-After) what cannot finish within it.
# It travels in the routing snapshot, so every gateway applies the value the control plane published.
FERRY_LATENCY_BUDGET_MS = env_int("FERRY_LATENCY_BUDGET_MS", 300, minimum=1)

# --- API docs for people: /api/ (index), /api/docs/ (Swagger UI), /api/redoc/ (Redoc) ---
# Their JavaScript and CSS come from drf-spectacular-sidecar through our static files (whitenoise), never a
# CDN: the pages load nothing from outside this server.
INSTALLED_APPS += ["drf_spectacular_sidecar"]
SPECTACULAR_SETTINGS.update(SWAGGER_UI_DIST="SIDECAR", SWAGGER_UI_FAVICON_HREF="SIDECAR", REDOC_DIST="SIDECAR")

# --- The demo's story (`make run`: serving/demo_story.py, manage.py demo_story and demo_traffic) ---
# FERRY_DEMO_TRAFFIC=0 leaves the demo as the models alone: no rollout is started and no traffic is sent.
# Otherwise `make run` sends FERRY_DEMO_TRAFFIC_RPS requests a second (at most 200) to `digits` with the demo
# tenant's key, at most FERRY_DEMO_TRAFFIC_IN_FLIGHT at once, while the server runs.
FERRY_DEMO_TRAFFIC = env_bool("FERRY_DEMO_TRAFFIC", True)
FERRY_DEMO_TRAFFIC_RPS = min(env_int("FERRY_DEMO_TRAFFIC_RPS", 20, minimum=1), 200)
FERRY_DEMO_TRAFFIC_IN_FLIGHT = min(env_int("FERRY_DEMO_TRAFFIC_IN_FLIGHT", 8, minimum=1), 32)

# --- WebSocket inference (issue 23; serving/dataplane/http/websocket.py, docs/websocket.md) ---
# Per connection: at most FERRY_WS_MAX_IN_FLIGHT messages and FERRY_WS_MAX_IN_FLIGHT_BYTES bytes of requests
# in flight (a message is in flight until its answer is written); at the bound the server stops reading the
# socket, so a fast sender is slowed by TCP, not buffered. A connection with nothing in flight that sends
# nothing for FERRY_WS_IDLE_S is closed (4408). Each message is bounded by FERRY_MAX_INFER_BODY_BYTES.
FERRY_WS_MAX_IN_FLIGHT = env_int("FERRY_WS_MAX_IN_FLIGHT", 64, minimum=1)
FERRY_WS_MAX_IN_FLIGHT_BYTES = env_int("FERRY_WS_MAX_IN_FLIGHT_BYTES", 16 * 1024 * 1024, minimum=1024)
FERRY_WS_IDLE_S = env_int("FERRY_WS_IDLE_S", 60, minimum=1)

# --- Response cache (issue 21; serving/dataplane/gateway/cache.py) ---
# A version that opts in (`response_cache: true`) is answered from the gateway's cache on a repeat of an
# identical request: FERRY_RESPONSE_CACHE_BYTES bound the local tier (an LRU; 0 turns the cache off for every
# version). FERRY_RESPONSE_CACHE_REDIS_URL adds a tier shared by the gateways (empty: none), each entry kept
# FERRY_RESPONSE_CACHE_REDIS_TTL_S seconds; a Redis look-up that takes over FERRY_RESPONSE_CACHE_REDIS_TIMEOUT_MS
# is a miss.
FERRY_RESPONSE_CACHE_BYTES = env_int("FERRY_RESPONSE_CACHE_BYTES", 64 * 1024 * 1024, minimum=0)
FERRY_RESPONSE_CACHE_REDIS_URL = env_str("FERRY_RESPONSE_CACHE_REDIS_URL")
FERRY_RESPONSE_CACHE_REDIS_TTL_S = env_int("FERRY_RESPONSE_CACHE_REDIS_TTL_S", 300, minimum=1)
FERRY_RESPONSE_CACHE_REDIS_TIMEOUT_MS = env_int("FERRY_RESPONSE_CACHE_REDIS_TIMEOUT_MS", 50, minimum=1)

# --- Traces (issue 21; serving/dataplane/tracing.py) ---
# Read from the standard OpenTelemetry variables, not from FERRY_* ones: off unless OTEL_EXPORTER_OTLP_ENDPOINT
# (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, or OTEL_TRACES_EXPORTER names an exporter (otlp, console);
# OTEL_SDK_DISABLED=true turns it off. Sampling: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (for 1%:
# parentbased_traceidratio and 0.01). OTEL_SERVICE_NAME names the process; unset, a web process is ferry-web
# (serving.wiring) and a node ferry-node (runnode).

# --- The Open Inference Protocol over gRPC (issue 21; serving/dataplane/grpc/, docs/grpc.md) ---
# Each web process serves inference.GRPCInferenceService on FERRY_GRPC_HOST:FERRY_GRPC_PORT beside HTTP (8001,
# as Triton; 0 turns it off). At most FERRY_GRPC_MAX_CONCURRENT_RPCS calls at once per process (past it:
# UNAVAILABLE with retry-after, as REST's 503; grpcio's own RESOURCE_EXHAUSTED only at twice it, a backstop), at
# most FERRY_GRPC_STREAM_IN_FLIGHT requests in flight per ModelStreamInfer stream; a message is bounded by
# FERRY_MAX_INFER_BODY_BYTES.
FERRY_GRPC_HOST = env_str("FERRY_GRPC_HOST", "127.0.0.1")
FERRY_GRPC_PORT = env_int("FERRY_GRPC_PORT", 8001, minimum=0)
FERRY_GRPC_MAX_CONCURRENT_RPCS = env_int("FERRY_GRPC_MAX_CONCURRENT_RPCS", 1024, minimum=1)
FERRY_GRPC_STREAM_IN_FLIGHT = env_int("FERRY_GRPC_STREAM_IN_FLIGHT", 64, minimum=1)
