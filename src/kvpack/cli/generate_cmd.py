"""``kvpack generate``: generate text with the packed cache, then say how much cache it took."""

from __future__ import annotations

import argparse

from kvpack.cli.args import fmt, int_in, real_in
from kvpack.errors import ConfigError

# tokens one call may generate: beyond this no model has positions (and the cache would not fit)
MAX_NEW_TOKENS = 1 << 20

BACKENDS = ("auto", "cpu", "triton", "reference")

EPILOG = """\
the prompt goes through the model's chat template when it has one (--raw to skip it).
examples:
  kvpack generate --prompt "Why is the sky blue?"
  kvpack generate --prompt "Summarize: ..." --format int8 --max-new-tokens 200
  kvpack generate --prompt "Once upon a time" --raw --temperature 0.8 --seed 1 --model path/to/hf-folder
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate text with a packed KV cache (embedded SmolLM2-135M by default)",
        description="Generate with transformers, the cache stored in kvpack's packed format and read by the "
        "fused decode kernel. Prints the text, then the cache bytes used against fp16.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--format", type=fmt, default="int4", help="cache format: a preset or custom string (default int4)")
    p.add_argument(
        "--model",
        help="local Hugging Face model folder, or a registered test model such as gemma3-270m "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--max-new-tokens", type=int_in(1, MAX_NEW_TOKENS), default=128, help="tokens to generate at most (default 128)"
    )
    p.add_argument(
        "--temperature", type=real_in(0.0, 100.0), default=0.0, help="sampling temperature; 0 is greedy (default 0)"
    )
    p.add_argument(
        "--top-p",
        type=real_in(0.0, 1.0, lo_open=True),
        default=None,
        help="nucleus sampling threshold (with --temperature > 0)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="decode kernel: auto, cpu, triton or reference (default auto)",
    )
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def run(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise ConfigError("--prompt is empty; give the text to continue")
    import torch

    from kvpack.cli.compile_note import compile_cpu_kernels
    from kvpack.formats import parse_format
    from kvpack.integrations.transformers import cache_for, cache_kwarg
    from kvpack.models import load_model

    fmt = parse_format(args.format)  # a bad format fails before the model loads
    model, tokenizer = load_model(args.model)
    compile_cpu_kernels(args.backend)  # a first run on this machine: say so before the kernels compile
    if not args.raw and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": args.prompt}]
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        inputs = tokenizer(args.prompt, return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    if prompt_len == 0:
        raise ConfigError("--prompt tokenizes to nothing; give the text to continue")
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_len + args.max_new_tokens > limit:
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens}: the prompt ({prompt_len} tokens) plus that many exceeds the "
            f"model's {limit} positions; give at most {max(1, limit - prompt_len)}"
        )
    cache = cache_for(model, fmt, max_tokens=prompt_len + args.max_new_tokens + 1, backend=args.backend)
    sampling = {"do_sample": False}
    if args.temperature > 0:
        sampling = {"do_sample": True, "temperature": args.temperature}
        if args.top_p is not None:
            sampling["top_p"] = args.top_p
        torch.manual_seed(args.seed)
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            **{cache_kwarg(model): cache},
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    print(tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True).strip())
    s = cache.bytes_summary()
    tokens = s["live_tokens"] // max(1, cache.num_layers)
    share = 100 * s["used_bytes"] / s["fp16_bytes"] if s["fp16_bytes"] else float("nan")
    note = ""
    if tokens < 4 * fmt.block_size and not fmt.is_passthrough:
        note = f"; short sequence: the {fmt.block_size}-token full-precision tail dominates"
    print(
        f"cache: {_human(s['used_bytes'])} used ({s['used_bytes']} bytes) vs {_human(s['fp16_bytes'])} in fp16 "
        f"({s['fp16_bytes']} bytes): {share:.0f}% of fp16 (format {fmt.name}, {tokens} tokens, tails included{note})"
    )
    return 0
