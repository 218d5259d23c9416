"""A real nginx on loopback configured the way ingress-nginx configures it from our Ingress.

The proxy settings come from the rendered Ingress's `nginx.ingress.kubernetes.io/*`
annotations, translated one by one into the nginx directives ingress-nginx generates for them;
an annotation this module cannot translate is an error, so the Ingress and the proxy under
test cannot drift apart. The fixed part of the location block mirrors what ingress-nginx's
template always emits for a proxied location (HTTP/1.1 keep-alive to the upstream, forwarded
headers).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

ANNOTATION_PREFIX = "nginx.ingress.kubernetes.io/"

# ingress-nginx annotation -> the directive its template writes into the location block.
DIRECTIVES: dict[str, Callable[[str], str]] = {
    "proxy-buffering": lambda v: f"proxy_buffering {v};",
    "proxy-request-buffering": lambda v: f"proxy_request_buffering {v};",
    "proxy-http-version": lambda v: f"proxy_http_version {v};",
    "proxy-connect-timeout": lambda v: f"proxy_connect_timeout {v}s;",
    "proxy-read-timeout": lambda v: f"proxy_read_timeout {v}s;",
    "proxy-send-timeout": lambda v: f"proxy_send_timeout {v}s;",
    "proxy-body-size": lambda v: f"client_max_body_size {v};",
    "proxy-buffer-size": lambda v: f"proxy_buffer_size {v};",
}


def directives_from_annotations(annotations: Mapping[str, str]) -> list[str]:
    """The location directives ingress-nginx derives from an Ingress's annotations."""
    lines = []
    for key, value in sorted(annotations.items()):
        if not key.startswith(ANNOTATION_PREFIX):
            continue
        name = key.removeprefix(ANNOTATION_PREFIX)
        if name not in DIRECTIVES:
            raise ValueError(f"no nginx translation for annotation {key}; add one to DIRECTIVES")
        lines.append(DIRECTIVES[name](value))
    return lines


def render_config(
    prefix: Path, listen_port: int, upstream_port: int, location: Sequence[str]
) -> str:
    """A complete nginx.conf: one server on 127.0.0.1 proxying everything to the upstream."""
    temp_paths = "\n".join(
        f"    {kind}_temp_path {prefix / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    # Workers of a root master would drop to `nobody` and could not use the temp dirs.
    user = f"user {getpass.getuser()};" if os.geteuid() == 0 else ""
    body = "\n".join(f"            {line}" for line in location)
    return f"""{user}
worker_processes 1;
daemon off;
pid {prefix / "nginx.pid"};
error_log {prefix / "error.log"} info;
events {{ worker_connections 64; }}
http {{
    access_log {prefix / "access.log"};
{temp_paths}
    upstream llm_server {{
        server 127.0.0.1:{upstream_port};
        keepalive 8;
    }}
    server {{
        listen 127.0.0.1:{listen_port};
        location / {{
            proxy_pass http://llm_server;
            proxy_set_header Host $host;
            proxy_set_header Connection "";
            proxy_set_header X-Real-IP $remote_addr;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
{body}
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def nginx_binary() -> str:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise RuntimeError("nginx is not installed: run deploy/ci-setup.sh")
    return found


@contextmanager
def running_nginx(prefix: Path, upstream_port: int, location: Sequence[str]) -> Iterator[int]:
    """Start nginx in the foreground under `prefix`; yield its port; stop it on exit."""
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / kind).mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(render_config(prefix, port, upstream_port, location))
    error_log = prefix / "error.log"
    command = [nginx_binary(), "-p", str(prefix), "-c", str(conf), "-e", str(error_log)]
    checked = subprocess.run([*command, "-t"], capture_output=True, text=True, check=False)
    if checked.returncode != 0:
        raise RuntimeError(f"nginx rejects the config:\n{checked.stderr}\n{conf.read_text()}")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 10.0, process)
        yield port
    finally:
        stop_process(process, 10)


def stop_process(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
