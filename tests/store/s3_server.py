"""An S3-compatible server on loopback for tests (moto), and the environment that points s3fs at it."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

#: A region other than us-east-1: s3fs's mkdir sends the location constraint only when given a
#: region, and moto's regional endpoint refuses a bucket without one.
REGION = "eu-west-1"


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, str]]:
    """Start moto on 127.0.0.1 (a free port); yield the AWS_* variables that reach it.

    The variables are set in os.environ while the server runs (s3fs and child processes read
    them), and restored afterwards.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def new_bucket_url() -> str:
    """A fresh bucket (created through s3fs, as a user's set-up would) and a prefix in it."""
    import s3fs

    bucket = f"ds4-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket, region_name=REGION)
    return f"s3://{bucket}/kv"
