import django.db.models.deletion
from django.db import migrations, models


def existing_models_public(apps, schema_editor) -> None:  # noqa: ANN001
    """Models registered before tenants existed stay visible to everyone: platform models, public."""
    Model = apps.get_model("serving", "Model")
    Model.objects.update(tenant=None, visibility="public")


class Migration(migrations.Migration):

    dependencies = [
        ("serving", "0001_initial"),
        ("tenants", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="model",
            name="tenant",
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name="models", to="tenants.tenant"),
        ),
        migrations.AddField(
            model_name="model",
            name="visibility",
            field=models.CharField(choices=[("private", "Private"), ("shared", "Shared"), ("public", "Public")], default="private", max_length=10),
        ),
        migrations.AddField(
            model_name="model",
            name="shared_with",
            field=models.ManyToManyField(blank=True, related_name="shared_models", to="tenants.tenant"),
        ),
        migrations.RunPython(existing_models_public, migrations.RunPython.noop),
    ]
