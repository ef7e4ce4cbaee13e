"""limit/offset pagination that answers 400 for what its documented bounds rule out.

DRF's LimitOffsetPagination silently falls back to the default for a malformed or negative value and
passes a huge one to the database, which fails on it. Here each parameter is a decimal integer given at
most once, `limit` 1..MAX_LIMIT (default DEFAULT_LIMIT) and `offset` 0..MAX_OFFSET; anything else is a 400
naming the parameter. The OpenAPI parameters carry the same bounds.
"""

import re

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_OFFSET = 2**31 - 1
_DECIMAL = re.compile(r"[+-]?[0-9]+", re.ASCII)


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    default_limit = DEFAULT_LIMIT
    max_limit = MAX_LIMIT

    def get_limit(self, request: Request) -> int:
        return _bounded(request, self.limit_query_param, 1, MAX_LIMIT, DEFAULT_LIMIT)

    def get_offset(self, request: Request) -> int:
        return _bounded(request, self.offset_query_param, 0, MAX_OFFSET, 0)

    def get_schema_operation_parameters(self, view: object) -> list[dict]:
        return [
            {
                "name": self.limit_query_param,
                "required": False,
                "in": "query",
                "description": f"Number of results per page, 1..{MAX_LIMIT} (default {DEFAULT_LIMIT}).",
                "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
            },
            {
                "name": self.offset_query_param,
                "required": False,
                "in": "query",
                "description": f"Index of the first result, 0..{MAX_OFFSET} (default 0).",
                "schema": {"type": "integer", "minimum": 0, "maximum": MAX_OFFSET, "default": 0},
            },
        ]


def _bounded(request: Request, name: str, low: int, high: int, default: int) -> int:
    values = request.query_params.getlist(name)
    if not values:
        return default
    message = f"must be an integer from {low} to {high}, given once"
    if len(values) > 1 or not _DECIMAL.fullmatch(values[0]):
        raise ValidationError({name: [message]})
    value = int(values[0])
    if not low <= value <= high:
        raise ValidationError({name: [message]})
    return value
