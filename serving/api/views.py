from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, PermissionDenied
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response

from serving.actions import RegistrationError, register_version
from serving.api.serializers import ModelSerializer, ModelVersionSerializer, VersionUploadSerializer
from serving.models import Model, ModelVersion, State
from tenants.models import Role, has_role

FORM_OVERHEAD = 64 * 1024  # multipart boundaries and the other form fields


class RegistrationFailed(APIException):
    def __init__(self, error: RegistrationError) -> None:
        super().__init__(error.message)
        self.status_code = error.status


class EngineerWrites:
    """Reading needs a login; changing the registry needs the engineer role, checked before the
    request body is looked at so a viewer learns nothing from validation errors."""

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)  # type: ignore[misc]
        if request.method not in SAFE_METHODS and not has_role(request.user, Role.ENGINEER):
            raise PermissionDenied("changing the registry needs the engineer role")


class ModelViewSet(EngineerWrites, viewsets.ModelViewSet):
    queryset = Model.objects.select_related("fallback").prefetch_related("versions")
    serializer_class = ModelSerializer
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9][A-Za-z0-9_.-]*"

    def perform_destroy(self, instance: Model) -> None:
        if instance.versions.exclude(state=State.RETIRED).exists():
            raise RegistrationFailed(RegistrationError("retire every version before deleting the model", 409))
        instance.delete()


class ModelVersionViewSet(EngineerWrites, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                          mixins.CreateModelMixin, viewsets.GenericViewSet):
    serializer_class = ModelVersionSerializer
    lookup_field = "version"
    parser_classes = [MultiPartParser, FormParser, JSONParser]

    def get_queryset(self):  # noqa: ANN201
        return ModelVersion.objects.filter(model__name=self.kwargs["model_name"]).select_related("model")

    def list(self, request: Request, *args: object, **kwargs: object) -> Response:
        if not Model.objects.filter(name=self.kwargs["model_name"]).exists():
            raise NotFound(f"unknown model '{self.kwargs['model_name']}'")
        return super().list(request, *args, **kwargs)

    @extend_schema(request={"multipart/form-data": VersionUploadSerializer}, responses={201: ModelVersionSerializer})
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Upload an artifact as the model's next version (creating the model if new); validation follows."""
        # Refuse an oversized upload before Django spools it to disk; the store checks again while hashing.
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > settings.FERRY_MAX_ARTIFACT_BYTES + FORM_OVERHEAD:
            raise RegistrationFailed(
                RegistrationError(f"artifact exceeds the {settings.FERRY_MAX_ARTIFACT_BYTES} byte limit", 413)
            )
        form = VersionUploadSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        data = dict(form.validated_data)
        artifact = data.pop("artifact")
        try:
            version = register_version(
                model_name=self.kwargs["model_name"], artifact_file=artifact, fmt=data.pop("format"),
                inputs=data.pop("inputs"), outputs=data.pop("outputs"), sha256=data.pop("sha256", None),
                task=data.pop("task", None), description=data.pop("description", None), **data,
            )
        except RegistrationError as exc:
            raise RegistrationFailed(exc) from None
        version.refresh_from_db()
        return Response(ModelVersionSerializer(version).data, status=status.HTTP_201_CREATED)

    @action(detail=True, methods=["post"])
    def retire(self, request: Request, *args: object, **kwargs: object) -> Response:
        version = self.get_object()
        version.retire()
        return Response(ModelVersionSerializer(version).data)
