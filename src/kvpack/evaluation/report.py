"""Reports: ``results.json`` (every number) and ``index.html`` (tables and plots, readable offline).

Plots are PNGs drawn with matplotlib's Agg backend and embedded as base64, so the HTML is one file that
needs no network and no other file. matplotlib is imported only here, only when a report is written; without
it the HTML has the tables and says the plots need ``pip install 'kvpack[eval]'``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from kvpack.evaluation.verdict import fmt_tokens

__all__ = ["summary_rows", "summary_table", "text_line", "write_report"]


# ----------------------------------------------------------------------------------------------------
# The summary (terminal and HTML)


def summary_rows(results: dict[str, Any]) -> list[dict[str, str]]:
    """One row per format: bits/element, cache bytes vs fp16, needle accuracy, KL, top-1, ppl, verdict."""
    rows = []
    needles = results.get("needles", {}).get("summary", {})
    fid = results.get("fidelity", {}).get("variants", {})
    spec = results.get("speculative", {})
    for name, facts in results["formats"].items():
        n = needles.get(name)
        f = fid.get(name)
        s = spec.get(name)
        rows.append(
            {
                "format": name,
                "bits/elem": f"{facts['bits_per_element']:.2f}",
                "bytes vs fp16": f"{facts['ratio_vs_fp16']:.3f}",
                "needles": f"{n['correct']}/{n['total']}" if n else "-",
                "vs fp16": (f"-{n['lost']}" if n["lost"] else "=") + (f" +{n['gained']}" if n["gained"] else "")
                if n
                else "-",
                "KL mean": f"{f['kl_mean']:.2g}" if f else "-",
                "KL p99": f"{f['kl_p99']:.2g}" if f else "-",
                "top-1": f"{100 * f['top1_agreement']:.1f}%" if f else "-",
                "ppl delta": f"{f['ppl_delta']:+.3f}" if f else "-",
                "accept": f"{100 * s['acceptance']:.0f}%" if s else "-",
                "verdict": results["verdicts"][name]["status"],
            }
        )
    return rows


def text_line(text: dict[str, Any] | None) -> str:
    """Where the haystacks and the teacher-forced text came from (``results["text"]``), in one line."""
    if not text or text.get("source") != "files":
        name = (text or {}).get("name", "pydoc_data.topics")
        return f"text: the built-in prose ({name})"
    files = ", ".join(
        f"{f['path']} ({f['tokens']:,} tokens" + (f", {f['documents']:,} documents)" if f["format"] == "jsonl" else ")")
        for f in text["files"]
    )
    return (
        f"text: {files}; {text['tokens']:,} tokens in all: the haystacks are runs of it in its own order, the "
        "teacher-forced texts windows of it"
    )


def summary_table(results: dict[str, Any]) -> str:
    """The summary as aligned plain text, followed by the verdict lines."""
    rows = summary_rows(results)
    if not rows:
        return ""
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols), "  ".join("-" * width[c] for c in cols)]
    lines += ["  ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
    lines.append("")
    lines += [v["text"] for v in results["verdicts"].values()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Plots


# a plan measured on one text whose KL is above this share of its budget is at the budget's edge
EDGE = 0.8


def plan_line(plan: dict[str, Any]) -> str:
    """The per-layer plan search in words (``results["plan"]``, :mod:`kvpack.evaluation.planner`)."""

    def texts(p: dict[str, Any]) -> str:
        k = p.get("kl_texts")
        return f" (texts {min(k):.2g}-{max(k):.2g})" if k else ""

    probes = ", ".join(f"{p['plan']} {p['bits']:.2f} bits KL {p['kl_mean']:.2g}{texts(p)}" for p in plan["probes"])
    c = plan["chosen"]
    n = plan.get("windows", 1)
    over = f" over {n} texts of {plan['tokens']:,} tokens{texts(c) if c else ''}" if n > 1 else ""
    if c is None:
        return (
            f"plan: no plan of {', '.join(plan['ladder'])} meets KL <= {plan['budget']:g}{over} (measured: {probes}); "
            "add a wider format to --plan-formats"
        )
    # one text's KL can sit well off another's (Gemma's by +-50%): a plan near its budget may not hold elsewhere
    edge = n == 1 and c["kl_mean"] > EDGE * plan["budget"]
    caution = (
        f" Measured on one text and within {100 - 100 * EDGE:.0f}% of the budget: --plan-windows 4 tells whether "
        "it holds on other text."
        if edge
        else ""
    )
    return (
        f"plan for KL <= {plan['budget']:g}: {c['plan']} ({c['bits']:.2f} bits per element, measured KL "
        f"{c['kl_mean']:.2g}{over}); use it as a format: kvpack.hf.cache_for(model, format='{c['plan']}'), "
        f"kvpack size --format '{c['plan']}'.{caution} Probes: {probes}"
    )


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plots(results: dict[str, Any]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out: dict[str, str] = {}
    formats = list(results["formats"])
    cases = results.get("needles", {}).get("cases", [])
    if cases:
        lengths = sorted({c["length"] for c in cases})
        depths = sorted({c["depth"] for c in cases})
        cols = min(4, len(formats))
        rows = math.ceil(len(formats) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
        for ax, name in zip(axes.flat, formats):
            grid = [[0.0] * len(lengths) for _ in depths]
            for i, d in enumerate(depths):
                for j, n in enumerate(lengths):
                    sel = [c["correct"][name] for c in cases if c["depth"] == d and c["length"] == n]
                    grid[i][j] = sum(sel) / len(sel) if sel else float("nan")
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            ax.set_xticks(range(len(lengths)), [fmt_tokens(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("context (tokens)", fontsize=8)
            ax.set_ylabel("depth", fontsize=8)
        for ax in list(axes.flat)[len(formats) :]:
            ax.axis("off")
        fig.suptitle("Needle accuracy (fraction of needle kinds found), per format", fontsize=10)
        fig.tight_layout()
        out["needle_heatmaps"] = _png(fig)

        base = results["config"]["baseline"]
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.5))
        for name in formats:
            acc, kept = [], []
            for n in lengths:
                sel = [c for c in cases if c["length"] == n]
                found = [c for c in sel if c["correct"].get(base)]
                acc.append(sum(c["correct"][name] for c in sel) / max(1, len(sel)))
                kept.append(sum(c["correct"][name] for c in found) / len(found) if found else float("nan"))
            ax.plot(lengths, acc, marker="o", label=name)
            ax2.plot(lengths, kept, marker="o", label=name)
        for a in (ax, ax2):
            a.set_xscale("log", base=2)
            a.set_xticks(lengths, [fmt_tokens(n) for n in lengths])
            a.minorticks_off()
            a.set_ylim(-0.05, 1.05)
            a.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle accuracy")
        ax.set_title("Needle accuracy vs context length (absolute)")
        ax2.set_title(f"Needles kept, of those {base} found")
        ax2.legend(fontsize=7, ncol=2)
        out["needle_vs_length"] = _png(fig)

    fid = results.get("fidelity", {}).get("variants", {})
    main = [n for n in formats if n in fid]
    if main:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
        for name in main:
            b = fid[name]["by_position"]
            x = [r["end"] for r in b]
            axes[0].plot(x, [max(r["kl_mean"], 1e-9) for r in b], marker="o", label=name)
            axes[1].plot(x, [100 * r["top1_agreement"] for r in b], marker="o", label=name)
            axes[2].plot(x, [r["ppl_delta"] for r in b], marker="o", label=name)
        axes[0].set_yscale("log")
        axes[0].set_title("mean KL vs full precision (nats)")
        axes[1].set_title("top-1 agreement (%)")
        axes[2].set_title("perplexity delta")
        ends = [r["end"] for r in fid[main[0]]["by_position"]]
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(ends, [fmt_tokens(e) for e in ends])
            ax.minorticks_off()
            ax.set_xlabel("position (bucket end, tokens)")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        out["fidelity_vs_position"] = _png(fig)

    attr = results.get("attribution", {})
    if attr.get("fidelity"):
        names = list(attr["fidelity"])
        fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(names)), 3.5))
        # markers on a log axis: bar heights on a log axis would depend on an arbitrary bottom
        for k, (side, marker) in enumerate((("both", "o"), ("keys_only", "^"), ("values_only", "v"))):
            vals = [max(attr["fidelity"][n].get(side, float("nan")), 1e-9) for n in names]
            ax.plot([i + (k - 1) * 0.12 for i in range(len(names))], vals, marker, ms=9, label=side.replace("_", " "))
        ax.set_xticks(range(len(names)), names)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_yscale("log")
        ax.set_ylabel("mean KL (nats)")
        ax.set_title("Keys or values? The same format on one side only")
        ax.legend(fontsize=8)
        out["attribution_kv"] = _png(fig)
    sens = attr.get("layer_sensitivity", {}).get("errors")
    if sens:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name, errs in sens.items():
            ax.plot(range(len(errs)), [max(e, 1e-9) for e in errs], marker=".", label=name)
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("relative attention-output error")
        ax.set_title("Per-layer sensitivity (one layer quantized at a time)")
        ax.legend(fontsize=7, ncol=2)
        out["layer_sensitivity"] = _png(fig)
    return out


# ----------------------------------------------------------------------------------------------------
# HTML


def _table(rows: list[dict[str, Any]], cls: str = "") -> str:
    if not rows:
        return "<p>(none)</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


_CSS = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left}
th{background:#f0f0f0}tr.fail td{background:#fde2e2}.ok{color:#176c2e}.caution{color:#9a6b00}.fails{color:#b00020}
code{background:#f4f4f4;padding:0 3px}img{max-width:100%}details{margin:1em 0}
"""


def _html(results: dict[str, Any], plots: dict[str, str], plot_note: str) -> str:
    def img(key: str, alt: str) -> str:
        return f'<p><img alt="{alt}" src="data:image/png;base64,{plots[key]}"></p>' if key in plots else ""

    cfg, model = results["config"], results["model"]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvpack eval</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>kvpack eval: {html.escape(model['name'])}</h1>",
        f"<p>{model['layers']} layers, {model['kv_heads']} kv_heads, head_dim {model['head_dim']}, "
        f"{model['parameters'] / 1e6:.0f}M parameters ({model['dtype']}); engine <code>{cfg['engine']}</code>; "
        f"seed {cfg['seed']}. The baseline is <code>{cfg['baseline']}</code>; every question is fed as a "
        "separate chunk after the document, so it reads the quantized cache.</p>",
        f"<p>{html.escape(text_line(results.get('text')))}.</p>",
        "<h2>Verdicts</h2><ul>",
    ]
    for v in results["verdicts"].values():
        parts.append(f"<li class='{v['status']}'>{html.escape(v['text'])}</li>")
    parts.append("</ul><h2>Summary</h2>")
    parts.append(_table(summary_rows(results)))
    if plot_note:
        parts.append(f"<p><em>{html.escape(plot_note)}</em></p>")

    cases = results.get("needles", {}).get("cases", [])
    if cases:
        parts.append("<h2>Needle in a haystack</h2>")
        parts.append(
            "<p>Exact match after normalisation (see <code>kvpack.evaluation.scoring</code>). Kinds: a number, an "
            "identifier, a sentence reproduced word for word, and a two-hop pair of facts half a document apart.</p>"
        )
        parts.append(img("needle_heatmaps", "needle heatmaps"))
        parts.append(img("needle_vs_length", "needle accuracy vs length"))
        rows = []
        for c in cases:
            row = {"length": c["length"], "depth": c["depth"], "kind": c["kind"], "answer": c["answer"]}
            for name, out in c["outputs"].items():
                row[name] = ("✓ " if c["correct"][name] else "✗ ") + out.strip()[:60]
            rows.append(row)
        parts.append("<details><summary>Every case and every answer</summary>" + _table(rows) + "</details>")

    fid = results.get("fidelity")
    if fid:
        parts.append("<h2>Fidelity on long text (teacher-forced)</h2>")
        parts.append(
            f"<p>{fid['tokens']} tokens of prose fed in chunks of {fid['chunk']}; reference: {fid['reference']}. "
            "KL(reference || format) per token; perplexity delta side by side: perplexity moves least.</p>"
        )
        rows = [
            {
                "variant": name,
                "KL mean": f"{v['kl_mean']:.3g}",
                "KL p99": f"{v['kl_p99']:.3g}",
                "KL max": f"{v['kl_max']:.3g}",
                "top-1": f"{100 * v['top1_agreement']:.2f}%",
                "ppl ref": f"{v['ppl_ref']:.3f}",
                "ppl": f"{v['ppl']:.3f}",
                "ppl delta": f"{v['ppl_delta']:+.4f}",
            }
            for name, v in fid["variants"].items()
        ]
        parts.append(_table(rows))
        parts.append(img("fidelity_vs_position", "fidelity vs position"))

    attr = results.get("attribution", {})
    if attr:
        parts.append("<h2>Attribution: keys or values, which layers</h2>")
        parts.append(img("attribution_kv", "keys vs values"))
        if attr.get("layer_sensitivity"):
            ls = attr["layer_sensitivity"]
            parts.append(f"<p>{html.escape(ls['metric'])}, over {ls['tokens']} tokens.</p>")
            parts.append(img("layer_sensitivity", "per-layer sensitivity"))

    if results.get("plan"):
        parts.append("<h2>Per-layer plan</h2>")
        parts.append(f"<p>{html.escape(plan_line(results['plan']))}</p>")

    spec = results.get("speculative")
    if spec:
        parts.append("<h2>Speculative decoding</h2>")
        parts.append(
            f"<p>The model drafts for itself with a full-precision cache; the target reads the format under test. "
            f"{cfg['draft_tokens']} draft tokens per verification, greedy, {cfg['speculative_tokens']} new tokens "
            f"after each of {cfg.get('speculative_prompts', 1)} prompts.</p>"
        )
        rows = [
            {
                "format": n,
                "acceptance": f"{100 * s['acceptance']:.1f}%",
                "accepted/proposed": f"{s['accepted']}/{s['proposed']}",
                "tokens per target call": f"{s['tokens_per_call']:.2f}",
                "same text as baseline": s["same_text_as_baseline"],
            }
            for n, s in spec.items()
        ]
        parts.append(_table(rows))

    facts = [
        {"format": n, **{k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in f.items()}}
        for n, f in results["formats"].items()
    ]
    parts.append("<h2>Formats and bytes</h2>" + _table(facts))
    env = [{"package": k, "version": v} for k, v in results["environment"].items()]
    parts.append("<h2>Configuration</h2><pre>" + html.escape(json.dumps(cfg, indent=1)) + "</pre>")
    parts.append("<h2>Environment</h2>" + _table(env))
    secs = results.get("run", {}).get("seconds", {})
    if secs:
        parts.append("<p>Wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in secs.items()) + "</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(results: dict[str, Any], out_dir: str | os.PathLike, plots: bool = True) -> Path:
    """Write ``results.json`` and ``index.html`` into ``out_dir`` (created); return the HTML path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    images: dict[str, str] = {}
    note = ""
    if plots:
        try:
            images = _plots(results)
        except ImportError as e:
            note = f"plots need matplotlib ({e}): pip install 'kvpack[eval]'"
    page = out / "index.html"
    page.write_text(_html(results, images, note), encoding="utf-8")
    return page
