"""moto's S3 server on 127.0.0.1 for the benchmarks that need object storage, with the AWS variables
pointing every client (obstore, boto3, DuckDB's secret) at it."""

from __future__ import annotations

import logging
import os

AWS_VARIABLES = (  # what `start_moto` sets (or, AWS_PROFILE, removes)
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_ALLOW_HTTP",
)


def start_moto():
    """Start the server; returns ``(server, endpoint)`` (``server.stop()`` when done)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    point_aws_at(endpoint)
    return server, endpoint


def point_aws_at(endpoint: str) -> None:
    """Point this process's AWS variables (and its children's) at a local S3 server."""
    os.environ.pop("AWS_PROFILE", None)
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_REGION="us-east-1",
        AWS_ALLOW_HTTP="true",
    )
