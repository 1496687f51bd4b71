"""The seam between the evaluation and the model: caches per format, chunked forwards, greedy answers.

Everything the evaluation does to a model goes through :class:`Runner`:

* :meth:`Runner.cache` builds a transformers cache for a format: kvpack's own (``engine="kvpack"``,
  :func:`kvpack.hf.cache_for`, the fused kernels) or the ``simulate`` stand-in
  (:mod:`kvpack.evaluation.simulate`, same cache contents, the model's own attention). ``None`` is the
  full-precision reference (a transformers ``DynamicCache`` in the model's dtype).
* :meth:`Runner.prefill` runs a document through the full-precision model once and keeps its keys and
  values; :meth:`Runner.filled` stores them into a fresh cache of any format, as a serving engine stores a
  prefilled chunk (the document's own forward saw full-precision keys, exactly as a one-chunk prefill does).
* :meth:`Runner.greedy` then feeds the question as a *later chunk* that attends to the quantized document,
  and decodes greedily: the damage a quantized cache does shows up here, and a prefill of document and
  question together would hide it.
* :meth:`Runner.forward` feeds any chunk to any cache (teacher-forced fidelity, speculative decoding).

The model's attention implementation is switched per call: ``kvpack`` for kvpack caches, the model's own
(usually ``sdpa``) for every other cache.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpack.errors import ConfigError
from kvpack.formats import KVFormat, parse_format
from kvpack.plans import LayerPlan, is_plan, parse_plan

__all__ = ["ENGINES", "LoadedModel", "PromptTemplate", "Runner", "engine_available", "load"]

ENGINES = ("kvpack", "simulate")


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and the facts the evaluation needs about it.

    Attributes:
        model: a transformers causal LM in eval mode.
        tokenizer: its tokenizer.
        name: what the report calls it.
        num_layers, kv_heads, head_dim: the cache geometry.
        max_context: ``max_position_embeddings`` of the config.
        attn_implementation: the model's own attention implementation (restored for non-kvpack caches).
    """

    model: Any
    tokenizer: Any
    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    max_context: int
    attn_implementation: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def wrap(model: Any, tokenizer: Any, name: str) -> LoadedModel:
    """Describe an already loaded ``model`` and ``tokenizer``."""
    cfg = model.config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    heads = cfg.num_attention_heads
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        num_layers=cfg.num_hidden_layers,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        max_context=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        attn_implementation="sdpa" if impl == "kvpack" else impl,
    )


def load(path: str | None = None) -> LoadedModel:
    """Load ``path`` (a local Hugging Face folder) or the embedded SmolLM2-135M-Instruct, float32 on the CPU."""
    from kvpack.models import EMBEDDED_NAME, load_model

    model, tokenizer = load_model(path, dtype=torch.float32)
    return wrap(model, tokenizer, EMBEDDED_NAME if path is None else os.path.basename(os.path.normpath(str(path))))


def engine_available(engine: str) -> list[str]:
    """Why ``engine`` cannot run here (empty list: it can)."""
    if engine == "simulate":
        return []
    if engine != "kvpack":
        return [f"unknown engine {engine!r}; engines are {', '.join(ENGINES)}"]
    try:
        _cache_for()
    except ImportError as e:
        return [f"kvpack's transformers integration is not importable ({e})"]
    return []


def _cache_for():
    """``kvpack.hf.cache_for`` (the public alias), or the integration's own function it re-exports."""
    try:
        from kvpack.hf import cache_for
    except ImportError:
        from kvpack.integrations.transformers import cache_for
    return cache_for


@dataclass(frozen=True)
class PromptTemplate:
    """How a document and a question become two chunks of the model's prompt format.

    The document chunk is ``doc_prefix + document``; the question chunk is ``question_prefix + question +
    question_suffix + answer_prefix`` (the suffix opens the assistant's turn when the model has a chat template).
    """

    doc_prefix: str
    question_prefix: str
    question_suffix: str

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PromptTemplate:
        """The chat template's user/assistant framing when the tokenizer has one; plain text otherwise."""
        intro = "Read the document below, then answer the question.\n\n"
        if getattr(tokenizer, "chat_template", None):
            doc, q = "\x00DOC\x00", "\x00Q\x00"
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": doc + q}], tokenize=False, add_generation_prompt=True
            )
            if isinstance(rendered, str) and rendered.count(doc) == 1 and rendered.count(q) == 1:
                before, rest = rendered.split(doc)
                _, after = rest.split(q)
                return cls(before + intro, "\n\n", after)
        return cls(intro + "Document:\n", "\n\nQuestion: ", "\nAnswer: ")

    def document(self, text: str) -> str:
        return self.doc_prefix + text

    def question(self, question: str, answer_prefix: str) -> str:
        return self.question_prefix + question + self.question_suffix + answer_prefix


@dataclass
class Prefilled:
    """A document run once through the full-precision model.

    Attributes:
        ids: the document chunk's token ids.
        keys, values: per layer ``[1, kv_heads, len(ids), head_dim]`` in the model dtype (after RoPE).
    """

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class Runner:
    """Runs chunks of a :class:`LoadedModel` against caches of any format (see the module docstring).

    Args:
        lm: the model.
        engine: ``"kvpack"`` (kvpack's transformers cache and fused kernels), ``"simulate"`` (the stand-in),
            or ``"auto"`` (kvpack when importable).
        backend: decode kernel backend for the kvpack engine (``"auto"`` picks the fused kernel).
        zero_keys_for: test hook: names of formats planted broken, their sealed keys replaced by zeros
            (simulate engine only).
        calibration: a :class:`~kvpack.calibration.Artifact` of this model: formats with ``static`` specs
            (``fp8@static``) get scales recomputed from its statistics for their own specs
            (:meth:`~kvpack.calibration.Artifact.rescaled`); without it such formats are refused.
    """

    def __init__(
        self,
        lm: LoadedModel,
        engine: str = "auto",
        backend: str = "auto",
        zero_keys_for: Sequence[str] = (),
        calibration: Any = None,
    ):
        if engine == "auto":
            engine = "kvpack" if not engine_available("kvpack") else "simulate"
        reasons = engine_available(engine)
        if reasons:
            raise ConfigError(f"engine {engine!r} cannot run: " + "; ".join(reasons) + "; use --engine simulate")
        if zero_keys_for and engine != "simulate":
            raise ConfigError("the zero_keys_for test hook exists in the simulate engine only")
        self.lm = lm
        self.engine = engine
        self.backend = backend
        self.zero_keys_for = frozenset(zero_keys_for)
        self.calibration = calibration
        self._scales: dict[str, Any] = {}
        self.template = PromptTemplate.for_tokenizer(lm.tokenizer)
        from kvpack.integrations.transformers import cache_kwarg

        self._cache_kwarg = cache_kwarg(lm.model)  # "cache" from transformers 5.24, "past_key_values" before

    # -- caches ---------------------------------------------------------------------------------------
    def cache(
        self,
        fmt: KVFormat | LayerPlan | str | None,
        max_tokens: int,
        layer_formats: Sequence[KVFormat | None] | None = None,
    ) -> Any:
        """A fresh cache for ``fmt`` (``None``: the full-precision reference).

        Args:
            fmt: the format of every layer.
            max_tokens: the longest sequence the cache will hold.
            layer_formats: one format per layer instead (``None`` entries stay full precision); always the
                simulate engine, which is the only one that mixes formats across layers.
        """
        from transformers import DynamicCache

        if layer_formats is not None:
            from kvpack.evaluation.simulate import SimulatedCache

            layer_formats = list(layer_formats)
            scales = [None if f is None else self.scales_for(f) for f in layer_formats]
            ranked = next((f for f in layer_formats if f is not None and f.query_ranked), None)
            return SimulatedCache(layer_formats, scales=scales, query_energy=self.query_energy(ranked))
        if fmt is None:
            return DynamicCache()
        if is_plan(fmt):  # a per-layer plan (kvpack.plans): the kvpack engine's layered cache, or the simulation
            plan = parse_plan(fmt)
            if self.engine == "simulate":
                return self.cache(None, max_tokens, layer_formats=plan.formats(self.lm.num_layers))
            ranked = next((f for f in plan.distinct_formats if f.query_ranked), None)
            extra = {"calibration": self.calibration} if self.query_energy(ranked) is not None else {}
            cache = _cache_for()(
                self.lm.model, format=plan, max_tokens=max_tokens, batch_size=1, backend=self.backend, **extra
            )
            self._use_attention(self.lm.attn_implementation)
            return cache
        fmt = parse_format(fmt)
        scales = self.scales_for(fmt)
        if self.engine == "simulate":
            from kvpack.evaluation.simulate import SimulatedCache

            n = self.lm.num_layers
            return SimulatedCache(
                [fmt] * n,
                zero_keys=fmt.name in self.zero_keys_for,
                scales=[scales] * n,
                query_energy=self.query_energy(fmt),
            )
        extra = {} if scales is None else {"calibration": scales}
        if fmt.query_ranked:  # the artifact itself: its query statistics rank the outlier channels
            self.query_energy(fmt)  # refuses a missing artifact with the command that makes one
            extra = {"calibration": self._artifact_for(fmt)}
        cache = _cache_for()(
            self.lm.model, format=fmt, max_tokens=max_tokens, batch_size=1, backend=self.backend, **extra
        )
        self._use_attention(self.lm.attn_implementation)  # switched back and forth per call
        return cache

    def scales_for(self, fmt: KVFormat) -> Any:
        """The calibrated scales of a format with ``static`` specs (``None`` for any other format).

        Raises:
            ConfigError: the format is static and the runner has no calibration artifact.
        """
        if not fmt.is_static:
            return None
        if self.calibration is None:
            raise ConfigError(
                f"format {fmt.name!r} takes calibrated scales and no calibration artifact was given; run "
                "`kvpack calibrate --out DIR` and pass --calibration DIR"
            )
        key = fmt.spec_string()
        if key not in self._scales:
            self._scales[key] = self._artifact_for(fmt).scales_for(fmt)
        return self._scales[key]

    def _artifact_for(self, fmt: KVFormat) -> Any:
        """The runner's artifact with its scales recomputed for ``fmt`` (static formats), else as it is."""
        if not fmt.is_static:
            return self.calibration
        from kvpack.calibration.run import default_source

        return self.calibration.rescaled(fmt, source=default_source(fmt))

    def query_energy(self, fmt: KVFormat | None) -> torch.Tensor | None:
        """The calibration's query statistics ``[layers, kv_heads, head_dim]`` when ``fmt`` ranks its outlier key
        channels by the queries (``o<k>q``); ``None`` for any other format.

        Raises:
            ConfigError: no calibration artifact was given.
            CalibrationError: the artifact holds no query statistics, or of another geometry.
        """
        if fmt is None or not fmt.query_ranked:
            return None
        if self.calibration is None:
            raise ConfigError(
                f"format {fmt.name!r} ranks outlier key channels by the queries' energy, which a calibration artifact "
                "holds, and none was given; run `kvpack calibrate --out DIR` and pass --calibration DIR"
            )
        from kvpack.cache.calibrated import resolve_query_energy

        lm = self.lm
        return resolve_query_energy(fmt, self.calibration, lm.num_layers, lm.kv_heads, lm.head_dim, torch.device("cpu"))

    def _is_kvpack(self, cache: Any) -> bool:
        return type(cache).__name__ == "KVPackCache"

    def _use_attention(self, impl: str) -> None:
        model = self.lm.model
        if getattr(model.config, "_attn_implementation", None) != impl:
            model.set_attn_implementation(impl)

    def _attention_for(self, cache: Any) -> None:
        self._use_attention("kvpack" if self._is_kvpack(cache) else self.lm.attn_implementation)

    # -- forwards -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: Sequence[int] | torch.Tensor, cache: Any, logits_to_keep: int = 0) -> torch.Tensor:
        """Feed one chunk of token ids to ``cache`` (it holds the history) and return its logits.

        Args:
            ids: the chunk, ``T`` token ids.
            cache: a cache from :meth:`cache`, appended to in place.
            logits_to_keep: keep only the last ``n`` positions' logits (0: all).

        Returns:
            ``[T or n, vocab]`` float32 logits.
        """
        x = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
        self._attention_for(cache)
        kw = {self._cache_kwarg: cache}
        out = self.lm.model(input_ids=x, use_cache=True, logits_to_keep=logits_to_keep, **kw)
        return out.logits[0].float()

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> Prefilled:
        """Run ``ids`` through the full-precision model once; keep every layer's keys and values."""
        cache = self.cache(None, len(ids))
        self.forward(ids, cache, logits_to_keep=1)
        return Prefilled(list(ids), [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])

    @torch.inference_mode()
    def filled(self, pre: Prefilled, fmt: KVFormat | str | None, max_tokens: int) -> Any:
        """A fresh cache of ``fmt`` holding the prefilled document (stored as the cache stores any chunk)."""
        cache = self.cache(fmt, max_tokens)
        for layer, (k, v) in enumerate(zip(pre.keys, pre.values)):
            cache.update(k, v, layer)  # every cache copies what it stores; pre stays untouched
        return cache

    @torch.inference_mode()
    def greedy(
        self,
        cache: Any,
        chunk: Sequence[int],
        max_new_tokens: int,
        stop_at_newline: bool = True,
        keep_going: Callable[[str], bool] | None = None,
    ) -> list[int]:
        """Feed ``chunk`` against ``cache``, then decode greedily one token at a time.

        Stops at the end-of-sequence token, at a newline after some text (when ``stop_at_newline``), when
        ``keep_going(text so far)`` says the answer is decided, or after ``max_new_tokens``. Returns the ids.
        """
        eos = _eos_ids(self.lm)
        logits = self.forward(chunk, cache, logits_to_keep=1)
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(logits[-1].argmax())
            if nxt in eos:
                break
            out.append(nxt)
            if stop_at_newline or keep_going is not None:
                text = self.lm.decode(out)
                if stop_at_newline and "\n" in text.lstrip():
                    break
                if keep_going is not None and not keep_going(text):
                    break
            if len(out) == max_new_tokens:
                break
            logits = self.forward([nxt], cache, logits_to_keep=1)
        return out


def _eos_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    tok = lm.tokenizer
    for t in (getattr(tok, "eos_token_id", None), getattr(lm.model.generation_config, "eos_token_id", None)):
        if isinstance(t, int):
            ids.add(t)
        elif isinstance(t, (list, tuple)):
            ids.update(int(i) for i in t)
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tok.convert_tokens_to_ids(name) if hasattr(tok, "convert_tokens_to_ids") else None
        if isinstance(tid, int) and tid != getattr(tok, "unk_token_id", None):
            ids.add(tid)
    return ids
