"""gs:// and gs+versioned:// on a real fake-gcs-server (tests/conftest.py ``fake_gcs``)."""

from __future__ import annotations

from ckptstore.tools.embedded_gcs import EmbeddedGCS


def test_embedded_fake_gcs_serves_its_bucket(fake_gcs: EmbeddedGCS) -> None:
    client = fake_gcs.client()
    blob = client.bucket(fake_gcs.bucket).blob("embedded-smoke")
    blob.upload_from_string(b"x", if_generation_match=0)
    assert client.bucket(fake_gcs.bucket).blob("embedded-smoke").download_as_bytes() == b"x"
    assert (
        fake_gcs.versioned_bucket("smoke-versioned")
        .client()
        .get_bucket("smoke-versioned")
        .versioning_enabled
    )
    assert fake_gcs.environment()["STORAGE_EMULATOR_HOST"] == fake_gcs.endpoint_url
