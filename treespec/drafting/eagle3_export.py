"""An EAGLE-3 head as vllm-project's ``speculators`` writes one, which vLLM and SGLang load.

A checkpoint is a folder with ``config.json`` (``speculators_model_type`` ``"eagle3"``, a Llama
``transformer_layer_config`` for the draft's one decoder layer, ``draft_vocab_size``,
``eagle_aux_hidden_state_layer_ids`` and the verifier) and ``model.safetensors``:

============================================  =====================================================
``fc.weight``                                 ``[H, k * H]``, k fused target layers
``layers.0.{input_layernorm,hidden_norm,``    ``[H]`` each
``post_attention_layernorm}.weight``
``layers.0.self_attn.{q,k,v}_proj.weight``    ``[heads * head_dim, 2H]``
``layers.0.self_attn.o_proj.weight``          ``[H, heads * head_dim]``
``layers.0.mlp.{gate,up}_proj.weight``        ``[I, H]``; ``down_proj`` ``[H, I]``
``norm.weight``                               ``[H]``
``lm_head.weight``                            ``[|S|, H]``: the target's LM-head rows on the subset
``d2t``                                       ``[|S|]`` int64, ``S[i] - i``
``t2d``                                       ``[V]`` bool, the subset as a mask
``embed_tokens.weight``                       ``[V, H]``: the target's input embedding table (optional)
============================================  =====================================================

The embedding table is the target's own and most of the file (``V * H``: 335 MB in bf16 for a 262,144-token
vocabulary), but ``speculators`` 0.9.0 needs it: loading a checkpoint without it left the embedding at
zeros (measured; it means to fall back on the verifier's, and does not), so it is written unless asked not to
(``embed=False``, for an engine that shares the target's embedding).
Written from the layout of ``speculators`` 0.9.0 (``Eagle3SpeculatorConfig``, ``Eagle3DraftModel``,
``build_vocab_mappings_from_distribution``); ``benchmarks/speculators_check.py`` loads an export with that
package (in an environment of its own: it pins transformers <= 5.19) and compares its forward with
:class:`~treespec.drafting.eagle3.Eagle3Head`'s.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .eagle3 import Eagle3Head, aux_layer_ids
from .head import HeadConfig

SPECULATORS_VERSION = "0.9.0"  # the release whose layout this module writes and was checked against
FILES = ("config.json", "model.safetensors")
_LAYER_KEYS = ("fc.weight", "norm.weight")


def speculators_config(head: Eagle3Head, *, verifier: str | None = None,
                       verifier_architectures: list[str] | None = None,
                       speculative_tokens: int = 3, max_position_embeddings: int = 32768,
                       dtype: torch.dtype = torch.bfloat16) -> dict:
    """The ``config.json`` of ``head`` in the ``speculators`` layout (a JSON-ready dict)."""
    cfg = head.cfg
    if speculative_tokens < 1:
        raise ValueError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    layer = {"model_type": "llama", "vocab_size": cfg.target_vocab_size, "hidden_size": cfg.hidden_size,
             "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
             "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads, "head_dim": cfg.head_dim,
             "hidden_act": "silu", "max_position_embeddings": int(max_position_embeddings),
             "rms_norm_eps": cfg.rms_eps, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
             "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "dtype": str(dtype).removeprefix("torch."),
        "transformer_layer_config": layer,
        "draft_vocab_size": int(head.vocab_ids.numel()),
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids(cfg.feature_layers),
        "target_hidden_size": None,
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures or [])},
        },
    }


def speculators_tensors(head: Eagle3Head, dtype: torch.dtype = torch.bfloat16, *, embed: bool = True
                        ) -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors`` (module docstring), floating ones in ``dtype``; the target's
    embedding table too with ``embed``."""
    if not head.attached:
        raise RuntimeError("attach the head to its target first (the LM-head rows are written)")
    if head.inference_weights != "plain":
        raise ValueError("this head is set for inference (packed or 4-bit weights); export a head as loaded or trained")
    ids = head.vocab_ids.cpu()
    out = {k: v.detach().to(dtype).cpu().contiguous() for k, v in head.state_dict().items()}
    out["lm_head.weight"] = head.lm_rows.detach().to(dtype).cpu().contiguous()
    out["d2t"] = (ids - torch.arange(ids.numel())).contiguous()
    t2d = torch.zeros(head.cfg.target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    if embed:
        out["embed_tokens.weight"] = head.embedding_table.detach().to(dtype).cpu().contiguous()
    return out


def save_speculators(head: Eagle3Head, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16, embed: bool = True,
                     verifier: str | None = None, verifier_architectures: list[str] | None = None,
                     speculative_tokens: int = 3, max_position_embeddings: int = 32768) -> dict:
    """Write ``head`` as a ``speculators`` EAGLE-3 checkpoint folder; returns what was written.

    The folder is built beside ``out_dir`` (``.NAME.tmpPID-*``) and moved into place whole: ``out_dir`` holds
    the old export or the new one, never a mix. The old one is moved aside (``.NAME.oldPID-*``) for the moment
    of the swap and put back if the swap fails; folders that a killed writer left behind are removed, or, where
    ``out_dir`` itself is missing, the old export is put back, before anything is written. An existing
    ``out_dir`` is replaced only when it is an EAGLE-3 checkpoint folder (its two files, ``config.json`` naming
    ``eagle3``)."""
    import tempfile

    from safetensors.torch import save_file

    out = Path(out_dir)
    _recover(out)
    if out.exists() and not _is_export(out):
        raise FileExistsError(f"{out} exists and is not an EAGLE-3 checkpoint folder ({' + '.join(FILES)}); "
                              "give a new folder")
    config = speculators_config(head, verifier=verifier, verifier_architectures=verifier_architectures,
                                speculative_tokens=speculative_tokens,
                                max_position_embeddings=max_position_embeddings, dtype=dtype)
    tensors = speculators_tensors(head, dtype, embed=embed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp{os.getpid()}-"))
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old{os.getpid()}-"))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        mask = os.umask(0)
        os.umask(mask)
        for name in FILES:  # readable as open(..., "w") makes files (the weights writer makes them private)
            os.chmod(tmp / name, 0o666 & ~mask)
        os.chmod(tmp, 0o777 & ~mask)  # and the folder as mkdir makes one (mkdtemp makes it private)
        if out.exists():
            os.replace(out, old)  # onto the empty folder made above
        try:
            os.replace(tmp, out)
        except BaseException:
            if old.exists() and not out.exists():
                os.replace(old, out)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return {"out": str(out), "bytes": sum((out / f).stat().st_size for f in FILES),
            "draft_vocab_size": config["draft_vocab_size"],
            "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]}


def _is_export(folder: Path) -> bool:
    """Whether ``folder`` is an EAGLE-3 checkpoint folder (nothing but its two files; config.json names eagle3)."""
    if not folder.is_dir() or folder.is_symlink() or set(os.listdir(folder)) - set(FILES):
        return False
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        return config.get("speculators_model_type") == "eagle3"
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def _recover(out: Path) -> None:
    """Clean up after a writer of ``out`` that was killed: its half-built folders go; where ``out`` is missing
    and the old export it had moved aside is still there, that export is put back."""
    from ..files import pid_alive

    if not out.parent.is_dir():
        return
    for entry in sorted(out.parent.iterdir()):
        for kind in ("tmp", "old"):
            prefix = f".{out.name}.{kind}"
            if not entry.name.startswith(prefix) or not entry.is_dir() or entry.is_symlink():
                continue
            pid = entry.name[len(prefix):].partition("-")[0]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            if kind == "old" and not out.exists() and _is_export(entry):
                os.replace(entry, out)
            else:
                shutil.rmtree(entry, ignore_errors=True)


def _require(cond: bool, where: Path, msg: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {msg}")


def read_speculators(path: str | Path
                     ) -> tuple[HeadConfig, dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(config, trained tensors, vocab_ids, lm_head rows, embedding table or None)`` of a ``speculators``
    EAGLE-3 checkpoint folder that :class:`~treespec.drafting.eagle3.Eagle3Head` can compute: one Llama layer,
    no grouped-query attention, none of the optional norms (``norm_before_fc``, ``fc_norm``, ``norm_output``,
    ``norm_before_residual``). Anything else is refused in one line naming it."""
    from safetensors import safe_open

    path = Path(path)
    _require(path.is_dir() and (path / "config.json").is_file() and (path / "model.safetensors").is_file(), path,
             "not an EAGLE-3 checkpoint folder (config.json + model.safetensors)")
    try:
        conf = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}/config.json: not readable JSON ({type(err).__name__})") from None
    _require(isinstance(conf, dict) and conf.get("speculators_model_type") == "eagle3", path,
             "config.json is not a speculators EAGLE-3 config (speculators_model_type != 'eagle3')")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        _require(not conf.get(flag, False), path, f"{flag} is set; treespec's EAGLE-3 head computes without it")
    layer = conf.get("transformer_layer_config")
    _require(isinstance(layer, dict) and layer.get("num_hidden_layers", 1) == 1, path,
             "transformer_layer_config must describe one decoder layer")
    _require(layer.get("model_type", "llama") == "llama", path,
             f"a {layer.get('model_type')!r} decoder layer is not supported (only llama)")
    heads, kv = layer.get("num_attention_heads"), layer.get("num_key_value_heads", layer.get("num_attention_heads"))
    _require(heads == kv, path, f"grouped-query attention ({heads} query, {kv} key/value heads) is not supported")
    plain = layer.get("hidden_act", "silu") == "silu" and not layer.get("attention_bias") and not layer.get("mlp_bias")
    _require(plain, path, "only a bias-free SwiGLU (silu) layer is supported")
    _require(isinstance(layer.get("rope_scaling") or {}, dict) and isinstance(layer.get("rope_parameters") or {}, dict),
             path, "rope_scaling / rope_parameters must be JSON objects")
    scaling = layer.get("rope_scaling") or {}
    _require(scaling.get("rope_type", scaling.get("type", "default")) == "default", path,
             f"rope_scaling {scaling!r} is not supported")
    rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": layer.get("rope_theta", 10000.0)}
    _require(rope.get("rope_type", "default") == "default", path,
             f"rope_type {rope.get('rope_type')!r} is not supported")
    ids = conf.get("eagle_aux_hidden_state_layer_ids")
    _require(isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 1 for i in ids), path,
             f"eagle_aux_hidden_state_layer_ids must name target layers >= 1, got {ids!r}")
    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as err:  # safetensors' SafetensorError (garbage, truncated) is no ValueError
        raise ValueError(f"{path}/model.safetensors: not a readable safetensors file ({type(err).__name__})") from None
    vocab = int(layer.get("vocab_size", 0))
    if "d2t" in tensors:
        d2t = tensors.pop("d2t").long()
        vocab_ids = d2t + torch.arange(d2t.numel())
        t2d = tensors.pop("t2d", None)
        if t2d is not None:
            _require(t2d.numel() == vocab and bool(torch.equal(torch.nonzero(t2d.bool()).flatten(), vocab_ids)), path,
                     "t2d and d2t name different token subsets")
    else:
        vocab_ids = torch.arange(vocab)
    _require(conf.get("draft_vocab_size", vocab_ids.numel()) == vocab_ids.numel(), path,
             f"draft_vocab_size {conf.get('draft_vocab_size')!r} does not match d2t ({vocab_ids.numel()} tokens)")
    lm_head = tensors.pop("lm_head.weight", None)
    _require(lm_head is not None and lm_head.shape[0] == vocab_ids.numel(), path,
             "lm_head.weight is missing or does not have draft_vocab_size rows")
    for key in ("verifier_lm_head.weight", "verifier_norm.weight"):
        tensors.pop(key, None)  # the target's own, taken from it when the head is attached
    embed = tensors.pop("embed_tokens.weight", None)
    try:
        cfg = HeadConfig(hidden_size=int(layer["hidden_size"]), target_vocab_size=vocab, num_heads=int(heads),
                         head_dim=int(layer.get("head_dim") or layer["hidden_size"] // heads),
                         intermediate_size=int(layer["intermediate_size"]), rope_theta=float(rope["rope_theta"]),
                         rms_eps=float(layer.get("rms_norm_eps", 1e-6)), feature_layers=tuple(i - 1 for i in ids))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: transformer_layer_config lacks or mangles a size ({type(err).__name__}: {err})") \
            from None
    return cfg, tensors, vocab_ids, lm_head, embed


def load_speculators(path: str | Path, target, *, dtype: torch.dtype = torch.float32,
                     device: torch.device | str | None = None) -> Eagle3Head:
    """An :class:`~treespec.drafting.eagle3.Eagle3Head` from a ``speculators`` EAGLE-3 checkpoint folder,
    attached to ``target``; refused where the checkpoint's ``lm_head`` (or embedding table) is not ``target``'s
    own LM-head rows on its subset (its input embedding): a head made for another target, since treespec
    computes with the target's own."""
    from .subset_head import _target_device
    from .weights_file import build_checked

    cfg, tensors, vocab_ids, lm_head, embed = read_speculators(path)
    head = build_checked(path, Eagle3Head.FILE_WHAT, HeadConfig, cfg.record(), tensors,
                         lambda c: Eagle3Head(c, vocab_ids))
    head.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
    head = head.to(device=device or _target_device(target), dtype=dtype).eval().attach(target)
    for name, stored, own in (("lm_head.weight", lm_head, head.lm_rows),
                              ("embed_tokens.weight", embed, head.embedding_table)):
        same = stored is None or (stored.shape == own.shape and torch.allclose(
            stored.float(), own.detach().float().cpu(), rtol=2 ** -7, atol=1e-6))
        _require(same, Path(path), f"{name} is not this target's own (a head made for another target?)")
    return head
