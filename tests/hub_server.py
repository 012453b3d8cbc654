"""A stand-in for the Hugging Face Hub's HTTP API, on loopback, for the hub round-trip tests.

It implements the routes huggingface_hub 1.33 uses to create a repo, upload a folder and
download files (read from huggingface_hub's hf_api.py, _commit_api.py, _upload_pipeline.py
and file_download.py):

    POST /api/repos/create                                   create_repo
    POST /api/validate-yaml                                  create_commit, when README.md changes
    POST /api/{type}s/{repo}/preupload/{rev}                 upload mode of each file
    POST /api/{type}s/{repo}/commit/{rev}                    NDJSON commit (header / file / deletedFile)
    GET  /api/{type}s/{repo}[/revision/{rev}]                model_info / repo_info
    GET  /api/{type}s/{repo}/tree/{rev}[/{path}]             list_repo_tree / list_repo_files
    POST /api/{type}s/{repo}/paths-info/{rev}                get_paths_info
    HEAD /{repo}/resolve/{rev}/{path}                        file metadata (X-Repo-Commit, ETag, size)
    GET  /{repo}/resolve/{rev}/{path}                        file content

The preupload answer is "regular" for every file, so the client sends all content base64-inline
in the commit; the LFS batch API and Xet storage (what the real Hub uses for large files) are
not implemented, and a commit with an `lfsFile` line is rejected. Errors carry the
`X-Error-Code` header the client maps to its exceptions (RepoNotFound, RevisionNotFound,
EntryNotFound). Every request is logged in `HubServer.requests` so tests can check what the
client did.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the Hub reports as the oid / ETag of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    repo_id: str
    repo_type: str = "model"
    private: bool = False
    # commit sha -> {path: bytes}; `branches` maps a branch name to its head commit.
    snapshots: dict[str, dict[str, bytes]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    commit_messages: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        """A branch name or a commit sha (full or a prefix of 7+ characters) -> commit sha."""
        if revision in self.branches:
            return self.branches[revision]
        if len(revision) >= 7:
            for sha in self.snapshots:
                if sha.startswith(revision):
                    return sha
        return None

    def files(self, revision: str = "main") -> dict[str, bytes]:
        sha = self.resolve(revision)
        return {} if sha is None else self.snapshots[sha]


class HubServer:
    """Run with `with HubServer() as hub:`; `hub.url` is the endpoint to give the client."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.auth_headers: list[str | None] = []  # Authorization header of every request
        # Fault injection: answer the next `fail_commits` commit requests with this status.
        self.fail_commits = 0
        self.fail_status = 500
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubServer":
        handler = type("BoundHandler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: a free port
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-stand-in", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ repo operations
    def repo(self, repo_id: str, repo_type: str = "model") -> Repo | None:
        return self.repos.get((repo_type, repo_id))

    def create_repo(self, repo_id: str, repo_type: str = "model", private: bool = False) -> Repo:
        with self._lock:
            repo = Repo(repo_id, repo_type, private)
            self.repos[(repo_type, repo_id)] = repo
            # The Hub creates a repo with an initial commit holding .gitattributes.
            self._commit(repo, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                         [], "initial commit")
            return repo

    def commit_files(self, repo_id: str, files: dict[str, bytes], deletions=(), message="server-side edit",
                     repo_type: str = "model", branch: str = "main") -> str:
        """Commit directly (bypassing HTTP): tests use it to break a repo on purpose."""
        with self._lock:
            return self._commit(self.repos[(repo_type, repo_id)], branch, files, list(deletions), message)

    @staticmethod
    def _commit(repo: Repo, branch: str, added: dict[str, bytes], deleted: list[str], message: str) -> str:
        parent = repo.branches.get(branch)
        tree = dict(repo.snapshots[parent]) if parent else {}
        for path in deleted:
            if path.endswith("/"):
                tree = {p: d for p, d in tree.items() if not p.startswith(path)}
            else:
                tree.pop(path, None)
        tree.update(added)
        digest = hashlib.sha1((parent or "").encode() + message.encode())
        for path in sorted(tree):
            digest.update(path.encode() + b"\0" + git_blob_sha1(tree[path]).encode())
        sha = digest.hexdigest()
        repo.snapshots[sha] = tree
        repo.branches[branch] = sha
        repo.commit_messages[sha] = message
        return sha


_API = re.compile(r"^/api/(?P<type>models|datasets|spaces)/(?P<repo>[^/]+/[^/]+)(?P<rest>/.*)?$")
_RESOLVE = re.compile(r"^/(?:(?P<type>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer  # set on the bound subclass

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    # ------------------------------------------------------------------ helpers
    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json",
              headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, payload, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers=headers)

    def _error(self, status: int, message: str, code: str | None = None, head: bool = False) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers=headers, head=head)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _record(self) -> tuple[str, dict]:
        split = urlsplit(self.path)
        with self.hub._lock:
            self.hub.requests.append((self.command, split.path))
            self.hub.auth_headers.append(self.headers.get("Authorization"))
        return split.path, parse_qs(split.query)

    def _lookup(self, api_type: str, repo_id: str, head: bool = False) -> Repo | None:
        repo = self.hub.repo(repo_id, api_type.rstrip("s"))
        if repo is None:
            self._error(404, f"Repository {repo_id} not found", "RepoNotFound", head=head)
        return repo

    # ------------------------------------------------------------------ verbs
    def do_HEAD(self) -> None:
        path, _ = self._record()
        self._resolve(path, head=True)

    def do_GET(self) -> None:
        path, query = self._record()
        if path.startswith("/api/"):
            m = _API.match(path)
            if m is None:
                return self._error(404, f"no route GET {path}")
            repo = self._lookup(m["type"], m["repo"])
            if repo is None:
                return
            rest = m["rest"] or ""
            if rest == "" or rest.startswith("/revision/"):
                return self._info(repo, unquote(rest[len("/revision/"):]) if rest else "main")
            if rest.startswith("/tree/"):
                rev, _, sub = rest[len("/tree/"):].partition("/")
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                return self._tree(repo, unquote(rev), unquote(sub), recursive)
            return self._error(404, f"no route GET {path}")
        self._resolve(path, head=False)

    def do_POST(self) -> None:
        path, query = self._record()
        body = self._body()
        if path == "/api/repos/create":
            return self._create(json.loads(body or b"{}"))
        if path == "/api/validate-yaml":
            return self._json(200, {"errors": [], "warnings": []})
        m = _API.match(path)
        if m is None:
            return self._error(404, f"no route POST {path}")
        repo = self._lookup(m["type"], m["repo"])
        if repo is None:
            return
        action, _, rev = (m["rest"] or "").lstrip("/").partition("/")
        rev = unquote(rev)
        if action == "preupload":
            return self._preupload(repo, rev, json.loads(body))
        if action == "commit":
            return self._commit(repo, rev, body, query)
        if action == "paths-info":
            return self._paths_info(repo, rev, body)
        return self._error(404, f"no route POST {path}")

    # ------------------------------------------------------------------ routes
    def _create(self, payload: dict) -> None:
        name, org = payload.get("name"), payload.get("organization")
        if not name:
            return self._error(400, "missing repo name")
        repo_id = f"{org}/{name}" if org else f"user/{name}"  # anonymous callers get the namespace 'user'
        repo_type = payload.get("type") or "model"
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.hub.url}/{prefix}{repo_id}"
        if self.hub.repo(repo_id, repo_type) is not None:
            # like the Hub, the conflict answer carries the url: create_repo(exist_ok=True) reads it
            message = f"You already created this {repo_type} repo"
            return self._send(409, json.dumps({"error": message, "url": url}).encode(),
                              headers={"X-Error-Message": message})
        self.hub.create_repo(repo_id, repo_type, private=payload.get("visibility") == "private")
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _preupload(self, repo: Repo, rev: str, payload: dict) -> None:
        current = repo.files(rev)
        files = [
            {
                "path": f["path"],
                "uploadMode": "regular",  # everything inline: no LFS/Xet transfer needed
                "shouldIgnore": False,
                # the oid of the file already there lets the client skip unchanged files
                "oid": git_blob_sha1(current[f["path"]]) if f["path"] in current else None,
            }
            for f in payload.get("files", [])
        ]
        self._json(200, {"files": files, "commitOid": repo.resolve(rev)})

    def _commit(self, repo: Repo, rev: str, body: bytes, query: dict) -> None:
        with self.hub._lock:
            if self.hub.fail_commits > 0:
                self.hub.fail_commits -= 1
                return self._error(self.hub.fail_status, "Internal Error (injected by the test server)")
        if "create_pr" in query:
            return self._error(400, "pull requests are not supported by the stand-in")
        if rev not in repo.branches:
            return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        added, deleted, message = {}, [], ""
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                message = value.get("summary", "")
                parent = value.get("parentCommit")
                if parent and parent != repo.branches[rev]:
                    return self._error(412, "A commit has happened since. Please refresh and try again.")
            elif key == "file":
                if value.get("encoding") != "base64":
                    return self._error(400, f"unsupported encoding {value.get('encoding')}")
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"] + ("/" if key == "deletedFolder" else ""))
            else:  # lfsFile: the preupload answer never asks for LFS
                return self._error(400, f"unsupported commit operation {key!r} (the stand-in has no LFS storage)")
        sha = self.hub.commit_files(repo.repo_id, added, deleted, message, repo.repo_type, rev)
        self._json(200, {"commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{sha}", "commitOid": sha,
                         "pullRequestUrl": None, "success": True})

    def _info(self, repo: Repo, rev: str) -> None:
        sha = repo.resolve(rev)
        if sha is None:
            return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        files = repo.snapshots[sha]
        now = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        config = {}
        if "config.json" in files:
            try:
                raw = json.loads(files["config.json"])
                config = {k: raw[k] for k in ("architectures", "model_type", "auto_map") if k in raw}
            except ValueError:
                pass
        self._json(200, {
            "id": repo.repo_id, "_id": repo.repo_id, "sha": sha, "private": repo.private, "gated": False,
            "disabled": False, "lastModified": now, "createdAt": now, "tags": [], "config": config,
            "siblings": [{"rfilename": p, "size": len(d), "blobId": git_blob_sha1(d)} for p, d in sorted(files.items())],
        })

    @staticmethod
    def _entry(path: str, data: bytes) -> dict:
        return {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}

    def _tree(self, repo: Repo, rev: str, sub: str, recursive: bool = False) -> None:
        sha = repo.resolve(rev)
        if sha is None:
            return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        files = repo.snapshots[sha]
        prefix = sub.rstrip("/") + "/" if sub else ""
        entries, folders = [], set()
        for path, data in sorted(files.items()):
            if not path.startswith(prefix):
                continue
            head, sep, _ = path[len(prefix):].partition("/")
            if sep and not recursive:  # a sub-folder: listed once, its content on request
                if head not in folders:
                    folders.add(head)
                    entries.append({"type": "directory", "path": prefix + head, "oid": "0" * 40, "size": 0})
            else:
                entries.append(self._entry(path, data))
        if sub and not entries:
            return self._error(404, f"{sub} does not exist on {rev}", "EntryNotFound")
        self._json(200, entries)

    def _paths_info(self, repo: Repo, rev: str, body: bytes) -> None:
        files = repo.files(rev)
        content_type = self.headers.get("Content-Type", "")
        if "json" in content_type:
            paths = json.loads(body).get("paths", [])
        else:  # form-encoded: paths=a&paths=b
            paths = parse_qs(body.decode()).get("paths", [])
        self._json(200, [self._entry(p, files[p]) for p in paths if p in files])

    def _resolve(self, path: str, head: bool) -> None:
        m = _RESOLVE.match(path)
        if m is None:
            return self._error(404, f"no route {self.command} {path}", head=head)
        repo = self._lookup(m["type"] or "models", m["repo"], head=head)
        if repo is None:
            return
        rev, filename = unquote(m["rev"]), unquote(m["path"])
        sha = repo.resolve(rev)
        if sha is None:
            return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound", head=head)
        files = repo.snapshots[sha]
        if filename not in files:
            return self._error(404, f"Entry not found: {filename}", "EntryNotFound", head=head)
        data = files[filename]
        etag = git_blob_sha1(data)
        self._send(200, data, content_type="application/octet-stream", head=head, headers={
            "X-Repo-Commit": sha,
            "ETag": f'"{etag}"',
            "X-Linked-Etag": f'"{etag}"',
            "X-Linked-Size": str(len(data)),
            "Accept-Ranges": "bytes",
        })
