"""Property-based fuzz of ``treespec generate`` arguments and of GenerationConfig / SamplingConfig.

Every generated argument list, in ``--json`` mode and in text (streaming) mode, either runs (exit 0;
stdout = one JSON document, or the prompt followed by the continuation; tokens in the vocabulary) or is
refused (exit 2, exactly one ``error:`` line on stderr -- ``treespec: error:`` for the CLI's checks,
``treespec generate: error:`` for argparse's -- and NOTHING on stdout, also in text mode where the
prompt is echoed); never a traceback. The space includes refusals decided only by ``generate()``
(--max-new-tokens 600 overflows the tiny model's 512-token context), ``--tree`` with ``--draft ngram``
(its shape is spelled ``ngram:DEPTH,BRANCHES``) and malformed ``ngram:`` spellings. Memory bound: no example raises the process's peak RSS by 300 MB or more
(the tiny model is ~1 MB; a refused 64,64,64 tree would need > 200 GB). 150 derandomized
examples plus 4 explicit ones, max-new-tokens <= 4: a few seconds on one core.
"""

from __future__ import annotations

import json
from collections import Counter
import resource

from hypothesis import HealthCheck, example, given, settings, strategies as st

from treespec.cli import main as cli_main
from treespec.generate import GenerationConfig
from treespec.sampling import SamplingConfig

from .test_cli_exact import VOCAB, tiny_dir  # noqa: F401  (fixture)

FLOATS = st.sampled_from(["0", "1", "0.7", "1e-40", "1e-300", "-1", "nan", "inf", "2", "0.001", "1e-4"])
ARGS = st.fixed_dictionaries({}, optional={
    "--temperature": FLOATS,
    "--top-p": FLOATS,
    "--top-k": st.sampled_from(["0", "1", "5", "-3", "100000"]),
    "--verifier": st.sampled_from(["auto", "greedy", "single", "rrs", "rrs_without_replacement",
                                   "deterministic", "kseq", "greedy_draft", "spechub"]),
    "--law": st.sampled_from(["iid", "without_replacement", "deterministic", "greedy_draft", "spechub"]),
    "--draft": st.sampled_from(["ngram", "ngram:4,2", "ngram:0,2", "none", "early-exit:1", "ngrams", "head-x",
                                "/no/such.safetensors"]),
    "--tree": st.sampled_from(["1", "2,1", "2,2", "8,4", "64,64,64", "0", "a,b"]),
    "--threads": st.sampled_from(["1", "0", "-1"]),
    "--dtype": st.sampled_from(["float32", "bfloat16"]),
    "--max-new-tokens": st.sampled_from(["1", "4", "0", "-2", "600"]),
    "--min-confidence": st.sampled_from(["0", "0.5"]),
    "--draft-quantize": st.sampled_from(["auto", "none", "int4", "int8"]),
    "--seed": st.sampled_from(["0", "7"]),
})


PROMPT = "w1 w2 w3 w1 w2"
OUTCOMES: Counter[tuple[bool, int]] = Counter()  # (json mode, exit status) -> examples


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ARGS, st.booleans(), st.booleans())
@example({"--draft": "ngram", "--tree": "1"}, False, False)
@example({"--draft": "ngram", "--tree": "1"}, False, True)
@example({"--temperature": "1", "--tree": "2,2,1"}, False, False)  # auto -> ngram here: --tree refused
@example({"--max-new-tokens": "600"}, False, False)  # refused by generate(), after the model loaded
def test_cli_fuzz(capsys, tiny_dir, options, plain, json_mode):  # noqa: F811
    argv = ["generate", PROMPT, "--target", tiny_dir, "--no-stop"]
    if json_mode:
        argv.append("--json")
    if "--max-new-tokens" not in options:
        argv += ["--max-new-tokens", "3"]
    if "--threads" not in options:
        argv += ["--threads", "1"]
    for key, value in options.items():
        argv += [key, value]
    if plain:
        argv.append("--plain")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        code = cli_main(argv)
    except SystemExit as stop:  # argparse refuses a malformed value (int("a"), --tree 0) with exit 2
        code = stop.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, (argv, err)
    OUTCOMES[json_mode, code] += 1
    if code == 0:
        if json_mode:
            result = json.loads(out)
            assert all(0 <= t < VOCAB for t in result["token_ids"]), argv
            assert 1 <= len(result["token_ids"]) <= int(options.get("--max-new-tokens", "3"))
        else:
            assert out.startswith(PROMPT) and out.endswith("\n"), (argv, out)
            assert "tokens/s" in err, (argv, err)
    else:
        assert code == 2, (argv, code, err)
        assert out == "", (argv, out)
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].startswith(("treespec: error:", "treespec generate: error:")), \
            (argv, err)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 300_000, argv  # KB on Linux


def test_cli_fuzz_saw_both_outcomes():
    """Runs after test_cli_fuzz: the fuzz must have exercised successful runs and refusals in both modes."""
    print(f"cli fuzz outcomes (json mode, exit status): {dict(OUTCOMES)}")
    assert set(OUTCOMES) == {(False, 0), (False, 2), (True, 0), (True, 2)}, OUTCOMES
    assert min(OUTCOMES.values()) >= 5, OUTCOMES


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5)),
       st.one_of(st.integers(-3, 10), st.floats()), st.one_of(st.floats(allow_nan=True), st.integers(-1, 2)),
       st.one_of(st.integers(-2, 5), st.floats()), st.sampled_from(["auto", "greedy", "rrs", "bogus", "spechub"]))
def test_config_fuzz(temperature, top_k, top_p, max_new, verifier):
    try:
        sampling = SamplingConfig(temperature, top_k, top_p)
    except ValueError as err:
        assert str(err)
        return
    assert sampling.temperature == 0 or sampling.temperature >= 1e-3
    try:
        GenerationConfig(max_new_tokens=max_new, sampling=sampling, verifier=verifier)
    except ValueError as err:
        assert str(err)
        return
    assert not (verifier == "greedy" and sampling.temperature > 0)
    assert verifier != "bogus"
