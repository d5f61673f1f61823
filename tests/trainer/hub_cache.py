"""A Hugging Face Hub cache filled from a local model directory, in the cache's own layout
(``models--ORG--NAME/blobs/<hash>``, ``snapshots/<commit>/<file>`` linking to the blob,
``refs/main`` holding the commit), as ``snapshot_download`` leaves it after a download."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# A commit id of 40 hex digits, as the Hub's are.
COMMIT = hashlib.sha1(b"tpu_train test commit").hexdigest()


def fill_hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = COMMIT,
                   branch: str = "main") -> Path:
    """Lay every file of ``model_dir`` into ``cache`` as the snapshot ``commit`` of
    ``repo_id``, the head of ``branch``; returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for source in sorted(model_dir.iterdir()):
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / source.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot
