"""A Hugging Face causal LM with a KV cache that can be extended by token trees and rolled back.

The cache holds the *committed* sequence except its newest token (the pending root of the next
tree): ``runner.length == len(sequence) - 1`` after every step. A forward call appends a chain of
committed tokens and/or some nodes of a tree; ``commit`` keeps the accepted root path by index
selection on every layer's keys and values (nothing is ever re-run) and drops the rest. Which entry
holds what (the committed length, the tree nodes after it, the tree and its root position) is the
runner's :class:`CacheBook`, the one place that bookkeeping changes; the runner moves the tensors.

Masks are 4-D additive float masks ``[1, 1, queries, keys]`` (0 = attend, dtype min = blocked)
with explicit ``position_ids``; models with sliding-window layers (Gemma-2/3, Mistral) get a dict
per layer type whose sliding entry also hides keys older than the window, so they stay exact past
the window.

A committed chain longer than ``runner.prefill_chunk`` tokens (a long prompt) is fed in pieces, each
appended causally after the previous one (:func:`chain_pieces`): one call's masks are
``[chunk, keys]``, never ``[prompt, prompt]``, so the memory of a prefill grows linearly with the
prompt instead of quadratically (a 30k-token prompt asked for a 7.2 GB mask in one block before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from .features import check_feature_layers, hf_layer_outputs, join_features, num_decoder_layers
from .kv_cache import TreeKVCache, cache_kwargs

from ..sampling import check_finite
from ..tree import TokenTree


#: committed-chain tokens per model call (:func:`chain_pieces`); a runner's ``prefill_chunk`` overrides it
PREFILL_CHUNK = 512


def _layer_window_types(config) -> tuple[list[str] | None, int | None]:
    """(layer types or None, sliding window or None) of a model config."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"treespec cannot build tree masks for attention layer types {sorted(unknown)}")
        if "sliding_attention" not in layer_types:
            return None, None
        return list(layer_types), window
    if window is not None and getattr(cfg, "use_sliding_window", True):
        return None, window  # every layer slides (Mistral-style)
    return None, None


@dataclass(eq=False)
class CacheBook:
    """The bookkeeping of a tree-extensible KV cache: which entries are committed, which tree nodes follow.

    A runner holds one (``runner.book``) and moves its own keys and values; the book alone decides
    what they mean. ``length`` entries hold the committed prefix; then come the uncommitted entries
    of one tree, ``slots[i]`` the node of entry ``length + i``, in the order they were fed; ``tree``
    is that tree (None when no node is cached) and ``root_position`` the position of its root (right
    after the committed prefix and the chain fed with its first nodes).
    """

    length: int = 0  # committed entries
    slots: list[int] = field(default_factory=list)  # tree node of each uncommitted entry, in order
    tree: TokenTree | None = None
    root_position: int = 0

    def begin(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None
              ) -> tuple[int, int]:
        """Check one forward of ``chain`` (``[m]`` committed tokens) then tree ``nodes`` (``[n]``) and
        record its tree: returns ``(m, n)``.

        The first call of a tree records it and its root position (right after the committed prefix
        and the chain); later calls of the same tree, grown level by level, keep the indices of its
        earlier nodes."""
        m = 0 if chain is None else chain.numel()
        n = 0 if nodes is None else nodes.numel()
        if m + n == 0:
            raise ValueError("nothing to forward")
        if m and self.slots:
            raise RuntimeError("a committed chain cannot follow uncommitted tree nodes")
        if n:
            if tree is None:
                raise ValueError("tree nodes need their tree")
            if not self.slots:
                self.tree, self.root_position = tree, self.length + m
            elif tree.num_nodes < self.tree.num_nodes:
                raise RuntimeError("uncommitted nodes of another tree are still in the cache")
            self.tree = tree
        return m, n

    def inputs(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None,
               device: torch.device) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """:meth:`begin`, then the token ids ``[m + n]`` and positions ``[m + n]`` of one forward: the
        chain right after the committed prefix, tree nodes at their depth past the root's position.
        ``chain`` ``[m]`` token ids and ``nodes`` ``[n]`` node indices of ``tree``, each or None."""
        base = self.length
        if tree is not None and tree.device != torch.device(device):
            raise ValueError(f"the tree is on {tree.device} and the runner on {device}: build trees on the target "
                             f"runner's device (TokenTree.to)")
        m, n = self.begin(tree, nodes, chain)
        ids_parts, pos_parts = [], []
        if m:
            ids_parts.append(chain.to(device))
            pos_parts.append(torch.arange(base, base + m, device=device))
        if n:
            ids_parts.append(tree.tokens[nodes])
            pos_parts.append(tree.depths[nodes] + self.root_position)
        ids = torch.cat(ids_parts) if len(ids_parts) > 1 else ids_parts[0]  # [m + n]
        q_pos = torch.cat(pos_parts) if len(pos_parts) > 1 else pos_parts[0]  # [m + n]
        return m, n, ids, q_pos

    def visible_keys(self, nodes: torch.Tensor | None, m: int, n: int, base: int, total: int,
                     device: torch.device) -> torch.Tensor:
        """``[m + n, total]`` bool: which cached keys each new query of a forward sees (after
        :meth:`begin`, before :meth:`finish`; ``base`` the committed length before the call). The
        committed prefix (and the chain, causally) for everyone; among tree nodes, their ancestors
        (earlier nodes of this tree sit right after the prefix, in ``slots`` order, the new ones at the
        end). ``nodes`` ``[n]`` node indices (or None when ``n`` is 0)."""
        visible = torch.zeros(m + n, total, dtype=torch.bool, device=device)
        visible[:, :base] = True
        if m:
            visible[:m, base:base + m] = torch.ones(m, m, dtype=torch.bool, device=device).tril()
            visible[m:, base:base + m] = True
        if n:
            # the earlier slots from the host, the new nodes as they are: no read-back of ``nodes``
            key_nodes = torch.cat([torch.tensor(self.slots, dtype=torch.long, device=device), nodes.to(device)])
            visible[m:, base + m:] = self.tree.ancestor_mask[nodes][:, key_nodes]  # [n, slots + n]
        return visible

    def finish(self, base: int, m: int, nodes: list[int]) -> None:
        """After a forward from committed length ``base``: its ``m`` chain tokens are committed, its
        tree ``nodes`` join ``slots``."""
        if m:
            self.length = base + m
        self.slots.extend(nodes)

    def kept_entries(self, path: list[int]) -> list[int]:
        """Cache indices of the entries of ``path`` (an accepted root path, in order) that are cached;
        nodes never fed (e.g. draft leaves) are skipped. Reads only: :meth:`committed` follows once
        the runner has moved those entries to ``length, length + 1, ...``."""
        where = {node: i for i, node in enumerate(self.slots)}
        return [self.length + where[node] for node in path if node in where]

    def committed(self, kept: int) -> None:
        """``kept`` more entries are committed (an accepted path, moved into place); every other
        uncommitted entry is dropped (``kept = 0``: a rollback to the committed prefix)."""
        self.length += kept
        self.slots = []
        self.tree = None


class HoldsCacheBook:
    """A runner whose cache bookkeeping lives in ``self.book`` (a :class:`CacheBook`): read-only views
    of its fields under the runner names the engine, the drafters and the tests read."""

    book: CacheBook

    @property
    def length(self) -> int:
        """Committed entries (``len(sequence) - 1`` between steps)."""
        return self.book.length

    @property
    def slots(self) -> list[int]:
        return self.book.slots

    @property
    def tree(self) -> TokenTree | None:
        return self.book.tree

    @property
    def root_position(self) -> int:
        return self.book.root_position


def chain_pieces(chain: torch.Tensor | None, nodes: torch.Tensor | None, rows: torch.Tensor | None, size: int
                 ) -> list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]:
    """The model calls one forward of ``chain`` then ``nodes`` is made of: ``(chain piece, nodes, rows)``.

    The chain (``[m]`` committed tokens) is cut into pieces of at most ``size`` tokens, fed one after
    the other (each committed, so the next sees it causally); the tree ``nodes`` (``[n]`` node indices,
    or None) go whole with the last piece.
    ``rows`` (``[R]`` ascending indices into the call's ``m + n`` tokens, or None: every row) become
    each call's own, relative to its first token. A chain of at most ``size`` tokens (or none) is one
    call, exactly as given."""
    if size < 1:
        raise ValueError(f"prefill chunk must be >= 1 token, got {size}")
    if chain is None or chain.numel() <= size:
        return [(chain, nodes, rows)]
    pieces = list(chain.split(size))  # [<= size] each
    calls, start = [], 0
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        own = None
        if rows is not None:  # the last call also holds the nodes' rows
            inside = rows >= start if last else (rows >= start) & (rows < start + piece.numel())
            own = rows[inside] - start  # [R_i]
        calls.append((piece, nodes if last else None, own))
        start += piece.numel()
    return calls


def join_pieces(results: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The results of the calls of :func:`chain_pieces`, rows in input order (``logits`` / ``hidden``
    ``[m + n, ...]``), as one call would return them: each call's ``logits`` ``[R_i, V]`` and ``hidden``
    ``[R_i, F]`` (F = H, or the features' width) concatenated along rows (``[R, ...]`` with ``rows``)."""
    if len(results) == 1:
        return results[0]
    return {key: torch.cat([r[key] for r in results]) for key in results[0]}


class TargetView(Protocol):
    """What a drafter may read of the engine's target runner (``DraftState.target_runner``; read-only).

    ``model`` is the causal LM behind it (None for a GGUF target), ``length`` its committed entries
    (the committed sequence but the root), ``slots`` the tree nodes it holds uncommitted (empty
    between steps), ``device`` where its inputs live (a drafter builds its trees there: no copy per
    step). Every target runner has these; a drafter that needs the cache itself (an
    early-exit draft reads the keys and values of the target's first layers) narrows to
    :class:`ModelRunner` first."""

    @property
    def model(self) -> PreTrainedModel | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def length(self) -> int: ...

    @property
    def slots(self) -> list[int]: ...


class DraftObservation(Protocol):
    """What a draft runner reads of the engine's state at the start of a proposal
    (:meth:`DraftRunner.observe`); :class:`~treespec.drafting.base.DraftState` is the engine's.

    ``tokens``: the committed sequence (its last token the root); ``max_depth``: the deepest the tree
    may go; ``target_hidden``: ``[num_new, F]`` the target's features at the newly committed positions,
    or None; ``target_runner``: the engine's target runner, or None."""

    @property
    def tokens(self) -> list[int]: ...

    @property
    def max_depth(self) -> int: ...

    @property
    def target_hidden(self) -> torch.Tensor | None: ...

    @property
    def target_runner(self) -> TargetView | None: ...


class DraftRunner(Protocol):
    """What every tree builder drafts through (a causal LM, an early exit, an EAGLE-style head, Medusa heads).

    ``length`` committed tokens are accounted for; ``model`` is the causal LM behind the runner
    (None for heads); ``vocab_size`` is the vocabulary of the logits ``forward`` returns.
    """

    model: PreTrainedModel | None
    device: torch.device
    vocab_size: int

    @property
    def length(self) -> int: ...

    def reset(self) -> None:
        """Start a new sequence (empty cache)."""

    def observe(self, state: DraftObservation) -> None:
        """Read what the engine offers at the start of a proposal (a
        :class:`~treespec.drafting.base.DraftState`)."""

    def forward(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None = None,
                *, need_logits: bool | str = True, need_hidden: bool = False) -> dict[str, torch.Tensor]:
        """Append ``chain`` (committed) then tree ``nodes``; ``logits`` ``[n, V]`` of the nodes.

        ``chain`` ``[m]`` token ids, ``nodes`` ``[n]`` node indices of ``tree``, each or None.

        ``need_logits="subset"``: a runner that scores only a vocabulary subset (a draft head) may
        return ``logits`` ``[n, |S|]`` with ``vocab_ids`` ``[|S|]`` instead; any other runner returns
        its usual logits (a truthy ``need_logits``)."""

    def commit(self, nodes: list[int]) -> None:
        """Keep the accepted root path ``nodes`` and drop the other tree entries."""


class TargetRunner(Protocol):
    """What the generate loop verifies through (:class:`ModelRunner` and its fast variants over PyTorch
    models, :class:`~treespec.models.llama_cpp.LlamaCppRunner` over GGUF models): the contract of
    :class:`DraftRunner` plus what the engine checks a request against.

    ``max_positions`` is the longest sequence it serves (None: unbounded); ``vocab_size`` the width of
    its logits; ``eos_ids`` (optional) the end-of-sequence ids when ``model`` is None.
    """

    model: PreTrainedModel | None
    device: torch.device
    vocab_size: int
    max_positions: int | None

    @property
    def length(self) -> int: ...

    @property
    def slots(self) -> list[int]: ...

    def reset(self) -> None: ...

    def forward(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None = None,
                *, need_logits: bool = True, need_hidden: bool = False,
                feature_layers: tuple[int, ...] = (), rows: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
        """:meth:`DraftRunner.forward`; ``rows`` ``[R]`` (ascending indices into the call's tokens,
        chain ``[m]`` then nodes ``[n]``): return ``logits`` and ``hidden`` of those rows only (None: every row)."""

    def commit(self, nodes: list[int]) -> None: ...


def target_runner(target) -> TargetRunner:
    """``target`` itself when it is a runner, else a :class:`ModelRunner` over it (a PyTorch causal LM)."""
    return ModelRunner(target) if isinstance(target, torch.nn.Module) else target


def target_eos_ids(runner: TargetRunner) -> set[int]:
    """The end-of-sequence ids of a target runner: its own ``eos_ids``, else its model's generation config."""
    own = getattr(runner, "eos_ids", None)
    if own is not None:
        return set(own)
    from .loading import eos_token_ids

    return eos_token_ids(runner.model)


def as_runner(source) -> DraftRunner:
    """The draft runner of ``source``: its own ``as_runner()`` (runners, heads, early exits), else a
    :class:`ModelRunner` over it (a Hugging Face causal LM)."""
    make = getattr(source, "as_runner", None)
    return make() if make is not None else ModelRunner(source)


class ModelRunner(HoldsCacheBook):
    """Wraps a causal LM: tree forwards over a rollback-able KV cache.

    Parameters
    ----------
    model : PreTrainedModel
        Any Hugging Face causal LM (Llama-family, GPT-2, Gemma-3, ...), in eval mode.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layer_types, self.window = _layer_window_types(model.config)
        text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.max_positions = getattr(text_cfg, "max_position_embeddings", None) or getattr(text_cfg, "n_positions", None)
        self.softcap = getattr(text_cfg, "final_logit_softcapping", None)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self._checked_layers: tuple[int, ...] = ()
        self.prefill_chunk = PREFILL_CHUNK  # chain tokens per model call (bounded masks, see the module docs)
        self.reset()

    def as_runner(self) -> "ModelRunner":
        return self

    # ------------------------------------------------------------------ state
    def observe(self, state: DraftObservation) -> None:
        """A causal LM reads only tokens: nothing to take from the engine."""

    def reset(self) -> None:
        self.cache = TreeKVCache()  # every layer keeps all keys; sliding windows live in the masks
        self.key_positions = torch.empty(0, dtype=torch.long, device=self.device)  # [cache entries]
        self.book = CacheBook()  # committed length, then the tree node held by each uncommitted entry

    # ------------------------------------------------------------------ forward
    def _masks(self, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """``visible`` ``[Q, K]`` bool -> a 4-D additive mask or a dict per layer type."""
        minus = torch.finfo(self.dtype).min

        def additive(v: torch.Tensor) -> torch.Tensor:
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            return torch.where(v, zero, torch.full((), minus, dtype=self.dtype, device=self.device))[None, None]

        if self.window is None:
            return additive(visible)
        band = visible & ((q_pos[:, None] - k_pos[None, :]) < self.window)
        if self.layer_types is None:
            return additive(band)
        return {"full_attention": additive(visible), "sliding_attention": additive(band)}

    def forward(self, tree: TokenTree | None, nodes: torch.Tensor | None,
                chain: torch.Tensor | None = None, *, need_logits: bool = True,
                need_hidden: bool = False, feature_layers: tuple[int, ...] = (),
                rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Append ``chain`` (``[m]`` committed token ids, causal) then tree ``nodes`` to the cache.

        ``nodes`` (``[n]`` node indices, ancestors before descendants, the root among the first
        call's nodes) may only see the committed prefix, the chain and their own ancestors.
        The chain is committed at once; one longer than ``prefill_chunk`` tokens is fed in pieces
        (:func:`chain_pieces`: bounded masks, the same function). Returns ``logits`` ``[m + n, V]``
        (float32, rows in input order) and, if asked, ``hidden`` ``[m + n, H]``; with
        ``feature_layers`` (checked against the model by
        :func:`~treespec.models.features.check_feature_layers`) ``hidden`` holds those layers'
        outputs before the last hidden state, ``[m + n, (k + 1) * H]``; with ``rows`` (``[R]``,
        ascending indices into the ``m + n`` tokens) only those rows of both, ``[R, ...]``.
        """
        layers = self._feature_layers(feature_layers) if need_hidden else ()  # checked before any bookkeeping
        return join_pieces([self._forward_piece(tree, piece_nodes, piece, need_logits, need_hidden, layers, own)
                            for piece, piece_nodes, own in chain_pieces(chain, nodes, rows, self.prefill_chunk)])

    def _forward_piece(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None,
                       need_logits: bool, need_hidden: bool, layers: tuple[int, ...],
                       rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One model call of :meth:`forward` (``layers``: checked feature layers; ``rows``: this call's)."""
        book = self.book
        base = book.length
        m, n, ids, q_pos = book.inputs(tree, nodes, chain, self.device)
        past = self.key_positions.numel()
        k_pos = torch.cat([self.key_positions, q_pos])  # [past + m + n]
        mask = self._masks(book.visible_keys(nodes, m, n, base, past + m + n, self.device), q_pos, k_pos)
        out = self.model.base_model(
            input_ids=ids[None], attention_mask=mask, position_ids=q_pos[None],
            **cache_kwargs(self.model.base_model, self.cache), use_cache=True, output_hidden_states=bool(layers),
        )
        self.key_positions = k_pos
        last = out.last_hidden_state[0]  # [m + n, H]
        if layers:
            outputs = hf_layer_outputs(out)
            features = join_features({i: outputs[i][0] for i in layers}, last, layers)
        else:
            features = None
        return self._finish(last, base, m, nodes, need_logits, need_hidden, features, rows)

    def _finish(self, hidden: torch.Tensor, base: int, m: int, nodes: torch.Tensor | None,
                need_logits: bool, need_hidden: bool, features: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """After one model call from committed length ``base``: the book takes the chain (committed) and
        the ``nodes`` (new slots); the result has ``logits`` from the last hidden state ``hidden``
        ``[m + n, H]`` and ``hidden`` = ``features`` when given (the last hidden state joined with
        earlier layers, :mod:`treespec.models.features`), else ``hidden``; only the rows ``rows``
        ``[R]`` of both when given (the LM head runs on those alone)."""
        self.book.finish(base, m, nodes.tolist() if nodes is not None else [])
        if rows is not None:
            hidden = hidden.index_select(0, rows)  # [R, H]
            features = None if features is None else features.index_select(0, rows)
        result = {}
        if need_logits:
            result["logits"] = self.logits(hidden)
        if need_hidden:
            result["hidden"] = hidden if features is None else features
        return result

    def _feature_layers(self, layers) -> tuple[int, ...]:
        """``layers`` checked against this model (cached per distinct request: hot path)."""
        layers = tuple(layers)
        if not layers:
            return ()
        if layers != self._checked_layers:
            check_feature_layers(layers, num_decoder_layers(self.model))
            self._checked_layers = layers
        return layers

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head (plus final soft-capping where the model has it): ``[..., H]`` -> float32 ``[..., V]``."""
        logits = self.model.get_output_embeddings()(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        check_finite(logits, type(self.model).__name__)
        return logits

    # ------------------------------------------------------------------ cache commit
    def commit(self, nodes: list[int]) -> None:
        """Keep the committed prefix plus the cache entries of ``nodes`` (a root path, in order).

        Nodes that were never fed to this model (e.g. draft leaves) are skipped: the caller feeds
        them later as a committed chain. Every other uncommitted entry is dropped.
        """
        length = self.book.length
        kept = self.book.kept_entries(nodes)
        if kept == list(range(length, length + len(kept))):  # already in place: truncate
            self.cache.keep(length + len(kept), torch.empty(0, dtype=torch.long, device=self.device))
        else:
            slots = torch.tensor(kept, dtype=torch.long, device=self.device)
            self.cache.keep(length, slots)
            self.key_positions[length: length + len(kept)] = self.key_positions[slots]
        self.key_positions = self.key_positions[: length + len(kept)]
        self.book.committed(len(kept))

    @property
    def cache_length(self) -> int:
        """Length of the cache as the model sees it (every layer agrees)."""
        return self.cache.get_seq_length()
