"""The target's own continuations of many prompts, generated in resumable, seeded chunks.

Stage 1 of a distillation corpus: only token ids are produced here (cheap to store, ~4 bytes a
position), so the expensive part of corpus building (autoregressive generation) is done once and
the teacher-forced labels (hidden states, top-k log-probabilities of any layer) can be recomputed
from the ids in one batched pass whenever the training recipe changes.

The generator is a lean batched loop over the model's own forward with a KV cache: left-padded
prompts, explicit position ids, the LM head applied to the last position only, greedy = argmax of
the logits, sampling = an exact draw from ``softmax(logits / T)`` in float32 with a per-chunk seeded
``torch.Generator``. Rows stop at their first EOS. Measured against Hugging Face ``generate`` by
``benchmarks/bench_continuations.py``.

A chunk is one gzip-compressed JSON file ``chunk-NNNNN.json.gz`` (folders written before chunks were compressed
hold ``chunk-NNNNN.json``, read alike) holding the prompt indices, the prompts' token counts and the generated ids;
a manifest fingerprints the recipe (prompt file hash, options) so a resumed run cannot mix recipes. A chunk is
written atomically; a killed run loses at most the chunk it was on.

Stage 2, :func:`build_corpus_from_continuations`, teacher-forces the target on the stored
continuations into a corpus of :mod:`.corpus` (one shard per finished chunk).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..files import atomic_write_gzip, atomic_write_json, remove_stale_temporaries
from ..sampling import draw, first_argmax
from .corpus import (DEFAULT_TRAIN, HELD_OUT_FROM, CorpusOptions, ShardBuffer, check_not_eval, open_corpus,
                     read_prompts)
from .corpus import MANIFEST as CORPUS_MANIFEST
from .inputs import DistillInputError, read_json_object, require_count, require_type

MANIFEST = "manifest.json"
FORMAT = 1
#: the draw algorithm of sampled chunks (2: treespec.sampling.draw, two independent uniforms per token)
SAMPLER = 2


@dataclass(frozen=True)
class ContinuationOptions:
    """mode: "greedy" or "sample" (temperature ``temperature``, no top-k / top-p).
    new_tokens: cap on generated tokens per prompt (a row ends earlier at EOS).
    max_prompt_tokens: prompts are cut to their last this many tokens (memory / time bound).
    batch_size: prompts per batched generation; chunk_size: prompts per stored chunk (a multiple of it)."""

    mode: str = "greedy"
    temperature: float = 1.0
    new_tokens: int = 256
    max_prompt_tokens: int = 512
    batch_size: int = 32
    chunk_size: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("greedy", "sample"):
            raise ValueError(f"mode must be 'greedy' or 'sample', got {self.mode!r}")
        if self.mode == "sample" and not (self.temperature > 0 and self.temperature < float("inf")):
            raise ValueError(f"sampling needs a finite temperature > 0, got {self.temperature!r}")
        for name in ("new_tokens", "max_prompt_tokens", "batch_size", "chunk_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.chunk_size % self.batch_size:
            raise ValueError(f"chunk_size ({self.chunk_size}) must be a multiple of batch_size ({self.batch_size})")


def _head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """``[B, H]`` last hidden states -> ``[B, V]`` float32 logits (LM head + soft-capping if any)."""
    logits = model.get_output_embeddings()(hidden).float()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _pick(logits: torch.Tensor, opts: ContinuationOptions, generator: torch.Generator | None) -> torch.Tensor:
    """``[B, V]`` float32 logits -> ``[B]`` next tokens (argmax, or an exact draw at the temperature)."""
    if opts.mode == "greedy":
        return first_argmax(logits)
    return draw(torch.softmax(logits / opts.temperature, dim=-1), generator)[:, 0]


@torch.no_grad()
def continue_batch(model, prompts: list[list[int]], opts: ContinuationOptions, eos: set[int],
                   generator: torch.Generator | None = None) -> list[list[int]]:
    """Continuations (each cut after its first EOS) of a batch of token-id prompts, in one batched loop."""
    from transformers import DynamicCache

    from ..models.kv_cache import cache_kwargs

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, width, dtype=torch.long)  # [B, T] left-padded
    att = torch.zeros(b, width, dtype=torch.long)  # [B, T] 1 = real token
    for k, p in enumerate(prompts):
        ids[k, width - len(p):] = torch.tensor(p)
        att[k, width - len(p):] = 1
    ids, att = ids.to(device), att.to(device)
    positions = (att.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    cache = DynamicCache(config=model.config)
    body = model.base_model
    out = body(input_ids=ids, attention_mask=att, position_ids=positions, **cache_kwargs(body, cache), use_cache=True)
    tok = _pick(_head_logits(model, out.last_hidden_state[:, -1]), opts, generator)  # [B]
    pos = positions[:, -1]  # [B]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    generated = torch.empty(b, opts.new_tokens, dtype=torch.long, device=device)  # [B, N]
    steps = opts.new_tokens
    for i in range(opts.new_tokens):
        generated[:, i] = tok
        done |= torch.isin(tok, eos_ids)
        if i + 1 == opts.new_tokens or bool(done.all()):  # one host sync a step, for the early stop
            steps = i + 1
            break
        att = torch.cat([att, torch.ones(b, 1, dtype=att.dtype, device=device)], dim=1)
        pos = pos + 1
        out = body(input_ids=tok[:, None], attention_mask=att, position_ids=pos[:, None],
                   **cache_kwargs(body, cache), use_cache=True)
        tok = _pick(_head_logits(model, out.last_hidden_state[:, -1]), opts, generator)
    rows = generated[:, :steps].tolist()
    conts = []
    for row in rows:
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        conts.append(row[:cut])
    return conts


def _fingerprint(prompt_ids: list[list[int]], opts: ContinuationOptions, model_name: str) -> str:
    recipe = {"opts": asdict(opts), "model": model_name, "format": FORMAT}
    if opts.mode == "sample":  # the sampler's random stream is part of a sampled recipe
        recipe["sampler"] = SAMPLER
    h = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode())
    for p in prompt_ids:
        h.update(len(p).to_bytes(4, "little"))
        h.update(torch.tensor(p, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()


def build_continuations(model, prompt_ids: list[list[int]], out_dir: str | Path,
                        opts: ContinuationOptions = ContinuationOptions(), *, eos: set[int],
                        model_name: str = "", time_limit_s: float | None = None, progress: bool = True,
                        source: dict | None = None) -> dict:
    """Generate continuations of ``prompt_ids`` chunk by chunk into ``out_dir``; resumes; returns the manifest.

    Chunk ``c`` covers prompts ``[c * chunk_size, (c + 1) * chunk_size)`` and is sampled with a
    generator seeded by ``(seed, c)``, so a chunk's content does not depend on where a run stopped.
    Stops after a finished chunk once ``time_limit_s`` is spent. ``source`` (e.g. the prompt file's
    name and row range) is recorded in the manifest for readers (:func:`continuation_sequences`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    prompts = [list(map(int, p))[-opts.max_prompt_tokens:] for p in prompt_ids]
    fp = _fingerprint(prompts, opts, model_name)
    mpath = out / MANIFEST
    n_chunks = -(-len(prompts) // opts.chunk_size)
    if mpath.exists():
        manifest = load_continuation_manifest(out)
        if manifest["fingerprint"] != fp:
            raise ValueError(f"{out} holds continuations of other prompts or options; use another directory")
    else:
        manifest = {"format": FORMAT, "fingerprint": fp, "options": asdict(opts), "model": model_name,
                    "num_prompts": len(prompts), "num_chunks": n_chunks, "chunks_done": [],
                    "generated_tokens": 0, "seconds": 0.0, "complete": False}
        atomic_write_json(mpath, manifest)
    if source is not None and manifest.get("source") != source:  # where the prompts came from (a record:
        manifest["source"] = source  # the fingerprint, not this, is what a later reader checks)
        atomic_write_json(mpath, manifest)
    device = next(model.parameters()).device
    start = time.perf_counter()
    for c in range(n_chunks):
        if c in manifest["chunks_done"]:
            continue
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            break
        t0 = time.perf_counter()
        gen = torch.Generator(device=device).manual_seed(opts.seed * 1_000_003 + c)
        lo, hi = c * opts.chunk_size, min((c + 1) * opts.chunk_size, len(prompts))
        # within a chunk, similar lengths share a batch (less padding); the order is deterministic
        order = sorted(range(lo, hi), key=lambda j: (len(prompts[j]), j))
        conts: dict[int, list[int]] = {}
        for s in range(0, len(order), opts.batch_size):
            idx = order[s:s + opts.batch_size]
            for j, cont in zip(idx, continue_batch(model, [prompts[j] for j in idx], opts, eos, gen)):
                conts[j] = cont
        rows = [{"index": j, "prompt_tokens": len(prompts[j]), "continuation": conts[j]} for j in range(lo, hi)]
        write_chunk(out, c, rows)
        dt = time.perf_counter() - t0
        manifest["chunks_done"] = sorted(manifest["chunks_done"] + [c])
        manifest["generated_tokens"] += sum(len(r["continuation"]) for r in rows)
        manifest["seconds"] += dt
        manifest["complete"] = len(manifest["chunks_done"]) == n_chunks
        atomic_write_json(mpath, manifest)
        if progress:
            rate = manifest["generated_tokens"] / max(manifest["seconds"], 1e-9)
            print(f"continuations: chunk {c + 1}/{n_chunks} in {dt:.0f} s, {manifest['generated_tokens']} tokens "
                  f"so far ({rate:.1f} tokens/s)", flush=True)
    return manifest


@dataclass(frozen=True)
class StoredContinuations:
    """A continuation folder checked against the prompts it was generated from (see
    :func:`continuation_sequences`)."""

    folder: Path
    prompts: list  # list[list[int]], every prompt of the recipe, cut as when generating
    fingerprint: str
    chunks: list  # list[int], finished chunks
    num_prompts: int
    complete: bool

    def chunk(self, c: int) -> tuple[list[list[int]], list[int]]:
        """Sequences ``prompt + continuation`` of chunk ``c`` and the first generated position of each."""
        rows = read_chunk_rows(self.folder, c, len(self.prompts))
        seqs, gen_start = [], []
        for r in rows:
            prompt = self.prompts[r["index"]]
            if len(prompt) != r["prompt_tokens"]:
                raise ValueError(f"{self.folder}: chunk {c}, row {r['index']}: prompt length differs from the "
                                 "stored one (another tokenizer or prompt file)")
            seqs.append(prompt + [int(t) for t in r["continuation"]])
            gen_start.append(len(prompt))
        return seqs, gen_start


def continuation_sequences(out_dir: str | Path, prompt_ids: list[list[int]]) -> StoredContinuations:
    """The finished chunks of a continuation folder, with ``prompt_ids`` checked against its fingerprint.

    ``prompt_ids`` must be every prompt the folder's recipe was given, in order (the fingerprint
    covers their token ids, the options and the model name): other prompts, another tokenizer or
    another row range are refused by name instead of silently pairing continuations with the
    wrong prompts.
    """
    out = Path(out_dir)
    mpath = out / MANIFEST
    if not mpath.is_file():
        raise ValueError(f"{out}: no continuation manifest ({MANIFEST})")
    manifest = load_continuation_manifest(out)
    try:
        opts = ContinuationOptions(**manifest["options"])
    except (TypeError, ValueError) as err:
        raise DistillInputError(f"continuation manifest {mpath}: damaged options ({err})") from None
    prompts = [list(map(int, p))[-opts.max_prompt_tokens:] for p in prompt_ids]
    if _fingerprint(prompts, opts, manifest.get("model", "")) != manifest["fingerprint"]:
        raise ValueError(f"{out}: these continuations were generated from other prompts (another prompt file, "
                         "row range or tokenizer) or another recipe")
    return StoredContinuations(out, prompts, manifest["fingerprint"], sorted(manifest["chunks_done"]),
                               manifest["num_prompts"], bool(manifest["complete"]))


def read_continuations(out_dir: str | Path) -> list[dict]:
    """Every stored row ``{"index", "prompt_tokens", "continuation"}`` of a continuation folder, by index."""
    out = Path(out_dir)
    manifest = load_continuation_manifest(out)
    rows = []
    for c in manifest["chunks_done"]:
        rows.extend(read_chunk_rows(out, c, manifest["num_prompts"]))
    return sorted(rows, key=lambda r: r["index"])


def load_continuation_manifest(out_dir: str | Path) -> dict:
    """The manifest of a continuation folder, checked: a damaged file or a missing / mistyped entry
    (``chunks_done`` must list chunk numbers below ``num_chunks``) is a :class:`.inputs.DistillInputError`."""
    path = Path(out_dir) / MANIFEST
    man = read_json_object(path, "continuation manifest")
    where = f"continuation manifest {path}"
    require_type(man, "fingerprint", str, where)
    require_type(man, "options", dict, where)
    require_type(man, "complete", bool, where)
    require_count(man, "num_prompts", where)
    chunks = require_count(man, "num_chunks", where)
    for c in require_type(man, "chunks_done", list, where):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < chunks:
            raise DistillInputError(f"{where}: chunks_done holds {c!r}, not a chunk number below {chunks}")
    return man


def chunk_path(folder: Path, c: int) -> Path:
    """Where chunk ``c`` of ``folder`` is: ``chunk-NNNNN.json.gz``, or the uncompressed ``.json`` of older folders."""
    plain = Path(folder) / f"chunk-{c:05d}.json"
    packed = plain.with_name(plain.name + ".gz")
    return plain if plain.is_file() and not packed.is_file() else packed


def write_chunk(folder: Path, c: int, rows: list[dict]) -> Path:
    """Write chunk ``c`` atomically as gzip-compressed JSON (no time stamp: the same rows give the same bytes under
    one Python version) and remove an older uncompressed copy."""
    path = Path(folder) / f"chunk-{c:05d}.json.gz"
    atomic_write_gzip(path, json.dumps({"chunk": c, "rows": rows}).encode("utf-8"))
    (Path(folder) / f"chunk-{c:05d}.json").unlink(missing_ok=True)  # an older, uncompressed copy
    return path


def read_chunk_rows(folder: Path, c: int, num_prompts: int) -> list[dict]:
    """The rows ``{"index", "prompt_tokens", "continuation"}`` of chunk ``c``, checked (indices below
    ``num_prompts``, counts and token ids non-negative integers)."""
    path = chunk_path(folder, c)
    rows = require_type(read_json_object(path, "continuation chunk"), "rows", list, f"continuation chunk {path}")
    for n, r in enumerate(rows):
        at = f"continuation chunk {path}, row {n}"
        if not isinstance(r, dict):
            raise DistillInputError(f"{at}: expected a JSON object")
        if require_count(r, "index", at) >= num_prompts:
            raise DistillInputError(f"{at}: index {r['index']} beyond the {num_prompts} prompts")
        require_count(r, "prompt_tokens", at)
        cont = require_type(r, "continuation", list, at)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in cont):
            raise DistillInputError(f"{at}: the continuation holds something other than token ids")
    return rows


@torch.no_grad()
def build_corpus_from_continuations(model, prompt_ids: list[list[int]], continuations_dir: str | Path,
                                    out_dir: str | Path, opts: CorpusOptions = CorpusOptions(), *,
                                    progress: bool = True, time_limit_s: float | None = None) -> dict:
    """Stage 2: teacher-force ``model`` on stored continuations (this module's stage 1), one shard per chunk.

    ``prompt_ids`` are the prompts the continuations were generated from (all of the recipe's rows,
    in order); they are checked against the continuation folder's fingerprint, so the sequences
    rebuilt here are exactly ``prompt + continuation`` as generated (``gen_start`` = the prompt's
    length). Chunks finished later are added by calling again: the corpus follows its continuation
    folder (its fingerprint is the folder's recipe plus ``opts``), and training may start on the
    shards that exist. Returns the manifest; ``complete`` once every chunk of a complete folder is in.
    """
    from tqdm import tqdm

    if opts.continuation != "none":
        raise DistillInputError("the continuations are stored already: continuation must be 'none' here")
    cont = continuation_sequences(continuations_dir, prompt_ids)  # checks the fingerprint
    fp = hashlib.sha256(json.dumps([cont.fingerprint, opts.record()], sort_keys=True).encode()).hexdigest()
    out, manifest = open_corpus(model, out_dir, fp, {"options": opts.record(),
                                                     "continuations": cont.fingerprint,
                                                     "num_input_sequences": cont.num_prompts})
    done = {sh["chunk"] for sh in manifest["shards"]}
    todo = [c for c in cont.chunks if c not in done]
    start_time = time.perf_counter()
    buf = ShardBuffer(manifest["vocab_size"])
    for c in tqdm(todo, unit="chunk", desc="corpus", disable=not progress):
        if time_limit_s is not None and time.perf_counter() - start_time > time_limit_s:
            break
        seqs, gen_start = cont.chunk(c)
        order = sorted(range(len(seqs)), key=lambda k: (len(seqs[k]), k))  # similar lengths share a batch
        for s in range(0, len(order), opts.batch_size):
            idx = order[s:s + opts.batch_size]
            buf.add(model, [seqs[k] for k in idx], [gen_start[k] for k in idx], opts)
        buf.flush(out, manifest, chunk=c)
    manifest["complete"] = cont.complete and len(manifest["shards"]) == len(cont.chunks)
    atomic_write_json(out / CORPUS_MANIFEST, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    """``python -m treespec.distill.continuations --name NAME --mode greedy --rows 0:6000 ...``"""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m treespec.distill.continuations",
                                 description="the target's own continuations of train prompts, in resumable chunks")
    ap.add_argument("--prompts", default=None, help="train prompts jsonl (default: ../shared/data/train)")
    ap.add_argument("--name", required=True, help="folder under <cache>/distill/continuations/ (or under --out)")
    ap.add_argument("--out", default=None,
                    help="parent folder of NAME instead of the cache, e.g. a tracked folder of the repo so that "
                         "finished chunks survive a lost cache")
    ap.add_argument("--rows", default="0:11000",
                    help="START:END of the seeded prompt order (seed 0); rows 11000: are held out")
    ap.add_argument("--mode", choices=["greedy", "sample"], default="greedy")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=None, help="minutes; stops after a finished chunk")
    ap.add_argument("--held-out-rows", action="store_true",
                    help="allow rows of the held-out part of the seeded order (e.g. continuations to measure on)")
    args = ap.parse_args(argv)
    from ..models.loading import cache_root, load_model, load_tokenizer

    try:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
        opts = ContinuationOptions(mode=args.mode, temperature=args.temperature, new_tokens=args.new_tokens,
                                   max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                                   chunk_size=args.chunk_size, seed=args.seed)
        path = check_not_eval(args.prompts or DEFAULT_TRAIN)
        start, _, end = args.rows.partition(":")
        all_rows = read_prompts(path, seed=0)
        stop = int(end) if end else len(all_rows)
        if stop > HELD_OUT_FROM and not args.held_out_rows:
            raise ValueError(f"--rows {args.rows}: rows {HELD_OUT_FROM}: of the seeded order are held out for "
                             "tuning and measurement (pass --held-out-rows to generate from them anyway)")
        rows = all_rows[int(start or 0): stop]
        if not rows:
            raise ValueError(f"--rows {args.rows} selects no prompts of {path}")
    except ValueError as err:
        print(f"treespec.distill.continuations: error: {err}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer("embedded")
    model = load_model("embedded", dtype=args.dtype)
    from ..models.loading import eos_token_ids

    prompt_ids = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    out = (Path(args.out) if args.out else cache_root() / "distill" / "continuations") / args.name
    limit = None if args.time_limit is None else args.time_limit * 60
    try:
        manifest = build_continuations(model, prompt_ids, out, opts, eos=eos_token_ids(model),
                                       model_name="embedded:gemma-3-270m", time_limit_s=limit,
                                       source={"prompts": path.name, "rows": args.rows, "order_seed": 0})
    except ValueError as err:  # a damaged folder, or one of another recipe
        print(f"treespec.distill.continuations: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({k: manifest[k] for k in ("num_prompts", "num_chunks", "generated_tokens", "seconds",
                                               "complete")} | {"chunks_done": len(manifest["chunks_done"]),
                                                               "dir": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
