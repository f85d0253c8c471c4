"""Does vllm-project's ``speculators`` load treespec's EAGLE-3 export and compute what treespec computes?

Two steps in two environments (``speculators`` 0.9.0 pins transformers <= 5.19, treespec needs >= 5.20):

1. ``export`` (treespec's environment): an EAGLE-3 head on the target (a head file, or random weights with
   every norm gain perturbed, so that a swapped or dropped tensor shows) is written as a ``speculators``
   checkpoint in float32 under ``OUT/checkpoint``; ``OUT/inputs.safetensors`` gets the inputs of one parallel
   pass over a token sequence (the target's fused layers, tokens, positions) and treespec's logits at draft
   depths 1..D (:meth:`~treespec.drafting.eagle3.Eagle3Head.unroll`). Both sides compute in float64 from the
   same float32 weights, so that rounding stays far below the 1e-6 the comparison allows.
2. ``compare`` (an environment with ``speculators``; imports nothing of treespec): the checkpoint is loaded
   with ``speculators``' own ``Eagle3DraftModel.from_pretrained`` (which takes the input embedding from the
   verifier: the checkpoint names a local folder, ``OUT/verifier``, with the target's config and embedding under
   their Hugging Face names, since nothing is downloaded here), and its training-time-test
   forward runs D steps on the same inputs. Its step-``s`` logits at index ``j`` are treespec's depth ``s + 1``
   at index ``j + s``; ``OUT/record.json`` gets the largest difference per depth, the argmax agreement and the
   export's record.

    .venv/bin/python benchmarks/speculators_check.py export --out DIR [--head FILE] [--depths 3] [--twin]
    SPEC_PY benchmarks/speculators_check.py compare --out DIR

``--twin`` writes the checkpoint with two norms' names swapped, a writer's mistake the comparison must catch.
SPEC_PY: a Python with ``speculators==0.9.0`` and its transformers (5.19); torch may come from treespec's
environment (e.g. a venv holding speculators, transformers 5.19 and its other requirements, with a ``.pth``
line naming treespec's site-packages after its own).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TEXT = ("The river rose through the night, and by morning the low fields were a sheet of grey water. "
        "def add(a, b):\n    return a + b\n")


def export(out: Path, head_file: str | None, depths: int, seed: int, twin: bool = False) -> dict:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import git_state, machine_info
    from treespec.drafting.eagle3 import Eagle3Head, new_eagle3_head
    from treespec.drafting.eagle3_export import save_speculators
    from treespec.models.features import model_features
    from treespec.models.loading import load_model, load_tokenizer

    torch.manual_seed(seed)
    target = load_model("embedded", dtype="float32").eval()
    tok = load_tokenizer("embedded")
    if head_file:
        head, weights = Eagle3Head.load(head_file, target), f"trained: {head_file}"
    else:
        head = new_eagle3_head(target, torch.arange(0, 262144, 16), seed=seed)
        with torch.no_grad():  # every gain differs from 1, so that a swapped or dropped norm shows
            for name, p in head.named_parameters():
                if p.dim() == 1:
                    p.copy_(1 + 0.5 * torch.randn_like(p))
        weights = "random (a layout check: gains perturbed)"
    ids = torch.tensor([tok(TEXT)["input_ids"]])  # [1, L]
    k = len(head.cfg.feature_layers)
    out.mkdir(parents=True, exist_ok=True)
    verifier = _verifier_folder(target, out / "verifier")
    written = save_speculators(head, out / "checkpoint", dtype=torch.float32, verifier=verifier,
                               verifier_architectures=["Gemma3ForCausalLM"])
    if twin:  # the broken twin: a writer that swapped the two input norms' names
        _swap_norms(out / "checkpoint" / "model.safetensors")
    with torch.no_grad():  # both sides compute in float64 from the same float32 weights: rounding stays far below 1e-6
        feats = model_features(target, ids, layers=head.cfg.feature_layers)[0].double()  # [L, (k + 1) H]
        hidden, tokens = feats[None, :-1], ids[:, 1:]  # entry j reads the features at j - 1 and token x_j
        positions = torch.arange(1, ids.shape[1])[None]
        head = head.double()
        head.lm_rows = head.lm_rows.double()
        outs = head.unroll(hidden, tokens, positions, depths)
        logits = torch.stack([head.logits(f[0], float32=False) for f in outs])  # [D, L - 1, |S|]
    save_file({"aux": hidden[..., : k * head.cfg.hidden_size].contiguous(), "tokens": tokens.contiguous(),
               "positions": positions.contiguous(), "treespec_logits": logits.contiguous()},
              str(out / "inputs.safetensors"))
    record = {"step": "export", "weights": weights,
              "twin": "input_layernorm and hidden_norm swapped" if twin else None, "depths": depths,
              "sequence_length": int(ids.shape[1]),
              "export": written, "machine": machine_info(), "git": git_state(), "command": sys.argv}
    (out / "export.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return record


def _swap_norms(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(str(path))
    a, b = "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight"
    t[a], t[b] = t[b], t[a]
    save_file(t, str(path), metadata={"format": "pt"})


def _verifier_folder(target, folder: Path) -> str:
    """A local stand-in for the verifier's hub folder: its config and the tensors ``speculators`` reads from it
    (the input embedding under the Hugging Face name, the final norm); the LM head is tied to the embedding."""
    import shutil

    from safetensors.torch import save_file
    from treespec.models.loading import embedded_gemma_dir

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(embedded_gemma_dir(progress=False) / "config.json", folder / "config.json")
    save_file({"model.embed_tokens.weight": target.get_input_embeddings().weight.detach().contiguous(),
               "model.norm.weight": target.model.norm.weight.detach().contiguous()}, str(folder / "model.safetensors"))
    return str(folder)


def compare(out: Path) -> dict:
    from importlib.metadata import version
    import torch
    import transformers
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    inp = load_file(str(out / "inputs.safetensors"))
    depths = inp["treespec_logits"].shape[0]
    config = Eagle3SpeculatorConfig.from_pretrained(str(out / "checkpoint"))
    config.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001 (flex attention needs a GPU)
    model = Eagle3DraftModel.from_pretrained(str(out / "checkpoint"), config=config)
    model = model.double().eval()
    caught: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, res: caught.append(res.detach()))
    t = inp["tokens"].shape[1]
    with torch.no_grad():
        model(hidden_states=inp["aux"], input_ids=inp["tokens"], document_ids=torch.zeros(1, t, dtype=torch.long),
              position_ids=inp["positions"], ttt_steps=depths)
    hook.remove()
    rows = []
    for s, theirs in enumerate(caught):  # step s at index j = treespec's depth s + 1 at index j + s
        a = theirs[0, : t - s]
        b = inp["treespec_logits"][s, s:]
        rows.append({"depth": s + 1, "rows": int(a.shape[0]), "max_abs_diff": float((a - b).abs().max()),
                     "logit_std": float(b.std()),
                     "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())})
    record = {"step": "compare", "speculators": version("speculators"), "transformers": transformers.__version__,
              "torch": torch.__version__, "attention": "eager", "depths": rows,
              "equal_within_1e-6": all(r["max_abs_diff"] <= 1e-6 for r in rows),
              "export": json.loads((out / "export.json").read_text()), "command": sys.argv}
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=("export", "compare"))
    ap.add_argument("--out", type=Path, required=True, help="the folder both steps share")
    ap.add_argument("--head", help="an EAGLE-3 head file (default: random weights, a layout check)")
    ap.add_argument("--depths", type=int, default=3, help="draft depths compared (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--twin", action="store_true",
                    help="export: write the broken twin (two norms swapped), which compare must find unequal")
    args = ap.parse_args(argv)
    if args.depths < 1:
        print("error: --depths must be >= 1", file=sys.stderr)
        return 2
    if args.step == "export":
        record = export(args.out, args.head, args.depths, args.seed, args.twin)
    else:
        record = compare(args.out)
    print(json.dumps({k: v for k, v in record.items() if k != "machine"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
