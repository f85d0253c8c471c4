"""Distillation corpus: teacher-forced target forwards, sharded to disk, resumable.

For every token sequence (a train prompt, optionally followed by the target's own continuation) the
target runs one teacher-forced forward; per position ``j`` the shard keeps

* ``hidden``   ``[N, H]`` bf16: the target's last hidden state (post final norm) at ``j``;
* ``features`` ``[N, k * H]`` bf16, only with ``CorpusOptions.feature_layers`` (k layers): the outputs of
  those decoder layers at ``j``, in order (what a head with fused features reads besides ``hidden``,
  :mod:`treespec.models.features`);
* ``tokens``   ``[N]`` int32: ``x_j``;
* ``topk_ids`` ``[N, k]`` int32 and ``topk_logp`` ``[N, k]`` float16: the target's top-k next-token
  log-probabilities at ``j`` (full-vocabulary softmax, soft-capping included);
* ``offsets``  ``[S + 1]`` int64: where each sequence starts; ``gen_start`` ``[S]`` int64: the first
  position written by the target (= sequence length when there is no continuation);
* ``counts``   ``[V]`` float32: per token, occurrences as a next token plus top-k probability mass
  (used to choose the draft's vocabulary subset).

Shards are written to a temporary name and renamed; ``manifest.json`` (also replaced atomically)
lists finished shards and how many input sequences they consumed, so an interrupted build resumes
after the last finished shard. The manifest records a fingerprint of the input sequences and
options; resuming with different inputs is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
import unicodedata
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch

from ..files import atomic_write, atomic_write_json, remove_stale_temporaries
from ..models.features import check_feature_layers, model_features, normalise_feature_layers, num_decoder_layers
from .inputs import (DistillInputError, contained_path, first_line, read_json_object, require_count, require_dir,
                     require_file, require_number, require_type)

MANIFEST = "manifest.json"
CORPUS_FORMAT = 1
#: rows of the train prompts' seeded order (``read_prompts(..., seed=0)``) from here on are held out:
#: no distillation corpus recipe uses them; tuning and ablations measure on them
HELD_OUT_FROM = 11000
#: the train prompts every distillation recipe reads (relative to the repository; never the eval set)
DEFAULT_TRAIN = "../shared/data/train/train_prompts.jsonl"
#: the held-out prompts ``python -m treespec.distill evaluate`` measures on by default
DEFAULT_EVAL = "../shared/data/eval/spec_bench.prompts.jsonl"


def shared_dir() -> Path:
    """The shared data folder: ``$TREESPEC_SHARED``, else ``../shared`` next to the repository."""
    env = os.environ.get("TREESPEC_SHARED")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared"


EVAL_SETS = ("spec_bench.prompts.jsonl", "humaneval.prompts.jsonl")


def _normalise(text: str) -> str:
    return " ".join(text.split())


def compact_text(text: str) -> str:
    """What the eval-set guard compares: ``text`` in Unicode NFKC form, case-folded, with every character that
    is not a letter or a digit (a regex word character other than ``_``) dropped: whitespace and punctuation do
    not tell two prompts apart."""
    return _NOT_ALNUM.sub("", unicodedata.normalize("NFKC", text).casefold())


_NOT_ALNUM = re.compile(r"[\W_]+")


#: character n-gram length of the near-duplicate index (one edit changes at most this many n-grams)
GRAM = 7
#: near-duplicates: texts whose n-gram sets have a Jaccard similarity of at least this
NEAR_JACCARD = 0.8
#: containment: a text of at least this many compact characters with this share of its n-grams in the other
CONTAINED_CHARS, CONTAINED_SHARE = 40, 0.9
#: texts up to this many compact characters are compared by edit distance too: at most
#: max(1, length // EDIT_PER) edits (insertions, deletions, substitutions) make a near-duplicate
EDIT_CHARS, EDIT_PER = 400, 20


def _grams(text: str) -> set[str]:
    if len(text) <= GRAM:
        return {text}
    return {text[i:i + GRAM] for i in range(len(text) - GRAM + 1)}


def _within_edits(a: str, b: str, limit: int) -> bool:
    """Whether the Levenshtein distance of ``a`` and ``b`` is at most ``limit`` (a band of the DP table:
    O(len * limit))."""
    if abs(len(a) - len(b)) > limit:
        return False
    if len(a) > len(b):
        a, b = b, a
    big = limit + 1
    prev = {j: j for j in range(0, min(len(b), limit) + 1)}
    for i in range(1, len(a) + 1):
        lo, hi = max(0, i - limit), min(len(b), i + limit)
        row = {}
        for j in range(lo, hi + 1):
            if j == 0:
                row[j] = i
                continue
            cost = prev.get(j - 1, big) + (a[i - 1] != b[j - 1])
            row[j] = min(cost, prev.get(j, big) + 1, row.get(j - 1, big) + 1)
        if min(row.values()) > limit:
            return False
        prev = row
    return prev.get(len(b), big) <= limit


class EvalIndex:
    """The evaluation prompts, indexed to tell whether a training prompt is one of them or a near-duplicate.

    A prompt matches an eval prompt when their :func:`compact_text` forms (case-folded, Unicode-normalised,
    letters and digits only) are equal, or when the two are near-duplicates: character :data:`GRAM`-grams with a
    Jaccard similarity of at least :data:`NEAR_JACCARD`; one contains nearly all n-grams of the other
    (:data:`CONTAINED_SHARE`, for a contained text of at least :data:`CONTAINED_CHARS` characters); or, for
    short texts (up to :data:`EDIT_CHARS`), an edit distance of at most one per :data:`EDIT_PER` characters
    (at least one). Candidates come from an inverted n-gram index, so a check costs the prompt's own n-grams
    plus exact comparisons with the few eval prompts that share many of them, never all pairs."""

    def __init__(self, prompts: list[tuple[str, str]]) -> None:
        """``prompts``: (where, text) pairs, ``where`` naming the eval prompt in messages."""
        self.where: list[str] = []
        self.texts: list[str] = []
        self.sizes: list[int] = []
        self.exact: dict[str, int] = {}
        self.index: dict[str, list[int]] = {}
        for where, text in prompts:
            compact = compact_text(text)
            if not compact or compact in self.exact:
                continue
            i = len(self.texts)
            self.where.append(where)
            self.texts.append(compact)
            self.exact[compact] = i
            grams = _grams(compact)
            self.sizes.append(len(grams))
            for gram in grams:
                self.index.setdefault(gram, []).append(i)

    def __len__(self) -> int:
        return len(self.texts)

    def match(self, text: str) -> tuple[str, str] | None:
        """(how, where) when ``text`` is an eval prompt (``how`` = "equal") or a near-duplicate of one, else None."""
        compact = compact_text(text)
        if not compact:
            return None
        i = self.exact.get(compact)
        if i is not None:
            return "equal", self.where[i]
        grams = _grams(compact)
        n = len(grams)
        shared = Counter(chain.from_iterable(map(self.index.__getitem__, grams & self.index.keys())))
        # the fewest shared n-grams any rule below accepts: edits 0.65 n - 7 (at most one edit per EDIT_PER
        # characters, each changing at most GRAM n-grams), Jaccard 0.8 n, containment 0.9 of the contained text
        floor = min(0.65 * n - GRAM, CONTAINED_SHARE * (CONTAINED_CHARS - GRAM + 1))
        for i, common in sorted(((i, c) for i, c in shared.items() if c >= floor), key=lambda ic: -ic[1]):
            m = self.sizes[i]
            if common / (n + m - common) >= NEAR_JACCARD:
                return "near-duplicate", self.where[i]
            other = self.texts[i]
            smaller = len(compact) if n <= m else len(other)
            if smaller >= CONTAINED_CHARS and common >= CONTAINED_SHARE * min(n, m):
                return "contained" if n <= m else "containing", self.where[i]
            longest = max(len(compact), len(other))
            if longest <= EDIT_CHARS:
                limit = max(1, longest // EDIT_PER)
                # one edit changes at most GRAM n-grams of each text: fewer shared n-grams rule the pair out
                if common >= max(n, m) - GRAM * limit and _within_edits(compact, other, limit):
                    return "near-duplicate", self.where[i]
        return None


_EVAL_INDEX: dict[tuple, EvalIndex] = {}


def eval_prompts() -> set[str]:
    """Every prompt of the evaluation sets (``<shared>/data/eval``), whitespace-normalised."""
    found: set[str] = set()
    for name in EVAL_SETS:
        path = shared_dir() / "data" / "eval" / name
        if path.is_file():
            found.update(_normalise(r["prompt"]) for r in _rows(path) if isinstance(r.get("prompt"), str))
    return found


def eval_index() -> EvalIndex:
    """:class:`EvalIndex` of the evaluation sets (``<shared>/data/eval``), built once per set of files
    (keyed by their paths, sizes and modification times)."""
    paths = [shared_dir() / "data" / "eval" / name for name in EVAL_SETS]
    key = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths if p.is_file())
    if key not in _EVAL_INDEX:
        prompts = [(f"{p.name} row {n}", r["prompt"]) for p in paths if p.is_file()
                   for n, r in enumerate(_rows(p), 1) if isinstance(r.get("prompt"), str)]
        _EVAL_INDEX.clear()
        _EVAL_INDEX[key] = EvalIndex(prompts)
    return _EVAL_INDEX[key]


def check_not_eval(path: str | Path) -> Path:
    """Refuse evaluation data as training input (the eval set is used only to measure).

    By location / name (``data/eval``, ``spec_bench``, ``humaneval``, ``eval``) and by content: a
    file with any prompt equal to a prompt of the evaluation sets up to case, whitespace and punctuation,
    or a near-duplicate of one (one character added, a few changed, an eval prompt inside a longer one:
    :class:`EvalIndex`), is refused, whatever it is called.
    """
    p = Path(path).resolve()
    parts = p.parts
    if any(a == "data" and b == "eval" for a, b in zip(parts, parts[1:])) or "eval" in p.name.lower() \
            or "spec_bench" in p.name or "humaneval" in p.name.lower():
        raise DistillInputError(f"{path}: evaluation data must never be used to build a training corpus")
    index = eval_index()
    for i, row in enumerate(_rows(p)):
        if not isinstance(row.get("prompt"), str):
            continue
        found = index.match(row["prompt"])
        if found is None:
            continue
        how, where = found
        what = {"equal": "a prompt of the evaluation set",
                "near-duplicate": "a near-duplicate of a prompt of the evaluation set",
                "contained": "contained in a prompt of the evaluation set",
                "containing": "a prompt containing a prompt of the evaluation set"}[how]
        raise DistillInputError(f"{path}: prompt {i + 1} is {what} ({shared_dir() / 'data' / 'eval'}, {where}); "
                                "evaluation data must never be used to build a training corpus")
    return p


def _rows(path: str | Path) -> list[dict]:
    """The JSON objects of a jsonl file, with bad files reported as :class:`DistillInputError`."""
    path = require_file(path, "prompts file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DistillInputError(f"prompts file {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    rows = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DistillInputError(f"prompts file {path}, line {n}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DistillInputError(f"prompts file {path}, line {n}: expected a JSON object")
        rows.append(row)
    return rows


def read_prompts(path: str | Path, *, limit: int | None = None, seed: int = 0) -> list[dict]:
    """Rows of a ``{"prompt": ...}`` jsonl file in a seeded random order (the first ``limit``)."""
    rows = _rows(path)
    for n, row in enumerate(rows, 1):
        if not isinstance(row.get("prompt"), str):
            raise DistillInputError(f"prompts file {path}, row {n}: no \"prompt\" string")
    if not rows:
        raise DistillInputError(f"prompts file {path}: no prompts")
    random.Random(seed).shuffle(rows)
    return rows[:limit] if limit else rows


def order_for_batching(seqs: list[list[int]], window: int = 64) -> list[list[int]]:
    """Sort by length inside consecutive windows (less padding, order still deterministic)."""
    out = []
    for i in range(0, len(seqs), window):
        out.extend(sorted(seqs[i:i + window], key=len))
    return out


@dataclass(frozen=True)
class CorpusOptions:
    topk: int = 32
    shard_positions: int = 100_000  # a shard is closed once it holds at least this many positions
    batch_size: int = 4  # sequences per teacher-forced forward
    logits_chunk: int = 256  # positions per full-vocabulary logits block (memory bound)
    continuation: str = "none"  # "none" | "greedy" | "sample" (temperature 1)
    new_tokens: int = 64  # continuation length
    seed: int = 0
    feature_layers: tuple[int, ...] = ()  # decoder layers whose outputs are stored too (fused features)

    def __post_init__(self) -> None:
        for name, low in (("topk", 0), ("shard_positions", 1), ("batch_size", 1), ("logits_chunk", 1),
                          ("new_tokens", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise DistillInputError(f"{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        try:  # a manifest stores a JSON list
            object.__setattr__(self, "feature_layers", normalise_feature_layers(self.feature_layers))
        except ValueError as err:
            raise DistillInputError(str(err)) from None

    def record(self) -> dict:
        """The options as stored in a manifest and fingerprinted (``feature_layers`` only when set, so
        the corpora built before the option existed keep their fingerprints)."""
        out = dict(self.__dict__)
        if out["feature_layers"]:
            out["feature_layers"] = list(out["feature_layers"])
        else:
            del out["feature_layers"]
        return out


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The target's LM head (+ final soft-capping) in float32."""
    head = model.get_output_embeddings()
    logits = head(hidden.to(head.weight.dtype)).float()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(text, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _fingerprint(seqs: list[list[int]], opts: CorpusOptions) -> str:
    h = hashlib.sha256(json.dumps(opts.record(), sort_keys=True).encode())
    for s in seqs:
        h.update(len(s).to_bytes(4, "little"))
        h.update(torch.tensor(s, dtype=torch.int32).numpy().tobytes())
    return h.hexdigest()


def load_manifest(out_dir: str | Path) -> dict:
    """The manifest of a corpus folder, checked (:class:`DistillInputError` if the folder holds no corpus
    or a damaged manifest: a missing or mistyped entry, a shard without positions, a shard file named
    outside the folder)."""
    path = Path(require_dir(out_dir, "corpus")) / MANIFEST
    man = read_json_object(path, "corpus manifest")
    where = f"corpus manifest {path}"
    require_type(man, "fingerprint", str, where)
    require_type(man, "options", dict, where)
    require_type(man, "complete", bool, where)
    for key in ("vocab_size", "hidden_size"):
        require_count(man, key, where, low=1)
    for key in ("positions", "sequences_done"):
        require_count(man, key, where)
    require_number(man, "seconds", where)
    for n, entry in enumerate(require_type(man, "shards", list, where)):
        at = f"{where}, shard {n}"
        if not isinstance(entry, dict):
            raise DistillInputError(f"{at}: expected a JSON object, found {type(entry).__name__}")
        if contained_path(path.parent, require_type(entry, "file", str, at), at).parent != path.parent:
            raise DistillInputError(f"{at}: {entry['file']!r} is not a file of the corpus folder itself")
        require_count(entry, "positions", at, low=1)
        require_count(entry, "sequences", at, low=1)
    return man


#: the tensors every shard holds (``features`` only in corpora built with feature layers)
SHARD_TENSORS = ("hidden", "tokens", "topk_ids", "topk_logp", "offsets", "gen_start", "counts")


def read_shard(path: Path, names: tuple[str, ...] | list[str], positions: int | None = None) -> dict:
    """The tensors ``names`` of the corpus shard ``path``, checked: a missing, truncated or damaged file, a
    missing tensor, or offsets that disagree with the rows (or with the manifest's ``positions``) are a
    :class:`DistillInputError` naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            missing = [k for k in names if k not in fh.keys()]
            if missing:
                raise DistillInputError(f"corpus shard {path}: no tensor {missing[0]!r} (damaged shard)")
            data = {k: fh.get_tensor(k) for k in names}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        if isinstance(err, DistillInputError):
            raise
        raise DistillInputError(f"corpus shard {path}: unreadable (missing, truncated or damaged: "
                                f"{first_line(err)})") from None
    off = data.get("offsets")
    if off is not None:
        n = int(off[-1]) if off.ndim == 1 and off.numel() >= 2 else -1
        rows = {k: data[k].shape[0] for k in ("hidden", "tokens", "topk_ids", "topk_logp", "features")
                if k in data and data[k].ndim >= 1}
        if n < 1 or int(off[0]) != 0 or bool((off[1:] < off[:-1]).any()) or any(r != n for r in rows.values()) \
                or (positions is not None and n != positions):
            raise DistillInputError(f"corpus shard {path}: damaged (offsets do not match its rows"
                                    f"{'' if positions is None else ' or the manifest'})")
    return data


def _continue(model, batch: list[list[int]], opts: CorpusOptions, index: int) -> list[list[int]]:
    """The target's own continuations of a batch of sequences (one batched ``generate``, left padding),
    each cut after its first EOS. Greedy, or sampled at temperature 1 with a seed fixed by ``index``."""
    from ..models.loading import eos_token_ids

    device = next(model.parameters()).device
    width = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    att = torch.zeros(len(batch), width, dtype=torch.long)
    for k, s in enumerate(batch):
        ids[k, width - len(s):] = torch.tensor(s)
        att[k, width - len(s):] = 1
    eos = eos_token_ids(model)
    pad = model.generation_config.pad_token_id
    pad = pad if isinstance(pad, int) else (min(eos) if eos else 0)
    sample = opts.continuation == "sample"
    torch.manual_seed(opts.seed * 1_000_003 + index)
    out = model.generate(ids.to(device), attention_mask=att.to(device), max_new_tokens=opts.new_tokens,
                         do_sample=sample, temperature=1.0 if sample else None, top_k=0 if sample else None,
                         top_p=1.0 if sample else None, pad_token_id=pad)[:, width:].tolist()
    conts = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        conts.append(row[:cut])
    return conts


class ShardBuffer:
    """Teacher-forced positions gathered for the next shard, and how they are written (also used by
    :func:`.continuations.build_corpus_from_continuations`)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.clear()

    def clear(self) -> None:
        self.parts: dict[str, list] = {"hidden": [], "features": [], "tokens": [], "ids": [], "logp": [], "lens": [],
                                       "gen": []}
        self.counts = torch.zeros(self.vocab, dtype=torch.float64)
        self.positions, self.sequences, self.t0 = 0, 0, time.perf_counter()

    @torch.no_grad()
    def add(self, model, full: list[list[int]], gen_start: list[int], opts: CorpusOptions) -> None:
        """One teacher-forced forward over the sequences ``full`` (right-padded batch)."""
        device = next(model.parameters()).device
        lens = [len(s) for s in full]
        ids = torch.zeros(len(full), max(lens), dtype=torch.long)
        att = torch.zeros(len(full), max(lens), dtype=torch.long)
        for k, s in enumerate(full):
            ids[k, : len(s)] = torch.tensor(s)
            att[k, : len(s)] = 1
        layers = opts.feature_layers
        feats = model_features(model, ids.to(device), att.to(device), layers)  # [B, L, (k + 1) * H]
        H = feats.shape[-1] // (len(layers) + 1)
        for k, s in enumerate(full):
            h = feats[k, : len(s), -H:]  # the last hidden state
            top_ids, top_lp = ([], []) if opts.topk else ([torch.zeros(len(s), 0, dtype=torch.long)],
                                                          [torch.zeros(len(s), 0)])
            for c in range(0, len(s) if opts.topk else 0, opts.logits_chunk):  # topk 0: no logits at all
                logp = torch.log_softmax(lm_logits(model, h[c:c + opts.logits_chunk]), dim=-1)
                v, j = torch.topk(logp, opts.topk, dim=-1)
                top_ids.append(j.cpu())
                top_lp.append(v.cpu())
            top_ids, top_lp = torch.cat(top_ids), torch.cat(top_lp)
            x = torch.tensor(s)
            self.counts.index_add_(0, x[1:], torch.ones(len(s) - 1, dtype=torch.float64))
            self.counts.index_add_(0, top_ids.flatten(), top_lp.double().exp().flatten())
            self.parts["hidden"].append(h.float().cpu())
            if layers:
                self.parts["features"].append(feats[k, : len(s), :-H].to(torch.bfloat16).cpu())
            self.parts["tokens"].append(x)
            self.parts["ids"].append(top_ids)
            self.parts["logp"].append(top_lp)
            self.parts["lens"].append(len(s))
            self.parts["gen"].append(gen_start[k])
            self.positions += len(s)
        self.sequences += len(full)

    def flush(self, out: Path, manifest: dict, **entry) -> None:
        """Write the buffer as the next shard (atomically), record it in the manifest, start afresh."""
        from safetensors.torch import save

        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        b = self.parts
        lens = torch.tensor(b["lens"], dtype=torch.int64)
        tensors = {
            "hidden": torch.cat(b["hidden"]).to(torch.bfloat16).contiguous(),
            "tokens": torch.cat(b["tokens"]).to(torch.int32).contiguous(),
            "topk_ids": torch.cat(b["ids"]).to(torch.int32).contiguous(),
            "topk_logp": torch.cat(b["logp"]).to(torch.float16).contiguous(),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]),
            "gen_start": torch.tensor(b["gen"], dtype=torch.int64),
            "counts": self.counts.float(),
        }
        if b["features"]:
            tensors["features"] = torch.cat(b["features"]).contiguous()
        data = save(tensors)  # bytes: safetensors' save_file writes its own temporary, which kill -9 leaves behind
        atomic_write(out / name, lambda tmp: tmp.write_bytes(data))
        manifest["shards"].append({"file": name, "sequences": self.sequences, "positions": self.positions, **entry})
        manifest["positions"] += self.positions
        manifest["sequences_done"] += self.sequences
        manifest["seconds"] += time.perf_counter() - self.t0
        atomic_write_json(out / MANIFEST, manifest)
        self.clear()


def open_corpus(model, out_dir: str | Path, fingerprint: str, fresh: dict) -> tuple[Path, dict]:
    """The corpus folder and its manifest (created from ``fresh`` when new; refused when it holds
    a corpus of other inputs)."""
    if fresh["options"].get("feature_layers"):  # checked before anything is written
        try:
            check_feature_layers(fresh["options"]["feature_layers"], num_decoder_layers(model))
        except ValueError as err:
            raise DistillInputError(str(err)) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    mpath = out / MANIFEST
    if mpath.exists():
        manifest = load_manifest(out)
        if manifest["fingerprint"] != fingerprint:
            raise DistillInputError(f"{out} holds a corpus built from other inputs or options; use another directory")
        return out, manifest
    manifest = {"format": CORPUS_FORMAT, "fingerprint": fingerprint,
                "vocab_size": model.get_output_embeddings().weight.shape[0],
                "hidden_size": model.get_input_embeddings().weight.shape[1], "shards": [], "positions": 0,
                "sequences_done": 0, "seconds": 0.0, "complete": False, **fresh}
    atomic_write_json(mpath, manifest)
    return out, manifest


@torch.no_grad()
def build_corpus(model, seqs: list[list[int]], out_dir: str | Path, opts: CorpusOptions = CorpusOptions(), *,
                 progress: bool = True, time_limit_s: float | None = None) -> dict:
    """Teacher-force ``model`` on ``seqs`` (token-id lists, each >= 2 tokens) into shards in ``out_dir``.

    Resumes an interrupted build. Stops cleanly (after a finished shard) when ``time_limit_s`` is
    spent; call again to continue. Returns the manifest.
    """
    from tqdm import tqdm

    if opts.continuation not in ("none", "greedy", "sample"):
        raise DistillInputError(f"continuation must be none / greedy / sample, got {opts.continuation!r}")
    seqs = [list(map(int, s)) for s in seqs if len(s) >= 2]
    out, manifest = open_corpus(model, out_dir, _fingerprint(seqs, opts),
                                {"options": opts.record(), "num_input_sequences": len(seqs)})
    done = manifest["sequences_done"]
    start_time = time.perf_counter()
    bar = tqdm(total=len(seqs), initial=done, unit="seq", desc="corpus", disable=not progress)
    buf = ShardBuffer(manifest["vocab_size"])
    i = done
    while i < len(seqs):
        if time_limit_s is not None and time.perf_counter() - start_time > time_limit_s:
            break
        batch = seqs[i:i + opts.batch_size]
        conts = _continue(model, batch, opts, i) if opts.continuation != "none" else [[] for _ in batch]
        buf.add(model, [s + c for s, c in zip(batch, conts)], [len(s) for s in batch], opts)
        i += len(batch)
        bar.update(len(batch))
        elapsed = manifest["seconds"] + time.perf_counter() - buf.t0
        bar.set_postfix(pos=manifest["positions"] + buf.positions,
                        pos_s=f"{(manifest['positions'] + buf.positions) / max(elapsed, 1e-9):.0f}")
        if buf.positions >= opts.shard_positions:
            buf.flush(out, manifest)
    if buf.sequences:
        buf.flush(out, manifest)
    bar.close()
    manifest["complete"] = manifest["sequences_done"] >= len(seqs)
    atomic_write_json(out / MANIFEST, manifest)
    return manifest
