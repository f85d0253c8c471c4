"""An EAGLE-style draft head on the target's own features, and the drafter that grows trees with it.

Architecture (after EAGLE, Li et al. arXiv 2401.15077, and EAGLE-2, arXiv 2406.16858; own code):
the head reads the target's last hidden state ``h_t`` (post final norm, what
``ModelRunner.forward(..., need_hidden=True)["hidden"]`` returns) and the target's own (frozen,
scaled) input embedding of the next token ``x_{t+1}``; both are RMS-normalised, concatenated and
projected by ``fc`` to the hidden size; ONE pre-norm decoder layer (rotary self-attention with its
own KV cache + SwiGLU MLP) and a final RMSNorm give a feature ``f_{t+1}`` trained to imitate
``h_{t+1}``. Logits are ``f @ W[S].T`` with ``W`` the target's own LM-head rows restricted to a
vocabulary subset ``S`` (the most frequent target tokens of the distillation corpus): the draft's
probability is exactly 0 outside ``S`` and rows are padded back to the target vocabulary, so
verification stays lossless. Deeper tree levels run the head on its own features.

Only the trained weights (fc, norms, the layer) and ``S`` are saved; the embedding and the LM-head
rows are taken from the target when the head is attached (:meth:`EagleHead.attach`).

Sequence convention: the head's entry for token ``x_j`` (position ``j >= 1``) reads ``h_{j-1}``
and its output predicts ``x_{j+1}``. :class:`HeadDrafter` keeps in its cache only entries built
from the target's true hidden states: each step it drops every tree entry, appends the newly
committed tokens (accepted path + new root) with the ``DraftState.target_hidden`` rows as one
causal chain, and grows the tree level by level from there (one head forward per depth).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..sampling import SamplingConfig, logits_to_probs
from ..tree import DRAFT_LAWS, TokenTree
from ..verify import VerifyResult
from .base import Draft, DraftState
from .weights_file import build_checked, read_weights, write_weights

FORMAT = "treespec-eagle-head"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int  # the target's hidden size H
    target_vocab_size: int
    num_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    softcap: float | None = None  # the target's final logit soft-capping, if any


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split convention) on ``x`` ``[..., T, D]`` with ``positions`` ``[..., T]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # [D/2]
    ang = positions.float()[..., None] * inv  # [..., T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class HeadLayer(nn.Module):
    """Pre-norm decoder layer: rotary multi-head self-attention + SwiGLU MLP."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        h, a = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.qkv = nn.Linear(h, 3 * a, bias=False)
        self.o = nn.Linear(a, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def qkv_heads(self, x: torch.Tensor, positions: torch.Tensor):
        """``x`` ``[B, T, H]`` -> q, k, v ``[B, nh, T, hd]`` (rotary applied to q and k)."""
        b, t, _ = x.shape
        nh, hd = self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, nh, hd).permute(2, 0, 3, 1, 4)
        pos = positions[:, None, :]  # [B, 1, T]
        return _rope(q, pos, self.cfg.rope_theta), _rope(k, pos, self.cfg.rope_theta), v

    def finish(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = att.shape
        x = x + self.o(att.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class EagleHead(nn.Module):
    """The trained part of the head plus (after :meth:`attach`) frozen references to the target."""

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_eps)
        self.embed_norm = RMSNorm(h, cfg.rms_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = HeadLayer(cfg)
        self.out_norm = RMSNorm(h, cfg.rms_eps)
        ids = torch.as_tensor(vocab_ids, dtype=torch.long,  # checked on its device (also under torch.device("meta"))
                              device=vocab_ids.device if isinstance(vocab_ids, torch.Tensor) else "cpu").flatten()
        if ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 \
                or int(ids[-1]) >= cfg.target_vocab_size:
            raise ValueError("vocab_ids must be strictly increasing ids inside the target vocabulary")
        self.register_buffer("vocab_ids", ids, persistent=False)
        self._embed: nn.Module | None = None  # the target's input embedding (frozen, not owned)
        self.register_buffer("lm_rows", torch.empty(0), persistent=False)  # W[S] [|S|, H], frozen copy

    # ------------------------------------------------------------------ target coupling
    def attach(self, target) -> "EagleHead":
        """Take the target's input embedding and the LM-head rows of the subset (frozen)."""
        from ..models.runner import ModelRunner

        model = target.model if isinstance(target, ModelRunner) else target
        emb, out = model.get_input_embeddings(), model.get_output_embeddings()
        if emb.weight.shape[1] != self.cfg.hidden_size or out.weight.shape[0] != self.cfg.target_vocab_size:
            raise ValueError("this head was built for another target (hidden size or vocabulary differ)")
        object.__setattr__(self, "_embed", emb)  # not a submodule: never trained, never saved
        self.lm_rows = out.weight.detach().index_select(0, self.vocab_ids.to(out.weight.device)).float().clone()
        return self

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._embed is None:
            raise RuntimeError("attach the head to its target first")
        with torch.no_grad():
            return self._embed(tokens).float()

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Features ``[..., H]`` -> float32 logits over the subset ``[..., |S|]``."""
        logits = feature.float() @ self.lm_rows.t()
        if self.cfg.softcap:
            logits = torch.tanh(logits / self.cfg.softcap) * self.cfg.softcap
        return logits

    def inputs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """fc(norm(h) ++ norm(emb(x))): ``[..., H]``."""
        dtype = self.fc.weight.dtype
        e = self.embed(tokens).to(dtype)
        return self.fc(torch.cat([self.hidden_norm(hidden.to(dtype)), self.embed_norm(e)], dim=-1))

    # ------------------------------------------------------------------ training forward
    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced parallel pass: ``hidden`` ``[B, T, H]`` (h_{j-1}), ``tokens`` ``[B, T]`` (x_j),
        ``positions`` ``[B, T]``, ``key_mask`` ``[B, T]`` bool (False = padding). Returns features ``[B, T, H]``."""
        x = self.inputs(hidden, tokens)
        q, k, v = self.layer.qkv_heads(x, positions)
        t = x.shape[1]
        allow = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
        if key_mask is not None:
            allow = allow & key_mask[:, None, None, :]
            allow = allow | torch.eye(t, dtype=torch.bool, device=x.device)  # padded queries see themselves
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=allow)
        return self.out_norm(self.layer.finish(x, att))

    # ------------------------------------------------------------------ saving
    def trained_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items()}

    def save(self, path: str | Path, *, dtype: torch.dtype | None = None, extra: dict | None = None) -> None:
        """Atomically write weights + subset + config to one ``.safetensors`` file."""
        write_weights(path, self.trained_state(), self.vocab_ids, fmt=FORMAT, version=FORMAT_VERSION,
                      config=asdict(self.cfg), extra=extra, dtype=dtype)

    @classmethod
    def load(cls, path: str | Path, target=None, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> "EagleHead":
        config, state, vocab_ids, extra = read_weights(path, fmt=FORMAT, what="EAGLE head")
        head = build_checked(path, "EAGLE head", HeadConfig, config, state,
                              lambda cfg: cls(cfg, vocab_ids))
        head.load_state_dict({k: v.to(dtype) for k, v in state.items()})
        head.extra = extra
        head = head.to(device=device, dtype=dtype).eval()
        if target is not None:
            head.attach(target)
        return head

    @property
    def num_trained_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def new_head(target, vocab_ids: torch.Tensor, *, num_heads: int = 8, head_dim: int | None = None,
             intermediate_size: int | None = None, seed: int = 0) -> EagleHead:
    """A freshly initialised head for ``target`` (a HF causal LM) over the subset ``vocab_ids``."""
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    h = target.get_input_embeddings().weight.shape[1]
    cfg = HeadConfig(hidden_size=h, target_vocab_size=target.get_output_embeddings().weight.shape[0],
                     num_heads=num_heads, head_dim=head_dim or max(h // num_heads, 4),
                     intermediate_size=intermediate_size or int(math.ceil(h * 3.2 / 64) * 64),
                     rms_eps=float(getattr(text, "rms_norm_eps", 1e-6) or 1e-6),
                     softcap=getattr(text, "final_logit_softcapping", None))
    torch.manual_seed(seed)
    head = EagleHead(cfg, torch.sort(torch.as_tensor(vocab_ids).long().unique()).values)
    with torch.no_grad():
        for mod in head.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=0.02)
        head.layer.o.weight.mul_(0.1)
        head.layer.down.weight.mul_(0.1)
    return head.attach(target)


# ---------------------------------------------------------------------- the drafter
class HeadDrafter:
    """Grows a static per-depth-width tree with an :class:`EagleHead`, level by level.

    ``shape`` is anything with ``branching`` (children per node at each depth) and ``law`` (a
    :data:`treespec.tree.DRAFT_LAWS` name), e.g. :class:`treespec.drafting.model.StaticTreeShape`.
    At temperature 0 children are the deterministic top-k of the draft logits.

    ``min_confidence``: an adaptive draft length (the stopping rule of SpecDec++, arXiv 2405.19715,
    with the draft's own confidence as the estimate of acceptance; EAGLE-2, arXiv 2406.16858, shows
    that confidence predicts acceptance). For deterministic candidates (temperature 0 or law
    "deterministic") a child is kept only if the head gives it at least this probability, and the
    tree stops growing when no child is kept: candidates chosen by the draft alone stay
    deterministic candidates, so verification stays lossless. For sampled children (T > 0) every
    drawn child is kept (dropping one would change the law of the children), but only children
    whose own draft probability reaches the threshold get children of their own: a node's subtree
    may depend on the node's token, never on its siblings' fate, which verification tolerates (the
    children of the accepted node are drawn afresh from q given that node). Costs one host sync per
    depth.
    """

    def __init__(self, head: EagleHead, shape, min_confidence: float = 0.0) -> None:
        if head._embed is None:
            raise ValueError("attach the head to the target before drafting")
        if shape.law not in DRAFT_LAWS:
            raise ValueError(f"unknown draft law {shape.law!r}")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        self.head = head.eval()
        self.shape = shape
        self.min_confidence = float(min_confidence)
        self.device = head.fc.weight.device
        self.begin([])

    def law(self, sampling: SamplingConfig) -> str:
        return "deterministic" if sampling.greedy else self.shape.law

    def begin(self, prompt_ids: list[int]) -> None:
        self.keys: torch.Tensor | None = None  # [1, nh, L, hd]
        self.values: torch.Tensor | None = None
        self.key_positions = torch.empty(0, dtype=torch.long, device=self.device)
        self.length = 0  # committed entries (built from the target's true hidden states)
        self.next_position = 1  # position of the next token to feed as committed

    # ------------------------------------------------------------------ cached forward
    def _step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              visible_new: torch.Tensor) -> torch.Tensor:
        """Feed ``n`` entries (``hidden`` ``[n, H]``, ``tokens`` ``[n]``, ``positions`` ``[n]``); every
        query sees the committed prefix plus the new/uncommitted keys flagged in ``visible_new``
        ``[n, K_uncommitted + n]``. Returns output features ``[n, H]``."""
        head, layer = self.head, self.head.layer
        x = head.inputs(hidden, tokens)[None]  # [1, n, H]
        q, k, v = layer.qkv_heads(x, positions[None])
        if self.keys is None:
            keys, values = k, v
        else:
            keys, values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        n = tokens.numel()
        visible = torch.cat([torch.ones(n, self.length, dtype=torch.bool, device=self.device), visible_new], dim=1)
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[None, None])
        self.keys, self.values = keys, values
        return head.out_norm(layer.finish(x, att))[0]

    def _truncate(self) -> None:
        if self.keys is not None:
            self.keys = self.keys[:, :, : self.length]
            self.values = self.values[:, :, : self.length]

    # ------------------------------------------------------------------ protocol
    @torch.no_grad()
    def propose(self, state: DraftState, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        from .laws import draw_children

        device, head = self.device, self.head
        law = self.law(sampling)
        root = state.tokens[-1]
        branching = tuple(self.shape.branching[: max(state.max_depth, 0)])
        self._truncate()
        hid = state.target_hidden
        single = TokenTree(torch.tensor([-1], device=device), torch.tensor([root], device=device), law)
        if hid is None or hid.shape[0] == 0:
            return Draft(single)
        # 1. the newly committed tokens (accepted path + root) with the target's true hidden states
        n_new = hid.shape[0]
        root_pos = len(state.tokens) - 1
        first = root_pos - n_new + 1
        if first < 1 or first != self.next_position:
            raise RuntimeError(f"target_hidden does not continue the head's cache (rows for positions "
                               f"{first - 1}..{root_pos - 1}, cache expects {self.next_position - 1})")
        chain_tokens = torch.tensor(state.tokens[first:], dtype=torch.long, device=device)
        positions = torch.arange(first, root_pos + 1, device=device)
        causal = torch.ones(n_new, n_new, dtype=torch.bool, device=device).tril()
        feats = self._step(hid.to(device), chain_tokens, positions, causal)
        self.length += n_new
        self.next_position = root_pos + 1
        if not branching:
            return Draft(single)
        # 2. the tree, one head forward per depth over the frontier
        parents = torch.tensor([-1], dtype=torch.long, device=device)
        tokens = torch.tensor([root], dtype=torch.long, device=device)
        node_feats = feats[-1:]  # [num_nodes so far, H]: output feature of each node's entry
        frontier = torch.zeros(1, dtype=torch.long, device=device)
        slots: list[int] = []  # tree nodes held by uncommitted cache entries, in order
        q_rows: list[torch.Tensor] = []  # q of each expanded node, level by level
        q_nodes: list[torch.Tensor] = []  # the expanded nodes of each level
        vocab = head.cfg.target_vocab_size
        ids = head.vocab_ids
        for depth, k in enumerate(branching):
            if depth > 0:
                tree = TokenTree(parents, tokens, law)
                anc = tree.ancestor_mask  # [N, N], self included
                key_nodes = torch.tensor(slots + frontier.tolist(), dtype=torch.long, device=device)
                out = self._step(node_feats[parents[frontier]], tokens[frontier], frontier.new_full(
                    frontier.shape, root_pos) + tree.depths[frontier], anc[frontier][:, key_nodes])
                slots.extend(frontier.tolist())
                grown = node_feats.new_zeros(tokens.numel(), node_feats.shape[1])  # rows = node ids
                grown[: node_feats.shape[0]] = node_feats
                grown[frontier] = out
                node_feats = grown
                level_feats = out
            else:
                level_feats = node_feats
            sub_logits = head.logits(level_feats)  # [M, |S|]
            m = sub_logits.shape[0]
            if law == "deterministic":
                kk = min(k, ids.numel())
                top = torch.topk(sub_logits, kk, dim=-1)
                kids = ids[top.indices]  # [M, kk]
                q, valid = None, None
                k = kk
                if self.min_confidence > 0.0:
                    conf = torch.softmax(sub_logits, dim=-1).gather(1, top.indices)  # [M, kk]
                    keep = conf >= self.min_confidence
                    if not bool(keep.any()):
                        break
                    new_parents = frontier[:, None].expand(-1, k)[keep]
                    start = tokens.numel()
                    parents = torch.cat([parents, new_parents])
                    tokens = torch.cat([tokens, kids[keep]])
                    frontier = torch.arange(start, tokens.numel(), device=device)
                    continue
            else:
                q = torch.zeros(m, vocab, dtype=torch.float32, device=device)
                q[:, ids] = logits_to_probs(sub_logits, sampling)  # exactly 0 outside the subset
                kids, valid = draw_children(q, k, law, generator)
            q_rows.append(q)
            q_nodes.append(frontier)
            start = tokens.numel()
            new_parents = frontier[:, None].expand(-1, k)
            conf = None
            if self.min_confidence > 0.0 and q is not None:  # the drawn child's own draft probability
                conf = q.gather(1, kids)  # [M, k]
            if law == "without_replacement":
                new_parents, kids = new_parents[valid], kids[valid]
                conf = conf[valid] if conf is not None else None
            parents = torch.cat([parents, new_parents.reshape(-1)])
            tokens = torch.cat([tokens, kids.reshape(-1)])
            frontier = torch.arange(start, tokens.numel(), device=device)
            if conf is not None:  # sampled children are all kept; only confident ones get children
                frontier = frontier[conf.reshape(-1) >= self.min_confidence]
                if frontier.numel() == 0:
                    break
        tree = TokenTree(parents, tokens, law)
        draft_probs = None
        if law != "deterministic":
            draft_probs = q_rows[0].new_zeros(tree.num_nodes, vocab)
            draft_probs[torch.cat(q_nodes)] = torch.cat(q_rows)
        return Draft(tree, draft_probs)

    def accept(self, result: VerifyResult, emitted: list[int]) -> None:
        # drop every tree entry: the accepted path comes back next step with the target's hidden states
        self._truncate()
