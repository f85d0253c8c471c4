"""A read-only, corrupted model cache (shared by the cache and the distill-command tests)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from treespec.models import loading


@contextlib.contextmanager
def read_only_corrupted_cache(root: Path, monkeypatch):
    """The embedded model's cache under ``root`` (TREESPEC_CACHE) with a corrupted model file, the cache
    and ``root`` made read-only; running as root, whose writes ignore permission bits, the removal a
    rebuild needs is made to fail instead. Yields the cache folder; permissions restored on exit."""
    cache = loading.embedded_gemma_dir(progress=False)
    (cache / "model.safetensors").write_bytes(b"corrupt")
    os.chmod(cache, 0o555)
    os.chmod(root, 0o555)
    try:
        if os.access(root, os.W_OK):
            def denied(path, *args, **kwargs):
                raise PermissionError(13, "Permission denied", str(path))

            monkeypatch.setattr(loading.shutil, "rmtree", denied)
        yield cache
    finally:
        os.chmod(root, 0o755)
        os.chmod(cache, 0o755)
