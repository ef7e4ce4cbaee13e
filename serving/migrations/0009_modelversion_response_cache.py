from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("serving", "0008_replica_cold_tier"),
    ]

    operations = [
        migrations.AddField(
            model_name="modelversion",
            name="response_cache",
            field=models.BooleanField(
                default=False,
                help_text="answer repeated identical requests from the gateway's response cache (Triton's"
                " response_cache); only for a deterministic model",
            ),
        ),
    ]
