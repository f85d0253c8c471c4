"""The token tree: one small immutable value from which masks, positions and paths are derived.

Node 0 is the *root*: the newest emitted token, not yet in any KV cache. Every other node is a
drafted token. ``parents[i] < i`` (topological order), so a forward pass can feed the nodes in
index order. The children of a node, in increasing index order, are its drafts in the order they
were drawn: that order is part of the draft law (it matters for verification without
replacement and for greedy drafting, whose last child is the random one).

Draft laws (how the children of one node were drawn from that node's draft distribution q):

``"iid"``                 i.i.d. from q, with replacement (siblings may repeat).
``"without_replacement"`` sequentially without replacement (Gumbel-top-k / exponential race).
``"deterministic"``       chosen by any rule that does not look at the target (top-k of q,
                          n-gram / prompt-lookup candidates); no q is needed to verify them.
``"greedy_draft"``        the n-1 most likely draft tokens, then one token drawn from q restricted
                          to the rest and renormalised (the random child is the last one).
``"spechub"``             SpecHub's two-draft law (see :mod:`treespec.verify.spechub`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from .files import atomic_write_json

DRAFT_LAWS = ("iid", "without_replacement", "deterministic", "greedy_draft", "spechub")


@dataclass(frozen=True, eq=False)
class TokenTree:
    """A rooted token tree.

    Attributes
    ----------
    parents : torch.LongTensor
        ``[num_nodes]`` parent index of each node; ``parents[0] == -1`` and ``parents[i] < i``.
    tokens : torch.LongTensor
        ``[num_nodes]`` token id of each node; ``tokens[0]`` is the root (the newest emitted token).
    law : str
        The draft law every node's children were drawn under (one of :data:`DRAFT_LAWS`).
    """

    parents: torch.Tensor  # [num_nodes] int64
    tokens: torch.Tensor  # [num_nodes] int64
    law: str = "deterministic"

    def __post_init__(self) -> None:
        if self.law not in DRAFT_LAWS:
            raise ValueError(f"unknown draft law {self.law!r}; expected one of {DRAFT_LAWS}")
        if self.parents.ndim != 1 or self.tokens.ndim != 1:
            raise ValueError("parents and tokens must be 1-D tensors")
        if self.parents.shape != self.tokens.shape:
            raise ValueError(
                f"parents {tuple(self.parents.shape)} and tokens {tuple(self.tokens.shape)} differ in shape"
            )
        if self.parents.numel() == 0:
            raise ValueError("a token tree needs at least its root node")
        if self.parents.device != self.tokens.device:
            raise ValueError("parents and tokens must live on the same device")
        # One host sync at construction: trees are built on the host side of the loop anyway.
        idx = torch.arange(self.parents.numel(), device=self.parents.device)
        rooted = self.parents[0] == -1
        ordered = ((self.parents[1:] >= 0) & (self.parents[1:] < idx[1:])).all()
        valid_ids = (self.tokens >= 0).all()
        rooted, ordered, valid_ids = torch.stack([rooted, ordered, valid_ids]).tolist()
        if not rooted:
            raise ValueError("node 0 must be the root (parents[0] == -1)")
        if not ordered:
            raise ValueError("every non-root node needs a parent with a smaller index (topological order)")
        if not valid_ids:
            raise ValueError(f"token ids must be >= 0, got {int(self.tokens.min())}")

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def chain(cls, root: int, tokens: list[int] | torch.Tensor, law: str = "deterministic",
              device: torch.device | str | None = None) -> "TokenTree":
        """A chain ``root -> tokens[0] -> tokens[1] -> ...``."""
        toks = torch.as_tensor(list(tokens) if not isinstance(tokens, torch.Tensor) else tokens,
                               dtype=torch.long, device=device)
        n = toks.numel() + 1
        parents = torch.arange(-1, n - 1, dtype=torch.long, device=toks.device)
        all_tokens = torch.cat([torch.tensor([root], dtype=torch.long, device=toks.device), toks])
        return cls(parents, all_tokens, law)

    @classmethod
    def from_lists(cls, parents: list[int], tokens: list[int], law: str = "deterministic",
                   device: torch.device | str | None = None) -> "TokenTree":
        return cls(torch.tensor(parents, dtype=torch.long, device=device),
                   torch.tensor(tokens, dtype=torch.long, device=device), law)

    # ------------------------------------------------------------------ derived structure
    @property
    def num_nodes(self) -> int:
        return self.parents.numel()

    @property
    def device(self) -> torch.device:
        return self.parents.device

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """``[num_nodes, num_nodes]`` bool: ``[i, j]`` is True iff j is i or an ancestor of i."""
        n = self.num_nodes
        eye = torch.eye(n, dtype=torch.float32, device=self.device)
        parent_of = torch.zeros(n, n, dtype=torch.float32, device=self.device)  # [child, parent]
        if n > 1:
            parent_of[torch.arange(1, n, device=self.device), self.parents[1:]] = 1.0
        reach = eye + parent_of  # paths of length <= 1
        # Doubling: after k squarings reach covers paths of length <= 2^k. n <= 2^k suffices.
        for _ in range(max(1, (n - 1).bit_length())):
            reach = (reach @ reach).clamp_(max=1.0)
        return reach.bool()

    @cached_property
    def depths(self) -> torch.Tensor:
        """``[num_nodes]`` int64 depth of each node (root = 0)."""
        return self.ancestor_mask.sum(dim=1) - 1

    def position_ids(self, root_position: int) -> torch.Tensor:
        """``[num_nodes]`` absolute positions: ``root_position + depth``."""
        return self.depths + root_position

    @cached_property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @cached_property
    def num_children(self) -> torch.Tensor:
        """``[num_nodes]`` int64 number of children of each node."""
        counts = torch.zeros(self.num_nodes, dtype=torch.long, device=self.device)
        if self.num_nodes > 1:
            counts.scatter_add_(0, self.parents[1:], torch.ones_like(self.parents[1:]))
        return counts

    @cached_property
    def verified_nodes(self) -> torch.Tensor:
        """``[R]`` the root and every node with children, ascending: the nodes whose target rows a
        verifier reads to accept or reject children. The other nodes (leaves) need a target row only
        for the bonus token of a path accepted down to them."""
        keep = self.num_children > 0
        keep[0] = True
        return torch.nonzero(keep).flatten()

    @cached_property
    def max_children(self) -> int:
        return int(self.num_children.max())

    @cached_property
    def children(self) -> torch.Tensor:
        """``[num_nodes, max_children]`` child node indices in draft order, padded with -1."""
        n, k = self.num_nodes, max(self.max_children, 1)
        table = torch.full((n, k), -1, dtype=torch.long, device=self.device)
        if n > 1:
            kids = torch.arange(1, n, device=self.device)
            par = self.parents[1:]
            # rank among siblings = number of earlier nodes with the same parent
            same = (par[:, None] == par[None, :]) & (kids[None, :] < kids[:, None])  # [n-1, n-1]
            rank = same.sum(dim=1)
            table[par, rank] = kids
        return table

    @cached_property
    def sibling_rank(self) -> torch.Tensor:
        """``[num_nodes]`` rank of each node among its siblings (root: 0)."""
        rank = torch.zeros(self.num_nodes, dtype=torch.long, device=self.device)
        valid = self.children >= 0
        ranks = torch.arange(self.children.shape[1], device=self.device).expand_as(self.children)
        rank[self.children[valid]] = ranks[valid]
        return rank

    def root_path(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive (host list)."""
        return torch.nonzero(self.ancestor_mask[node]).flatten().tolist()

    def paths(self) -> list[list[int]]:
        """Root paths of every leaf (host lists)."""
        leaves = torch.nonzero(self.num_children == 0).flatten().tolist()
        return [self.root_path(leaf) for leaf in leaves]

    # ------------------------------------------------------------------ misc
    def to(self, device: torch.device | str) -> "TokenTree":
        return TokenTree(self.parents.to(device), self.tokens.to(device), self.law)

    def to_dict(self) -> dict:
        return {"parents": self.parents.tolist(), "tokens": self.tokens.tolist(), "law": self.law}

    @classmethod
    def from_dict(cls, data: dict, device: torch.device | str | None = None) -> "TokenTree":
        return cls.from_lists(data["parents"], data["tokens"], data.get("law", "deterministic"), device)

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_dict(), indent=None)

    @classmethod
    def load(cls, path: str | Path) -> "TokenTree":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __repr__(self) -> str:
        return f"TokenTree(num_nodes={self.num_nodes}, max_depth={self.max_depth}, law={self.law!r})"
