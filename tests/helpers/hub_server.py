"""A local stand-in for the Hugging Face Hub's file routes, on 127.0.0.1 (nothing reaches
the internet): HEAD and GET /{org}/{repo}/resolve/{revision}/{filename}, with the
headers huggingface_hub reads (X-Repo-Commit, ETag, X-Linked-Etag / X-Linked-Size for
LFS files, Content-Length) and its error codes (X-Error-Code: RepoNotFound,
RevisionNotFound, EntryNotFound). Revisions are branch names or commit hashes; weights
are served as LFS files (ETag = their SHA-256), configs as regular ones."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from tests.helpers.bucket import trickle

LFS_SUFFIXES = (".safetensors", ".bin")


class HubServer:
    """repos[repo_id][revision] = (commit, {filename: bytes}); put() fills one."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, tuple[str, dict[str, bytes]]]] = {}
        self.requests: list[str] = []
        self.trickle: set[str] = set()  # paths whose GET body trickles (bucket.trickle)
        self.lie: set[str] = set()  # paths whose LFS ETag is the SHA-256 of other bytes
        self.closed = threading.Event()
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.answer(head=True)

            def do_GET(self) -> None:
                self.answer(head=False)

            def answer(self, head: bool) -> None:
                path = unquote(self.path.split("?", 1)[0])
                with hub._lock:
                    hub.requests.append(f"{self.command} {path}")
                parts = path.strip("/").split("/")
                if len(parts) < 5 or parts[2] != "resolve":
                    self.error(404, "RepoNotFound")
                    return
                repo_id, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                revisions = hub.repos.get(repo_id)
                if revisions is None:
                    self.error(404, "RepoNotFound")
                    return
                found = revisions.get(revision) or next(
                    (r for r in revisions.values() if r[0] == revision), None)
                if found is None:
                    self.error(404, "RevisionNotFound")
                    return
                commit, files = found
                body = files.get(filename)
                if body is None:
                    self.error(404, "EntryNotFound", commit)
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                if filename.endswith(LFS_SUFFIXES):
                    sha = hashlib.sha256(body + (b"lie" if path in hub.lie else b"")).hexdigest()
                    self.send_header("ETag", f'"{sha}"')
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(body)))
                else:
                    self.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if head:
                    return
                if path not in hub.trickle:
                    self.wfile.write(body)
                    return
                trickle(self, body, hub.closed)

            def error(self, status: int, code: str, commit: str | None = None) -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", code)
                if commit is not None:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def put(self, repo_id: str, files: dict[str, bytes], revision: str = "main") -> str:
        """The repo's revision holds `files` now; returns its commit hash."""
        commit = hashlib.sha1(repr((repo_id, revision, sorted(
            (k, hashlib.sha256(v).hexdigest()) for k, v in files.items()))).encode()).hexdigest()
        with self._lock:
            self.repos.setdefault(repo_id, {})[revision] = (commit, dict(files))
        return commit

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()
