"""moto's S3 server (moto[server] from PyPI) in server mode, in its own process on a free
loopback port: the S3 a test's sources fetch from, with its real protocol (SigV4, ETags,
errors, HEAD, ranges) and, where a test asks, IAM/STS authentication enforced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import boto3
import httpx
from botocore.config import Config

from tests.helpers.process import stop, wait_ready
from tests.helpers.server import free_port

FILES = ("adapter_config.json", "adapter_model.safetensors")
KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class MotoS3:
    """`with MotoS3(log_path) as s3:` ... s3.env (the variables a source reads), s3.client.
    auth_after: the number of requests served without authentication before moto's IAM
    checks every request (None: never checked)."""

    def __init__(self, log_path: Path, auth_after: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {"PATH": "/usr/bin:/bin", "MOTO_PORT": str(self.port)}
        if auth_after is not None:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(auth_after)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(self.proc, "moto_server", f"{self.url}/moto-api/ to answer", self._up,
                       lambda: log_path.read_text(errors="replace"))
        except BaseException:
            self.stop()
            raise
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_REGION": "us-east-1", **KEYS}
        self.client = self.client_with(**KEYS)

    def client_with(self, service: str = "s3", **keys):
        return boto3.client(service, endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id=keys.get("AWS_ACCESS_KEY_ID"),
                            aws_secret_access_key=keys.get("AWS_SECRET_ACCESS_KEY"),
                            config=Config(retries={"max_attempts": 1}))

    def _up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/moto-api/", timeout=5, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def put_adapter(self, bucket: str, key_prefix: str, folder: Path) -> None:
        for f in FILES:
            self.client.put_object(Bucket=bucket, Key=f"{key_prefix}/{f}", Body=(folder / f).read_bytes())

    def stop(self) -> None:
        stop(self.proc)

    def __enter__(self) -> MotoS3:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
