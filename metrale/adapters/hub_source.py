"""A Hugging Face Hub organisation as an adapter source (`--adapter-source hf://org`),
through huggingface_hub: the name `org/adapter` is the model repo org/adapter at `main`,
`org/adapter@rev` at a branch, tag or commit. Only adapter_config.json and
adapter_model.safetensors are fetched (never a pickled adapter_model.bin), with the
library's cache (HF_HUB_CACHE), offline mode (HF_HUB_OFFLINE: cached files only), endpoint
(HF_ENDPOINT: a mirror) and token (HF_TOKEN); huggingface_hub checks each file's size and
re-validates a revision's commit on every look-up. A file whose ETag is a SHA-256 (the
Hub's LFS files) is checked against it here.

Every HTTP request goes through the fetch transport (fetch_transport.py), so a look-up is
bounded by its fetch deadline in every phase. That transport is installed as
huggingface_hub's client factory for this process (set_client_factory): without a fetch
deadline on the calling thread it is a plain transport. The Hub's cache is the library's
and is not bounded by --adapter-cache-bytes.

The adapter's snapshot directory is confined to its repo's cache folder (the snapshot's
files are links into that folder's blobs/).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path
from urllib.parse import urlsplit

from metrale.adapters.confined import ConfinedDir, open_inside
from metrale.adapters.download_cache import ADAPTER_FILES
from metrale.adapters.fetch_deadline import DEFAULT_LIMITS, Deadline, FetchDeadlineError, FetchLimits
from metrale.config import ConfigError
from metrale.errors import AdapterFileError, ObjectStoreError

try:  # the `sources` extra; without it an hf:// source is refused at start-up
    import httpx2
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import hf_hub_download, set_client_factory, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.file_download import repo_folder_name

    from metrale.adapters.fetch_transport import DeadlineTransport
except ImportError:  # pragma: no cover - the CI installs the extra
    hf_hub_download = None

_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 4 << 20


def _client() -> httpx2.Client:
    """huggingface_hub's client: its defaults (redirects followed, no client timeout: the
    fetch deadline bounds a look-up), offline mode honoured, over the deadline transport."""
    def offline_guard(request: httpx2.Request) -> None:
        if hf_constants.is_offline_mode():
            raise OfflineModeIsEnabled(f"Cannot reach {request.url}: offline mode is enabled "
                                       "(HF_HUB_OFFLINE)")

    return httpx2.Client(transport=DeadlineTransport(), follow_redirects=True, timeout=None,
                         event_hooks={"request": [offline_guard]})


class HubSource:
    def __init__(self, url: str, limits: FetchLimits = DEFAULT_LIMITS,
                 cache_dir: str | Path | None = None, endpoint: str | None = None) -> None:
        """cache_dir, endpoint: huggingface_hub's own (HF_HUB_CACHE, HF_ENDPOINT) unless set."""
        parts = urlsplit(url)
        if parts.scheme != "hf" or not parts.netloc or parts.path.strip("/"):
            raise ConfigError(f"adapter source {url!r} is not hf://org (an organisation or user)")
        if hf_hub_download is None:
            raise ConfigError(f"adapter source {url} needs huggingface_hub: install metrale's "
                              "`sources` extra (pip install 'metrale[sources]')")
        self.url, self.org, self.limits = url, parts.netloc, limits
        self._slots = threading.BoundedSemaphore(limits.workers)  # look-ups asking the Hub
        self.cache_dir = Path(cache_dir or hf_constants.HF_HUB_CACHE)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache_dir = self.cache_dir.resolve()
        self.endpoint = endpoint
        set_client_factory(_client)

    def __str__(self) -> str:
        return self.url

    def repo(self, name: str) -> tuple[str, str] | None:
        """(repo id, revision) of `name`, or None when it is not of this organisation."""
        org, sep, rest = name.partition("/")
        if org != self.org or not sep or "/" in rest:
            return None
        repo, _, revision = rest.partition("@")
        return f"{org}/{repo}", revision or "main"

    def find(self, name: str, revalidate: bool = True) -> ConfinedDir | None:
        """The adapter's snapshot directory in the Hub cache, fetched if needed; None when the
        Hub (or, offline, the cache) has no such repo, revision or file. revalidate=False:
        a cached snapshot is used without asking the Hub. Raises ObjectStoreError."""
        found = self.repo(name)
        if found is None:
            return None
        repo_id, revision = found
        root = (self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")).resolve()
        if not revalidate:
            cached = [try_to_load_from_cache(repo_id, f, cache_dir=self.cache_dir, revision=revision)
                      for f in ADAPTER_FILES]
            if all(isinstance(p, str) for p in cached) and len({Path(p).parent for p in cached}) == 1:
                return ConfinedDir(Path(cached[0]).parent, root)
        deadline = Deadline(self.limits, f"{self.url}: adapter {name!r}")
        paths = []
        with deadline.active(), deadline.slot(self._slots):
            for file in ADAPTER_FILES:
                path = self._download(repo_id, revision, file, name)
                if path is None:
                    return None
                paths.append(Path(path))
        if len({p.parent for p in paths}) != 1:  # the revision moved between the two files
            raise ObjectStoreError(f"{self.url}: adapter {name!r} changed while it was fetched; "
                                   "retry")
        for path in paths:
            self._check_sha256(path, root, name)
        return ConfinedDir(paths[0].parent, root)

    def discard(self, name: str, found: ConfinedDir) -> None:
        """Drop a copy refused for its content: its snapshot links and the blobs they name."""
        for file in ADAPTER_FILES:
            link = found.path / file
            target = Path(os.path.realpath(link))
            for p in (link, target):
                if p.is_relative_to(found.root):
                    p.unlink(missing_ok=True)

    def _download(self, repo_id: str, revision: str, file: str, name: str) -> str | None:
        offline = hf_constants.is_offline_mode()
        try:
            return hf_hub_download(repo_id, file, revision=revision, cache_dir=self.cache_dir,
                                   endpoint=self.endpoint, local_files_only=offline)
        except FetchDeadlineError:
            raise
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            if isinstance(e, GatedRepoError):
                raise ObjectStoreError(f"{self.url}: {repo_id} is gated: {_brief(e)}") from None
            return None
        except LocalEntryNotFoundError as e:
            if offline:  # HF_HUB_OFFLINE: what the cache does not hold does not exist
                return None
            raise ObjectStoreError(f"{self.url}: {repo_id}/{file}@{revision}: the Hub could not "
                                   f"be reached and nothing is cached: {_brief(e.__cause__ or e)}") from None
        except EntryNotFoundError:
            return None
        except (HfHubHTTPError, httpx2.HTTPError, OSError, ValueError) as e:
            raise ObjectStoreError(f"{self.url}: {repo_id}/{file}@{revision}: {_brief(e)}") from None

    def _check_sha256(self, path: Path, root: Path, name: str) -> None:
        """A blob named by a SHA-256 (an LFS file's ETag) must hash to it."""
        blob = Path(os.path.realpath(path))
        if not _SHA256.fullmatch(blob.name):
            return
        digest = hashlib.sha256()
        with open_inside(path, root, AdapterFileError) as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != blob.name:
            blob.unlink(missing_ok=True)
            raise ObjectStoreError(f"{self.url}: adapter {name!r}: {path.name} does not match its "
                                   "SHA-256; dropped from the cache")


def _brief(e: BaseException | None) -> str:
    return f"{type(e).__name__}: {str(e)[:200]}"
