from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0005_promotion_policy_shadow_samples"),
    ]

    operations = [
        migrations.AddField(
            model_name="tenant",
            name="share_response_cache",
            field=models.BooleanField(
                default=False,
                help_text="whether cached answers of public models may be shared with other tenants that opted in",
            ),
        ),
    ]
