"""What the front door relies on in uvicorn, checked against the installed uvicorn.

`serving.dataplane.http.frontdoor.FrontDoorProtocol` subclasses uvicorn's `HttpToolsProtocol` (and
`LeanCycle` its `RequestResponseCycle`): it reads and writes their state, overrides their hooks and calls
their methods, none of which is uvicorn's public API. uvicorn is pinned to an exact version in
pyproject.toml; these tests fail when an upgrade renames, removes or re-signs anything the front door
uses, and when the front door starts using something of uvicorn's that is not listed here, so a uvicorn
upgrade cannot break serving silently. To upgrade: change the pin, run this file, and read uvicorn's
changes for every name it reports.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import tomllib
from pathlib import Path

import pytest
import uvicorn
import websockets
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.protocol import Protocol
from websockets.server import ServerProtocol

from serving.dataplane.http import frontdoor

ROOT = Path(__file__).resolve().parent.parent
PINNED = "0.54.0"

# HttpToolsProtocol's instance state the front door reads or writes (set by uvicorn's own methods).
PROTOCOL_STATE = {
    "access_log", "app", "app_state", "asgi_version", "client", "connections", "cycle", "expect_100_continue",
    "flow", "headers", "limit_concurrency", "logger", "loop", "parser", "pipeline", "root_path", "scheme",
    "scope", "server", "server_state", "tasks", "timeout_keep_alive", "transport", "url",
}  # fmt: skip
# HttpToolsProtocol's methods the front door overrides or calls, with their parameters (name, kind, default?).
P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
PROTOCOL_METHODS: dict[str, list[tuple[str, object, bool]]] = {
    "__init__": [("self", P, False), ("config", P, False), ("server_state", P, False), ("app_state", P, False),
                 ("_loop", P, True)],
    "connection_made": [("self", P, False), ("transport", P, False)],
    "connection_lost": [("self", P, False), ("exc", P, False)],
    "data_received": [("self", P, False), ("data", P, False)],
    "on_message_begin": [("self", P, False)],
    "on_url": [("self", P, False), ("url", P, False)],
    "on_header": [("self", P, False), ("name", P, False), ("value", P, False)],
    "on_headers_complete": [("self", P, False)],
    "on_body": [("self", P, False), ("body", P, False)],
    "on_message_complete": [("self", P, False)],
    "on_response_complete": [("self", P, False)],
    "send_400_response": [("self", P, False), ("msg", P, False)],
    "handle_websocket_upgrade": [("self", P, False)],
    "_should_upgrade": [("self", P, False)],
    "_unsupported_upgrade_warning": [("self", P, False)],
    "_start_asgi_task": [("self", P, False), ("cycle", P, False), ("app", P, False)],
    "shutdown": [("self", P, False)],  # uvicorn's Server calls it on every connection, a lane's included
}  # fmt: skip
# RequestResponseCycle's state the front door reads or writes (on `self.cycle` and in LeanCycle).
CYCLE_STATE = {
    "access_log", "body", "chunked_encoding", "default_headers", "disconnected", "expected_content_length",
    "flow", "keep_alive", "message_event", "more_body", "response_complete", "response_started", "scope",
    "transport", "waiting_for_100_continue",
}  # fmt: skip
CYCLE_METHODS: dict[str, list[tuple[str, object, bool]]] = {
    "__init__": [("self", P, False), ("scope", P, False), ("transport", P, False), ("flow", P, False),
                 ("logger", P, False), ("access_logger", P, False), ("access_log", P, False),
                 ("default_headers", P, False), ("message_event", P, False), ("expect_100_continue", P, False),
                 ("keep_alive", P, False), ("on_response", P, False)],
    "send": [("self", P, False), ("message", P, False)],
    "run_asgi": [("self", P, False), ("app", P, False)],
}  # fmt: skip
FLOW_STATE = {"read_paused", "write_paused"}
FLOW_METHODS = {"drain", "pause_reading", "resume_reading"}
SERVER_STATE = {"default_headers", "total_requests", "connections", "tasks"}
# uvicorn.Config keywords `frontdoor.uvicorn_config` and `manage.py serve` pass.
CONFIG_KEYWORDS = {
    "app", "host", "port", "loop", "lifespan", "access_log", "proxy_headers", "forwarded_allow_ips",
    "limit_concurrency", "log_level",
    "timeout_graceful_shutdown", "ws", "ws_max_size", "ws_per_message_deflate", "http", "workers",
}  # fmt: skip


def params(function: object) -> list[tuple[str, object, bool]]:
    return [(p.name, p.kind, p.default is not p.empty) for p in inspect.signature(function).parameters.values()]


def class_ast(cls: type) -> ast.ClassDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    return node


def self_attributes(cls: ast.ClassDef, stored_only: bool = False) -> set[str]:
    """Names used as `self.NAME` in the class's methods (only those assigned, with `stored_only`)."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if not stored_only or isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def super_calls(cls: ast.ClassDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "super"
    }


def defined_methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def own_state(cls: ast.ClassDef) -> set[str]:
    """What the front door's class adds: its methods and the state its __init__ assigns."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    stored = {
        node.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and isinstance(node.ctx, ast.Store)
    }
    return defined_methods(cls) | stored


def test_uvicorn_is_pinned_to_the_version_checked_here() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in dependencies if re.match(r"uvicorn\b", d)]
    assert pins == [f"uvicorn[standard]=={PINNED}"]
    assert uvicorn.__version__ == PINNED


def test_the_protocol_state_and_methods_the_front_door_uses_are_uvicorns() -> None:
    state = self_attributes(class_ast(HttpToolsProtocol), stored_only=True)
    assert PROTOCOL_STATE - state == set(), "state the front door uses that uvicorn's protocol no longer sets"
    for name, expected in PROTOCOL_METHODS.items():
        assert callable(getattr(HttpToolsProtocol, name, None)), f"HttpToolsProtocol.{name} is gone"
        assert params(getattr(HttpToolsProtocol, name)) == expected, f"HttpToolsProtocol.{name} changed signature"


def test_the_cycle_state_and_methods_the_front_door_uses_are_uvicorns() -> None:
    state = self_attributes(class_ast(RequestResponseCycle), stored_only=True)
    assert CYCLE_STATE - state == set(), "state the front door uses that uvicorn's cycle no longer sets"
    for name, expected in CYCLE_METHODS.items():
        assert callable(getattr(RequestResponseCycle, name, None)), f"RequestResponseCycle.{name} is gone"
        assert params(getattr(RequestResponseCycle, name)) == expected, f"RequestResponseCycle.{name} changed"
    assert {408, 503, 200, 413} <= set(httptools_impl.STATUS_LINE)
    assert httptools_impl.STATUS_LINE[408] == b"HTTP/1.1 408 Request Timeout\r\n"


def test_flow_control_server_state_and_config_keep_what_the_front_door_uses() -> None:
    assert FLOW_METHODS <= {n for n in dir(FlowControl) if callable(getattr(FlowControl, n))}
    assert FLOW_STATE <= self_attributes(class_ast(FlowControl), stored_only=True)
    assert SERVER_STATE <= set(vars(ServerState()))
    assert CONFIG_KEYWORDS - {"app"} <= set(inspect.signature(uvicorn.Config.__init__).parameters)
    assert "app" in inspect.signature(uvicorn.Config.__init__).parameters
    assert params(uvicorn.Server.__init__) == [("self", P, False), ("config", P, False)]
    from uvicorn.supervisors import Multiprocess

    assert params(Multiprocess.__init__) == [("self", P, False), ("config", P, False), ("sockets", P, False)]


def test_a_config_carries_the_front_door_protocol_through_load(settings) -> None:  # noqa: ANN001
    async def app(scope: object, receive: object, send: object) -> None:
        return None

    config = frontdoor.uvicorn_config(app, "127.0.0.1", 0)
    config.load()
    assert config.http_protocol_class is frontdoor.FrontDoorProtocol
    assert config.access_log is False and config.limit_concurrency == settings.FERRY_MAX_CONCURRENCY


def test_everything_the_protocol_subclass_touches_is_listed_or_its_own() -> None:
    ours = class_ast(frontdoor.FrontDoorProtocol)
    uvicorns = PROTOCOL_STATE | set(PROTOCOL_METHODS)
    own = own_state(ours) - uvicorns
    touched = self_attributes(ours) | super_calls(ours)
    assert touched - uvicorns - own == set(), "uvicorn names the front door uses that this guard does not list"
    # and what it adds does not shadow anything of uvicorn's by accident (a hook it means to override is listed)
    assert own & set(dir(HttpToolsProtocol)) == set()
    assert own & self_attributes(class_ast(HttpToolsProtocol), stored_only=True) == set()


def test_everything_the_cycle_subclass_touches_is_listed() -> None:
    ours = class_ast(frontdoor.LeanCycle)
    touched = self_attributes(ours) | super_calls(ours) | defined_methods(ours)
    assert touched - CYCLE_STATE - set(CYCLE_METHODS) == set()


@pytest.mark.parametrize(
    "method",
    # uvicorn's methods that run with a Lane as `self.cycle` (or the previous cycle): shutdown, connection_lost
    # (called through super()), and on_headers_complete (a Lane may be the request before); the others the
    # front door either overrides whole or calls only for uvicorn's own cycles.
    ["shutdown", "connection_lost", "on_headers_complete"],
)
def test_a_lane_has_every_cycle_attribute_uvicorns_protocol_reads_on_it(method: str) -> None:
    function = next(n for n in class_ast(HttpToolsProtocol).body if getattr(n, "name", None) == method)
    read = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute | ast.Name):
            holder = node.value
            on_cycle = (isinstance(holder, ast.Attribute) and holder.attr == "cycle") or (
                isinstance(holder, ast.Name) and holder.id == "existing_cycle"
            )
            if on_cycle:
                read.add(node.attr)
    lane = set(dir(frontdoor.Lane)) | self_attributes(class_ast(frontdoor.Lane), stored_only=True)
    assert read - lane == set(), f"uvicorn's {method} reads, on a cycle, what a Lane lacks"
    assert read <= CYCLE_STATE | set(CYCLE_METHODS)


# The inference socket's protocol (`frontdoor.FrontDoorWebSocket`) subclasses uvicorn's websockets-sansio protocol
# and swaps its connection for a subclass of websockets' ServerProtocol (`frontdoor._FirstMessageBound`): what
# either reads, writes, overrides or calls of theirs, listed as above. websockets is pinned in pyproject.toml too.
WS_PROTOCOL_STATE = {"conn", "response", "scope", "transport", "close_sent", "queue", "handshake_complete"}
WS_PROTOCOL_METHODS: dict[str, list[tuple[str, object, bool]]] = {
    "__init__": PROTOCOL_METHODS["__init__"],
    "handle_connect": [("self", P, False), ("event", P, False)],
    "handle_parser_exception": [("self", P, False)],
    "send": [("self", P, False), ("message", P, False)],
}
WS_CONNECTION_STATE = {"max_message_size", "close_sent", "available_extensions", "logger"}
WS_CONNECTION_METHODS = {"recv_frame": [("self", P, False), ("frame", P, False)]}
WS_CONNECTION_KEYWORDS = {"extensions", "max_size", "logger"}


def test_websockets_is_pinned_to_the_version_checked_here() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in dependencies if re.match(r"websockets\b", d)] == [f"websockets=={websockets.__version__}"]


def test_the_websocket_protocol_and_connection_keep_what_the_front_door_uses() -> None:
    state = self_attributes(class_ast(WebSocketsSansIOProtocol), stored_only=True)
    assert WS_PROTOCOL_STATE - state == set(), "state the socket uses that uvicorn's protocol no longer sets"
    for name, expected in WS_PROTOCOL_METHODS.items():
        assert params(getattr(WebSocketsSansIOProtocol, name)) == expected, f"{name} changed signature"
    stored = self_attributes(class_ast(Protocol), stored_only=True) | self_attributes(
        class_ast(ServerProtocol), stored_only=True
    )
    assert WS_CONNECTION_STATE - stored == set(), "state the socket uses that websockets' protocol no longer sets"
    for name, expected in WS_CONNECTION_METHODS.items():
        assert params(getattr(ServerProtocol, name)) == expected, f"ServerProtocol.{name} changed signature"
    assert WS_CONNECTION_KEYWORDS <= set(inspect.signature(ServerProtocol.__init__).parameters)


def test_everything_the_websocket_subclasses_touch_is_listed_or_their_own() -> None:
    for ours, base, listed in (
        (frontdoor.FrontDoorWebSocket, WebSocketsSansIOProtocol, WS_PROTOCOL_STATE | set(WS_PROTOCOL_METHODS)),
        (frontdoor._FirstMessageBound, ServerProtocol, WS_CONNECTION_STATE | set(WS_CONNECTION_METHODS) | {"__init__"}),
    ):
        tree = class_ast(ours)
        own = own_state(tree) - listed
        touched = self_attributes(tree) | super_calls(tree)
        assert touched - listed - own == set(), f"{ours.__name__} uses names of its base this guard does not list"
        assert own & set(dir(base)) == set(), f"{ours.__name__} shadows names of its base by accident"
