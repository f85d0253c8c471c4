"""A GGUF target through llama.cpp: the runner contract (prefill, one tree pass, commit) over
llama-cpp-python's low-level API.

Every drafter, tree builder and verifier runs unchanged on a :class:`LlamaCppRunner`: ``forward``
returns float32 ``logits`` ``[rows, vocab]`` and ``hidden`` ``[rows, H]`` (the final hidden state after
the output norm, what an EAGLE-style head reads) like :class:`~treespec.models.runner.ModelRunner`.

How one ``llama_decode`` verifies a whole token tree (unified KV cache, ``kv_unified``):

* sequence 0 holds the committed prefix;
* each root-to-leaf path of the tree gets its own sequence id ``s = 1..leaves``; the prefix is shared
  into it first (``llama_memory_seq_cp(0, s)``: with a unified cache this adds an id to the prefix's
  cells, no copy);
* each node carries the ids of every path through it, at position ``prefix length + depth``. A token
  attends to the cells that share one of its ids at positions not after its own: exactly the prefix,
  its ancestors and itself (two nodes share an id only if one is an ancestor of the other);
* commit: the accepted nodes lie on the path of any leaf below the last of them, at consecutive
  positions; ``seq_cp(s, 0, root, root + kept)`` gives them id 0, then every path id is removed, which
  frees the cells of the rejected nodes.

Sliding-window layers: ``swa_full`` keeps every layer's cache whole, so a rejected node can always be
dropped; llama.cpp's own masks hide keys past the window by position, as a causal pass does.

The target here is llama.cpp's own model (its quantised weights and kernels, its logits). A batched
pass can round differently from a one-token pass (llama.cpp's own batch noise), so greedy outputs may
differ from llama.cpp's plain decoding at near-ties; the verifiers stay exact with respect to the
logits this runner returns (tested against per-path causal passes in ``tests/treespec/test_llama_cpp.py``).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import torch

from ..tree import TokenTree
from .loading import cpu_has_amx
from .runner import DraftObservation

#: the most sequence ids llama.cpp takes (``LLAMA_MAX_SEQ``): one for the prefix, the rest for paths
MAX_SEQ = 256
#: leaves (root-to-leaf paths) of the largest tree one pass verifies by default
DEFAULT_MAX_LEAVES = 63
#: tree nodes a pass may hold beyond the context (cells of the unified cache reserved for trees)
DEFAULT_TREE_CELLS = 512

# ggml_tensor fields the hidden-state capture reads (ggml.h: type, buffer, ne[4], nb[4], op, op_params[16],
# flags, src[10], view_src, view_offs, data, name[64]); checked against llama.cpp's own embeddings in the tests
_TENSOR_NE, _TENSOR_DATA, _TENSOR_NAME = 16, 248, 256
_HIDDEN_NAME = b"result_norm\0"  # the final hidden state after the output norm, in every llama.cpp model graph


def llama_cpp_available() -> str | None:
    """None when llama-cpp-python imports, else the reason it does not (one line)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # noqa: BLE001  (a broken native build raises OSError and friends)
        return f"llama-cpp-python is not usable ({type(exc).__name__}: {exc}); install it with " \
               f"pip install llama-cpp-python"
    return None


def default_extra_buffers() -> bool:
    """Whether a runner lets llama.cpp move weights into its extra CPU buffer types by default
    (``llama_model_params.use_extra_bufts``: weights repacked for its AMX and other blocked matrix products):
    everywhere but on a CPU with AMX (:func:`~treespec.models.loading.cpu_has_amx`).

    On an Intel Xeon with AMX (family 6, model 167 as its VM reports it; llama-cpp-python 0.3.36 built from
    source there), every ``llama_decode`` of two or more tokens died with a segmentation fault inside
    llama.cpp's AMX matrix product, llama-cpp-python's own ``Llama`` included; one-token decodes ran. Without
    the extra buffers every batch decoded, and a one-token step took about the same time as with them (an ad
    hoc check; the session of 2026-12-01 in ``docs/results.md``). The same crash is reported upstream on other
    AMX machines (ggml-org/llama.cpp issue 20824); ``extra_buffers=True`` asks for the buffers anyway."""
    return not cpu_has_amx()


def set_model_params(params, extra_buffers: bool | None = None):
    """``params`` (llama.cpp's ``llama_model_params``, as ``llama_model_default_params()`` gives them) set as the
    runner loads a model: CPU only, ``use_extra_bufts`` from ``extra_buffers`` (None:
    :func:`default_extra_buffers`); returns ``params``. The runner and the benchmarks' llama.cpp rows load
    through it, so that both run the same kernels."""
    params.n_gpu_layers = 0  # the runner's tensors are host tensors (device cpu), the captured ones too
    params.use_extra_bufts = default_extra_buffers() if extra_buffers is None else bool(extra_buffers)
    return params


def _lib():
    reason = llama_cpp_available()
    if reason is not None:
        raise ImportError(reason)
    import llama_cpp

    return llama_cpp


_LOG_OFF = None  # the no-op log callback (kept alive for the process)
_BACKEND_READY = False


def _quiet_backend(ll) -> None:
    """Silence llama.cpp's logging and initialise its backend once per process."""
    global _LOG_OFF, _BACKEND_READY
    if _LOG_OFF is None:
        _LOG_OFF = ll.llama_log_callback(lambda level, text, data: None)
        ll.llama_log_set(_LOG_OFF, ctypes.c_void_p(0))
    if not _BACKEND_READY:
        ll.llama_backend_init()
        _BACKEND_READY = True


class LlamaCppRunner:
    """A GGUF model in llama.cpp behind the target runner contract.

    Parameters
    ----------
    gguf_path : a GGUF file llama.cpp loads.
    context : the longest sequence (prompt + generated tokens) it serves; capped by the model's
        training context.
    threads : CPU threads (default: torch's thread count).
    max_leaves : the most root-to-leaf paths of a tree one pass verifies (at most 255).
    tree_cells : cache cells kept for the uncommitted nodes of one tree (its node budget).
    capture_hidden : read hidden states from the graph while it runs (an evaluation callback on the tensor
        ``result_norm``) and stop before the LM head when no logits are asked: a prefill for a head drafter
        then costs no LM head rows. The callback runs on every graph node (about 1 ms a decode for
        Gemma-3-270M), so it is for runners that serve hidden-state drafters. Without it, hidden states come
        from llama.cpp's embeddings output, which computes the LM head on every token of the batch.
    even_outputs : when a tree pass asks for an odd number (3 or more) of its nodes' rows (``rows``), output one
        more token and drop its row. llama.cpp's CPU matrix product over the Q8_0 LM head took about 25 ms
        longer for an odd number of rows than for the next even one on an AVX2 AMD EPYC (3 rows 59 ms, 4 rows
        33 ms; ``benchmarks/results/profile/`` ``*-llama-cpp-epyc-avx2-rows``, where ``profile_llama_cpp.py``
        measures it for any host).
    extra_buffers : let llama.cpp repack weights into its extra CPU buffer types (AMX and other blocked
        products); None (the default): :func:`default_extra_buffers`, off on a CPU with AMX, where llama.cpp's
        AMX product crashed on every batch of two or more tokens.
    """

    model = None  # no PyTorch module behind it
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, gguf_path: str | os.PathLike, *, context: int = 4096, threads: int | None = None,
                 max_leaves: int = DEFAULT_MAX_LEAVES, tree_cells: int = DEFAULT_TREE_CELLS,
                 capture_hidden: bool = False, even_outputs: bool = True,
                 extra_buffers: bool | None = None) -> None:
        path = Path(gguf_path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file {str(path)!r}")
        if not 1 <= max_leaves < MAX_SEQ:
            raise ValueError(f"max_leaves must be in 1..{MAX_SEQ - 1}, got {max_leaves}")
        if context < 1 or tree_cells < 1:
            raise ValueError(f"context and tree_cells must be positive, got {context} and {tree_cells}")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        ll = self._ll = _lib()
        _quiet_backend(ll)
        mparams = set_model_params(ll.llama_model_default_params(), extra_buffers)
        self.extra_buffers = bool(mparams.use_extra_bufts)
        self._model = ll.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {str(path)!r}")
        self.path = path
        vocab = self._vocab = ll.llama_model_get_vocab(self._model)
        self.vocab_size = int(ll.llama_vocab_n_tokens(vocab))
        self.hidden_size = int(ll.llama_model_n_embd(self._model))
        trained = int(ll.llama_model_n_ctx_train(self._model))
        self.max_positions = min(context, trained) if trained > 0 else context
        self.max_leaves = max_leaves
        self.tree_cells = tree_cells
        self.threads = int(threads or torch.get_num_threads())
        self.eos_ids = {int(t) for t in (ll.llama_vocab_eos(vocab), ll.llama_vocab_eot(vocab)) if t >= 0}
        self.bos_id = int(ll.llama_vocab_bos(vocab))
        self.batch_size = max(512, tree_cells)  # tokens a decode call takes (prompts go in chunks of it)

        cparams = ll.llama_context_default_params()
        cparams.n_ctx = self.max_positions + tree_cells
        cparams.n_batch = cparams.n_ubatch = self.batch_size  # a tree stays in one micro-batch
        cparams.n_seq_max = max_leaves + 1
        cparams.n_threads = cparams.n_threads_batch = self.threads
        # hidden states only on the passes that ask for them (llama_set_embeddings per call): with embeddings on,
        # llama.cpp outputs every token of a batch, LM head included
        cparams.embeddings = False
        cparams.kv_unified = True  # paths share the prefix's cells (coupled sequences)
        cparams.swa_full = True  # sliding-window layers keep every cell: rejected nodes can be dropped
        cparams.no_perf = True
        self.capture_hidden = capture_hidden
        self.even_outputs = even_outputs
        self._captured: list[np.ndarray] = []
        self._capture_on = False  # capture on the current decode
        self._stop_after_hidden = False  # and skip the rest of the graph (the LM head)
        if capture_hidden:
            self._callback = ll.ggml_backend_sched_eval_callback(self._observe)  # kept alive with the runner
            cparams.cb_eval = self._callback
            cparams.cb_eval_user_data = None
        self._ctx = ll.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            ll.llama_model_free(self._model)
            self._model = None
            raise ValueError(f"llama.cpp could not create a context for {str(path)!r}")
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(self.batch_size, 0, max_leaves + 1)
        self._embeddings = False
        self.reset()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free llama.cpp's context and model (also done when the runner is collected)."""
        ll = getattr(self, "_ll", None)
        if ll is None:
            return
        if getattr(self, "_batch", None) is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def as_runner(self) -> "LlamaCppRunner":
        return self

    def observe(self, state: DraftObservation) -> None:
        """Reads only tokens: nothing to take from the engine."""

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        self._ll.llama_memory_clear(self._mem, True)
        self.length = 0  # committed tokens in sequence 0
        self.tree: TokenTree | None = None
        self.root_position = 0
        self._leaves: list[int] = []  # leaf node of each path id 1..k
        self.slots: list[int] = []  # tree nodes in the cache, uncommitted

    @property
    def cache_length(self) -> int:
        """Committed tokens as llama.cpp's memory sees them (last position of sequence 0, plus one)."""
        return int(self._ll.llama_memory_seq_pos_max(self._mem, 0)) + 1

    # ------------------------------------------------------------------ forward
    def forward(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None = None,
                *, need_logits: bool | str = True, need_hidden: bool = False,
                feature_layers: tuple[int, ...] = (), rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Append ``chain`` (committed at once, causal) and/or the nodes of one tree (all of them, in
        index order). Returns ``logits`` ``[m + n, V]`` float32 and, if asked, ``hidden`` ``[m + n, H]``.

        ``rows`` ``[R]`` (ascending node indices; a tree pass without a chain): llama.cpp outputs those
        tokens alone, so the LM head runs on ``R`` rows instead of ``n``; ``logits`` ``[R, V]``, ``hidden``
        ``[R, H]``.
        """
        if feature_layers:
            raise ValueError("the llama.cpp runner returns the last hidden state only (a head reading "
                             f"earlier layers {list(feature_layers)} needs a PyTorch target)")
        m = 0 if chain is None else chain.numel()
        n = 0 if nodes is None else nodes.numel()
        if m + n == 0:
            raise ValueError("nothing to forward")
        if self.slots:
            raise RuntimeError("uncommitted tree nodes are in the cache: commit before the next forward")
        outputs = bool(need_logits) or need_hidden
        self._capture_on = need_hidden and self.capture_hidden
        self._stop_after_hidden = self._capture_on and not need_logits
        embeddings = need_hidden and not self.capture_hidden
        if embeddings != self._embeddings:
            self._ll.llama_set_embeddings(self._ctx, embeddings)
            self._embeddings = embeddings
        ids = [int(t) for t in chain.tolist()] if m else []
        self._check_ids(ids)
        if self.length + m > self.max_positions:
            raise ValueError(f"context overflow: {self.length + m} tokens exceed the runner's context of "
                             f"{self.max_positions}")
        plan = self._plan_tree(tree, nodes, n, self.length + m) if n else None  # checked before any decode
        flags, keep = self._outputs(rows, m, n)  # [n] output flags of the tree's tokens, the output rows returned
        logits, hidden = [], []
        for start in range(0, m, self.batch_size):
            part = ids[start:start + self.batch_size]
            self._fill(part, [self.length + i for i in range(len(part))], [(0,)] * len(part), outputs)
            self._decode()  # a failed chunk leaves nothing: llama.cpp rolls its own batch back
            self.length += len(part)  # committed chunk by chunk, so a later failure keeps the cache consistent
            if outputs:
                self._read(len(part), need_logits, need_hidden, logits, hidden)
        if plan is not None:
            tokens, positions, seq_ids, leaves = plan
            for s in range(1, len(leaves) + 1):
                self._ll.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
            self.tree, self.root_position, self._leaves = tree, self.length, leaves
            self._fill(tokens, positions, seq_ids, [outputs and f for f in flags])
            try:
                self._decode()
                if outputs:
                    self._read(n if self._embeddings else sum(flags), need_logits, need_hidden, logits, hidden,
                               (rows.tolist() if rows is not None else None) if self._embeddings else keep)
            except BaseException:
                self._drop_paths()  # the prefix alone again, as before the call
                raise
            self.slots = list(range(n))
        result = {}
        if need_logits:
            result["logits"] = torch.cat(logits) if len(logits) > 1 else logits[0]
        if need_hidden:
            result["hidden"] = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
        return result

    def _plan_tree(self, tree: TokenTree | None, nodes: torch.Tensor, n: int, root_position: int):
        """(tokens, positions, sequence ids, leaves) of one tree pass, every limit checked."""
        if tree is None:
            raise ValueError("tree nodes need their tree")
        if n != tree.num_nodes or not torch.equal(nodes.cpu(), torch.arange(n)):
            raise ValueError("the llama.cpp runner verifies a whole tree in one forward: pass every node in "
                             "index order")
        tokens = [int(t) for t in tree.tokens.tolist()]
        self._check_ids(tokens)
        if n > self.tree_cells:
            raise ValueError(f"a tree of {n} nodes exceeds the runner's {self.tree_cells} tree cells")
        children = tree.num_children.tolist()
        leaves = [i for i in range(n) if children[i] == 0]
        if len(leaves) > self.max_leaves:
            raise ValueError(f"a tree with {len(leaves)} leaves exceeds the runner's {self.max_leaves} paths "
                             f"(max_leaves)")
        if root_position + int(tree.max_depth) + 1 > self.max_positions:
            raise ValueError(f"context overflow: the tree reaches position {root_position + int(tree.max_depth)}, "
                             f"past the runner's context of {self.max_positions}")
        on_path = tree.ancestor_mask[torch.tensor(leaves)].cpu()  # [leaves, n]: node j on path s
        seq_ids = [tuple(int(s) + 1 for s in torch.nonzero(on_path[:, j]).flatten().tolist()) for j in range(n)]
        positions = [root_position + d for d in tree.depths.tolist()]
        return tokens, positions, seq_ids, leaves

    def _outputs(self, rows: torch.Tensor | None, m: int, n: int) -> tuple[list[bool], list[int] | None]:
        """``rows`` checked: ``[n]`` whether each tree node is an output of the decode, and which of the output
        rows to return (None: all). With ``even_outputs`` an odd count of three or more rows gets one more
        output token (the first not asked for), whose row is dropped."""
        if rows is None:
            return [True] * n, None
        if m:
            raise ValueError("rows select outputs of a tree pass: pass no chain with them")
        picked = [int(r) for r in rows.tolist()]
        if not picked or picked != sorted(set(picked)) or picked[0] < 0 or picked[-1] >= n:
            raise ValueError(f"rows must be ascending distinct node indices in [0, {n}), got {picked}")
        flags = [False] * n
        for r in picked:
            flags[r] = True
        if self.even_outputs and len(picked) >= 3 and len(picked) % 2 and len(picked) < n:
            flags[flags.index(False)] = True
            out_rows = [i for i in range(n) if flags[i]]
            return flags, [out_rows.index(r) for r in picked]
        return flags, None

    def _drop_paths(self) -> None:
        """Remove every path id (the cells only they hold go too) and forget the tree."""
        for s in range(1, len(self._leaves) + 1):
            self._ll.llama_memory_seq_rm(self._mem, s, -1, -1)
        self.tree, self.slots, self._leaves = None, [], []

    def _check_ids(self, ids: list[int]) -> None:
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"token ids outside the model's vocabulary [0, {self.vocab_size})")

    def _fill(self, tokens: list[int], positions: list[int], seq_ids: list[tuple[int, ...]],
              outputs: bool | list[bool]) -> None:
        """Write one decode's tokens into the reusable batch (``outputs``: for all, or per token)."""
        flags = outputs if isinstance(outputs, list) else [outputs] * len(tokens)
        b = self._batch
        for i, (tok, pos, ids) in enumerate(zip(tokens, positions, seq_ids)):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = len(ids)
            row = b.seq_id[i]
            for k, s in enumerate(ids):
                row[k] = s
            b.logits[i] = flags[i]
        b.n_tokens = len(tokens)

    def _decode(self) -> None:
        self._captured = []
        code = self._ll.llama_decode(self._ctx, self._batch)
        if code != 0:
            raise RuntimeError(f"llama_decode failed (code {code}): the cache is full or the batch is invalid")

    def _read(self, written: int, need_logits, need_hidden: bool, logits: list, hidden: list,
              keep: list[int] | None = None) -> None:
        """Copy the output rows of the last decode: llama.cpp wrote ``written`` rows (its output tokens in batch
        order; with embeddings on, every token whatever the flags); ``keep``: those returned (None: all)."""
        take = None if keep is None else np.asarray(keep)
        if need_logits:
            ptr = self._ll.llama_get_logits(self._ctx)
            out = np.ctypeslib.as_array(ptr, shape=(written, self.vocab_size))
            logits.append(torch.from_numpy((out if take is None else out[take]).copy()))
        if need_hidden and self._capture_on:
            if not self._captured:
                raise RuntimeError("llama.cpp's graph ran without a result_norm tensor: this model's hidden states "
                                   "cannot be captured (use capture_hidden=False)")
            got = np.concatenate(self._captured) if len(self._captured) > 1 else self._captured[0]
            self._captured = []
            if got.shape != (written, self.hidden_size):
                raise RuntimeError(f"llama.cpp's graph gave hidden states of shape {got.shape}, expected "
                                   f"{(written, self.hidden_size)}")
            hidden.append(torch.from_numpy(got if take is None else got[take]))
        elif need_hidden:
            ptr = self._ll.llama_get_embeddings(self._ctx)
            out = np.ctypeslib.as_array(ptr, shape=(written, self.hidden_size))
            hidden.append(torch.from_numpy((out if take is None else out[take]).copy()))

    def _observe(self, tensor: int, ask: bool, user_data) -> bool:
        """llama.cpp's evaluation callback (``capture_hidden``): asked for every graph node whether its data is
        wanted, then handed the wanted one; returning False there ends the graph (skips the LM head)."""
        if not self._capture_on or ctypes.string_at(tensor + _TENSOR_NAME, len(_HIDDEN_NAME)) != _HIDDEN_NAME:
            return not ask
        if ask:
            return True
        ne0, ne1 = ctypes.cast(tensor + _TENSOR_NE, ctypes.POINTER(ctypes.c_int64))[0:2]
        data = ctypes.cast(tensor + _TENSOR_DATA, ctypes.POINTER(ctypes.c_void_p))[0]
        rows = np.ctypeslib.as_array(ctypes.cast(data, ctypes.POINTER(ctypes.c_float)), shape=(ne1, ne0))
        self._captured.append(rows.copy())
        return not self._stop_after_hidden

    # ------------------------------------------------------------------ commit
    def commit(self, nodes: list[int]) -> None:
        """Keep the committed prefix plus ``nodes`` (the tree's root path, in order); drop every other node."""
        if self.tree is None:
            if nodes:
                raise RuntimeError("no tree to commit nodes of")
            return
        tree = self.tree
        kept = len(nodes)
        if kept:
            if nodes != tree.root_path(nodes[-1]):
                raise ValueError(f"commit takes a root path of the tree, got {nodes}")
            below = tree.ancestor_mask[torch.tensor(self._leaves), nodes[-1]].cpu()  # [leaves]
            path_id = int(torch.nonzero(below).flatten()[0]) + 1  # a path through the last kept node
            self._ll.llama_memory_seq_cp(self._mem, path_id, 0, self.root_position, self.root_position + kept)
        self._drop_paths()
        self.length = self.root_position + kept


class LlamaCppTokenizer:
    """A GGUF model's own tokenizer, as llama.cpp applies it: the two calls the CLI makes of a Hugging
    Face tokenizer (``tok(text)["input_ids"]``, ``tok.decode(ids, skip_special_tokens=True)``)."""

    def __init__(self, runner: LlamaCppRunner) -> None:
        self._ll, self._vocab = runner._ll, runner._vocab
        self._runner = runner  # keeps the model (and so the vocabulary) alive
        self.add_bos = bool(self._ll.llama_vocab_get_add_bos(self._vocab))

    def __call__(self, text: str) -> dict[str, list[int]]:
        data = text.encode("utf-8")
        room = len(data) + 8
        while True:
            out = (self._ll.llama_token * room)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), out, room, self.add_bos, False)
            if n >= 0:
                return {"input_ids": [int(t) for t in out[:n]]}
            room = -n

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        pieces = []
        buf = ctypes.create_string_buffer(256)
        for t in ids:
            n = self._ll.llama_token_to_piece(self._vocab, int(t), buf, len(buf), 0, not skip_special_tokens)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._ll.llama_token_to_piece(self._vocab, int(t), buf, len(buf), 0, not skip_special_tokens)
            pieces.append(buf.raw[:n])
        return b"".join(pieces).decode("utf-8", errors="replace")
