"""Regenerate the Python code of the vendored protos (proto/, from triton-inference-server/common, BSD-3-Clause:
proto/LICENSE) with grpcio-tools: `python -m serving.dataplane.grpc.generate`.

The generated modules are checked in (proto/*_pb2*.py) so that serving needs only grpcio and protobuf;
tests/test_grpc_codec.py regenerates them into a temporary folder and checks they are what is checked in.
protoc writes `import model_config_pb2` (the protos import each other by bare file name); the modules live in
a package here, so that import is made relative.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent / "proto"
PROTOS = ("model_config.proto", "grpc_service.proto")
_BARE_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def generate(out: Path) -> list[Path]:
    """Write the generated modules into `out`; their paths."""
    from grpc_tools import protoc  # a build-time tool, not a serving dependency

    with tempfile.TemporaryDirectory() as raw:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={raw}", f"--grpc_python_out={raw}", *PROTOS]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + " ".join(PROTOS))
        written = []
        for path in sorted(Path(raw).glob("*.py")):
            text = _BARE_IMPORT.sub(r"from . import \1 as \2", path.read_text())
            target = out / path.name
            target.write_text(text)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(PROTO_DIR):
        sys.stdout.write(f"wrote {path}\n")
