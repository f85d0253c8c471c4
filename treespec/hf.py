"""The Hugging Face front door: a script written for ``model.generate`` runs on treespec with one changed call.

::

    out = model.generate(**inputs, generation_config=config, streamer=streamer)        # Hugging Face
    out = generate_hf(model, tokenizer, inputs, config, streamer=streamer)              # treespec
    out.sequences, out.text, out.tau

:func:`generate_hf` reads a :class:`transformers.GenerationConfig` as ``model.generate`` does (the config passed,
then the model's own ``generation_config``, then transformers' defaults, then keyword overrides): ``do_sample``
(False: greedy), ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens`` / ``max_length``, ``eos_token_id`` (one
id or a list) and ``stop_strings``. A setting that would change the target's distribution in a way treespec's
verification does not reproduce (beams, repetition penalties, ``min_p``, ...) is refused by name: the output would
no longer follow the target losslessly. HF streamers (``TextStreamer``, ``TextIteratorStreamer``) receive the
prompt, then each step's new tokens, then ``end()``.

The drafter is the one ``treespec generate --draft auto`` picks for the model (:func:`treespec.drafters.
default_draft`): n-gram lookup for any model, the measured default of the embedded Gemma-3-270M when the model
was loaded from its folder (:func:`treespec.models.loading.embedded_gemma_path`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .drafters import DraftOptions, build_drafter, default_draft, default_leaf_logits
from .drafting.base import Drafter
from .generate import GenerationConfig, GenerationResult, generate
from .sampling import SamplingConfig

#: settings of a transformers GenerationConfig treespec cannot honour losslessly, with the value that means "off"
UNSUPPORTED: dict[str, Any] = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "penalty_alpha": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "constraints": None,
    "sequence_bias": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "min_p": 0.0, "top_h": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "exponential_decay_length_penalty": None, "guidance_scale": 1.0,
    "watermarking_config": None, "diversity_penalty": 0.0, "dola_layers": None, "min_length": 0,
    "min_new_tokens": 0, "renormalize_logits": False, "token_healing": False, "prompt_lookup_num_tokens": 0,
    "max_time": None,
}


@dataclass(frozen=True)
class HFGenerationOutput:
    """What :func:`generate_hf` returns. ``sequences``: the prompt and the new tokens, ``[1, prompt_len + new]``
    (what ``model.generate`` returns); ``text``: the new tokens decoded (special tokens skipped); ``draft``: the
    draft word used (``"none"`` for plain decoding, ``"custom"`` for a drafter passed in); ``result``: treespec's
    own record (per-step statistics), trimmed to the returned tokens."""

    sequences: torch.Tensor  # [1, prompt_len + new] int64
    text: str
    draft: str
    result: GenerationResult

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward pass (plain decoding: 1.0)."""
        return self.result.tau

    @property
    def target_calls(self) -> int:
        return self.result.target_calls

    def summary(self) -> dict:
        return {**self.result.summary(), "draft": self.draft}


def chat_prompt(tokenizer, text: str) -> str:
    """``text`` as a user turn in the tokenizer's chat template, ending with the assistant's generation prompt.
    A tokenizer without a chat template (a base model's) is refused by name. The one implementation behind
    ``generate_hf(..., chat=True)`` and ``treespec generate --chat``."""
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("the tokenizer has no chat template (a base model takes plain text): drop chat=True / --chat")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)


def encode_prompt(tokenizer, text: str, *, chat: bool = False) -> list[int]:
    """The prompt's token ids: ``text`` tokenized as it is, or (``chat``) its :func:`chat_prompt`, tokenized
    without adding special tokens again (the template writes its own BOS)."""
    if not chat:
        return list(tokenizer(text)["input_ids"])
    return list(tokenizer(chat_prompt(tokenizer, text), add_special_tokens=False)["input_ids"])


def _prompt_ids(tokenizer, inputs, chat: bool) -> list[int]:
    """The one prompt of ``inputs`` (text, ids, a ``[1, N]`` tensor, or a tokenizer's output) as a list of ids."""
    from .generate import prompt_list

    if isinstance(inputs, str):
        return encode_prompt(tokenizer, inputs, chat=chat)
    if chat:
        raise ValueError("chat=True takes the prompt as text (the chat template wraps it); got token ids")
    mask = None
    if hasattr(inputs, "keys") and "input_ids" in inputs:  # a BatchEncoding or a dict
        mask = inputs.get("attention_mask")
        inputs = inputs["input_ids"]
    ids = torch.as_tensor(inputs) if isinstance(inputs, (list, tuple)) and inputs and \
        isinstance(inputs[0], (list, tuple)) else inputs
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError(f"generate_hf serves a batch of one; got {ids.shape[0]} prompts (input_ids of shape "
                         f"{list(ids.shape)}): call it once per prompt")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("the attention mask hides some prompt tokens (padding): pass the prompt unpadded")
    return prompt_list(ids)


def _merged_config(model, generation_config, overrides: dict) -> Any:
    """The GenerationConfig ``model.generate`` would run with: ``generation_config``, then the model's own, then
    transformers' defaults, then ``overrides`` (transformers' own merge, so that both read a config alike)."""
    from transformers import GenerationConfig as HFGenerationConfig

    if generation_config is not None and not isinstance(generation_config, HFGenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig or None, got "
                        f"{type(generation_config).__name__} (a streamer goes in the next argument, streamer=)")
    config, unused = model._prepare_generation_config(copy.deepcopy(generation_config), **overrides)
    if unused:
        raise ValueError(f"unknown generation settings {sorted(unused)}: generate_hf takes GenerationConfig fields")
    return config


def _check_supported(config) -> None:
    """Refuse, by name, a setting of :data:`UNSUPPORTED` that is on (neither None nor its "off" value)."""
    for name, off in UNSUPPORTED.items():
        value = getattr(config, name, None)
        if value is None or value == off:
            continue
        raise ValueError(f"GenerationConfig {name}={value!r} is not supported by treespec (the output would no "
                         f"longer follow the target's distribution as verified): leave it at {off!r}")


def sampling_from_hf(config) -> SamplingConfig:
    """transformers' sampling settings as treespec's: ``do_sample=False`` is greedy (temperature 0, whatever
    temperature says, as in transformers); else temperature, ``top_k`` (None or 0: off) and ``top_p``."""
    if not config.do_sample:
        return SamplingConfig(temperature=0.0)
    temperature = 1.0 if config.temperature is None else config.temperature
    if temperature <= 0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {temperature!r} (do_sample=False is greedy)")
    return SamplingConfig(temperature=temperature, top_k=config.top_k or 0,
                          top_p=1.0 if config.top_p is None else config.top_p)


def _eos_ids(config) -> set[int] | None:
    ids = config.eos_token_id
    if ids is None:
        return None
    return {int(i) for i in ([ids] if isinstance(ids, int) else ids)}


def target_word(model) -> str:
    """The ``--target`` word for ``model`` in the drafter tables: ``embedded`` when it was loaded from the
    embedded Gemma-3-270M's folder, else its own path or id (an ``other`` target)."""
    from .models.loading import embedded_gemma_path

    name = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    try:
        if name and Path(name).resolve() == embedded_gemma_path().resolve():
            return "embedded"
    except OSError:
        pass
    return name or "hf-model"


class StopStrings:
    """Stops where transformers' ``StopStringCriteria`` does: at the first new token whose text completes a stop
    string (the string overlaps that token's text; it may begin in earlier tokens, the prompt's included)."""

    def __init__(self, tokenizer, stop_strings: list[str], prompt: list[int]) -> None:
        if tokenizer is None:
            raise ValueError("stop_strings need the tokenizer (pass it to generate_hf)")
        self.tokenizer, self.strings = tokenizer, [s for s in stop_strings if s]
        self.seq = list(prompt)
        # tokens enough to hold a stop string ending in the newest token (a token decodes to >= 1 character,
        # special tokens aside: a margin covers them)
        self.window = max(len(s) for s in self.strings) + 8 if self.strings else 0

    def cut(self, new: list[int]) -> int | None:
        """Appends ``new``; the number of them kept when one completes a stop string, else None."""
        for i, tok in enumerate(new):
            self.seq.append(tok)
            start = max(0, len(self.seq) - self.window)
            before = self.tokenizer.decode(self.seq[start:-1])
            after = self.tokenizer.decode(self.seq[start:])
            for s in self.strings:
                if after.find(s, max(0, len(before) - len(s) + 1)) != -1:
                    return i + 1
        return None


def generate_hf(model, tokenizer, inputs, generation_config=None, streamer=None, *,
                draft: str | Drafter | None = "auto", chat: bool = False, seed: int | None = None,
                **overrides) -> HFGenerationOutput:
    """``model.generate(**inputs, generation_config=..., streamer=...)`` on treespec: the same tokens at
    ``do_sample=False`` (float32), the same distribution when sampling.

    Parameters
    ----------
    model : a Hugging Face causal LM (batch of one).
    tokenizer : its tokenizer (decodes ``text``, stop strings, chat template).
    inputs : the prompt: text, a tokenizer's output (``input_ids`` ``[1, N]``, an all-ones attention mask), a
        ``[1, N]`` / ``[N]`` tensor or a list of ids.
    generation_config : a :class:`transformers.GenerationConfig` (None: the model's own).
    streamer : an HF streamer: ``put`` the prompt ``[1, N]``, then each step's new tokens ``[k]``; ``end()``.
    draft : ``"auto"`` (the CLI's default for the model), a ``--draft`` word (``"ngram"``, ``"head"``,
        ``"lookup+head"``, ``"none"``) or a :class:`~treespec.drafting.base.Drafter`.
    chat : wrap the text prompt in the tokenizer's chat template (:func:`chat_prompt`).
    seed : the sampling seed; None draws one from torch's global generator (``torch.manual_seed`` then
        reproduces a run, as with transformers).
    overrides : GenerationConfig fields (``max_new_tokens=32``), as ``model.generate`` takes them.
    """
    from .models.fast import make_runner

    config = _merged_config(model, generation_config, overrides)
    _check_supported(config)
    sampling = sampling_from_hf(config)
    prompt = _prompt_ids(tokenizer, inputs, chat)
    max_new = config.max_new_tokens
    if max_new is None:
        max_new = (config.max_length or 20) - len(prompt)
        if max_new < 1:
            raise ValueError(f"max_length={config.max_length} leaves no room after the prompt ({len(prompt)} "
                             f"tokens): set max_new_tokens")
    stops = config.stop_strings
    stops = StopStrings(tokenizer, [stops] if isinstance(stops, str) else list(stops), prompt) if stops else None
    if seed is None and not sampling.greedy:
        seed = int(torch.randint(0, 2**63 - 1, ()))
    dtype = next(model.parameters()).dtype
    target = target_word(model)
    if draft is None or isinstance(draft, str):
        word = default_draft(target, dtype, sampling.temperature) if draft == "auto" else (draft or "none")
        drafter = None if word == "none" else build_drafter(word, model, DraftOptions(),
                                                            temperature=sampling.temperature, tokenizer=tokenizer,
                                                            dtype=dtype)
        leaf_logits = default_leaf_logits(target, word)
    else:
        word, drafter, leaf_logits = "custom", draft, True
    gen_config = GenerationConfig(max_new_tokens=max_new, sampling=sampling, seed=seed, leaf_logits=leaf_logits)
    kept: list[int] = []

    def on_tokens(new: list[int]) -> bool:
        cut = stops.cut(new) if stops is not None else None
        new = new if cut is None else new[:cut]
        kept.extend(new)
        if streamer is not None and new:
            streamer.put(torch.tensor(new, dtype=torch.long))
        return cut is not None

    if streamer is not None:
        streamer.put(torch.tensor([prompt], dtype=torch.long))
    try:
        result = generate(make_runner(model, fast=True), prompt, drafter, gen_config, on_tokens=on_tokens,
                          eos_ids=_eos_ids(config))
    finally:
        if streamer is not None:
            streamer.end()
    if len(kept) < len(result.token_ids):  # a stop string ended a step early: drop the tokens after it
        result.steps[-1].emitted -= len(result.token_ids) - len(kept)
        result.token_ids = kept
    result.text = tokenizer.decode(result.token_ids, skip_special_tokens=True) if tokenizer is not None else None
    sequences = torch.tensor([prompt + result.token_ids], dtype=torch.long)  # [1, prompt_len + new]
    return HFGenerationOutput(sequences, result.text or "", word, result)
