"""The pipelines' REST API: /api/pipelines/ (serving.pipelines registers; serving.policies.pipeline checks).

Reading shows the pipelines the caller may see (its tenants', public and platform ones). Registering one, or
a new version of one (POST again with the same name, or PUT), needs the engineer role in the owning tenant,
and the admin role to make it public. A graph whose steps do not connect is a 422 naming the step and the
tensor; a step whose model the tenant may not see reads exactly as one that does not exist.
"""

from __future__ import annotations

from django.db.models import Q, QuerySet
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status
from rest_framework.exceptions import APIException, PermissionDenied
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response

from serving.api.serializers import ModelNameField, OwnerField, TextField
from serving.api.views import errors, name_parameter, owner_by_default
from serving.models import MODEL_NAME_PATTERN, PIPELINE_VISIBILITIES, Pipeline, Visibility
from serving.pipelines import (
    KEEP,
    PipelineRegistrationError,
    current_settings,
    delete_pipeline,
    redact_spec,
    register_pipeline,
    step_models,
)
from tenants.models import Role, has_role
from tenants.scoping import TenantScopedViewSet, member_tenant_ids, visible_models, visible_tenants

SWITCH_EXAMPLE = {
    "name": "digits-cascade",
    "visibility": "private",
    "fallback": "digits-small",
    "spec": {
        "sequence": [
            {"model": "digits-small", "name": "small"},
            {
                "switch": {"tensor": "scores", "reduce": "max_softmax", "op": "<", "value": 0.9},
                "then": {"model": "digits", "name": "big"},
            },
        ]
    },
}


UNRESOLVED = object()  # a body's tenant that is not one of the caller's: the validation answers it


class PipelineRefused(APIException):
    def __init__(self, error: PipelineRegistrationError) -> None:
        super().__init__(error.message)
        self.status_code = error.status


class TensorSerializer(serializers.Serializer):
    name = serializers.CharField()
    datatype = serializers.CharField()
    shape = serializers.ListField(child=serializers.IntegerField())


class PipelineVersionSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    spec = serializers.JSONField(
        help_text="the graph (serving.policies.pipeline); a step whose model the caller may not see has `model`"
        " null (and a step named after it, no name)"
    )
    inputs = TensorSerializer(many=True, help_text="the request's tensors, derived from what the steps read")
    outputs = TensorSerializer(many=True, help_text="the root node's response")
    created_at = serializers.DateTimeField()


class PipelineSerializer(serializers.Serializer):
    """A pipeline and its versions; writing one registers its next version."""

    name = ModelNameField(help_text="served at /v2/models/{name}/infer; no model may have it")
    tenant = OwnerField(allow_null=True, required=False)
    visibility = serializers.ChoiceField(
        choices=PIPELINE_VISIBILITIES,
        required=False,
        help_text="private (its tenant's) or public; left out, a new version keeps the pipeline's (a new one: private)",
    )
    description = TextField(required=False, allow_blank=True, default="")
    fallback = ModelNameField(
        required=False,
        allow_null=True,
        help_text="a model with the pipeline's signature (a public pipeline's must be public); null too when the"
        " caller may not see it (then `fallback_hidden` is true); left out, a new version keeps the pipeline's,"
        " null removes it",
    )
    # An object, as the schema says (a JSONField would admit null or a list): its graph is checked on registration.
    spec = serializers.DictField(write_only=True, help_text="the graph of the new version (serving.policies.pipeline)")
    latest = serializers.SerializerMethodField(help_text="the version unpinned requests run")
    versions = serializers.SerializerMethodField()

    fallback_hidden = serializers.SerializerMethodField(
        help_text="true when the pipeline has a fallback the caller may not see: `fallback` is null then"
    )

    def get_latest(self, instance: Pipeline) -> int | None:
        return max((v.version for v in instance.versions.all()), default=None)

    @extend_schema_field(PipelineVersionSerializer(many=True))
    def get_versions(self, instance: Pipeline) -> list[dict]:
        rows = sorted(instance.versions.all(), key=lambda v: v.version)
        data = PipelineVersionSerializer(rows, many=True).data
        hidden = self._hidden(set().union(*(step_models(row.spec) for row in rows)))
        if hidden:  # a step's model made private since, or unshared: its name is its tenant's business
            for item in data:
                item["spec"] = redact_spec(item["spec"], hidden)
        return data

    def get_fallback_hidden(self, instance: Pipeline) -> bool:
        return instance.fallback is not None and bool(self._hidden({instance.fallback.name}))

    def _hidden(self, names: set[str]) -> set[str]:
        """Those of `names` that are not models the caller sees (cached for a list's rows)."""
        seen = self.context.setdefault("model_seen", {})
        unknown = names - set(seen)
        if unknown:
            request = self.context.get("request")
            visible = set(
                visible_models(getattr(request, "user", None)).filter(name__in=unknown).values_list("name", flat=True)
            )
            seen.update({name: name in visible for name in unknown})
        return {name for name in names if not seen[name]}

    def to_representation(self, instance: Pipeline) -> dict:
        hidden = self.get_fallback_hidden(instance)
        return {
            "name": instance.name,
            "tenant": instance.tenant.slug if instance.tenant else None,
            "visibility": instance.visibility,
            "description": instance.description,
            "fallback": instance.fallback.name if instance.fallback and not hidden else None,
            "fallback_hidden": hidden,
            "latest": self.get_latest(instance),
            "versions": self.get_versions(instance),
        }


def visible_pipelines(user: object, queryset: QuerySet | None = None) -> QuerySet:
    """The pipelines `user` may see: platform and public ones and its tenants' own (staff: all)."""
    queryset = Pipeline.objects.all() if queryset is None else queryset
    if not getattr(user, "is_authenticated", False):
        return queryset.none()
    if getattr(user, "is_staff", False):
        return queryset
    mine = member_tenant_ids(user)
    return queryset.filter(Q(tenant__isnull=True) | Q(visibility=Visibility.PUBLIC) | Q(tenant_id__in=mine))


_WRITE_ERRORS = errors(
    400,
    403,
    409,
    429,
    e409="The name is a model's, or another tenant's pipeline's.",
    e429="The owning tenant's quota is full: a pipeline counts as a model (max_models), each of its served"
    " versions as a version (max_versions). No Retry-After.",
)


@extend_schema_view(
    list=extend_schema(responses={200: PipelineSerializer(many=True), **errors(400, 403)}),
    create=extend_schema(
        request=PipelineSerializer,
        examples=[OpenApiExample("a cheap model, then the big one where it is unsure", value=SWITCH_EXAMPLE)],
        responses={
            201: PipelineSerializer,
            **_WRITE_ERRORS,
            422: errors(422, e422="The graph does not run: the message names the step and the tensor.")[422],
        },
    ),
    retrieve=extend_schema(
        parameters=[name_parameter("name")], responses={200: PipelineSerializer, **errors(403, 404)}
    ),
    update=extend_schema(
        parameters=[name_parameter("name")],
        responses={
            200: PipelineSerializer,
            **_WRITE_ERRORS,
            **errors(404),
            422: errors(422, e422="The graph does not run: the message names the step and the tensor.")[422],
        },
    ),
    destroy=extend_schema(parameters=[name_parameter("name")], responses={204: None, **errors(403, 404)}),
)
class PipelineViewSet(
    TenantScopedViewSet,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
):
    queryset = Pipeline.objects.select_related("tenant", "fallback").prefetch_related("versions")
    serializer_class = PipelineSerializer
    lookup_field = "name"
    lookup_value_regex = MODEL_NAME_PATTERN

    def scope(self, queryset: QuerySet) -> QuerySet:
        return visible_pipelines(self.request.user, queryset)

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        if request.method not in SAFE_METHODS and not has_role(request.user, Role.ENGINEER):
            raise PermissionDenied("changing the registry needs the engineer role")

    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        # The roles first, on the tenant the body names (among the caller's: any other is left to the
        # validation, which answers it as a tenant that does not exist), so a refused caller learns nothing
        # from validation errors.
        named = self._named_tenant(body)
        if named is not UNRESOLVED:
            self._require_roles(named, self._visibility(body, body.get("name"), named))
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        tenant = data["tenant"] if "tenant" in data else owner_by_default(request.user)
        row = self._register(data, tenant)
        return Response(self._answer(row.pipeline_id), status=status.HTTP_201_CREATED)

    def update(self, request: Request, *args: object, **kwargs: object) -> Response:
        pipeline = self.get_object()
        body = request.data if isinstance(request.data, dict) else {}
        # Before validation, as for a new pipeline.
        self._require_roles(pipeline.tenant, self._visibility(body, pipeline.name, pipeline.tenant))
        serializer = self.get_serializer(data={**body, "name": pipeline.name})
        serializer.is_valid(raise_exception=True)
        row = self._register(serializer.validated_data, pipeline.tenant)
        return Response(self._answer(row.pipeline_id))

    def perform_destroy(self, instance: Pipeline) -> None:
        self.require(Role.ENGINEER, instance.tenant_id, "deleting a pipeline")
        delete_pipeline(pipeline=instance, actor=self.request.user)

    def _named_tenant(self, body: dict) -> object:
        """The owner a new pipeline's body asks for, if it is one of the caller's tenants (or none: a platform
        pipeline, or the caller's only tenant by default); UNRESOLVED for anything else."""
        if "tenant" not in body:
            return owner_by_default(self.request.user)
        slug = body["tenant"]
        if slug is None:
            return None
        if not isinstance(slug, str):
            return UNRESOLVED
        found = visible_tenants(self.request.user).filter(slug=slug).first()
        return found if found is not None else UNRESOLVED

    @staticmethod
    def _visibility(body: dict, name: object, tenant: object) -> object:
        """The visibility the new version will have: the body's, else the pipeline's own (a new one: private),
        so a new version of a public pipeline, which every tenant then runs, needs the admin role too."""
        if "visibility" in body:
            return body["visibility"]
        if not isinstance(name, str):
            return Visibility.PRIVATE
        return current_settings(name, getattr(tenant, "pk", None))[0]

    def _require_roles(self, tenant: object, visibility: object) -> None:
        self.require(Role.ENGINEER, tenant, "registering a pipeline")  # type: ignore[arg-type]
        if visibility != Visibility.PRIVATE:
            self.require(Role.ADMIN, tenant, "making a pipeline visible to other tenants")  # type: ignore[arg-type]

    def _register(self, data: dict, tenant: object):  # noqa: ANN202
        self._require_roles(tenant, self._visibility(data, data["name"], tenant))
        try:
            return register_pipeline(
                name=data["name"],
                spec=data["spec"],
                tenant=tenant,
                visibility=data.get("visibility", KEEP),  # left out: the pipeline's own (register_pipeline)
                description=data.get("description", ""),
                fallback=data.get("fallback", KEEP),
                actor=self.request.user,
            )
        except PipelineRegistrationError as exc:
            raise PipelineRefused(exc) from None

    def _answer(self, pk: int) -> dict:
        fresh = Pipeline.objects.select_related("tenant", "fallback").prefetch_related("versions").get(pk=pk)
        return PipelineSerializer(fresh, context=self.get_serializer_context()).data
