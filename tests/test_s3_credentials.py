"""The S3 source resolves credentials through boto3's chain, against moto's server with
IAM authentication enforced (every request after the test's set-up is checked against
the users and policies moto holds) for a named profile (AWS_PROFILE, a shared credentials
file: wrong keys are refused with 403, so a pass means the SDK found and used the right
ones), and a web-identity token file (AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN: STS
AssumeRoleWithWebIdentity at moto, as on EKS; the requests are seen signed with the
temporary credentials STS returned)."""

from __future__ import annotations

import json

import pytest

from metrale.adapters.object_store import S3Source
from metrale.errors import ObjectStoreError
from tests.helpers.moto_s3 import FILES, MotoS3
from tests.helpers.peers import adapter_dir

SETUP = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": ["s3:*", "iam:*"], "Resource": "*"}]})
AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
            "AWS_DEFAULT_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
            "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_ENDPOINT_URL_S3")


@pytest.fixture(scope="module")
def iam_moto(tmp_path_factory):
    """moto with IAM checks after 3 unauthenticated set-up calls: a user with a policy and
    its keys, then (signed with them) a bucket holding adapter a."""
    with MotoS3(tmp_path_factory.mktemp("moto") / "moto.log", auth_after=3) as moto:
        iam = moto.client_with("iam", AWS_ACCESS_KEY_ID="setup", AWS_SECRET_ACCESS_KEY="setup")
        iam.create_user(UserName="reader")
        keys = iam.create_access_key(UserName="reader")["AccessKey"]
        iam.put_user_policy(UserName="reader", PolicyName="setup", PolicyDocument=SETUP)
        signed = {"AWS_ACCESS_KEY_ID": keys["AccessKeyId"],
                  "AWS_SECRET_ACCESS_KEY": keys["SecretAccessKey"]}
        moto.client = moto.client_with(**signed)
        moto.client.create_bucket(Bucket="bucket")
        moto.put_adapter("bucket", "p/a", adapter_dir("a"))
        yield moto, signed


@pytest.fixture
def env(iam_moto, monkeypatch, tmp_path):
    """Only the endpoint and region from the environment: credentials are the test's."""
    moto, _ = iam_moto
    for key in AWS_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to look for
    return monkeypatch


def fetched(tmp_path) -> bool:
    found = S3Source("s3://bucket/p", tmp_path / "cache").find("a")
    return all((found.path / f).read_bytes() == (adapter_dir("a") / f).read_bytes() for f in FILES)


def test_a_named_profile_from_the_shared_credentials_file(iam_moto, env, tmp_path):
    _, keys = iam_moto
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[lora]\naws_access_key_id = {keys['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {keys['AWS_SECRET_ACCESS_KEY']}\n"
        f"[stale]\naws_access_key_id = {keys['AWS_ACCESS_KEY_ID']}\naws_secret_access_key = wrong\n")
    env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    env.setenv("AWS_PROFILE", "stale")
    with pytest.raises(ObjectStoreError, match="403"):  # moto checks: wrong keys fail
        fetched(tmp_path)
    env.setenv("AWS_PROFILE", "lora")
    assert fetched(tmp_path)


@pytest.fixture(scope="module")
def open_moto(tmp_path_factory):
    """moto without IAM checks: its checks cannot take STS's unsigned
    AssumeRoleWithWebIdentity (a 500 from moto), so here the test reads the credential
    each request was signed with instead."""
    with MotoS3(tmp_path_factory.mktemp("moto") / "moto.log") as moto:
        moto.client.create_bucket(Bucket="bucket")
        moto.put_adapter("bucket", "p/a", adapter_dir("a"))
        yield moto


def test_a_web_identity_token_file_assumes_its_role(open_moto, env, tmp_path):
    """No keys anywhere but a token file and a role: boto3 calls STS
    AssumeRoleWithWebIdentity (moto's) and signs the GETs with the temporary credentials
    it returns (an ASIA... key and a session token), as on EKS."""
    env.setenv("AWS_ENDPOINT_URL", open_moto.url)
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJsb3JhIn0.c2lnbmF0dXJl")
    env.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    env.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/lora-reader")
    env.setenv("AWS_ROLE_SESSION_NAME", "metrale-test")
    source = S3Source("s3://bucket/p", tmp_path / "cache")
    signed: list[tuple[str, str | None]] = []
    source.client.meta.events.register("before-send.s3", lambda request, **_: signed.append(
        (str(request.headers["Authorization"]), request.headers.get("X-Amz-Security-Token"))))
    found = source.find("a")
    assert all((found.path / f).read_bytes() == (adapter_dir("a") / f).read_bytes() for f in FILES)
    assert signed and all("Credential=ASIA" in auth and token_header for auth, token_header in signed)


def test_no_credentials_at_all_is_refused(iam_moto, env, tmp_path):
    with pytest.raises(ObjectStoreError):
        fetched(tmp_path)


def test_without_the_sdk_an_s3_source_is_refused_at_start_up(monkeypatch, tmp_path):
    from metrale.adapters import object_store
    from metrale.config import ConfigError

    monkeypatch.setattr(object_store, "boto3", None)
    with pytest.raises(ConfigError, match="sources"):
        S3Source("s3://bucket/p", tmp_path)
