"""No secret a URL carries is ever shown (issue 24, item 11), every command reads a URL the
same way (item 12), and a file:// URL ckptstore prints opens the store it names (item 18).

Each secret-bearing form of a URL goes through every command of the ``ckptstore`` CLI, with
and without ``--json``, on a real moto S3 server where the form names its bucket; the secret
must appear nowhere: stdout, stderr, report files, nor any log record down to DEBUG (the
library's and its clients'). The public API's errors are checked alike.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import traceback
from urllib.parse import quote

import pytest

import ckptstore
from ckptstore.cli import build_parser, main
from ckptstore.errors import CkptStoreError, InvalidOptionError
from ckptstore.redaction import has_password, redact
from ckptstore.tools.embedded import EmbeddedS3
from ckptstore.urls import file_url, parse_url

# Secrets with a '/' and a '+' (as AWS and Azure keys have) and one percent-encoded.
FORMS: dict[str, tuple[str, str]] = {
    "s3 userinfo": (
        "s3://AKIAEXAMPLEKEYID:S3UserinfoSecret0@{bucket}/{prefix}?{moto}",
        "S3UserinfoSecret0",
    ),
    "s3 userinfo with a slash": (
        "s3://AKIAEXAMPLEKEYID:wJalrXUtnFEMI/S3SlashSecret0@{bucket}/{prefix}?{moto}",
        "S3SlashSecret0",
    ),
    "s3 token as user name": (
        "s3://S3UserTokenSecret0@{bucket}/{prefix}?{moto}",
        "S3UserTokenSecret0",
    ),
    "fsspec+s3 userinfo": (
        "fsspec+s3://AKIAEXAMPLEKEYID:FsspecUserinfoSecret0@{bucket}/{prefix}"
        "?endpoint_url={endpoint}",
        "FsspecUserinfoSecret0",
    ),
    "az userinfo": ("az://container:AzUserinfoSecret0@account/run", "AzUserinfoSecret0"),
    "abfss userinfo": (
        "abfss://container:AbfsUserinfoSecret0@account.dfs.core.windows.net/run",
        "AbfsUserinfoSecret0",
    ),
    "az SAS query": (
        "az://container@account.blob.core.windows.net/run?sv=2022-11-02&ss=b&srt=co"
        "&sp=rwdlac&se=2030-01-01T00%3A00%3A00Z&spr=https&sig=AzSasSignature0%2Bx%3D",
        "AzSasSignature0",
    ),
    "s3 presigned query": (
        "s3://{bucket}/{prefix}?{moto}&X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLEKEYID%2F20260101%2Fus-east-1%2Fs3%2Faws4_request"
        "&X-Amz-Date=20260101T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
        "&X-Amz-Security-Token=S3SessionTokenSecret0&X-Amz-Signature=S3PresignedSignature0",
        "S3PresignedSignature0",
    ),
    "gs token query": ("gs://bucket-name/run?token=GcsTokenSecret0", "GcsTokenSecret0"),
    "fsspec+gcs token query": (
        "fsspec+gcs://bucket-name/run?token=FsGcsTokenSecret0",
        "FsGcsTokenSecret0",
    ),
    "s3 endpoint_url userinfo": (
        "s3://{bucket}/{prefix}?endpoint_url=http://user:S3EndpointSecret0@{hostport}"
        "&region=us-east-1&addressing_style=path",
        "S3EndpointSecret0",
    ),
    "s3 endpoint_url userinfo, encoded": (
        "s3://{bucket}/{prefix}?endpoint_url="
        + quote("http://user:S3EncodedEndpointSecret0@", safe="")
        + "{hostport}&region=us-east-1&addressing_style=path",
        "S3EncodedEndpointSecret0",
    ),
    "gs endpoint_url userinfo": (
        "gs://bucket-name/run?endpoint_url=ftp://user:GcsEndpointSecret0@127.0.0.1:1",
        "GcsEndpointSecret0",
    ),
}

SECOND_SECRETS = {
    "s3 presigned query": "S3SessionTokenSecret0",
    "az SAS query": "AzSasSignature0+x=",
}
"""Forms with a second secret, which must not show either."""


def _commands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def _argvs(url: str, tmp) -> dict[str, list[list[str]]]:
    """Every command that takes a URL, with the arguments it needs (each also with --json)."""
    directory = tmp / "pushed"
    directory.mkdir(exist_ok=True)
    (directory / "weights.bin").write_bytes(b"x" * 100)
    return {
        "ls": [["ls", url]],
        "show": [["show", url], ["show", url, "1"]],
        "verify": [["verify", url], ["verify", url, "--all"]],
        "gc": [["gc", url], ["gc", url, "--dry-run", "--grace", "0s"]],
        "delete": [["delete", url, "1", "--force"]],
        "rollback": [["rollback", url, "1"]],
        "take-over": [["take-over", url, "1"], ["take-over", url, "--discard-history"]],
        "repair-epoch": [["repair-epoch", url, "1", "--parent", "1"]],
        "push": [["push", str(directory), url, "--step", "1"]],
        "pull": [["pull", url, "1", str(tmp / "pulled")]],
        "bench": [["bench", url, "--size", "1K", "--repeats", "1"]],
        "advise": [["advise", url], ["advise", url, "--mtbi", "6h"]],
        "lifecycle": [["lifecycle", url, "--days", "3"]],
        "conformance": [
            ["conformance", url, "--budget", "5", "--json-file", str(tmp / "report.json"),
             "--junit", str(tmp / "report.xml")],
            ["conformance", f"file://{tmp}/fast", "--replicate-to", url, "--budget", "5"],
        ],
    }  # fmt: skip


def _url(template: str, moto_s3: EmbeddedS3, prefix: str) -> str:
    endpoint = moto_s3.endpoint_url
    moto = f"endpoint_url={endpoint}&region=us-east-1&addressing_style=path"
    return template.format(
        bucket=moto_s3.bucket,
        prefix=prefix,
        moto=moto,
        endpoint=endpoint,
        hostport=endpoint.partition("://")[2],
    )


def _shown(secret: str) -> list[str]:
    """The forms a secret could be shown in: as written, and percent-decoded."""
    from urllib.parse import unquote

    return sorted({secret, unquote(secret)})


@pytest.fixture
def credentials(monkeypatch, moto_s3: EmbeddedS3) -> None:
    """The CLI signs in through the AWS credential chain, as an operator's shell does."""
    for name, value in moto_s3.credentials_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def test_every_command_is_covered(tmp_path) -> None:
    """A command added later must be added to the matrix below."""
    assert _commands() - {"demo", "keygen"} == set(_argvs("file:///x", tmp_path))  # no URL


@pytest.mark.parametrize("form", sorted(FORMS))
def test_no_command_shows_a_secret_of_the_url(
    form: str, moto_s3: EmbeddedS3, credentials, tmp_path, capsys, caplog
) -> None:
    template, secret = FORMS[form]
    url = _url(template, moto_s3, f"secrets/{os.getpid()}/{form.replace(' ', '-')}")
    secrets = _shown(secret) + _shown(SECOND_SECRETS.get(form, secret))
    caplog.set_level(logging.DEBUG)
    for argvs in _argvs(url, tmp_path).values():
        for argv in argvs:
            for words in (argv, [*argv, "--json"]):
                out = io.StringIO()
                status = main(words, out)
                captured = capsys.readouterr()
                shown = {
                    "stdout": out.getvalue() + captured.out,
                    "stderr": captured.err,
                    "logging": caplog.text + "".join(r.getMessage() for r in caplog.records),
                }
                for name in ("report.json", "report.xml"):
                    if (tmp_path / name).exists():
                        shown[name] = (tmp_path / name).read_text()
                caplog.clear()
                for where, text in shown.items():
                    for leaked in secrets:
                        assert leaked not in text, f"{words}: {where} shows it: {text[-600:]}"
                # Refused (2); the tiered conformance run reports a durable URL it cannot open
                # as a failed workload (1).
                assert status == 2 or (status == 1 and "--replicate-to" in words), (words, shown)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_no_error_of_the_api_shows_a_secret_of_the_url(
    form: str, moto_s3: EmbeddedS3, credentials, tmp_path, caplog
) -> None:
    template, secret = FORMS[form]
    url = _url(template, moto_s3, f"secrets-api/{os.getpid()}/{form.replace(' ', '-')}")
    secrets = _shown(secret) + _shown(SECOND_SECRETS.get(form, secret))
    caplog.set_level(logging.DEBUG)
    fast = f"file://{tmp_path}/fast"
    attempts = [
        lambda: ckptstore.open(url),
        lambda: ckptstore.open(url, create=False),
        lambda: ckptstore.open(fast, replicate_to=url, background=False),
        lambda: ckptstore.open(url, replicate_to=fast, background=False),
    ]
    if url.startswith("s3"):
        from ckptstore.backends.s3 import install_abort_incomplete_uploads_rule

        attempts.append(lambda: install_abort_incomplete_uploads_rule(url, days=3))
    for attempt in attempts:
        with pytest.raises(CkptStoreError) as raised:
            attempt()
        printed = "".join(traceback.format_exception(raised.value))  # the whole chain
        for text in (str(raised.value), repr(raised.value), printed, caplog.text):
            for leaked in secrets:
                assert leaked not in text, text


def test_redact_keeps_what_is_not_a_secret() -> None:
    assert redact("az://container@account.blob.core.windows.net/run") == (
        "az://container@account.blob.core.windows.net/run"
    )
    assert redact("s3://KEY:SEC/RET@bucket/run?region=x&sig=1: gone") == (
        "s3://KEY:***@bucket/run?region=x&sig=***: gone"
    )
    assert redact("see 'gs://b/p?token=t&epoch=3' and https://tok@host/x.") == (
        "see 'gs://b/p?token=***&epoch=3' and https://***@host/x."
    )
    assert redact("/bare/path?sig=kept, a name") == "/bare/path?sig=kept, a name"
    assert redact("file:///tmp/a@b/c%3Fd") == "file:///tmp/a@b/c%3Fd"
    assert redact("fsspec+http://host:8080/v@2?X-Amz-SignedHeaders=host") == (
        "fsspec+http://host:8080/v@2?X-Amz-SignedHeaders=host"
    )
    assert not has_password("fsspec+sftp://host:/path@v2")


# -- item 12: lifecycle reads its URL as every other command does ----------------------------


def _rules(moto_s3: EmbeddedS3) -> list[dict[str, object]]:
    client = moto_s3.client()
    try:
        return list(client.get_bucket_lifecycle_configuration(Bucket=moto_s3.bucket)["Rules"])
    except client.exceptions.ClientError as exc:
        if "NoSuchLifecycleConfiguration" not in str(exc):
            raise
        return []


@pytest.mark.parametrize(
    ("query", "kind"),
    [
        ("&aws_access_key_id={key}&aws_secret_access_key={secret}", "InvalidOptionError"),
        ("&aws_secret_access_key={secret}", "InvalidOptionError"),
        ("&bogus=1", "InvalidOptionError"),
        ("&concurrency=many", "InvalidOptionError"),
    ],
)
def test_lifecycle_refuses_what_ls_and_push_refuse(
    moto_s3: EmbeddedS3, credentials, tmp_path, capsys, query: str, kind: str
) -> None:
    url = moto_s3.url(f"lifecycle-parity/{os.getpid()}") + query.format(
        key=moto_s3.access_key, secret=moto_s3.secret_key
    )
    before = _rules(moto_s3)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.bin").write_bytes(b"a")
    errors = {}
    for argv in (
        ["lifecycle", url],
        ["ls", url],
        ["push", str(tmp_path / "dir"), url, "--step", "1"],
    ):
        out = io.StringIO()
        assert main([*argv, "--json"], out) == 2, argv
        errors[argv[0]] = json.loads(out.getvalue())
        assert "Traceback" not in capsys.readouterr().err
    assert {e["type"] for e in errors.values()} == {kind}, errors
    assert errors["lifecycle"]["error"] == errors["ls"]["error"] == errors["push"]["error"]
    assert _rules(moto_s3) == before  # nothing installed


def test_lifecycle_still_installs_its_rule_from_a_good_url(
    moto_s3: EmbeddedS3, credentials
) -> None:
    url = moto_s3.url(f"lifecycle-good/{os.getpid()}")
    out = io.StringIO()
    assert main(["lifecycle", url, "--days", "4", "--json"], out) == 0
    rule = json.loads(out.getvalue())
    assert rule["Filter"]["Prefix"] == f"lifecycle-good/{os.getpid()}/"
    assert rule in _rules(moto_s3)


@pytest.mark.parametrize(
    "given",
    [{"aws_secret_access_key": "x"}, {"aws_access_key_id": "x"}, {"aws_session_token": "x"}],
)
def test_half_an_access_key_is_an_option_error(moto_s3: EmbeddedS3, given) -> None:
    from ckptstore.backends.s3 import install_abort_incomplete_uploads_rule

    url = moto_s3.url(f"half-key/{os.getpid()}")
    options = {k: v for k, v in moto_s3.options.items() if not k.startswith("aws_")}
    for attempt in (
        lambda: install_abort_incomplete_uploads_rule(url, **options, **given),
        lambda: ckptstore.open(url, **options, **given),
    ):
        with pytest.raises(InvalidOptionError, match="together"):
            attempt()


# -- item 18: a file:// URL ckptstore prints opens the store it names -------------------------

AWKWARD = ["run?epoch=0", "run#1", "run%41", "100%", "a b", "new\nline", "tab\there", "?#%"]


@pytest.mark.parametrize("name", AWKWARD)
def test_a_printed_file_url_opens_the_same_store(tmp_path, name: str) -> None:
    root = tmp_path / name
    store = ckptstore.open(str(root))
    store.save(7, {"a.bin": b"seven"})
    assert parse_url(store.url).path == str(root)
    out = io.StringIO()
    assert main(["ls", str(root), "--json"], out) == 0
    printed = json.loads(out.getvalue())["url"]
    assert printed == store.url == file_url(str(root))
    again = ckptstore.open(printed, create=False)
    assert again.steps() == [7] and again.url == printed
    out = io.StringIO()
    assert main(["ls", printed, "--json"], out) == 0  # and the CLI reads it back
    assert [c["step"] for c in json.loads(out.getvalue())["checkpoints"]] == [7]


def test_a_replica_source_names_the_fast_store_it_came_from(tmp_path) -> None:
    fast = tmp_path / "fast?tier#1"
    store = ckptstore.open(str(fast), replicate_to=str(tmp_path / "durable"), background=False)
    try:
        store.save(3, {"a.bin": b"three"})
        store.wait_replicated()
    finally:
        store.close()
    source = ckptstore.open(str(tmp_path / "durable")).get(3).manifest.source
    assert source is not None
    assert parse_url(source.url).path == str(fast)


def test_conformance_reports_redact_the_urls_they_quote(tmp_path) -> None:
    """What a layer recorded quotes URLs and foreign errors as they were: every report format
    shows them redacted (the CLI writes these to stdout and to --json-file/--junit)."""
    from ckptstore.conformance.report import BackendReport, render_text, to_json, to_junit

    report = BackendReport(url="s3://b/run?endpoint_url=http://u:ReportSecret0@h", strategy="x")
    report.storage_error(("I1",), "GET s3://b/run/x?X-Amz-Signature=ReportSecret1: reset")
    report.layer_error("crash points", "storage error", "az://c:ReportSecret2@acct/run: gone")
    for render in (render_text, to_json, to_junit):
        text = render([report])
        assert "ReportSecret" not in text and "***" in text, (render, text)


@pytest.mark.parametrize("form", ["fsspec+s3 userinfo", "s3 presigned query", "az SAS query"])
def test_the_ckptstore_process_shows_no_secret(form: str, moto_s3: EmbeddedS3, tmp_path) -> None:
    """The command in a process of its own (its own logging handler and warning display)."""
    import subprocess
    import sys

    template, secret = FORMS[form]
    url = _url(template, moto_s3, f"secrets-process/{os.getpid()}")
    env = {**os.environ, **moto_s3.credentials_env(), "AWS_DEFAULT_REGION": "us-east-1"}
    for argv in (["ls", url], ["ls", url, "--json"], ["lifecycle", url, "--json"]):
        done = subprocess.run(
            [sys.executable, "-m", "ckptstore.cli", *argv],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done
        assert "Traceback" not in done.stderr
        for leaked in _shown(secret) + _shown(SECOND_SECRETS.get(form, secret)):
            assert leaked not in done.stdout + done.stderr, done


def test_a_client_cache_keys_on_the_environment_and_hashes_its_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckptstore.backends.client_cache import ClientCache

    cache: ClientCache[object] = ClientCache(
        ("endpoint",), ("SECRET_KEY",), disconnect=lambda client: None,
        environment=("ACCOUNT", "SECRET_KEY"),
    )  # fmt: skip
    monkeypatch.delenv("ACCOUNT", raising=False)
    monkeypatch.delenv("SECRET_KEY", raising=False)
    bare = cache.key({})
    monkeypatch.setenv("ACCOUNT", "one")
    one = cache.key({})
    monkeypatch.setenv("ACCOUNT", "two")
    assert len({bare, one, cache.key({})}) == 3  # each environment its own client
    monkeypatch.setenv("SECRET_KEY", "hunter2")
    keyed = cache.key({})
    assert "hunter2" not in repr(keyed) and keyed != cache.key({"endpoint": "x"})
