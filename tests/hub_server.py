"""A small in-memory server speaking the subset of the Hugging Face Hub HTTP API that huggingface_hub and
transformers use to push and pull a model repo, for round-trip tests on 127.0.0.1.

Covered (model repos only): ``whoami-v2``; ``repos/create``; ``validate-yaml`` (the model card metadata);
``branch/{branch}``; ``refs``; ``preupload/{rev}`` (every file is a regular git blob, so the client never needs the
LFS / Xet storage services); the NDJSON
``commit/{rev}`` endpoint (``file`` and ``deletedFile`` / ``deletedFolder`` lines, ``parentCommit`` check);
``model_info`` (``/api/models/{id}`` and ``/revision/{rev}``); ``tree/{rev}/{path}``; and file downloads
``HEAD|GET /{id}/resolve/{rev}/{path}`` with the ``X-Repo-Commit`` and ``ETag`` (git blob id) headers
huggingface_hub requires, byte ranges, and the ``X-Error-Code`` headers it maps to RepositoryNotFound /
RevisionNotFound / EntryNotFound.

Tokens: ``Authorization: Bearer <token>``. A token the server does not know gets 401 with the Hub's "Invalid
credentials in Authorization header" message on every endpoint; writes need a known write token on the repo's
own namespace (else 401 / 403); reads of public repos need no token. Requests to routes outside this subset get
404 and are recorded in ``HubServer.unhandled`` so a test can assert the protocol subset sufficed.

    python tests/hub_server.py --port 8123 --token hf_write=alice   # manual use: HF_ENDPOINT=http://127.0.0.1:8123
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

INITIAL_GITATTRIBUTES = (
    b"*.bin filter=lfs diff=lfs merge=lfs -text\n"
    b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
)
INVALID_TOKEN = "Invalid credentials in Authorization header"


def git_blob_id(content: bytes) -> str:
    """The git object id of a blob: what the Hub reports as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def validate_card_metadata(readme: str) -> tuple[list[dict], list[dict]]:
    """(errors, warnings) for a README's YAML front matter, checking the fields a model card uses."""
    import yaml

    match = re.match(r"^---\n(.*?)\n---\n", readme, flags=re.S)
    if match is None:
        return [], [{"message": "empty or missing yaml metadata in repo card"}]
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        return [{"message": f"invalid YAML: {err}"}], []
    if not isinstance(data, dict):
        return [{"message": "the metadata must be a YAML mapping"}], []
    errors = []
    for key in ("license", "library_name", "pipeline_tag"):
        if key in data and not isinstance(data[key], str):
            errors.append({"message": f'"{key}" must be a string'})
    for key in ("tags", "base_model"):
        value = data.get(key)
        if value is not None and not (isinstance(value, str) or (isinstance(value, list)
                                                                   and all(isinstance(v, str) for v in value))):
            errors.append({"message": f'"{key}" must be a string or a list of strings'})
    return errors, []


@dataclass
class Commit:
    oid: str
    parent: str | None
    files: dict[str, bytes]
    title: str
    date: str


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision, revision)
        return self.commits.get(oid)


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.commit, self.extra = status, message, code, commit, extra or {}


class HubServer:
    """``with HubServer({"hf_write": ("alice", True)}) as hub: ... hub.endpoint ...`` (port 0: a free port)."""

    def __init__(self, tokens: dict[str, tuple[str, bool]], host: str = "127.0.0.1", port: int = 0):
        self.tokens = tokens  # token -> (user name, may write)
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()
        self.unhandled: list[tuple[str, str]] = []
        self._counter = 0
        server = self

        class Handler(_Handler):
            hub = server

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hub-server", daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ----------------------------------------------------------------------------------------------------------
    # Repository operations
    # ----------------------------------------------------------------------------------------------------------
    def new_commit(self, repo: Repo, parent: str | None, files: dict[str, bytes], title: str) -> Commit:
        self._counter += 1
        digest = hashlib.sha1(f"{repo.repo_id}\n{parent}\n{title}\n{self._counter}".encode())
        for path in sorted(files):
            digest.update(f"{path}\0{git_blob_id(files[path])}\n".encode())
        date = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
        commit = Commit(digest.hexdigest(), parent, files, title, date)
        repo.commits[commit.oid] = commit
        return commit

    def create_repo(self, user: str, body: dict) -> dict:
        namespace = body.get("organization") or user
        repo_id = f"{namespace}/{body['name']}"
        if body.get("type", "model") != "model":
            raise HubError(400, "this test server hosts model repos only")
        if namespace != user:
            raise HubError(403, f"You don't have the rights to create a model under the namespace \"{namespace}\"")
        with self.lock:
            if repo_id in self.repos:
                # The Hub's conflict answer still names the repo (create_repo(exist_ok=True) reads its url).
                raise HubError(409, "You already created this model repo", extra={"url": f"{self.endpoint}/{repo_id}"})
            private = body.get("visibility") == "private" or bool(body.get("private"))
            repo = Repo(repo_id, private)
            repo.branches["main"] = self.new_commit(repo, None, {".gitattributes": INITIAL_GITATTRIBUTES},
                                                    "initial commit").oid
            self.repos[repo_id] = repo
        return {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id}

    def create_branch(self, repo: Repo, branch: str, body: dict) -> dict:
        with self.lock:
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            start = repo.resolve(body.get("startingPoint") or "main")
            if start is None:
                raise HubError(404, "Invalid rev id", "RevisionNotFound")
            repo.branches[branch] = start.oid
        return {}

    def commit(self, repo: Repo, revision: str, lines: list[dict]) -> dict:
        header = lines[0]["value"] if lines and lines[0].get("key") == "header" else None
        if header is None:
            raise HubError(400, "the commit payload must start with a header line")
        with self.lock:
            if revision not in repo.branches:
                raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            head = repo.commits[repo.branches[revision]]
            if header.get("parentCommit") not in (None, head.oid):
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(head.files)
            for line in lines[1:]:
                key, value = line["key"], line["value"]
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise HubError(400, f"unsupported encoding {value.get('encoding')!r}")
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    files.pop(value["path"], None)
                elif key == "deletedFolder":
                    prefix = value["path"].rstrip("/") + "/"
                    files = {p: c for p, c in files.items() if not p.startswith(prefix)}
                elif key == "lfsFile":
                    raise HubError(400, "this test server stores regular files only (preupload never asks for LFS)")
                else:
                    raise HubError(400, f"unknown commit operation {key!r}")
            commit = self.new_commit(repo, head.oid, files, header.get("summary", ""))
            repo.branches[revision] = commit.oid
        return {"commitUrl": f"{self.endpoint}/{repo.repo_id}/commit/{commit.oid}", "commitOid": commit.oid,
                "success": True}

    def model_info(self, repo: Repo, commit: Commit) -> dict:
        return {"id": repo.repo_id, "modelId": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": commit.oid,
                "private": repo.private, "gated": False, "disabled": False, "lastModified": commit.date,
                "tags": [], "siblings": [{"rfilename": p} for p in sorted(commit.files)]}

    @staticmethod
    def tree(commit: Commit, path: str, recursive: bool) -> list[dict]:
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        entries, folders = [], set()
        for name in sorted(commit.files):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                if recursive or depth == 1:
                    folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                content = commit.files[name]
                entries.append({"type": "file", "oid": git_blob_id(content), "size": len(content), "path": name})
        entries += [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                    for f in sorted(folders)]
        if prefix and not entries:
            raise HubError(404, f"{path} does not exist", "EntryNotFound", commit.oid)
        return entries


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer

    def log_message(self, format, *args):  # noqa: A002  (silence the per-request stderr lines)
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    # ----------------------------------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        try:
            self._route(method, url.path, query, body, self._user())
        except HubError as err:
            headers = {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            if err.commit:
                headers["X-Repo-Commit"] = err.commit
            self._send(err.status, json.dumps({"error": err.message, **err.extra}).encode(), "application/json",
                       headers, head=method == "HEAD")

    def _user(self) -> tuple[str, bool] | None:
        auth = self.headers.get("Authorization")
        if not auth:
            return None
        token = auth.removeprefix("Bearer ").strip()
        if token not in self.hub.tokens:
            raise HubError(401, INVALID_TOKEN)
        return self.hub.tokens[token]

    def _repo(self, repo_id: str, user: tuple[str, bool] | None, write: bool = False) -> Repo:
        repo = self.hub.repos.get(repo_id)
        owner = user is not None and repo_id.split("/")[0] == user[0]
        if repo is None or (repo.private and not owner):
            raise HubError(404, "Repository not found", "RepoNotFound")
        if write and user is None:
            raise HubError(401, "You must be authenticated to write to this repo")
        if write and not (owner and user[1]):
            raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    @staticmethod
    def _commit(repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def _route(self, method: str, path: str, query: dict, body: bytes, user) -> None:
        hub = self.hub
        if path == "/api/whoami-v2" and method == "GET":
            if user is None:
                raise HubError(401, "You must be authenticated")
            role = "write" if user[1] else "read"
            return self._json({"type": "user", "name": user[0], "auth": {"accessToken": {"role": role}}})
        if path == "/api/repos/create" and method == "POST":
            if user is None:
                raise HubError(401, "You must be authenticated to create a repo")
            if not user[1]:
                raise HubError(403, "This token has read access only")
            return self._json(hub.create_repo(user[0], json.loads(body)))
        if path == "/api/validate-yaml" and method == "POST":
            errors, warnings = validate_card_metadata(json.loads(body)["content"])
            return self._send(400 if errors else 200,
                              json.dumps({"errors": errors, "warnings": warnings}).encode(), "application/json")
        actions = "revision|tree|preupload|commit|branch|refs"
        m = re.fullmatch(rf"/api/models/([^/]+/[^/]+)(?:/({actions})(?:/([^/]+)(/.*)?)?)?", path)
        if m:
            repo_id, action, revision, rest = m.group(1), m.group(2), unquote(m.group(3) or ""), m.group(4) or ""
            if action in (None, "revision") and method in ("GET", "HEAD"):
                repo = self._repo(repo_id, user)
                return self._json(hub.model_info(repo, self._commit(repo, revision or "main")), head=method == "HEAD")
            if action == "refs" and method == "GET":
                repo = self._repo(repo_id, user)
                return self._json({"branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": oid}
                                                for b, oid in sorted(repo.branches.items())],
                                   "tags": [], "converts": []})
            if action == "tree" and method == "GET" and revision:
                repo = self._repo(repo_id, user)
                commit = self._commit(repo, revision)
                return self._json(hub.tree(commit, unquote(rest), query.get("recursive") in ("1", "true", "True")))
            if action == "branch" and method == "POST" and revision:
                repo = self._repo(repo_id, user, write=True)
                return self._json(hub.create_branch(repo, revision, json.loads(body or b"{}")))
            if action == "preupload" and method == "POST" and revision:
                repo = self._repo(repo_id, user, write=True)
                files = self._commit(repo, revision).files
                return self._json({"files": [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                     "oid": git_blob_id(files[f["path"]]) if f["path"] in files else None}
                    for f in json.loads(body)["files"]]})
            if action == "commit" and method == "POST" and revision:
                repo = self._repo(repo_id, user, write=True)
                if query.get("create_pr"):
                    raise HubError(400, "this test server does not open pull requests")
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                return self._json(hub.commit(repo, revision, lines))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m and method in ("GET", "HEAD"):
            repo = self._repo(m.group(1), user)
            commit = self._commit(repo, unquote(m.group(2)))
            filename = unquote(m.group(3))
            if filename not in commit.files:
                raise HubError(404, "Entry not found", "EntryNotFound", commit.oid)
            return self._file(commit, commit.files[filename], head=method == "HEAD")
        self.hub.unhandled.append((method, self.path))
        raise HubError(404, f"not served by this test server: {method} {path}")

    # ----------------------------------------------------------------------------------------------------------
    def _json(self, payload, head: bool = False) -> None:
        self._send(200, json.dumps(payload).encode(), "application/json", head=head)

    def _file(self, commit: Commit, content: bytes, head: bool) -> None:
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{git_blob_id(content)}"', "Accept-Ranges": "bytes"}
        status = 200
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if match and not head:
            start = int(match.group(1))
            end = int(match.group(2)) if match.group(2) else len(content) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
            content, status = content[start:end + 1], 206
        self._send(status, content, "application/octet-stream", headers, head=head)

    def _send(self, status: int, content: bytes, content_type: str, headers: dict | None = None,
              head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(content)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(content)


def main() -> None:
    parser = argparse.ArgumentParser(description="In-memory Hub-protocol test server")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--token", action="append", default=[], help="TOKEN=USER (write access); repeatable")
    args = parser.parse_args()
    tokens = {t.split("=", 1)[0]: (t.split("=", 1)[1], True) for t in args.token}
    with HubServer(tokens, port=args.port) as hub:
        print(f"serving on {hub.endpoint} (HF_ENDPOINT={hub.endpoint}); Ctrl-C to stop", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
