"""A local S3-compatible server (moto) on loopback, reached through a proxy a test can cut.

The proxy is a plain TCP relay. ``cut_on(marker)`` lets the request that carries ``marker``
through and then drops every later request and connection, as a network partition or a dead
endpoint would; ``restore()`` reconnects. Nothing leaves the machine.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CuttableProxy:
    """Relays 127.0.0.1:<port> to the server until cut."""

    upstream: tuple[str, int]
    port: int = 0
    marker: bytes | None = None
    cut: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_on(self, marker: bytes) -> None:
        self.marker = marker

    def restore(self) -> None:
        self.marker = None
        self.cut.clear()

    def stop(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.cut.is_set():
                client.close()
                continue
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if from_client and self.cut.is_set():
                    break
                sink.sendall(chunk)
                if from_client and self.marker is not None and self.marker in chunk:
                    self.cut.set()  # this request goes through; everything after it is dropped
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@dataclass
class S3Server:
    """moto on loopback, a cuttable proxy in front, and a bucket; ``env`` points clients at it."""

    bucket: str
    proxy: CuttableProxy
    env: dict[str, str]
    moto: Any

    def cut_on(self, marker: bytes) -> None:
        self.proxy.cut_on(marker)

    def restore(self) -> None:
        self.proxy.restore()

    def stop(self) -> None:
        self.proxy.stop()
        self.moto.stop()


def start_s3(bucket: str) -> S3Server:
    """Start moto on loopback and a proxy in front of it, and create ``bucket``."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    proxy = CuttableProxy(moto.get_host_and_port())
    proxy.start()
    env = {
        "AWS_ACCESS_KEY_ID": "convoy-test",
        "AWS_SECRET_ACCESS_KEY": "convoy-test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
    }
    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=bucket)
    return S3Server(bucket, proxy, env, moto)
