from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0006_tenant_share_response_cache"),
    ]

    operations = [
        migrations.AddField(
            model_name="quota",
            name="latency_budget_ms",
            field=models.PositiveIntegerField(
                blank=True,
                help_text="its requests' latency budget in ms, where lower than the platform's; empty: the platform's",
                null=True,
            ),
        ),
    ]
