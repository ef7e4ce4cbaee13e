from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    OpenApiRequest,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, PermissionDenied, UnsupportedMediaType
from rest_framework.parsers import BaseParser, JSONParser, MultiPartParser
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response

from rollout.api.serializers import NoteSerializer, PromotionRequestSerializer
from rollout.api.shadow import ShadowReportMixin
from rollout.models import PromotionRequest
from rollout.promotion import PromotionError, promote_or_request
from serving import model_names, quota_counts
from serving.actions import set_routing, set_visibility, sharing_state
from serving.api.serializers import (
    UPLOAD_JSON_PARTS,
    BatchingUpdateSerializer,
    ErrorSerializer,
    ModelSerializer,
    ModelVersionSerializer,
    PlacementUpdateSerializer,
    VersionUploadSerializer,
)
from serving.errors import RegistrationError
from serving.models import (
    BATCHING_FIELDS,
    MODEL_NAME_PATTERN,
    PLACEMENT_FIELDS,
    Model,
    ModelVersion,
    Pipeline,
    State,
    Visibility,
    lock_name,
)
from serving.publish import publish_snapshot
from serving.tasks import register_and_validate
from serving.validation import rename_refusal
from tenants import audit
from tenants.models import Role, Tenant, has_role
from tenants.scoping import TenantScopedViewSet, require, visible_models

FORM_OVERHEAD = 64 * 1024  # multipart boundaries and the other form fields
VERSION_PATTERN = r"[1-9][0-9]*"
MAX_VERSION = 2**31 - 1  # PositiveIntegerField; a larger number in the URL is a version that cannot exist

_ERRORS = {
    400: "The request is malformed; `fields` names each bad field or query parameter with its messages.",
    403: "Not logged in, or lacking the role the change needs in the tenant that owns the model (engineer;"
    " admin for visibility and sharing; platform staff for a platform model).",
    404: "No such model or version, or one the caller may not see.",
    409: "Conflicts with the registry's state.",
    413: "The request body is larger than the server accepts.",
    415: "The body is not of the content type the operation takes.",
    422: "The artifact is not a model the server can load.",
    429: "The owning tenant's quota is full (the message names it: max_models, max_versions). No"
    " Retry-After: waiting does not help; retire or delete something, or request an increase.",
}


def errors(*codes: int, **described: str) -> dict:
    """Documented error responses (the Error schema), each with its meaning for this operation."""
    return {
        code: OpenApiResponse(ErrorSerializer, description=described.get(f"e{code}", _ERRORS[code])) for code in codes
    }


def name_parameter(name: str) -> OpenApiParameter:
    return OpenApiParameter(
        name,
        {"type": "string", "pattern": f"^{MODEL_NAME_PATTERN}$", "maxLength": 100},
        OpenApiParameter.PATH,
        description="the model's name",
        examples=[OpenApiExample("the demo classifier", value="digits")],
    )


NAME = name_parameter("name")
VERSION_PARAMETER = OpenApiParameter(
    "version",
    {"type": "integer", "minimum": 1, "maximum": MAX_VERSION},
    OpenApiParameter.PATH,
    description="the version number",
    examples=[OpenApiExample("the first version", value=1)],
)


class RegistrationFailed(APIException):
    def __init__(self, error: RegistrationError) -> None:
        super().__init__(error.message)
        self.status_code = error.status


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "conflicts with the registry's state"


E409_RENAME = (
    "The new name is another model's or a pipeline's; or the tenant requires approval, the model has a stable"
    " version, and a model of the tenant gave that name up (deleted or renamed away)."
)


class RegistryViewSet(TenantScopedViewSet):
    """Reading needs a login and shows only the models the caller may see; changing one needs the
    engineer role in the tenant that owns it. A caller who is an engineer nowhere is refused before the
    request body is looked at, so a viewer learns nothing from validation errors."""

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        if request.method not in SAFE_METHODS and not has_role(request.user, Role.ENGINEER):
            raise PermissionDenied("changing the registry needs the engineer role")

    def check_object_permissions(self, request: Request, obj: object) -> None:
        super().check_object_permissions(request, obj)
        if request.method not in SAFE_METHODS:
            model = obj if isinstance(obj, Model) else obj.model  # type: ignore[attr-defined]
            self.require(Role.ENGINEER, model.tenant_id, "changing a model")


@extend_schema_view(
    list=extend_schema(responses={200: ModelSerializer(many=True), **errors(400, 403)}),
    create=extend_schema(
        responses={
            201: ModelSerializer,
            **errors(
                400,
                403,
                409,
                413,
                415,
                429,
                e409="The name is taken: by one of the caller's tenants' models ('exists"
                " already'), or not available (another tenant's, a pipeline's or reserved).",
            ),
        }
    ),
    retrieve=extend_schema(parameters=[NAME], responses={200: ModelSerializer, **errors(403, 404)}),
    update=extend_schema(
        parameters=[NAME], responses={200: ModelSerializer, **errors(400, 403, 404, 409, 413, 415, e409=E409_RENAME)}
    ),
    partial_update=extend_schema(
        parameters=[NAME], responses={200: ModelSerializer, **errors(400, 403, 404, 409, 413, 415, e409=E409_RENAME)}
    ),
    destroy=extend_schema(
        parameters=[NAME],
        responses={204: None, **errors(403, 404, 409, e409="The model has versions that are not retired.")},
    ),
)
class ModelViewSet(ShadowReportMixin, RegistryViewSet, viewsets.ModelViewSet):
    queryset = Model.objects.select_related("fallback", "tenant").prefetch_related("versions__replicas", "shared_with")
    serializer_class = ModelSerializer
    lookup_field = "name"
    lookup_value_regex = MODEL_NAME_PATTERN
    parser_classes = [JSONParser]

    def scope(self, queryset):  # noqa: ANN001, ANN201
        return visible_models(self.request.user, queryset)

    def perform_create(self, serializer: ModelSerializer) -> None:
        data = serializer.validated_data
        tenant = data["tenant"] if "tenant" in data else owner_by_default(self.request.user)
        self.require(Role.ENGINEER, tenant, "registering a model")
        serializer.validated_data["tenant"] = tenant
        self._save_named(serializer)

    def perform_update(self, serializer: ModelSerializer) -> None:
        self._save_named(serializer)

    def _save_named(self, serializer: ModelSerializer) -> None:
        data = serializer.validated_data
        sharing = {k: data.pop(k) for k in ("visibility", "shared_with") if k in data}
        shadow = {k: data.pop(k) for k in ("shadow_version", "shadow_fraction") if k in data}
        instance = serializer.instance
        if shadow and instance is None and (shadow.get("shadow_version") is not None or shadow.get("shadow_fraction")):
            raise serializers.ValidationError({"shadow_version": ["a new model has no versions to mirror to"]})
        if sharing and _changes_sharing(instance, sharing):
            tenant = instance.tenant if instance is not None else data["tenant"]
            self.require(Role.ADMIN, tenant, "changing who sees a model")
        if "shared_with" in sharing:
            # Looked up only now, after the role check: whether a slug names a tenant is told to those who
            # may share the model, not to an engineer guessing slugs.
            sharing["shared_with"] = _tenants(sharing["shared_with"])
        name = data.get("name")
        old_name = instance.name if instance is not None else None
        others = Model.objects.exclude(pk=instance.pk) if instance else Model.objects
        creating = instance is None
        if name is not None and others.filter(name=name).exists():
            raise Conflict(model_names.taken(self.request.user, name))
        try:
            with transaction.atomic():
                if name is not None and name != old_name:
                    # Orders this against a pipeline taking the name (serving.pipelines.register_pipeline).
                    lock_name(name)
                    if Pipeline.objects.filter(name=name).exists():
                        raise Conflict(model_names.not_available(name))
                    if instance is not None:
                        _check_rename(instance, name)
                model = serializer.save()
                if old_name is not None and model.name != old_name:
                    audit.record(
                        self.request.user,
                        "model.rename",
                        f"model {old_name}",
                        tenant=model.tenant,
                        before={"name": old_name, "model": model.pk},
                        after={"name": model.name},
                    )
                if sharing:
                    set_visibility(model=model, actor=self.request.user, **sharing)
                if shadow and instance is not None:
                    set_routing(model=model, actor=self.request.user, **shadow)
                    model.refresh_from_db()
                if creating:
                    quota_counts.check_new_model(model)
        except RegistrationError as exc:  # the owning tenant's max_models (429)
            raise RegistrationFailed(exc) from None
        except DjangoValidationError as exc:  # routing rules Model.clean refuses (set_routing)
            raise serializers.ValidationError(exc.message_dict) from None
        except IntegrityError:  # created by someone else since the check
            raise Conflict(model_names.taken(self.request.user, name)) from None

    def perform_destroy(self, instance: Model) -> None:
        """Delete the model once every version is retired, with its audit entry: the entry is also what
        makes a model of the same name, created later by the tenant, wait for an approval before its first
        version takes traffic where the tenant requires one (serving.validation.name_released)."""
        with transaction.atomic():
            model = Model.objects.select_for_update().get(pk=instance.pk)
            if model.versions.exclude(state=State.RETIRED).exists():
                raise Conflict("retire every version before deleting the model")
            audit.record(
                self.request.user,
                "model.delete",
                f"model {model.name}",
                tenant=model.tenant,
                before={
                    "model": model.pk,
                    **model.routing_state(),
                    **sharing_state(model),
                    "versions": sorted(model.versions.values_list("version", flat=True)),
                },
            )
            model.delete()


def _tenants(slugs: list[str]) -> list[Tenant]:
    """The tenants `slugs` name (400 naming the first that names none)."""
    found = list(Tenant.objects.filter(slug__in=set(slugs)))
    missing = sorted(set(slugs) - {t.slug for t in found})
    if missing:
        raise serializers.ValidationError({"shared_with": [f"no tenant {missing[0]!r}"]})
    return found


def _check_rename(model: Model, name: str) -> None:
    refusal = rename_refusal(model, name)
    if refusal is not None:
        raise Conflict(refusal)


def owner_by_default(user: object) -> object:
    """The tenant a new model belongs to when the request names none: the caller's only tenant; none
    (a platform model) for staff in no tenant."""
    tenants = [m.tenant for m in user.memberships.select_related("tenant")]  # type: ignore[attr-defined]
    if len(tenants) == 1:
        return tenants[0]
    if not tenants and getattr(user, "is_staff", False):
        return None
    raise serializers.ValidationError({"tenant": ["name the tenant that owns the model"]})


def _changes_sharing(model: Model | None, sharing: dict) -> bool:
    """Whether `sharing` (a visibility, slugs) differs from `model`'s; compared as slugs, before any is
    looked up."""
    if model is None:  # a new model: anything but the default, private and shared with nobody
        return sharing.get("visibility", Visibility.PRIVATE) != Visibility.PRIVATE or bool(sharing.get("shared_with"))
    if "visibility" in sharing and sharing["visibility"] != model.visibility:
        return True
    current = set(model.shared_with.values_list("slug", flat=True))
    return "shared_with" in sharing and set(sharing["shared_with"]) != current


def upload_target(user: object, name: str) -> Model | None:
    """The model an upload to `name` adds a version to, checked (engineer in its tenant), or None for a new
    one. A name another tenant's model uses (or a platform model's, or a pipeline's) is a conflict that does
    not say so, as when creating a model of that name. Django's door (serving.django_door) asks the same
    before it lets an upload's body up to the artifact limit."""
    existing = Model.objects.filter(name=name).first()
    if existing is None:
        if Pipeline.objects.filter(name=name).exists():
            raise Conflict(model_names.not_available(name))
        return None
    if not model_names.owns(user, existing):
        # Another tenant's model, private, public or a platform one: the same words for all, as when
        # creating a model of that name (serving.model_names).
        raise Conflict(model_names.not_available(name))
    require(user, Role.ENGINEER, existing.tenant_id, "adding a version to a model")
    return existing


@extend_schema(parameters=[name_parameter("model_name")])
@extend_schema_view(
    list=extend_schema(responses={200: ModelVersionSerializer(many=True), **errors(400, 403, 404)}),
    retrieve=extend_schema(parameters=[VERSION_PARAMETER], responses={200: ModelVersionSerializer, **errors(403, 404)}),
)
class ModelVersionViewSet(RegistryViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    serializer_class = ModelVersionSerializer
    lookup_field = "version"
    lookup_value_regex = VERSION_PATTERN

    def get_parsers(self) -> list[BaseParser]:
        # An upload is multipart only (the artifact is a file part); the batching PATCH is JSON.
        method = getattr(getattr(self, "request", None), "method", "") or ""
        if self.action_map.get(method.lower()) == "create":
            return [MultiPartParser()]
        return [JSONParser()]

    queryset = ModelVersion.objects.select_related("model").prefetch_related("replicas")

    def scope(self, queryset):  # noqa: ANN001, ANN201
        models = visible_models(self.request.user).filter(name=self.kwargs["model_name"])
        return queryset.filter(model__in=models)

    def visible_model(self) -> Model:
        model = visible_models(self.request.user).filter(name=self.kwargs["model_name"]).first()
        if model is None:
            raise NotFound(f"unknown model '{self.kwargs['model_name']}'")
        return model

    def list(self, request: Request, *args: object, **kwargs: object) -> Response:
        self.visible_model()
        return super().list(request, *args, **kwargs)

    @extend_schema(
        request={
            "multipart/form-data": OpenApiRequest(
                VersionUploadSerializer,
                encoding={part: {"contentType": "application/json"} for part in UPLOAD_JSON_PARTS},
            )
        },
        responses={
            201: ModelVersionSerializer,
            **errors(
                400,
                403,
                404,
                409,
                413,
                415,
                422,
                429,
                e400="The form is malformed or inconsistent (signature, batching settings, `sha256` of the upload,"
                " a tenant the caller is not in), or the new model's tenant is ambiguous.",
                e404="No endpoint: the model name in the path is not a valid name.",
                e409="A model of that name belongs to another tenant (or is reserved), or a pipeline has the name:"
                " the name is not available.",
                e413="The artifact exceeds the upload limit (FERRY_MAX_ARTIFACT_BYTES).",
            ),
        },
    )
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Upload an artifact as the model's next version (creating the model if new); validation follows."""
        # Who may upload to this name is settled before the body is read (up to the artifact limit): an
        # existing model's owner and role, a name a pipeline holds. A new model's tenant is named in the form,
        # so that check waits for it (the caller is an engineer somewhere: RegistryViewSet.initial).
        existing = upload_target(request.user, self.kwargs["model_name"])
        # Refuse an oversized upload before Django spools it to disk; the store checks again while hashing.
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > settings.FERRY_MAX_ARTIFACT_BYTES + FORM_OVERHEAD:
            raise RegistrationFailed(
                RegistrationError(f"artifact exceeds the {settings.FERRY_MAX_ARTIFACT_BYTES} byte limit", 413)
            )
        if not request.content_type.startswith("multipart/form-data"):
            raise UnsupportedMediaType(
                request.content_type, "an upload is multipart/form-data, with the artifact as a file part"
            )
        form = VersionUploadSerializer(data=request.data, context=self.get_serializer_context())
        form.is_valid(raise_exception=True)
        data = dict(form.validated_data)
        artifact = data.pop("artifact")
        tenant = self._upload_owner(data.pop("tenant", None), existing)
        try:
            version = register_and_validate(
                model_name=self.kwargs["model_name"],
                artifact_file=artifact,
                fmt=data.pop("format"),
                inputs=data.pop("inputs"),
                outputs=data.pop("outputs"),
                sha256=data.pop("sha256", None),
                task=data.pop("task", None),
                description=data.pop("description", None),
                tenant=tenant,
                owner_only=True,  # the model found above (or none) is still the one, or the name is taken
                **data,
            )
        except RegistrationError as exc:
            raise RegistrationFailed(exc) from None
        version.refresh_from_db()
        return Response(ModelVersionSerializer(version).data, status=status.HTTP_201_CREATED)

    def _upload_owner(self, named: object, existing: Model | None) -> object:
        """The tenant of the model the upload goes to: the existing model's, or for a new model the one
        named or the caller's only one (checked: engineer there)."""
        name = self.kwargs["model_name"]
        if existing is None:
            tenant = named if named is not None else owner_by_default(self.request.user)
            self.require(Role.ENGINEER, tenant, "registering a model")
            return tenant
        if named is not None and named.pk != existing.tenant_id:
            raise serializers.ValidationError({"tenant": [f"model {name!r} belongs to another tenant"]})
        return existing.tenant

    @extend_schema(
        parameters=[VERSION_PARAMETER],
        request=BatchingUpdateSerializer,
        responses={
            200: ModelVersionSerializer,
            **errors(
                400,
                403,
                404,
                413,
                415,
                e400="A setting is malformed, unknown, or the settings together are not servable"
                " (e.g. a preferred batch size above max_batch_size).",
            ),
        },
    )
    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Change the version's batching settings and response cache; the data plane picks them up once committed."""
        found = self.get_object()  # 404 and 403 before the body's validation says anything
        form = BatchingUpdateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        changes = form.validated_data
        with transaction.atomic():
            version = ModelVersion.objects.select_for_update().get(pk=found.pk)
            for field, value in changes.items():
                setattr(version, field, value)
            others = [f.name for f in ModelVersion._meta.concrete_fields if f.name not in BATCHING_FIELDS]
            try:
                version.full_clean(exclude=others, validate_unique=False, validate_constraints=False)
            except DjangoValidationError as exc:
                raise serializers.ValidationError(exc.message_dict) from None
            if changes:
                version.updated_at = timezone.now()
                # update(), not save(): the registry signal would publish a second snapshot for the same change.
                ModelVersion.objects.filter(pk=version.pk).update(
                    updated_at=version.updated_at, **{f: getattr(version, f) for f in changes}
                )
                transaction.on_commit(publish_snapshot)
        return Response(ModelVersionSerializer(version).data)

    @extend_schema(
        parameters=[VERSION_PARAMETER],
        request=PlacementUpdateSerializer,
        responses={
            200: ModelVersionSerializer,
            **errors(
                400,
                403,
                404,
                413,
                415,
                e400="A setting is malformed or unknown.",
            ),
        },
    )
    @action(detail=True, methods=["patch"])
    def placement(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Change the version's placement constraints (minimum device memory, allowed accelerator types) and
        what keeps it loaded (pinned, minimum replicas). A version found unschedulable is judged again on
        the new constraints. Audited; the data plane picks the change up once committed."""
        from tenants import audit

        found = self.get_object()  # 404 and 403 before the body's validation says anything
        form = PlacementUpdateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        changes = form.validated_data
        with transaction.atomic():
            version = ModelVersion.objects.select_for_update().select_related("model").get(pk=found.pk)
            before = {f: getattr(version, f) for f in PLACEMENT_FIELDS}
            for field, value in changes.items():
                setattr(version, field, value)
            after = {f: getattr(version, f) for f in PLACEMENT_FIELDS}
            if after != before:
                version.unschedulable_reason = ""
                version.updated_at = timezone.now()
                # update(), not save(): the registry signal would publish a second snapshot for the same change.
                ModelVersion.objects.filter(pk=version.pk).update(
                    updated_at=version.updated_at, unschedulable_reason="", **after
                )
                audit.record(
                    request.user,
                    "version.placement",
                    f"model {version.model.name} version {version.version}",
                    tenant=version.model.tenant,
                    before=before,
                    after=after,
                )
                transaction.on_commit(publish_snapshot)
        return Response(ModelVersionSerializer(version).data)

    @extend_schema(
        parameters=[VERSION_PARAMETER],
        request=None,
        responses={
            200: ModelVersionSerializer,
            **errors(
                403,
                404,
                409,
                e409="The version is the model's stable version and another version is ready: promote that one first.",
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def retire(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Retire the version: it stops serving and is left out of the routing snapshot. The stable version
        retires only when no other version is ready to take its traffic by promotion."""
        version = self.get_object()
        model = version.model
        if (
            model.stable_version == version.version
            and model.versions.filter(state=State.READY).exclude(pk=version.pk).exists()
        ):
            raise Conflict(
                f"version {version.version} is the stable version of '{model.name}': promote another"
                " version before retiring it"
            )
        version.retire(actor=request.user)
        return Response(ModelVersionSerializer(version).data)

    @extend_schema(
        parameters=[VERSION_PARAMETER],
        request=NoteSerializer,
        responses={
            200: ModelSerializer,
            202: OpenApiResponse(
                PromotionRequestSerializer,
                description=(
                    "The tenant requires approval: a promotion request is filed for an approver"
                    " (/api/promotion-requests/); the stable version has not changed."
                ),
            ),
            **errors(
                400,
                403,
                404,
                409,
                413,
                415,
                e400="The note is malformed.",
                e409="The version is not ready (registered, validating, failed or retired)"
                " or stable already, a rollout of the model is active (it promotes"
                " through its gates and approval), or a promotion request of the"
                " model is pending.",
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Make the version the model's stable version: unpinned traffic goes to it (ending any rollout
        weights); tenant-specific versions and experiment arms stay. Needs the engineer role in the owning
        tenant. Where the tenant's promotion policy is "approval required" this files a promotion request
        instead (202), and the version becomes stable when an approver accepts it. Refused (409) while a
        rollout of the model is active."""
        version = self.get_object()
        form = NoteSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            done = promote_or_request(
                model=version.model,
                version=version.version,
                actor=request.user,
                note=form.validated_data.get("note", ""),
            )
        except PromotionError as exc:
            raise RegistrationFailed(RegistrationError(exc.message, exc.status)) from None
        if isinstance(done, PromotionRequest):
            return Response(PromotionRequestSerializer(done).data, status=status.HTTP_202_ACCEPTED)
        return Response(ModelSerializer(done, context=self.get_serializer_context()).data)
