"""A password hasher for the test processes: production's PBKDF2-SHA256 at a thousandth of its iterations.

A hash costs about 0.3 s on this machine at Django's default iterations, and the suite creates and logs in
users by the hundred. The encoded hash names its algorithm and iteration count, so the server processes a
test starts (which run production's hashers) verify these hashes as they are, at the count stored."""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class QuickPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    iterations = 1_000
