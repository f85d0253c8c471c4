"""Fixed-shape tree passes, replayed as CUDA graphs: the fast Gemma-3 runner without per-kernel launch cost.

At batch 1 a small model on a GPU spends most of a decoding step launching kernels (Gemma-3-270M: 18 layers of
about 20 kernels each), whatever the number of tokens in the pass. A CUDA graph records the kernels of one pass
once and replays them with a single launch, but it needs every shape and every address fixed. So
:class:`GraphedGemmaRunner` runs each short pass (tree passes, and chains as long as the largest budget) at a
fixed shape:

* **nodes** padded up to the next of a few budgets (:data:`NODE_BUDGETS`): padding rows carry token 0 at the
  last real position, see only their own slot, and are dropped from the result;
* **keys**: attention over every slot of the static cache (:class:`~.static_cache.StaticKVCache`) with the slots
  past the filled ones masked, instead of over the filled slots alone;
* **cache writes** at slot indices (a tensor of fixed shape) instead of a slice.

One graph per (budget, cache capacity) is captured on first use (after two warm-up runs on a side stream) and
replayed afterwards; the LM head runs after it, eagerly, on the rows the caller asks for (their number varies).
Prefills longer than the largest budget, passes that read earlier layers' outputs (fused features) and every
pass on a CPU (no graphs) take the fixed-shape path without capture (``capture=False``) or the lean runner's
own path. The function is the same as :class:`~.gemma.FastGemmaRunner`'s: the fixed-shape pass is tested against
it on the CPU (logits, caches after commits, greedy identity, and no host synchronisation inside the pass,
which a capture would refuse); the capture itself runs only on CUDA (``benchmarks/device_check.py``).
"""

from __future__ import annotations

import torch

from ...tree import TokenTree
from .gemma import FastGemmaRunner

#: a pass of n tokens runs at the first budget >= n (n above the last one: the lean runner's own path)
NODE_BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128)


class _StaticPass:
    """The fixed-shape inputs and output of one (budget, capacity), and its CUDA graph once captured."""

    def __init__(self, runner: "GraphedGemmaRunner", budget: int) -> None:
        device, capacity = runner.device, runner.kv.capacity
        self.budget, self.capacity = budget, capacity
        self.ids = torch.zeros(budget, dtype=torch.long, device=device)  # [B]
        self.q_pos = torch.zeros(budget, dtype=torch.long, device=device)  # [B]
        self.slots = torch.arange(capacity - budget, capacity, device=device)  # [B] (unused slots until filled)
        self.visible = torch.zeros(budget, capacity, dtype=torch.bool, device=device)  # [B, C]
        self.visible[torch.arange(budget), self.slots] = True
        self.hidden: torch.Tensor | None = None  # [B, H] the graph's output buffer
        self.graph = None

    def run(self, runner: "GraphedGemmaRunner", capture: bool) -> torch.Tensor:
        if not capture:
            return runner._static_body(self)
        if self.graph is None:
            side = torch.cuda.Stream(runner.device)
            side.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph (allocator, kernel selection)
                    runner._static_body(self)
            torch.cuda.current_stream(runner.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=runner._graph_pool):
                self.hidden = runner._static_body(self)
        self.graph.replay()
        return self.hidden


class GraphedGemmaRunner(FastGemmaRunner):
    """:class:`~.gemma.FastGemmaRunner` whose short passes run at fixed shapes and, on CUDA, as CUDA graphs.

    Parameters
    ----------
    model : a ``Gemma3ForCausalLM`` that :func:`~.gemma.fast_supported` covers.
    capacity : cache slots (fixed while graphs live: growing the cache drops the graphs, which are captured
        again at the new capacity).
    budgets : the node budgets passes are padded to (ascending).
    capture : record and replay CUDA graphs (default: where the model is on CUDA); False runs the same
        fixed-shape function eagerly (the CPU's only choice, and the tests' view of what is captured).
    """

    def __init__(self, model, capacity: int = 2048, budgets: tuple[int, ...] = NODE_BUDGETS,
                 capture: bool | None = None) -> None:
        if list(budgets) != sorted(set(budgets)) or budgets[0] < 1:
            raise ValueError(f"budgets must be distinct positive sizes in ascending order, got {budgets}")
        self.budgets = tuple(budgets)
        self._passes: dict[tuple[int, int], _StaticPass] = {}
        super().__init__(model, capacity=max(capacity, 2 * self.budgets[-1]), quantize=None)
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device} (capture=False runs "
                             f"the same fixed-shape passes without graphs)")
        self.capture = capture
        self._graph_pool = torch.cuda.graph_pool_handle() if capture else None

    def refresh(self) -> None:
        super().refresh()
        self._passes = {}  # graphs read the weights' addresses: new weights, new graphs

    def _budget(self, tokens: int) -> int | None:
        return next((b for b in self.budgets if b >= tokens), None)

    def _forward_piece(self, tree: TokenTree | None, nodes: torch.Tensor | None, chain: torch.Tensor | None,
                       need_logits: bool, need_hidden: bool, layers: tuple[int, ...],
                       rows: torch.Tensor | None) -> dict[str, torch.Tensor]:
        kv, book = self.kv, self.book
        m = 0 if chain is None else chain.numel()
        n = 0 if nodes is None else nodes.numel()
        budget = self._budget(m + n)
        limit = kv.max_capacity
        if budget is None or layers or (limit is not None and kv.used + budget > limit):
            # a long prefill, earlier layers' outputs, or padding that would pass the cache's limit near the model's
            # longest context: the lean runner's own pass (the same function)
            return super()._forward_piece(tree, nodes, chain, need_logits, need_hidden, layers, rows)
        base = book.length
        m, n, ids, q_pos = book.inputs(tree, nodes, chain, self.device)
        past, total = kv.used, kv.used + m + n
        kv.reserve(past + budget)  # padding rows write past the real ones
        if any(capacity != kv.capacity for _, capacity in self._passes):
            self._passes = {}  # the cache grew (here or in a long prefill): every graph read the old buffers
        key = (budget, kv.capacity)
        step = self._passes.get(key)
        if step is None:
            step = self._passes[key] = _StaticPass(self, budget)
        self._fill(step, ids, q_pos, book.visible_keys(nodes, m, n, base, total, self.device), past, total)
        # every graph shares one memory pool and they replay in any order: a replay may overwrite another graph's
        # output buffer, so the rows are copied out (clone, below) before any other pass runs
        hidden = step.run(self, self.capture)[: m + n]  # [m + n, H]
        kv.positions[past:total] = q_pos
        kv.used = total
        return self._finish(hidden.clone(), base, m, nodes, need_logits, need_hidden, None, rows)

    def _fill(self, step: _StaticPass, ids: torch.Tensor, q_pos: torch.Tensor, visible: torch.Tensor,
              past: int, total: int) -> None:
        """Write one pass into ``step``'s fixed inputs: ``ids`` / ``q_pos`` ``[q]``, ``visible`` ``[q, total]``."""
        q, budget = ids.numel(), step.budget
        step.ids.zero_()[:q] = ids
        step.q_pos.fill_(0)[:q] = q_pos
        step.q_pos[q:] = q_pos[-1]  # padding rows: a real position (their rotary embedding stays finite)
        step.slots.copy_(torch.arange(past, past + budget, device=self.device))
        step.visible.zero_()[:q, :total] = visible
        pad = torch.arange(q, budget, device=self.device)
        step.visible[pad, past + pad] = True  # a padding row sees its own slot only

    def _static_body(self, step: _StaticPass) -> torch.Tensor:
        """The fixed-shape pass: ``[B, H]`` final hidden states; writes keys / values into ``step.slots``.
        Every shape is (budget, capacity): nothing in it reads a value back to the host."""
        positions = self.kv.positions.index_copy(0, step.slots, step.q_pos)  # [C] keys' positions, this pass's too
        masks = self._masks(step.visible, step.q_pos, positions)
        return self._body(step.ids, step.q_pos, masks, step.slots, step.capacity)
