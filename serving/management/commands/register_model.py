import json

from django.core.management.base import BaseCommand, CommandError

from serving.actions import RegistrationError, register_version
from serving.models import ArtifactFormat, State, Task


def tensor(spec: str) -> dict:
    """NAME:DATATYPE:DIMS[:MAXDIMS], dims comma-separated with -1 for variable and MAXDIMS the same
    dims with each variable one's maximum, e.g. input:FP32:64 or tokens:INT64:-1:512 (default maximum 1024)"""
    try:
        name, datatype, dims, *rest = spec.split(":")
        shape = [int(d) for d in dims.split(",")] if dims else []
        if len(rest) > 1:
            raise ValueError
        maxima = [int(d) for d in rest[0].split(",")] if rest and rest[0] else None
    except ValueError:
        raise CommandError(
            f"tensor spec {spec!r} is not NAME:DATATYPE:DIMS[:MAXDIMS] (e.g. input:FP32:64, tokens:INT64:-1:512)"
        ) from None
    result: dict = {"name": name, "datatype": datatype, "shape": shape}
    if maxima is not None:
        result["max_shape"] = maxima
    return result


class Command(BaseCommand):
    help = "Register an artifact as the next version of a model and validate it now."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("name")
        parser.add_argument("artifact", help="path to a TorchScript archive or torch.export program")
        parser.add_argument("--format", required=True, choices=ArtifactFormat.values)
        parser.add_argument("--input", action="append", required=True, type=tensor, help=tensor.__doc__)
        parser.add_argument("--output", action="append", required=True, type=tensor)
        parser.add_argument("--task", choices=Task.values)
        parser.add_argument("--description")
        parser.add_argument("--sha256")
        parser.add_argument("--max-batch-size", type=int)
        parser.add_argument("--max-queue-delay-ms", type=float)
        parser.add_argument("--preferred-batch-sizes", type=lambda s: [int(x) for x in s.split(",") if x])
        parser.add_argument("--max-queue-size", type=int)
        parser.add_argument("--default-timeout-ms", type=int)
        parser.add_argument("--metrics", type=json.loads, help='JSON object, e.g. {"accuracy": 0.97}')

    def handle(self, *args: object, **o: object) -> None:
        try:
            with open(str(o["artifact"]), "rb") as f:
                version = register_version(
                    model_name=o["name"],
                    artifact_file=f,
                    fmt=o["format"],
                    inputs=o["input"],
                    outputs=o["output"],
                    sha256=o["sha256"],
                    task=o["task"],
                    description=o["description"],
                    metrics=o["metrics"],
                    validate="sync",
                    max_batch_size=o["max_batch_size"],
                    max_queue_delay_ms=o["max_queue_delay_ms"],
                    preferred_batch_sizes=o["preferred_batch_sizes"],
                    max_queue_size=o["max_queue_size"],
                    default_timeout_ms=o["default_timeout_ms"],
                )
        except OSError as exc:
            raise CommandError(f"cannot read {o['artifact']}: {exc}") from None
        except RegistrationError as exc:
            raise CommandError(exc.message) from None
        if version.state != State.READY:
            raise CommandError(f"{version} is {version.state}: {version.failure_reason}")
        profile = ", ".join(f"b{k}={v * 1000:.2f}ms" for k, v in version.latency_profile.items())
        self.stdout.write(f"{version} ready; sha256 {version.artifact_id}; latency {profile}")
