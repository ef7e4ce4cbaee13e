"""Typed readers for settings from the environment; a bad value stops start-up with a clear message."""

import ipaddress
import os
from pathlib import Path


class ImproperSetting(ValueError):
    pass


def env_str(name: str, default: str = "") -> str:
    file_path = os.environ.get(f"{name}_FILE")
    if file_path:
        return Path(file_path).read_text().strip()
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperSetting(f"{name}={raw!r} is not a boolean (use true/false)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ImproperSetting(f"{name}={raw!r} is not an integer") from exc
    if minimum is not None and value < minimum:
        raise ImproperSetting(f"{name}={value} is below its minimum {minimum}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


_PERIODS = {"s", "m", "h", "d", "sec", "second", "min", "minute", "hour", "day"}


def env_rate(name: str, default: str) -> str:
    """A rate as DRF's throttles read it: `<count>/<period>`, the period second, minute, hour or day (or s, m, h, d)."""
    raw = os.environ.get(name)
    value = default if raw is None or raw.strip() == "" else raw.strip()
    count, sep, period = value.partition("/")
    if not sep or not count.isdigit() or int(count) < 1 or period not in _PERIODS:
        raise ImproperSetting(f"{name}={value!r} is not a rate such as 10/minute")
    return value


def env_json(name: str, default: dict) -> dict:
    raw = env_str(name)
    if raw.strip() == "":
        return default
    import json

    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ImproperSetting(f"{name} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ImproperSetting(f"{name} must be a JSON object")
    return value


def env_cidrs(name: str, default: list[str]) -> list[str]:
    """Addresses or CIDRs, comma-separated; "none" for an empty list (an unset or empty value is the default)."""
    values = env_list(name, default)
    if values == ["none"]:
        return []
    for value in values:
        try:
            ipaddress.ip_network(value, strict=False)
        except ValueError as exc:
            raise ImproperSetting(f"{name}: {value!r} is not an address or CIDR ({exc})") from exc
    return values
