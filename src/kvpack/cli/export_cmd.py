"""``kvpack export``: calibrated scales in the layout a serving engine reads."""

from __future__ import annotations

import argparse

from kvpack.cli.args import out_dir

EPILOG = """\
vllm: fp8 e4m3 per-layer scales, model.layers.{i}.self_attn.k_scale / v_scale (float32 scalars,
scale = amax / 448), the convention of vLLM and llm-compressor checkpoints; plus kv_cache_scheme.json
(the config.json entry) and a README with the serve command. The artifact is verified first (checksums);
a broken one is refused, never replaced by default scales.
example:
  kvpack calibrate --out calib/ && kvpack export vllm --artifact calib/ --out vllm-scales/
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write calibrated KV scales in a serving engine's checkpoint layout (vllm)",
        description="Export calibrated KV-cache scales for a serving engine.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("engine", choices=["vllm"], help="target engine")
    p.add_argument("--artifact", required=True, help="calibration artifact folder (from kvpack calibrate)")
    p.add_argument("--out", type=out_dir, required=True, help="folder to write")
    p.add_argument("--range", dest="source", metavar="SOURCE", help="rope, absmax or p<P> (default: the artifact's)")


def run(args: argparse.Namespace) -> int:
    from kvpack.integrations.export import SCALES_FILE, export_vllm

    summary = export_vllm(args.artifact, args.out, source=args.source)
    k, v = summary["k_scale"], summary["v_scale"]
    print(
        f"wrote {summary['out']}/{SCALES_FILE}: {2 * summary['layers']} fp8 scales ({summary['layers']} layers, "
        f"source {summary['source']}); k_scale {min(k):.4g} .. {max(k):.4g}, v_scale {min(v):.4g} .. {max(v):.4g}"
    )
    for r in summary["reasons"]:
        print(f"note: {r}")
    print(f"see {summary['out']}/README.md to serve with vLLM")
    return 0
