"""Judge decoding (LOSSY, opt-in): the verifier, the judge, the engine, the labels, the trainer and the CLI.

1. ``verify_judge`` against the obvious loop from the root (:func:`verify_judge_reference`) on 600 random trees;
   a twin that follows the first judged child instead of the highest-scored one disagrees with the loop (so the
   comparison sees the rule). With no judged node it is greedy verification.
2. ``JudgeHead.node_logits`` against the formula written per node.
3. The engine: a judge that accepts nothing gives greedy decoding token for token; one that accepts everything
   keeps every drafted token, and the run counts exactly the tokens that differ from the target's choice after
   their prefix (checked by causal forwards of the output) and is marked lossy.
4. The labels of ``distill judge``: the tree pass's labels and features equal those of per-branch causal
   forwards (prefix, substitution, text) of the same model; the threshold and the AUC against brute force;
   training separates separable rows.
5. The CLI: a run with a judge file says LOSSY and counts judged tokens; the refusals exit 2.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from treespec.cli import main as cli_main
from treespec.distill.judge import (JudgeRows, JudgeRowsOptions, JudgeTrainOptions, auc, branch_tree,
                                    choose_threshold, collect_rows, sequence_rows, split_sequences, substitutions,
                                    train_judge)
from treespec.drafting.base import Draft, DraftState, tree_device
from treespec.drafting.judge import JudgeHead, JudgeHeadConfig
from treespec.generate import GenerationConfig, generate
from treespec.models.runner import ModelRunner
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree
from treespec.verify import VERIFIERS
from treespec.verify.core import _result, _walk, at
from treespec.verify.judge import JudgedResult, verify_judge, verify_judge_reference

V = 32
T0 = SamplingConfig(0.0)


def random_tree(rng: random.Random, n: int, vocab: int) -> TokenTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return TokenTree.from_lists(parents, [rng.randrange(vocab) for _ in range(n)])


def _same(a: JudgedResult, b: JudgedResult) -> bool:
    return (a.accepted_nodes, a.accepted_tokens, a.next_token, a.is_bonus, a.judged_nodes) == \
        (b.accepted_nodes, b.accepted_tokens, b.next_token, b.is_bonus, b.judged_nodes)


def first_judged_twin(tree, scores, judge_logits, threshold):
    """A broken variant: follows the first judged child (draft order), not the highest-scored one."""
    best = scores.argmax(-1)
    kids = tree.children
    valid = kids >= 0
    match = valid & (tree.tokens[kids.clamp(min=0)] == best[:, None])
    judged = valid & (judge_logits[kids.clamp(min=0)] > threshold)
    pick = torch.where(match.any(1), match.to(torch.int8).argmax(1), judged.to(torch.int8).argmax(1))
    nxt = torch.where((match | judged).any(1), kids.gather(1, pick[:, None])[:, 0], torch.full_like(best, -1))
    cur = _walk(tree, nxt)
    base = _result(tree, cur, at(best, cur), at(tree.num_children, cur) == 0, torch.ones((), dtype=torch.bool))
    own = (tree.tokens != best[tree.parents.clamp(min=0)]).tolist()
    return JudgedResult(base.accepted_nodes, base.accepted_tokens, base.next_token, base.is_bonus,
                        [i for i in base.accepted_nodes if own[i]])


def test_verify_judge_equals_the_loop_and_the_twin_does_not():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    twin_differs = 0
    for trial in range(600):
        tree = random_tree(rng, rng.randint(1, 14), 5)  # a small vocabulary: siblings share the target's choice
        scores = torch.randn(tree.num_nodes, 5, generator=gen)
        judge_logits = torch.randn(tree.num_nodes, generator=gen)
        threshold = rng.choice([-0.5, 0.0, 0.7])
        fast = verify_judge(tree, scores, judge_logits, threshold)
        assert _same(fast, verify_judge_reference(tree, scores, judge_logits, threshold)), trial
        twin_differs += not _same(first_judged_twin(tree, scores, judge_logits, threshold), fast)
    assert twin_differs >= 10


def test_without_a_judged_node_it_is_greedy_verification():
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    for _ in range(200):
        tree = random_tree(rng, rng.randint(1, 12), 4)
        scores = torch.randn(tree.num_nodes, 4, generator=gen)
        got = verify_judge(tree, scores, torch.randn(tree.num_nodes, generator=gen), math.inf)
        greedy = VERIFIERS["greedy"](tree, scores)
        assert (got.accepted_nodes, got.next_token, got.is_bonus, got.judged_nodes) == \
            (greedy.accepted_nodes, greedy.next_token, greedy.is_bonus, [])


def test_verify_judge_refuses_rows_of_verified_nodes_only():
    tree = TokenTree.chain(0, [1, 2])
    with pytest.raises(ValueError, match="row of every node"):
        verify_judge(tree, torch.randn(2, 4), torch.zeros(3), 0.0)
    with pytest.raises(ValueError, match=r"judge_logits must be \[num_nodes\]"):
        verify_judge(tree, torch.randn(3, 4), torch.zeros(2), 0.0)


def _judge(hidden: int, seed: int = 0, threshold: float = 0.0) -> JudgeHead:
    torch.manual_seed(seed)
    head = JudgeHead(JudgeHeadConfig(hidden, threshold))
    head.gap_shift.fill_(-1.0)
    head.gap_scale.fill_(2.0)
    return head.eval()


def test_node_logits_follow_the_formula():
    gen, rng = torch.Generator().manual_seed(2), random.Random(2)
    head = _judge(8)
    w, b = head.linear.weight[0].detach(), float(head.linear.bias)
    for _ in range(20):
        tree = random_tree(rng, rng.randint(2, 9), 6)
        scores, hidden = torch.randn(tree.num_nodes, 6, generator=gen), torch.randn(tree.num_nodes, 16, generator=gen)
        got = head.node_logits(tree, scores, hidden, scores.argmax(-1))
        assert got[0] == -math.inf
        for c in range(1, tree.num_nodes):
            u, x = int(tree.parents[c]), int(tree.tokens[c])
            h = hidden[c, -8:]
            feats = torch.cat([h / torch.sqrt(h.pow(2).mean() + 1e-6), torch.tensor([(scores[u, x] - scores[u].max()
                                                                                     + 1.0) / 2.0])])
            assert float(got[c]) == pytest.approx(float(feats @ w + b), abs=1e-5)
    with pytest.raises(ValueError, match="hidden states of width 8"):
        head.node_logits(TokenTree.chain(0, [1]), torch.randn(2, 6), torch.randn(2, 12),
                         torch.zeros(2, dtype=torch.long))


def test_a_gap_below_the_training_rows_is_never_accepted():
    """A linear judge extrapolates: a token far below the greedy one (where the shipped judge's gap weight would
    raise its logit) is refused once its gap lies below ``gap_min``, whatever the logit."""
    head = _judge(8, threshold=-math.inf)
    with torch.no_grad():
        head.linear.weight[0, -1] = -5.0  # a judge that likes far-off tokens
    head.gap_min.fill_(-3.0)
    tree = TokenTree.from_lists([-1, 0, 0], [0, 1, 2])
    scores = torch.tensor([[5.0, 4.0, -10.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # gaps: node 1 -1, node 2 -15
    got = head.node_logits(tree, scores, torch.randn(3, 8), scores.argmax(-1))
    assert math.isfinite(float(got[1])) and got[2] == -math.inf
    assert verify_judge(tree, scores, got, -math.inf).accepted_nodes == [1]


def test_judge_file_round_trip_and_refusals(tmp_path):
    head = _judge(16, threshold=1.25)
    head.save(tmp_path / "j.safetensors", extra={"note": "test"})
    back = JudgeHead.load(tmp_path / "j.safetensors")
    assert back.threshold == 1.25 and back.extra == {"note": "test"}
    for name, value in head.state_dict().items():
        assert torch.equal(value, back.state_dict()[name])
    assert back.with_threshold(-2.0).threshold == -2.0 and back.threshold == 1.25
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not a readable treespec judge head"):
        JudgeHead.load(tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError, match="no judge head file"):
        JudgeHead.load(tmp_path / "missing.safetensors")


class FixedChain:
    """Proposes a chain of ``depth`` seeded random tokens each step (deterministic law): drafts the target
    mostly would not choose, so that a judge that accepts everything changes the output."""

    reads_target_hidden = False

    def __init__(self, depth: int, seed: int) -> None:
        self.depth, self.rng = depth, random.Random(seed)

    def law(self, sampling):
        return "deterministic"

    def begin(self, prompt_ids):
        pass

    def propose(self, state: DraftState, sampling, generator):
        tokens = [self.rng.randrange(V) for _ in range(min(self.depth, state.max_depth))]
        return Draft(TokenTree.chain(state.tokens[-1], tokens, device=tree_device(state, None)))

    def accept(self, result, emitted):
        pass


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", V, seed=5, logit_scale=3.0)


PROMPT = [1, 5, 9, 3, 7]


def test_a_judge_that_accepts_nothing_is_greedy_decoding(target):
    plain = generate(target, PROMPT, None, GenerationConfig(max_new_tokens=24, sampling=T0, stop_on_eos=False))
    cfg = GenerationConfig(max_new_tokens=24, sampling=T0, stop_on_eos=False, judge=_judge(32, threshold=math.inf))
    judged = generate(target, PROMPT, FixedChain(3, 0), cfg)
    assert judged.token_ids == plain.token_ids
    assert judged.summary()["judged_tokens"] == 0 and judged.summary()["lossy"] is True
    assert plain.summary()["lossy"] is False


def test_a_judge_that_accepts_everything_keeps_every_draft_and_counts_them(target):
    cfg = GenerationConfig(max_new_tokens=24, sampling=T0, stop_on_eos=False, judge=_judge(32, threshold=-math.inf))
    res = generate(target, PROMPT, FixedChain(3, 1), cfg)
    assert all(s.accepted == s.tree_nodes for s in res.steps[:-1])  # every drafted token kept
    # judged tokens = the output tokens that are not the target's greedy choice after their prefix
    seq = PROMPT + res.token_ids
    with torch.no_grad():
        logits = target(torch.tensor([seq])).logits[0]
    chosen = logits[len(PROMPT) - 1:-1].argmax(-1).tolist()
    differs = sum(c != t for c, t in zip(chosen, res.token_ids))
    assert differs > 0 and res.summary()["judged_tokens"] == differs
    assert res.token_ids != generate(target, PROMPT, None, GenerationConfig(max_new_tokens=24, sampling=T0,
                                                                            stop_on_eos=False)).token_ids


def test_generation_config_refuses_a_judge_outside_temperature_0():
    with pytest.raises(ValueError, match="temperature 0 only"):
        GenerationConfig(sampling=SamplingConfig(1.0), judge=_judge(8))
    with pytest.raises(ValueError, match="verifier must be 'auto' or 'greedy'"):
        GenerationConfig(sampling=T0, verifier="deterministic", judge=_judge(8))
    with pytest.raises(ValueError, match="JudgeHead"):
        GenerationConfig(sampling=T0, judge="shipped")


# ----------------------------------------------------------------------------------------------- labels


def test_branch_tree_layout():
    ids = [10, 11, 12, 13, 14, 15, 16]
    tree, nodes = branch_tree(ids, 2, [(4, 99), (5, 98)], 2)
    # root ids[2]; the text 13..16 as a chain (nodes 1..4); branch (4, 99) under ids[3] = node 1: 99, ids[5]
    assert tree.tokens.tolist() == [12, 13, 14, 15, 16, 99, 15, 98, 16]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 1, 5, 2, 7]
    assert nodes == [[5, 6], [7, 8]]


def _reference_rows(model, ids, gen_start, opts, generator):
    """The labels and features by plain causal forwards: the slow, obvious way."""
    k = opts.resync
    ids = ids[:gen_start + opts.max_tokens]
    cands = list(range(max(gen_start, 1), len(ids) - k))
    js = [cands[i] for i in torch.randperm(len(cands), generator=generator)[: opts.positions].sort().values.tolist()]
    hidden, gaps, labels = [], [], []
    with torch.no_grad():
        for j in js:
            logits = model(torch.tensor([ids[:j]])).logits[0, -1]
            order = torch.argsort(logits, descending=True).tolist()
            if order[0] != ids[j]:
                continue
            for b in substitutions(order[:max(opts.alternatives + 1, 101)], V, opts, generator):
                seq = ids[:j] + [b] + ids[j + 1:j + k]
                out = model(torch.tensor([seq]), output_hidden_states=True)
                best = out.logits[0, j:j + k].argmax(-1).tolist()
                labels.append(float(best == ids[j + 1:j + 1 + k]))
                hidden.append(out.hidden_states[-1][0, j])
                gaps.append(float(logits[b] - logits[order[0]]))
    return torch.stack(hidden), torch.tensor(gaps), torch.tensor(labels)


def test_labels_of_the_tree_pass_equal_causal_forwards():
    model = tiny_model("llama", V, seed=11, logit_scale=2.0)
    runner = ModelRunner(model)
    opts = JudgeRowsOptions(positions=6, alternatives=3, resync=3, max_tokens=20)
    rng = random.Random(3)
    with torch.no_grad():
        positives = negatives = 0
        for s in range(4):
            prompt = [rng.randrange(V) for _ in range(6)]
            cfg = GenerationConfig(max_new_tokens=20, sampling=T0, stop_on_eos=False)
            text = generate(model, prompt, None, cfg).token_ids
            ids = prompt + text
            got = sequence_rows(runner, ids, len(prompt), opts, torch.Generator().manual_seed(s))
            want = _reference_rows(model, ids, len(prompt), opts, torch.Generator().manual_seed(s))
            assert torch.equal(got[2], want[2])
            assert torch.allclose(got[1], want[1], atol=1e-4)
            assert torch.allclose(got[0].float(), want[0].half().float(), atol=2e-3)
            positives += int(got[2].sum())
            negatives += int((got[2] == 0).sum())
        assert positives > 0 and negatives > 0  # both labels occur


def test_collect_rows_numbers_sequences_and_refuses_text_the_target_did_not_choose():
    model = tiny_model("llama", V, seed=11, logit_scale=2.0)
    opts = JudgeRowsOptions(positions=4, alternatives=2, far=0, resync=2)
    cfg = GenerationConfig(max_new_tokens=16, sampling=T0, stop_on_eos=False)
    seqs = [(p + generate(model, p, None, cfg).token_ids, len(p)) for p in ([1, 2, 3], [5, 6])]
    rows = collect_rows(ModelRunner(model), seqs, opts)
    assert set(rows.sequence.tolist()) == {0, 1} and rows.hidden.shape == (rows.size, 32) and rows.size == 16
    # text the target would not write (its greedy choice nowhere) has no position to label
    with pytest.raises(ValueError, match="no labelled position"):
        collect_rows(ModelRunner(model), [([1, 2, 3] + [7] * 16, 3)], opts)


def test_choose_threshold_and_auc_against_brute_force():
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):
        n = 60
        logits = torch.randn(n, generator=gen).round(decimals=1)  # ties
        label = (torch.rand(n, generator=gen) < torch.sigmoid(2 * logits)).float()
        for precision in (0.6, 0.8, 0.95):
            t = choose_threshold(logits, label, precision, min_accepted=5)
            ok = [c for c in sorted(set(logits.tolist()))
                  if (logits >= c).sum() >= 5 and label[logits >= c].mean() >= precision]
            if not ok:
                assert t == math.inf
            else:
                assert (logits > t).sum() == (logits >= min(ok)).sum()
        pos, neg = logits[label > 0.5].tolist(), logits[label <= 0.5].tolist()
        if pos and neg:
            brute = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg) / (len(pos) * len(neg))
            assert auc(logits, label) == pytest.approx(brute)


def test_substitutions_are_the_next_ranks_then_far_tokens():
    order = list(range(100, 200))  # the target's ranking: 100 first, then 101, 102, ...
    gen = torch.Generator().manual_seed(0)
    for far in (0, 1, 2, 5):
        opts = JudgeRowsOptions(alternatives=3, far=far)
        for _ in range(50):
            got = substitutions(order, 1000, opts, gen)
            assert got[:3] == [101, 102, 103] and 100 not in got and len(set(got)) == len(got)
            if far == 0:
                assert got == [101, 102, 103]
            else:
                assert got[3] in order[4:]  # one far down the ranking
                assert len(got) <= 3 + far and all(0 <= t < 1000 for t in got)
    # a ranking with nothing below the next ranks: no token from it
    assert substitutions([7, 8, 9], 10, JudgeRowsOptions(alternatives=2, far=1), gen) == [8, 9]


def test_threshold_read_back_from_the_file(tmp_path):
    """A threshold written as an int, a large number or infinity loads as it was; nan is refused by name."""
    import json as _json

    from safetensors import safe_open
    from safetensors.torch import save_file

    head = _judge(8)
    head.save(tmp_path / "j.safetensors")
    with safe_open(str(tmp_path / "j.safetensors"), framework="pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    for value, want in ((3, 3.0), (5000, 5000.0), (math.inf, math.inf)):
        save_file(tensors, str(tmp_path / "t.safetensors"),
                  metadata={**meta, "config": _json.dumps({"hidden_size": 8, "threshold": value})})
        assert JudgeHead.load(tmp_path / "t.safetensors").threshold == want
    save_file(tensors, str(tmp_path / "t.safetensors"),
              metadata={**meta, "config": _json.dumps({"hidden_size": 8, "threshold": math.nan})})
    with pytest.raises(ValueError, match="threshold must be a number"):
        JudgeHead.load(tmp_path / "t.safetensors")


def test_split_keeps_sequences_whole():
    seq = torch.arange(40) // 4  # 10 sequences of 4 rows
    rows = JudgeRows(torch.zeros(40, 2).half(), torch.zeros(40), torch.zeros(40), seq)
    kept, aside = split_sequences(rows, 0.3, seed=0)
    assert kept.size + aside.size == 40 and aside.size == 12
    assert not set(kept.sequence.tolist()) & set(aside.sequence.tolist())


def test_training_separates_separable_rows():
    gen = torch.Generator().manual_seed(5)
    n, h = 2000, 16
    hidden = torch.randn(n, h, generator=gen)
    label = (hidden[:, 0] > 0.3).float()
    rows = JudgeRows(hidden.half(), torch.randn(n, generator=gen), label, torch.arange(n) // 10)
    head = train_judge(rows, h, JudgeTrainOptions(epochs=20, precision=0.95))
    with torch.no_grad():
        accepted = head.logit(hidden, rows.gap) > head.threshold
    assert float(label[accepted].mean()) >= 0.95 and int(accepted.sum()) > n // 10


# ----------------------------------------------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-judge")
    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(V - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    tiny_model("llama", V, seed=5, logit_scale=3.0).save_pretrained(path)
    _judge(32).save(path / "judge.safetensors")
    return path


def _cli(tiny_dir, *argv):
    return cli_main(["generate", "w1 w2 w3 w1 w2 w3 w1 w2", "--target", str(tiny_dir), "--max-new-tokens",
                     "12", "--no-stop", "--threads", "1", "--draft", "ngram", *argv])


def test_cli_judge_run_is_marked_lossy(capsys, tiny_dir):
    assert _cli(tiny_dir, "--json", "--judge", str(tiny_dir / "judge.safetensors"), "--judge-threshold=-inf") == 0
    out, err = capsys.readouterr()
    stats = json.loads(out)["statistics"]
    assert stats["lossy"] is True and stats["judged_tokens"] > 0  # every draft accepted: some the target did not choose
    assert stats["judge"] == {"file": str(tiny_dir / "judge.safetensors"), "threshold": "-inf"}
    assert _cli(tiny_dir, "--judge", str(tiny_dir / "judge.safetensors")) == 0
    assert "LOSSY: judge decoding kept" in capsys.readouterr().err
    assert _cli(tiny_dir, "--json") == 0
    assert json.loads(capsys.readouterr().out)["statistics"]["lossy"] is False


@pytest.mark.parametrize("argv, words", [
    (["--exact"], "--exact promises the target's own output"),
    (["--plain"], "plain decoding drafts nothing"),
    (["--temperature", "1"], "temperature 0"),
    (["--verifier", "deterministic"], "--verifier deterministic"),
    (["--draft", "none"], "--draft none: nothing is drafted"),
    (["--leaf-logits", "off"], "--leaf-logits off"),
    (["--judge-threshold=nan"], "--judge-threshold must be a number"),
])
def test_cli_judge_refusals(capsys, tiny_dir, argv, words):
    assert _cli(tiny_dir, "--judge", str(tiny_dir / "judge.safetensors"), *argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_cli_judge_missing_file_and_stray_threshold(capsys, tiny_dir):
    assert _cli(tiny_dir, "--judge", str(tiny_dir / "nope.safetensors")) == 2
    assert "no judge file there" in capsys.readouterr().err
    assert _cli(tiny_dir, "--judge-threshold", "1") == 2
    assert "--judge-threshold applies to --judge" in capsys.readouterr().err


def test_cli_shipped_judge_only_on_the_embedded_pytorch_target(capsys, tiny_dir):
    """The shipped judge reads Gemma-3-270M's hidden states: refused on another target, and on the GGUF target
    (llama.cpp); ``--target auto`` keeps the PyTorch target for it, saying why."""
    import torch

    from treespec.cli import build_parser, resolve_target

    assert _cli(tiny_dir, "--judge", "shipped") == 2
    assert "trained for the embedded Gemma-3-270M" in capsys.readouterr().err
    code = cli_main(["generate", "hello", "--target", "embedded-gguf", "--judge", "shipped", "--draft", "ngram"])
    err = capsys.readouterr().err
    assert code == 2 and "--judge applies to PyTorch targets" in err and len(err.strip().splitlines()) == 1
    args = build_parser().parse_args(["generate", "hello", "--judge", "shipped"])
    target, why = resolve_target(args, dtype=torch.float32)
    assert target == "embedded" and "--judge asks for it" in why


def test_the_engine_reads_every_row_for_a_judge_and_refuses_another_target(target):
    """``leaf_logits=False`` asks a lossless run for the rows of nodes with children only; a judged path may end at
    a leaf, so a judge gets every row (greedy identity with a judge that accepts nothing holds either way). A
    judge trained for another vocabulary or hidden width is refused by name, before any pass."""
    plain = generate(target, PROMPT, None, GenerationConfig(max_new_tokens=16, sampling=T0, stop_on_eos=False))
    cfg = GenerationConfig(max_new_tokens=16, sampling=T0, stop_on_eos=False, leaf_logits=False,
                           judge=_judge(32, threshold=math.inf))
    assert generate(target, PROMPT, FixedChain(3, 2), cfg).token_ids == plain.token_ids
    other = _judge(32)
    other.extra = {"target_vocab_size": V + 1}
    with pytest.raises(ValueError, match=f"trained for a target of {V + 1} tokens"):
        generate(target, PROMPT, FixedChain(3, 2), GenerationConfig(sampling=T0, judge=other))
    with pytest.raises(ValueError, match="hidden states of width 16"):
        generate(target, PROMPT, FixedChain(3, 2), GenerationConfig(sampling=T0, judge=_judge(16)))
