"""Run calibration text through a model and build an artifact.

The text is real prose available offline: the topic pages of the Python documentation shipped with the
interpreter (``pydoc_data.topics``), tokenized once, cut into non-overlapping windows of ``seq_len``
tokens, of which ``samples`` are drawn by a seeded permutation (so the same seed always picks the same
windows, and ``skip`` gives held-out windows for evaluation).

transformers is imported only inside the functions that need a model.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from kvpack.calibration.artifact import Artifact
from kvpack.calibration.fingerprint import fingerprint_from_config
from kvpack.calibration.observer import KVObserver, observing_cache
from kvpack.errors import CalibrationError
from kvpack.formats import KVFormat, parse_format

__all__ = [
    "DATA_NAME",
    "DEFAULT_FORMAT",
    "calibrate",
    "calibration_text",
    "calibration_windows",
    "default_source",
    "load_model",
    "observe_model",
]

DATA_NAME = "pydoc_data.topics"
# Static per-channel int8 keys with per-token int8 values: the int8 preset with calibrated key scales.
DEFAULT_FORMAT = "k=int8:channel:sym:fp16:static,v=int8:token:sym:fp16,block=64"


def default_source(format: str | KVFormat) -> str:
    """``"rope"`` when the key spec is symmetric (the pair bound stops clipping at positions the calibration
    never reached), ``"absmax"`` when it is asymmetric (a symmetric ``[-r, r]`` range would throw away the
    per-channel offset that asymmetric int4 keys depend on: about 3x the attention error, docs/calibration.md)."""
    return "absmax" if parse_format(format).key.has_zero else "rope"


def calibration_text() -> str:
    """The calibration corpus: every pydoc topic page, in sorted topic order (about 465 kB of prose)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def calibration_windows(
    tokenizer: Any,
    samples: int,
    seq_len: int,
    seed: int = 0,
    exclude: Sequence[int] = (),
    exclude_len: int = 0,
    text: str | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Draw ``samples`` non-overlapping windows of ``seq_len`` tokens from the corpus.

    Args:
        tokenizer: anything with ``encode(text, add_special_tokens=False) -> list[int]``.
        samples, seq_len: how many windows, and their length.
        seed: the permutation that orders the candidate windows.
        exclude, exclude_len: token offsets of windows of ``exclude_len`` tokens that must not be overlapped
            (pass a calibration's ``data["offsets"]`` and ``seq_len`` to draw held-out text).
        text: another corpus (default :func:`calibration_text`).

    Returns:
        ``(input_ids, data)``: ``[samples, seq_len]`` int64, and the manifest's ``data`` entry (name,
        samples, seq_len, seed, the windows' token offsets, tokens_sha256).
    """
    if samples <= 0 or seq_len <= 0:
        raise CalibrationError(f"samples and seq_len must be positive, got {samples} and {seq_len}")
    ids = torch.tensor(tokenizer.encode(text or calibration_text(), add_special_tokens=False), dtype=torch.int64)
    n = ids.numel() // seq_len
    starts = torch.arange(n) * seq_len
    if exclude:
        ex = torch.tensor(list(exclude)).unsqueeze(1)  # overlap of [s, s+seq_len) and [e, e+exclude_len)
        clash = ((starts < ex + exclude_len) & (ex < starts + seq_len)).any(0)
        starts = starts[~clash]
    if samples > starts.numel():
        raise CalibrationError(
            f"the corpus has {starts.numel()} usable windows of {seq_len} tokens, asked for {samples}; "
            "use fewer --samples or a shorter --seq-len"
        )
    g = torch.Generator().manual_seed(seed)
    chosen = starts[torch.randperm(starts.numel(), generator=g)[:samples]]
    windows = torch.stack([ids[s : s + seq_len] for s in chosen.tolist()])
    data = {
        "name": DATA_NAME if text is None else "custom",
        "samples": samples,
        "seq_len": seq_len,
        "seed": seed,
        "offsets": chosen.tolist(),
        "tokens_sha256": hashlib.sha256(windows.numpy().tobytes()).hexdigest(),
    }
    return windows, data


@torch.no_grad()
def observe_model(model: Any, input_ids: torch.Tensor, observer: KVObserver, batch_size: int = 4) -> None:
    """Run ``input_ids`` ``[samples, seq_len]`` int64 through ``model`` (a transformers causal LM) in batches,
    feeding every layer's queries and keys (after RoPE) and values to ``observer``. Only the decoder runs (no LM
    head)."""
    from kvpack.calibration.observer import observing_attention
    from kvpack.integrations.transformers import cache_kwarg

    body = getattr(model, "base_model", model)
    key = cache_kwarg(body)
    device = next(model.parameters()).device
    restore = observing_attention(observer, model)
    try:
        for i in range(0, input_ids.shape[0], batch_size):
            batch = input_ids[i : i + batch_size].to(device)
            body(input_ids=batch, use_cache=True, **{key: observing_cache(observer, model.config)})
    finally:
        restore()


def calibrate(
    model: Any,
    tokenizer: Any,
    *,
    samples: int = 16,
    seq_len: int = 256,
    seed: int = 0,
    percentiles: Sequence[float] = (99.9, 99.99),
    format: str | KVFormat = DEFAULT_FORMAT,
    source: str | None = None,
    batch_size: int = 4,
    text: str | None = None,
    exclude: Sequence[int] = (),
    exclude_len: int = 0,
) -> Artifact:
    """Observe ``samples`` windows of calibration text and return the artifact (not yet saved).

    ``source`` picks the statistic the static scales come from: ``"rope"`` (the RoPE pair bound for keys,
    abs-max for values), ``"absmax"``, or ``"p<P>"`` (added to ``percentiles`` if missing); ``None`` means
    :func:`default_source` of the format. ``text``, ``exclude`` and ``exclude_len`` are
    :func:`calibration_windows`' (another corpus; windows of it to keep out, such as those an evaluation reads).
    """
    from kvpack.calibration.observer import parse_source

    source = source or default_source(format)
    pct = set(percentiles)
    if source not in ("absmax", "rope"):
        pct.add(parse_source(source))
    observer = KVObserver(sorted(pct))
    ids, data = calibration_windows(tokenizer, samples, seq_len, seed, exclude, exclude_len, text)
    observe_model(model, ids, observer, batch_size)
    keys, values = observer.stats()
    info = {"name_or_path": str(getattr(model.config, "name_or_path", "") or getattr(model, "name_or_path", ""))}
    fp = fingerprint_from_config(model.config)
    try:
        energy = observer.query_energy()
    except CalibrationError as e:  # some layers' queries went unseen: the artifact is made without them
        warnings.warn(f"kvpack calibrate: no query statistics recorded ({e})", stacklevel=2)
        energy = None
    return Artifact.build(keys, values, format, fp, data, source, info, query_energy=energy)


def load_model(path: str | None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in float32, eval mode, via :func:`kvpack.models.load_model` (the embedded
    SmolLM2-135M-Instruct when ``path`` is ``None``, else a local Hugging Face model folder)."""
    from kvpack.models import load_model as project_loader

    model, tok = project_loader(path)
    return model.float().eval(), tok
