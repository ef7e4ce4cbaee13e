"""`make run`'s first step: fail at once, naming the setting to change, where the HTTP or gRPC port is taken,
rather than after minutes of set-up and training with uvicorn's or gRPC's bare "address already in use".
Usage: free_ports.py HOST HTTP_PORT GRPC_HOST GRPC_PORT (a port of 0 is off: not checked). Standard library
only: it runs before the virtualenv exists."""

from __future__ import annotations

import socket
import sys


def taken(host: str, port: int) -> str | None:
    """Why `port` cannot be bound on `host` (as the server would bind it), or None where it can."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"{host} does not resolve ({exc.strerror})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and gRPC bind
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def main(argv: list[str]) -> int:
    host, http_port, grpc_host, grpc_port = argv
    problems = []
    if int(http_port) and http_port == grpc_port:
        problems.append(f"PORT and GRPC_PORT are both {http_port}: give gRPC another with GRPC_PORT")
    for what, setting, bind_host, port in (
        ("HTTP", "PORT", host, int(http_port)),
        ("gRPC", "GRPC_PORT (FERRY_GRPC_PORT; 0 turns gRPC off)", grpc_host, int(grpc_port)),
    ):
        if port == 0:
            continue
        why = taken(bind_host, port)
        if why:
            problems.append(f"the {what} port {bind_host}:{port} cannot be bound ({why}): choose another, {setting}")
    for problem in problems:
        print(f"make run: {problem}", file=sys.stderr)
    if problems:
        print("  e.g. make run PORT=8080 GRPC_PORT=8081", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
